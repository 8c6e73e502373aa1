"""The cost model: every formula of time and memory, once (`model.CostModel`), by concept:
collectives, shard groups, host memory, the parameter layouts, the rules the runtime shares
(`rules`: where the fused tail runs, where collectives are padded even), what it answers
(`results`), and the sources it is built from (`sources`: catalog, profiles, measurements).

Import from the submodules; this package imports nothing itself."""
