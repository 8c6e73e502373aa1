"""Hierarchical sharding at run time: shard groups, and the gradient all-reduce between them.

A hierarchical plan (`Plan.shard_groups`, docs/plan-format.md) splits the ranks into groups, each
holding a whole replica of the training state sharded unevenly over its own ranks. The engine
runs today's uneven all-gathers and reduce-scatters on the group's sub-process-group
(`group_comm`); after the backward, once per step whatever the micro-batches, the ranks that own
the same elements in different groups all-reduce their gradient shards. The groups' shard
boundaries differ, so the reduce runs over the intersections of the ranges: every group's
boundaries cut a unit's buffer into segments, each owned by one rank of each group, and each
segment is all-reduced among its g owners on their own process sub-group (made once, for every
unit, by `prepare`). The backend runs that all-reduce as a ring (gloo, NCCL): each owner sends
2 (g-1)/g of its segment, what the cost model charges (`CostModel.cross_reduce_s`), and every
owner ends with the same sum. In `cross_group_reduce_dtype` bf16 the segments travel as bf16
(half the bytes) but are summed in fp32 (`_Bf16Reduce`): a ring all-reduce in bf16 would round
after every partial sum, g-1 roundings; here each owner receives its chunk of every owner's
segment (an all-to-all), adds them in fp32, rounds once, and the rounded chunks are all-gathered,
the same 2 (g-1)/g of the segment's bf16 bytes a ring sends. Every owner gets the same bits.

Emulation (`inter_node_bytes_per_s`): the exchange is charged a delay per byte its node sends
(the group's ranks share the node's link), as `slowdown` charges compute, so a slow inter-node
network shows on the CPU; the groups' own rings (and a flat plan's) run on the faithful emulated
comm at their links' rates (runtime/collectives/emulated.py).

Under layered gradient accumulation each unit's exchange starts as soon as its gradient shard is
complete (`unit_final`, called by the engine's backward), beside the backward of the units before
it, as the cost model charges it; the sums are made before the optimizer step (`finish`). A
segment whose owners include a rank with host state waits for the optimizer step on every owner
(a sub-group's all-reduces must start in the same order on all of its ranks).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cephalo.errors import CephaloError
from cephalo.planner.plan import Plan
from cephalo.runtime.collectives.comm import Comm, _all_gather_even, make_comm
from cephalo.runtime.state.flat import shard_ranges

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


_REDUCE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _reduce_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream the bf16 cross-group sums run on (one per device, made once)."""
    if device not in _REDUCE_STREAMS:
        _REDUCE_STREAMS[device] = torch.cuda.Stream(device)
    return _REDUCE_STREAMS[device]


@dataclass
class _Bf16Reduce:
    """One segment's all-reduce with bf16 on the wire and an fp32 sum: an all-to-all of the
    owners' bf16 segments (padded to g equal chunks, one per owner), then, once it is done, this
    owner's chunk summed in fp32 and rounded to bf16 once, then an all-gather of the sums."""

    grad: torch.Tensor
    lo: int
    hi: int
    group: object
    received: torch.Tensor
    """(g, chunk) bf16: every owner's chunk of the segment that this owner sums."""
    work: object
    """The all-to-all's, then the all-gather's."""
    gathered: torch.Tensor | None = None

    @classmethod
    def start(cls, grad: torch.Tensor, lo: int, hi: int, group, owners: int) -> _Bf16Reduce:
        n = hi - lo
        chunk = -(-n // owners)
        send = torch.zeros(owners * chunk, dtype=torch.bfloat16, device=grad.device)
        send[:n].copy_(grad[lo:hi])
        received = torch.empty(owners, chunk, dtype=torch.bfloat16, device=grad.device)
        work = dist.all_to_all_single(received.view(-1), send, group=group, async_op=True)
        return cls(grad, lo, hi, group, received, work)

    def gather(self) -> None:
        """Second phase: sum this owner's chunk in fp32 (the all-to-all must have finished) and
        start the all-gather of every owner's rounded sum.

        On CUDA the wait, the sum and the all-gather's start are queued on a side stream: the
        engine calls this inside the backward (the next segment of the same owners starts), and
        on the compute stream `work.wait()` would make the backward's kernels wait for the
        inter-node all-to-all (issue 38, finding 9). The compute stream waits only in `finish`,
        where the sums are consumed. scripts/gpu_check.py (`--collectives`) checks the sums."""
        device = self.received.device
        if device.type != "cuda":
            self.work.wait()
            summed = self.received.float().sum(0).to(torch.bfloat16)
            self.gathered = torch.empty(self.received.numel(), dtype=torch.bfloat16, device=device)
            self.work = _all_gather_even(self.gathered, summed, self.group)
            return
        compute = torch.cuda.current_stream(device)
        side = _reduce_stream(device)
        # allocated on the compute stream: the side stream must not write them before what the
        # compute stream queued earlier (the allocator may hand back a block it still reads)
        self.gathered = torch.empty(self.received.numel(), dtype=torch.bfloat16, device=device)
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            self.work.wait()  # the side stream waits for the all-to-all, not the backward
            summed = self.received.float().sum(0).to(torch.bfloat16)
            self.work = _all_gather_even(self.gathered, summed, self.group)
        self.received.record_stream(side)
        self.gathered.record_stream(side)

    def finish(self) -> None:
        if self.gathered is None:
            self.gather()
        self.work.wait()
        self.grad[self.lo : self.hi].copy_(self.gathered[: self.hi - self.lo])


@dataclass
class _Segment:
    """One intersection of this rank's shard with a rank's shard of every other group."""

    lo: int
    hi: int
    """Relative to this rank's shard start."""
    owners: tuple[int, ...]
    """Its owner in each group, in group order (global ranks; this rank among them)."""


def owner_segments(
    numel: int, groups: list[list[int]], fractions: list[list[float]]
) -> list[tuple[int, int, tuple[int, ...]]]:
    """(start, end, owners) covering [0, numel): where every group's shard boundaries cut the
    buffer, each piece with its owner in each group (consecutive pieces of the same owners
    merged: each owner's range is one interval)."""
    ranges = [shard_ranges(numel, f) for f in fractions]
    cuts = sorted({0, numel, *(s for rs in ranges for s, _ in rs)})
    out: list[tuple[int, int, tuple[int, ...]]] = []
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        if b <= a:
            continue
        owners = tuple(
            next(r for r, (s, n) in zip(members, rs, strict=True) if s <= a < s + n)
            for members, rs in zip(groups, ranges, strict=True)
        )
        if out and out[-1][2] == owners and out[-1][1] == a:
            out[-1] = (out[-1][0], b, owners)
        else:
            out.append((a, b, owners))
    return out


class ShardGroupSync:
    """This rank's shard group, its sub-communicator, and the cross-group gradient all-reduce."""

    def __init__(
        self,
        plan: Plan,
        world: Comm,
        inter_node_bytes_per_s: float | None = None,
    ):
        if not plan.hierarchical:
            raise CephaloError("ShardGroupSync is for hierarchical plans (several shard groups)")
        self.plan = plan
        self.world = world
        self.groups = plan.groups
        self.index = plan.group_of(world.rank)
        self.members = self.groups[self.index]
        self.local_rank = self.members.index(world.rank)
        self.fractions = [plan.ranks[r].state_fraction for r in self.members]
        self.dtype = REDUCE_DTYPES[plan.cross_group_reduce_dtype]
        self.elem_bytes = self.dtype.itemsize
        """Bytes per element on the wire between groups."""
        self.inter_node_bytes_per_s = inter_node_bytes_per_s
        # every rank creates every group, in the same order (torch.distributed's contract)
        pgs = [dist.new_group(ranks=g) for g in self.groups]
        self._own_groups: list[object] = pgs
        """The process groups this object made (`close` destroys them with the owners')."""
        self.group_comm: Comm = make_comm(group=pgs[self.index], validate=world.validate)
        self._owner_groups: dict[tuple[int, ...], object] = {}
        """Per owner tuple: the process sub-group its segments are all-reduced on (`prepare`)."""
        self._late = {r for r, rp in enumerate(plan.ranks) if rp.host_state_fraction > 0}
        """Ranks with host state: their segments are reduced at the optimizer step."""
        self._segments: dict[int, list[_Segment]] = {}
        self._started: dict[int, set[int]] = {}
        """Per unit: the indices of its segments whose all-reduce has started."""
        self._inflight: list[object] = []
        """The work of every started fp32 all-reduce (in place) or `_Bf16Reduce`."""
        self._first_phase: dict[tuple[int, ...], _Bf16Reduce] = {}
        """Per owner tuple: its last bf16 reduce still in its all-to-all. Its all-gather starts
        before the owners' next collective on that sub-group, so every owner issues the
        sub-group's collectives in the same order (the backends' contract)."""
        self._due = 0.0
        """Emulated link: when the exchanges started so far have crossed it."""
        self.bytes_sent = 0
        """Bytes this rank has sent to other groups (a running count: 2 (g-1)/g per segment)."""
        self.wait_s = 0.0

    def prepare(self, numels: list[int]) -> None:
        """Make the owners' sub-groups of every unit's segments (collective: every rank calls it
        with the same unit sizes; torch.distributed needs every rank at every `new_group`)."""
        fr = [[self.plan.ranks[r].state_fraction for r in members] for members in self.groups]
        tuples: set[tuple[int, ...]] = set()
        for unit, numel in enumerate(numels):
            segs = owner_segments(numel, self.groups, fr)
            tuples.update(owners for _, _, owners in segs)
            start = shard_ranges(numel, self.fractions)[self.local_rank][0]
            self._segments[unit] = [
                _Segment(a - start, b - start, owners)
                for a, b, owners in segs
                if self.world.rank in owners
            ]
        for owners in sorted(tuples - set(self._owner_groups)):
            self._owner_groups[owners] = dist.new_group(ranks=list(owners))

    def close(self) -> None:
        """Destroy the process groups this object made (the shard groups', the owners'): a
        re-plan makes new ones for the new plan, and each NCCL communicator holds device
        memory, buffers and threads until it is destroyed. Local (no collective); nothing may
        be in flight on them (the engine's step has finished). Idempotent."""
        groups = [*self._own_groups, *self._owner_groups.values()]
        self._own_groups, self._owner_groups = [], {}
        for pg in groups:
            if pg is not None and pg is not dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(pg)

    def _segments_of(self, unit: int) -> list[_Segment]:
        if unit not in self._segments:
            raise CephaloError(
                f"internal: unit {unit}'s cross-group segments were not prepared (ShardGroupSync.prepare)"
            )
        return self._segments[unit]

    @torch.no_grad()
    def start(self, unit: int, numel: int, g: torch.Tensor, early: bool = False) -> None:
        """Start the all-reduce of one unit's final gradient shard `g` with the other groups, one
        per segment on its owners' sub-group (asynchronous; `finish` waits and writes the sums
        back). `early` (from the backward): segments with a host-state owner wait. On an emulated
        link the unit's bytes queue behind the units started before it."""
        done = self._started.setdefault(unit, set())
        sent = started = 0
        segments = self._segments_of(unit)
        for i, seg in enumerate(segments):
            if i in done or (early and self._late.intersection(seg.owners)):
                continue
            done.add(i)
            group = self._owner_groups[seg.owners]
            n = len(seg.owners)
            if self.dtype == g.dtype:  # in place
                part = g[seg.lo : seg.hi]
                self._inflight.append(dist.all_reduce(part, group=group, async_op=True))
            else:
                earlier = self._first_phase.pop(seg.owners, None)
                if earlier is not None:
                    earlier.gather()
                part = _Bf16Reduce.start(g, seg.lo, seg.hi, group, n)
                self._first_phase[seg.owners] = part
                self._inflight.append(part)
            sent += int(2 * (n - 1) / n * (seg.hi - seg.lo) * self.elem_bytes)
            started += seg.hi - seg.lo
        self.bytes_sent += sent
        mine = sum(seg.hi - seg.lo for seg in segments)
        if self.inter_node_bytes_per_s and started:
            # the group's ranks share their node's link: each sends its segments' ring share,
            # 2 (g-1)/g of them, so the node sends 2 (g-1)/g of the unit (the cost model's
            # charge for one node per group), this call the part of it started now
            g_count = len(self.groups)
            node_bytes = 2 * (g_count - 1) / g_count * numel * self.elem_bytes * started / mine
            now = time.perf_counter()
            self._due = max(self._due, now) + node_bytes / self.inter_node_bytes_per_s

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for every started all-reduce and write the sums back, in place."""
        # in the order started: per sub-group, every owner starts the all-gathers in one order
        for work in self._inflight:
            if isinstance(work, _Bf16Reduce):
                work.finish()
            else:
                work.wait()
        self._inflight.clear()
        self._first_phase.clear()
        self._started.clear()
        left = self._due - time.perf_counter()
        if left > 0:
            time.sleep(left)
        self._due = 0.0

    def all_reduce_grads(self, grads: list[tuple[int, int, torch.Tensor]]) -> None:
        """Sum every unit's gradient shard over the groups, in place. `grads`: per unit (index,
        numel of its flat buffer, this rank's fp32 gradient shard); segments already started
        keep their all-reduce."""
        t0 = time.perf_counter()
        for unit, numel, g in grads:
            self.start(unit, numel, g)
        self.finish()
        self.wait_s = time.perf_counter() - t0

    def unit_final(self, shards: list, device_grad: Callable, unit: int) -> None:
        """Engine hook (layered gradient accumulation): unit `unit`'s gradient shard is complete
        (its reduce-scatter and its borrowers' are done): start its exchange now, beside the
        backward of the units before it. Units with host state wait for the optimizer step.
        `shards`: the engine's `UnitShard`s; `device_grad`: a unit's device gradient shard."""
        if not 0 <= unit < len(shards):
            return
        us = shards[unit]
        if us.host is None:
            self.start(unit, us.layout.numel, device_grad(us), early=True)

    def reduce_engine_grads(self, shards: list, device_grad: Callable) -> float:
        """`all_reduce_grads` over an engine's units (`shards`, their device gradient shards
        from `device_grad`, the host-held part of a shard too); returns the seconds it took."""
        grads, hosted = [], []
        for us in shards:
            g = device_grad(us)
            if us.host is not None:
                whole = torch.cat([g, us.host.grad.to(g.device)])
                hosted.append((us, g, whole))
                g = whole
            grads.append((us.index, us.layout.numel, g))
        self.all_reduce_grads(grads)
        for us, g, whole in hosted:
            g.copy_(whole[: g.numel()])
            us.host.grad.copy_(whole[g.numel() :].to(us.host.grad.device))
        return self.wait_s


def attach_shard_group_sync(
    plan: Plan, world: Comm, inter_node_bytes_per_s: float | None = None
) -> ShardGroupSync | None:
    """The `ShardGroupSync` of a hierarchical plan (every rank calls it: it creates the groups), else None."""
    if not plan.hierarchical:
        return None
    return ShardGroupSync(plan, world, inter_node_bytes_per_s)


def saved_state(engine) -> list:
    """What this rank writes into a checkpoint: its shards, or nothing outside the first shard
    group (every group holds the same replica; the logical layout needs each element once). Every
    rank still loads its own ranges, so a checkpoint resumes under any plan, flat or not."""
    if engine.group_sync is not None and engine.group_sync.index != 0:
        return []
    return engine.sharded_state()


def emulate_links(config, cluster, emulated: bool):
    """An emulated multi-rank cluster (`cephalo run --devices ...`, tests through the trainer):
    its collectives run as NCCL runs them (runtime/collectives/emulated.py `FaithfulComm`: one
    queue per process group, asynchronous waits) at the links its spec declares (`inter=`
    between nodes; `intra=` within one, where given), and across nodes the all-reduce between
    shard groups is charged the inter-node rate per byte."""
    from dataclasses import replace

    from cephalo.runtime.collectives.emulated import EmulatedLinks
    from cephalo.specs.catalog.devices import intra_node_bytes_per_s

    if not emulated or cluster.world_size < 2:
        return config
    spans = cluster.num_nodes >= 2
    default_intra = min(intra_node_bytes_per_s(d.type) for d in cluster.devices)
    declared_intra = cluster.intra_node_bytes_per_s != default_intra
    links = EmulatedLinks(
        float(cluster.inter_node_bytes_per_s) if spans else None,
        float(cluster.intra_node_bytes_per_s) if declared_intra else None,
        tuple(d.node for d in cluster.devices),
    )
    inter = float(cluster.inter_node_bytes_per_s) if spans else config.inter_node_bytes_per_s
    return replace(config, inter_node_bytes_per_s=inter, links=links)
