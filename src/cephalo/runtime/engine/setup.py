"""The engine's set-up, one step per function, in the order `Engine.__init__` calls them
(runtime/engine/engine.py): the shard groups (`attach_shard_groups`), the compute device
(`compute_device`), this rank's shards of every unit with their initial values, the frozen
base and the tie table (`build_shards`), whether the last block stays gathered and runs in the
head's pass (`plan_tail`), the boundary store and its pinned arena (`apply_offload`), the
device optimizer (`build_optimizer`) and the host-held part's (`apply_host_state`). Each
returns what it made; none keeps anything."""

from __future__ import annotations

import torch

from cephalo.costmodel.rules import fused_tail_possible, rank_fuses_tail
from cephalo.modeling.units import UnitModel
from cephalo.planner.plan import Plan, RankPlan
from cephalo.runtime.boundary import BoundaryStore
from cephalo.runtime.collectives.comm import Comm
from cephalo.runtime.collectives.emulated import EmulatedStream, faithful
from cephalo.runtime.collectives.padded import PaddedSplit
from cephalo.runtime.collectives.shard_groups import ShardGroupSync, attach_shard_group_sync
from cephalo.runtime.device_memory import host_memory
from cephalo.runtime.engine.config import EngineConfig
from cephalo.runtime.memory import MemoryLedger
from cephalo.runtime.state.adamw import ShardedAdamW, ShardGroup
from cephalo.runtime.state.flat import FlatLayout, overlap, shard_ranges
from cephalo.runtime.state.frozen import FrozenBase
from cephalo.runtime.state.host_state import HostAdamW, HostGroup, HostLink
from cephalo.runtime.state.param_groups import wants_weight_decay
from cephalo.runtime.state.pinned import ALIGN as PINNED_ALIGN
from cephalo.runtime.state.pinned import PinnedArena
from cephalo.runtime.state.unit_shard import Borrow, UnitShard


def attach_shard_groups(
    plan: Plan, comm: Comm, config: EngineConfig, stream: EmulatedStream | None = None
) -> tuple[Comm, Comm, ShardGroupSync | None]:
    """The comm of every rank, the comm of this rank's shard group and, for a hierarchical plan,
    the all-reduce between groups (runtime/collectives/shard_groups.py; None for a flat plan).
    Every rank calls it: it creates the groups. On an emulated cluster (`config.links` and a
    `stream`) the comms run as NCCL runs them (runtime/collectives/emulated.py): one queue per
    process group (a flat plan's world and group are one communicator, one queue) at the rate
    of the group's slowest link."""
    group_sync = attach_shard_group_sync(plan, comm, config.inter_node_bytes_per_s)
    links = config.links
    if links is None or stream is None:
        if group_sync is not None:
            return comm, group_sync.group_comm, group_sync
        return comm, comm, None
    world = faithful(comm, stream, links.rate(range(comm.world_size)))
    if group_sync is None:
        return world, world, None
    members = group_sync.members
    group_sync.group_comm = faithful(group_sync.group_comm, stream, links.rate(members))
    return world, group_sync.group_comm, group_sync


def compute_device(config: EngineConfig, comm: Comm) -> torch.device:
    """`config.device`, else the current CUDA device under NCCL, else the CPU."""
    if config.device:
        return torch.device(config.device)
    if comm.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def build_shards(
    model: UnitModel,
    plan: Plan,
    comm: Comm,
    group_sync: ShardGroupSync | None,
    config: EngineConfig,
    ledger: MemoryLedger,
    device: torch.device,
    dtype: torch.dtype,
    host_fraction: float,
    lean_grads: bool,
    units: range | None = None,
    fractions: list[float] | None = None,
) -> tuple[list[UnitShard], FrozenBase | None]:
    """Initial weights (identical on every rank: from `config.seed`, or the model's own
    values if it is not on meta), this rank's slices of them (`alloc_unit_state`), the tie
    table, and the frozen base (None: every parameter trains). Leaves the model's parameters
    on meta (`to_meta_params`). `comm`: the shard group's. A pipeline stage passes its `units`
    (only those get shards; the others' initial values are still drawn, so the generator
    gives every unit what it gives in one process) and its ranks' `fractions`; a tied
    parameter owned in another stage is no borrow here (runtime/pipeline/tie.py)."""
    on_meta = any(p.is_meta for p in model.parameters())
    # one generator drawn unit by unit in `named_unit_parameters` order = `init_weights`
    generator = torch.Generator().manual_seed(config.seed)
    owned: dict[int, list[tuple[str, torch.Tensor]]] = {}
    owner_of: dict[int, tuple[int, str]] = {}
    index_of = {u.name: i for i, u in enumerate(model.units)}
    for unit_name, pname, p in model.named_unit_parameters():
        owned.setdefault(index_of[unit_name], []).append((pname, p))
        owner_of[id(p)] = (index_of[unit_name], pname)
    if fractions is None:
        fractions = group_sync.fractions if group_sync else plan.state_fractions
    padded = config.padded_collectives
    if padded is None:  # (a pipeline stage's run unpadded, as the cost model charges them)
        padded = comm.even_gather and units is None
    shards: list[UnitShard] = []
    # parameters with requires_grad False (a LoRA base) form the frozen base (frozen.py)
    frozen_base: FrozenBase | None = None
    if any(not p.requires_grad for p in model.parameters()):
        frozen_base = FrozenBase(comm, ledger, device, dtype, fractions, model.quantized_parameters)
    for i, unit in enumerate(model.units):
        params = owned.get(i, [])
        if units is not None and i not in units:
            if on_meta:  # drawn and dropped: the next unit's values come out as in one process
                with host_memory():
                    model.initial_values(unit.name, params, generator)
            continue
        if frozen_base is not None:
            frozen = [(n, p) for n, p in params if not p.requires_grad]
            params = [(n, p) for n, p in params if p.requires_grad]
        layout = FlatLayout(unit.name, params)
        us = UnitShard(i, unit, layout, shard_ranges(layout.numel, fractions), comm.rank)
        if padded and comm.world_size > 1:
            us.padded = PaddedSplit.of(us.sizes)
            us.pad_offset = us.padded.offset(comm.rank) if us.padded else 0
        if on_meta:
            # materialise ONE unit's initial values on the CPU (host memory: the largest
            # unit, fp32), keep this rank's slice, drop the rest
            with host_memory():  # not the emulated device's either
                values = model.initial_values(unit.name, owned.get(i, []), generator)
        else:
            values = dict(owned.get(i, []))
        if frozen_base is not None:
            frozen_base.add_unit(i, unit.name, frozen, values)
        with host_memory():
            full = layout.flatten(values)
        del values
        decays = [wants_weight_decay(f"{unit.name}.{name}", p) for name, p in params]
        us.decay_segments = layout.segments_where(decays, us.start, us.size)
        alloc_unit_state(
            us,
            full[us.start : us.start + us.size],
            ledger,
            device,
            dtype,
            host_fraction,
            lean_grads,
        )
        del full  # before the next unit's values exist: at most two units at a time
        shards.append(us)
    if group_sync is not None:  # every rank: the owners' sub-groups of every unit
        group_sync.prepare([us.layout.numel for us in shards])
    by_index = {us.index: us for us in shards}
    for i, unit in enumerate(model.units):
        if i not in by_index:
            continue
        for pname, p in unit.module.named_parameters():
            owner_index, owner_name = owner_of[id(p)]
            if owner_index == i or owner_index not in by_index:  # (another stage's: its tie)
                continue
            if frozen_base is not None and not p.requires_grad:
                frozen_base.tie(i, pname, owner_index, owner_name)
                continue
            owner = by_index[owner_index]
            slot = owner.layout.slot(owner_name)
            pieces = [overlap(s, n, slot.offset, slot.numel) for s, n in owner.ranges]
            lo, hi = pieces[comm.rank]
            by_index[i].borrows.append(
                Borrow(
                    pname,
                    owner,
                    slot,
                    [b - a for a, b in pieces],
                    (lo - owner.start, hi - owner.start),
                )
            )
    to_meta_params(model, device)
    return shards, frozen_base


def alloc_unit_state(
    us: UnitShard,
    values: torch.Tensor,
    ledger: MemoryLedger,
    device: torch.device,
    dtype: torch.dtype,
    host_fraction: float,
    lean_grads: bool,
) -> None:
    """This rank's state of one unit from its shard's initial fp32 `values`: the device
    part, and the host part of `host_fraction` (see runtime/engine/engine.py's docstring). A lean
    rank's (`lean_grads`) gradient shards are left empty: their first reduce-scatter makes
    them (runtime/engine/shard_update.py `GradShards`)."""

    def state(numel: int) -> torch.Tensor:
        return ledger.alloc("state", numel, torch.float32, device=device)

    us.host_n = min(us.size, round(host_fraction * us.size))
    us.dev_n = d = us.size - us.host_n
    if dtype == torch.float32:
        # one device buffer: the device part's master, then the host part's copy
        if us.padded is None:
            us.param_buf = state(us.size).copy_(values)
        else:  # the padded chunk the gathers send (runtime/collectives/padded.py), zero around the shard
            us.send_buf = state(us.padded.pad).zero_()
            o = us.pad_offset
            us.param_buf = us.send_buf[o : o + us.size].copy_(values)
        us.master, us.host_copy = us.param_buf[:d], us.param_buf[d:]
    else:
        us.master = state(d).copy_(values[:d])
        us.host_copy = ledger.alloc("state", us.host_n, dtype, device=device)
        us.host_copy.copy_(values[d:])
    us.grad = us.master[0:0] if lean_grads else state(d).zero_()
    us.exp_avg = state(d).zero_()
    us.exp_avg_sq = state(d).zero_()
    if us.host_n == 0:
        return
    pin = device.type == "cuda"

    def host(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return ledger.alloc("host/state", numel, dtype, pin=pin)

    us.host = HostGroup(
        host(us.host_n).copy_(values[d:]),
        host(us.host_n).zero_(),
        host(us.host_n).zero_(),
        host(us.host_n).zero_(),
        [(max(a, d) - d, b - d) for a, b in us.decay_segments if b > d],
    )
    if dtype != torch.float32:
        us.host_upload = host(us.host_n, dtype)


def to_meta_params(model: UnitModel, device: torch.device) -> None:
    """Replace every parameter by a meta tensor (ties kept: one object per parameter):
    units only ever run on views of gathered buffers. Buffers (the unit contract says
    there are none) would move to the compute device."""
    replaced: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
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
                module._buffers[name] = b.to(device)


def plan_tail(
    model: UnitModel,
    config: EngineConfig,
    rank_plan: RankPlan,
    hierarchical: bool,
    overlap_reduce: bool,
    offload: bool,
) -> tuple[bool, bool]:
    """(fused_tail_possible, fuse_tail): whether the fused tail is possible here, so that the
    last block stays gathered from its forward to its backward (every rank alike: the ranks'
    collectives must match), and whether this rank runs it in the head's pass
    (costmodel/rules.py)."""
    fusable = fused_tail_possible(
        blocks=len(model.units) - 2,
        moe=model.spec.num_experts > 0,
        quantized=bool(model.quantized_parameters),
        hierarchical=hierarchical,
    )
    possible = config.mode == "lga" and fusable  # LGA: the backward follows the whole forward
    fuse_tail = bool(
        config.fuse_tail
        and rank_plan.fuse_tail
        and possible
        and rank_fuses_tail(fusable, overlap_reduce, offload)
    )
    return possible, fuse_tail


def boundary_host_bytes(
    model: UnitModel, plan: Plan, rank_plan: RankPlan, mode: str, dtype: torch.dtype
) -> int:
    """Host bytes of this rank's offloaded boundaries at their peak, as the arena lays them
    out: every unit's input but the first, per micro-batch kept at once (all of them under
    LGA, one in the standard mode), [m, seq, hidden] in compute dtype, each piece aligned
    to `pinned.ALIGN`. The cost model's `host_bytes` counts the same bytes."""
    rp, spec = rank_plan, model.spec
    sizes = rp.micro_batch_sizes()
    kept = sizes if mode == "lga" else sizes[:1]
    piece = [m * plan.seq_len * spec.hidden_size * dtype.itemsize for m in kept]
    aligned = sum(-(-n // PINNED_ALIGN) * PINNED_ALIGN for n in piece)
    return (len(model.units) - 1) * aligned


def apply_offload(
    config: EngineConfig,
    ledger: MemoryLedger,
    device: torch.device,
    offload: bool,
    link: HostLink,
    host_bytes: int,
) -> BoundaryStore:
    """The store of the step's boundary activations (on the host with `offload`), and, where
    pinned memory is wanted (CUDA, or `config.pinned_arena`), the ledger's pinned arena of
    `host_bytes` (`boundary_host_bytes`) the offloaded boundaries are carved from."""
    store = BoundaryStore(
        ledger,
        device,
        offload,
        link=link if config.host_copy_bytes_per_s is not None else None,
    )
    arena = config.pinned_arena if config.pinned_arena is not None else device.type == "cuda"
    if arena and offload and ledger.arena is None:
        with host_memory():  # host memory, not the emulated device's
            ledger.arena = PinnedArena(host_bytes, pin=device.type == "cuda")
    return store


def build_optimizer(
    shards: list[UnitShard],
    config: EngineConfig,
    group_sync: ShardGroupSync | None,
    device: torch.device,
) -> ShardedAdamW:
    """AdamW over the device part of every unit's shard (weight decay on its decayed
    segments); its kernel: `shard_group_kernel`."""
    return ShardedAdamW(
        [
            ShardGroup(
                us.master,
                us.grad,
                us.exp_avg,
                us.exp_avg_sq,
                [(a, min(b, us.dev_n)) for a, b in us.decay_segments if a < us.dev_n],
            )
            for us in shards
        ],
        config.adamw,
        config.adamw_kernel or shard_group_kernel(device, group_sync is not None),
    )


def shard_group_kernel(device: torch.device, hierarchical: bool) -> str | None:
    """The AdamW kernel of a rank's device optimizer where the config names none (None: the
    device's default, `default_adamw_kernel`). The shard groups' copies of the state must stay
    bit-identical, and the fused CPU kernel rounds an element differently in its vector body
    and in its tail, which fall at other elements under another group's shard boundaries: a
    hierarchical plan on the CPU takes the single-tensor kernel. The CUDA fused kernel computes
    every element alike wherever it falls (scripts/gpu_check.py `adamw_split` checks it bit for
    bit), so on CUDA a hierarchical plan keeps the fused kernel and its update without a host
    sync."""
    if hierarchical and device.type == "cpu":
        return "single"
    return None


def apply_host_state(
    shards: list[UnitShard], config: EngineConfig
) -> tuple[HostAdamW | None, list[UnitShard]]:
    """AdamW of the host-held parts (None: all state on the device) and the units that have
    one, in the host optimizer's group order."""
    hosted = [us for us in shards if us.host is not None]
    host_optimizer = (
        HostAdamW([us.host for us in hosted], config.adamw, config.host_adamw, config.host_threads)
        if hosted
        else None
    )
    return host_optimizer, hosted
