"""cap(b; T): the largest state fraction a rank of a group can own at batch b within step time T.

From the group's tables (rank_tables.py): the memory left after its activations and the time
left for its optimizer both bound its fraction; with host state a small linear programme per
(b, option) whose optimum stays closed form (`host_cap`). cap is non-increasing in b and
non-decreasing in T, which the split of the batch (batch_split.py) relies on.
"""

from __future__ import annotations

import math

import numpy as np

from cephalo.planning.costmodel import CostModel
from cephalo.planning.rank_tables import RankGroup, SearchRegime


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


def host_cap(
    cm: CostModel, rates, time_left, mem_left, host_left, pad: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """The largest state fraction x + y a rank can own (x on the host, y on the device) within
    `time_left` seconds for its optimizer phase and host copies, `mem_left` device bytes and
    `host_left` host bytes, and the x of that optimum; broadcasts, `rates` too ((o, a1, a2) as
    `host_cap_rates` gives them, o for the whole state: P x seconds per parameter).

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


def capacity(
    g: RankGroup, T: float, cm: CostModel | None = None, allowed: SearchRegime | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """cap(b; T) for b = 0..bmax (-inf where b cannot run within T), and the option achieving it."""
    allowed = allowed or SearchRegime(offload=False)
    if allowed.host:
        assert cm is not None
        Bs = cm.bytes_per_fraction_at(allowed.pad)
        with np.errstate(invalid="ignore"):
            mem_left = np.where(np.isfinite(g.memcap), g.memcap * Bs, -1.0)
            time_left = np.where(np.isfinite(g.time), T - g.time, -1.0)
        cap, _ = host_cap(
            cm, host_cap_rates(g), time_left, mem_left, g.host_share - g.host_boundary, allowed.pad
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
