"""Padded-even collectives (runtime/collectives/padded.py) on gloo (a 2-rank and a 3-rank process pool): a
near-even uneven split trains like the grouped collectives of its exact sizes (bitwise on 2
ranks, where a sum of two is the same in any order; to rounding on 3, where gloo's two
reduce-scatters add in different orders), runs the even collectives, and a skewed split keeps
the grouped ones."""

from __future__ import annotations

import pytest
import torch

from cephalo.costmodel.collectives import collective_factor, padded_even
from cephalo.modeling.registry import build_model
from cephalo.runtime.collectives.comm import make_comm
from cephalo.runtime.collectives.padded import PaddedSplit
from cephalo.runtime.engine.engine import Engine, EngineConfig
from cephalo.runtime.state.adamw import AdamWHyper
from cephalo.runtime.state.flat import FlatLayout
from dist_harness import dist_pool_fixture
from engine_common import (
    LR,
    TEST_EPS,
    make_data,
    make_plan,
    one_thread,
    rank_slice,
    reference_floor,
)

__all__ = ["one_thread"]
pool2 = dist_pool_fixture(2, timeout_s=300)
pool3 = dist_pool_fixture(3, timeout_s=300)
NEAR_EVEN = [0.36, 0.33, 0.31]  # max x 3 / sum = 1.08
NEAR_EVEN_2 = [0.54, 0.46]  # max x 2 / sum = 1.08
SKEWED = [0.6, 0.3, 0.1]


def test_rule_and_factor():
    assert padded_even([10, 10]) and collective_factor([10, 10]) == 1.0
    assert padded_even([11, 10]) and collective_factor([11, 10]) == pytest.approx(22 / 21)
    assert padded_even(NEAR_EVEN) and not padded_even(SKEWED)
    assert not padded_even([5]) and not padded_even([0, 0]) and collective_factor(SKEWED) == 1.0


@pytest.mark.parametrize("sizes", [[7, 5], [4, 5, 3], [3, 4, 4, 2], [4, 4, 4]])
def test_padded_split_places_every_element_once(sizes):
    """Every logical element has one place in the padded buffer, rank r's inside chunk r at
    its offset; a parameter's pieces, read in order, are the parameter."""
    split = PaddedSplit(tuple(sizes), max(sizes))  # (whatever the rule says of them)
    n = sum(sizes)
    logical = torch.arange(n, dtype=torch.float32)
    buf = torch.full((split.numel,), -1.0)
    start = 0
    for r, size in enumerate(sizes):
        at = r * split.pad + split.offset(r)
        assert r * split.pad <= at and at + size <= (r + 1) * split.pad
        buf[at : at + size] = logical[start : start + size]
        start += size
    assert int((buf >= 0).sum()) == n
    layout = FlatLayout(
        "u", [("a", torch.empty(2, 2)), ("b", torch.empty(n - 5)), ("c", torch.empty(1))]
    )
    views, copied = split.views(layout, buf, lambda k: torch.empty(k))
    for s in layout.slots:
        assert torch.equal(views[s.name].reshape(-1), logical[s.offset : s.end])
        assert torch.equal(torch.cat(split.slices(buf, s.offset, s.end)), logical[s.offset : s.end])
    # 2 ranks or equal sizes: one run, no copy (the padding is at the ends); else at most one
    # copied parameter per interior padding
    if len(sizes) == 2 or len(set(sizes)) == 1:
        assert len(split.runs()) == 1 and not copied
    assert len(copied) <= len(split.runs()) - 1
    assert PaddedSplit.of([6, 5]) == PaddedSplit((6, 5), 6) and PaddedSplit.of([7, 5]) is None


def _run(plan, cfg: EngineConfig, data, even_gather: bool = True):
    """Train on this rank. `even_gather`: equal-size gathers as all_gather_into_tensor, as
    on NCCL (gloo's default is its faster broadcasts, and then no padding)."""
    torch.set_num_threads(1)
    comm = make_comm("gloo")
    comm.even_gather = even_gather
    engine = Engine(build_model("gpt-tiny", dropout=0.1), plan, comm, cfg)
    state_bytes = engine.state_bytes()
    comm.counters.reset()
    stats = [
        engine.train_step(rank_slice(plan, comm.rank, x), rank_slice(plan, comm.rank, y), lr=LR)
        for x, y in data
    ]
    even = dict(comm.counters.even_calls)
    calls = dict(comm.counters.calls)
    return {
        "losses": [s.loss for s in stats],
        "norms": [s.grad_norm for s in stats],
        "state": [(f.name, f.offset, f.local.clone()) for f in engine.sharded_state()],
        "params": engine.full_state_dict(),
        "state_bytes": state_bytes,
        "even": even,
        "calls": calls,
        "padded": [us.padded is not None for us in engine.shards],
    }


@pytest.mark.slow
@pytest.mark.parametrize("dtype, host", [("fp32", 0.0), ("bf16", 0.5)])
def test_padded_even_matches_grouped_bitwise(pool2, dtype, host):
    """Several steps, losses, norms, every rank's state pieces and the final parameters
    bitwise equal; the padding shows nowhere (checkpoint pieces, state bytes)."""
    plan = make_plan([3, 2], NEAR_EVEN_2, [2, 1], dtype=dtype)
    plan.ranks[1].host_state_fraction = host
    padded, grouped = _both(pool2, plan)
    for a, b in zip(padded, grouped, strict=True):
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
        assert a["state_bytes"] == b["state_bytes"]
        assert len(a["state"]) == len(b["state"])
        for (na, oa, ta), (nb, ob, tb) in zip(a["state"], b["state"], strict=True):
            assert (na, oa) == (nb, ob) and torch.equal(ta, tb), na
        for name, t in a["params"].items():
            assert torch.equal(t, b["params"][name]), name


def _data(plan):
    return make_data(4, plan.global_batch_size)


def _both(pool, plan):
    """(padded-even, grouped) runs of 4 steps of `plan`, clipping and weight decay on."""
    data = _data(plan)
    kw = dict(grad_clip=0.5, adamw=AdamWHyper(eps=TEST_EPS, weight_decay=0.1))
    padded = pool.run(_run, plan, EngineConfig(**kw), data)
    grouped = pool.run(_run, plan, EngineConfig(padded_collectives=False, **kw), data)
    assert all(all(r["padded"]) for r in padded) and not any(any(r["padded"]) for r in grouped)
    return padded, grouped


@pytest.mark.slow
def test_padded_even_three_ranks_matches_grouped(pool3):
    """3 ranks: the padding between ranks 1 and 2 splits a parameter (copied out of the
    gathered unit, its gradient added into two pieces)."""
    plan = make_plan([3, 2, 2], NEAR_EVEN, [2, 1, 2])
    padded, grouped = _both(pool3, plan)
    kw = dict(grad_clip=0.5, adamw=AdamWHyper(eps=TEST_EPS, weight_decay=0.1))
    floor = reference_floor("gpt-tiny", {"dropout": 0.1}, _data(plan), EngineConfig(**kw))
    for label, runs in (("padded", padded), ("grouped", grouped)):
        for r in runs:
            floor.check(label, params=r["params"], losses=r["losses"], norms=r["norms"])
    for a, b in zip(padded, grouped, strict=True):
        assert a["state_bytes"] == b["state_bytes"]


@pytest.mark.slow
def test_counters_even_for_near_even_grouped_for_skewed(pool3):
    data = make_data(1, 7)
    near = pool3.run(_run, make_plan([3, 2, 2], NEAR_EVEN, [1, 1, 1]), EngineConfig(), data)
    skew = pool3.run(_run, make_plan([3, 2, 2], SKEWED, [1, 1, 1]), EngineConfig(), data)
    units = len(near[0]["padded"])
    for r in near:
        # every unit's own gathers and reduce-scatters are even; the head's borrowed tied wte
        # piece (its own sizes) and full_state_dict's logical gathers stay grouped
        assert r["even"]["reduce_scatter_v"] == units
        # (twice per unit but the head and the last block, gathered from its forward to its
        # backward: costmodel/rules.py)
        assert r["even"]["all_gather_v"] == 2 * units - 2
        assert r["calls"]["reduce_scatter_v"] == units + 1
    for r in skew:
        assert not any(r["padded"])
        assert r["even"]["all_gather_v"] == 0 and r["even"]["reduce_scatter_v"] == 0
    # gloo's own default: broadcasts for the gathers, so nothing is padded
    plain = pool3.run(_run, make_plan([3, 2, 2], NEAR_EVEN, [1, 1, 1]), EngineConfig(), data, False)
    assert not any(any(r["padded"]) for r in plain)
