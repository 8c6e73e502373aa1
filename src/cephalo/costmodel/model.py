"""The cost model: time and peak memory of one rank under a plan. The ONE place these formulas live.

Its parts by concept: the collectives and the padded-even rule (`collective_cost.py`), shard
groups of hierarchical plans (`group_cost.py`), host memory (`host_cost.py`), the result
values (`cost_results.py`) and the profile curves as tables (`curve_tables.py`); `CostModel`
here puts them together and is the one way in.

The planner, `cephalo simulate` and the benchmarks all call into this module, so a plan is
always judged by the same numbers it was made with. Every formula is written once, over
numpy arrays that broadcast: the planner evaluates whole tables of (batch, micro-batch,
offload) choices at once, `rank_cost` evaluates one choice, and both read the same code.

Per rank i (its device's profile, memory M_i), for a choice of batch b, micro-batch m
(k = ceil(b/m) micro-batches, the last one b - (k-1) m samples), state fraction s and
offload o, one training step under layered gradient accumulation (LGA) costs:

  per unit u (embedding, L blocks, head):
    forward    fwd_u  = (k-1) F_u(m) + F_u(last)
    backward   bwd_u  = fwd_u (recompute) + (k-1) B_u(m) + B_u(last); the head has no
               recompute and no second gather: its loss and backward run in one pass, at the
               end of the forward (runtime/head_loss.py); where the plan fuses its tail
               (costmodel/rules.py) the last block runs in that pass too, with neither
               recompute nor second gather; where the model allows it, every rank keeps the
               last block gathered from its forward to its backward (no second gather), fused
               or not
    collectives: all-gather of the unit's compute-dtype parameters in forward and again in
    backward, reduce-scatter of its fp32 gradient once in backward; ring cost
    (n-1)/n * bytes / slowest link + latency (costmodel/collectives.py). They depend on the
    unit, not on b, m or s, except that a near-even split runs them padded-even where the
    backend pads (`padded_collectives`: NCCL): its padding travels too, N x u of the unit's
    trained part for u the split's largest fraction, and its padded buffers are held
    (`pad`, charged by `evaluate` and weighed by the planner; collective_cost.py says how).
    All are overlapped with compute: the all-gather of the next unit is prefetched while
    this one computes, and the engine's reduce-scatter of a unit's gradient runs while the
    next unit's backward computes (runtime/engine/step_passes.py). A process group's
    collectives run one after another (NCCL: one stream per communicator; the emulated
    cluster's comm likewise, runtime/collectives/emulated.py), so each unit's backward is
    charged max(its compute, a gather + a reduce-scatter) of its own kind (the neighbour
    whose collective it hides is of the same kind but at the ends of the model), not the
    max of the three; the head, first of the backward, hides no reduce-scatter, and the last
    one (the embedding's, before the optimizer) is not hidden.
    host copies (offload): the unit's boundary activation (b * seq * hidden * dtype bytes)
    goes to the host in forward and comes back in backward: every unit's output but the
    head's is written in forward, every unit's input gradient but the embedding's in
    backward; the input of every unit but the embedding is read back (forward and backward)
    and the output gradient of every unit but the head (backward).
    With a copy engine (a GPU: `DeviceProfile.async_copies`; an emulated link, `pcie=`:
    `boundary_writes_in_compute` False) the copies are a queue of their own beside the
    compute and the collectives (runtime/boundary.py): the writes never hold the compute, a
    read of a unit's input does (the unit needs it at once), a read of an output gradient
    runs beside the unit's recompute and holds the backward only for what is left of it. So
    a unit's forward costs max(compute + input read, gather, all its copies) and its backward
    max(compute + input read + max(0, gradient read - recompute), gather + reduce-scatter,
    all its copies + gradient copy down), each sum one queue's work. A device copying with
    plain memcpys on its compute thread (a CPU without `pcie=`) has its writes in the
    profiled compute (a memcpy into host memory costs what one into device memory does) and
    adds each read: a unit costs max(compute + reads, collectives).
    A rank that does not overlap its reduce-scatters (plan `overlap_reduce` false: one unit
    gradient less on the device) waits for each one after its unit's backward: that unit's
    backward costs max(compute, gather, copies) + scatter.
  optimizer:  s * P * optimizer_s_per_param (after the last reduce-scatter; not overlapped)
  host state (plan `host_state_fraction` h; x = h * s of the model lives on the host): the
    reduce-scatter output of that part goes down to the host (x * P_u * 4 bytes per unit at the
    host bandwidth: on a GPU beside the next unit's backward, so a unit's backward costs
    max(compute, gather + scatter, boundary copy + gradient copy), the embedding's copy after
    its reduce-scatter not hidden; on a CPU on the compute thread, added); the host runs
    AdamW on it (x * P * host_optimizer_s_per_param of this rank: the node's host shared by its
    ranks) and the updated compute-dtype parameters go back up (x * P * d bytes). The device
    optimizer then works on (s - x) * P. On a GPU the host step, the uploads (pipelined unit
    by unit) and the device optimizer run at once: the optimizer phase is the largest of the
    three; on a CPU they add up.
  step time of the rank: sum over units and passes + optimizer; a rank with b = 0 still
  takes part in every collective, so it costs the collective time.

  peak memory: `costmodel/memory.py` (`MemoryModel`, this class's memory half).

  adapters (LoRA, QLoRA: `CostModel.adapter`): the same formulas over `costmodel/layout.py`'s
    per-unit quantities: the gathers move the frozen base in its storage bytes (compute dtype or
    NF4) and the adapters in the compute dtype, the fp32 gradients, reduce-scatters and the
    optimizer cover only the adapters, the state is the frozen shard + 16 B per adapter
    parameter, and the measured pass times are scaled for the skipped weight gradients of the
    frozen matmuls (and QLoRA's dequantization added); host state is for full fine-tuning only.

  DPO (`AdapterSpec.objective`, preference/objective.py): a sample is a pair, two sequences,
    so every profile curve is read at 2 m (`TypeTables(rows=2)`) and a sample's boundary and
    logits bytes double; the head's pass adds a forward (the rows' log-probabilities before
    the weighted pass), and under an adapter every unit's forward runs twice (the reference,
    adapters off, beside the policy: no extra gather).

  host memory: x * P * (16 + d unless fp32: the pinned compute-dtype copy the uploads read) +
  the offloaded boundaries ((L + 1) * b * seq * hidden * d); the ranks of a node share its
  `HostResources.memory_bytes`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from cephalo.costmodel.collectives import (
    Collectives,
    split_padding,
)
from cephalo.costmodel.curve_tables import TypeTables
from cephalo.costmodel.host import (
    HOST_STATE_BYTES_PER_PARAM,
    HostResources,
)
from cephalo.costmodel.layout import param_layout
from cephalo.costmodel.memory import (
    GRAD_BYTES,
    LOGIT_BYTES,
    MemoryModel,
    device_reserve_bytes,
)
from cephalo.costmodel.results import MemoryBreakdown, PlanEvaluation, RankCost
from cephalo.costmodel.rules import fused_tail_possible, rank_fuses_tail
from cephalo.costmodel.shard_groups import CrossReduce, Links, ShardGroupCosts, cross_reduce_times
from cephalo.costmodel.stages import StageCosts
from cephalo.errors import CephaloError
from cephalo.planner.plan import Plan
from cephalo.specs.adapter import AdapterSpec
from cephalo.specs.catalog.devices import DTYPE_BYTES
from cephalo.specs.model import ModelSpec
from cephalo.specs.profile import CommProfile, DeviceProfile

DEFAULT_RESERVE_FRACTION = 0.05
"""Share of each device's memory kept free for fragmentation and library workspaces."""


class DeviceLike(Protocol):
    """What the cost model reads of a device (`cephalo.specs.cluster.Device` satisfies it)."""

    type_key: str
    memory_bytes: int


class CostModel(StageCosts, ShardGroupCosts, MemoryModel):
    """Time and memory of each rank of a cluster for one model, sequence length and dtype."""

    def __init__(
        self,
        model: ModelSpec,
        seq_len: int,
        dtype: str,
        devices: list[DeviceLike],
        profiles: dict[str, DeviceProfile],
        comm: CommProfile,
        reserve_bytes: int | None = None,
        reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
        meta: dict[str, Any] | None = None,
        reserve_extra_bytes: int = 0,
        host: HostResources | None = None,
        serial_reduce: bool = False,
        adapter: AdapterSpec | None = None,
        links: Links | None = None,
        cross_reduce: CrossReduce | None = None,
        padded_collectives: bool = False,
        fuse_tail: bool = True,
    ):
        if dtype not in DTYPE_BYTES:
            raise CephaloError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        if seq_len < 1:
            raise CephaloError(f"seq_len must be >= 1, got {seq_len}")
        if not devices:
            raise CephaloError("the cluster has no devices")
        missing = sorted({d.type_key for d in devices} - set(profiles))
        if missing:
            raise CephaloError(
                f"no profile for device type(s) {', '.join(missing)}; profile them or use the catalog"
            )
        for key, p in profiles.items():
            absent = {"embedding", "block", "head"} - set(p.units)
            if absent:
                raise CephaloError(
                    f"profile of {key!r} lacks unit kind(s) {', '.join(sorted(absent))}"
                )
        if host is not None and (
            len(host.node_of) != len(devices) or len(host.optimizer_s_per_param) != len(devices)
        ):
            raise CephaloError(
                f"the host resources describe {len(host.node_of)} ranks but the cluster has {len(devices)}"
            )
        if links is not None and len(links.node_of) != len(devices):
            raise CephaloError(
                f"the links describe {len(links.node_of)} ranks but the cluster has {len(devices)}"
            )
        self.links = links
        """Intra- and inter-node links (None: every collective at `comm`'s bandwidth)."""
        self.cross_reduce = cross_reduce
        """The all-reduce between shard groups this model's ranks take part in (None: a flat plan)."""
        self.fused_tail_possible = fused_tail_possible(
            blocks=model.num_layers,
            moe=model.num_experts > 0,
            quantized=(adapter or AdapterSpec()).quantized,
            hierarchical=cross_reduce is not None and cross_reduce.groups > 1,
        )
        """Whether the model and plan allow the fused tail (costmodel/rules.py): then
        every rank keeps the last block gathered from its forward to its backward."""
        self.fuse_tail = fuse_tail
        """Whether ranks that overlap their reduce-scatters and keep their boundaries on the
        device run the last block in the head's pass (`EngineConfig.fuse_tail`: off only to
        compare)."""
        self.host = host
        """The hosts (memory per node, AdamW speed per rank); None: the planner keeps all state on
        the devices and host memory is not checked."""
        self.serial_reduce = serial_reduce
        """Whether the planner may turn off a rank's reduce-scatter overlap to save a unit gradient."""
        self.model = model
        self.seq_len = seq_len
        self.dtype = dtype
        self.devices = list(devices)
        self.profiles = profiles
        self.comm = comm
        self.reserve_bytes = reserve_bytes
        self.reserve_fraction = reserve_fraction
        # what calibration measured beyond each device's own reserve (train/calibration.py):
        # added to every device's reserve, not one absolute reserve for all, so a mixed
        # cluster's small device is not held to the largest one's fragmentation share
        self.reserve_extra_bytes = int(reserve_extra_bytes)
        self.meta = dict(meta or {})
        self.dtype_bytes = DTYPE_BYTES[dtype]
        self.total_params = model.total_params
        self.adapter = adapter or AdapterSpec()
        rows = self.adapter.rows_per_sample  # DPO: a sample (pair) is 2 profiled sequences
        self._tables = {k: TypeTables(p, rows) for k, p in profiles.items()}
        """What is trained: everything, or LoRA adapters on a frozen (NF4 for qlora) base."""
        self.layout = param_layout(model, seq_len, self.dtype_bytes, self.adapter)
        """Per unit kind: the bytes gathered and held, the trained parameters (layout.py)."""
        self.optimizer_params = self.layout.trained_params
        """Parameters the optimizer steps at state fraction 1 (all, or the adapters)."""
        self._time_factors = {k: self.layout.time_factors(p) for k, p in profiles.items()}
        self._rank_costs: dict[tuple, RankCost] = {}
        """`evaluate`'s rank costs by what they depend on, kept across calls: a plan's search
        evaluates the same ranks many times (its choices with and without the padding charge,
        then the plan's predictions). Keyed by all a rank's cost reads that a caller may set
        on a made model (`serial_reduce`, `host`); the rest is fixed at construction."""
        if self.adapter.frozen_base:  # plans made with this model carry it (`evaluate` checks)
            self.meta["adapter"] = self.adapter.to_dict()

        # Parameters each kind of unit gathers. A tied head gathers the token embedding too.
        head_gathered = model.head_params + (
            model.vocab_size * model.hidden_size if model.tied_embeddings else 0
        )
        self.gathered_params = {
            "embedding": model.embedding_params,
            "block": model.params_per_block,
            "head": head_gathered,
        }
        self.unit_counts = {"embedding": 1, "block": model.num_layers, "head": 1}
        # The staging copies of the boundaries read back, per pass (see the module docstring).
        self.sync_copies_fwd = {"embedding": 0, "block": 1, "head": 1}
        self.sync_copies_bwd = {"embedding": 1, "block": 2, "head": 1}
        # Of those, the output gradients a unit reads back for its backward (read beside its
        # recompute, runtime/boundary.py `loaded(deferred=True)`): the embedding's and every
        # block's; the head's backward reads its input only.
        self.gout_reads = {"embedding": 1, "block": 1, "head": 0}
        # The boundary writes to the host, per pass: every unit's output but the head's in
        # forward, every unit's input gradient but the embedding's in backward.
        self.writes_fwd = {"embedding": 1, "block": 1, "head": 0}
        self.writes_bwd = {"embedding": 0, "block": 1, "head": 1}

        n = len(self.devices)
        self.padded_collectives = bool(padded_collectives)
        """Whether the runtime pads this cluster's near-even splits, so `evaluate` and the planner
        charge the padding (collective_cost.py). `costmodel.sources` sets it from the cluster
        (`backend_pads`: CUDA GPUs over NCCL yes, CPUs over gloo no); a cost model built by
        hand knows no backend and charges none unless told."""
        own = self.layout.owned_trained
        # the elements of each kind of unit the runtime pads: the unit's own trained ones (a tied
        # head's borrowed embedding and an adapter run's frozen base are gathered unpadded)
        self.padded_params = {
            "embedding": own[0],
            "block": own[1] if model.num_layers else 0,
            "head": own[-1],
        }
        """Per unit kind: the trained elements its padded buffers hold N x u of."""
        largest = {
            "embedding": model.vocab_size * model.hidden_size,
            "block": max(
                (lin.weight_params for lin in model.block_linears),
                default=model.params_per_block,
            ),
            "head": model.head_params,
        }
        self.straddle_params = {
            k: (n - 1) // 2 * min(largest[k], p) for k, p in self.padded_params.items()
        }
        """Per unit kind, padded: the elements of its parameters that straddle padding, which a
        computing unit holds as copies (runtime/collectives/padded.py `views`: between an odd rank's piece
        and the next one's, at most one parameter each; bounded by the largest, the token
        embedding's, a block's largest Linear weight or the head)."""
        self.collectives = Collectives.ring(
            n,
            comm.bytes_per_s,
            comm.latency_s,
            {k: u.gather_bytes for k, u in self.layout.units.items()},
            {k: p * self.dtype_bytes for k, p in self.padded_params.items()},
            {k: u.trained * GRAD_BYTES for k, u in self.layout.units.items()},
        )
        """The ring collectives of each kind of unit, padded or not (collective_cost.py)."""
        self.gather_s = self.collectives.gather_s
        """Per unit kind: one all-gather (overlapped with compute by the prefetch), unpadded."""
        self.scatter_s = self.collectives.scatter_s
        """Per unit kind: the reduce-scatter of its gradient (overlapped with the next backward)."""
        self.cross_reduce_s = cross_reduce_times(self.layout, cross_reduce)
        """Per unit kind: its gradient's all-reduce between shard groups (hierarchical plans),
        started once the unit's reduce-scatter is done, one after another on the node's link."""
        self.cross_reduce_total_s = sum(
            c * self.cross_reduce_s[k] for k, c in self.unit_counts.items()
        )
        """Every unit's all-reduce between shard groups, one after another on the node's link:
        no rank of a hierarchical plan steps faster (its backward phase waits for them)."""

        self.reduce_out_bytes_per_fraction = (
            max(u.trained for u in self.layout.units.values()) * GRAD_BYTES
        )
        """The largest unit's reduce-scatter output at state fraction 1 (a rank receives s of
        it); counted in every phase of the peak, an upper bound that keeps memory linear in s."""
        self.bytes_per_fraction = self.layout.state_bytes + self.reduce_out_bytes_per_fraction
        """Device bytes that grow with the state fraction s, per unit of s: the state and the
        reduce-scatter output."""
        self.sample_boundary_bytes = rows * seq_len * model.hidden_size * self.dtype_bytes
        self.sample_logit_bytes = rows * seq_len * model.vocab_size * LOGIT_BYTES
        self.host_part_device_bytes_per_fraction = (
            self.total_params * self.dtype_bytes + self.reduce_out_bytes_per_fraction
        )
        """Device bytes per unit of host-held fraction x: its compute-dtype copy and its share of
        the reduce-scatter output (which lands on the device before it goes down)."""
        self.padding_bytes_per_fraction = self.reduce_out_bytes_per_fraction + (
            self.optimizer_params * GRAD_BYTES if dtype == "fp32" else 0
        )
        """Padded-even (collective_cost.py): the device bytes a rank holds at u instead of at its
        own fraction s, per unit of fraction: the reduce-scatter output (a whole padded chunk)
        and, in fp32, the shard buffer a gather sends from (the master lives inside it)."""
        self.host_bytes_per_param = HOST_STATE_BYTES_PER_PARAM + (
            0 if dtype == "fp32" else self.dtype_bytes
        )
        """Host bytes per host-held parameter: the state, plus (unless fp32) the pinned
        compute-dtype copy the uploads read."""
        self.grad_copy_params = sum(
            c * self.layout.units[k].trained for k, c in self.unit_counts.items()
        )
        """Gradient elements reduce-scattered per step per unit of state fraction (a tied head
        reduces its borrowed embedding slice too): what goes down to the host at x = 1."""

    # ------------------------------------------------------------------ per-device constants
    def capacity_bytes(self, rank: int) -> int:
        return int(self.devices[rank].memory_bytes)

    def reserve_for(self, capacity_bytes: int, type_key: str = "cpu") -> int:
        """Device memory kept free: `reserve_bytes` when given (calibration, tests), else the
        fragmentation share of the capacity plus what no tensor holds on that device type (the
        context, workspaces, a communicator per process group: `device_reserve_bytes`)."""
        if self.reserve_bytes is not None:
            return int(self.reserve_bytes) + self.reserve_extra_bytes
        groups = 1 if self.cross_reduce is None else self.cross_reduce.groups
        fixed = device_reserve_bytes(type_key, groups)
        return int(self.reserve_fraction * capacity_bytes) + fixed + self.reserve_extra_bytes

    def optimizer_s_per_param(self, type_key: str) -> float:
        return self.profiles[type_key].optimizer_s_per_param

    # ------------------------------------------------------------------ formulas (broadcasting)
    def _pass_times(self, type_key: str, b, m):
        """Per unit kind: (forward, recompute + backward) kernel time of b samples in micro-batches of m."""
        b = np.asarray(b, dtype=np.int64)
        m = np.maximum(np.asarray(m, dtype=np.int64), 1)
        k = -(-b // m)  # ceil
        full = np.maximum(k - 1, 0)
        last = np.where(b > 0, b - full * m, 0)
        t = self._tables[type_key]
        out = {}
        for kind in self.unit_counts:
            # adapters: the frozen matmuls' skipped weight gradients, QLoRA's dequantization
            # once per pass of a unit that computes (layout.py)
            f_fwd, f_bwd, dequant = self._time_factors[type_key][kind]
            deq = np.where(b > 0, dequant, 0.0)
            fwd = (full * t.fwd[kind].at(m) + t.fwd[kind].at(last)) * f_fwd + deq
            # the head computes its loss and backward in one pass (runtime/head_loss.py): no
            # recompute
            recompute = 0.0 if kind == "head" else fwd
            bwd = recompute + (full * t.bwd[kind].at(m) + t.bwd[kind].at(last)) * f_bwd
            if self.adapter.objective == "dpo" and kind == "head":
                bwd = bwd + fwd  # DPO: the rows' log-probabilities first, without a graph
            if self.adapter.reference_forward:
                fwd = 2 * fwd  # DPO under an adapter: the reference's forward beside it
            out[kind] = (fwd, bwd)
        return out

    def step_time_parts(
        self, type_key: str, b, m, offload, overlap_reduce=True, host_part=0.0, pad=0.0, fuse=True
    ):
        """(time without the optimizer, compute, host-copy time) of a rank; broadcasts over b,
        m, offload, overlap_reduce and host_part (x = h * s, the host-held fraction of the model,
        whose gradients go down to the host in the backward).

        The optimizer (`optimizer_phase_s`) is added by the caller because the planner chooses
        s after the rest. On a device without async copies the compute includes the boundary
        copies (the gradient copies to the host run outside the unit compute, on the same thread).
        `pad`: the split's largest fraction where it runs padded-even, else 0 (`split_padding`):
        its collectives then move the padding too (collective_cost.py). `fuse`: the plan's
        `fuse_tail` (broadcasts; the rank fuses where it also allows it, `_fused`).
        """
        return self.step_time_of_passes(
            type_key,
            b,
            self._pass_times(type_key, b, m),
            offload,
            overlap_reduce,
            host_part,
            pad,
            fuse,
        )

    def fastest_pass_times(self, type_key: str, b, max_micro_batch: int):
        """Per unit kind: the least forward and the least recompute + backward kernel time of b
        samples over every micro-batch 1..min(b, max_micro_batch), each minimised on its own;
        non-decreasing in b (a suffix minimum). Fed to `step_time_of_passes` with offload off,
        it gives a lower bound on `step_time_parts(type_key, b, m, o)[0]` for every such m and
        any o: that time only grows with each pass time, and offload only adds copies."""
        b = np.atleast_1d(np.asarray(b, dtype=np.int64))
        ms = np.arange(1, max(1, int(max_micro_batch)) + 1)
        least: dict[str, list[list[np.ndarray]]] = {k: [[], []] for k in self.unit_counts}
        rows = max(1, 2**20 // len(ms))  # b x m tables of at most a million entries at a time
        for start in range(0, len(b), rows):
            bb = b[start : start + rows, None]
            usable = ms[None, :] <= np.maximum(bb, 1)
            for kind, passes in self._pass_times(type_key, bb, ms[None, :]).items():
                for i, t in enumerate(passes):
                    least[kind][i].append(np.where(usable, t, np.inf).min(axis=1))
        out = {}
        for kind, (fwd, bwd) in least.items():
            # suffix minimum: never falling with b
            f, w = np.concatenate(fwd), np.concatenate(bwd)
            out[kind] = (np.minimum.accumulate(f[::-1])[::-1], np.minimum.accumulate(w[::-1])[::-1])
        return out

    def step_time_of_passes(
        self,
        type_key: str,
        b,
        passes,
        offload,
        overlap_reduce=True,
        host_part=0.0,
        pad=0.0,
        fuse=True,
    ):
        """`step_time_parts` from per-kind (forward, recompute + backward) kernel times: the
        collectives and host copies each pass overlaps with, and the last reduce-scatter.
        Overlapping the reduce-scatter and keeping no state on the host give the least time
        (each other choice only adds to a pass or enters a max)."""
        b = np.asarray(b, dtype=np.int64)
        offload = np.asarray(offload, dtype=bool)
        overlap = np.asarray(overlap_reduce, dtype=bool)
        x = np.asarray(host_part, dtype=np.float64)
        hosted = bool(np.any(x))
        profile = self.profiles[type_key]
        bw = profile.host_copy_bytes_per_s
        copy_one = np.where(offload, b * self.sample_boundary_bytes / bw, 0.0)
        forward_total = 0.0
        total = 0.0
        head_backward = 0.0
        compute = 0.0
        copies = 0.0
        grad_copies = 0.0
        fused = self._fused(overlap, offload, fuse)
        for kind, (fwd, bwd) in passes.items():
            count = self.unit_counts[kind]
            gather = self.collectives.gather(kind, pad)
            scatter = self.collectives.scatter(kind, pad)
            # the head is not gathered again in the backward (runtime/head_loss.py)
            gather_b = 0.0 if kind == "head" else gather
            # with overlap, the reduce-scatter a unit's backward hides is the one of the unit
            # before it in the backward (approximated by its own kind's): the head, first, hides
            # none, and the embedding's own is the step's tail (one scatter per unit in all)
            hidden_scatter = 0.0 if kind == "head" else scatter
            grad_down = x * self.gathered_params[kind] * GRAD_BYTES / bw if hosted else 0.0
            if profile.async_copies or not profile.boundary_writes_in_compute:
                # a copy engine (a GPU's, or an emulated link's): the writes to the host and
                # the reads back are one queue of their own; the compute waits for a read of
                # its input at once, for a block's output gradient only after its recompute
                # (runtime/boundary.py: that read runs beside it); the gradient going down
                # (host state) queues there too
                reads_f = copy_one * self.sync_copies_fwd[kind]
                gout = copy_one * self.gout_reads[kind]
                reads_b = copy_one * self.sync_copies_bwd[kind] - gout
                recompute = 0.0 if kind == "head" else fwd
                late = np.maximum(gout - recompute, 0.0)
                cf = reads_f + copy_one * self.writes_fwd[kind]
                cb = reads_b + gout + copy_one * self.writes_bwd[kind]
                # three queues beside the compute: the group's collectives (one communicator:
                # the next unit's gather and the last unit's reduce-scatter one after the
                # other), the copies, and the compute itself
                hidden = np.maximum(bwd + reads_b + late, cb + grad_down)
                backward = np.where(
                    overlap,
                    np.maximum(hidden, gather_b + hidden_scatter),
                    np.maximum(hidden, gather_b) + scatter,
                )
                forward = np.maximum(np.maximum(fwd + reads_f, gather), cf)
                compute = compute + count * (fwd + bwd)
                if kind == "block" and self.fused_tail_possible:
                    # the last block is not gathered again for its backward; fused, not
                    # recomputed either (costmodel/rules.py)
                    own = np.where(fused, bwd - fwd, bwd)
                    last = np.maximum(own + reads_b + late, cb + grad_down)
                    last = np.where(overlap, np.maximum(last, scatter), last + scatter)
                    total = total + last - backward
                    compute = compute - np.where(fused, fwd, 0.0)
            else:
                # memcpys on the compute thread (the writes are in the profiled compute)
                cf = copy_one * self.sync_copies_fwd[kind]
                cb = copy_one * self.sync_copies_bwd[kind]
                backward = np.where(
                    overlap,
                    np.maximum(bwd + cb, gather_b + hidden_scatter),  # one queue for the group
                    np.maximum(bwd + cb, gather_b) + scatter,
                )
                forward = np.maximum(fwd + cf, gather)
                backward = backward + grad_down
                compute = compute + count * (fwd + bwd + cf + cb)
                if kind == "block" and self.fused_tail_possible:
                    # the last block is not gathered again for its backward; fused, not
                    # recomputed either (costmodel/rules.py)
                    own = np.where(fused, bwd - fwd, bwd)
                    last = np.where(
                        overlap,
                        np.maximum(own + cb, scatter),
                        own + cb + scatter,
                    )
                    total = total + last + grad_down - backward
                    compute = compute - np.where(fused, fwd, 0.0)
            forward_total = forward_total + count * forward
            total = total + count * backward
            if kind == "head":
                head_backward = count * backward
            copies = copies + count * (cf + cb)
            grad_copies = grad_copies + count * grad_down
        # the embedding's reduce-scatter (with overlap; without, every unit's is counted) and, on
        # a GPU, the copy of its gradient to the host, last of the backward, have no compute left
        # to hide under
        tail = np.where(overlap, self.collectives.scatter("embedding", pad), 0.0)
        if profile.async_copies and hosted:
            tail = tail + x * self.gathered_params["embedding"] * GRAD_BYTES / bw
        backward_phase = total + tail
        if self.cross_reduce is not None and self.cross_reduce.groups > 1:
            # hierarchical: each unit's gradient shard is all-reduced between the groups once its
            # reduce-scatter is done, one unit after another on the node's link, beside the
            # backward of the units before it; the embedding's, last, has nothing to hide under
            ar = self.cross_reduce_s
            backward_phase = np.maximum(
                backward_phase + ar["embedding"], head_backward + self.cross_reduce_total_s
            )
        return forward_total + backward_phase, compute, copies

    def _fused(self, overlap, offload, fuse):
        """Where a rank runs the fused tail (costmodel/rules.py): the model allows it, this
        cost model's `fuse_tail`, the plan's (`fuse`) and the rank's own choices. Broadcasts."""
        allowed = rank_fuses_tail(self.fused_tail_possible and self.fuse_tail, overlap, offload)
        return np.logical_and(allowed, np.asarray(fuse, dtype=bool))

    def host_rates(self, rank: int) -> tuple[float, float, float]:
        """Per host-held parameter on `rank`: (gradient copy down, upload of the compute-dtype
        copy, host AdamW) seconds; (inf, inf, inf) without host resources."""
        if self.host is None:
            return math.inf, math.inf, math.inf
        bw = self.profiles[self.devices[rank].type_key].host_copy_bytes_per_s
        grad = self.grad_copy_params / self.total_params * GRAD_BYTES / bw
        return grad, self.dtype_bytes / bw, self.host.optimizer_s_per_param[rank]

    def optimizer_phase_s(
        self, rank: int, state_fraction, host_part
    ) -> tuple[np.ndarray, np.ndarray]:
        """(optimizer phase seconds, of which host-state work) of `rank` owning `state_fraction`
        of the model, `host_part` of it on the host; broadcasts."""
        s = np.asarray(state_fraction, dtype=np.float64)
        x = np.asarray(host_part, dtype=np.float64)
        key = self.devices[rank].type_key
        device = (s - x) * self.optimizer_params * self.optimizer_s_per_param(key)
        if self.host is None:
            return device + 0.0 * x, np.zeros(np.broadcast_shapes(s.shape, x.shape))
        _, up, opt = self.host_rates(rank)
        host_opt = x * self.total_params * opt
        upload = x * self.total_params * up
        if self.profiles[key].async_copies:
            # the device optimizer's kernels, the host's AdamW and the uploads (each unit as
            # soon as the host has updated it) run at once
            return np.maximum(np.maximum(device, host_opt), upload), host_opt + upload
        return device + host_opt + upload, host_opt + upload

    def split_padding(self, fractions) -> float:
        """The `pad` of a split of state fractions over this cluster: its largest fraction where
        the runtime pads it (`padded_collectives` and near even), else 0 (collective_cost.py)."""
        return split_padding(list(fractions), self.padded_collectives)

    # ------------------------------------------------------------------ one rank, one plan
    def rank_cost(
        self,
        rank: int,
        batch_size: int,
        micro_batch_size: int,
        state_fraction: float,
        offload: bool = False,
        host_fraction: float = 0.0,
        overlap_reduce: bool = True,
        pad: float = 0.0,
        fuse_tail: bool = True,
    ) -> RankCost:
        """One rank's time and memory; `host_fraction` is the plan's `host_state_fraction` h (the
        part of this rank's shard on the host); `pad` the split's largest fraction where it runs
        padded-even (`split_padding`; `evaluate` finds it), else 0: its collectives and padded
        buffers are then charged (collective_cost.py)."""
        if not 0.0 <= host_fraction <= 1.0:
            raise CephaloError(
                f"rank {rank}: host_state_fraction must be in [0, 1] (0: all state on the device, "
                f"1: all on the host), got {host_fraction}"
            )
        if host_fraction > 0 and state_fraction > 0 and self.adapter.frozen_base:
            raise CephaloError(
                f"rank {rank} keeps state on the host (host_state_fraction {host_fraction:g}), "
                f"which {self.adapter.mode} does not support: set it to 0"
            )
        if host_fraction > 0 and state_fraction > 0 and self.host is None:
            raise CephaloError(
                f"rank {rank} keeps state on the host (host_state_fraction {host_fraction:g}) but this "
                "cost model knows no hosts; build it from a cluster (costmodel.sources)"
            )
        dev = self.devices[rank]
        key = dev.type_key
        cap = self.capacity_bytes(rank)
        x = state_fraction * host_fraction
        total, compute, copies = self.step_time_parts(
            key, batch_size, micro_batch_size, offload, overlap_reduce, x, pad, fuse_tail
        )
        opt, host_s = self.optimizer_phase_s(rank, state_fraction, x)
        parts = self.memory_parts(
            key,
            cap,
            batch_size,
            micro_batch_size,
            offload,
            overlap_reduce,
            state_fraction,
            x,
            pad,
            fuse_tail,
        )
        # padded, a rank receives a whole padded chunk of each reduce-scatter (u, not s) and in
        # fp32 sends its gathers from a padded chunk holding its master (collective_cost.py)
        held = max(pad, state_fraction) if pad > 0 else state_fraction
        parts["grad_accum"] = parts["grad_accum"] + held * self.reduce_out_bytes_per_fraction
        parts["state"] = parts["state"] + (held - state_fraction) * (
            self.padding_bytes_per_fraction - self.reduce_out_bytes_per_fraction
        )
        mem = MemoryBreakdown(**{k: int(math.ceil(float(v))) for k, v in parts.items()})
        grad_down = (
            x * self.grad_copy_params * GRAD_BYTES / self.profiles[key].host_copy_bytes_per_s
        )
        node = self.host.node_of[rank] if self.host is not None else 0
        return RankCost(
            rank=rank,
            device=key,
            step_s=float(total) + float(opt),
            compute_s=float(compute),
            optimizer_s=float(opt),
            comm_s=self.comm_s(pad),
            host_copy_s=float(copies),
            memory=mem,
            capacity_bytes=cap,
            host_state_s=float(host_s) + grad_down,
            host_bytes=int(math.ceil(float(self.host_bytes(batch_size, offload, x)))),
            node=node,
            host_capacity_bytes=self.host.memory_bytes[node] if self.host is not None else None,
            fused_tail=bool(self._fused(overlap_reduce, offload, fuse_tail)),
        )

    def comm_s(self, pad: float = 0.0) -> float:
        """Every collective of a step (two gathers and a reduce-scatter per unit, the all-reduce
        between shard groups), mostly hidden under compute; padded to `pad` where it is."""
        c = self.collectives
        return sum(
            n * (2 * c.gather(k, pad) + c.scatter(k, pad) + self.cross_reduce_s[k])
            for k, n in self.unit_counts.items()
        )

    def evaluate(self, plan: Plan, charge_padding: bool = True) -> PlanEvaluation:
        """Per-rank time and memory of any plan (made by the planner or by hand).
        `charge_padding` False: as if its split ran unpadded (the planner's relaxation)."""
        if plan.world_size != len(self.devices):
            raise CephaloError(
                f"the plan has {plan.world_size} ranks but the cluster has {len(self.devices)} devices; "
                "simulate it on the cluster it was made for (--cluster)"
            )
        if plan.seq_len != self.seq_len or plan.dtype != self.dtype:
            raise CephaloError(
                f"the plan is for seq_len {plan.seq_len} / {plan.dtype} but the cost model for "
                f"seq_len {self.seq_len} / {self.dtype}"
            )
        planned = AdapterSpec.from_dict(plan.meta.get("adapter"))
        if "adapter" in plan.meta and planned != self.adapter:
            raise CephaloError(
                f"the plan is for {planned.describe()} but the cost model for "
                f"{self.adapter.describe()}; evaluate it with the plan's adapter settings"
            )
        for r, d in zip(plan.ranks, self.devices, strict=True):
            if r.device != d.type_key:
                raise CephaloError(
                    f"rank {r.rank} of the plan is a {r.device!r} but device {r.rank} of the cluster is a "
                    f"{d.type_key!r}; list the devices in the plan's order"
                )
        if plan.staged:  # pipeline stages (costmodel/stages.py)
            return self._evaluate_stages(plan)
        if plan.hierarchical and self.cross_reduce is None:
            return self._evaluate_groups(plan)
        # the split runs padded-even where the backend pads and it is near even: every rank's
        # collectives and padded buffers are charged for it (collective_cost.py)
        pad = self.split_padding(plan.state_fractions) if charge_padding else 0.0
        # identical ranks doing identical work cost the same: compute each combination once
        # (a 1024-GPU plan has a handful), and once for all the plans evaluated on this model
        cache = self._rank_costs
        costs = []
        for r, d in zip(plan.ranks, self.devices, strict=True):
            key = (
                d.type_key,
                int(d.memory_bytes),
                r.batch_size,
                r.micro_batch_size,
                r.state_fraction,
                r.offload_activations,
                r.host_state_fraction,
                r.overlap_reduce,
                # the node enters a rank's cost only through its host memory (nodes of one GPU
                # each: one combination per kind of node, not per node)
                None if self.host is None else self.host.memory_bytes[self.host.node_of[r.rank]],
                None if self.host is None else self.host.optimizer_s_per_param[r.rank],
                pad,
                # the one setting callers change on a made model (bench/hetero_throughput.py)
                self.serial_reduce,
                r.fuse_tail,
            )
            if key not in cache:
                cache[key] = self.rank_cost(
                    r.rank,
                    r.batch_size,
                    r.micro_batch_size,
                    r.state_fraction,
                    r.offload_activations,
                    r.host_state_fraction,
                    r.overlap_reduce,
                    pad,
                    r.fuse_tail,
                )
            node = self.host.node_of[r.rank] if self.host is not None else 0
            costs.append(replace(cache[key], rank=r.rank, node=node))
        return PlanEvaluation(
            ranks=costs, global_batch_size=plan.global_batch_size, seq_len=plan.seq_len
        )
