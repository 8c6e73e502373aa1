"""A unit's backward: its trained parameters as autograd leaves draining into the fp32
gradient buffer (`leaves`), its forward with a graph charged as its backward holds it
(`unit_graph`: the recompute, and the fused tail's last block, runtime/engine/tail_pass.py), and the
recompute + backward of one block's micro-batch (`micro_batch`; the head's is
runtime/engine/head_pass.py's). `UnitBackward` is a part the engine's passes hold; it is given what
it uses."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from cephalo.runtime.autograd import (
    BackwardCharges,
    LeafDrain,
    drain_first,
    drain_together,
    held_grad_bytes,
)
from cephalo.runtime.boundary import BoundaryStore
from cephalo.runtime.engine.unit_comm import UnitGrads
from cephalo.runtime.engine.unit_run import UnitRunner
from cephalo.runtime.memory import MemoryLedger
from cephalo.runtime.state.frozen import FrozenBase
from cephalo.runtime.state.unit_shard import MicroBatch, UnitShard


def graph_key(u: int, mb: MicroBatch, store: BoundaryStore) -> tuple:
    """What a unit's graph over one micro-batch saves depends on: `BackwardCharges`' key."""
    return (u, tuple(mb.input_ids.shape), mb.position_ids is None, store.offload)


class UnitBackward:
    """Recompute and backward of a unit, one micro-batch at a time. Owns nothing across
    calls (the leaves live in the caller's `UnitGrads`). Given the ledger (transient gradients
    are charged to it), the compute dtype, the frozen base (its parameters are no leaves), the
    activation charges measured once per graph (`BackwardCharges`) and the unit runner."""

    def __init__(
        self,
        ledger: MemoryLedger,
        dtype: torch.dtype,
        frozen: FrozenBase | None,
        charges: BackwardCharges,
        runner: UnitRunner,
    ):
        self.ledger = ledger
        self.dtype = dtype
        self.frozen = frozen
        self.charges = charges
        self.runner = runner

    @contextlib.contextmanager
    def unit_graph(
        self,
        us: UnitShard,
        params: dict[str, torch.Tensor],
        leaves: dict[str, torch.Tensor],
        x: torch.Tensor,
        mb: MicroBatch,
        key: tuple,
        grads: UnitGrads,
    ) -> Iterator[torch.Tensor]:
        """Unit `us`'s forward on `x` with a graph over its trained parameters `leaves`, its
        saved activations and autograd's transient gradients charged as its backward holds
        them; yields the output, whose backward the caller runs inside (the recompute of
        `micro_batch`, the fused tail's last block, runtime/engine/tail_pass.py)."""
        param_grad = self.grad_bytes(grads)
        with self.charges.activations(key):
            with torch.enable_grad():
                out = self.runner.run(us, {**params, **leaves}, x, mb)
            # Autograd's transient gradients are not saved tensors, so the ledger does not
            # see them. At a backward's peak, the gradient w.r.t. the largest saved tensor
            # coexists with the gradient it produces (the head: d log-probs and d logits,
            # each the size of the saved log-probs) or with a parameter's gradient: charge
            # the larger (runtime/autograd.py, measured once per key).
            transient = self.charges.transient(key, out, param_grad)
            self.ledger.charge("grad_transient", transient)
            yield out
            del out
        self.ledger.release("grad_transient", transient)

    def leaves(
        self, us: UnitShard, params: dict[str, torch.Tensor], grads: UnitGrads
    ) -> dict[str, torch.Tensor]:
        """The unit's trained parameters as autograd leaves. Its own slots' gradients are
        drained together after each backward into the fp32 accumulation buffer (`drain`:
        one or two ops per unit and micro-batch, runtime/autograd.py `drain_together`); a
        borrowed tied parameter's by a post-accumulate hook, as autograd produces it. The buffers are not zeroed: the first gradient of a slot is
        copied in (`grads.written`: the slots written so far; a padded buffer is zeroed and
        added to, its pieces around the padding). Made once per unit backward
        (`grads.leaves`): every micro-batch's backward drains through the same leaves."""
        if grads.leaves is not None:
            return grads.leaves
        frozen = self.frozen.names(us.index) if self.frozen else ()
        leaves = {n: v.detach().requires_grad_() for n, v in params.items() if n not in frozen}
        acc, written = grads.acc, grads.written
        borrowed = {b.name: t for b, t in zip(us.borrows, grads.tied, strict=True)}
        together: list[tuple[int, str, torch.Tensor]] = []
        for name, leaf in leaves.items():
            if name in borrowed:
                hook = functools.partial(drain_first, written, name, borrowed[name])
                leaf.register_post_accumulate_grad_hook(hook)
            elif name in grads.foreign:  # owned in another stage (runtime/pipeline/tie.py)
                buf, seen = grads.foreign[name]
                leaf.register_post_accumulate_grad_hook(
                    functools.partial(drain_first, seen, name, buf)
                )
            else:
                together.append((us.layout.slot(name).offset, name, leaf))
        if together:
            together.sort(key=lambda t: t[0])
            slots = [us.layout.slot(name) for _, name, _ in together]
            if us.padded is None:
                dsts = [[acc[s.offset : s.end]] for s in slots]
                tiles = all(a.end == b.offset for a, b in zip(slots, slots[1:], strict=False))
                region = acc[slots[0].offset : slots[-1].end] if tiles else None
            else:  # the padded gradient buffer, zeroed (runtime/collectives/padded.py)
                dsts = [us.padded.slices(acc, s.offset, s.end) for s in slots]
                region = None
            grads.drain = LeafDrain(
                [name for _, name, _ in together],
                [leaf for _, _, leaf in together],
                dsts,
                region,
                accumulate=us.padded is not None,
            )
        grads.leaves = leaves
        return leaves

    def hooked(self, grads: UnitGrads) -> list[torch.Tensor]:
        """The leaves drained by their own hooks (not by `drain`)."""
        together = {id(v) for v in grads.drain.leaves} if grads.drain else set()
        return [v for v in (grads.leaves or {}).values() if id(v) not in together]

    def grad_bytes(self, grads: UnitGrads) -> int:
        """The parameter gradients a backward of this unit holds at once (compute dtype)."""
        return held_grad_bytes(grads.drain, self.hooked(grads), self.dtype)

    @staticmethod
    def drain(grads: UnitGrads) -> None:
        """After a backward through the unit's leaves: their gradients into the buffer."""
        if grads.drain is not None:
            drain_together(grads.drain, grads.written)

    def micro_batch(
        self,
        us: UnitShard,
        params: dict[str, torch.Tensor],
        mb: MicroBatch,
        j: int,
        store: BoundaryStore,
        grads: UnitGrads,
    ) -> None:
        """Micro-batch j of block u: its recompute with a graph (the random generators as its
        forward left them) and its backward from the output gradient stored at (u + 1, j); the
        input gradient replaces the input at (u, j)."""
        u = us.index
        leaves = self.leaves(us, params, grads)
        key = graph_key(u, mb, store)
        with self.runner.unit_input(store, u, j, mb) as x_in:
            x = x_in if u == 0 else x_in.detach().requires_grad_()
            self.runner.restore_rng(mb.rng[u])
            with (
                # its copy runs beside the recompute: waited for only by the backward
                store.loaded((u + 1, j), deferred=True) as gout,
                self.unit_graph(us, params, leaves, x, mb, key, grads) as out,
                torch.enable_grad(),
            ):
                inputs = ([x] if u > 0 else []) + list(leaves.values())
                store.ready(gout)
                torch.autograd.backward(out, grad_tensors=gout, inputs=inputs)
                del out
                self.drain(grads)
            store.drop((u + 1, j))  # the output gradient is consumed
            if u > 0:
                store.put((u, j), x.grad)  # replaces the input: unit u-1's output gradient
                x.grad = None
