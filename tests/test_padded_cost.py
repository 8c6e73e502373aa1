"""The padded-even charge (costmodel/collectives.py): where a split runs padded, its
collectives move N x max(fractions) of each unit and its padded buffers are held; the planner
weighs it and stays exact against a search over every split and fraction."""

import itertools
import math

import numpy as np
import pytest

from cephalo.costmodel.collectives import (
    PAD_EVEN_SLACK,
    backend_pads,
    collective_factor,
    least_unpadded_fraction,
    split_padding,
)
from cephalo.costmodel.sources import catalog_cost_model, profiles_cost_model
from cephalo.planner.makers import make_plan, manual_plan
from cephalo.specs.catalog.models import get_model_spec
from cephalo.specs.cluster import Cluster
from planner_helpers import FakeDevice, cost_model, linear_profile, tiny_model
from test_planner import assert_optimal

# the tiny model of test_costmodel.py (P = 270: embedding 50, 2 blocks of 100, head 20), two
# ranks, link 100 B/s, latency 0.5 s: a unit's gather moves 0.5 x its trained elements x d / 100
# seconds of bytes (the part padding stretches) on top of the latency


def _cm(padded=True, dtype="fp16"):
    prof = linear_profile("x", 1.0, 2.0, 1000.0, optimizer_s_per_param=0.01)
    return cost_model(
        [FakeDevice("x", 10_000), FakeDevice("x", 10_000)],
        {"x": prof},
        model=tiny_model(),
        dtype=dtype,
        bytes_per_s=100.0,
        latency_s=0.5,
        reserve_bytes=100,
        padded_collectives=padded,
    )


def _plan(cm, fractions, batches=(3, 0)):
    return manual_plan(
        "tiny",
        cm.seq_len,
        list(batches),
        [max(b, 1) for b in batches],
        list(fractions),
        device_keys=["x", "x"],
        dtype=cm.dtype,
    )


def test_the_rule():
    assert collective_factor([0.55, 0.45]) == pytest.approx(1.1)
    assert collective_factor([0.7, 0.3]) == 1.0 and collective_factor([0.5, 0.5]) == 1.0
    assert split_padding([0.55, 0.45], True) == pytest.approx(0.55)
    assert split_padding([0.55, 0.45], False) == 0.0 and split_padding([0.7, 0.3], True) == 0.0
    assert split_padding([1.0], True) == 0.0  # one rank: nothing to pad
    assert least_unpadded_fraction(4) * 4 > PAD_EVEN_SLACK
    assert backend_pads(["a100", "l4"]) and not backend_pads(["cpu", "cpu"])
    assert not backend_pads(["cpu", "l4"]) and not backend_pads([])


def test_near_even_split_on_a_padding_backend_is_charged_its_bytes():
    """[0.55, 0.45] pads to 2 x 0.55: every collective moves 1.1 x its bytes (not its latency).
    Rank 1 has no samples: its step is the collectives, one after another on the group's one
    queue, 15.2 s unpadded (test_costmodel: 10 collectives' latency 5.0 s + bytes 10.2 s)."""
    near = _cm().evaluate(_plan(_cm(), [0.55, 0.45]))
    free = _cm(padded=False).evaluate(_plan(_cm(), [0.55, 0.45]))
    for p, f in zip(near.ranks, free.ranks, strict=True):
        # 4 units x 3 collectives, each 0.5 s of latency
        assert p.comm_s == pytest.approx(1.1 * f.comm_s - 0.1 * 12 * 0.5)
    p, f = near.ranks[1], free.ranks[1]
    assert f.step_s - f.optimizer_s == pytest.approx(15.2)
    assert p.step_s - p.optimizer_s == pytest.approx(5.0 + 1.1 * 10.2)
    assert near.step_s > free.step_s
    # the planner's relaxation: the same plan without the charge
    relaxed = _cm().evaluate(_plan(_cm(), [0.55, 0.45]), charge_padding=False)
    assert relaxed.step_s == free.step_s


@pytest.mark.parametrize(
    "fractions, padded",
    [([0.7, 0.3], True), ([0.55, 0.45], False), ([0.5, 0.5], True), ([0.58, 0.42], True)],
)
def test_skewed_gloo_or_even_splits_pay_nothing(fractions, padded):
    """Skewed past 1.15 (0.7 and 0.58 of 2), on gloo, or exactly even (2 x 0.5 = 1): as unpadded."""
    ev = _cm(padded).evaluate(_plan(_cm(), fractions, (3, 2)))
    free = _cm(False).evaluate(_plan(_cm(), fractions, (3, 2)))
    assert [r.step_s for r in ev.ranks] == pytest.approx([r.step_s for r in free.ranks], rel=1e-12)
    assert [r.memory for r in ev.ranks] == [r.memory for r in free.ranks]


def test_padded_buffers_are_charged_their_bytes():
    """[9/16, 7/16] pads to 2 x 9/16 = 1.125 (fractions exact in binary). Rank 1 (s = 7/16, no
    samples): its peak is the first block's backward (test_costmodel: gathered (100 + 50) x d,
    gradients (100 + 100) x 4 = 800). Padded, both hold 1.125 x the units' trained part, and
    the reduce-scatter output is u x 100 x 4 = 225, not s x 400 = 175. In fp16 the state is as
    unpadded; in fp32 the shard buffer the gathers send from holds u of the model:
    + (9/16 - 7/16) x 270 x 4 = 135."""
    for dtype in ("fp16", "fp32"):
        cm, free = _cm(True, dtype), _cm(False, dtype)
        plan = _plan(cm, [9 / 16, 7 / 16])
        p, f = cm.evaluate(plan).ranks[1].memory, free.evaluate(plan).ranks[1].memory
        d = 2 if dtype == "fp16" else 4
        assert f.gathered == 150 * d and p.gathered == math.ceil(1.125 * 150 * d)
        assert f.grad_accum == 800 + 175 and p.grad_accum == 900 + 225
        assert p.state - f.state == (0 if dtype == "fp16" else 135)
        assert (p.activations, p.boundary, p.reserve) == (f.activations, f.boundary, f.reserve)
        # rank 0 holds the largest fraction: no padding in its shard or reduce-scatter output
        # (u = s: 225), only its unit gradients at its peak stretched by 1.125 (3 samples: the
        # first block's backward in fp16, the last block's in fp32)
        p0, f0 = cm.evaluate(plan).ranks[0].memory, free.evaluate(plan).ranks[0].memory
        assert p0.state == f0.state
        assert p0.grad_accum - 225 == 1.125 * (f0.grad_accum - 225)
        # what the planner tabulates adds up to the same (within the bytes rounded up)
        table = float(cm.memory_without_state("x", 10_000, 0, 1, False, True, 9 / 16))
        table += float(cm.fraction_bytes(7 / 16, 9 / 16))
        assert abs(table - cm.evaluate(plan).ranks[1].peak_bytes) <= 2


def test_the_cluster_says_whether_it_pads():
    """costmodel.sources reads the backend off the devices: GPUs train over NCCL (pads), CPUs
    over gloo (does not)."""
    spec = get_model_spec("gpt-test")
    gpus = catalog_cost_model(Cluster.parse("l4,l4"), spec, 512, "fp32")
    assert gpus.padded_collectives
    cpus = Cluster.parse("cpu,cpu")
    prof = {"cpu": linear_profile("cpu", 1.0, 2.0, 100.0, 1e-4)}
    assert not profiles_cost_model(cpus, tiny_model(), 3, "fp32", prof).padded_collectives
    forced = catalog_cost_model(Cluster.parse("l4,l4"), spec, 512, "fp32", padded_collectives=False)
    assert not forced.padded_collectives


# ---------------------------------------------------------------- the planner, exact
def _fractions_grid(lo: float, hi: float, n: int = 401) -> np.ndarray:
    return np.linspace(lo, hi, n)


def _best_on(cm, combo, lo, hi, pad_of) -> float:
    """min over s0 in [lo, hi] of the step of two ranks (batch, micro, offload) with fractions
    (s0, 1 - s0) whose split is padded to pad_of(s0) (0: unpadded): the rank's time at state 0
    plus its optimizer, memory within capacity (the planner's 1-byte slack). Convex in s0 on
    each piece (the collectives are a max of lines in u, the optimizer a line), its feasible
    set an interval: a grid, then zooms around its least point."""
    P = cm.optimizer_params
    for _ in range(4):
        s0 = _fractions_grid(lo, hi)
        pad = pad_of(s0)
        step = np.zeros_like(s0)
        ok = np.ones(s0.shape, dtype=bool)
        for i, ((b, m, o), s) in enumerate(zip(combo, (s0, 1.0 - s0), strict=True)):
            key, cap = cm.devices[i].type_key, cm.capacity_bytes(i)
            t, _, _ = cm.step_time_parts(key, b, m, o, pad=pad)
            step = np.maximum(step, t + s * P * cm.optimizer_s_per_param(key))
            mem = cm.memory_without_state(key, cap, b, m, o, True, pad)
            per = np.where(pad > 0, cm.bytes_per_fraction_at(1.0), cm.bytes_per_fraction)
            ok &= mem + s * per <= cap - 1
        step = np.where(ok, step, np.inf)
        k = int(np.argmin(step))
        if not np.isfinite(step[k]):
            return math.inf
        width = (hi - lo) / (len(s0) - 1)
        lo, hi = max(lo, s0[k] - width), min(hi, s0[k] + width)
        best = float(step[k])
    return best


def brute_force_two_ranks(cm, B: int) -> float:
    """Every batch split, micro-batch and offload of both ranks; the fractions over the three
    pieces where the charge is smooth: unpadded (one rank past `least_unpadded_fraction`, as
    the planner keeps it) and padded with rank 0 or rank 1 the largest."""
    F = least_unpadded_fraction(2)
    top = PAD_EVEN_SLACK / 2

    def free(s0):
        return np.zeros_like(s0)

    pieces = [
        (F, 1.0, free),
        (0.0, 1.0 - F, free),
        (0.5, top, lambda s0: s0),
        (1.0 - top, 0.5, lambda s0: 1.0 - s0),
    ]
    best = math.inf
    for b0 in range(B + 1):
        opts = [
            [(b, m, o) for m in range(1, max(b, 1) + 1) for o in (False, True)]
            for b in (b0, B - b0)
        ]
        for combo in itertools.product(*opts):
            # the charge-free time at state 0 is below every piece: skip combos that cannot win
            floor = max(
                float(cm.step_time_parts(cm.devices[i].type_key, b, m, o)[0])
                for i, (b, m, o) in enumerate(combo)
            )
            if floor >= best:
                continue
            for lo, hi, pad_of in pieces:
                best = min(best, _best_on(cm, combo, lo, hi, pad_of))
    return best


def _two(speeds, mems, bytes_per_s, opt=0.05, act=120.0, padded=True):
    profiles = {
        f"d{i}": linear_profile(
            f"d{i}", 1.0 / s, 2.0 / s, act, opt, fwd_intercept=0.2 / s, host_bytes_per_s=1e9
        )
        for i, s in enumerate(speeds)
    }
    devices = [FakeDevice(f"d{i}", m) for i, m in enumerate(mems)]
    return cost_model(
        devices,
        profiles,
        bytes_per_s=bytes_per_s,
        latency_s=0.01,
        padded_collectives=padded,
    )


@pytest.mark.parametrize(
    "speeds, mems, bytes_per_s, opt, B, act",
    [
        # near-even speeds: the charge-free optimum pads and keeps its padding
        ((1.0, 1.05), (9000, 9000), 150.0, 0.05, 4, 120.0),
        # a slow link: the padding's bytes cost more than an exactly even split
        ((1.0, 1.03), (9000, 9000), 20.0, 0.02, 4, 120.0),
        # ... or than a split skewed past the threshold
        ((1.0, 1.15), (9000, 9000), 20.0, 0.05, 4, 120.0),
        # memory tight: the charge-free optimum's padded buffers do not fit
        ((1.0, 1.05), (4000, 4000), 100.0, 0.05, 4, 120.0),
        # skewed from the start: nothing to pad
        ((1.0, 1.2), (8000, 8000), 90.0, 0.08, 3, 120.0),
    ],
)
def test_planner_exact_with_padding(speeds, mems, bytes_per_s, opt, B, act):
    cm = _two(speeds, mems, bytes_per_s, opt, act)
    ref = brute_force_two_ranks(cm, B)
    plan = make_plan(cm, B)
    ev = cm.evaluate(plan)
    assert ev.fits and sum(plan.batch_sizes) == B
    assert_optimal(ev.step_s, ref)
    # the same cluster on gloo: nothing charged, and never slower
    gloo = _two(speeds, mems, bytes_per_s, opt, act, padded=False)
    assert gloo.evaluate(make_plan(gloo, B)).step_s <= ev.step_s * (1 + 1e-9)


@pytest.mark.parametrize(
    "speeds, opt, mems, how",
    [
        ((1.0, 1.03), 0.02, (9000, 9000), "even"),
        ((1.0, 1.15), 0.05, (9000, 9000), "skewed"),
        ((1.0, 1.05), 0.05, (4000, 4000), "padded"),
    ],
)
def test_planner_avoids_or_pays_the_padding(speeds, opt, mems, how):
    """Instances whose charge-free optimum runs padded and pays for it (time, or memory it
    does not have): the plan made with the charge is better by the cost model's own
    evaluation, and it splits as the instance needs: exactly even, skewed past the threshold
    (by `SKEW_MARGIN`), or padded to a different largest fraction."""
    # (the skewed instance on a 40 B/s link: on 20 B/s its gather and reduce-scatter, one
    # after the other on the group's queue, push the optimum far past the threshold)
    bw = {"padded": 100.0, "skewed": 40.0}.get(how, 20.0)
    cm, free = _two(speeds, mems, bw, opt), _two(speeds, mems, bw, opt, padded=False)
    relaxed = make_plan(free, 4)
    assert split_padding(relaxed.state_fractions, True) > 0.5  # near even, not even
    as_run = cm.evaluate(relaxed)
    assert as_run.step_s > free.evaluate(relaxed).step_s or not as_run.fits
    plan = make_plan(cm, 4)
    ev = cm.evaluate(plan)
    assert ev.fits and (not as_run.fits or ev.step_s < as_run.step_s * (1 - 1e-6))
    top = max(plan.state_fractions)
    if how == "even":
        assert plan.state_fractions == pytest.approx([0.5, 0.5], abs=1e-12)
    elif how == "skewed":
        assert 2 * top == pytest.approx(least_unpadded_fraction(2) * 2, rel=1e-9)
        assert split_padding(plan.state_fractions, True) == 0.0
    else:
        assert 0.5 < top < max(relaxed.state_fractions) and split_padding(
            plan.state_fractions, True
        )


def _three_random_ranks(seed: int) -> tuple[list, dict, dict]:
    """Three devices of random speed (within 10 %) and memory, and a random link: (devices,
    profiles, link keywords of `cost_model`)."""
    rng = np.random.default_rng(seed)
    speeds = tuple(1.0 + 0.1 * rng.random(3))
    mems = tuple(int(m) for m in rng.integers(4500, 9000, 3))
    profiles = {
        f"d{i}": linear_profile(f"d{i}", 1.0 / s, 2.0 / s, 120.0, 0.05, fwd_intercept=0.2 / s)
        for i, s in enumerate(speeds)
    }
    devices = [FakeDevice(f"d{i}", m) for i, m in enumerate(mems)]
    kw = {"bytes_per_s": float(rng.choice([20.0, 100.0])), "latency_s": 0.01}
    return devices, profiles, kw


@pytest.mark.parametrize("seed", range(6))
def test_three_ranks_between_the_bounds(seed):
    """Three ranks, padding on: the plan fits and lies between the charge-free optimum (a lower
    bound on every plan) and that optimum as it would run (a plan the search also weighs)."""
    devices, profiles, kw = _three_random_ranks(seed)
    cm = cost_model(devices, profiles, padded_collectives=True, **kw)
    free = cost_model(devices, profiles, **kw)
    relaxed = make_plan(free, 6)
    plan = make_plan(cm, 6)
    ev, as_run = cm.evaluate(plan), cm.evaluate(relaxed)
    assert ev.fits
    assert ev.step_s >= free.evaluate(relaxed).step_s * (1 - 1e-5)
    if as_run.fits:
        assert ev.step_s <= as_run.step_s * (1 + 1e-12)


def _least_step(C, o, caps, floor_rank=-1, floor=0.0) -> np.ndarray:
    """Per column (a charge): the least T with sum_i min(caps_i, (T - C_i) / o_i) >= 1 (each
    term at least 0), rank `floor_rank` taking at least `floor`: the optimal fractions of
    fixed (batch, micro-batch, offload) choices, by bisection on T. Rows: ranks; inf where no
    T will do."""

    def enough(T):
        c = np.clip((T - C) / o, 0.0, caps)
        ok = c.sum(axis=0) >= 1.0
        return ok & (c[floor_rank] >= floor) if floor_rank >= 0 else ok

    possible = (np.maximum(caps, 0).sum(axis=0) >= 1.0) & np.all(caps >= 0, axis=0)
    if floor_rank >= 0:
        possible &= caps[floor_rank] >= floor
    lo = C.max(axis=0)
    hi = lo + (o * np.maximum(caps, 0)).max(axis=0) + 1e-12
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        ok = enough(mid)
        hi, lo = np.where(ok, mid, hi), np.where(ok, lo, mid)
    return np.where(possible, hi, np.inf)


def _tables(cm, combo, pad):
    """Per rank of `combo` ((batch, micro-batch) each, no offload) and per charge in `pad`: the
    time without the optimizer and the state fraction its memory holds (the planner's slack)."""
    pad = np.atleast_1d(np.asarray(pad, dtype=np.float64))
    C, caps = [], []
    for i, (b, m) in enumerate(combo):
        key, cap = cm.devices[i].type_key, cm.capacity_bytes(i)
        C.append(np.broadcast_to(cm.step_time_parts(key, b, m, False, pad=pad)[0], pad.shape))
        mem = cm.memory_without_state(key, cap, b, m, False, True, pad)
        per = np.where(pad > 0, cm.bytes_per_fraction_at(1.0), cm.bytes_per_fraction)
        caps.append(np.broadcast_to((cap - 1 - mem) / per, pad.shape))
    return np.array(C), np.array(caps), pad


def brute_force_n_ranks(cm, B: int) -> float:
    """Every batch split and micro-batch of every rank (no offload); the fractions of each
    choice: unpadded with one rank held at `least_unpadded_fraction` or more (the planner's
    rule), or padded, every fraction at most u, charged at u, for u over [1/N, 1.15/N] (convex
    in u for fixed choices: a grid zoomed around its least point)."""
    n = len(cm.devices)
    o = np.array([[cm.optimizer_params * cm.optimizer_s_per_param(d.type_key)] for d in cm.devices])
    F = least_unpadded_fraction(n)
    best = math.inf
    for split in _compositions(B, n):
        opts = [[(b, m) for m in range(1, max(b, 1) + 1)] for b in split]
        for combo in itertools.product(*opts):
            C0, caps0, _ = _tables(cm, combo, 0.0)
            if C0.max() >= best:  # the charge-free time without state: no fraction beats it
                continue
            for j in range(n):
                best = min(best, float(_least_step(C0, o, np.minimum(caps0, 1.0), j, F)[0]))
            lo, hi = 1.0 / n, PAD_EVEN_SLACK / n
            for _ in range(5):
                C, caps, u = _tables(cm, combo, np.linspace(lo, hi, 41))
                step = _least_step(C, o, np.minimum(caps, u * (1 + 1e-12)))
                k = int(np.argmin(step))
                if not np.isfinite(step[k]):
                    break
                best = min(best, float(step[k]))
                w = u[1] - u[0]
                lo, hi = max(1.0 / n, u[k] - w), min(PAD_EVEN_SLACK / n, u[k] + w)
    return best


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(total + parts - 1), parts - 1):
        edges = (-1, *cuts, total + parts - 1)
        yield [edges[i + 1] - edges[i] - 1 for i in range(parts)]


@pytest.mark.parametrize(
    "seed, B",
    # measured: padded to an interior largest fraction (0, 2, 6 at B = 3: the planner within
    # 2.2e-6), exactly even (3 at B = 6), skewed past the threshold (1, 3 at B = 4), unpadded
    # from the start (4 at B = 4)
    [(0, 3), (2, 3), (6, 3), (3, 6), (1, 4), (3, 4), (4, 4)],
)
def test_three_ranks_exact_with_padding(seed, B):
    """The planner (no offload) against `brute_force_n_ranks` on three ranks with padding on."""
    devices, profiles, kw = _three_random_ranks(seed)
    cm = cost_model(devices, profiles, padded_collectives=True, **kw)
    ref = brute_force_n_ranks(cm, B)
    plan = make_plan(cm, B, allow_offload=False)
    ev = cm.evaluate(plan)
    assert ev.fits and sum(plan.batch_sizes) == B
    assert_optimal(ev.step_s, ref)
