"""Autograd helpers shared by the engine and the profiler, which replays the engine's backward
(`profiling/measure.py`) and must charge the same transient bytes and drain gradients alike."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from cephalo.runtime.memory import ACTIVATIONS, MemoryLedger


def drain_grad(dst: torch.Tensor, leaf: torch.Tensor) -> None:
    """Post-accumulate hook: add a parameter's fresh gradient into its fp32 slot, free it."""
    dst.add_(leaf.grad.reshape(-1))
    leaf.grad = None


def largest_grad_bytes(leaves, dtype: torch.dtype) -> int:
    """Bytes of the largest parameter gradient autograd produces for `leaves` (compute dtype):
    the parameter side of a backward's transient gradients (`BackwardCharges.transient`)."""
    return max((v.numel() for v in leaves), default=0) * dtype.itemsize


def drain_first(written: set[str], name: str, dst: torch.Tensor, leaf: torch.Tensor) -> None:
    """`drain_grad` into an unzeroed slot: the first gradient of `name` in this backward is
    copied in, later ones added (`UnitCollectives.start_reduces` zeroes the slots no gradient
    reached)."""
    if name in written:
        dst.add_(leaf.grad.reshape(-1))
    else:
        dst.copy_(leaf.grad.reshape(-1))
        written.add(name)
    leaf.grad = None


def drain_grad_pieces(dsts: list[torch.Tensor], leaf: torch.Tensor) -> None:
    """`drain_grad` into consecutive pieces (a parameter split by a padded buffer's padding)."""
    grad, at = leaf.grad.reshape(-1), 0
    for dst in dsts:
        dst.add_(grad[at : at + dst.numel()])
        at += dst.numel()
    leaf.grad = None


_COMPILED_NODE = "CompiledFunctionBackward"
"""torch.compile's backward node: its saved tensors are `saved_tensors`, not `_saved_*`."""

_ALL_AT_ONCE = frozenset({_COMPILED_NODE, "GraphedBackward"})
"""Backward nodes of a compiled block (torch.compile's; `make_graphed_callables`' CUDA graph):
they return every parameter gradient of the block together."""


def compiled_grad_bytes(root) -> int:
    """Bytes of the parameter gradients a compiled block's backward returns together
    (runtime/capture/): the leaves its node feeds; 0 for an eager graph, whose gradients
    arrive (and drain) one at a time. The parameter side of the transient gradients
    (`BackwardCharges.transient`, the profiler's `UnitBench`) is then this, not the largest."""
    total, seen, stack = 0, set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ in _ALL_AT_ONCE:
            for fn, _ in node.next_functions:
                if type(fn).__name__ == "AccumulateGrad":
                    total += fn.variable.numel() * fn.variable.element_size()
        stack.extend(fn for fn, _ in node.next_functions)
    return total


_SAVED_ATTRS: dict[type, tuple[str, ...]] = {}
"""Names of the saved-tensor attributes of each autograd node type (dir() is slow)."""


def largest_saved_bytes(root, ledger: MemoryLedger) -> int:
    """Largest storage any node of the autograd graph under `root` saved for backward
    (ledger buffers, i.e. gathered parameters and boundaries, excluded): the transient bytes
    a unit's backward holds beyond what the ledger allocated."""
    largest, seen, stack = 0, set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        attrs = _SAVED_ATTRS.get(type(node))
        if attrs is None:
            attrs = _SAVED_ATTRS[type(node)] = tuple(
                a for a in dir(node) if a.startswith("_saved_")
            )
        values = [getattr(node, attr) for attr in attrs]
        if type(node).__name__ == _COMPILED_NODE:
            values = node.saved_tensors  # a compiled block (runtime/capture/) saves them here
        for value in values:
            if isinstance(value, torch.Tensor) and value.numel() and not ledger.owns(value):
                largest = max(largest, value.untyped_storage().nbytes())
        stack.extend(fn for fn, _ in node.next_functions)
    return largest


class BackwardCharges:
    """What the ledger charges for one unit's recompute + backward, measured once per key
    and charged as measured afterwards (no per-call graph walk, no saved-tensor hooks).

    The key is (unit index, micro-batch shape, ...): the same graph over tensors of the same
    shapes saves the same bytes. The first call of a key runs under the ledger's exact
    `track_activations` and walks the graph (`largest_saved_bytes`); later calls charge the
    recorded activation bytes before the forward and release them after the backward. The
    peak is the same: saved tensors are all alive at the end of the forward, which is where
    the transient gradients are charged too. `exact=True` measures every call (tests)."""

    def __init__(self, ledger: MemoryLedger, exact: bool = False):
        self.ledger = ledger
        self.exact = exact
        self._base = 0
        self._known: dict[tuple, tuple[int, int, int]] = {}
        """key -> (activation bytes saved by the forward, largest saved storage, parameter
        gradients a compiled block returns together: `compiled_grad_bytes`)."""

    def known(self, key: tuple) -> bool:
        return not self.exact and key in self._known

    @contextmanager
    def activations(self, key: tuple) -> Iterator[None]:
        """Around the graph-building forward and its backward."""
        ledger = self.ledger
        if self.known(key):
            nbytes = self._known[key][0]
            ledger.charge(ACTIVATIONS, nbytes)
            try:
                yield
            finally:
                ledger.release(ACTIVATIONS, nbytes)
            return
        self._base = ledger.current_by_category.get(ACTIVATIONS, 0)
        with ledger.track_activations():
            yield

    def transient(self, key: tuple, out: torch.Tensor, param_grad: int) -> int:
        """Bytes of autograd's transient gradients to charge before `out`'s backward (call
        inside `activations(key)`, after the forward): the largest saved storage plus the
        larger of it and the largest parameter gradient (see the engine)."""
        if self.known(key):
            _, saved, together = self._known[key]
        else:
            saved = largest_saved_bytes(out.grad_fn, self.ledger)
            together = compiled_grad_bytes(out.grad_fn)
            held = self.ledger.current_by_category.get(ACTIVATIONS, 0) - self._base
            self._known[key] = (held, saved, together)
        return saved + max(saved, param_grad, together)
