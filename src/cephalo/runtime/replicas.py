"""Hierarchical sharding at run time: shard groups, and the gradient all-reduce between them.

A hierarchical plan (`Plan.shard_groups`, docs/plan-format.md) splits the ranks into groups, each
holding a whole replica of the training state sharded unevenly over its own ranks. The engine
runs today's uneven all-gathers and reduce-scatters on the group's sub-process-group
(`group_comm`); after the backward, once per step whatever the micro-batches, every rank
all-reduces its gradient shard with the ranks that own the same elements in the other groups.
The groups' shard boundaries differ, so the reduce runs over the intersections of the ranges:
for each unit, each intersection of this rank's range with a rank's range of another group is
exchanged with that rank (one send and one receive, point to point), and every participant adds
the groups' pieces in group order, so all replicas hold bitwise the same sum. In
`cross_group_reduce_dtype` bf16 the pieces travel (and are added, own piece included) as bf16
values, accumulated in fp32.

Emulation (`inter_node_bytes_per_s`): the exchange is charged a delay per byte its node sends
(the group's ranks share the node's link), as `slowdown` charges compute, so a slow inter-node
network shows on the CPU; a flat plan's rings over emulated nodes are charged the same way
(`SlowLinkComm`).

Under layered gradient accumulation each unit's exchange starts as soon as its gradient shard is
complete (`unit_final`, called by the engine's backward), beside the backward of the units before
it, as the cost model charges it; the sums are made before the optimizer step (`finish`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cephalo.errors import CephaloError
from cephalo.planning.plan import Plan
from cephalo.runtime.comm import Comm, make_comm
from cephalo.runtime.flat import shard_ranges

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class _Piece:
    peer: int
    """Global rank of the other group's owner."""
    group: int
    """Its group index."""
    lo: int
    hi: int
    """The intersection, relative to this rank's shard start."""


class Replicas:
    """This rank's shard group, its sub-communicator, and the cross-group gradient all-reduce."""

    def __init__(
        self,
        plan: Plan,
        world: Comm,
        inter_node_bytes_per_s: float | None = None,
    ):
        if not plan.hierarchical:
            raise CephaloError("Replicas is for hierarchical plans (several shard groups)")
        self.plan = plan
        self.world = world
        self.groups = plan.groups
        self.index = plan.group_of(world.rank)
        self.members = self.groups[self.index]
        self.local_rank = self.members.index(world.rank)
        self.fractions = [plan.ranks[r].state_fraction for r in self.members]
        self.dtype = REDUCE_DTYPES[plan.cross_group_reduce_dtype]
        self.inter_node_bytes_per_s = inter_node_bytes_per_s
        # every rank creates every group, in the same order (torch.distributed's contract)
        pgs = [dist.new_group(ranks=g) for g in self.groups]
        self.group_comm: Comm = make_comm(group=pgs[self.index], validate=world.validate)
        self._pieces: dict[int, list[_Piece]] = {}
        self._inflight: dict[int, tuple] = {}
        """Per unit whose exchange has started: (gradient shard, pieces, receive buffers, works)."""
        self._due = 0.0
        """Emulated link: when the exchanges started so far have crossed it."""
        self.bytes_sent = 0
        """Bytes this rank has sent to other groups (a running count)."""
        self.wait_s = 0.0

    def _pieces_of(self, unit: int, numel: int) -> list[_Piece]:
        if unit not in self._pieces:
            mine = shard_ranges(numel, self.fractions)[self.local_rank]
            start, end = mine[0], mine[0] + mine[1]
            out = []
            for gi, members in enumerate(self.groups):
                if gi == self.index:
                    continue
                fr = [self.plan.ranks[r].state_fraction for r in members]
                for r, (s, n) in zip(members, shard_ranges(numel, fr), strict=True):
                    lo, hi = max(start, s), min(end, s + n)
                    if hi > lo:
                        out.append(_Piece(r, gi, lo - start, hi - start))
            self._pieces[unit] = out
        return self._pieces[unit]

    @torch.no_grad()
    def start(self, unit: int, numel: int, g: torch.Tensor) -> None:
        """Start the exchange of one unit's final gradient shard `g` with the other groups
        (asynchronous; `finish` adds the pieces). On an emulated link the unit's bytes queue
        behind the units started before it."""
        if unit in self._inflight:
            return
        pieces = self._pieces_of(unit, numel)
        ops, bufs = [], []
        for p in pieces:
            out = g[p.lo : p.hi].to(self.dtype).contiguous()
            buf = torch.empty_like(out)
            ops.append(dist.P2POp(dist.isend, out, p.peer, tag=unit))
            ops.append(dist.P2POp(dist.irecv, buf, p.peer, tag=unit))
            bufs.append(buf)
            self.bytes_sent += out.numel() * out.element_size()
        works = dist.batch_isend_irecv(ops) if ops else []
        self._inflight[unit] = (g, pieces, bufs, works)
        if self.inter_node_bytes_per_s:
            # the group's ranks share their node's link: together they send each of the group's
            # elements to every other group (what the cost model charges a node for g = 2)
            elem = torch.finfo(self.dtype).bits // 8
            node_bytes = (len(self.groups) - 1) * numel * elem
            now = time.perf_counter()
            self._due = max(self._due, now) + node_bytes / self.inter_node_bytes_per_s

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for every started exchange and sum each element over the groups, in place."""
        for g, pieces, bufs, works in self._inflight.values():
            for work in works:
                work.wait()
            if not pieces:
                continue
            # each group's ranges partition the buffer: cut this shard where any of them ends,
            # then add the groups' pieces of each cut in group order (the same sum everywhere)
            cuts = sorted({0, g.numel(), *(p.lo for p in pieces), *(p.hi for p in pieces)})
            own = g.to(self.dtype).float()
            for a, b in zip(cuts[:-1], cuts[1:], strict=True):
                parts = {self.index: own[a:b]}
                for p, buf in zip(pieces, bufs, strict=True):
                    if p.lo <= a and b <= p.hi:
                        parts[p.group] = buf[a - p.lo : b - p.lo].float()
                total = torch.zeros(b - a, dtype=torch.float32, device=g.device)
                for gi in sorted(parts):
                    total += parts[gi]
                g[a:b].copy_(total)
        self._inflight.clear()
        left = self._due - time.perf_counter()
        if left > 0:
            time.sleep(left)
        self._due = 0.0

    def all_reduce_grads(self, grads: list[tuple[int, int, torch.Tensor]]) -> None:
        """Sum every unit's gradient shard over the groups, in place. `grads`: per unit (index,
        numel of its flat buffer, this rank's fp32 gradient shard); units already started keep
        their exchange."""
        t0 = time.perf_counter()
        for unit, numel, g in grads:
            self.start(unit, numel, g)
        self.finish()
        self.wait_s = time.perf_counter() - t0

    def unit_final(self, engine, unit: int) -> None:
        """Engine hook (layered gradient accumulation): unit `unit`'s gradient shard is complete
        (its reduce-scatter and its borrowers' are done): start its exchange now, beside the
        backward of the units before it. Units with host state wait for the optimizer step."""
        if not 0 <= unit < len(engine.shards):
            return
        us = engine.shards[unit]
        if us.host is None:
            self.start(unit, us.layout.numel, engine._device_grad(us))

    def reduce_engine_grads(self, engine) -> float:
        """`all_reduce_grads` over an engine's units (the host-held part of a shard too);
        returns the seconds it took."""
        grads, hosted = [], []
        for us in engine.shards:
            g = engine._device_grad(us)
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


def attach_replicas(
    plan: Plan, world: Comm, inter_node_bytes_per_s: float | None = None
) -> Replicas | None:
    """The `Replicas` of a hierarchical plan (every rank calls it: it creates the groups), else None."""
    if not plan.hierarchical:
        return None
    return Replicas(plan, world, inter_node_bytes_per_s)


def saved_state(engine) -> list:
    """What this rank writes into a checkpoint: its shards, or nothing outside the first shard
    group (every group holds the same replica; the logical layout needs each element once). Every
    rank still loads its own ranges, so a checkpoint resumes under any plan, flat or not."""
    if engine.replicas is not None and engine.replicas.index != 0:
        return []
    return engine.sharded_state()


def emulate_links(config, cluster, emulated: bool):
    """An emulated cluster spanning nodes (`cephalo run --devices "...@node1;inter=RATE"`): the
    collectives that cross nodes are charged a delay per byte at the inter-node rate (the
    all-reduce between shard groups; a flat plan's rings, `SlowLinkComm`)."""
    from dataclasses import replace

    if not emulated or cluster.num_nodes < 2:
        return config
    return replace(config, inter_node_bytes_per_s=float(cluster.inter_node_bytes_per_s))


class SlowLinkComm:
    """A `Comm` whose ring collectives wait as long as a ring over a link of `bytes_per_s` would
    take ((n-1)/n of the gathered or reduced bytes), counted from the call: asynchronous calls
    overlap the delay with compute, as a network would. Everything else is the inner comm's."""

    def __init__(self, inner: Comm, bytes_per_s: float):
        self._inner = inner
        self._rate = float(bytes_per_s)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _delayed(self, handle, nbytes: int, async_op: bool):
        from cephalo.runtime.comm import Handle

        n = self._inner.world_size
        due = time.perf_counter() + (n - 1) / n * nbytes / self._rate

        def finish() -> None:
            left = due - time.perf_counter()
            if left > 0:
                time.sleep(left)

        if not async_op:
            handle.wait()
            finish()
            return handle
        return Handle([handle], finish)

    def all_gather_v(self, out, shard, sizes, async_op: bool = False):
        h = self._inner.all_gather_v(out, shard, sizes, async_op=async_op)
        return self._delayed(h, out.numel() * out.element_size(), async_op)

    def reduce_scatter_v(self, out, full, sizes, async_op: bool = False):
        h = self._inner.reduce_scatter_v(out, full, sizes, async_op=async_op)
        return self._delayed(h, full.numel() * full.element_size(), async_op)
