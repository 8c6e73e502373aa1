"""State fractions for a fixed split: water-filling to the smallest step time that holds the state.

With each rank's batch and option fixed (batch_split.py), the fractions are water-filled: the
smallest T' with sum_i min(memory cap_i, (T' - C_i) / (P * opt_i)) >= 1, then s_i at those
caps; with host state each rank's programme of `rank_capacity.host_cap`, and the host part that
makes it fastest within its memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cephalo.costmodel.model import CostModel
from cephalo.errors import CephaloError
from cephalo.planner.choice import Choice
from cephalo.planner.search.capacity import host_cap, host_cap_rates, host_cap_terms
from cephalo.planner.search.rank_tables import RankGroup, SearchRegime

FRACTION_SNAP = 1e-9
"""State fractions below this are rounded to 0 (bisection residue)."""


@dataclass
class _RankOption:
    """The option a rank ended up with."""

    batch: int = 0
    micro: int = 1
    offload: bool = False
    overlap: bool = True
    fuse: bool = True
    time: float = 0.0
    """Step time without the optimizer (and without host state)."""
    memcap: float = 0.0
    """State fraction the device memory holds at 16 bytes per parameter."""
    host_boundary: float = 0.0


def _rank_options(cm: CostModel, groups: list[RankGroup], found) -> list[_RankOption]:
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
                fuse=bool(g.fuse[b, j]) if g.fuse is not None else True,
                time=float(g.time[b, j]),
                memcap=float(g.memcap[b, j]),
                host_boundary=float(g.host_boundary[b, j]) if g.host_boundary is not None else 0.0,
            )
    return out


def _group_of(groups: list[RankGroup]) -> dict[int, RankGroup]:
    return {r: g for g in groups for r in g.ranks}


def _rank_time(cm: CostModel, g: RankGroup, opt: _RankOption, s: float, x: float) -> float:
    """The planner's time of a rank owning s, x of it on the host (the gradient copies to the
    host counted in full: on a GPU the cost model hides them under the backward)."""
    if cm.host is None:
        return opt.time + s * g.opt_s_per_fraction
    phase, _ = cm.optimizer_phase_s(g.ranks[0], s, x)
    grad = g.host_rates[0] * cm.total_params * x if x > 0 else 0.0
    return opt.time + float(phase) + grad


def step_time_of(cm: CostModel, groups: list[RankGroup], found, allowed: SearchRegime) -> float:
    """Step time of a split once its fractions are water-filled (the same terms as `rank_cost`)."""
    choice = water_fill(cm, groups, found, allowed)
    opts = _rank_options(cm, groups, found)
    by_rank = _group_of(groups)
    host = choice.host or [0.0] * len(opts)
    return max(
        _rank_time(cm, by_rank[i], o, choice.fraction[i], choice.fraction[i] * host[i])
        for i, o in enumerate(opts)
    )


def _holds_state(allowed: SearchRegime) -> Callable[[np.ndarray], bool]:
    """Whether per-rank state caps hold the whole state (and the floored rank its floor)."""
    j, floor = allowed.floor_rank, allowed.floor

    def enough(c: np.ndarray) -> bool:
        return c.sum() >= 1.0 and (j < 0 or c[j] >= floor)

    return enough


def _least_holding(
    caps: Callable[[float], np.ndarray],
    enough: Callable[[np.ndarray], bool],
    lo: float,
    hi: float,
) -> float:
    """Bisection on the step time: the least T in (lo, hi] (to 1e-12 relative) whose caps hold
    the state, given that hi's do and lo's do not."""
    while hi - lo > 1e-12 * max(hi, 1e-30) and hi - lo > 1e-15:
        mid = 0.5 * (lo + hi)
        if enough(caps(mid)):
            hi = mid
        else:
            lo = mid
    return hi


def water_fill(cm: CostModel, groups: list[RankGroup], found, allowed: SearchRegime) -> Choice:
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
    enough = _holds_state(allowed)

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
        c = caps(_least_holding(caps, enough, lo, hi))
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
    return Choice(
        batch=batch,
        micro=micro,
        offload=off,
        fraction=fractions.tolist(),
        overlap=[o.overlap for o in opts],
        fuse=[o.fuse for o in opts],
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
    cm: CostModel, groups: list[RankGroup], opts: list[_RankOption], allowed: SearchRegime
) -> Choice:
    """The water-filling with host state: the smallest T' at which the ranks' largest state
    fractions (`host_cap`) sum to 1; then each rank's fraction at its cap (normalised) and the
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
        np.array(r) for r in zip(*(host_cap_rates(by_rank[i]) for i in range(n)), strict=True)
    )

    # what the caps need beside T, once for the ~40 steps of the bisection below
    terms = host_cap_terms(cm, rates, mem_left, host_left, allowed.pad)

    def caps(T: float) -> np.ndarray:
        return np.minimum(np.maximum(host_cap(terms, T - t), 0.0), allowed.clip)

    j, floor = allowed.floor_rank, allowed.floor
    enough = _holds_state(allowed)

    lo = float(t.max())
    hi = lo + max(g.opt_s_per_fraction for g in groups) + 1e-12
    while not enough(caps(hi)):  # the host-state work may exceed the device optimizer's
        hi = lo + 2 * (hi - lo)
        if hi - lo > 1e12:
            raise CephaloError(
                "internal: the water-filling found no step time that holds the state"
            )
    c = caps(_least_holding(caps, enough, lo, hi))
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
    return Choice(
        batch=[o.batch for o in opts],
        micro=[o.micro for o in opts],
        offload=[o.offload for o in opts],
        fraction=fractions.tolist(),
        host=host,
        overlap=[o.overlap for o in opts],
        fuse=[o.fuse for o in opts],
    )
