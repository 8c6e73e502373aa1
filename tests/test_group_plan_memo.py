"""Shard-group planning shares its work (planner/group_split.py `GroupPlanMemo`, a `TableCache`
per step curve, `CostModel.evaluate`'s rank costs): the plans must be exactly those made
without any of it, on clusters whose groupings repeat groups and on ones that differ only in
what the memo must tell apart (links, memory)."""

import json

import pytest

import cephalo.planner.group_split as group_split
from cephalo.costmodel.model import CostModel
from cephalo.costmodel.sources import catalog_cost_model
from cephalo.planner.group_split import GroupPlanMemo, _group_plan
from cephalo.planner.shard_groups import make_hierarchical_plan
from cephalo.specs.catalog.models import get_model_spec
from cephalo.specs.cluster import Cluster

# nodes repeat within and across clusters; the last two differ from others only in the
# inter-node rate or one node's memory, which the memo must not confuse
CLUSTERS = [
    "4xa6000@node0,4xl4@node1,4xv100x16@node2;inter=10GB/s",
    "4xl4@node0,4xa6000@node1,4xl4@node2,4xa6000@node3;inter=10GB/s",
    "4xt4@node0,4xl4@node1;inter=10GB/s",
    "4xt4@node0,4xl4@node1,4xt4@node2,4xl4@node3;inter=10GB/s",
    "4xa6000@node0,4xl4@node1,4xv100x16@node2;inter=2GB/s",
    "4xt4@node0,4xl4:mem=16GiB,node=1;inter=10GB/s",
]
BATCH = 96


def _cm(spec: str) -> CostModel:
    return catalog_cost_model(Cluster.parse(spec), get_model_spec("gpt-2.7b"), 512, "fp16")


def _as_dict(plan) -> dict:
    """The plan without its wall time (the only field that may differ)."""
    d = json.loads(plan.to_json())
    d["meta"].pop("planner_wall_s", None)
    return d


def _plans(memo: GroupPlanMemo | None) -> list[dict]:
    return [
        _as_dict(make_hierarchical_plan(_cm(spec), BATCH, reduce_dtype="bf16", memo=memo))
        for spec in CLUSTERS
    ]


@pytest.fixture
def uncached(monkeypatch):
    """The planner as it was without shared work: every group plan made afresh with tables
    of its own, every evaluation computing its rank costs afresh."""

    def fresh(self, key, cm, b, planner_kw, tables=None):
        return _group_plan(cm, b, planner_kw)

    evaluate = CostModel.evaluate

    def evaluate_afresh(self, plan, charge_padding=True):
        self._rank_costs = {}
        return evaluate(self, plan, charge_padding)

    monkeypatch.setattr(GroupPlanMemo, "plan", fresh)
    monkeypatch.setattr(group_split, "TableCache", lambda cm: None)
    monkeypatch.setattr(CostModel, "evaluate", evaluate_afresh)


def test_shared_group_plans_are_the_plans_made_afresh(request):
    memo = GroupPlanMemo()
    shared = _plans(memo)
    again = _plans(memo)  # every group plan from the memo now
    assert memo.hits > 0
    assert any(p["shard_groups"] for p in shared), "no cluster chose shard groups"
    request.getfixturevalue("uncached")
    reference = _plans(None)
    assert shared == reference
    assert again == reference


def test_memo_tells_groups_apart_by_links_and_memory():
    memo = GroupPlanMemo()
    keys = {
        memo.key(_cm(spec).group_model(members, 2, "bf16"), {})
        for spec, members in [
            ("4xl4@node0,4xt4@node1;inter=10GB/s", [0, 1, 2, 3]),
            ("4xt4@node0,4xl4@node1;inter=10GB/s", [4, 5, 6, 7]),  # the same group
            ("4xl4@node0,4xt4@node1;inter=2GB/s", [0, 1, 2, 3]),  # another inter rate
            ("4xl4:mem=16GiB,node=0,4xt4@node1;inter=10GB/s", [0, 1, 2, 3]),  # less memory
        ]
    }
    assert len(keys) == 3
