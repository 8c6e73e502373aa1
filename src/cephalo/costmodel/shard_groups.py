"""Shard groups of a hierarchical plan as the cost model charges them: the cluster's links
(`Links`: a group's collectives run at its slowest link), the once-per-step all-reduce of the
gradient shards between groups (`CrossReduce`, `cross_reduce_times`), and, as `CostModel`'s
mixin `ShardGroupCosts`, one group's own cost model (`group_model`), the key that says two
groups cost the same (`group_key`) and a hierarchical plan's evaluation, group by group."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Self

from cephalo.costmodel.host import HostResources
from cephalo.costmodel.results import PlanEvaluation, RankCost
from cephalo.errors import CephaloError
from cephalo.planner.plan import Plan
from cephalo.specs.catalog.devices import DTYPE_BYTES
from cephalo.specs.profile import CommProfile

if TYPE_CHECKING:
    from cephalo.costmodel.layout import ParamLayout


@dataclass(frozen=True)
class Links:
    """The cluster's links as the cost model charges them: within a node and between nodes
    (`costmodel.sources` builds it from the cluster spec). A ring collective is bounded by its
    slowest link: a group of ranks on one node runs at `intra_bytes_per_s`, one spanning nodes at
    the smaller of the two."""

    intra_bytes_per_s: float
    inter_bytes_per_s: float
    node_of: tuple[int, ...]
    """Per rank: its node."""
    latency_s: float = 0.0

    def bytes_per_s(self, ranks) -> float:
        if len({self.node_of[r] for r in ranks}) <= 1:
            return self.intra_bytes_per_s
        return min(self.intra_bytes_per_s, self.inter_bytes_per_s)


@dataclass(frozen=True)
class CrossReduce:
    """The once-per-step gradient all-reduce between shard groups (hierarchical plans): the ranks
    owning the same bytes in different groups all-reduce them over the inter-node network. Per
    node it moves 2 (g-1)/g of the node's share of the gradients in `dtype` through the node's
    network link (`bytes_per_s`, shared by its ranks); the share is bounded by 1 (a node holding
    its group's whole replica, exact for one node per group)."""

    groups: int
    dtype: str = "fp32"
    bytes_per_s: float = math.inf
    latency_s: float = 0.0


def cross_reduce_times(layout: ParamLayout, cross_reduce: CrossReduce | None) -> dict[str, float]:
    """Per unit kind: its gradient's all-reduce between shard groups (0 in a flat plan), started
    once the unit's reduce-scatter is done, one after another on the node's link: 2 (g-1)/g of
    the unit's trained fp32 (or bf16) gradient through the node's network link + latency."""
    out = {k: 0.0 for k in layout.units}
    if cross_reduce is None or cross_reduce.groups <= 1:
        return out
    if cross_reduce.dtype not in ("fp32", "bf16"):
        raise CephaloError(
            f"cross-node reduce dtype {cross_reduce.dtype!r} is not one of fp32, bf16"
        )
    g = cross_reduce.groups
    reduce_bytes = DTYPE_BYTES[cross_reduce.dtype]
    for kind, u in layout.units.items():
        out[kind] = (
            2 * (g - 1) / g * u.trained * reduce_bytes / cross_reduce.bytes_per_s
            + cross_reduce.latency_s
        )
    return out


class ShardGroupCosts:
    """`CostModel`'s methods for shard groups (a mixin: these read the model's devices, hosts,
    links and profiles, and build one group's own model of the same class)."""

    def group_model(self, ranks: list[int], groups: int, reduce_dtype: str = "fp32") -> Self:
        """The cost model of one shard group of a hierarchical plan: the group's ranks (renumbered
        0..), its collectives over its own slowest link (intra-node for a group on one node), and
        the all-reduce between the `groups` groups over the inter-node link in `reduce_dtype`.
        With `groups` 1 and every rank, the flat model (the same numbers as this one)."""
        ranks = list(ranks)
        links = self.links
        if links is not None:
            comm = CommProfile(bytes_per_s=links.bytes_per_s(ranks), latency_s=links.latency_s)
            sub_links = replace(links, node_of=tuple(links.node_of[r] for r in ranks))
            cross_bw = links.inter_bytes_per_s
        else:
            comm, sub_links, cross_bw = self.comm, None, self.comm.bytes_per_s
        host = None
        if self.host is not None:
            host = HostResources(
                node_of=tuple(self.host.node_of[r] for r in ranks),
                memory_bytes=self.host.memory_bytes,
                optimizer_s_per_param=tuple(self.host.optimizer_s_per_param[r] for r in ranks),
            )
        cross = None
        if groups > 1:
            latency = links.latency_s if links is not None else self.comm.latency_s
            cross = CrossReduce(groups, reduce_dtype, cross_bw, latency)
        return type(self)(
            self.model,
            self.seq_len,
            self.dtype,
            [self.devices[r] for r in ranks],
            self.profiles,
            comm,
            reserve_bytes=self.reserve_bytes,
            reserve_fraction=self.reserve_fraction,
            reserve_extra_bytes=self.reserve_extra_bytes,
            meta=self.meta,
            host=host,
            serial_reduce=self.serial_reduce,
            adapter=self.adapter,
            links=sub_links,
            cross_reduce=cross,
            padded_collectives=self.padded_collectives,
        )

    def group_key(self, ranks: list[int]) -> tuple:
        """Equal for two groups whose `group_model`s are the same up to the ranks' numbering:
        their devices in order, their hosts (the group's nodes numbered in order of appearance)
        and their links. Identical nodes are planned and evaluated once."""
        devs = tuple((self.devices[r].type_key, int(self.devices[r].memory_bytes)) for r in ranks)
        host = None
        if self.host is not None:
            index: dict[int, int] = {}
            host = (
                tuple(self.host.optimizer_s_per_param[r] for r in ranks),
                tuple(self.host.memory_bytes[self.host.node_of[r]] for r in ranks),
                tuple(index.setdefault(self.host.node_of[r], len(index)) for r in ranks),
            )
        links = None if self.links is None else self.links.bytes_per_s(ranks)
        return devs, host, links

    def _evaluate_groups(self, plan: Plan) -> PlanEvaluation:
        """A hierarchical plan: each shard group under its `group_model`, the ranks back in order."""
        groups = plan.groups
        costs: list[RankCost] = [None] * plan.world_size  # type: ignore[list-item]
        done: dict[tuple, list[RankCost]] = {}  # identical groups with identical plans, once
        for members in groups:
            key = (
                self.group_key(members),
                tuple(
                    tuple(v for k, v in vars(plan.ranks[r]).items() if k != "rank") for r in members
                ),
            )
            if key in done:  # the same costs on this group's own ranks and nodes
                for i, c in enumerate(done[key]):
                    r = members[i]
                    node = self.host.node_of[r] if self.host is not None else c.node
                    costs[r] = replace(c, rank=r, node=node)
                continue
            sub = self.group_model(members, len(groups), plan.cross_group_reduce_dtype)
            part = Plan(
                strategy=plan.strategy,
                model=plan.model,
                seq_len=plan.seq_len,
                global_batch_size=sum(plan.ranks[r].batch_size for r in members) or 1,
                dtype=plan.dtype,
                ranks=[replace(plan.ranks[r], rank=i) for i, r in enumerate(members)],
                meta=plan.meta,
            )
            done[key] = sub.evaluate(part).ranks
            for i, c in enumerate(done[key]):
                costs[members[i]] = replace(c, rank=members[i])
        return PlanEvaluation(
            ranks=costs, global_batch_size=plan.global_batch_size, seq_len=plan.seq_len
        )
