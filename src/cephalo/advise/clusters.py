"""The advisor's clusters: a count vector over the offers as a cluster of nodes, and how such a
cluster is planned (as `cephalo plan` plans it: flat, or in shard groups).

A cluster of several offers is several nodes (each offer on its own node or nodes of
`per_node` GPUs), so the planner also tries one shard group per node (or per few nodes):
collectives inside a node, one gradient all-reduce between the groups per step
(`planner/shard_groups.py`). The advisor's bound on such plans, and the floors with which the
planner skips groupings that cannot win, are in `advise/bound.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cephalo.costmodel.model import CostModel
from cephalo.errors import CephaloError
from cephalo.planner.group_split import GroupPlanMemo
from cephalo.planner.plan import REDUCE_DTYPES
from cephalo.planner.shard_groups import Grouping, make_hierarchical_plan
from cephalo.specs.cluster import Cluster, Device
from cephalo.specs.offers import Offer


@dataclass(frozen=True)
class PlanOptions:
    """What the planner may choose for the advisor's clusters (`cephalo plan`'s flags)."""

    allow_offload: bool = True
    allow_host_state: bool = True
    hierarchy: bool = True
    """Shard groups (per node, per few nodes) as well as the flat plan (`--no-hierarchy`: flat)."""
    reduce_dtype: str = "fp32"
    """The all-reduce between shard groups (`--cross-node-reduce-dtype`)."""

    def __post_init__(self) -> None:
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise CephaloError(
                f"cross-node reduce dtype {self.reduce_dtype!r} is not one of "
                f"{', '.join(REDUCE_DTYPES)}"
            )


def planned_samples_per_s(
    cm: CostModel,
    global_batch: int,
    options: PlanOptions,
    step_floor: Callable[[CostModel, Grouping], float] | None = None,
    memo: GroupPlanMemo | None = None,
) -> float:
    """The throughput `cephalo plan` predicts for the cluster of `cm` (raises `CephaloError`
    where no plan fits). `step_floor(cm, grouping)`: a lower bound on a grouping's step, to
    skip groupings that cannot beat the best plan (`groups.make_hierarchical_plan`). `memo`: the
    shard groups' plans made for other clusters (the same plans, made once)."""
    plan = make_hierarchical_plan(
        cm,
        global_batch,
        hierarchy=options.hierarchy,
        reduce_dtype=options.reduce_dtype,
        step_floor=None if step_floor is None else lambda g: step_floor(cm, g),
        memo=memo,
        allow_offload=options.allow_offload,
        allow_host_state=options.allow_host_state,
    )
    return plan.predicted.samples_per_s


def cluster_of(offers: Sequence[Offer], units: Sequence[int]) -> Cluster:
    """The cluster of `units[j]` units (nodes, or GPUs) of each offer: each offer on its own
    node(s), links the slowest of the offers used."""
    devices: list[Device] = []
    node = 0
    used = []
    for o, k in zip(offers, units, strict=True):
        if k <= 0:
            continue
        used.append(o)
        gpus = k * o.unit_gpus
        per_node = o.per_node or gpus
        for start in range(0, gpus, per_node):
            devices.extend(
                Device(o.type, o.memory_bytes, node) for _ in range(min(per_node, gpus - start))
            )
            node += 1
    if not devices:
        raise CephaloError("internal: an empty cluster")
    return Cluster(
        devices,
        intra_node_bytes_per_s=min(o.intra_bytes_per_s for o in used),
        inter_node_bytes_per_s=min(o.inter_node_bytes_per_s for o in used),
    )


def renumber(devices: list[Device]) -> list[Device]:
    """Node numbers 0.. in order of first appearance (an emptied node disappears)."""
    index: dict[int, int] = {}
    out = []
    for d in devices:
        node = index.setdefault(d.node, len(index))
        out.append(Device(d.type, d.memory_bytes, node, d.slowdown))
    return out


def with_new_node(cluster: Cluster, o: Offer) -> Cluster:
    """An owned cluster plus one unit of an offer, on a node of its own."""
    node = max(d.node for d in cluster.devices) + 1
    added = [Device(o.type, o.memory_bytes, node) for _ in range(o.unit_gpus)]
    return Cluster(
        cluster.devices + added,
        intra_node_bytes_per_s=min(cluster.intra_node_bytes_per_s, o.intra_bytes_per_s),
        inter_node_bytes_per_s=min(cluster.inter_node_bytes_per_s, o.inter_node_bytes_per_s),
        collective_latency_s=cluster.collective_latency_s,
    )
