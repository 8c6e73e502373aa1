"""The fused tail (costmodel/rules.py says where and why): at the end of the forward, per
micro-batch, the last block's forward with a graph, the head's loss and backward
(runtime/engine/head_pass.py), then the last block's backward, so the last block is neither recomputed
nor gathered again. `TailPass` is a part the engine's passes (runtime/engine/step_passes.py) hold; it
is given what it uses."""

from __future__ import annotations

import torch

from cephalo.runtime.boundary import BoundaryStore
from cephalo.runtime.engine.head_pass import HeadPass
from cephalo.runtime.engine.step_state import StepState
from cephalo.runtime.engine.unit_backward import UnitBackward, graph_key
from cephalo.runtime.engine.unit_comm import Gathered, UnitCollectives, UnitGrads
from cephalo.runtime.engine.unit_run import UnitRunner
from cephalo.runtime.state.unit_shard import MicroBatch, UnitShard, backward_gathers


class TailPass:
    """The last block and the head in one pass. Owns nothing across steps: what it leaves in
    flight for the backward (both units' reduce-scatters, the next block's gather) goes into
    the step's `StepState`. Given the compute device, the unit shards (to prefetch the block
    before the last), the unit collectives, the unit backward (the last block's graph), the
    head pass (the head's micro-batches), the unit runner, and whether gathers are prefetched
    (`EngineConfig.prefetch`)."""

    def __init__(
        self,
        device: torch.device,
        shards: list[UnitShard],
        collectives: UnitCollectives,
        unit_backward: UnitBackward,
        head: HeadPass,
        runner: UnitRunner,
        prefetch: bool,
    ):
        self.device = device
        self.shards = shards
        self.collectives = collectives
        self.unit_backward = unit_backward
        self.head = head
        self.runner = runner
        self.prefetch = prefetch

    def run(
        self,
        block: UnitShard,
        block_gathered: Gathered,
        block_params: dict[str, torch.Tensor],
        head: UnitShard,
        head_gathered: Gathered,
        head_params: dict[str, torch.Tensor],
        mbs: list[MicroBatch],
        store: BoundaryStore,
        head_grad: torch.Tensor,
        state: StepState,
    ) -> torch.Tensor:
        """Per micro-batch: the last block's forward with a graph (its saved activations and
        transient gradients charged as its backward would), its output stored as the head's
        input for this micro-batch only, the head's loss and backward (the output gradient
        stored in that input's place), the last block's backward (the input gradient stored in
        its input's place). After the head's last micro-batch, the head is released, its
        reduce-scatters start and the previous block's gather is prefetched, beside the last
        block's last backward. Both gathered units are released here; the last block's
        reduce-scatters are left in flight for the backward (`state.tail_reducing`). Returns
        the loss sum."""
        coll, ub = self.collectives, self.unit_backward
        u, h = block.index, head.index
        grads = coll.grad_buffers(block)
        head_grads = coll.grad_buffers(head)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        head_open = True
        for j, mb in enumerate(mbs):
            leaves = ub.leaves(block, block_params, grads)
            key = graph_key(u, mb, store)
            with self.runner.unit_input(store, u, j, mb) as x_in:
                x = x_in.detach().requires_grad_()
                # charged as the unfused backward charges them, before its backward: the
                # head's pass then runs on top of them (the cost model's `tail_head`)
                with ub.unit_graph(block, block_params, leaves, x, mb, key, grads) as out:
                    store.put((h, j), out)  # the head's input, this micro-batch only
                    mb.rng[h] = self.runner.save_rng()
                    loss_sum += self.head.micro_batch(
                        head, head_params, mb, j, store, head_grad, head_grads
                    )
                    if j == len(mbs) - 1:
                        self._close_head(head, head_gathered, head_grads, state)
                        head_open = False
                    with store.loaded((h, j)) as gout, torch.enable_grad():
                        torch.autograd.backward(
                            out, grad_tensors=gout, inputs=[x, *leaves.values()]
                        )
                    del out
                    ub.drain(grads)
                store.drop((h, j))  # the output gradient is consumed
                store.put((u, j), x.grad)  # replaces the input: the previous unit's output gradient
                x.grad = None
        if head_open:  # no micro-batch on this rank
            self._close_head(head, head_gathered, head_grads, state)
        grads.done_with_leaves()
        coll.release(block_gathered)
        state.tail_reducing = coll.start_reduces(block, grads)
        return loss_sum

    def _close_head(
        self, head: UnitShard, gathered: Gathered, grads: UnitGrads, state: StepState
    ) -> None:
        """The head's gradient is complete: release its gathered parameters, start its
        reduce-scatters (finished before the previous block's backward) and prefetch the
        previous block for the backward (both into `state`)."""
        coll = self.collectives
        grads.done_with_leaves()
        coll.release(gathered)
        state.head_reducing = coll.start_reduces(head, grads)
        before = head.index - 2
        if self.prefetch and backward_gathers(self.shards, before):
            state.backward_prefetch = coll.start_gather(self.shards[before], async_op=True)
