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

Emulation (`inter_node_bytes_per_s`): the exchange is charged a delay per byte sent, as
`slowdown` charges compute, so a slow inter-node network shows on the CPU.
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
        self.bytes_sent = 0
        """Bytes this rank sent to other groups in the last `all_reduce_grads`."""
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
    def all_reduce_grads(self, grads: list[tuple[int, int, torch.Tensor]]) -> None:
        """Sum every unit's gradient shard over the groups, in place. `grads`: per unit (index,
        numel of its flat buffer, this rank's fp32 gradient shard)."""
        t0 = time.perf_counter()
        ops, received, sent = [], [], 0
        for unit, numel, g in grads:
            pieces = self._pieces_of(unit, numel)
            bufs = []
            for p in pieces:
                out = g[p.lo : p.hi].to(self.dtype).contiguous()
                buf = torch.empty_like(out)
                ops.append(dist.P2POp(dist.isend, out, p.peer, tag=unit))
                ops.append(dist.P2POp(dist.irecv, buf, p.peer, tag=unit))
                bufs.append(buf)
                sent += out.numel() * out.element_size()
            received.append((g, pieces, bufs))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for g, pieces, bufs in received:
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
        if self.inter_node_bytes_per_s:
            delay = sent / self.inter_node_bytes_per_s - (time.perf_counter() - t0)
            if delay > 0:
                time.sleep(delay)
        self.bytes_sent = sent
        self.wait_s = time.perf_counter() - t0

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
