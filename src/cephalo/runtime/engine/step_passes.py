"""A step's two passes over the units (`StepPasses`): the forward, which ends with the head's
loss and backward (runtime/engine/head_pass.py) or the fused tail (runtime/engine/tail_pass.py) and returns
what it left in flight as a `StepState` (runtime/engine/step_state.py), and the backward, which
consumes it: units in reverse, recomputed from their saved inputs (runtime/engine/unit_backward.py),
one gradient buffer and one reduce-scatter per unit. The module docstring of
runtime/engine/engine.py describes the step as a whole."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from cephalo.runtime.boundary import BoundaryStore
from cephalo.runtime.collectives.shard_groups import ShardGroupSync
from cephalo.runtime.engine.head_pass import HeadPass
from cephalo.runtime.engine.step_clock import StepClock
from cephalo.runtime.engine.step_state import StepState
from cephalo.runtime.engine.tail_pass import TailPass
from cephalo.runtime.engine.unit_backward import UnitBackward
from cephalo.runtime.engine.unit_comm import UnitCollectives
from cephalo.runtime.engine.unit_run import UnitRunner
from cephalo.runtime.state.unit_shard import MicroBatch, UnitShard, backward_gathers, trains


class StepPasses:
    """The forward and backward passes of a step. Owns no state across steps (a step's state
    is its `StepState`). Given: the unit shards; the parts it calls (collectives, unit runner,
    unit backward, head pass, fused tail, clock); the shard groups' all-reduce (`group_sync`,
    None for a flat plan) with `device_grad`, the device part's gradient shard it starts
    from; and this rank's choices: `mode` ("lga" or "standard"), `prefetch`, `fused_tail_possible`
    (the last block stays gathered from its forward to its backward), `fuse_tail` (it runs in
    the head's pass), `overlap_reduce`, and `reference` (DPO under LoRA: the reference's
    forward runs beside the policy's, `forward`)."""

    def __init__(
        self,
        shards: list[UnitShard],
        collectives: UnitCollectives,
        runner: UnitRunner,
        unit_backward: UnitBackward,
        head: HeadPass,
        tail: TailPass,
        clock: StepClock,
        group_sync: ShardGroupSync | None,
        device_grad: Callable[[UnitShard], torch.Tensor],
        *,
        mode: str,
        prefetch: bool,
        fused_tail_possible: bool,
        fuse_tail: bool,
        overlap_reduce: bool,
        reference: bool = False,
    ):
        self.shards = shards
        self.collectives = collectives
        self.runner = runner
        self.unit_backward = unit_backward
        self.head = head
        self.tail = tail
        self.clock = clock
        self.group_sync = group_sync
        self.device_grad = device_grad
        self.mode = mode
        self.prefetch = prefetch
        self.fused_tail_possible = fused_tail_possible
        self.fuse_tail = fuse_tail
        self.overlap_reduce = overlap_reduce
        self.reference = reference
        """DPO under LoRA: every unit also runs each micro-batch with its adapters off (the
        reference, `UnitRunner.reference`) while it is gathered for the forward."""

    def forward(
        self,
        mbs: list[MicroBatch],
        store: BoundaryStore,
        keep_inputs: bool,
        head_grad: torch.Tensor | None = None,
        rows_out: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, StepState]:
        """Every unit over every micro-batch, no graph; store[(u, j)] receives unit u's input
        for micro-batch j (u >= 1; with `keep_inputs=False`, only until unit u has run).
        With `head_grad` (training), the head computes its loss and backward at once (the
        head pass, or the fused tail). Returns this rank's loss sum (fp32) and what the
        backward must take over (`StepState`).

        DPO: with `reference`, each gathered unit first runs every micro-batch with its
        adapters off, its output kept under (-(u + 1), j) until the next unit's reference has
        read it, and the head sets each micro-batch's `ref_logps` (so the reference costs no
        gather). Without `head_grad`, the head gives each row's log-probability: appended to
        `rows_out` if given (the full fine-tuning reference's pass), else the pairs' loss."""
        coll, runner, clock = self.collectives, self.runner, self.clock
        state = StepState()
        loss_sum = torch.zeros((), dtype=torch.float32, device=coll.device)
        n = len(self.shards)
        keep = head_grad is not None and self.fused_tail_possible
        fuse = keep and self.fuse_tail
        tail = None  # fused: the last block, kept gathered for the head's pass
        pending = coll.start_gather(self.shards[0], async_op=self.prefetch)
        for u, us in enumerate(self.shards):
            g = pending if pending is not None else coll.start_gather(us, async_op=False)
            params = coll.finish_gather(g)
            pending = None
            if self.prefetch and u + 1 < n:
                pending = coll.start_gather(self.shards[u + 1], async_op=True)
            elif (
                self.prefetch
                and head_grad is not None
                and not keep
                and backward_gathers(self.shards, n - 2)
            ):
                # the head pass: the backward's first unit, the last block, gathers meanwhile
                state.backward_prefetch = coll.start_gather(self.shards[n - 2], async_op=True)
            if self.reference:
                with clock.compute(), torch.no_grad():
                    self._reference(us, params, mbs, store, last=u == n - 1)
            if fuse and u == n - 2:
                tail = (us, g, params)  # its forward runs in the head's pass, with a graph
                continue
            with clock.compute(), torch.no_grad():
                if u == n - 1 and tail is not None:
                    assert head_grad is not None
                    loss_sum += self.tail.run(*tail, us, g, params, mbs, store, head_grad, state)
                    tail = None
                    del params  # both gathered units were released in the pass
                    break
                if u == n - 1 and head_grad is not None:
                    loss_sum += self.head.run(us, params, mbs, store, head_grad, state)
                    mbs = []  # done
                if u == n - 1 and head_grad is None and self.head.dpo is not None:
                    loss_sum += self._dpo_head(us, params, mbs, store, rows_out)
                    mbs = []  # done
                for j, mb in enumerate(mbs):
                    mb.rng[u] = runner.save_rng()
                    with runner.unit_input(store, u, j, mb) as x:
                        out = runner.run(us, params, x, mb)
                    if not keep_inputs:
                        store.drop((u, j))
                    if u == n - 1:
                        loss_sum += out.float()
                    else:
                        store.put((u + 1, j), out)
                    del out
            if keep and u == n - 2:  # gathered for its backward already: not gathered again
                state.kept_last = (g, params)
            else:
                coll.release(g)
            del params  # the gathered buffers die with the ledger's count of them
        return loss_sum, state

    def _reference(
        self,
        us: UnitShard,
        params: dict[str, torch.Tensor],
        mbs: list[MicroBatch],
        store: BoundaryStore,
        last: bool,
    ) -> None:
        """The DPO reference's forward of unit `us` (adapters off) over every micro-batch: a
        block's output replaces its input under -(index) keys; the head (`last`) sets each
        micro-batch's `ref_logps`."""
        u = us.index
        for j, mb in enumerate(mbs):
            with self.runner.reference(us):
                if last:
                    with store.loaded((-u, j)) as x:
                        mb.ref_logps = self.head.row_logps(us, params, mb, x)
                else:
                    x_ctx = (
                        contextlib.nullcontext(mb.input_ids) if u == 0 else store.loaded((-u, j))
                    )
                    with x_ctx as x:
                        out = self.runner.run(us, params, x, mb)
            if u > 0:
                store.drop((-u, j))
            if not last:
                store.put((-(u + 1), j), out)
                del out

    def _dpo_head(
        self,
        us: UnitShard,
        params: dict[str, torch.Tensor],
        mbs: list[MicroBatch],
        store: BoundaryStore,
        rows_out: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        """The head without a backward under DPO: each micro-batch's rows' log-probabilities,
        appended to `rows_out` if given, else turned into the pairs' loss (and metrics).
        Returns the loss sum; the head's inputs are dropped."""
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.collectives.device)
        dpo = self.head.dpo
        assert dpo is not None
        for j, mb in enumerate(mbs):
            with self.runner.unit_input(store, us.index, j, mb) as x:
                logps = self.head.row_logps(us, params, mb, x)
            store.drop((us.index, j))
            if rows_out is not None:
                rows_out.append(logps)
            else:
                assert mb.ref_logps is not None, "DPO needs reference logps"
                loss_sum += dpo.pairs(logps, mb.ref_logps, mb.labels)[0]
        return loss_sum

    def backward_after_forward(
        self, mbs: list[MicroBatch], store: BoundaryStore, state: StepState
    ) -> None:
        """The backward pass, leaving the random generators where the forward left them: the
        recompute rewinds them unit by unit, and without this the next step would draw the
        numbers this step's units already used (with `per_sample_dropout` off)."""
        after_forward = self.runner.save_rng()
        self.backward(mbs, store, state)
        self.runner.restore_rng(after_forward)

    def backward(self, mbs: list[MicroBatch], store: BoundaryStore, state: StepState) -> None:
        """Units in reverse: recompute with a graph, backprop, one gradient buffer per unit,
        one reduce-scatter per unit (plus one for a borrowed tied parameter), in flight
        during the next unit's backward (`EngineConfig.overlap_reduce`). Consumes `state`:
        the head's (and a fused tail's) reduce-scatters in flight, the kept or prefetched
        last block."""
        coll = self.collectives
        # the head ran its backward in the forward (the head pass); its reduce-scatters are in
        # flight
        n = len(self.shards) - 1
        reducing, state.head_reducing = state.head_reducing, []
        if state.tail_reducing is not None:
            # the fused tail ran the last block's backward too: the head's reduce-scatters
            # complete now (one unit's in flight from here on, as unfused), the last block's
            # during the next unit's backward
            for r in reducing:
                coll.finish_reduce(r)
            reducing, state.tail_reducing = state.tail_reducing, None
            n -= 1
        pending, state.backward_prefetch = state.backward_prefetch, None
        kept, state.kept_last = state.kept_last, None
        if pending is None and kept is None and backward_gathers(self.shards, n - 1):
            pending = coll.start_gather(self.shards[n - 1], async_op=self.prefetch)
        for u in reversed(range(n)):
            us = self.shards[u]
            if u == 0 and not trains(us):  # a frozen embedding: no gradient to compute
                for j in range(len(mbs)):
                    store.drop((1, j))
                break
            if kept is not None:  # the last block, still gathered from the forward
                (g, params), kept = kept, None
            else:
                g = pending if pending is not None else coll.start_gather(us, async_op=False)
                params = coll.finish_gather(g)
            pending = None
            if self.prefetch and u > 0 and (u > 1 or trains(self.shards[0])):
                pending = coll.start_gather(self.shards[u - 1], async_op=True)
            grads = coll.grad_buffers(us)
            with self.clock.compute():
                for j, mb in enumerate(mbs):
                    self.unit_backward.micro_batch(us, params, mb, j, store, grads)
            grads.done_with_leaves()
            coll.release(g)
            del params  # the gathered buffers die with the ledger's count of them
            # the previous unit's reduce-scatters ran while this unit's backward computed
            for r in reducing:
                coll.finish_reduce(r)
            if self.group_sync is not None and self.mode == "lga":
                # complete: its all-reduce can start
                self.group_sync.unit_final(self.shards, self.device_grad, u + 1)
            reducing = coll.start_reduces(us, grads)
            # the reduce-scatters hold the buffers now: no name here may keep them alive into
            # the next unit's backward once `finish_reduce` has freed them in the ledger
            grads = None
            if not self.overlap_reduce:
                for r in reducing:
                    coll.finish_reduce(r)
                reducing = []
        for r in reducing:
            coll.finish_reduce(r)
        if self.group_sync is not None and self.mode == "lga":
            self.group_sync.unit_final(self.shards, self.device_grad, 0)
