"""Compiled blocks on an emulated device whose memory is counted byte by byte
(runtime/device_memory.py's `EmulatedDeviceMemory`, a dispatch mode).

Why this exists: inductor's compiled code allocates its buffers below the dispatcher
(`empty_strided_cpu`), so the mode that counts every CPU storage an op makes sees none of a
compiled call's activations, outputs or gradients: an emulated rank would fit plans a GPU
cannot run. So a compiled call is charged from outside, honestly:

- what it leaves alive: its outputs and what its backward saved (`count`, right after the
  call), and the gradients its backward returns (a post-hook on its backward node);
- what it holds inside for a moment: the transient peak above the live bytes at the start,
  of the forward and of the backward, as the EAGER call of the same key measured it (the
  first call of each key runs eagerly under a measuring window, `CountedCalls.eager`). Eager
  is taken as the bound: inductor fuses pointwise chains (their intermediates never exist)
  and reuses dead buffers, so its internal peak is at most about the eager graph's; what it
  may choose differently, the saved tensors and outputs, is counted exactly, as above. A
  compiled call is charged that transient before it runs (`charge_transient`): past the
  budget it fails as the eager one would.

Without an active `EmulatedDeviceMemory` (a GPU, `CEPHALO_STRICT_MEMORY=0`) nothing here runs.
The blocks are the only code the engine compiles: other code compiled under the mode (none
today) would go uncounted the same way and needs the same charge.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cephalo.runtime.device_memory import EmulatedDeviceMemory

_COMPILED_NODE = "CompiledFunctionBackward"
"""torch.compile's backward node (runtime/autograd.py reads its saved tensors too)."""


def _compiled_node(out: torch.Tensor):
    """The compiled call's backward node behind `out` (its outputs may be views of the
    compiled function's: a few nodes down at most), or None."""
    stack, seen = [out.grad_fn], 0
    while stack and seen < 8:
        node = stack.pop(0)
        seen += 1
        if node is None:
            continue
        if type(node).__name__ == _COMPILED_NODE:
            return node
        stack.extend(fn for fn, _ in node.next_functions)
    return None


class CountedCalls:
    """Per call key (block type, input shape and dtype, train / eval, grad mode): the eager
    call's transient peaks, forward and backward (see the module docstring)."""

    def __init__(self) -> None:
        self.forward: dict[tuple, int] = {}
        """key -> bytes the eager forward rose above its start (outputs included)."""
        self.backward: dict[tuple, int] = {}
        """key -> bytes the eager backward rose above its start (gradients included)."""

    def measured(self, key: tuple) -> bool:
        return key in self.forward

    def eager(
        self,
        mode: EmulatedDeviceMemory,
        key: tuple,
        call: Callable[[], torch.Tensor],
        inputs: list[torch.Tensor],
    ) -> torch.Tensor:
        """`call()` (the eager block) with its forward's and backward's peaks measured; the
        backward's from the first node of its graph to the last gradient of `inputs`."""
        window = mode.open_window()
        try:
            out = call()
        finally:
            self.forward[key] = mode.close_window(window)
        self.backward.setdefault(key, 0)
        if out.grad_fn is None:
            return out
        grads = [t for t in inputs if t.requires_grad]
        opened: list[list[int]] = []

        def start(_grad_outputs):
            opened.append(mode.open_window())

        def end(_grads) -> None:
            if opened:
                nbytes = mode.close_window(opened.pop())
                self.backward[key] = max(self.backward[key], nbytes)

        out.grad_fn.register_prehook(start)
        if grads:
            torch.autograd.graph.register_multi_grad_hook(grads, end, mode="all")
        return out

    def compiled(
        self, mode: EmulatedDeviceMemory, key: tuple, call: Callable[[], torch.Tensor], what: str
    ) -> torch.Tensor:
        """`call()` (the compiled block) charged its eager twin's transient before it runs,
        its outputs and saved tensors after, its backward's transient and gradients when the
        backward runs."""
        mode.charge_transient(self.forward[key], f"{what}: the compiled forward's buffers")
        out = call()
        mode.count([out])
        node = _compiled_node(out) if out.grad_fn is not None else None
        if node is None:
            return out
        mode.count(list(node.saved_tensors))
        backward = self.backward[key]

        def before(_grad_outputs):
            mode.charge_transient(backward, f"{what}: the compiled backward's buffers")

        def after(grad_inputs, _grad_outputs):
            mode.count([g for g in grad_inputs if g is not None])

        node.register_prehook(before)
        node.register_hook(after)
        return out
