"""A plan file meets the ranks that came up (planner/rank_match.py): the same order runs the
plan as it is, another order of the same devices reorders its rank-plans, other devices stop
with one message naming the rank, the plan's device and the discovered one."""

from __future__ import annotations

import pytest

from cephalo.errors import CephaloError
from cephalo.planner.makers import manual_plan
from cephalo.planner.plan import Plan, ShardGroup
from cephalo.planner.rank_match import match_plan, match_ranks, plan_devices
from cephalo.specs.cluster import Cluster, Device

GiB = 2**30
SPEC = "cpu,cpu:slowdown=3,mem=24MiB"


def recorded_plan(spec: str, batches, fractions, recorded: bool = True) -> Plan:
    """A plan for `spec` as `cephalo plan` writes one (its cluster in meta), or hand-written
    (type keys only)."""
    cluster = Cluster.parse(spec)
    meta = {"cluster": cluster.to_dict(), "cluster_spec": spec} if recorded else {}
    return manual_plan(
        "gpt-tiny",
        16,
        batches,
        batches,
        fractions,
        device_keys=[d.type_key for d in cluster.devices],
        meta=meta,
    )


def test_same_order_is_the_plan_itself():
    plan = recorded_plan(SPEC, [5, 1], [0.889, 0.111])
    matched, order = match_plan(plan, Cluster.parse(SPEC), "p.json")
    assert order is None and matched is plan


def test_swapped_devices_get_the_rank_plans_made_for_them():
    plan = recorded_plan(SPEC, [5, 1], [0.889, 0.111])
    swapped = Cluster.parse("cpu:slowdown=3,mem=24MiB,cpu")
    matched, order = match_plan(plan, swapped, "p.json")
    assert order == [1, 0]
    assert [r.rank for r in matched.ranks] == [0, 1]
    assert [r.device for r in matched.ranks] == [d.type_key for d in swapped.devices]
    assert matched.batch_sizes == [1, 5] and matched.state_fractions == [0.111, 0.889]
    assert matched.batch_offsets() == [0, 1]  # consecutive slices in the new rank order
    assert matched.meta["rank_map"] == [1, 0]
    assert Cluster.parse(matched.meta["cluster_spec"]).devices == swapped.devices
    assert plan.batch_sizes == [5, 1]  # the loaded plan is left as it was
    # a hand-written plan (type keys only) is matched the same way
    bare = recorded_plan(SPEC, [5, 1], [0.889, 0.111], recorded=False)
    assert match_plan(bare, swapped, "p.json")[1] == [1, 0]


def test_other_devices_stop_with_one_message():
    plan = recorded_plan(SPEC, [5, 1], [0.889, 0.111])
    with pytest.raises(CephaloError) as err:
        match_plan(plan, Cluster.parse("cpu,cpu:slowdown=2"), "p.json")
    text = str(err.value)
    assert "plan p.json was made for other devices: rank 1 is a cpu:slowdown=2 (4 GiB)" in text
    assert "the plan's rank 1 is a cpu:slowdown=3 (24 MiB)" in text
    assert "cephalo plan --cluster cpu,cpu:slowdown=2" in text
    assert "start the ranks on the devices the plan was made for" in text
    # swapped AND different: the rank named is one whose device the plan lacks
    with pytest.raises(
        CephaloError,
        match=r"rank 0 is a cpu:slowdown=2 \(4 GiB\) but the plan's rank 0 is a cpu \(",
    ):
        match_plan(plan, Cluster.parse("cpu:slowdown=2,cpu"), "p.json")


def test_equal_devices_keep_their_order():
    spec = "cpu,cpu:slowdown=2,cpu,cpu:slowdown=2"
    plan = recorded_plan(spec, [3, 1, 2, 0], [0.4, 0.1, 0.3, 0.2])
    matched, order = match_plan(plan, Cluster.parse("cpu:slowdown=2,cpu,cpu,cpu:slowdown=2"), "p")
    assert order == [1, 0, 2, 3]
    assert matched.batch_sizes == [1, 3, 2, 0]


def test_memory_tells_equal_types_apart_where_the_plan_recorded_it():
    plan = recorded_plan("cpu:mem=24MiB,cpu", [1, 5], [0.1, 0.9])
    swapped = Cluster.parse("cpu,cpu:mem=24MiB")
    assert match_plan(plan, swapped, "p")[1] == [1, 0]
    # a hand-written plan knows type keys only: equal types run in the plan's order
    bare = recorded_plan("cpu:mem=24MiB,cpu", [1, 5], [0.1, 0.9], recorded=False)
    assert match_plan(bare, swapped, "p")[1] is None


def test_a_gpu_reporting_less_than_its_data_sheet_is_still_the_plans():
    plan = recorded_plan("l4,a6000", [2, 4], [0.3, 0.7])
    found = [Device("a6000", int(47.5 * GiB)), Device("l4", int(22.5 * GiB))]
    assert match_ranks(plan_devices(plan), found) == [1, 0]
    assert match_ranks(plan_devices(plan), found[::-1]) == [0, 1]
    # the smaller plan device goes to the smaller discovered one
    two = recorded_plan("l4:mem=20GiB,l4", [1, 2], [0.2, 0.8])
    assert match_ranks(plan_devices(two), [Device("l4", 23 * GiB), Device("l4", 19 * GiB)]) == [
        1,
        0,
    ]
    # half the memory is another device
    assert (
        match_ranks(plan_devices(plan), [Device("l4", 12 * GiB), Device("a6000", 48 * GiB)]) is None
    )


def test_nodes_are_kept_where_the_devices_allow():
    spec = "cpu@node0,cpu@node0:slowdown=2,cpu@node1,cpu@node1:slowdown=2"
    plan = recorded_plan(spec, [2, 1, 2, 1], [0.3, 0.2, 0.3, 0.2])
    found = Cluster.parse("cpu@node0:slowdown=2,cpu@node0,cpu@node1,cpu@node1:slowdown=2").devices
    assert match_ranks(plan_devices(plan), found) == [1, 0, 2, 3]
    # the same devices on each node: each rank runs the rank-plan of its node
    found = Cluster.parse("cpu@node1,cpu@node1:slowdown=2,cpu@node0,cpu@node0:slowdown=2").devices
    assert match_ranks(plan_devices(plan), found) == [2, 3, 0, 1]
    # torchrun numbered the nodes the other way: the devices still match, node for node
    plan = recorded_plan("2xcpu@node0,2xcpu@node1:slowdown=2", [2, 2, 1, 1], [0.3, 0.3, 0.2, 0.2])
    found = Cluster.parse("2xcpu@node0:slowdown=2,2xcpu@node1").devices
    assert match_ranks(plan_devices(plan), found) == [2, 3, 0, 1]


def test_shard_groups_follow_their_ranks():
    plan = recorded_plan("cpu,cpu:slowdown=2,cpu,cpu:slowdown=2", [2, 1, 2, 1], [0.3, 0.2] * 2)
    plan.shard_groups = [ShardGroup([0, 1]), ShardGroup([2, 3])]
    for r in plan.ranks:
        r.state_fraction *= 2
    plan.validate()
    found = Cluster.parse("cpu:slowdown=2,cpu,cpu,cpu:slowdown=2")
    matched, order = match_plan(plan, found, "p")
    assert order == [1, 0, 2, 3]
    assert matched.groups == [[0, 1], [2, 3]]
    found = Cluster.parse("cpu,cpu:slowdown=2,cpu:slowdown=2,cpu")
    matched, order = match_plan(plan, found, "p")
    assert order == [0, 1, 3, 2] and matched.groups == [[0, 1], [2, 3]]
    assert matched.state_fractions == [0.6, 0.4, 0.4, 0.6]
    found = Cluster.parse("cpu:slowdown=2,cpu:slowdown=2,cpu,cpu")
    matched, order = match_plan(plan, found, "p")
    assert order == [1, 3, 0, 2] and matched.groups == [[0, 2], [1, 3]]
