"""The sharded engine of one rank (`engine.Engine`: LGA and standard schedules), composed of
parts that each own what they are given: the set-up functions (`setup`), the unit runner
(`unit_run`), the unit collectives (`unit_comm`), the unit backward, the head pass and the
fused tail, the forward and backward passes (`step_passes`) and the per-step state they pass
(`step_state`), the shard update (`shard_update`), the step's clock (`step_clock`), and the
engine's config (`config.EngineConfig`)."""
