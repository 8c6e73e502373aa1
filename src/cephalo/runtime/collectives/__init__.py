"""Collectives: the uneven all-gather / reduce-scatter / all-reduce (`comm`), process groups
(`dist`), padded-even collectives (`padded`) and the all-reduce between shard groups
(`shard_groups`)."""
