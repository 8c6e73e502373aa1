"""The sharded engine of one rank: `engine.Engine` (LGA and standard schedules) and its parts,
each in its own module: the unit shards, the unit collectives, the unit backward, the head
pass and the fused tail, the boundary store, the head's chunked loss, module binding,
autograd helpers, the step's timing and its config (`config.EngineConfig`)."""
