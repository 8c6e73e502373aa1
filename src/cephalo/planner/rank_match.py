"""A plan file meets the ranks that came up: each rank gets the rank-plan made for its device.

A plan is made for a cluster's devices in one order: `RankPlan.device` is each rank's device
type key (an emulated slowdown or host link is part of it), and a plan `cephalo plan` made
records its cluster in `meta["cluster"]` (each device's memory and node). The ranks that run
it come up in the launcher's order (`cephalo run --devices`, torchrun's rendezvous, which
numbers the nodes as it likes), and each rank discovers its own device (train/discovery.py).
Before any engine is built, `match_plan` matches the plan's ranks to the discovered devices:

- every rank's device is the plan's device for it: the plan as it is;
- the discovered devices are the plan's in another order: the plan's `RankPlan`s permuted
  (`permute_plan`) so each rank runs the rank-plan made for its device. Equal devices keep
  their order (identity first); a device on the plan's node index is preferred;
- no order matches: one `CephaloError`, the same on every rank (each computes it from the
  same plan and the same discovered cluster), naming a rank, the plan's device for it and
  the discovered one, and the fix.

"Matches": the same type key; where the plan recorded memory, the same memory, or, where no
order matches exactly, memory within `MEMORY_TOLERANCE` (a data sheet's GiB vs what a GPU
reports: ECC, the driver's reserve), pairing the smaller with the smaller.

A permuted plan is a plan like any other: ranks take consecutive slices of the global batch
and contiguous state shards in the new rank order (the losses are those of any plan), shard
groups name the new ranks, `meta["rank_map"][i]` is the plan rank that rank i runs, and
checkpoints are plan-independent (a checkpoint written under it resumes under any plan).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from cephalo.errors import CephaloError
from cephalo.planner.plan import Plan, ShardGroup
from cephalo.specs.cluster import Cluster, Device

MEMORY_TOLERANCE = 0.2
"""Relative memory difference within which a discovered device may still be the plan's (the
catalog's own rule for a GPU's reported memory vs its data sheet: `device_type_for_gpu`)."""


@dataclass(frozen=True)
class PlanDevice:
    """The device a plan's rank was made for: its type key, and its memory and node where the
    plan recorded them (`meta["cluster"]`), else None."""

    key: str
    memory_bytes: int | None = None
    node: int | None = None

    def describe(self) -> str:
        if self.memory_bytes is None:
            return self.key
        return f"{self.key} ({_memory(self.memory_bytes)})"


def plan_devices(plan: Plan) -> list[PlanDevice]:
    """Each rank's device as the plan knows it. Memory and node come from `meta["cluster"]`
    when it lists the plan's devices (one per rank, the same type keys); a hand-written plan
    (or one whose meta disagrees with its ranks) has type keys only."""
    recorded = _recorded_cluster(plan)
    if recorded is None:
        return [PlanDevice(r.device) for r in plan.ranks]
    return [PlanDevice(d.type_key, d.memory_bytes, d.node) for d in recorded.devices]


def _recorded_cluster(plan: Plan) -> Cluster | None:
    raw = plan.meta.get("cluster")
    if not isinstance(raw, dict):
        return None
    try:
        cluster = Cluster.from_dict(raw, "plan meta.cluster")
    except (CephaloError, TypeError, ValueError, KeyError):
        return None
    keys = [d.type_key for d in cluster.devices]
    return cluster if keys == [r.device for r in plan.ranks] else None


def _memory(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def _found(d: Device) -> str:
    return f"{d.type_key} ({_memory(d.memory_bytes)})"


# ----------------------------------------------------------------------------- matching
def _exact(p: PlanDevice, d: Device, with_node: bool) -> bool:
    return (
        p.key == d.type_key
        and (p.memory_bytes is None or p.memory_bytes == d.memory_bytes)
        and (not with_node or p.node is None or p.node == d.node)
    )


def _close(p: PlanDevice, d: Device) -> bool:
    if p.key != d.type_key:
        return False
    if p.memory_bytes is None:
        return True
    big = max(p.memory_bytes, d.memory_bytes)
    return abs(p.memory_bytes - d.memory_bytes) <= MEMORY_TOLERANCE * big


def _by_class(planned: list[PlanDevice], found: list[Device], with_node: bool) -> list[int] | None:
    """Discovered rank j -> the first unused plan rank of its class (exact equality), equal
    devices in order; None where the classes' counts differ."""

    def cls(key: str, memory: int | None, node: int | None, recorded: PlanDevice) -> tuple:
        return (
            key,
            memory if recorded.memory_bytes is not None else None,
            node if with_node and recorded.node is not None else None,
        )

    queues: dict[tuple, list[int]] = {}
    for i, p in enumerate(planned):
        queues.setdefault(cls(p.key, p.memory_bytes, p.node, p), []).append(i)
    order = []
    for j, d in enumerate(found):
        # the plan records memory and node for all of its ranks or for none
        waiting = queues.get(cls(d.type_key, d.memory_bytes, d.node, planned[j]))
        if not waiting:
            return None
        order.append(waiting.pop(0))
    return order


def _by_memory(planned: list[PlanDevice], found: list[Device]) -> list[int] | None:
    """Per type key, plan ranks and discovered ranks sorted by memory (then rank) and paired
    in that order (the pairing with the smallest largest memory ratio); None where a key's
    counts differ or a pair is further apart than `MEMORY_TOLERANCE`."""
    order: list[int | None] = [None] * len(found)
    for key in {p.key for p in planned} | {d.type_key for d in found}:
        mine = sorted(
            (i for i, p in enumerate(planned) if p.key == key),
            key=lambda i: (planned[i].memory_bytes or 0, i),
        )
        theirs = sorted(
            (j for j, d in enumerate(found) if d.type_key == key),
            key=lambda j: (found[j].memory_bytes, j),
        )
        if len(mine) != len(theirs):
            return None
        for i, j in zip(mine, theirs, strict=True):
            if not _close(planned[i], found[j]):
                return None
            order[j] = i
    return [i for i in order if i is not None] if None not in order else None


def match_ranks(planned: list[PlanDevice], found: list[Device]) -> list[int] | None:
    """`order[j]`: the plan rank whose rank-plan discovered rank j runs (a permutation), or
    None where no order of the plan's devices is the discovered one. Tried in turn: exact
    devices on their nodes, exact devices, devices within `MEMORY_TOLERANCE`; in each the
    identity first."""
    n = len(found)
    if len(planned) != n:
        return None
    identity = list(range(n))
    for with_node in (True, False):
        if all(_exact(p, d, with_node) for p, d in zip(planned, found, strict=True)):
            return identity
        order = _by_class(planned, found, with_node)
        if order is not None:
            return order
    if all(_close(p, d) for p, d in zip(planned, found, strict=True)):
        return identity
    return _by_memory(planned, found)


# ----------------------------------------------------------------------------- the plan
def permute_plan(plan: Plan, order: list[int]) -> Plan:
    """The plan whose rank j runs the plan's rank `order[j]`: its rank-plans moved, its shard
    groups renamed (each ascending), `meta["rank_map"] = order` and the recorded cluster's
    devices moved with them. Validated like any plan."""
    new_rank = {old: new for new, old in enumerate(order)}
    ranks = [replace(plan.ranks[old], rank=new) for new, old in enumerate(order)]
    groups = (
        [ShardGroup(sorted(new_rank[r] for r in g.ranks)) for g in plan.shard_groups]
        if plan.shard_groups
        else plan.shard_groups
    )
    meta = dict(plan.meta)
    meta["rank_map"] = list(order)
    recorded = _recorded_cluster(plan)
    if recorded is not None:
        recorded.devices = [recorded.devices[old] for old in order]
        meta["cluster"] = recorded.to_dict()
        if "cluster_spec" in meta:
            meta["cluster_spec"] = recorded.to_spec()
        if "cluster_description" in meta:
            meta["cluster_description"] = recorded.describe()
    permuted = replace(plan, ranks=ranks, shard_groups=groups, meta=meta)
    permuted.validate()
    return permuted


def match_plan(plan: Plan, cluster: Cluster, source: str) -> tuple[Plan, list[int] | None]:
    """The plan for the ranks that came up (`cluster`, in rank order) and the permutation it
    took (None: the plan as it is); `CephaloError` where no order of the plan's devices is
    the discovered one (see the module docstring)."""
    planned = plan_devices(plan)
    found = cluster.devices
    order = match_ranks(planned, found)
    if order is None:
        raise CephaloError(mismatch_message(planned, found, source, cluster))
    if order == list(range(len(order))):
        return plan, None
    return permute_plan(plan, order), order


def mismatch_message(
    planned: list[PlanDevice], found: list[Device], source: str, cluster: Cluster
) -> str:
    """One message: the first rank whose discovered device the plan has too few of (else the
    first whose device is not the plan's for it), the plan's device for that rank and the
    discovered one, both device lists, and the fix."""
    surplus = Counter(d.type_key for d in found) - Counter(p.key for p in planned)
    rank = next((j for j, d in enumerate(found) if d.type_key in surplus), None)
    if rank is None:
        rank = next(
            j for j, (p, d) in enumerate(zip(planned, found, strict=True)) if not _close(p, d)
        )
    return (
        f"plan {source} was made for other devices: rank {rank} is a {_found(found[rank])} but "
        f"the plan's rank {rank} is a {planned[rank].describe()}, and no order of the plan's "
        f"ranks matches the devices that came up (plan: {', '.join(p.describe() for p in planned)}; "
        f"discovered: {', '.join(_found(d) for d in found)}). Make the plan for this cluster "
        f"(`cephalo plan --cluster {cluster.to_spec()} --json PLAN`, or parallel.plan = auto), or "
        "start the ranks on the devices the plan was made for, in its order"
    )


def describe_remap(order: list[int], planned: list[PlanDevice]) -> str:
    """The log line of a permuted plan: which plan rank each rank runs."""
    moved = ", ".join(
        f"rank {j} runs plan rank {i} ({planned[i].key})" for j, i in enumerate(order) if i != j
    )
    return (
        "the ranks came up in another order than the plan's devices: plan ranks reordered to "
        f"match them ({moved})"
    )
