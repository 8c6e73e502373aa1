"""One stage's part of a pipeline step (`StageStep`): the engine's parts (runtime/engine/) run the
stage's units over the step's micro-batches in the order of the plan's schedule
(runtime/pipeline/schedule.py), the boundaries crossing to and from the neighbouring stages
(runtime/pipeline/exchange.py).

Micro-batches. Micro-batch j of the step is samples j x B/M .. (j+1) x B/M of the global batch;
this rank holds its `micro_batch_size` rows of each (`Plan.micro_batch_slices`), so the rank's
slice of the step (`Plan.sample_ranges`) is M runs of rows, and each micro-batch's
`sample_offset` (the global index of its first row) keys the dropout masks as in any plan.

Forward of micro-batch j: the stage's first unit takes the token ids (stage 0) or the boundary
received from the previous stage, re-partitioned for this stage's split; each unit runs without
a graph, its input kept (the store's (u, j), as the flat engine's forward keeps it); the last
unit's output goes to the next stage, or, on the last stage, the head computes its loss and
backward at once (runtime/engine/head_pass.py) with the output gradient 1 / global tokens.
Backward of micro-batch j: the output gradient received from the next stage (or the head's
input gradient) goes through the stage's units in reverse, each recomputed from its saved input
with a graph (runtime/engine/unit_backward.py); the input gradient of the stage's first unit goes
back to the previous stage.

Weights (`Stage.keep_gathered`). Kept gathered: every unit of the stage is all-gathered once per
step (all started at the step's start, each waited for at its first use), its fp32 gradient
accumulates unsharded over the micro-batches and is reduce-scattered once, right after its last
micro-batch's backward (ZeRO-2-like; the cost model's `keep`). Else each unit is gathered for
each micro-batch's forward and again for its backward, and its gradient reduce-scattered after
each micro-batch's backward into the shard's gradient (which sums them). Either way the stage's
state is sharded over its ranks by their fractions, on the stage's own process group.

The step's numbers are the flat engine's: the global token count (the last stage's labels) and
the loss and squared gradient norm (every stage's shards) are all-reduced over every rank, so
the loss is the mean over the global batch's tokens, the clipping sees the whole model, and
every rank reads the same values once per step (runtime/engine/shard_update.py).

What a stage cannot run yet (one message, `check_runnable`): host state or offloaded boundaries
inside a stage, the standard mode, compiled blocks, DPO, LoRA / QLoRA and MoE models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from cephalo.errors import CephaloError
from cephalo.planner.plan import Plan, check_stages_runnable
from cephalo.runtime.boundary import BoundaryStore
from cephalo.runtime.engine.unit_comm import Gathered, Reduce, UnitGrads
from cephalo.runtime.pipeline.exchange import BoundaryExchange
from cephalo.runtime.pipeline.groups import StageGroups
from cephalo.runtime.pipeline.schedule import FORWARD, stage_ops
from cephalo.runtime.pipeline.tie import StageTie
from cephalo.runtime.state.unit_shard import MicroBatch, UnitShard, trains

if TYPE_CHECKING:
    from cephalo.modeling.units import UnitModel
    from cephalo.runtime.collectives.emulated import EmulatedStream
    from cephalo.runtime.engine.config import EngineConfig
    from cephalo.runtime.engine.head_pass import HeadPass
    from cephalo.runtime.engine.shard_update import GradShards
    from cephalo.runtime.engine.step_clock import StepClock
    from cephalo.runtime.engine.unit_backward import UnitBackward
    from cephalo.runtime.engine.unit_comm import UnitCollectives
    from cephalo.runtime.engine.unit_run import UnitRunner


class Engine(Protocol):
    """What a stage reads of the engine that runs it (runtime/engine/engine.py's `Engine`):
    named here so this module does not import the engine that imports it."""

    plan: Plan
    model: UnitModel
    rank: int
    shards: list[UnitShard]
    dtype: torch.dtype
    device: torch.device
    config: EngineConfig
    stream: EmulatedStream | None
    overlap_reduce: bool
    collectives: UnitCollectives
    clock: StepClock
    runner: UnitRunner
    unit_backward: UnitBackward
    head: HeadPass
    grads: GradShards


def check_runnable(plan: Plan, config: EngineConfig, model: UnitModel) -> None:
    """One message for what the pipeline runtime does not run yet (else nothing): the plan's
    options (`planner.plan.check_stages_runnable`) and the engine's."""
    if not plan.staged:
        return
    assert plan.stages is not None
    head = len(model.units) - 1
    if plan.stages[-1].units[1] != head:  # (every rank: before any collective)
        raise CephaloError(
            f"the plan's last stage ends at unit {plan.stages[-1].units[1]} but "
            f"{model.spec.name}'s head is unit {head}: the stages must cover its units 0..{head} "
            "exactly (make the plan for this model: `cephalo plan --stages`)"
        )
    why = []
    if config.mode != "lga":
        why.append(f"the {config.mode!r} mode")
    if config.compile not in ("off", "auto"):  # ("auto": a stage runs eagerly)
        why.append(f"compiled blocks (parallel.compile = {config.compile})")
    if config.dpo is not None:
        why.append("the DPO objective")
    if any(not p.requires_grad for p in model.parameters()):
        why.append("an adapter (LoRA / QLoRA)")
    if model.spec.num_experts > 0:
        why.append("a mixture-of-experts model")
    check_stages_runnable(plan, "the plan", why)


def sample_ranges(plan: Plan, rank: int) -> list[tuple[int, int]]:
    """(first sample, samples) of each run of the global batch rank `rank` trains on, in the
    order its micro-batches take them: one run in a flat plan, one per micro-batch in a staged
    one (one empty run for a staged rank without rows)."""
    if not plan.staged:
        return [(plan.batch_offsets()[rank], plan.ranks[rank].batch_size)]
    assert plan.stages is not None and plan.num_micro_batches
    stage = next(s for s, st in enumerate(plan.stages) if rank in st.ranks)
    start, size = next((a, n) for r, a, n in plan.micro_batch_slices(stage) if r == rank)
    per = plan.global_batch_size // plan.num_micro_batches
    return [(j * per + start, size) for j in range(plan.num_micro_batches)] if size else [(0, 0)]


class _Weights:
    """The stage's gathered units and gradient buffers for one step or evaluation, per
    `Stage.keep_gathered` (module docstring). Given the stage step; `train`: gradients too."""

    def __init__(self, step: StageStep, train: bool):
        self.step = step
        self.coll = step.engine.collectives
        self.train = train
        self.keep = step.keep
        self.pending: dict[int, Gathered] = {}
        self.gathered: dict[int, tuple[Gathered, dict[str, torch.Tensor]]] = {}
        self.grads: dict[int, UnitGrads] = {}
        self.reducing: list[Reduce] = []
        self.prefetching = step.engine.config.prefetch
        self.overlap = step.engine.overlap_reduce
        if self.keep:  # every unit's gather starts now, each waited for at its first use
            for us in step.shards:
                self.pending[us.index] = self.coll.start_gather(us, async_op=True)

    def params(self, us: UnitShard) -> dict[str, torch.Tensor]:
        u = us.index
        if u not in self.gathered:
            g = self.pending.pop(u, None) or self.coll.start_gather(us, async_op=False)
            params = self.coll.finish_gather(g)
            for tie in self.step.ties_of(u):
                params.update(tie.params())
            self.gathered[u] = (g, params)
        return self.gathered[u][1]

    def prefetch(self, u: int) -> None:
        """Gathered per micro-batch: start unit `u`'s gather now (it runs beside the current
        unit's compute, as the flat engine's prefetch and the cost model's overlap have it)."""
        us = self.step.by_index.get(u)
        if self.keep or not self.prefetching or us is None:
            return
        if u not in self.pending and u not in self.gathered:
            self.pending[u] = self.coll.start_gather(us, async_op=True)

    def unit_grads(self, us: UnitShard) -> UnitGrads:
        u = us.index
        if u not in self.grads:
            grads = self.coll.grad_buffers(us)
            for tie in self.step.ties_of(u):
                grads.foreign.update(tie.foreign())
            self.grads[u] = grads
        return self.grads[u]

    def done(self, us: UnitShard, j: int, backward: bool) -> None:
        """Unit `us` is through micro-batch j's forward (`backward` False) or backward: per
        micro-batch, its gathered buffers go (and after a backward its gradient is reduced);
        kept gathered, its gradient is reduced after the step's last micro-batch."""
        u = us.index
        last = j == self.step.M - 1
        if backward and (not self.keep or last):
            grads = self.grads.pop(u)
            grads.done_with_leaves()
            if not self.keep:  # the previous unit's ran beside this one's backward
                self.finish_reduces()
            self.reducing += self.coll.start_reduces(us, grads)
            del grads
            if not self.overlap:  # (a rank short of memory: one unit's gradient at a time)
                self.finish_reduces()
        if not self.keep and u in self.gathered:
            g, _ = self.gathered.pop(u)
            self.coll.release(g)

    def finish_reduces(self) -> None:
        for r in self.reducing:
            self.coll.finish_reduce(r)
        self.reducing = []

    def finish(self) -> None:
        """The step's end: the reduce-scatters complete, the gathered buffers go."""
        self.finish_reduces()
        for g in self.pending.values():  # (a step that raised before using them)
            self.coll.finish_gather(g)
            self.coll.release(g)
        self.pending.clear()
        for g, _ in self.gathered.values():
            self.coll.release(g)
        self.gathered.clear()
        self.grads.clear()


class StageStep:
    """This rank's stage of a staged plan: its step's passes over the micro-batches (the update
    is the engine's). Owns the schedule, the boundary exchange and the cross-stage ties; uses
    the engine's parts (collectives, runner, unit backward, head pass, clock, store)."""

    def __init__(self, engine: Engine, groups: StageGroups, ties: list[StageTie]):
        plan = engine.plan
        assert plan.stages is not None and plan.num_micro_batches and plan.schedule
        self.engine = engine
        self.groups = groups
        self.S, self.M, self.s = len(plan.stages), int(plan.num_micro_batches), groups.index
        self.first, self.last = groups.stage.units
        self.head = len(engine.model.units) - 1
        self.keep = groups.stage.keep_gathered
        self.ops = stage_ops(plan.schedule, self.s, self.S, self.M)
        self.shards = engine.shards
        self.by_index = {us.index: us for us in engine.shards}
        self.ties = ties
        rp = plan.ranks[engine.rank]
        self.rows = rp.micro_batch_size if rp.batch_size else 0
        self.ranges = sample_ranges(plan, engine.rank)
        self.exchange = BoundaryExchange(
            plan,
            self.s,
            engine.rank,
            (plan.seq_len, engine.model.spec.hidden_size),
            engine.dtype,
            engine.device,
            engine.config.links,
            engine.stream,
        )

    @property
    def is_last(self) -> bool:
        """This rank's stage ends in the head (its labels count the step's tokens)."""
        return self.s == self.S - 1

    def ties_of(self, unit: int) -> list[StageTie]:
        """The cross-stage ties unit `unit` borrows here."""
        return [t for t in self.ties if t.tie.borrower == unit and t.owner_shard is None]

    def micro_batches(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor | None,
    ) -> list[MicroBatch]:
        """This rank's slice as the step's M micro-batches (module docstring)."""
        m = self.rows
        if input_ids.shape[0] != m * self.M:
            raise CephaloError(
                f"rank {self.engine.rank}: got {input_ids.shape[0]} rows, but its plan takes "
                f"{m} rows of each of the step's {self.M} micro-batches ({m * self.M}; "
                "Plan.sample_ranges says which)"
            )
        if not m:
            empty = input_ids[0:0]
            return [
                MicroBatch(empty, labels[0:0], 0, None if position_ids is None else empty)
                for _ in range(self.M)
            ]
        return [
            MicroBatch(
                input_ids[j * m : (j + 1) * m],
                labels[j * m : (j + 1) * m].clone(),
                self.ranges[j][0],
                None if position_ids is None else position_ids[j * m : (j + 1) * m],
            )
            for j in range(self.M)
        ]

    # ------------------------------------------------------------------ the step
    def run(
        self, mbs: list[MicroBatch], store: BoundaryStore, head_grad: torch.Tensor
    ) -> torch.Tensor:
        """The step's forwards and backwards in the schedule's order, the stage's gradient
        shards complete (the ties' included) at the end. Returns this rank's loss sum."""
        e = self.engine
        for tie in self.ties:
            tie.fetch(train=True)
        weights = _Weights(self, train=True)
        loss_sum = torch.zeros((), dtype=torch.float32, device=e.device)
        try:
            for kind, j in self.ops:
                if kind == FORWARD:
                    loss_sum += self._forward(j, mbs[j], store, weights, head_grad)
                else:
                    self._backward(j, mbs[j], store, weights)
            weights.finish()
            self.exchange.finish()
            for tie in self.ties:
                tie.reduce(e.grads.device_grad)
        finally:
            for tie in self.ties:
                tie.release()
        return loss_sum

    def forward_only(self, mbs: list[MicroBatch], store: BoundaryStore) -> torch.Tensor:
        """Every micro-batch's forward without graphs (evaluation): this rank's loss sum."""
        for tie in self.ties:
            tie.fetch(train=False)
        weights = _Weights(self, train=False)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.engine.device)
        try:
            for j, mb in enumerate(mbs):
                loss_sum += self._forward(j, mb, store, weights, None)
            weights.finish()
            self.exchange.finish()
        finally:
            for tie in self.ties:
                tie.release()
        return loss_sum

    def _forward(
        self,
        j: int,
        mb: MicroBatch,
        store: BoundaryStore,
        weights: _Weights,
        head_grad: torch.Tensor | None,
    ) -> torch.Tensor:
        e, clock, runner = self.engine, self.engine.clock, self.engine.runner
        rows = self.rows
        loss = torch.zeros((), dtype=torch.float32, device=e.device)
        if self.first > 0:
            with clock.communication():
                x = self.exchange.recv_activation(j, rows)
            if rows:
                store.put((self.first, j), x)
            del x
        for u in range(self.first, self.last + 1):
            us = self.by_index[u]
            params = weights.params(us)
            weights.prefetch(u + 1)
            if u == self.head and head_grad is not None:
                grads = weights.unit_grads(us)
                if rows:
                    with clock.compute():
                        mb.rng[u] = runner.save_rng()
                        loss += e.head.micro_batch(us, params, mb, j, store, head_grad, grads)
                del params, grads
                weights.done(us, j, backward=True)  # the head's backward ran with its forward
                continue
            out = None
            if rows:
                with clock.compute(), torch.no_grad():
                    mb.rng[u] = runner.save_rng()
                    with runner.unit_input(store, u, j, mb) as x:
                        out = runner.run(us, params, x, mb)
                    if head_grad is None:  # evaluation: no recompute needs the input
                        store.drop((u, j))
                    if u == self.head:
                        loss += out.float()
                    elif u < self.last:
                        store.put((u + 1, j), out)
            del params
            weights.done(us, j, backward=False)
            if u == self.last and u != self.head:
                if out is None:
                    out = torch.empty((0, *self.exchange.row_shape), dtype=e.dtype, device=e.device)
                self.exchange.send_activation(j, out)
            del out
        return loss

    def _backward(self, j: int, mb: MicroBatch, store: BoundaryStore, weights: _Weights) -> None:
        e, clock, runner = self.engine, self.engine.clock, self.engine.runner
        rows = self.rows
        # the forwards after this backward draw what they would draw without it
        after_forward = runner.save_rng()
        if self.last != self.head:
            with clock.communication():
                g = self.exchange.recv_grad(j, rows)
            if rows:
                store.put((self.last + 1, j), g)
            del g
        top = self.last if self.last != self.head else self.last - 1
        for u in range(top, self.first - 1, -1):
            us = self.by_index[u]
            if u == 0 and not trains(us):  # (refused today: a frozen embedding)
                store.drop((1, j))
                break
            params = weights.params(us)
            if u - 1 >= self.first and (u > 1 or trains(self.by_index[0])):
                weights.prefetch(u - 1)
            grads = weights.unit_grads(us)
            if rows:
                with clock.compute():
                    e.unit_backward.micro_batch(us, params, mb, j, store, grads)
            del params, grads
            weights.done(us, j, backward=True)
        if self.first > 0:
            if rows:
                with store.loaded((self.first, j)) as dx:
                    self.exchange.send_grad(j, dx.clone() if store.offload else dx)
                store.drop((self.first, j))
            else:
                self.exchange.send_grad(
                    j, torch.empty((0, *self.exchange.row_shape), dtype=e.dtype, device=e.device)
                )
        runner.restore_rng(after_forward)
