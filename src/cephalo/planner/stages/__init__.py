"""Pipeline stages chosen by the planner (issue 40): the DP over cut points (`cuts`) and the
search over stage counts, node formations, micro-batch counts and schedules (`search`).
The runtime runs the plans (runtime/pipeline/)."""
