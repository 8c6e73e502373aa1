"""Autograd helpers shared by the engine and the profiler, which replays the engine's backward
(`profiling/measure.py`) and must charge the same transient bytes and drain gradients alike."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from cephalo.runtime.memory import ACTIVATIONS, MemoryLedger


def drain_grad(dst: torch.Tensor, leaf: torch.Tensor) -> None:
    """Post-accumulate hook: add a parameter's fresh gradient into its fp32 slot, free it."""
    dst.add_(leaf.grad.reshape(-1))
    leaf.grad = None


def largest_grad_bytes(leaves, dtype: torch.dtype) -> int:
    """Bytes of the largest parameter gradient autograd produces for `leaves` (compute dtype),
    each drained by its hook as it is produced (`held_grad_bytes`)."""
    return max((v.numel() for v in leaves), default=0) * dtype.itemsize


@dataclass
class LeafDrain:
    """A unit's parameter leaves whose gradients are drained together, once per backward
    (`drain_together`), instead of one post-accumulate hook and one add per parameter: about
    a dozen ops per block and micro-batch become one or two (issue 39). Autograd leaves each
    leaf's gradient in `.grad` (the first one stolen, not copied); they all live until the
    drain, which the ledger charges (`held_grad_bytes`)."""

    names: list[str]
    leaves: list[torch.Tensor]
    dsts: list[list[torch.Tensor]]
    """Each leaf's fp32 destination: 1-D pieces, in order (one, but where a padded buffer's
    padding splits the parameter, runtime/collectives/padded.py)."""
    region: torch.Tensor | None = None
    """The fp32 slice the destinations tile in order, where they do (a unit's own slots): in
    a narrower compute dtype the gradients are concatenated and added to it at once (a
    mixed-dtype foreach add is a kernel per tensor on CUDA)."""
    accumulate: bool = False
    """The destinations are zeroed (a padded buffer): every gradient is added, none copied."""
    partial: bool = False
    """A leaf got no gradient in this backward: drained leaf by leaf from then on."""

    def __post_init__(self) -> None:
        self.flat_dsts = [d for ds in self.dsts for d in ds]
        split = len(self.flat_dsts) != len(self.dsts)
        self.sizes = [[d.numel() for d in ds] for ds in self.dsts] if split else None
        """Per leaf, the sizes of its pieces (None: one piece each)."""

    def concatenates(self) -> bool:
        """Whether the drain concatenates the gradients first (a transient of their size)."""
        return (
            self.region is not None
            and bool(self.leaves)
            and self.leaves[0].dtype != self.region.dtype
        )


def drain_together(drain: LeafDrain, written: set[str]) -> None:
    """Add the leaves' gradients into their fp32 destinations (copy them where nothing was
    written yet: the buffers are not zeroed, `drain_first`), then free them. One foreach op
    in fp32, a concatenation and one add in a narrower compute dtype. Once a leaf got no
    gradient (a parameter the forward did not use), this backward drains leaf by leaf.
    No generator expressions: this runs per unit and micro-batch (its Python calls count)."""
    grads = [leaf.grad for leaf in drain.leaves]
    if not grads:
        return
    if drain.partial or [g for g in grads if g is None]:
        drain.partial = True
        for name, leaf, dsts, g in zip(drain.names, drain.leaves, drain.dsts, grads, strict=True):
            if g is None:
                continue
            if drain.accumulate:
                drain_grad_pieces(dsts, leaf)
            else:
                drain_first(written, name, dsts[0], leaf)
        return
    first = not drain.accumulate and drain.names[0] not in written  # (all or none: not partial)
    if drain.concatenates():
        assert drain.region is not None
        flat = torch.cat([g.reshape(-1) for g in grads])
        if first:
            drain.region.copy_(flat)
        else:
            drain.region.add_(flat)
        del flat
    else:
        if drain.sizes is None:
            flat_grads = [g.reshape(-1) for g in grads]
        else:
            flat_grads = [
                p
                for g, sizes in zip(grads, drain.sizes, strict=True)
                for p in g.reshape(-1).split(sizes)
            ]
        if first:
            torch._foreach_copy_(drain.flat_dsts, flat_grads)
        else:
            torch._foreach_add_(drain.flat_dsts, flat_grads)
        del flat_grads
    del grads
    if first:
        written.update(drain.names)
    for leaf in drain.leaves:
        leaf.grad = None


def held_grad_bytes(
    drain: LeafDrain | None, hooked: Iterable[torch.Tensor], dtype: torch.dtype
) -> int:
    """Bytes of parameter gradients in compute dtype a backward holds at once: every drained
    leaf's until `drain_together` (twice that where it concatenates them) plus the largest
    of the leaves drained by their own hooks (as they are produced): the parameter side of a
    backward's transient gradients (`BackwardCharges.transient`)."""
    together = 0
    if drain is not None:
        together = sum(v.numel() for v in drain.leaves) * dtype.itemsize
        if drain.concatenates():
            together *= 2
    return together + largest_grad_bytes(hooked, dtype)


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
