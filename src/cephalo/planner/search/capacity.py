"""cap(b; T): the largest state fraction a rank of a group can own at batch b within step time T.

From the group's tables (rank_tables.py): the memory left after its activations and the time
left for its optimizer both bound its fraction; with host state a small linear programme per
(b, option) whose optimum stays closed form (`host_cap`), its terms that do not depend on T
made once per tables (`HostCapTerms`). cap is non-increasing in b and non-decreasing in T,
which the split of the batch (batch_split.py) relies on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from cephalo.costmodel.model import CostModel
from cephalo.planner.search.rank_tables import RankGroup, SearchRegime


def host_cap_rates(g: RankGroup) -> tuple[float, float, float]:
    """(o, a1, a2) of `host_cap` for a group: device optimizer seconds per parameter, and per
    host-held parameter the time that competes with the device optimizer (a1) and the time
    of the host part alone (a2). On a CPU everything adds up; on a GPU the device optimizer,
    the host AdamW and the uploads run at once, beside the gradient copies."""
    o = g.opt_s_per_fraction
    grad, up, opt = g.host_rates
    if not g.async_copies:
        return o, grad + opt + up, grad + opt + up
    return o, grad, grad + max(opt, up)


@dataclass(frozen=True)
class HostCapTerms:
    """The terms of `host_cap` that do not depend on the time left, for one set of memory and
    host bounds: the bisections over T (the search's, some 20 steps on the same tables, and the
    water-filling's, some 40 on the same split) evaluate `host_cap` on the same bounds again
    and again, and these terms were about a third of each evaluation. Each is computed by the
    same operations in the same order as when `host_cap` made them itself: the caps are
    bit-identical."""

    timed: np.ndarray
    """o > 0: the device optimizer takes time."""
    o_div: np.ndarray
    """o where timed, else 1 (the divisor of the time bound)."""
    bt: np.ndarray
    """The time bound's slope in x."""
    am: np.ndarray
    """The memory bound at x = 0 (mem_left / Bs)."""
    bm: float
    """The memory bound's slope in x (Bd / Bs)."""
    x_room: np.ndarray
    """The largest x the host memory and the device memory hold."""
    p_a2: np.ndarray
    """P x a2: seconds of the host part alone per unit of x."""
    room_ok: np.ndarray
    """mem_left >= 0 and host_left >= 0."""
    time_ok: np.ndarray | None = None
    """Where the group's tables have a finite time (`capacity`'s valid options; None in
    `host_cap`)."""


def host_cap_terms(cm: CostModel, rates, mem_left, host_left, pad: float = 0.0) -> HostCapTerms:
    """`host_cap`'s terms without the time left (see `HostCapTerms`)."""
    P = cm.total_params
    o_all, a1, a2 = rates
    Bs, Bd = cm.bytes_per_fraction_at(pad), cm.host_part_bytes_per_fraction_at(pad)
    ml = np.asarray(mem_left, dtype=np.float64)
    hl = np.asarray(host_left, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        # y(x) = min(at - x bt, am - x bm): the time bound (at, bt) and the memory bound
        o = np.asarray(o_all, dtype=np.float64)
        timed = o > 0
        o_div = np.where(timed, o, 1.0)
        bt = np.where(timed, P * np.asarray(a1) / o_div, 0.0)
        am, bm = ml / Bs, Bd / Bs
        # padded fp32: the host part's device copy lives in the padded send buffer (Bd 0)
        by_mem = ml / Bd if Bd > 0 else np.inf
        x_room = np.minimum(hl / (P * cm.host_bytes_per_param), by_mem)
        p_a2 = P * np.asarray(a2)
    return HostCapTerms(timed, o_div, bt, am, bm, x_room, p_a2, (ml >= 0) & (hl >= 0))


def host_cap(terms: HostCapTerms, time_left) -> np.ndarray:
    """The largest state fraction x + y a rank can own (x on the host, y on the device) within
    `time_left` seconds for its optimizer phase and host copies and the device and host bytes
    of `terms` (`host_cap_terms`); -inf where any of them is negative; broadcasts.

    y(x) = min((time_left - x P a1) / (P o'), (mem_left - x Bd) / Bs) for x in [0, x_max], a
    concave objective x + y(x): its maximum is at 0, at x_max or where the two bounds cross."""
    tl = np.asarray(time_left, dtype=np.float64)
    timed, bt, am, bm = terms.timed, terms.bt, terms.am, terms.bm
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        at = np.where(timed, tl / terms.o_div, np.inf)
        x_max = np.minimum(terms.x_room, tl / terms.p_a2)
        x_max = np.maximum(x_max, 0.0)
        cross = np.clip((at - am) / (bt - bm), 0.0, x_max)
        cross = np.where(np.isfinite(cross), cross, 0.0)
        f0 = np.minimum(at, am)
        f_max = x_max + np.maximum(np.minimum(at - x_max * bt, am - x_max * bm), 0.0)
        f_cross = cross + np.maximum(np.minimum(at - cross * bt, am - cross * bm), 0.0)
        best_f = np.maximum(np.maximum(f0, f_max), f_cross)
    ok = (tl >= 0) & terms.room_ok
    return np.where(ok, best_f, -np.inf)


def _group_host_terms(cm: CostModel, g: RankGroup, pad: float) -> HostCapTerms:
    """The group's `HostCapTerms` for its current tables, made once per tables and charge."""
    made = g.host_cap_terms
    if made is not None and made[0] == pad:
        return made[1]
    Bs = cm.bytes_per_fraction_at(pad)
    with np.errstate(invalid="ignore"):
        mem_left = np.where(np.isfinite(g.memcap), g.memcap * Bs, -1.0)
    terms = host_cap_terms(cm, host_cap_rates(g), mem_left, g.host_share - g.host_boundary, pad)
    terms = replace(terms, time_ok=np.isfinite(g.time))
    g.host_cap_terms = (pad, terms)
    return terms


def capacity(
    g: RankGroup, T: float, cm: CostModel | None = None, allowed: SearchRegime | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """cap(b; T) for b = 0..bmax (-inf where b cannot run within T), and the option achieving it."""
    allowed = allowed or SearchRegime(offload=False)
    if allowed.host:
        assert cm is not None
        terms = _group_host_terms(cm, g, allowed.pad)
        time_ok = terms.time_ok
        with np.errstate(invalid="ignore"):
            time_left = np.where(time_ok, T - g.time, -1.0)
        cap = host_cap(terms, time_left)
        cap = np.where(time_ok & np.isfinite(cap), cap, -np.inf)
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
