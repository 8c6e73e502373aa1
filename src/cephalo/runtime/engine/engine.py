"""The sharded data-parallel engine: uneven shards, uneven batches, layered gradient
accumulation (LGA).

State. Every unit's parameters form one flat buffer (`FlatLayout`); rank i owns the
contiguous piece `shard_ranges(numel, fractions)[i]` of each and keeps, for that piece
only, the fp32 master, the fp32 gradient and the two AdamW moments (ledger category
`state`). Nothing else of the state outlives a step. Parameters with `requires_grad` False
(a LoRA / QLoRA base) are no such state: `runtime/frozen.py` keeps them, sharded by the same
fractions, gathered with their unit and never reduced; a unit with nothing to train (a frozen
embedding) skips its backward.

Host state. With the plan's `host_state_fraction` h, the last round(h x size) elements of
each unit's piece keep master, gradient and moments in host memory (`host/state`, pinned on
CUDA) and only their compute-dtype copy on the device (`state`), which the all-gathers read
(in fp32 the master and that copy are one device buffer, so a gather reads it in place). The
reduce-scatter output of that part goes down to the host gradient when its reduce completes,
the host runs AdamW on it after the global norm (runtime/host_state.py), and each unit's
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
            sums and its backward in one pass (runtime/engine/head_loss.py: chunks of the sequence,
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
squared gradient norm share one more all-reduce.

Dropout. Masks are drawn per sample from (seed, step, unit, call, global sample index)
(`cephalo.runtime.dropout.SampleDropout`, only around units that can drop anything:
`module_uses_dropout`), so they do not depend on the plan: any plan,
and a single-process reference running under the same mode, sees the same masks. The CPU
and CUDA generator states are also saved before each (unit, micro-batch) forward and
restored in its recompute, for any other randomness a model draws.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator

import torch

from cephalo.costmodel.rules import rank_may_fuse, tail_fusable
from cephalo.errors import CephaloError
from cephalo.log import logger
from cephalo.modeling.units import IGNORE_INDEX, UnitModel, position_kwargs
from cephalo.planner.plan import Plan
from cephalo.runtime.adamw import ShardedAdamW, ShardGroup, clip_coefficient
from cephalo.runtime.collectives.comm import Comm
from cephalo.runtime.collectives.padded import PaddedSplit
from cephalo.runtime.collectives.shard_groups import SlowLinkComm, attach_replicas
from cephalo.runtime.dropout import SampleDropout, module_uses_dropout
from cephalo.runtime.emulation import ComputeEmulator, thread_cpu_measures_work
from cephalo.runtime.engine import head_loss
from cephalo.runtime.engine.autograd import BackwardCharges
from cephalo.runtime.engine.bind import UnitBinding
from cephalo.runtime.engine.boundary import BoundaryStore
from cephalo.runtime.engine.config import EngineConfig, StepStats
from cephalo.runtime.engine.head_pass import HeadPass
from cephalo.runtime.engine.tail_pass import TailPass
from cephalo.runtime.engine.unit_backward import UnitBackward
from cephalo.runtime.engine.unit_comm import Gathered, Reduce, UnitComm
from cephalo.runtime.engine.unit_shard import Borrow, MicroBatch, UnitShard
from cephalo.runtime.flat import FlatLayout, FlatShard, overlap, shard_ranges
from cephalo.runtime.frozen import FrozenBase
from cephalo.runtime.host_state import HostAdamW, HostGroup, HostLink
from cephalo.runtime.memory import MemoryLedger
from cephalo.runtime.param_groups import wants_weight_decay
from cephalo.runtime.pinned import ALIGN as PINNED_ALIGN
from cephalo.runtime.pinned import PinnedArena
from cephalo.runtime.precision import DynamicLossScaler, compute_dtype


class Engine(UnitComm, UnitBackward, HeadPass, TailPass):
    """Sharded data-parallel training of a `UnitModel` under a `Plan` (see module docstring).

    The engine takes the model over: after construction its parameters are meta tensors
    (the values live in the shards) and its units only run on gathered buffers."""

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
        self.model, self.plan, self.comm = model, plan, comm
        self.rank = comm.rank
        self.rank_plan = plan.ranks[self.rank]
        self.sample_offset = plan.batch_offsets()[self.rank]
        """Index of this rank's first sample in the global batch (ranks take consecutive slices)."""
        if config.validate_collectives is not None:
            comm.validate = config.validate_collectives
        self.world = comm
        """Every rank: the token count, the loss and the gradient norm (`comm`: the shard group's)."""
        self.replicas = attach_replicas(plan, comm, config.inter_node_bytes_per_s)
        """Hierarchical plans: this rank's shard group and the all-reduce between groups
        (runtime/collectives/shard_groups.py); None for a flat plan."""
        if self.replicas is not None:
            self.comm = comm = self.replicas.group_comm
        elif config.inter_node_bytes_per_s:  # an emulated flat ring across slow nodes
            self.comm = comm = SlowLinkComm(comm, config.inter_node_bytes_per_s)  # type: ignore[assignment]
        self.device = (
            torch.device(config.device)
            if config.device
            else (
                torch.device("cuda", torch.cuda.current_device())
                if comm.backend == "nccl"
                else torch.device("cpu")
            )
        )
        self.dtype = compute_dtype(config.compute_dtype or plan.dtype)
        self.offload = (
            self.rank_plan.offload_activations if config.offload is None else config.offload
        )
        self.overlap_reduce = config.overlap_reduce and self.rank_plan.overlap_reduce
        """Whether this rank waits for each reduce-scatter only after the next unit's backward."""
        self.lean_grads = not self.rank_plan.overlap_reduce
        """Gradient shards exist only from their reduce-scatter to the optimizer step: on a
        rank the plan marks short of memory (its `overlap_reduce` false)."""
        self.host_fraction = self.rank_plan.host_state_fraction
        """The part of this rank's shard kept on the host (the plan's `host_state_fraction`)."""
        self.ledger = ledger or MemoryLedger(
            self.rank,
            self.device,
            budget_bytes=config.memory_budget_bytes,
            host_budget_bytes=config.host_memory_budget_bytes,
        )
        self.emulator = ComputeEmulator(
            config.slowdown, use_cpu_time=thread_cpu_measures_work(self.device)
        )
        self.link = HostLink(self.ledger, self.device, config.host_copy_bytes_per_s, self.emulator)
        """Copies between this rank's device and its host (host state; emulated boundary copies)."""
        self.scaler = (
            DynamicLossScaler(
                scale=config.loss_scale_init, growth_interval=config.loss_scale_growth_interval
            )
            if self.dtype == torch.float16
            else None
        )
        self.step_index = 0
        """Train steps run (including fp16-skipped ones): keys the dropout masks."""
        self._boundaries = BoundaryStore(
            self.ledger,
            self.device,
            self.offload,
            link=self.link if config.host_copy_bytes_per_s is not None else None,
        )
        """Boundary activations of the step in flight (empty between steps)."""
        self._dropout_units = {
            i for i, u in enumerate(model.units) if module_uses_dropout(u.module)
        }
        """Units that can drop anything: only they run under `SampleDropout`."""
        self._charges = BackwardCharges(self.ledger)
        """Activation and transient bytes per (unit, micro-batch shape), measured once."""
        self._vocab = model.spec.vocab_size
        self._head_reducing: list[Reduce] = []
        """The head's reduce-scatters, started at the end of the forward (`_head_pass`)."""
        self._tail_reducing: list[Reduce] | None = None
        """The last block's reduce-scatters, started by the fused tail (`_tail_pass`)."""
        self._kept_last: tuple[Gathered, dict[str, torch.Tensor]] | None = None
        """Unfused with `keep_last`: the last block as gathered in the forward, for its backward."""
        self._backward_prefetch: Gathered | None = None
        """The backward's first gather, started during the head pass (unfused: the last block;
        fused: the block before it, `_close_head`)."""
        self._build_shards()
        fusable = tail_fusable(
            blocks=len(model.units) - 2,
            moe=model.spec.num_experts > 0,
            quantized=bool(model.quantized_parameters),
            hierarchical=self.replicas is not None,
        )
        self.keep_last = config.mode == "lga" and fusable
        """Whether the last block stays gathered from its forward to its backward (every rank
        alike: the ranks' collectives must match)."""
        self.fuse_tail = bool(
            config.fuse_tail
            and self.rank_plan.fuse_tail
            and self.keep_last
            and rank_may_fuse(fusable, self.overlap_reduce, self.offload)
        )
        """Whether the last block runs in the head's pass (costmodel/rules.py)."""
        arena = (
            config.pinned_arena if config.pinned_arena is not None else self.device.type == "cuda"
        )
        if arena and self.offload and self.ledger.arena is None:
            self.ledger.arena = PinnedArena(
                self.boundary_host_bytes(), pin=self.device.type == "cuda"
            )
        self.optimizer = ShardedAdamW(
            [
                ShardGroup(
                    us.master,
                    us.grad,
                    us.exp_avg,
                    us.exp_avg_sq,
                    [(a, min(b, us.dev_n)) for a, b in us.decay_segments if a < us.dev_n],
                )
                for us in self.shards
            ],
            config.adamw,
            # replicas in several shard groups must stay bit-identical: the fused CPU kernel
            # rounds an element differently in its vector body and in its tail, which fall at
            # other elements under another group's shard boundaries
            config.adamw_kernel or ("single" if self.replicas is not None else None),
        )
        hosted = [us for us in self.shards if us.host is not None]
        self.host_optimizer = (
            HostAdamW([us.host for us in hosted], config.adamw, config.host_adamw)
            if hosted
            else None
        )
        """AdamW of the host-held parts (None: all state on the device)."""
        self._hosted = hosted
        self._comm_wait_s = 0.0
        self._busy_s = 0.0
        self._host_s = 0.0
        self._validated: set[str] = set()
        """Kinds of pass ("train", "eval") whose collectives every rank has cross-checked."""
        self._cuda_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._bindings: dict[int, UnitBinding] = {}
        """Each unit's parameter slots, found once (runtime/engine/bind.py)."""

    # ------------------------------------------------------------------ setup
    @torch.no_grad()
    def _build_shards(self) -> None:
        """Initial weights (identical on every rank: from `config.seed`, or the model's own
        values if it is not on meta), this rank's slices of them, and the tie table."""
        model = self.model
        on_meta = any(p.is_meta for p in model.parameters())
        # one generator drawn unit by unit in `named_unit_parameters` order = `init_weights`
        generator = torch.Generator().manual_seed(self.config.seed)
        owned: dict[int, list[tuple[str, torch.Tensor]]] = {}
        owner_of: dict[int, tuple[int, str]] = {}
        index_of = {u.name: i for i, u in enumerate(model.units)}
        for unit_name, pname, p in model.named_unit_parameters():
            owned.setdefault(index_of[unit_name], []).append((pname, p))
            owner_of[id(p)] = (index_of[unit_name], pname)
        fractions = self.replicas.fractions if self.replicas else self.plan.state_fractions
        padded = self.config.padded_collectives
        padded = self.comm.even_gather if padded is None else padded
        self.shards: list[UnitShard] = []
        # parameters with requires_grad False (a LoRA base) form the frozen base (frozen.py)
        self.frozen: FrozenBase | None = None
        if any(not p.requires_grad for p in model.parameters()):
            self.frozen = FrozenBase(
                self.comm,
                self.ledger,
                self.device,
                self.dtype,
                fractions,
                model.quantized_parameters,
            )
        for i, unit in enumerate(model.units):
            params = owned.get(i, [])
            if self.frozen is not None:
                frozen = [(n, p) for n, p in params if not p.requires_grad]
                params = [(n, p) for n, p in params if p.requires_grad]
            layout = FlatLayout(unit.name, params)
            us = UnitShard(i, unit, layout, shard_ranges(layout.numel, fractions), self.comm.rank)
            if padded and self.comm.world_size > 1:
                us.padded = PaddedSplit.of(us.sizes)
                us.pad_offset = us.padded.offset(self.comm.rank) if us.padded else 0
            if on_meta:
                # materialise ONE unit's initial values on the CPU (host memory: the largest
                # unit, fp32), keep this rank's slice, drop the rest
                values = model.initial_values(unit.name, owned.get(i, []), generator)
            else:
                values = dict(owned.get(i, []))
            if self.frozen is not None:
                self.frozen.add_unit(i, unit.name, frozen, values)
            full = layout.flatten(values)
            del values
            decays = [wants_weight_decay(f"{unit.name}.{name}", p) for name, p in params]
            us.decay_segments = layout.segments_where(decays, us.start, us.size)
            self._alloc_unit_state(us, full[us.start : us.start + us.size])
            del full  # before the next unit's values exist: at most two units at a time
            self.shards.append(us)
        if self.replicas is not None:  # every rank: the owners' sub-groups of every unit
            self.replicas.prepare([us.layout.numel for us in self.shards])
        for i, unit in enumerate(model.units):
            for pname, p in unit.module.named_parameters():
                owner_index, owner_name = owner_of[id(p)]
                if owner_index == i:
                    continue
                if self.frozen is not None and not p.requires_grad:
                    self.frozen.tie(i, pname, owner_index, owner_name)
                    continue
                owner = self.shards[owner_index]
                slot = owner.layout.slot(owner_name)
                pieces = [overlap(s, n, slot.offset, slot.numel) for s, n in owner.ranges]
                lo, hi = pieces[self.comm.rank]
                self.shards[i].borrows.append(
                    Borrow(
                        pname,
                        owner,
                        slot,
                        [b - a for a, b in pieces],
                        (lo - owner.start, hi - owner.start),
                    )
                )
        self._to_meta_params()

    def boundary_host_bytes(self) -> int:
        """Host bytes of this rank's offloaded boundaries at their peak, as the arena lays them
        out: every unit's input but the first, per micro-batch kept at once (all of them under
        LGA, one in the standard mode), [m, seq, hidden] in compute dtype, each piece aligned
        to `pinned.ALIGN`. The cost model's `host_bytes` counts the same bytes."""
        rp, spec = self.rank_plan, self.model.spec
        sizes = [
            min(rp.micro_batch_size, rp.batch_size - a)
            for a in range(0, rp.batch_size, rp.micro_batch_size)
        ]
        kept = sizes if self.config.mode == "lga" else sizes[:1]
        piece = [m * self.plan.seq_len * spec.hidden_size * self.dtype.itemsize for m in kept]
        aligned = sum(-(-n // PINNED_ALIGN) * PINNED_ALIGN for n in piece)
        return (len(self.model.units) - 1) * aligned

    def _alloc_state(self, numel: int) -> torch.Tensor:
        return self.ledger.alloc("state", numel, torch.float32, device=self.device)

    def _alloc_unit_state(self, us: UnitShard, values: torch.Tensor) -> None:
        """This rank's state of one unit from its shard's initial fp32 `values`: the device
        part, and the host part of `host_fraction` (see the module docstring)."""
        us.host_n = min(us.size, round(self.host_fraction * us.size))
        us.dev_n = d = us.size - us.host_n
        if self.dtype == torch.float32:
            # one device buffer: the device part's master, then the host part's copy
            if us.padded is None:
                us.param_buf = self._alloc_state(us.size).copy_(values)
            else:  # the padded chunk the gathers send (runtime/collectives/padded.py), zero around the shard
                us.send_buf = self._alloc_state(us.padded.pad).zero_()
                o = us.pad_offset
                us.param_buf = us.send_buf[o : o + us.size].copy_(values)
            us.master, us.host_copy = us.param_buf[:d], us.param_buf[d:]
        else:
            us.master = self._alloc_state(d).copy_(values[:d])
            us.host_copy = self.ledger.alloc("state", us.host_n, self.dtype, device=self.device)
            us.host_copy.copy_(values[d:])
        # a lean rank's gradient shards are allocated by their first reduce-scatter
        us.grad = us.master[0:0] if self.lean_grads else self._alloc_state(d).zero_()
        us.exp_avg = self._alloc_state(d).zero_()
        us.exp_avg_sq = self._alloc_state(d).zero_()
        if us.host_n == 0:
            return
        pin = self.device.type == "cuda"

        def host(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return self.ledger.alloc("host/state", numel, dtype, pin=pin)

        us.host = HostGroup(
            host(us.host_n).copy_(values[d:]),
            host(us.host_n).zero_(),
            host(us.host_n).zero_(),
            host(us.host_n).zero_(),
            [(max(a, d) - d, b - d) for a, b in us.decay_segments if b > d],
        )
        if self.dtype != torch.float32:
            us.host_upload = host(us.host_n, self.dtype)

    def _upload(self, us: UnitShard) -> None:
        """The host part's updated parameters up to the device copy the gathers read."""
        assert us.host is not None
        if us.host_upload is None:  # fp32: the master itself
            self.link.up(us.host_copy, us.host.param)
            return
        # cast on the host (the pinned buffer this step's upload reads; the previous step's
        # upload of it completed: the copy stream ran it before this step's gradient copies,
        # which `link.sync` waited for)
        us.host_upload.copy_(us.host.param)
        self.link.up(us.host_copy, us.host_upload)

    def state_written(self) -> None:
        """After writing into `sharded_state()`'s views (loading a checkpoint): refresh the
        device copies of the host-held parts from their new masters."""
        for us in self._hosted:
            self._upload(us)
        self.link.wait_uploads()

    def _to_meta_params(self) -> None:
        """Replace every parameter by a meta tensor (ties kept: one object per parameter):
        units only ever run on views of gathered buffers. Buffers (the unit contract says
        there are none) would move to the compute device."""
        replaced: dict[int, torch.nn.Parameter] = {}
        for module in self.model.modules():
            for name, p in module._parameters.items():
                if p is None:
                    continue
                if id(p) not in replaced:
                    replaced[id(p)] = torch.nn.Parameter(
                        torch.empty_like(p, device="meta"), p.requires_grad
                    )
                module._parameters[name] = replaced[id(p)]
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = b.to(self.device)

    # ------------------------------------------------------------------ compute helpers
    def _run_unit(
        self, us: UnitShard, params: dict[str, torch.Tensor], x: torch.Tensor, mb: MicroBatch
    ) -> torch.Tensor:
        with self._dropout(us, mb):
            if us.unit.kind != "head":
                kwargs = position_kwargs(self.model, mb.position_ids)
                return self._binding(us)(params, (x,), kwargs)
            return head_loss.loss(self._head_fn(us, params), x, mb.labels, self._vocab)

    def _binding(self, us: UnitShard) -> UnitBinding:
        binding = self._bindings.get(us.index)
        if binding is None:
            binding = self._bindings[us.index] = UnitBinding(us.unit.module)
        return binding

    def _dropout(self, us: UnitShard, mb: MicroBatch) -> contextlib.AbstractContextManager:
        if not (
            self.config.per_sample_dropout
            and self.model.training
            and us.index in self._dropout_units
        ):
            return contextlib.nullcontext()
        return SampleDropout(self.config.seed, self.step_index, us.index, mb.sample_offset)

    def _save_rng(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def _restore_rng(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)

    @contextlib.contextmanager
    def _compute(self) -> Iterator[None]:
        """Time a piece of compute (stretched by the emulated slowdown). On CUDA, events
        time the stream without stalling the host (summed at the end of the step), unless a
        slowdown must be emulated, which needs the host to know the time now."""
        if self.device.type == "cuda" and self.emulator.slowdown == 1.0:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream = torch.cuda.current_stream(self.device)  # once: it builds a Stream object
            start.record(stream)
            yield
            end.record(stream)
            self._cuda_events.append((start, end))
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        mark = self.emulator.start()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._busy_s += self.emulator.finish(mark)

    @contextlib.contextmanager
    def _optimizer_work(self) -> Iterator[None]:
        """Optimizer work on this rank's shard, stretched by the emulated slowdown: a slow
        device is slow at its optimizer step too, and the profiler measures that step under
        the same emulator (profiling/measure.py `measure_optimizer`). Not part of `busy_s`
        (unit compute only); without emulation nothing is timed, so CUDA never stalls here."""
        if self.emulator.slowdown == 1.0:
            yield
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        mark = self.emulator.start()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.emulator.finish(mark)

    def _collect_busy(self) -> float:
        if self._cuda_events:
            torch.cuda.synchronize(self.device)
            self._busy_s += sum(a.elapsed_time(b) for a, b in self._cuda_events) / 1000.0
            self._cuda_events.clear()
        return self._busy_s

    # ------------------------------------------------------------------ passes
    def _forward_pass(
        self,
        mbs: list[MicroBatch],
        store: BoundaryStore,
        keep_inputs: bool,
        head_grad: float | None = None,
    ) -> torch.Tensor:
        """Every unit over every micro-batch, no graph; store[(u, j)] receives unit u's input
        for micro-batch j (u >= 1; with `keep_inputs=False`, only until unit u has run).
        With `head_grad` (training), the head computes its loss and backward at once
        (`_head_pass`). Returns this rank's loss sum (fp32)."""
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        n = len(self.shards)
        keep = head_grad is not None and self.keep_last
        fuse = keep and self.fuse_tail
        tail = None  # fused: the last block, kept gathered for the head's pass
        self._tail_reducing = self._kept_last = None  # (left set only by a step that raised)
        pending = self._start_gather(self.shards[0], async_op=self.config.prefetch)
        for u, us in enumerate(self.shards):
            g = pending if pending is not None else self._start_gather(us, async_op=False)
            params = self._finish_gather(g)
            pending = None
            if self.config.prefetch and u + 1 < n:
                pending = self._start_gather(self.shards[u + 1], async_op=True)
            elif (
                self.config.prefetch
                and head_grad is not None
                and not keep
                and self._backward_gathers(n - 2)
            ):
                # the head pass: the backward's first unit, the last block, gathers meanwhile
                self._backward_prefetch = self._start_gather(self.shards[n - 2], async_op=True)
            if fuse and u == n - 2:
                tail = (us, g, params)  # its forward runs in the head's pass, with a graph
                continue
            with self._compute(), torch.no_grad():
                if u == n - 1 and tail is not None:
                    loss_sum += self._tail_pass(*tail, us, g, params, mbs, store, head_grad)
                    tail = None
                    del params  # both gathered units were released in the pass
                    break
                if u == n - 1 and head_grad is not None:
                    loss_sum += self._head_pass(us, params, mbs, store, head_grad)
                    mbs = []  # done
                for j, mb in enumerate(mbs):
                    mb.rng[u] = self._save_rng()
                    with self._unit_input(store, u, j, mb) as x:
                        out = self._run_unit(us, params, x, mb)
                    if not keep_inputs:
                        store.drop((u, j))
                    if u == n - 1:
                        loss_sum += out.float()
                    else:
                        store.put((u + 1, j), out)
                    del out
            if keep and u == n - 2:  # gathered for its backward already: not gathered again
                self._kept_last = (g, params)
            else:
                self._release(g)
            del params  # the gathered buffers die with the ledger's count of them
        return loss_sum

    def _backward_gathers(self, u: int) -> bool:
        """Whether the backward gathers unit u (not the head: its backward ran in the forward;
        not a frozen embedding: nothing to compute)."""
        return 0 <= u < len(self.shards) - 1 and (u > 0 or self._trains(self.shards[0]))

    def _unit_input(self, store: BoundaryStore, u: int, j: int, mb: MicroBatch):
        """Unit u's input for micro-batch j: the token ids for the embedding, else the stored
        boundary."""
        return contextlib.nullcontext(mb.input_ids) if u == 0 else store.loaded((u, j))

    def _backward_after_forward(
        self, mbs: list[MicroBatch], store: BoundaryStore, head_grad: float
    ) -> None:
        """The backward pass, leaving the random generators where the forward left them: the
        recompute rewinds them unit by unit, and without this the next step would draw the
        numbers this step's units already used (with `per_sample_dropout` off)."""
        after_forward = self._save_rng()
        self._backward_pass(mbs, store, head_grad)
        self._restore_rng(after_forward)

    def _backward_pass(self, mbs: list[MicroBatch], store: BoundaryStore, head_grad: float) -> None:
        """Units in reverse: recompute with a graph, backprop, one gradient buffer per unit,
        one reduce-scatter per unit (plus one for a borrowed tied parameter), in flight
        during the next unit's backward (`EngineConfig.overlap_reduce`)."""
        # the head ran its backward in the forward (`_head_pass`); its reduce-scatters are in
        # flight
        n = len(self.shards) - 1
        reducing, self._head_reducing = self._head_reducing, []
        if self._tail_reducing is not None:
            # the fused tail ran the last block's backward too: the head's reduce-scatters
            # complete now (one unit's in flight from here on, as unfused), the last block's
            # during the next unit's backward
            for r in reducing:
                self._finish_reduce(r)
            reducing, self._tail_reducing = self._tail_reducing, None
            n -= 1
        pending, self._backward_prefetch = self._backward_prefetch, None
        kept, self._kept_last = self._kept_last, None
        if pending is None and kept is None and self._backward_gathers(n - 1):
            pending = self._start_gather(self.shards[n - 1], async_op=self.config.prefetch)
        for u in reversed(range(n)):
            us = self.shards[u]
            if u == 0 and not self._trains(us):  # a frozen embedding: no gradient to compute
                for j in range(len(mbs)):
                    store.drop((1, j))
                break
            if kept is not None:  # the last block, still gathered from the forward
                (g, params), kept = kept, None
            else:
                g = pending if pending is not None else self._start_gather(us, async_op=False)
                params = self._finish_gather(g)
            pending = None
            if self.config.prefetch and u > 0 and (u > 1 or self._trains(self.shards[0])):
                pending = self._start_gather(self.shards[u - 1], async_op=True)
            grads = self._grad_buffers(us)
            with self._compute():
                for j, mb in enumerate(mbs):
                    self._backward_micro_batch(us, params, mb, j, store, head_grad, grads)
            grads.done_with_leaves()
            self._release(g)
            del params  # the gathered buffers die with the ledger's count of them
            # the previous unit's reduce-scatters ran while this unit's backward computed
            for r in reducing:
                self._finish_reduce(r)
            if self.replicas is not None and self.config.mode == "lga":
                self.replicas.unit_final(self, u + 1)  # complete: its all-reduce can start
            reducing = self._start_reduces(us, grads)
            # the reduce-scatters hold the buffers now: no name here may keep them alive into
            # the next unit's backward once `_finish_reduce` has freed them in the ledger
            grads = None
            if not self.overlap_reduce:
                for r in reducing:
                    self._finish_reduce(r)
                reducing = []
        for r in reducing:
            self._finish_reduce(r)
        if self.replicas is not None and self.config.mode == "lga":
            self.replicas.unit_final(self, 0)

    # ------------------------------------------------------------------ public API
    def _micro_batches(
        self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None
    ) -> list[MicroBatch]:
        rp = self.rank_plan
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
        if input_ids.shape[0] != rp.batch_size:
            raise CephaloError(
                f"rank {self.rank}: got {input_ids.shape[0]} samples but the plan gives this rank "
                f"batch_size {rp.batch_size}; pass this rank's slice of the global batch"
            )
        input_ids = input_ids.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        if position_ids is not None:
            position_ids = position_ids.to(self.device, non_blocking=True)
        first = self.sample_offset
        m = rp.micro_batch_size
        return [
            MicroBatch(
                input_ids[a : a + m],
                # its own storage: the head's loss saves its labels, and a view would make the
                # ledger charge the whole batch's labels to every micro-batch (the profile, and
                # so the cost model, charges one micro-batch's)
                labels[a : a + m].clone(),
                first + a,
                None if position_ids is None else position_ids[a : a + m],
            )
            for a in range(0, rp.batch_size, m)
        ]

    @contextlib.contextmanager
    def _validated_once(self, kind: str) -> Iterator[None]:
        """Cross-check the collectives of the first pass of each kind, not of later ones
        (`EngineConfig.validate_every_step`). Every rank runs the same passes, so they agree
        on when to stop checking."""
        if self.config.validate_every_step or kind not in self._validated:
            yield
            self._validated.add(kind)
            return
        with self.comm.unvalidated():
            yield

    def train_step(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        lr: float,
        position_ids: torch.Tensor | None = None,
    ) -> StepStats:
        """One optimizer step on this rank's slice [B_i, s] of the global batch
        (`position_ids`: per-document positions of packed samples, else None)."""
        with self._validated_once("train"):
            return self._train_step(input_ids, labels, lr, position_ids)

    def _train_step(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        lr: float,
        position_ids: torch.Tensor | None = None,
    ) -> StepStats:
        t_step = time.perf_counter()
        self._comm_wait_s = self._busy_s = self._host_s = 0.0
        self.ledger.reset_peak()
        self.model.train()
        # counted on the caller's labels (host memory: no device sync per micro-batch)
        n_local = int((labels != IGNORE_INDEX).sum())
        mbs = self._micro_batches(input_ids, labels, position_ids)
        # int64: an fp32 count is inexact above 2**24 tokens (a large global batch)
        tokens = torch.tensor([n_local], dtype=torch.int64, device=self.device)
        self._all_reduce(tokens)
        n_tokens = int(tokens.item()) if self.world.world_size > 1 else n_local
        loss_scale = self.scaler.scale if self.scaler else 1.0
        head_grad = loss_scale / max(n_tokens, 1)
        store = self._boundaries
        store.clear()  # normally empty; not after a step that raised
        aux, aux_term = getattr(self.model, "router_aux", None), 0.0  # MoE router loss
        if aux is not None:
            aux.start(self.config.mode, self.device)
        if self.config.mode == "lga":
            loss_sum = self._forward_pass(mbs, store, keep_inputs=True, head_grad=head_grad)
            if aux is not None:  # global-batch router statistics: one all-reduce
                aux_term = aux.reduce(self._all_reduce, loss_scale)
            self._backward_after_forward(mbs, store, head_grad)
        else:
            # every rank must run the same number of collectives: pad with empty passes
            rounds = max(r.num_micro_batches for r in self.plan.ranks)
            loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
            for k in range(rounds):
                chunk = mbs[k : k + 1]
                loss_sum += self._forward_pass(chunk, store, keep_inputs=True, head_grad=head_grad)
                self._backward_after_forward(chunk, store, head_grad)
        assert len(store) == 0, "the backward consumes every boundary"
        t_opt, comm_before = time.perf_counter(), self._comm_wait_s
        skipped, grad_norm = self._optimizer_step(loss_sum, loss_scale, lr, n_tokens)
        optimizer_s = time.perf_counter() - t_opt - (self._comm_wait_s - comm_before)
        if aux is not None:
            aux.finish()
            self._last_loss += aux_term
        self.step_index += 1
        peaks = self.ledger.peak_by_category
        return StepStats(
            loss=self._last_loss,
            grad_norm=grad_norm,
            n_tokens=n_tokens,
            skipped=skipped,
            busy_s=self._collect_busy(),
            comm_wait_s=self._comm_wait_s,
            step_s=time.perf_counter() - t_step,
            peak_bytes=self.ledger.peak_bytes,
            peak_by_category=dict(peaks),
            loss_scale=loss_scale,
            host_peak_bytes=self.ledger.host_peak_bytes,
            host_s=self._host_s,
            aux_loss=None if aux is None else aux.aux_loss,
            optimizer_s=max(0.0, optimizer_s - self._host_s),
        )

    @torch.no_grad()
    def _optimizer_step(
        self, loss_sum: torch.Tensor, loss_scale: float, lr: float, n_tokens: int
    ) -> tuple[bool, float]:
        opt, host_opt = self.optimizer, self.host_optimizer
        self.link.sync()  # every host gradient piece has arrived
        for us in self.shards:  # (lean: a unit no reduce-scatter reached has a zero gradient)
            self._device_grad(us)
        if self.replicas is not None:  # once per step: sum the groups' gradient shards
            self._comm_wait_s += self.replicas.reduce_engine_grads(self)
        with self._optimizer_work():
            if loss_scale != 1.0:
                opt.scale_grads(1.0 / loss_scale)
            # one all-reduce for the squared norm and the loss sum
            red = torch.stack([opt.local_grad_sq_sum(), loss_sum.double()])
        if host_opt is not None:
            t0 = time.perf_counter()
            if loss_scale != 1.0:
                host_opt.scale_grads(1.0 / loss_scale)
            red[0] += host_opt.grad_sq_sum().to(red.device)
            self._host_s += time.perf_counter() - t0
        self._all_reduce(red)
        if self.replicas is not None:  # every group holds the same, whole gradient
            red[0] /= len(self.replicas.groups)
        if self.scaler is None and host_opt is None and opt.kernel == "fused":
            with self._optimizer_work():
                self._device_step(red, lr)
            return self._step_outcome(red, n_tokens)
        grad_norm = float(red[0].sqrt())
        self._last_loss = float(red[1]) / max(n_tokens, 1)
        finite = math.isfinite(grad_norm)
        if self.scaler is not None:
            self.scaler.update(found_inf=not finite)
        if not finite:
            # skip the update on every rank (the norm is global, so they all agree); fp16 has
            # lowered its loss scale above; the trainer decides how many skips it tolerates
            if self.scaler is not None:
                logger.debug(
                    "fp16: non-finite gradient, step skipped; loss scale now %g", self.scaler.scale
                )
            with self._optimizer_work():
                self._zero_device_grads()
            self._host_zero_grad()
            return True, grad_norm
        coef = clip_coefficient(grad_norm, self.config.grad_clip) if self.config.grad_clip else 1.0
        with self._optimizer_work():
            opt.step(lr, coef)  # (the fused kernel scales the gradients as it reads them)
            self._zero_device_grads()
        if host_opt is not None:
            # not under the emulated slowdown: the host is not the emulated device. On CUDA
            # the device's optimizer kernels run meanwhile; each unit's upload starts as soon
            # as the host has updated it
            t0 = time.perf_counter()
            if coef < 1.0:
                host_opt.scale_grads(coef)
            for i, us in enumerate(self._hosted):
                host_opt.step_group(i, lr, opt.step_count)
                self._upload(us)
            self._host_zero_grad()
            self.link.wait_uploads()
            self._host_s += time.perf_counter() - t0
        return False, grad_norm

    def _device_step(self, red: torch.Tensor, lr: float) -> None:
        """The update without a host sync (all state on the device, no loss scaler, the fused
        kernel): the clipping coefficient is computed and applied on the device, and a
        non-finite norm makes the kernel leave everything as it is (`found_inf`).
        scripts/gpu_check.py runs it under `torch.cuda.set_sync_debug_mode("error")`."""
        norm = red[0].sqrt()
        clip = self.config.grad_clip
        coef = clip_coefficient(norm, clip) if clip else 1.0
        self.optimizer.step(lr, coef, found_inf=(~torch.isfinite(norm)).to(torch.float32))
        self._zero_device_grads()

    def _step_outcome(self, red: torch.Tensor, n_tokens: int) -> tuple[bool, float]:
        """After `_device_step` is queued: (skipped, gradient norm), one read of the device's
        norm and loss sum. A skipped step is taken back (`step_count`); the trainer decides
        how many skips it tolerates."""
        norm_sq, loss = red.tolist()
        self._last_loss = loss / max(n_tokens, 1)
        grad_norm = math.sqrt(norm_sq) if norm_sq >= 0 else math.nan
        if math.isfinite(grad_norm):
            return False, grad_norm
        self.optimizer.step_count -= 1
        return True, grad_norm

    def _device_grad(self, us: UnitShard) -> torch.Tensor:
        """The device part's gradient shard (a lean rank allocates it on first use)."""
        if us.grad.numel() != us.dev_n:
            us.grad = self._alloc_state(us.dev_n).zero_()
            self.optimizer.groups[us.index].grad = us.grad
        return us.grad

    def _zero_device_grads(self) -> None:
        """After the optimizer step: zero the gradient shards, or (lean) free them."""
        if not self.lean_grads:
            self.optimizer.zero_grad()
            return
        for us in self.shards:
            if us.grad.numel():
                self.ledger.free(us.grad)
            us.grad = us.master[0:0]
            self.optimizer.groups[us.index].grad = us.grad

    def _host_zero_grad(self) -> None:
        if self.host_optimizer is not None:
            self.host_optimizer.zero_grad()
        for us in self._hosted:
            us.host_grad_written = False

    @torch.no_grad()
    def eval_loss(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> float:
        """Global mean token loss of this step's batch (no update, dropout off)."""
        with self._validated_once("eval"):
            return self._eval_loss(input_ids, labels, position_ids)

    def _eval_loss(
        self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None
    ) -> float:
        was_training = self.model.training
        self.model.eval()
        try:
            mbs = self._micro_batches(input_ids, labels, position_ids)
            store = self._boundaries
            loss_sum = self._forward_pass(mbs, store, keep_inputs=False)
            assert len(store) == 0
            n_tok = float(sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in mbs))
            # fp64: the token count is exact to 2**53 (fp32 stops at 2**24)
            red = torch.stack(
                [loss_sum.double(), torch.tensor(n_tok, dtype=torch.float64, device=self.device)]
            )
            self._all_reduce(red)
            return float(red[0]) / max(float(red[1]), 1.0)
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
            self._wait(self.comm.all_gather_v(full, mine, us.sizes))
            for name, view in us.layout.views(full).items():
                out[f"{us.unit.name}.{name}"] = view.detach().cpu().clone()
        return out

    def state_bytes(self) -> int:
        """Bytes of persistent training state on this rank (master, grad, 2 moments), on the
        device and the host together."""
        return sum(4 * 4 * us.size for us in self.shards)
