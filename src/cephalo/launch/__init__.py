"""Local processes and their signals: the elastic launcher of `cephalo run` (`elastic`), the
rank pool that runs functions on local gloo ranks (`pool`), one-shot local ranks (`ranks`),
and the stop signals a job saves and exits on (`preempt`)."""
