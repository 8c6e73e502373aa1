"""The split of a batch over shard groups (planner/group_split.py): exact against every split on
synthetic step curves (staircases with plateaus and ties, as a group of n ranks gives), and the
number of plans it makes on large clusters (identical groups planned once per batch size)."""

import itertools
import math
import random
from types import SimpleNamespace

import pytest

from cephalo.costmodel.sources import catalog_cost_model
from cephalo.planner.group_split import StepCurve, split_batch
from cephalo.planner.shard_groups import candidate_groupings, plan_grouping
from cephalo.specs.catalog.models import get_model_spec
from cephalo.specs.cluster import Cluster


class _Synthetic(StepCurve):
    """A non-decreasing T(b) from a table (inf beyond it: memory), counting its evaluations."""

    def __init__(self, table: list[float], ranks: int, bmax: int):
        super().__init__(SimpleNamespace(devices=[None] * ranks), bmax)
        self.table = table

    def __call__(self, b: int) -> float:
        if b <= 0:
            return -math.inf
        if b > self.bmax:
            return math.inf
        if b not in self.values:
            self.values[b] = self.table[b] if b < len(self.table) else math.inf
        return self.values[b]

    def rate(self, b: int) -> float:
        return len(self.cm.devices) / max(1e-9, self.table[min(len(self.table) - 1, 2)])


def _staircase(rng: random.Random, ranks: int, length: int) -> list[float]:
    """T(b) of a group of `ranks` ranks: a base, a rise every `ranks` samples, small sub-steps and
    plateaus in between (rounded so that ties occur)."""
    base, per = rng.uniform(0.5, 3), rng.uniform(0.2, 2)
    t = [0.0]
    for b in range(1, length):
        stair = math.ceil(b / ranks)
        sub = rng.choice([0.0, 0.0, 0.01, 0.03]) * ((b - 1) % ranks)
        t.append(round(max(base, per * stair + sub), 2))
    for b in range(2, length):  # non-decreasing
        t[b] = max(t[b], t[b - 1])
    return t


def _brute(tables, counts, B) -> float:
    per_group = [tab for tab, c in zip(tables, counts, strict=True) for _ in range(c)]
    best = math.inf
    for split in itertools.product(range(1, B + 1), repeat=len(per_group)):
        if sum(split) == B:
            best = min(
                best,
                max(
                    tab[b] if b < len(tab) else math.inf
                    for tab, b in zip(per_group, split, strict=True)
                ),
            )
    return best


@pytest.mark.parametrize("seed", range(40))
def test_exact_against_every_split_on_staircases(seed):
    rng = random.Random(seed)
    kinds = rng.randint(1, 3)
    counts = [rng.randint(1, 2) for _ in range(kinds)]
    g = sum(counts)
    B = rng.randint(g, 14)
    tables = [_staircase(rng, rng.randint(1, 4), rng.randint(3, 16)) for _ in range(kinds)]
    curves = [_Synthetic(t, len(t) % 4 + 1, B - (g - 1)) for t in tables]
    t_star, best = split_batch(curves, counts, B)
    assert t_star == _brute(tables, counts, B)
    if math.isfinite(t_star):
        # every group of a kind can take maxB(T*) samples, and together they hold B
        assert sum(c * b for c, b in zip(counts, best, strict=True)) >= B
        assert all(b >= 1 and tab[b] <= t_star for tab, b in zip(tables, best, strict=True))


def test_identical_groups_are_planned_once_per_batch_size():
    """128 nodes of 4 kinds: the split plans a handful of batch sizes of each kind (not of each
    node), about as many as for 8 nodes of the same kinds."""
    types = ["l4", "a6000", "t4", "rtx3090"]
    made = {}
    for nodes in (8, 128):
        spec = ",".join(f"8x{types[i % 4]}@node{i}" for i in range(nodes)) + ";inter=3.1GB/s"
        cm = catalog_cost_model(Cluster.parse(spec), get_model_spec("gpt-2.7b"), 512, "fp16")
        res = plan_grouping(cm, 32 * 8 * nodes, candidate_groupings(cm)[0], "bf16")
        assert res.plan is not None and res.plan.hierarchical
        made[nodes] = res.plans_made
        # identical groups are evaluated once, each rank's cost on its own node
        ev = cm.evaluate(res.plan)
        assert ev.fits
        assert [c.node for c in ev.ranks] == list(cm.host.node_of)
    assert made[128] <= 12 * len(types), made
    assert made[128] <= made[8] + 2 * len(types), made
