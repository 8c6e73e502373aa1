"""Plain values the planner is told (no torch): the model's shape, the cluster, device
profiles and the catalog of published GPU measurements."""
