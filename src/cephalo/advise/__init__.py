"""The advisor: which cluster to rent or buy (the Pareto frontier of price vs throughput over
the offers, `advisor`), with its bound (`bound`, `partial`), its clusters (`clusters`) and what
it answers (`results`)."""
