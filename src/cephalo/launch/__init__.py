"""Local processes: the elastic launcher of `cephalo run` (`elastic`), the rank pool that
runs functions on local gloo ranks (`pool`), and one-shot local ranks (`ranks`)."""
