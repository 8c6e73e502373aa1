"""The fused tail (costmodel/rules.py says where and why): at the end of the forward, per
micro-batch, the last block's forward with a graph, the head's loss and backward
(runtime/engine/head_pass.py), then the last block's backward, so the last block is neither recomputed
nor gathered again. `TailPass` is a part of `Engine` (runtime/engine/engine.py): the attributes it
declares are the engine's."""

from __future__ import annotations

from collections.abc import Callable

import torch

from cephalo.runtime.engine.boundary import BoundaryStore
from cephalo.runtime.engine.unit_comm import Gathered, Reduce, UnitGrads
from cephalo.runtime.engine.unit_shard import MicroBatch, UnitShard
from cephalo.runtime.memory import MemoryLedger


class TailPass:
    """The last block and the head in one pass (an `Engine` part)."""

    ledger: MemoryLedger
    device: torch.device
    dtype: torch.dtype
    shards: list[UnitShard]
    _head_reducing: list[Reduce]
    _tail_reducing: list[Reduce] | None
    _backward_prefetch: Gathered | None
    _leaves: Callable
    _unit_graph: Callable
    _unit_input: Callable
    _backward_micro_batch: Callable

    def _tail_pass(
        self,
        block: UnitShard,
        block_gathered: Gathered,
        block_params: dict[str, torch.Tensor],
        head: UnitShard,
        head_gathered: Gathered,
        head_params: dict[str, torch.Tensor],
        mbs: list[MicroBatch],
        store: BoundaryStore,
        head_grad: float,
    ) -> torch.Tensor:
        """Per micro-batch: the last block's forward with a graph (its saved activations and
        transient gradients charged as its backward would), its output stored as the head's
        input for this micro-batch only, the head's loss and backward (the output gradient
        stored in that input's place), the last block's backward (the input gradient stored in
        its input's place). After the head's last micro-batch, the head is released, its
        reduce-scatters start and the previous block's gather is prefetched, beside the last
        block's last backward. Both gathered units are released here; the last block's
        reduce-scatters are left in flight for the backward (`_tail_reducing`). Returns the
        loss sum."""
        u, h = block.index, head.index
        grads = self._grad_buffers(block)
        head_grads = self._grad_buffers(head)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        head_open = True
        for j, mb in enumerate(mbs):
            leaves = self._leaves(block, block_params, grads)
            key = (u, tuple(mb.input_ids.shape), mb.position_ids is None, store.offload)
            with self._unit_input(store, u, j, mb) as x_in:
                x = x_in.detach().requires_grad_()
                # charged as the unfused backward charges them, before its backward: the
                # head's pass then runs on top of them (the cost model's `tail_head`)
                with self._unit_graph(block, block_params, leaves, x, mb, key) as out:
                    store.put((h, j), out)  # the head's input, this micro-batch only
                    mb.rng[h] = self._save_rng()
                    loss_sum += self._backward_micro_batch(
                        head, head_params, mb, j, store, head_grad, head_grads
                    )
                    if j == len(mbs) - 1:
                        self._close_head(head, head_gathered, head_grads)
                        head_open = False
                    with store.loaded((h, j)) as gout, torch.enable_grad():
                        torch.autograd.backward(
                            out, grad_tensors=gout, inputs=[x, *leaves.values()]
                        )
                    del out
                store.drop((h, j))  # the output gradient is consumed
                store.put((u, j), x.grad)  # replaces the input: the previous unit's output gradient
                x.grad = None
        if head_open:  # no micro-batch on this rank
            self._close_head(head, head_gathered, head_grads)
        grads.done_with_leaves()
        self._release(block_gathered)
        self._tail_reducing = self._start_reduces(block, grads)
        return loss_sum

    def _close_head(self, head: UnitShard, gathered: Gathered, grads: UnitGrads) -> None:
        """The head's gradient is complete: release its gathered parameters, start its
        reduce-scatters (finished before the previous block's backward, `_backward_pass`) and
        prefetch the previous block for the backward."""
        grads.done_with_leaves()
        self._release(gathered)
        self._head_reducing = self._start_reduces(head, grads)
        before = head.index - 2
        if self.config.prefetch and self._backward_gathers(before):
            self._backward_prefetch = self._start_gather(self.shards[before], async_op=True)
