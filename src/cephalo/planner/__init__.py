"""Specs + cost model -> Plan: the contract (`plan`), the plan makers (`makers`: `make_plan`,
`simple_plan`, `manual_plan`), the baselines, shard groups (`shard_groups`, `group_split`),
why nothing fits (`does_not_fit`), and the search itself (`search/`).

Import from the submodules; this package imports nothing itself."""
