"""The sharded data-parallel engine: uneven shards, uneven batches, layered gradient
accumulation (LGA).

State. Every unit's parameters form one flat buffer (`FlatLayout`); rank i owns the
contiguous piece `shard_ranges(numel, fractions)[i]` of each and keeps, for that piece
only, the fp32 master, the fp32 gradient and the two AdamW moments (ledger category
`state`). Nothing else of the state outlives a step. Parameters with `requires_grad` False
(a LoRA / QLoRA base) are no such state: `runtime/state/frozen.py` keeps them, sharded by the same
fractions, gathered with their unit and never reduced; a unit with nothing to train (a frozen
embedding) skips its backward.

Host state. With the plan's `host_state_fraction` h, the last round(h x size) elements of
each unit's piece keep master, gradient and moments in host memory (`host/state`, pinned on
CUDA) and only their compute-dtype copy on the device (`state`), which the all-gathers read
(in fp32 the master and that copy are one device buffer, so a gather reads it in place). The
reduce-scatter output of that part goes down to the host gradient when its reduce completes,
the host runs AdamW on it after the global norm (runtime/state/host_state.py), and each unit's
updated copy goes back up. Checkpoints see the two parts as two pieces of the same logical
tensors (`sharded_state`), so a checkpoint loads whatever the host fraction of either run.

Memory-tight ranks. A rank whose plan says `overlap_reduce` false (the planner's choice for a
rank short of memory) waits for each reduce-scatter at once, so only one unit gradient is
alive, and keeps its gradient shards only from the reduce-scatter that fills each one to the
optimizer step (allocated there, freed after it): during the backward it holds the gradients
of the units already reduced, not all of them. (`EngineConfig.overlap_reduce` false only
serialises the reduce-scatters.)

LGA step (mode "lga"), per rank, over its micro-batches (plan `micro_batch_size`):
  forward:  for each unit: all-gather it (the next unit's gather prefetched), run EVERY
            micro-batch through it without a graph, keep each micro-batch's unit input
            (device or host), release the gathered buffer. The head computes its token loss
            sums and its backward in one pass (runtime/head_loss.py: chunks of the sequence,
            no full logits), stores its input gradients in its inputs' place and starts its
            reduce-scatter. Where the model allows it (costmodel/rules.py) the last block
            stays gathered from its forward to its backward on every rank, and a rank whose
            plan fuses its tail runs it in the head's pass: per micro-batch its forward with
            a graph, the head's loss and backward, its backward (runtime/engine/tail_pass.py), so it
            is neither recomputed nor gathered again.
  backward: for each unit in reverse but the head (and a fused last block): all-gather it
            (prefetch the previous one), for each micro-batch recompute the unit from its
            saved input with a graph, backprop
            the output gradient, add the parameter gradients into ONE full-unit fp32
            buffer, and keep the input gradient (in the saved input's place) as the
            previous unit's output gradient; then ONE reduce-scatter of the unit's
            gradient to the shard owners.
  So each unit is gathered once per pass and reduced once per step whatever the number
  of micro-batches. A unit whose split is near even runs both as the even collectives on
  padded buffers (runtime/collectives/padded.py), a skewed one as grouped collectives of its sizes.
  Standard mode (the baseline) runs the same per-unit machinery with
  the micro-batch loop outermost: FSDP with per-unit activation checkpointing, whose
  collectives grow with the number of micro-batches.

Tied weights (GPT-2's wte / lm_head): the first unit holding the parameter owns it. A
later unit that uses it (the head) gathers the owner's slice range of that parameter as a
second, smaller all-gather in each pass, and reduce-scatters its gradient for it straight
back into the owner's gradient slice right after its own backward (no full-size buffer
kept across the backward). Per step, a tied model therefore does 2 x units all-gathers (the
head and its borrowed slice once each) and units + 1 reduce-scatters (LGA).

Loss. The gradient is that of the mean over all tokens of the GLOBAL batch: the global
token count is all-reduced once per step before the backward and the head's output
gradient is 1 / global_tokens (times the loss scale in fp16). The step's loss sum and the
squared gradient norm share one more all-reduce. DPO (`EngineConfig.dpo`,
preference/objective.py): a sample is a pair of rows, the loss the mean pair loss over the
plan's global pairs (known on the host: the head's output gradient needs no all-reduce), the
head weights each row's token losses by the objective's gradient for that row (a graph-free
head pass gives the rows' log-probabilities first), and the token count and TRL's metrics
share one small all-reduce after the backward. The reference is the frozen base with the
adapters off under LoRA, run beside the policy in the forward (no extra gather), else
log-probabilities precomputed once (`reference_logps`).

Host syncs. A step after the first reads nothing of the device on the host but once: the
norm, the loss sum, the token count (and an MoE router loss) together, after the update is
queued (`ShardUpdate`; before it where the update needs the norm on the host: fp16, host
state, a non-fused AdamW). The token count and the head's gradient stay device tensors, the
collectives' cross-rank checks stop after the first step on every communicator, and the MoE
statistics are device-side sums. tests count the operations that would sync a GPU
(runtime/host_syncs.py); scripts/gpu_check.py runs the steps under CUDA's sync debug mode.

Pipeline stages. Under a staged plan (`Plan.stages`) this rank's engine holds only its stage's
units, sharded over the stage's ranks on their own process group (`runtime/pipeline/groups.py`),
and its step's passes are the stage's (`pipeline`, runtime/pipeline/stage_step.py): the same
parts run each micro-batch in the schedule's order, the boundaries crossing to the neighbouring
stages; the token count, loss and norm are still all-reduced over every rank, and the update is
this class's.

Dropout. Masks are drawn per sample from (seed, step, unit, call, global sample index)
(`cephalo.runtime.dropout.SampleDropout`, only around units that can drop anything:
`module_uses_dropout`), so they do not depend on the plan: any plan,
and a single-process reference running under the same mode, sees the same masks. The CPU
and CUDA generator states are also saved before each (unit, micro-batch) forward and
restored in its recompute, for any other randomness a model draws.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from cephalo.errors import CephaloError
from cephalo.modeling.units import IGNORE_INDEX, UnitModel, position_kwargs
from cephalo.planner.plan import Plan
from cephalo.preference.objective import DpoObjective, metrics_of
from cephalo.runtime.autograd import BackwardCharges
from cephalo.runtime.capture.apply import apply_compile
from cephalo.runtime.collectives.comm import Comm
from cephalo.runtime.collectives.emulated import EmulatedStream
from cephalo.runtime.emulation import ComputeEmulator, thread_cpu_measures_work
from cephalo.runtime.engine.config import EngineConfig, StepStats
from cephalo.runtime.engine.head_pass import HeadPass
from cephalo.runtime.engine.setup import (
    apply_host_state,
    apply_offload,
    attach_shard_groups,
    boundary_host_bytes,
    build_optimizer,
    build_shards,
    compute_device,
    plan_tail,
)
from cephalo.runtime.engine.shard_update import GradShards, ShardUpdate
from cephalo.runtime.engine.step_clock import StepClock
from cephalo.runtime.engine.step_passes import StepPasses
from cephalo.runtime.engine.tail_pass import TailPass
from cephalo.runtime.engine.unit_backward import UnitBackward
from cephalo.runtime.engine.unit_comm import UnitCollectives
from cephalo.runtime.engine.unit_run import UnitRunner
from cephalo.runtime.memory import MemoryLedger
from cephalo.runtime.pipeline.groups import attach_stages
from cephalo.runtime.pipeline.stage_step import StageStep, check_runnable, sample_ranges
from cephalo.runtime.pipeline.tie import StageTie, cross_stage_ties, owner_layout
from cephalo.runtime.state.flat import FlatShard, overlap
from cephalo.runtime.state.host_state import HostLink
from cephalo.runtime.state.precision import DynamicLossScaler, compute_dtype
from cephalo.runtime.state.unit_shard import MicroBatch


class Engine:
    """Sharded data-parallel training of a `UnitModel` under a `Plan` (see module docstring).

    The engine takes the model over: after construction its parameters are meta tensors
    (the values live in the shards) and its units only run on gathered buffers.

    It is composed of parts, each given what it uses (the set-up functions of
    runtime/engine/setup.py make the state they work on): `collectives` (the units'
    all-gathers and reduce-scatters, runtime/engine/unit_comm.py), `runner` (a unit on gathered
    parameters, runtime/engine/unit_run.py), `unit_backward` (a unit's recompute and backward,
    runtime/engine/unit_backward.py), `head` (the head's loss and backward, runtime/engine/head_pass.py),
    `tail` (the fused tail, runtime/engine/tail_pass.py), `passes` (the step's forward and backward,
    runtime/engine/step_passes.py), `update` (the optimizer step, runtime/engine/shard_update.py) and
    `clock` (the step's time, runtime/engine/step_clock.py). The engine keeps the step's loop, the
    public state access and the attributes other code reads."""

    def __init__(
        self,
        model: UnitModel,
        plan: Plan,
        comm: Comm,
        config: EngineConfig | None = None,
        ledger: MemoryLedger | None = None,
    ):
        self.config = config = config or EngineConfig()
        config.validate()
        plan.validate(world_size=comm.world_size)
        self.model, self.plan = model, plan
        self.rank = comm.rank
        self.rank_plan = rp = plan.ranks[self.rank]
        self.sample_ranges = sample_ranges(plan, self.rank)
        """(first sample, samples) of each run of the global batch this rank trains on: one
        (ranks take consecutive slices), or one per micro-batch in a staged plan."""
        self.sample_offset = self.sample_ranges[0][0]
        """Index of this rank's first sample in the global batch."""
        check_runnable(plan, config, model)
        if config.validate_collectives is not None:
            comm.validate = config.validate_collectives
        self.stream = EmulatedStream() if config.links is not None else None
        """An emulated cluster's compute stream (runtime/collectives/emulated.py): the waits of
        its collectives hold it, the clock counts its stalls; None: not emulated."""
        self.stages = attach_stages(plan, comm, config.links, self.stream) if plan.staged else None
        """A staged plan: this rank's stage and its communicators (runtime/pipeline/groups.py)."""
        if self.stages is not None:
            self.world, self.comm, self.group_sync = self.stages.world, self.stages.comm, None
        else:
            self.world, self.comm, self.group_sync = attach_shard_groups(
                plan, comm, config, self.stream
            )
        """`world`: every rank (the token count, the loss and the gradient norm). `comm`: this
        rank's shard group's collectives. `group_sync`: hierarchical plans, the all-reduce
        between groups (runtime/collectives/shard_groups.py); None for a flat plan."""
        self.device = device = compute_device(config, self.comm)
        self.dtype = dtype = compute_dtype(config.compute_dtype or plan.dtype)
        self.offload = rp.offload_activations if config.offload is None else config.offload
        self.overlap_reduce = config.overlap_reduce and rp.overlap_reduce
        """Whether this rank waits for each reduce-scatter only after the next unit's backward."""
        self.lean_grads = not rp.overlap_reduce
        """Gradient shards exist only from their reduce-scatter to the optimizer step: on a
        rank the plan marks short of memory (its `overlap_reduce` false)."""
        self.host_fraction = rp.host_state_fraction
        """The part of this rank's shard kept on the host (the plan's `host_state_fraction`)."""
        self.ledger = ledger = ledger or MemoryLedger(
            self.rank,
            device,
            budget_bytes=config.memory_budget_bytes,
            host_budget_bytes=config.host_memory_budget_bytes,
        )
        self.emulator = ComputeEmulator(
            config.slowdown, use_cpu_time=thread_cpu_measures_work(device)
        )
        self.link = HostLink(ledger, device, config.host_copy_bytes_per_s, self.emulator)
        """Copies between this rank's device and its host (host state; emulated boundary copies)."""
        self.scaler = (
            DynamicLossScaler(
                scale=config.loss_scale_init, growth_interval=config.loss_scale_growth_interval
            )
            if dtype == torch.float16
            else None
        )
        self.charges = BackwardCharges(ledger)
        """Activation and transient bytes per (unit, micro-batch shape), measured once."""
        self.runner = UnitRunner(model, device, config.seed, config.per_sample_dropout)
        self.dpo = DpoObjective(config.dpo) if config.dpo is not None else None
        """The DPO objective (preference/objective.py); None: SFT."""
        self.rows_per_sample = 1 if self.dpo is None else 2
        """Rows of a sample: a DPO pair is two (chosen, rejected); the plan counts samples."""
        self.reference_by_adapters = self.dpo is not None and model.adapter is not None
        """DPO under LoRA: the reference is the frozen base with its adapters off, run in the
        forward beside the policy (`StepPasses.forward`); else precomputed (`reference_logps`)."""
        self.shards, self.frozen = build_shards(
            model,
            plan,
            self.comm,
            self.group_sync,
            config,
            ledger,
            device,
            dtype,
            self.host_fraction,
            self.lean_grads,
            *self._stage_units(),
        )
        """`shards`: every unit on this rank (runtime/state/unit_shard.py). `frozen`: the parameters
        that do not train (a LoRA / QLoRA base, runtime/state/frozen.py); None if all train."""
        self.fused_tail_possible, self.fuse_tail = plan_tail(
            model, config, rp, self.group_sync is not None, self.overlap_reduce, self.offload
        )
        """`fused_tail_possible`: the last block stays gathered from its forward to its backward (every
        rank alike). `fuse_tail`: it runs in the head's pass (costmodel/rules.py)."""
        self._boundaries = apply_offload(
            config, ledger, device, self.offload, self.link, self.boundary_host_bytes()
        )
        """Boundary activations of the step in flight (empty between steps)."""
        self.optimizer = build_optimizer(self.shards, config, self.group_sync, device)
        self.host_optimizer, hosted = apply_host_state(self.shards, config)
        """AdamW of the host-held parts (None: all state on the device)."""
        self.grads = GradShards(ledger, device, self.shards, self.optimizer, self.lean_grads)
        self.clock = StepClock(device, self.emulator, self.stream)
        self.collectives = UnitCollectives(
            self.comm,
            self.world,
            ledger,
            device,
            dtype,
            self.frozen,
            self.link,
            self.clock,
            self.grads.device_grad,
        )
        self.unit_backward = UnitBackward(ledger, dtype, self.frozen, self.charges, self.runner)
        self.head = HeadPass(
            ledger,
            device,
            dtype,
            self.collectives,
            self.unit_backward,
            self.runner,
            self.charges,
            self.overlap_reduce,
            self.dpo,
        )
        self.tail = TailPass(
            device,
            self.shards,
            self.collectives,
            self.unit_backward,
            self.head,
            self.runner,
            config.prefetch,
        )
        self.passes = StepPasses(
            self.shards,
            self.collectives,
            self.runner,
            self.unit_backward,
            self.head,
            self.tail,
            self.clock,
            self.group_sync,
            self.grads.device_grad,
            mode=config.mode,
            prefetch=config.prefetch,
            fused_tail_possible=self.fused_tail_possible,
            fuse_tail=self.fuse_tail,
            overlap_reduce=self.overlap_reduce,
            reference=self.reference_by_adapters,
        )
        self.update = ShardUpdate(
            self.optimizer,
            self.host_optimizer,
            hosted,
            self.grads,
            self.collectives,
            self.clock,
            self.link,
            self.scaler,
            self.group_sync,
            config.grad_clip,
        )
        self.eval_metrics: dict[str, float] | None = None
        """DPO: TRL's metrics of the last `eval_loss` batch (None: SFT, or none yet)."""
        self._validated: set[str] = set()
        """Kinds of pass ("train", "eval") whose collectives every rank has cross-checked."""
        self.runner.compiled = apply_compile(  # (a pipeline stage runs eagerly)
            model, device, "off" if plan.staged else config.compile, config.per_sample_dropout
        )
        """The blocks compiled as `config.compile` says (runtime/capture/); None: eager."""
        self.pipeline = (
            None if self.stages is None else StageStep(self, self.stages, self._stage_ties())
        )
        """A staged plan: this rank's stage's passes (runtime/pipeline/stage_step.py)."""

    def _stage_units(self) -> tuple[range | None, list[float] | None]:
        """A staged plan: the units this rank's stage runs and its ranks' state fractions
        (`build_shards`); else (None, None)."""
        if self.stages is None:
            return None, None
        return self.stages.units, [
            self.plan.ranks[r].state_fraction for r in self.stages.stage.ranks
        ]

    def _stage_ties(self) -> list[StageTie]:
        """The tied parameters whose owner runs in another stage, on this rank's side of them
        (collective: every rank makes every pair's group, runtime/pipeline/tie.py)."""
        groups = self.stages
        assert groups is not None and self.plan.stages is not None
        out = []
        for tie in cross_stage_ties(self.model, groups):
            a, b = groups.stage_of_unit(tie.owner), groups.stage_of_unit(tie.borrower)
            comm = groups.pair_comm(a, b)
            if comm is None:
                continue
            owners = self.plan.stages[a].ranks
            owner_shard = next((us for us in self.shards if us.index == tie.owner), None)
            out.append(
                StageTie.make(
                    tie,
                    comm,
                    owner_layout(self.model, tie.owner),
                    owners,
                    [self.plan.ranks[r].state_fraction for r in owners],
                    sorted({*owners, *self.plan.stages[b].ranks}),
                    owner_shard,
                    self.ledger,
                    self.device,
                    self.dtype,
                    self.clock,
                )
            )
        return out

    @property
    def step_index(self) -> int:
        """Train steps run (including fp16-skipped ones): keys the dropout masks."""
        return self.runner.step_index

    @step_index.setter
    def step_index(self, value: int) -> None:
        self.runner.step_index = value

    def close(self) -> None:
        """Release what outlives the engine's Python objects: the process sub-groups of a
        hierarchical plan (`ShardGroupSync.close`). The engine is unusable afterwards. A
        re-plan calls it on the engine it drops (train/replan.py); the world's group is the
        caller's."""
        if self.group_sync is not None:
            self.group_sync.close()
        if self.stages is not None:
            self.stages.close()

    def boundary_host_bytes(self) -> int:
        """Host bytes of this rank's offloaded boundaries at their peak, as the arena lays them
        out (runtime/engine/setup.py `boundary_host_bytes`)."""
        return boundary_host_bytes(
            self.model, self.plan, self.rank_plan, self.config.mode, self.dtype
        )

    def state_written(self) -> None:
        """After writing into `sharded_state()`'s views (loading a checkpoint): refresh the
        device copies of the host-held parts from their new masters."""
        for us in self.update.hosted:
            self.update.upload(us)
        self.link.wait_uploads()

    # ------------------------------------------------------------------ steps
    def _micro_batches(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor | None,
        ref_logps: torch.Tensor | None = None,
    ) -> list[MicroBatch]:
        rp = self.rank_plan
        k = self.rows_per_sample
        if position_ids is not None and position_ids.shape != input_ids.shape:
            raise CephaloError(
                f"rank {self.rank}: position_ids {tuple(position_ids.shape)} and input_ids "
                f"{tuple(input_ids.shape)} must have the same shape"
            )
        position_kwargs(self.model, position_ids)  # a model that cannot take them: refused
        if input_ids.dim() != 2 or input_ids.shape != labels.shape:
            raise CephaloError(
                f"rank {self.rank}: input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} "
                "must both be [batch, seq]"
            )
        if input_ids.shape[0] != k * rp.batch_size:
            what = "rows" if k == 1 else "rows (a DPO pair is 2 rows: chosen, rejected)"
            raise CephaloError(
                f"rank {self.rank}: got {input_ids.shape[0]} {what} but the plan gives this "
                f"rank batch_size {rp.batch_size} ({k * rp.batch_size} rows); pass this rank's "
                "slice of the global batch"
            )
        # to the device ahead of their use, the host not waiting (runtime/state/host_state.py)
        if ref_logps is not None:
            ref_logps = ref_logps.to(torch.float32)
        input_ids, labels, position_ids, ref_logps = self.link.inputs(
            [input_ids, labels, position_ids, ref_logps]
        )
        if self.pipeline is not None:  # M micro-batches of this rank's rows (stage_step.py)
            return self.pipeline.micro_batches(input_ids, labels, position_ids)
        first = k * self.sample_offset  # (rows: per-sample dropout masks follow the rows)
        m = k * rp.micro_batch_size
        mbs = [
            MicroBatch(
                input_ids[a : a + m],
                # its own storage: the head's loss saves its labels, and a view would make the
                # ledger charge the whole batch's labels to every micro-batch (the profile, and
                # so the cost model, charges one micro-batch's)
                labels[a : a + m].clone(),
                first + a,
                None if position_ids is None else position_ids[a : a + m],
                ref_logps=None if ref_logps is None else ref_logps[a : a + m],
            )
            for a in range(0, k * rp.batch_size, m)
        ]
        return mbs

    def _check_reference(self, input_ids: torch.Tensor, ref_logps: torch.Tensor | None) -> None:
        """DPO without an adapter trains against precomputed reference log-probabilities, one
        per row; with one (or SFT) none is taken."""
        rows = input_ids.shape[0] if input_ids.dim() else 0
        if self.dpo is not None and not self.reference_by_adapters:
            if ref_logps is None or tuple(ref_logps.shape) != (rows,):
                got = None if ref_logps is None else tuple(ref_logps.shape)
                raise CephaloError(
                    f"rank {self.rank}: DPO without an adapter needs each row's precomputed "
                    f"reference log-probability (a tensor [{rows}]), got {got}: compute them "
                    "once before training with Engine.reference_logps"
                )
        elif ref_logps is not None:
            raise CephaloError(
                f"rank {self.rank}: reference log-probabilities given, but "
                + (
                    "the objective is SFT"
                    if self.dpo is None
                    else "the reference under LoRA is the base with the adapters off"
                )
            )

    @contextlib.contextmanager
    def _validated_once(self, kind: str) -> Iterator[None]:
        """Cross-check the collectives of the first pass of each kind, not of later ones
        (`EngineConfig.validate_every_step`). Every rank runs the same passes, so they agree
        on when to stop checking (a per-call cache of the signatures seen could not: a rank
        whose call is new would check while the others went on). Both communicators: the shard
        group's and, under shard groups, the world's (the token count, norm and loss), whose
        fingerprint exchange is a host read of the device each call on NCCL."""
        if self.config.validate_every_step or kind not in self._validated:
            yield
            self._validated.add(kind)
            return
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.comm.unvalidated())
            if self.world is not self.comm:
                stack.enter_context(self.world.unvalidated())
            for pair in self.stages.pair_comms() if self.stages is not None else []:
                stack.enter_context(pair.unvalidated())  # (the tied weights' exchange)
            yield

    def train_step(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        lr: float,
        position_ids: torch.Tensor | None = None,
        ref_logps: torch.Tensor | None = None,
    ) -> StepStats:
        """One optimizer step on this rank's slice [B_i, s] of the global batch
        (`position_ids`: per-document positions of packed samples, else None). DPO: the
        slice is [2 B_i, s], pair i's chosen row 2i and its rejected row 2i + 1, and without
        an adapter `ref_logps` [2 B_i] each row's reference log-probability
        (`reference_logps`)."""
        self._check_reference(input_ids, ref_logps)
        with self._validated_once("train"):
            return self._train_step(input_ids, labels, lr, position_ids, ref_logps)

    def _train_step(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        lr: float,
        position_ids: torch.Tensor | None = None,
        ref_logps: torch.Tensor | None = None,
    ) -> StepStats:
        t_step = time.perf_counter()
        clock, passes = self.clock, self.passes
        clock.reset()
        self.ledger.reset_peak()
        self.model.train()
        mbs = self._micro_batches(input_ids, labels, position_ids, ref_logps)
        # the global token count stays on the device (a host read here would stall the host
        # until the device has run everything queued before it): counted on the device's
        # labels, all-reduced in int64 (an fp32 count is inexact above 2**24 tokens), read with
        # the loss after the update (`ShardUpdate.step`)
        zero = torch.zeros((), dtype=torch.int64, device=self.device)  # (a rank without samples)
        counted = mbs if self.pipeline is None or self.pipeline.is_last else []  # (the head's)
        tokens = sum(((mb.labels != IGNORE_INDEX).sum() for mb in counted), zero).reshape(1)
        loss_scale = self.scaler.scale if self.scaler else 1.0
        dpo, pairs = self.dpo, self.plan.global_batch_size
        if dpo is None:
            self.collectives.all_reduce(tokens)
            # in fp64, then rounded to the fp32 the head back-propagates: as a Python float
            head_grad = (loss_scale / tokens[0].clamp(min=1).double()).float()
        else:  # the mean over the global pairs, the plan's (each row weighted: head_pass.py)
            head_grad = torch.full((), loss_scale / pairs, dtype=torch.float32, device=self.device)
            dpo.begin(self.device)
        store = self._boundaries
        store.clear()  # normally empty; not after a step that raised
        aux = getattr(self.model, "router_aux", None)  # MoE router loss
        aux_term = None  # its value, on the device
        if aux is not None:
            aux.start(self.config.mode, self.device)
        if self.pipeline is not None:  # a pipeline stage (runtime/pipeline/stage_step.py)
            loss_sum = self.pipeline.run(mbs, store, head_grad)
        elif self.config.mode == "lga":
            loss_sum, state = passes.forward(mbs, store, keep_inputs=True, head_grad=head_grad)
            if aux is not None:  # global-batch router statistics: one all-reduce
                aux_term = aux.reduce(self.collectives.all_reduce, loss_scale)
            passes.backward_after_forward(mbs, store, state)
        else:
            # every rank must run the same number of collectives: pad with empty passes
            rounds = max(r.num_micro_batches for r in self.plan.ranks)
            loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
            for k in range(rounds):
                chunk = mbs[k : k + 1]
                part, state = passes.forward(chunk, store, keep_inputs=True, head_grad=head_grad)
                loss_sum += part
                passes.backward_after_forward(chunk, store, state)
        assert len(store) == 0, "the backward consumes every boundary"
        extra = aux_term
        if dpo is not None:  # the token count and TRL's metrics: one small all-reduce
            red = torch.cat([tokens.double(), dpo.sums().double()])
            self.collectives.all_reduce(red)
            tokens = red[:1]
            extra = red[1:] if aux_term is None else torch.cat([red[1:], aux_term.reshape(-1)])
        t_opt, comm_before = time.perf_counter(), clock.comm_wait_s
        skipped, grad_norm, loss, read = self.update.step(
            loss_sum, loss_scale, lr, tokens, extra, None if dpo is None else pairs
        )
        optimizer_s = time.perf_counter() - t_opt - (clock.comm_wait_s - comm_before)
        times = clock.collect()  # (CUDA: the events, complete after the update's read)
        if times.optimizer_s is not None:
            optimizer_s = times.optimizer_s + clock.host_s  # (host_s is taken off below)
        n_tokens = int(read[0])
        metrics = None
        if dpo is not None:
            metrics = metrics_of(read[1:8])
            read = read[:1] + read[8:]
        if aux is not None:
            aux.finish(read[1])
            loss += aux.settings.coef * read[1]
        self.step_index += 1
        peaks = self.ledger.peak_by_category
        return StepStats(
            loss=loss,
            grad_norm=grad_norm,
            n_tokens=n_tokens,
            skipped=skipped,
            busy_s=times.busy_s,
            comm_wait_s=times.comm_wait_s,
            step_s=time.perf_counter() - t_step,
            peak_bytes=self.ledger.peak_bytes,
            peak_by_category=dict(peaks),
            loss_scale=loss_scale,
            host_peak_bytes=self.ledger.host_peak_bytes,
            host_s=clock.host_s,
            aux_loss=None if aux is None else aux.aux_loss,
            optimizer_s=max(0.0, optimizer_s - clock.host_s),
            device_step_s=times.device_step_s,
            dpo=metrics,
            contention_s=clock.contention_s,
        )

    @torch.no_grad()
    def eval_loss(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        ref_logps: torch.Tensor | None = None,
    ) -> float:
        """Global mean token loss of this step's batch (no update, dropout off). DPO: the mean
        pair loss (`ref_logps` as for `train_step`), TRL's metrics in `eval_metrics`."""
        self._check_reference(input_ids, ref_logps)
        with self._validated_once("eval"):
            return self._eval_loss(input_ids, labels, position_ids, ref_logps)

    def _eval_loss(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor | None,
        ref_logps: torch.Tensor | None = None,
    ) -> float:
        was_training = self.model.training
        self.model.eval()
        try:
            mbs = self._micro_batches(input_ids, labels, position_ids, ref_logps)
            store = self._boundaries
            if self.dpo is not None:
                self.dpo.begin(self.device)
            if self.pipeline is not None:
                loss_sum = self.pipeline.forward_only(mbs, store)
            else:
                loss_sum, _ = self.passes.forward(mbs, store, keep_inputs=False)
            assert len(store) == 0
            if self.dpo is not None:  # the pairs with a completion (not padding) count
                red = self.dpo.sums().double()
                self.collectives.all_reduce(red)
                sums = red.tolist()  # the one read
                self.eval_metrics = {**metrics_of(sums), "pairs": sums[6]}
                return sums[0] / max(sums[6], 1.0)
            # counted on the device (no host read per micro-batch); fp64: the token count is
            # exact to 2**53 (fp32 stops at 2**24)
            zero = torch.zeros((), dtype=torch.int64, device=self.device)
            counted = mbs if self.pipeline is None or self.pipeline.is_last else []
            n_tok = sum(((mb.labels != IGNORE_INDEX).sum() for mb in counted), zero)
            red = torch.stack([loss_sum.double(), n_tok.double()])
            self.collectives.all_reduce(red)
            total, count = red.tolist()  # the one read
            return total / max(count, 1.0)
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def reference_logps(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """DPO in full fine-tuning: each row's log-probability under the current weights
        (`DpoObjective.logps`: summed, averaged under IPO), fp32 [rows] on the CPU, for this
        rank's slice as `train_step` takes it. Run once before training over the data under
        the same plan, it is the reference (TRL's `precompute_ref_log_probs`): no second copy
        of the weights. No dropout; no update."""
        if self.dpo is None:
            raise CephaloError("reference_logps is for the DPO objective (EngineConfig.dpo)")
        with self._validated_once("eval"):
            was_training = self.model.training
            self.model.eval()
            try:
                mbs = self._micro_batches(input_ids, labels, position_ids)
                rows: list[torch.Tensor] = []
                self.passes.forward(mbs, self._boundaries, keep_inputs=False, rows_out=rows)
                assert len(self._boundaries) == 0
                if not rows:
                    return torch.zeros(0, dtype=torch.float32)
                return torch.cat(rows).float().cpu()
            finally:
                self.model.train(was_training)

    # ------------------------------------------------------------------ state
    def sharded_state(self) -> list[FlatShard]:
        """This rank's pieces of every parameter and AdamW moment, as live views: per tensor
        the piece of the device part (possibly empty) and, where the rank keeps part of its
        shard on the host, the piece of the host part. After writing into them, call
        `state_written()`."""
        out: list[FlatShard] = []
        for prefix, attr, host_attr in (
            ("", "master", "param"),
            ("optim.exp_avg.", "exp_avg", "exp_avg"),
            ("optim.exp_avg_sq.", "exp_avg_sq", "exp_avg_sq"),
        ):
            for us in self.shards:
                parts = [(us.start, us.dev_n, getattr(us, attr))]
                if us.host is not None:
                    parts.append((us.start + us.dev_n, us.host_n, getattr(us.host, host_attr)))
                for s in us.layout.slots:
                    for k, (start, size, local_all) in enumerate(parts):
                        lo, hi = overlap(start, size, s.offset, s.numel)
                        if k > 0 and hi <= lo:
                            continue
                        out.append(
                            FlatShard(
                                f"{prefix}{us.unit.name}.{s.name}",
                                s.shape,
                                lo - s.offset if hi > lo else 0,
                                local_all[lo - start : hi - start] if hi > lo else local_all[0:0],
                            )
                        )
        return out

    def extra_state(self) -> dict:
        """Non-tensor state a checkpoint needs: optimizer step, train steps, loss scaler."""
        return {
            "optimizer_step": self.optimizer.step_count,
            "train_step": self.step_index,
            "loss_scaler": self.scaler.state_dict() if self.scaler else None,
        }

    def load_extra_state(self, d: dict) -> None:
        self.optimizer.step_count = int(d["optimizer_step"])
        self.step_index = int(d["train_step"])
        if self.scaler is not None and d.get("loss_scaler"):
            self.scaler.load_state_dict(d["loss_scaler"])

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole fp32 parameters by `<unit>.<param>` (gathered on every rank, on the CPU)."""
        out: dict[str, torch.Tensor] = {}
        for us in [us for us in self.shards if us.layout.numel]:
            full = torch.empty(us.layout.numel, dtype=torch.float32, device=self.device)
            mine = us.master
            if us.host is not None:  # the fp32 masters of both parts, contiguous
                mine = torch.cat([us.master, us.host.param.to(self.device)])
            self.collectives.wait(self.comm.all_gather_v(full, mine, us.sizes))
            for name, view in us.layout.views(full).items():
                out[f"{us.unit.name}.{name}"] = view.detach().cpu().clone()
        if self.stages is not None:  # every stage's units: from each stage's first rank
            first = self.stages.stage.ranks[0] == self.rank
            for part in self.world.all_gather_object(out if first else {}):
                out.update(part)
        return out

    def state_bytes(self) -> int:
        """Bytes of persistent training state on this rank (master, grad, 2 moments), on the
        device and the host together."""
        return sum(4 * 4 * us.size for us in self.shards)
