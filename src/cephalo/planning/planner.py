"""The planner: choose each rank's batch, micro-batch, state fraction and offload to maximise throughput.

For a global batch B the throughput is B / T, so the planner minimises the step time T =
max over ranks of t_i subject to every rank's memory. All numbers come from
`cephalo.planning.costmodel`; this module only searches.

The search (docs/planner.md has the long form):

1. Ranks with the same device type and memory are one *group*: they share every table.
2. For each group, tabulate over batch b and options (micro-batch m, offload o) the rank's
   time without the optimizer, C(b, m, o), and its memory without the state, M(b, m, o).
   Keep, per b, only the Pareto-optimal options (faster or leaner than every other).
3. For a candidate step time T, a rank taking b samples can own at most
   cap(b; T) = max over options of min((M_i - M(b,.)) / 16P, (T - C(b,.)) / (P * opt_s)),
   the memory left after its activations and the time left for its optimizer both
   bounding its state fraction. cap is non-increasing in b (a bigger batch never needs
   less time or memory at the best micro-batch) and non-decreasing in T.
4. T is feasible iff some split sum b_i = B has sum cap_i(b_i) >= 1. Small instances solve
   this exactly with a max-plus dynamic program over ranks; large ones with a greedy over
   each group's upper concave hull of cap (the Lagrangian relaxation; identical ranks take
   hull vertices, at most one per group lies between two, evaluated at its true value, so
   every plan it returns is feasible). T is found by bisection.
5. With (b, m, o) fixed, the fractions are water-filled: the smallest T' with
   sum_i min(memory cap_i, (T' - C_i) / (P * opt_i)) >= 1, then s_i at those caps.

Baselines from the same cost model: `even` (plain FSDP: equal batches, equal shards) and
`proportional` (batch proportional to each device's solo speed, equal shards).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cephalo.errors import CephaloError, PlanDoesNotFit
from cephalo.log import logger
from cephalo.planning.costmodel import STATE_BYTES_PER_PARAM, CostModel
from cephalo.planning.plan import Plan, Predicted, RankPlan, largest_remainder
from cephalo.specs.cluster import Cluster

PLANNER_STRATEGIES = ("cephalo", "even", "proportional")
MAX_MICRO_BATCH = 512
"""Largest micro-batch the planner considers (beyond it GPUs gain nothing per sample)."""
MAX_BATCH_PER_RANK = 16384
"""Largest batch one rank may take (the tables grow with it; 16k samples per step per GPU is far beyond use)."""
EXACT_MICRO_BATCH = 64
"""Micro-batches up to this size are all considered; larger ones on a geometric grid."""
MICRO_BATCH_GRID = 1.05
EXACT_DP_MAX_WORK = 400_000
"""Use the exact dynamic program while ranks x (B + 1) x (max batch + 1) stays below this."""
BISECT_REL_TOL = 1e-5
"""Relative precision of the step-time bisection: the plan's step time is within this of
the optimum (tests/test_planner.py holds it to that against an exhaustive search)."""
MEMORY_SLACK_BYTES = 1
"""Kept free so that rounding the state fraction's bytes up never tips a rank over its capacity."""
FRACTION_SNAP = 1e-9
"""State fractions below this are rounded to 0 (bisection residue)."""
GIB = 1024**3


def _gib(n: float) -> str:
    """Bytes as GiB for people (MiB / bytes when tiny, as in emulated or synthetic clusters)."""
    if abs(n) >= 0.01 * GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= 1024**2:
        return f"{n / 1024**2:.1f} MiB"
    return f"{n:.0f} B"


@dataclass
class _Group:
    """Ranks with the same device type and memory: one set of tables serves them all."""

    type_key: str
    capacity: int
    ranks: list[int]
    bmax: int = 0
    time: np.ndarray | None = None
    """[b, option] step time without the optimizer (inf where the option is invalid)."""
    memcap: np.ndarray | None = None
    """[b, option] state fraction the memory left after everything else can hold."""
    micro: np.ndarray | None = None
    """[b, option] micro-batch size of the option."""
    offload: np.ndarray | None = None
    """[b, option] offload flag of the option."""
    opt_s_per_fraction: float = 0.0
    """Optimizer time of owning the whole state (P * optimizer_s_per_param)."""

    @property
    def size(self) -> int:
        return len(self.ranks)


def make_plan(
    cost_model: CostModel,
    global_batch: int,
    strategy: str = "cephalo",
    allow_offload: bool = True,
    model_name: str | None = None,
) -> Plan:
    """Make a plan for `global_batch` samples per step (see the module docstring)."""
    if global_batch < 1:
        raise CephaloError(f"the global batch must be >= 1, got {global_batch}")
    if strategy not in PLANNER_STRATEGIES:
        raise CephaloError(
            f"unknown strategy {strategy!r}; choose one of {', '.join(PLANNER_STRATEGIES)}"
        )
    started = time.perf_counter()
    if strategy == "cephalo":
        choice = _optimise(cost_model, global_batch, allow_offload)
    else:
        batches = (
            _even_batches(len(cost_model.devices), global_batch)
            if strategy == "even"
            else _proportional_batches(cost_model, global_batch)
        )
        choice = _equal_shards(cost_model, batches, allow_offload, strategy)
    elapsed = time.perf_counter() - started
    plan = _to_plan(cost_model, global_batch, strategy, choice, model_name)
    plan.meta["planner_wall_s"] = round(elapsed, 6)
    logger.debug(
        "planned %s for %d devices, batch %d, in %.3f s",
        strategy,
        len(cost_model.devices),
        global_batch,
        elapsed,
    )
    return plan


# ====================================================================== the optimiser
def _groups(cm: CostModel) -> list[_Group]:
    by_key: dict[tuple[str, int], _Group] = {}
    for i, d in enumerate(cm.devices):
        key = (d.type_key, int(d.memory_bytes))
        if key not in by_key:
            by_key[key] = _Group(type_key=d.type_key, capacity=int(d.memory_bytes), ranks=[])
        by_key[key].ranks.append(i)
    groups = list(by_key.values())
    for g in groups:
        g.opt_s_per_fraction = cm.total_params * cm.optimizer_s_per_param(g.type_key)
    return groups


def _largest_micro_batch(cm: CostModel, g: _Group, allow_offload: bool) -> int:
    """Largest m whose working memory (no state) fits at all (memory grows with m)."""
    ms = np.arange(1, MAX_MICRO_BATCH + 1)
    mem = cm.memory_without_state(g.type_key, g.capacity, ms, ms, allow_offload)
    fits = np.nonzero(mem + MEMORY_SLACK_BYTES <= g.capacity)[0]
    return int(ms[fits[-1]]) if fits.size else 0


def _micro_batch_candidates(mmax: int) -> np.ndarray:
    """Every micro-batch up to EXACT_MICRO_BATCH, then a geometric grid (and mmax itself).

    Beyond a few dozen samples a GPU's time per sample is flat, so a 5 % grid loses nothing
    measurable while it keeps the tables of 1000-GPU clusters small.
    """
    exact = np.arange(1, min(mmax, EXACT_MICRO_BATCH) + 1)
    if mmax <= EXACT_MICRO_BATCH:
        return exact
    grid = np.unique(
        np.round(EXACT_MICRO_BATCH * MICRO_BATCH_GRID ** np.arange(1, 200)).astype(np.int64)
    )
    grid = grid[(grid > EXACT_MICRO_BATCH) & (grid < mmax)]
    return np.concatenate([exact, grid, [mmax]])


def _tabulate(cm: CostModel, g: _Group, bmax: int, allow_offload: bool) -> None:
    """Fill the group's [b, option] tables for b = 0..bmax, keeping Pareto-optimal options."""
    if bmax > MAX_BATCH_PER_RANK:
        raise CephaloError(
            f"this plan would put more than {MAX_BATCH_PER_RANK} samples per step on one {g.type_key}, beyond "
            "what the planner tabulates; use a smaller global batch (accumulate over steps instead) or more devices"
        )
    mmax = max(1, min(_largest_micro_batch(cm, g, allow_offload), bmax))
    bs = np.arange(bmax + 1)[:, None]
    ms = _micro_batch_candidates(mmax)[None, :]
    offs = [False, True] if allow_offload else [False]
    times, mems, micro, offl = [], [], [], []
    for o in offs:
        t, _, _ = cm.step_time_parts(g.type_key, bs, ms, o)
        mem = cm.memory_without_state(g.type_key, g.capacity, bs, ms, o)
        # an option is valid when m <= b (or the single dummy option m = 1 of a rank without samples)
        valid = ms <= np.maximum(bs, 1)
        times.append(np.where(valid, t, np.inf))
        mems.append(np.where(valid, mem, np.inf))
        micro.append(np.broadcast_to(ms, t.shape))
        offl.append(np.full(t.shape, o))
    time_all = np.concatenate(times, axis=1)
    mem_all = np.concatenate(mems, axis=1)
    micro_all = np.concatenate(micro, axis=1)
    off_all = np.concatenate(offl, axis=1)
    memcap_all = (g.capacity - MEMORY_SLACK_BYTES - mem_all) / cm.bytes_per_fraction
    memcap_all = np.where(np.isfinite(time_all), memcap_all, -np.inf)

    # Pareto filter per row: sorted by time, an option survives only if it leaves more memory
    # than every faster one.
    order = np.argsort(time_all, axis=1, kind="stable")
    t_sorted = np.take_along_axis(time_all, order, axis=1)
    c_sorted = np.take_along_axis(memcap_all, order, axis=1)
    best_before = np.maximum.accumulate(
        np.concatenate([np.full((bmax + 1, 1), -np.inf), c_sorted[:, :-1]], axis=1), axis=1
    )
    keep = (c_sorted > best_before) & np.isfinite(t_sorted) & (c_sorted >= 0)
    width = max(1, int(keep.sum(axis=1).max()))
    # pack the kept options to the left, in time order
    rank_in_row = np.cumsum(keep, axis=1) - 1
    rows, cols = np.nonzero(keep)
    g.time = np.full((bmax + 1, width), np.inf)
    g.memcap = np.full((bmax + 1, width), -np.inf)
    g.micro = np.ones((bmax + 1, width), dtype=np.int64)
    g.offload = np.zeros((bmax + 1, width), dtype=bool)
    dest = rank_in_row[rows, cols]
    src = order[rows, cols]
    g.time[rows, dest] = t_sorted[rows, cols]
    g.memcap[rows, dest] = c_sorted[rows, cols]
    g.micro[rows, dest] = micro_all[rows, src]
    g.offload[rows, dest] = off_all[rows, src]
    g.bmax = bmax


def _capacity(g: _Group, T: float) -> tuple[np.ndarray, np.ndarray]:
    """cap(b; T) for b = 0..bmax (-inf where b cannot run within T), and the option achieving it."""
    if math.isinf(T):
        timecap = np.where(np.isfinite(g.time), np.inf, -np.inf)
    elif g.opt_s_per_fraction > 0:
        with np.errstate(
            over="ignore", invalid="ignore"
        ):  # a vanishing optimizer cost: +inf is right
            timecap = (T - g.time) / g.opt_s_per_fraction
    else:
        timecap = np.where(g.time <= T, np.inf, -np.inf)
    cap = np.minimum(g.memcap, timecap)
    best = np.argmax(cap, axis=1)
    f = cap[np.arange(cap.shape[0]), best]
    f = np.where(f >= 0, np.minimum(f, 1.0), -np.inf)
    # cap is non-increasing in b; enforce it so the feasible batches form a prefix 0..k
    f = np.minimum.accumulate(f)
    return f, best


def _split_exact(fs: list[np.ndarray], B: int) -> tuple[float, list[int]] | None:
    """Max-plus DP over ranks: the split of B maximising the sum of capacities."""
    best = np.full(B + 1, -np.inf)
    best[0] = 0.0
    args = []
    for f in fs:
        new = np.full(B + 1, -np.inf)
        arg = np.zeros(B + 1, dtype=np.int64)
        for b in range(min(len(f) - 1, B) + 1):
            if not np.isfinite(f[b]):
                break
            cand = np.full(B + 1, -np.inf)
            cand[b:] = best[: B + 1 - b] + f[b]
            better = cand > new
            new[better] = cand[better]
            arg[better] = b
        best = new
        args.append(arg)
    if not np.isfinite(best[B]):
        return None
    split, rest = [], B
    for arg in reversed(args):
        b = int(arg[rest])
        split.append(b)
        rest -= b
    return float(best[B]), split[::-1]


def _upper_hull(f: np.ndarray) -> list[int]:
    """Vertices (batch sizes) of the upper concave hull of the finite prefix of f."""
    n = int(np.isfinite(f).sum())
    hull: list[int] = []
    for x in range(n):
        while len(hull) >= 2:
            x0, x1 = hull[-2], hull[-1]
            # drop x1 if it lies on or below the chord x0 -> x
            if (f[x1] - f[x0]) * (x - x0) <= (f[x] - f[x0]) * (x1 - x0):
                hull.pop()
            else:
                break
        hull.append(x)
    return hull


def _split_hull(
    groups: list[_Group], fs: list[np.ndarray], B: int
) -> tuple[float, list[list[int]]] | None:
    """Greedy over the groups' concave hulls: cheapest capacity per sample first."""
    segments = []  # (slope, group index, start, end)
    for gi, f in enumerate(fs):
        h = _upper_hull(f)
        for a, b in zip(h[:-1], h[1:], strict=True):
            segments.append(((f[b] - f[a]) / (b - a), gi, a, b))
    if sum(int(np.isfinite(f).sum() - 1) * g.size for g, f in zip(groups, fs, strict=True)) < B:
        return None
    segments.sort(key=lambda s: -s[0])
    level = [0] * len(groups)  # every rank of the group has reached this hull vertex
    partial = [None] * len(
        groups
    )  # (ranks fully through the segment, one rank's extra, segment end)
    remaining = B
    for _, gi, a, b in segments:
        if remaining == 0:
            break
        n = groups[gi].size
        need = n * (b - a)
        if need <= remaining:
            level[gi] = b
            remaining -= need
        else:
            full, extra = divmod(remaining, b - a)
            partial[gi] = (full, extra, b)
            remaining = 0
    if remaining:
        return None
    splits, total = [], 0.0
    for gi, g in enumerate(groups):
        batches = [level[gi]] * g.size
        if partial[gi] is not None:
            full, extra, end = partial[gi]
            for j in range(full):
                batches[j] = end
            if extra:
                batches[full] = level[gi] + extra
        total += float(sum(fs[gi][b] for b in batches))
        splits.append(batches)
    return total, splits


def _feasible(groups: list[_Group], T: float, B: int, exact: bool):
    """A split of B whose capacities sum to >= 1 at step time T, or None."""
    fs, bests = [], []
    for g in groups:
        f, best = _capacity(g, T)
        if not np.isfinite(f[0]):
            return None  # even without samples this rank cannot keep up or fit
        fs.append(f)
        bests.append(best)
    if exact:
        rank_fs = [fs[gi] for gi, g in enumerate(groups) for _ in g.ranks]
        res = _split_exact(rank_fs, B)
        if res is None or res[0] < 1.0:
            return None
        it = iter(res[1])
        splits = [[next(it) for _ in g.ranks] for g in groups]
    else:
        res = _split_hull(groups, fs, B)
        if res is None or res[0] < 1.0:
            return None
        splits = res[1]
    return splits, bests


@dataclass
class _Choice:
    """Per rank: batch, micro-batch, offload, state fraction."""

    batch: list[int]
    micro: list[int]
    offload: list[bool]
    fraction: list[float]


def _fits_at_all(cm: CostModel, groups: list[_Group], B: int, allow_offload: bool):
    """A split that fits memory when time is no object (tabulating larger batches as needed), or None."""
    # First batch range per group: 1.3 x its share by solo speed (plus a margin); the
    # callers grow it whenever the optimum might lie beyond.
    speed = {
        g.type_key: _solo_speed(cm, g.type_key, max(1, round(B / len(cm.devices)))) for g in groups
    }
    total_speed = sum(speed[g.type_key] * g.size for g in groups)
    for g in groups:
        share = B * speed[g.type_key] / total_speed
        first = min(B, MAX_BATCH_PER_RANK, max(16, math.ceil(1.3 * share) + 8))
        # never shrink tables the optimiser already grew: it calls this again after growing
        # them, and shrinking them back made it grow and shrink them for ever
        if first > g.bmax or g.time is None:
            _tabulate(cm, g, max(first, g.bmax), allow_offload)
    while True:
        found = _feasible(groups, math.inf, B, _exact(groups, B))
        if found is not None:
            return found
        # memory alone rules it out at these batch ranges; larger ranges can only help by
        # giving the batch somewhere to go (cap is non-increasing in b)
        if all(g.bmax >= B for g in groups):
            return None
        for g in groups:
            _tabulate(cm, g, min(B, 2 * g.bmax), allow_offload)


def _exact(groups: list[_Group], B: int) -> bool:
    n = sum(g.size for g in groups)
    return n * (B + 1) * (max(g.bmax for g in groups) + 1) <= EXACT_DP_MAX_WORK


def _optimise(cm: CostModel, B: int, allow_offload: bool) -> _Choice:
    groups = _groups(cm)
    found = _fits_at_all(cm, groups, B, allow_offload)
    if found is None:
        raise _does_not_fit(cm, B, allow_offload)
    while True:
        exact = _exact(groups, B)
        T_hi = _step_time_of(cm, groups, found)
        T_lo = 0.0
        while T_hi - T_lo > BISECT_REL_TOL * T_hi:
            mid = 0.5 * (T_lo + T_hi)
            f = _feasible(groups, mid, B, exact)
            if f is None:
                T_lo = mid
            else:
                T_hi, found = mid, f
        # a group whose largest tabulated batch still runs within T might do better with more;
        # otherwise no rank can take more than bmax samples at this T and the search was complete
        grow = [g for g in groups if g.bmax < B and float(np.min(g.time[g.bmax])) <= T_hi]
        if not grow:
            break
        for g in grow:
            _tabulate(cm, g, min(B, 2 * g.bmax), allow_offload)
        found = _feasible(groups, T_hi, B, _exact(groups, B)) or _fits_at_all(
            cm, groups, B, allow_offload
        )
    return _water_fill(cm, groups, found)


def _rank_options(
    cm: CostModel, groups: list[_Group], found
) -> tuple[list[int], list[int], list[bool], list[float], list[float]]:
    """Per rank: batch, micro-batch, offload, time without optimizer, memory cap of the chosen option."""
    splits, bests = found
    n = len(cm.devices)
    batch, micro, off, t, mc = [0] * n, [1] * n, [False] * n, [0.0] * n, [0.0] * n
    for g, split, best in zip(groups, splits, bests, strict=True):
        for r, b in zip(g.ranks, split, strict=True):
            j = int(best[b])
            batch[r], micro[r], off[r] = b, int(g.micro[b, j]), bool(g.offload[b, j])
            t[r], mc[r] = float(g.time[b, j]), float(g.memcap[b, j])
    return batch, micro, off, t, mc


def _step_time_of(cm: CostModel, groups: list[_Group], found) -> float:
    """Step time of a split once its fractions are water-filled (the same terms as `rank_cost`)."""
    choice = _water_fill(cm, groups, found)
    _, _, _, t, _ = _rank_options(cm, groups, found)
    return max(
        t[i] + choice.fraction[i] * cm.total_params * cm.optimizer_s_per_param(d.type_key)
        for i, d in enumerate(cm.devices)
    )


def _water_fill(cm: CostModel, groups: list[_Group], found) -> _Choice:
    """Fractions that minimise the slowest rank's time under every rank's memory cap."""
    batch, micro, off, t, mc = _rank_options(cm, groups, found)
    opt = [cm.total_params * cm.optimizer_s_per_param(d.type_key) for d in cm.devices]
    mc_arr = np.clip(np.array(mc), 0.0, 1.0)
    t_arr, opt_arr = np.array(t), np.array(opt)

    def caps(T: float) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            timecap = np.where(
                opt_arr > 0,
                (T - t_arr) / np.where(opt_arr > 0, opt_arr, 1.0),
                np.where(t_arr <= T, np.inf, -np.inf),
            )
        return np.clip(np.minimum(mc_arr, timecap), 0.0, None)

    if not np.any(opt_arr > 0):
        c = mc_arr
    else:
        lo = float(t_arr.max())
        hi = lo + float(opt_arr.max())  # every rank can then take its whole memory cap (<= 1)
        while hi - lo > 1e-12 * max(hi, 1e-30) and hi - lo > 1e-15:
            mid = 0.5 * (lo + hi)
            if caps(mid).sum() >= 1.0:
                hi = mid
            else:
                lo = mid
        c = caps(hi)
        if c.sum() < 1.0:
            # the optimizer is so cheap that T' is lost in float resolution: time does not
            # limit anyone, memory does
            c = mc_arr
    total = float(c.sum())
    if total <= 0:
        raise CephaloError("internal: no rank can hold any state after planning")
    fractions = c / total
    # The bisection leaves the bottleneck ranks a residue (~1e-11) of state; an exact 0 reads
    # better and gives them an empty shard. Keep the residue if dropping it would push another
    # rank past its memory.
    snapped = np.where(fractions < FRACTION_SNAP, 0.0, fractions)
    if snapped.sum() > 0:
        snapped = snapped / snapped.sum()
        if np.all(snapped <= np.maximum(mc_arr, fractions)):
            fractions = snapped
    return _Choice(batch=batch, micro=micro, offload=off, fraction=fractions.tolist())


# ====================================================================== baselines
def _even_batches(n: int, B: int) -> list[int]:
    return largest_remainder(B, [1.0] * n)


def _solo_speed(cm: CostModel, type_key: str, ref: int) -> float:
    """Samples/s of a device's compute alone at `ref` samples in one micro-batch."""
    _, compute, _ = cm.step_time_parts(type_key, ref, ref, False)
    return ref / float(compute) if compute > 0 else 1.0


def _proportional_batches(cm: CostModel, B: int) -> list[int]:
    """Batches proportional to each device's solo speed (samples/s of compute at an even share)."""
    n = len(cm.devices)
    ref = max(1, round(B / n))
    by_type = {k: _solo_speed(cm, k, ref) for k in dict.fromkeys(d.type_key for d in cm.devices)}
    speeds = [by_type[d.type_key] for d in cm.devices]
    return largest_remainder(B, speeds)


def _equal_shards(cm: CostModel, batches: list[int], allow_offload: bool, strategy: str) -> _Choice:
    """Equal state fractions; per rank the fewest micro-batches that fit, offloading only if needed."""
    n = len(cm.devices)
    fraction = 1.0 / n
    state = float(cm.fraction_bytes(fraction))
    micro, off, short = [], [], {}
    for i, (d, b) in enumerate(zip(cm.devices, batches, strict=True)):
        cap = cm.capacity_bytes(i)
        chosen = None
        for o in [False, True] if allow_offload else [False]:
            if b == 0:
                ms = np.array([1])
            else:
                ks = np.arange(1, b + 1)
                ms = np.unique(-(-b // ks))[
                    ::-1
                ]  # largest micro-batch (fewest micro-batches) first
            mem = cm.memory_without_state(d.type_key, cap, b, ms, o) + state
            ok = np.nonzero(mem <= cap)[0]
            if ok.size:
                chosen = (int(ms[ok[0]]), o)
                break
        if chosen is None:
            least = float(cm.memory_without_state(d.type_key, cap, b, 1, allow_offload)) + state
            short[i] = int(least - cap)
            micro.append(1)
            off.append(allow_offload)
        else:
            micro.append(chosen[0])
            off.append(chosen[1])
    if short:
        per_rank = "; ".join(
            f"rank {i} ({cm.devices[i].type_key}, batch {batches[i]}) short {_gib(s)}"
            for i, s in short.items()
        )
        raise PlanDoesNotFit(
            f"the {strategy} plan does not fit even with micro-batch 1"
            f"{' and offloaded activations' if allow_offload else ''}: {per_rank}",
            short,
        )
    return _Choice(batch=list(batches), micro=micro, offload=off, fraction=[fraction] * n)


# ====================================================================== plans without a search
def manual_plan(
    model: str,
    seq_len: int,
    batches: Sequence[int],
    micro_batches: Sequence[int],
    fractions: Sequence[float],
    device_keys: Sequence[str] | None = None,
    offload: Sequence[bool] | bool = False,
    dtype: str = "fp32",
    strategy: str = "manual",
    meta: dict | None = None,
) -> Plan:
    """A plan from explicit per-rank choices (tests, benchmarks, hand-made baselines): each
    micro-batch is clipped to its rank's batch, and a rank without samples gets one dummy
    micro-batch size and none to run. Validated like any plan."""
    n = len(batches)
    keys = list(device_keys) if device_keys is not None else ["cpu"] * n
    offloads = [offload] * n if isinstance(offload, bool) else list(offload)
    ranks = []
    for i, (b, m, f, key, o) in enumerate(
        zip(batches, micro_batches, fractions, keys, offloads, strict=True)
    ):
        m = max(1, min(m, b)) if b else 1
        ranks.append(RankPlan(i, key, b, m, math.ceil(b / m), f, offload_activations=o))
    plan = Plan(strategy, model, seq_len, sum(batches), dtype, ranks, meta=dict(meta or {}))
    plan.validate()
    return plan


def simple_plan(
    strategy: str, cluster: Cluster, model_name: str, seq_len: int, global_batch: int, dtype: str
) -> Plan:
    """`even` (equal batches) or `proportional` (batches in proportion to each device's speed,
    1 / slowdown) with equal state shards and one micro-batch per rank: the FSDP-style
    baselines, made without a profile (`parallel.plan = even | proportional`)."""
    n = cluster.world_size
    if strategy == "even":
        batches = largest_remainder(global_batch, [1.0] * n)
    else:
        if any(d.type != "cpu" for d in cluster.devices):
            logger.warning(
                "plan = proportional without a profile treats every GPU as equally fast; "
                "use plan = auto (measured speeds) for a real heterogeneous cluster"
            )
        batches = largest_remainder(global_batch, [1.0 / d.slowdown for d in cluster.devices])
    return manual_plan(
        model_name,
        seq_len,
        batches,
        batches,
        [1.0 / n] * n,
        device_keys=[d.type_key for d in cluster.devices],
        dtype=dtype,
        strategy=strategy,
        meta={"cluster": cluster.describe()},
    )


# ====================================================================== output
def _to_plan(cm: CostModel, B: int, strategy: str, c: _Choice, model_name: str | None) -> Plan:
    ranks = []
    for i, d in enumerate(cm.devices):
        b = c.batch[i]
        m = max(1, min(c.micro[i], b)) if b > 0 else 1
        ranks.append(
            RankPlan(
                rank=i,
                device=d.type_key,
                batch_size=b,
                micro_batch_size=m,
                num_micro_batches=math.ceil(b / m),
                state_fraction=c.fraction[i],
                offload_activations=bool(c.offload[i] and b > 0),
            )
        )
    plan = Plan(
        strategy=strategy,
        model=model_name or cm.model.name,
        seq_len=cm.seq_len,
        global_batch_size=B,
        dtype=cm.dtype,
        ranks=ranks,
        meta=dict(cm.meta),
    )
    fill_predictions(cm, plan)
    return plan


def fill_predictions(cm: CostModel, plan: Plan) -> None:
    """Write the cost model's per-rank and whole-step predictions into the plan."""
    ev = cm.evaluate(plan)
    for r, cost in zip(plan.ranks, ev.ranks, strict=True):
        r.predicted_step_s = cost.step_s
        r.predicted_peak_memory_bytes = cost.peak_bytes
    plan.predicted = Predicted(
        step_s=ev.step_s, samples_per_s=ev.samples_per_s, tokens_per_s=ev.tokens_per_s
    )


# ====================================================================== does not fit
def _memory_only_fits(cm: CostModel, B: int, allow_offload: bool) -> bool:
    return _fits_at_all(cm, _groups(cm), B, allow_offload) is not None


def _does_not_fit(cm: CostModel, B: int, allow_offload: bool) -> PlanDoesNotFit:
    n = len(cm.devices)
    P = cm.total_params
    state_total = P * STATE_BYTES_PER_PARAM
    # what the shards need in all: the state and the reduce-scatter output that grows with it
    sharded_total = cm.bytes_per_fraction
    even_state = sharded_total / n
    lines, short = [], {}
    leftover_total = 0.0
    for i, d in enumerate(cm.devices):
        cap = cm.capacity_bytes(i)
        b = 1 if B >= 1 else 0
        least = float(cm.memory_without_state(d.type_key, cap, b, 1, allow_offload))
        idle = float(cm.memory_without_state(d.type_key, cap, 0, 1, False))
        leftover_total += max(0.0, cap - idle)
        need = least + even_state
        if need > cap:
            short[i] = int(need - cap)
            lines.append(
                f"rank {i} ({d.type_key}) needs {_gib(need)} of {_gib(cap)} (short {_gib(need - cap)})"
            )
    msg = [
        f"{cm.model.name} does not fit on this cluster: its training state alone is "
        f"{_gib(state_total)} (16 bytes x {P:,} parameters)"
    ]
    if lines:
        msg.append(
            "with micro-batch 1"
            + (", offloaded activations" if allow_offload else "")
            + " and equal shards: "
            + "; ".join(lines)
        )
    missing = sharded_total - leftover_total
    if missing > 0:
        msg.append(
            f"after buffers the devices have {_gib(leftover_total)} left for it, {_gib(missing)} too little"
        )
    if not allow_offload and _memory_only_fits(cm, B, True):
        msg.append("offloading activations to the host would fit (allow offload)")
    # the largest global batch that fits (memory only)
    lo, hi = 0, B - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _memory_only_fits(cm, mid, allow_offload):
            lo = mid
        else:
            hi = mid - 1
    if lo >= 1:
        msg.append(f"the largest global batch that fits is {lo}")
    else:
        smallest = min(range(n), key=lambda i: cm.capacity_bytes(i))
        d = cm.devices[smallest]
        cap = cm.capacity_bytes(smallest)
        per_device = (
            cap - float(cm.memory_without_state(d.type_key, cap, 0, 1, False)) - MEMORY_SLACK_BYTES
        )
        if missing > 0 and per_device > 0:
            more = math.ceil(missing / per_device)
            msg.append(
                f"no smaller batch helps: add about {more} more {d.type_key} "
                f"({_gib(cap)} each), or {_gib(missing)} more device memory in total, "
                "or train a smaller model"
            )
        else:
            msg.append(
                "no smaller batch helps: add devices with more memory, shorten the sequence, "
                "or train a smaller model"
            )
    return PlanDoesNotFit("; ".join(msg), short)
