"""Graph capture and compilation of the engine's blocks (`parallel.compile`, issue 39): one
explicit step, `apply_compile`, gives the engine's unit runner a `CompiledBlocks` that runs
every block of a type through one compiled callable (`inductor`: torch.compile) or through
CUDA graphs captured per micro-batch shape (`graphs`); the embedding and the head stay eager.
Dropout masks are drawn outside the compiled code and passed in (`masks`), so compiled and
eager runs, forwards and recomputes draw the same plan-invariant masks."""
