"""The engine's head pass: the head's loss and backward in one pass at the end of the forward,
one micro-batch at a time, over chunks of the sequence (runtime/engine/head_loss.py). `HeadPass` is a
part of `Engine` (runtime/engine/engine.py): the attributes it declares are the engine's."""

from __future__ import annotations

from collections.abc import Callable

import torch

from cephalo.runtime.engine import head_loss
from cephalo.runtime.engine.autograd import BackwardCharges, largest_grad_bytes
from cephalo.runtime.engine.bind import UnitBinding
from cephalo.runtime.engine.boundary import BoundaryStore
from cephalo.runtime.engine.unit_comm import Reduce
from cephalo.runtime.engine.unit_shard import MicroBatch, UnitShard
from cephalo.runtime.memory import MemoryLedger


class HeadPass:
    """The head's one pass of loss and backward (an `Engine` part)."""

    ledger: MemoryLedger
    device: torch.device
    dtype: torch.dtype
    overlap_reduce: bool
    _charges: BackwardCharges
    _vocab: int
    _head_reducing: list[Reduce]
    _binding: Callable[[UnitShard], UnitBinding]

    def _head_fn(self, us: UnitShard, params: dict[str, torch.Tensor]) -> head_loss.RunHead:
        return lambda h, labels: self._binding(us)(params, (h, labels))

    def _head_pass(
        self,
        us: UnitShard,
        params: dict[str, torch.Tensor],
        mbs: list[MicroBatch],
        store: BoundaryStore,
        head_grad: float,
    ) -> torch.Tensor:
        """The head's loss and backward in one pass at the end of the forward
        (runtime/engine/head_loss.py): its gradient buffers filled, its input gradients stored in its
        inputs' place, its reduce-scatters started (finished during the last block's backward,
        `_backward_pass`). Returns the loss sum."""
        grads = self._grad_buffers(us)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for j, mb in enumerate(mbs):
            mb.rng[us.index] = self._save_rng()
            loss_sum += self._backward_micro_batch(us, params, mb, j, store, head_grad, grads)
        grads.done_with_leaves()  # (the caller releases the head's parameters)
        self._head_reducing = self._start_reduces(us, grads)
        if not self.overlap_reduce:
            for r in self._head_reducing:
                self._finish_reduce(r)
            self._head_reducing = []
        return loss_sum

    def _head_micro_batch(self, us, leaves, params, mb, j, store, out_grad, key) -> torch.Tensor:
        """The head over one micro-batch, chunk by chunk (runtime/engine/head_loss.py): loss sum
        returned, input gradient stored in the input's place."""
        param_grad = largest_grad_bytes(leaves.values(), self.dtype)
        charged = [0]

        def on_chunk(out: torch.Tensor) -> None:  # this chunk's transient gradients
            self.ledger.release("grad_transient", charged[0])
            charged[0] = self._charges.transient(key, out, param_grad)
            self.ledger.charge("grad_transient", charged[0])

        u = us.index
        run = self._head_fn(us, {**params, **leaves})
        with self._unit_input(store, u, j, mb) as x_in:
            self._restore_rng(mb.rng[u])
            with self._charges.activations(key), self._dropout(us, mb):
                loss, dx = head_loss.loss_and_backward(
                    run,
                    x_in,
                    mb.labels,
                    self._vocab,
                    out_grad,
                    list(leaves.values()),
                    u > 0,
                    on_chunk,
                )
            self.ledger.release("grad_transient", charged[0])
        if u > 0:
            store.put((u, j), dx)  # replaces the input: the last block's output gradient
        return loss
