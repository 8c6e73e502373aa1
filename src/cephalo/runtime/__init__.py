"""One rank's sharded data-parallel runtime: the engine and its parts (`engine/`), the
collectives and process groups (`collectives/`), the training state and its optimizers
(`state/`), and the mechanisms they share: the memory ledger (`memory`, `live_bytes`),
plan-invariant dropout (`dropout`), the emulated slow device (`emulation`), the boundary store
(`boundary`), the head's chunked loss (`head_loss`), module binding (`bind`), autograd helpers
(`autograd`) and where a step's time goes (`step_timing`)."""
