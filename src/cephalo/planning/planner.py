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

Two more per-rank choices where the cost model knows the cluster (`CostModel.host`,
`CostModel.serial_reduce`): an option may wait for each reduce-scatter at once (one unit
gradient less, the reduce-scatter no longer hidden), and a rank may keep a part x of the model's
state on the host (`host_state_fraction` h = x / s). With host state, cap(b; T) becomes a
small linear programme per (b, option): maximise x + y (y: the device-held part) under the
device memory (16 P bytes per unit of y, d P per unit of x), the rank's share of its node's host
memory, and the time left (the device optimizer on y; on x the gradient copies, the host AdamW
and the uploads: added on a CPU, beside the device optimizer on a GPU). Its optimum lies at
x = 0, at the largest x, or where the memory and time bounds on y cross, so it stays closed
form. The water-filling then solves the same programme per rank, and each rank keeps on the
host the least part its memory needs, or more only where that makes it faster.

Baselines from the same cost model: `even` (plain FSDP: equal batches, equal shards) and
`proportional` (batch proportional to each device's solo speed, equal shards).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from cephalo.errors import CephaloError, PlanDoesNotFit
from cephalo.log import logger
from cephalo.planning.costmodel import CostModel
from cephalo.planning.padded_search import PADDED_REL_TOL, Attempt, best_with_padding
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
HOST_STATE_MIN_GAIN = 0.03
"""Host state, and ranks waiting for each reduce-scatter, must each make the predicted step at
least this much shorter than the best plan without them, or that plan is kept: they trade time
for memory (host state also costs host memory and a host CPU busy with the optimizer), and
smaller gains are within the model's error (a few percent on the emulated devices,
bench/results/hetero_throughput.md)."""
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
    overlap: np.ndarray | None = None
    """[b, option] whether the option overlaps its reduce-scatters."""
    host_boundary: np.ndarray | None = None
    """[b, option] host bytes of the option's offloaded boundaries."""
    host_share: float = math.inf
    """Host memory of one rank: its node's, shared equally by the node's ranks."""
    host_rates: tuple[float, float, float] = (math.inf, math.inf, math.inf)
    """Per host-held parameter: gradient copy, upload, host AdamW seconds (`CostModel.host_rates`)."""
    async_copies: bool = True
    floor: float = 0.0
    """The state fraction this group's one rank must own at least (`_Allowed.floor_rank`)."""

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class _Allowed:
    """What the search may choose beyond batch, micro-batch and state fraction."""

    offload: bool
    """Offload boundary activations."""
    host: bool = False
    """Keep state on the host (the cost model knows the hosts)."""
    serial: bool = False
    """Wait for each reduce-scatter at once."""
    pad: float = 0.0
    """The split's padding charged (`CostModel.split_padding`; 0: none): the padded-even search
    (padded_search.py) plans under a charge; the plain search is the charge-free relaxation."""
    clip: float = 1.0
    """The largest state fraction any rank may own (padded-even: the split's padding)."""
    floor_rank: int = -1
    """A rank that must own at least `floor` of the state (>= 0), so that the split runs
    unpadded (padded_search.py)."""
    floor: float = 0.0
    rel_tol: float = BISECT_REL_TOL
    """Relative precision of the step-time bisection."""


def make_plan(
    cost_model: CostModel,
    global_batch: int,
    strategy: str = "cephalo",
    allow_offload: bool = True,
    model_name: str | None = None,
    allow_host_state: bool = True,
    host_state_min_gain: float = HOST_STATE_MIN_GAIN,
    explain: bool = True,
) -> Plan:
    """Make a plan for `global_batch` samples per step (see the module docstring).

    `allow_host_state=False` keeps all training state on the devices even where the cost model
    knows the hosts (the plan to compare with); a plan with host state is only returned where
    its predicted step is at least `host_state_min_gain` shorter than that of the best plan
    without (or where none fits without). `explain=False`: a plan that does not fit raises a
    `PlanDoesNotFit` without working out why (searches that only need to know, such as the
    split over shard groups, skip the search for the largest batch that fits)."""
    if global_batch < 1:
        raise CephaloError(f"the global batch must be >= 1, got {global_batch}")
    if strategy not in PLANNER_STRATEGIES:
        raise CephaloError(
            f"unknown strategy {strategy!r}; choose one of {', '.join(PLANNER_STRATEGIES)}"
        )
    started = time.perf_counter()
    if strategy == "cephalo":
        allowed = _Allowed(
            offload=allow_offload,
            host=allow_host_state
            and cost_model.host is not None
            and not cost_model.adapter.frozen_base,
            serial=cost_model.serial_reduce,
        )
        choice = _optimise_charged(cost_model, global_batch, allowed, explain)
        if allowed.host and choice.host is not None and any(h > 0 for h in choice.host):
            choice, allowed = _unless_marginal(
                cost_model, global_batch, allowed, choice, "host", host_state_min_gain
            )
        if allowed.serial and choice.overlap is not None and not all(choice.overlap):
            choice, _ = _unless_marginal(
                cost_model, global_batch, allowed, choice, "serial", host_state_min_gain
            )
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
def _groups(cm: CostModel, allowed: _Allowed | None = None) -> list[_Group]:
    by_key: dict[tuple, _Group] = {}
    floor_rank = allowed.floor_rank if allowed is not None else -1
    for i, d in enumerate(cm.devices):
        share, rates = math.inf, (math.inf, math.inf, math.inf)
        if cm.host is not None:
            node = cm.host.node_of[i]
            share = cm.host.memory_bytes[node] / len(cm.host.ranks_on(node))
            rates = cm.host_rates(i)
        # the rank with a floor on its fraction is a group of its own (its capacity differs)
        key = (d.type_key, int(d.memory_bytes), share, rates, i == floor_rank)
        if key not in by_key:
            by_key[key] = _Group(
                type_key=d.type_key,
                capacity=int(d.memory_bytes),
                ranks=[],
                host_share=share,
                host_rates=rates,
                async_copies=cm.profiles[d.type_key].async_copies,
                floor=allowed.floor if i == floor_rank and allowed is not None else 0.0,
            )
        by_key[key].ranks.append(i)
    groups = list(by_key.values())
    for g in groups:
        g.opt_s_per_fraction = cm.optimizer_params * cm.optimizer_s_per_param(g.type_key)
    return groups


def _largest_micro_batch(cm: CostModel, g: _Group, allowed: _Allowed) -> int:
    """Largest m whose working memory (no state) fits at all (memory grows with m)."""
    ms = np.arange(1, MAX_MICRO_BATCH + 1)
    mem = cm.memory_without_state(
        g.type_key, g.capacity, ms, ms, allowed.offload, not allowed.serial, allowed.pad
    )
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


def _tabulate(cm: CostModel, g: _Group, bmax: int, allowed: _Allowed) -> None:
    """Fill the group's [b, option] tables for b = 0..bmax, keeping Pareto-optimal options."""
    if bmax > MAX_BATCH_PER_RANK:
        raise CephaloError(
            f"this plan would put more than {MAX_BATCH_PER_RANK} samples per step on one {g.type_key}, beyond "
            "what the planner tabulates; use a smaller global batch (accumulate over steps instead) or more devices"
        )
    mmax = max(1, min(_largest_micro_batch(cm, g, allowed), bmax))
    bs = np.arange(bmax + 1)[:, None]
    ms = _micro_batch_candidates(mmax)[None, :]
    offs = [False, True] if allowed.offload else [False]
    overlaps = [True, False] if allowed.serial else [True]
    # every (offload, overlap) choice in one evaluation: axes b, m, offload, overlap
    o_axis = np.array(offs)[None, None, :, None]
    ov_axis = np.array(overlaps)[None, None, None, :]
    t_all, _, _ = cm.step_time_parts(
        g.type_key, bs[..., None, None], ms[..., None, None], o_axis, ov_axis, pad=allowed.pad
    )
    mem_all = cm.memory_without_state(
        g.type_key,
        g.capacity,
        bs[..., None, None],
        ms[..., None, None],
        o_axis,
        ov_axis,
        allowed.pad,
    )
    shape = (bmax + 1, ms.shape[1], len(offs), len(overlaps))
    t_all, mem_all = np.broadcast_to(t_all, shape), np.broadcast_to(mem_all, shape)
    blocks = []
    for io, o in enumerate(offs):
        for iv, ov in enumerate(overlaps):
            t, mem = t_all[:, :, io, iv], mem_all[:, :, io, iv]
            # an option is valid when m <= b (or the single dummy option m = 1 of a rank without samples)
            valid = ms <= np.maximum(bs, 1)
            t = np.where(valid, t, np.inf)
            memcap = (g.capacity - MEMORY_SLACK_BYTES - np.where(valid, mem, np.inf)) / (
                cm.bytes_per_fraction_at(allowed.pad)
            )
            host_b = np.broadcast_to(cm.host_bytes(bs, o, 0.0), t.shape).astype(np.float64)
            if allowed.host:
                # the offloaded boundaries must fit the rank's share of its host's memory
                t = np.where(host_b <= g.host_share, t, np.inf)
            blocks.append(
                (
                    t,
                    np.where(np.isfinite(t), memcap, -np.inf),
                    np.broadcast_to(ms, t.shape),
                    np.full(t.shape, o),
                    np.full(t.shape, ov),
                    host_b,
                )
            )
    # Pareto filter per row; with host state the offloaded options compete only among
    # themselves (they use host memory the others leave to the state)
    classes = [[b for b in blocks if b[3][0, 0] == o] for o in offs] if allowed.host else [blocks]
    kept = [_pareto([np.concatenate([b[i] for b in c], axis=1) for i in range(6)]) for c in classes]
    width = max(k[0].shape[1] for k in kept)
    g.time = np.concatenate([_pad(k[0], width, np.inf) for k in kept], axis=1)
    g.memcap = np.concatenate([_pad(k[1], width, -np.inf) for k in kept], axis=1)
    g.micro = np.concatenate([_pad(k[2], width, 1) for k in kept], axis=1)
    g.offload = np.concatenate([_pad(k[3], width, False) for k in kept], axis=1)
    g.overlap = np.concatenate([_pad(k[4], width, True) for k in kept], axis=1)
    g.host_boundary = np.concatenate([_pad(k[5], width, 0.0) for k in kept], axis=1)
    g.bmax = bmax


def _pad(a: np.ndarray, width: int, fill) -> np.ndarray:
    if a.shape[1] == width:
        return a
    return np.concatenate(
        [a, np.full((a.shape[0], width - a.shape[1]), fill, dtype=a.dtype)], axis=1
    )


def _pareto(cols: list[np.ndarray]) -> list[np.ndarray]:
    """The columns (time, memcap, then any payload) reduced per row to the Pareto-optimal
    options, in time order, packed to the left (invalid cells: time inf, memcap -inf)."""
    time_all, memcap_all = cols[0], cols[1]
    bmax = time_all.shape[0] - 1
    # sorted by time, an option survives only if it leaves more memory than every faster one;
    # memory for more than the whole state (memcap > 1) is worth no more than for all of it
    order = np.argsort(time_all, axis=1, kind="stable")
    t_sorted = np.take_along_axis(time_all, order, axis=1)
    c_sorted = np.take_along_axis(memcap_all, order, axis=1)
    useful = np.minimum(c_sorted, 1.0)
    best_before = np.maximum.accumulate(
        np.concatenate([np.full((bmax + 1, 1), -np.inf), useful[:, :-1]], axis=1), axis=1
    )
    keep = (useful > best_before) & np.isfinite(t_sorted) & (c_sorted >= 0)
    width = max(1, int(keep.sum(axis=1).max()))
    # pack the kept options to the left, in time order
    rank_in_row = np.cumsum(keep, axis=1) - 1
    rows, idx = np.nonzero(keep)
    dest = rank_in_row[rows, idx]
    src = order[rows, idx]
    out = [np.full((bmax + 1, width), np.inf), np.full((bmax + 1, width), -np.inf)]
    out[0][rows, dest] = t_sorted[rows, idx]
    out[1][rows, dest] = c_sorted[rows, idx]
    for payload in cols[2:]:
        fill = {np.dtype(bool): False, np.dtype(np.float64): 0.0}.get(payload.dtype, 1)
        a = np.full((bmax + 1, width), fill, dtype=payload.dtype)
        a[rows, dest] = payload[rows, src]
        out.append(a)
    return out


def _host_rates(g: _Group) -> tuple[float, float, float]:
    """(o, a1, a2) of `_host_cap` for a group: device optimizer seconds per parameter, and per
    host-held parameter the time that competes with the device optimizer (a1) and the time
    of the host part alone (a2). On a CPU everything adds up; on a GPU the device optimizer,
    the host AdamW and the uploads run at once, beside the gradient copies."""
    o = g.opt_s_per_fraction
    grad, up, opt = g.host_rates
    if not g.async_copies:
        return o, grad + opt + up, grad + opt + up
    return o, grad, grad + max(opt, up)


def _host_cap(
    cm: CostModel, rates, time_left, mem_left, host_left, pad: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """The largest state fraction x + y a rank can own (x on the host, y on the device) within
    `time_left` seconds for its optimizer phase and host copies, `mem_left` device bytes and
    `host_left` host bytes, and the x of that optimum; broadcasts, `rates` too ((o, a1, a2) as
    `_host_rates` gives them, o for the whole state: P x seconds per parameter).

    y(x) = min((time_left - x P a1) / (P o'), (mem_left - x Bd) / Bs) for x in [0, x_max], a
    concave objective x + y(x): its maximum is at 0, at x_max or where the two bounds cross."""
    P = cm.total_params
    o_all, a1, a2 = rates
    Bs, Bd = cm.bytes_per_fraction_at(pad), cm.host_part_bytes_per_fraction_at(pad)
    tl = np.asarray(time_left, dtype=np.float64)
    ml = np.asarray(mem_left, dtype=np.float64)
    hl = np.asarray(host_left, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        # y(x) = min(at - x bt, am - x bm): the time bound (at, bt) and the memory bound
        o = np.asarray(o_all, dtype=np.float64)
        timed = o > 0
        at = np.where(timed, tl / np.where(timed, o, 1.0), np.inf)
        bt = np.where(timed, P * np.asarray(a1) / np.where(timed, o, 1.0), 0.0)
        am, bm = ml / Bs, Bd / Bs
        # padded fp32: the host part's device copy lives in the padded send buffer (Bd 0)
        by_mem = ml / Bd if Bd > 0 else np.inf
        x_max = np.minimum(
            np.minimum(hl / (P * cm.host_bytes_per_param), by_mem), tl / (P * np.asarray(a2))
        )
        x_max = np.maximum(x_max, 0.0)
        cross = np.clip((at - am) / (bt - bm), 0.0, x_max)
        cross = np.where(np.isfinite(cross), cross, 0.0)
        f0 = np.minimum(at, am)
        f_max = x_max + np.maximum(np.minimum(at - x_max * bt, am - x_max * bm), 0.0)
        f_cross = cross + np.maximum(np.minimum(at - cross * bt, am - cross * bm), 0.0)
        best_f = np.maximum(np.maximum(f0, f_max), f_cross)
        best_x = np.where(best_f == f0, 0.0, np.where(best_f == f_cross, cross, x_max))
        ok = (tl >= 0) & (ml >= 0) & (hl >= 0)
    return np.where(ok, best_f, -np.inf), np.where(ok, best_x, 0.0)


def _capacity(
    g: _Group, T: float, cm: CostModel | None = None, allowed: _Allowed | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """cap(b; T) for b = 0..bmax (-inf where b cannot run within T), and the option achieving it."""
    allowed = allowed or _Allowed(offload=False)
    if allowed.host:
        assert cm is not None
        Bs = cm.bytes_per_fraction_at(allowed.pad)
        with np.errstate(invalid="ignore"):
            mem_left = np.where(np.isfinite(g.memcap), g.memcap * Bs, -1.0)
            time_left = np.where(np.isfinite(g.time), T - g.time, -1.0)
        cap, _ = _host_cap(
            cm, _host_rates(g), time_left, mem_left, g.host_share - g.host_boundary, allowed.pad
        )
        cap = np.where(np.isfinite(g.time) & np.isfinite(cap), cap, -np.inf)
        best = np.argmax(cap, axis=1)
        f = cap[np.arange(cap.shape[0]), best]
        f = np.where(f >= 0, np.minimum(f, allowed.clip), -np.inf)
        return _floored(np.minimum.accumulate(f), g.floor), best
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
    f = np.where(f >= 0, np.minimum(f, allowed.clip), -np.inf)
    # cap is non-increasing in b; enforce it so the feasible batches form a prefix 0..k
    f = np.minimum.accumulate(f)
    return _floored(f, g.floor), best


def _floored(f: np.ndarray, floor: float) -> np.ndarray:
    """cap(b) of a rank that must own at least `floor`: -inf where it cannot (still a prefix of
    finite batches, cap being non-increasing in b)."""
    return np.where(f >= floor, f, -np.inf) if floor > 0 else f


def _split_exact(fs: list[np.ndarray], B: int) -> tuple[float, list[int]] | None:
    """Max-plus DP over ranks: the split of B maximising the sum of capacities.

    Each rank's step is one vectorised max over a (batch, total) matrix, restricted to the
    totals from which B is still reachable (at most the finite batches of the ranks before,
    at least B less those of the ranks after); among equal sums the smallest batch of the rank
    wins (the first maximum), so the split is deterministic."""
    heads = []
    for f in fs:
        head = np.asarray(f[: min(len(f) - 1, B) + 1], dtype=np.float64)
        finite = np.isfinite(head)
        n_ok = int(np.argmin(finite)) if not finite.all() else head.size
        if n_ok == 0:
            return None
        heads.append(head[:n_ok])
    most = [h.size - 1 for h in heads]
    after = np.concatenate([np.cumsum(most[::-1])[::-1][1:], [0]])  # ranks after each
    best = np.full(B + 1, -np.inf)
    best[0] = 0.0
    args = []
    reach = 0
    for head, rest in zip(heads, after, strict=True):
        reach = min(B, reach + head.size - 1)
        cols = np.arange(max(0, B - int(rest)), reach + 1)
        n_ok = head.size
        bs = np.arange(n_ok)
        # cand[b, j] = best[j - b] + f[b] (j >= b), read from best padded with -inf in front
        padded = np.concatenate([np.full(n_ok, -np.inf), best])
        cand = padded[n_ok + cols[None, :] - bs[:, None]] + head[:, None]
        pick = np.argmax(cand, axis=0)
        best = np.full(B + 1, -np.inf)
        best[cols] = cand[pick, np.arange(cols.size)]
        arg = np.zeros(B + 1, dtype=np.int64)
        arg[cols] = pick
        args.append(arg)
    if not np.isfinite(best[B]):
        return None
    split, rest_b = [], B
    for arg in reversed(args):
        b = int(arg[rest_b])
        split.append(b)
        rest_b -= b
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


def _feasible(
    groups: list[_Group],
    T: float,
    B: int,
    exact: bool,
    cm: CostModel | None = None,
    allowed: _Allowed | None = None,
):
    """A split of B whose capacities sum to >= 1 at step time T, or None."""
    fs, bests = [], []
    for g in groups:
        f, best = _capacity(g, T, cm, allowed)
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
    """Per rank: batch, micro-batch, offload, state fraction (and host part, reduce overlap)."""

    batch: list[int]
    micro: list[int]
    offload: list[bool]
    fraction: list[float]
    host: list[float] | None = None
    """host_state_fraction per rank (None: all 0)."""
    overlap: list[bool] | None = None
    """overlap_reduce per rank (None: all True)."""
    lower: float = 0.0
    """A step time no plan of the search that made it reaches (its bisection's infeasible end)."""


def _fits_at_all(cm: CostModel, groups: list[_Group], B: int, allowed: _Allowed):
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
            _tabulate(cm, g, max(first, g.bmax), allowed)
    while True:
        found = _feasible(groups, math.inf, B, _exact(groups, B), cm, allowed)
        if found is not None:
            return found
        # memory alone rules it out at these batch ranges; larger ranges can only help by
        # giving the batch somewhere to go (cap is non-increasing in b)
        if all(g.bmax >= B for g in groups):
            return None
        for g in groups:
            _tabulate(cm, g, min(B, 2 * g.bmax), allowed)


def _exact(groups: list[_Group], B: int) -> bool:
    n = sum(g.size for g in groups)
    return n * (B + 1) * (max(g.bmax for g in groups) + 1) <= EXACT_DP_MAX_WORK


def _optimise(cm: CostModel, B: int, allowed: _Allowed, explain: bool = True) -> _Choice:
    """The optimum under `allowed` (its padding charge included), `lower` set to a step time at
    which no plan is feasible (a certified lower bound)."""
    groups = _groups(cm, allowed)
    found = _fits_at_all(cm, groups, B, allowed)
    if found is None:
        if not explain:
            raise PlanDoesNotFit(f"{cm.model.name} does not fit at global batch {B}")
        raise _does_not_fit(cm, B, allowed)
    while True:
        exact = _exact(groups, B)
        T_hi = _step_time_of(cm, groups, found, allowed)
        T_lo = 0.0
        while T_hi - T_lo > allowed.rel_tol * T_hi:
            mid = 0.5 * (T_lo + T_hi)
            f = _feasible(groups, mid, B, exact, cm, allowed)
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
            _tabulate(cm, g, min(B, 2 * g.bmax), allowed)
        found = _feasible(groups, T_hi, B, _exact(groups, B), cm, allowed) or _fits_at_all(
            cm, groups, B, allowed
        )
    choice = _water_fill(cm, groups, found, allowed)
    choice.lower = T_lo
    return choice


def _optimise_charged(cm: CostModel, B: int, allowed: _Allowed, explain: bool = True) -> _Choice:
    """`_optimise` where the backend pads near-even splits (`CostModel.padded_collectives`):
    the charge-free optimum, or a better plan that pays its padding (padded_search.py)."""
    relaxed = _optimise(cm, B, allowed, explain)
    if not cm.padded_collectives or len(cm.devices) < 2:
        return relaxed

    def step_s(c: _Choice, padded: bool = True) -> float:
        plan = _to_plan(cm, B, "cephalo", c, None, predict=False)
        ev = cm.evaluate(plan, charge_padding=padded)
        return ev.step_s if ev.fits else math.inf

    def search(**regime) -> Attempt[_Choice] | None:
        try:
            c = _optimise(cm, B, replace(allowed, rel_tol=PADDED_REL_TOL, **regime), False)
        except PlanDoesNotFit:
            return None
        return Attempt(c, c.lower, step_s(c), cm.split_padding(c.fraction))

    kinds = [g.ranks[0] for g in _groups(cm)]
    return best_with_padding(
        len(cm.devices),
        Attempt(relaxed, relaxed.lower, step_s(relaxed), cm.split_padding(relaxed.fraction)),
        cm.split_padding(relaxed.fraction),
        step_s(relaxed, padded=False),
        kinds,
        search,
    )


def _unless_marginal(
    cm: CostModel, B: int, allowed: _Allowed, choice: _Choice, option: str, min_gain: float
) -> tuple[_Choice, _Allowed]:
    """`choice`, or the best plan without `option` (`host`: host state; `serial`: ranks
    waiting for each reduce-scatter) where that is (almost) as fast; with what the kept plan
    allows. Both options trade time for memory, and a gain below `min_gain` is within the
    cost model's error (measured on the emulated clusters: a plan waiting on its reduce-scatters
    for a 0.03 % predicted gain ran 10 % slower, bench/results/hetero_throughput.md B)."""
    narrower = replace(allowed, **{option: False})
    try:
        without = _optimise_charged(cm, B, narrower, explain=False)  # the reason is not shown
    except PlanDoesNotFit:
        return choice, allowed
    steps = [cm.evaluate(_to_plan(cm, B, "cephalo", c, None)).step_s for c in (choice, without)]
    if steps[0] < (1.0 - min_gain) * steps[1]:
        return choice, allowed
    return without, narrower


@dataclass
class _RankOption:
    """The option a rank ended up with."""

    batch: int = 0
    micro: int = 1
    offload: bool = False
    overlap: bool = True
    time: float = 0.0
    """Step time without the optimizer (and without host state)."""
    memcap: float = 0.0
    """State fraction the device memory holds at 16 bytes per parameter."""
    host_boundary: float = 0.0


def _rank_options(cm: CostModel, groups: list[_Group], found) -> list[_RankOption]:
    """Per rank: the chosen batch and option."""
    splits, bests = found
    out = [_RankOption() for _ in cm.devices]
    for g, split, best in zip(groups, splits, bests, strict=True):
        for r, b in zip(g.ranks, split, strict=True):
            j = int(best[b])
            out[r] = _RankOption(
                batch=b,
                micro=int(g.micro[b, j]),
                offload=bool(g.offload[b, j]),
                overlap=bool(g.overlap[b, j]) if g.overlap is not None else True,
                time=float(g.time[b, j]),
                memcap=float(g.memcap[b, j]),
                host_boundary=float(g.host_boundary[b, j]) if g.host_boundary is not None else 0.0,
            )
    return out


def _group_of(groups: list[_Group]) -> dict[int, _Group]:
    return {r: g for g in groups for r in g.ranks}


def _rank_time(cm: CostModel, g: _Group, opt: _RankOption, s: float, x: float) -> float:
    """The planner's time of a rank owning s, x of it on the host (the gradient copies to the
    host counted in full: on a GPU the cost model hides them under the backward)."""
    if cm.host is None:
        return opt.time + s * g.opt_s_per_fraction
    phase, _ = cm.optimizer_phase_s(g.ranks[0], s, x)
    grad = g.host_rates[0] * cm.total_params * x if x > 0 else 0.0
    return opt.time + float(phase) + grad


def _step_time_of(cm: CostModel, groups: list[_Group], found, allowed: _Allowed) -> float:
    """Step time of a split once its fractions are water-filled (the same terms as `rank_cost`)."""
    choice = _water_fill(cm, groups, found, allowed)
    opts = _rank_options(cm, groups, found)
    by_rank = _group_of(groups)
    host = choice.host or [0.0] * len(opts)
    return max(
        _rank_time(cm, by_rank[i], o, choice.fraction[i], choice.fraction[i] * host[i])
        for i, o in enumerate(opts)
    )


def _water_fill(cm: CostModel, groups: list[_Group], found, allowed: _Allowed) -> _Choice:
    """Fractions that minimise the slowest rank's time under every rank's memory cap."""
    opts = _rank_options(cm, groups, found)
    if allowed.host:
        return _water_fill_host(cm, groups, opts, allowed)
    batch = [o.batch for o in opts]
    micro = [o.micro for o in opts]
    off = [o.offload for o in opts]
    t = [o.time for o in opts]
    mc = [o.memcap for o in opts]
    opt = [cm.optimizer_params * cm.optimizer_s_per_param(d.type_key) for d in cm.devices]
    mc_arr = np.clip(np.array(mc), 0.0, allowed.clip)
    t_arr, opt_arr = np.array(t), np.array(opt)
    j, floor = allowed.floor_rank, allowed.floor

    def enough(c: np.ndarray) -> bool:
        return c.sum() >= 1.0 and (j < 0 or c[j] >= floor)

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
            if enough(caps(mid)):
                hi = mid
            else:
                lo = mid
        c = caps(hi)
        if not enough(c):
            # the optimizer is so cheap that T' is lost in float resolution: time does not
            # limit anyone, memory does
            c = mc_arr
    total = float(c.sum())
    if total <= 0:
        raise CephaloError("internal: no rank can hold any state after planning")
    fractions = _fractions(c, j, floor)
    # The bisection leaves the bottleneck ranks a residue (~1e-11) of state; an exact 0 reads
    # better and gives them an empty shard. Keep the residue if dropping it would push another
    # rank past its memory.
    snapped = np.where(fractions < FRACTION_SNAP, 0.0, fractions)
    if snapped.sum() > 0:
        snapped = snapped / snapped.sum()
        if np.all(snapped <= np.maximum(mc_arr, fractions)) and (j < 0 or snapped[j] >= floor):
            fractions = snapped
    return _Choice(
        batch=batch,
        micro=micro,
        offload=off,
        fraction=fractions.tolist(),
        overlap=[o.overlap for o in opts],
    )


def _fractions(c: np.ndarray, j: int = -1, floor: float = 0.0) -> np.ndarray:
    """State fractions summing to 1 from caps `c` (sum >= 1), each at most its cap: in
    proportion to the caps, except that rank `j` (>= 0) keeps at least `floor` (c[j] >= floor):
    it takes max(floor, its proportional share) and the others share the rest in proportion,
    which their caps hold (c[j] + the others' >= 1)."""
    total = float(c.sum())
    if j < 0:
        return c / total
    rest = total - float(c[j])
    s_j = max(floor, float(c[j]) / total)
    out = c * ((1.0 - s_j) / rest) if rest > 0 else np.zeros_like(c)
    out[j] = s_j
    return out


def _water_fill_host(
    cm: CostModel, groups: list[_Group], opts: list[_RankOption], allowed: _Allowed
) -> _Choice:
    """The water-filling with host state: the smallest T' at which the ranks' largest state
    fractions (`_host_cap`) sum to 1; then each rank's fraction at its cap (normalised) and the
    host part that makes it fastest within its memory (the least its memory needs where the
    host is the slower optimizer)."""
    by_rank = _group_of(groups)
    n = len(opts)
    P = cm.total_params
    Bs, Bd = cm.bytes_per_fraction_at(allowed.pad), cm.host_part_bytes_per_fraction_at(allowed.pad)
    mem_left = np.array([max(o.memcap, 0.0) * Bs for o in opts])
    host_left = np.array([by_rank[i].host_share - opts[i].host_boundary for i in range(n)])
    t = np.array([o.time for o in opts])

    rates = tuple(
        np.array(r) for r in zip(*(_host_rates(by_rank[i]) for i in range(n)), strict=True)
    )

    def caps(T: float) -> tuple[np.ndarray, np.ndarray]:
        cs, xs = _host_cap(cm, rates, T - t, mem_left, host_left, allowed.pad)
        return np.minimum(np.maximum(cs, 0.0), allowed.clip), xs

    j, floor = allowed.floor_rank, allowed.floor

    def enough(c: np.ndarray) -> bool:
        return c.sum() >= 1.0 and (j < 0 or c[j] >= floor)

    lo = float(t.max())
    hi = lo + max(g.opt_s_per_fraction for g in groups) + 1e-12
    while not enough(caps(hi)[0]):  # the host-state work may exceed the device optimizer's
        hi = lo + 2 * (hi - lo)
        if hi - lo > 1e12:
            raise CephaloError(
                "internal: the water-filling found no step time that holds the state"
            )
    while hi - lo > 1e-12 * max(hi, 1e-30) and hi - lo > 1e-15:
        mid = 0.5 * (lo + hi)
        if enough(caps(mid)[0]):
            hi = mid
        else:
            lo = mid
    c, _ = caps(hi)
    fractions = _fractions(c, j, floor)
    snapped = np.where(fractions < FRACTION_SNAP, 0.0, fractions)
    if snapped.sum() > 0 and np.all(snapped <= np.maximum(c, fractions)):
        snapped = snapped / snapped.sum()
        if j < 0 or snapped[j] >= floor:
            fractions = snapped
    host = []
    for i in range(n):
        s_i = float(fractions[i])
        g = by_rank[i]
        if s_i <= 0:
            host.append(0.0)
            continue
        # device memory: (s - x) Bs + x Bd <= mem_left; host memory: x P hb <= host_left
        need = max(0.0, (s_i * Bs - mem_left[i]) / (Bs - Bd))
        most = min(s_i, max(0.0, host_left[i]) / (P * cm.host_bytes_per_param))
        need = min(need, most)
        grad, up, opt = g.host_rates
        o = g.opt_s_per_fraction / P
        if not g.async_copies:
            best = most if grad + up + opt < o else need
        else:
            # device and host optimizers run at once: balance them where the copies cost less
            # than the device's own step
            best = s_i * o / (o + max(opt, up)) if grad < o else 0.0
            best = min(max(best, need), most)
        best = min(max(best, need), most)
        host.append(min(1.0, best / s_i) if best > 0 else 0.0)
    return _Choice(
        batch=[o.batch for o in opts],
        micro=[o.micro for o in opts],
        offload=[o.offload for o in opts],
        fraction=fractions.tolist(),
        host=host,
        overlap=[o.overlap for o in opts],
    )


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
def _to_plan(
    cm: CostModel,
    B: int,
    strategy: str,
    c: _Choice,
    model_name: str | None,
    predict: bool = True,
) -> Plan:
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
                host_state_fraction=(
                    round(c.host[i], 12) if c.host is not None and c.fraction[i] > 0 else 0.0
                ),
                overlap_reduce=True if c.overlap is None else bool(c.overlap[i]),
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
    if predict:
        fill_predictions(cm, plan)
    return plan


def fill_predictions(cm: CostModel, plan: Plan) -> None:
    """Write the cost model's per-rank and whole-step predictions into the plan."""
    ev = cm.evaluate(plan)
    for r, cost in zip(plan.ranks, ev.ranks, strict=True):
        r.predicted_step_s = cost.step_s
        r.predicted_peak_memory_bytes = cost.peak_bytes
        r.predicted_host_bytes = cost.host_bytes if cm.host is not None else None
    plan.predicted = Predicted(
        step_s=ev.step_s, samples_per_s=ev.samples_per_s, tokens_per_s=ev.tokens_per_s
    )


# ====================================================================== does not fit
def _memory_only_fits(cm: CostModel, B: int, allowed: _Allowed) -> bool:
    return _fits_at_all(cm, _groups(cm, allowed), B, allowed) is not None


def _does_not_fit(cm: CostModel, B: int, allowed: _Allowed) -> PlanDoesNotFit:
    allow_offload = allowed.offload
    n = len(cm.devices)
    P = cm.total_params
    state_total = cm.layout.state_bytes
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
        + (
            f"{_gib(state_total)} (16 bytes x {P:,} parameters)"
            if not cm.adapter.frozen_base
            else f"{_gib(state_total)} ({cm.adapter.describe()}: the {P:,}-parameter base "
            f"{_gib(cm.layout.frozen_bytes)}, 16 bytes x {cm.optimizer_params:,} adapter parameters)"
        )
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
    if not allow_offload and _memory_only_fits(cm, B, replace(allowed, offload=True)):
        msg.append("offloading activations to the host would fit (allow offload)")
    if cm.host is not None:
        if allowed.host:
            hosts = ", ".join(
                f"node {n}: {_gib(m)}" for n, m in sorted(cm.host.memory_bytes.items())
            )
            msg.append(
                f"even with training state in host memory ({hosts}, shared by each node's ranks; "
                f"{cm.host_bytes_per_param} bytes per host-held parameter)"
            )
        elif _memory_only_fits(cm, B, replace(allowed, host=True)):
            msg.append("keeping part of the training state in host memory would fit")
    # the largest global batch that fits (memory only)
    lo, hi = 0, B - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _memory_only_fits(cm, mid, allowed):
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
