"""Whether a step time T is feasible: a split of the global batch whose capacities sum to 1.

Given each group's cap(b; T) (rank_capacity.py), the split of B over ranks maximising the sum
of capacities: exactly by a max-plus dynamic program over ranks on small instances
(`_split_exact`), by a greedy over each group's upper concave hull on large ones
(`_split_hull`, the Lagrangian relaxation). `fits_at_all` finds a split that fits memory when
time is no object, growing the groups' tables until one does or none can.
"""

from __future__ import annotations

import math

import numpy as np

from cephalo.costmodel.model import CostModel
from cephalo.planner.search.capacity import capacity
from cephalo.planner.search.rank_tables import (
    MAX_BATCH_PER_RANK,
    RankGroup,
    SearchRegime,
    TableCache,
    solo_speed,
    tabulate,
)

EXACT_DP_MAX_WORK = 400_000
"""Use the exact dynamic program while ranks x (B + 1) x (max batch + 1) stays below this."""


def _split_exact(fs: list[np.ndarray], B: int) -> tuple[float, list[int]] | None:
    """Max-plus DP over ranks: the split of B maximising the sum of capacities.

    Each rank's step is one vectorised max over a (total, batch) matrix, restricted to the
    totals from which B is still reachable (at most the finite batches of the ranks before,
    at least B less those of the ranks after); among equal sums the smallest batch of the rank
    wins (the first maximum), so the split is deterministic.

    The matrix is a strided view of the previous step's best sums (cand[j, b] = best[j - b] +
    f[b]), not gathered through an index matrix: the bisection runs this some 20 times per
    search, and the gather was half of each step. Ranks of a group pass the same array, whose
    finite head is found once."""
    heads_of: dict[int, np.ndarray] = {}
    heads = []
    for f in fs:
        head = heads_of.get(id(f))
        if head is None:
            head = np.asarray(f[: min(len(f) - 1, B) + 1], dtype=np.float64)
            finite = np.isfinite(head)
            n_ok = int(np.argmin(finite)) if not finite.all() else head.size
            if n_ok == 0:
                return None
            head = heads_of[id(f)] = head[:n_ok]
        heads.append(head)
    most = [h.size - 1 for h in heads]
    after = np.concatenate([np.cumsum(most[::-1])[::-1][1:], [0]])  # ranks after each
    # best[x] lives at buf[w + x]: w cells of -inf before it stand for x < 0, w after it keep
    # every window of width w inside the buffer; two buffers, read one, write the other
    w = max(h.size for h in heads)
    bufs = [np.full(2 * w + B + 1, -np.inf) for _ in range(2)]
    windows = [np.lib.stride_tricks.sliding_window_view(b, w) for b in bufs]
    bufs[0][w] = 0.0
    cur = 0
    args = []
    reach = 0
    for head, rest in zip(heads, after, strict=True):
        n_ok = head.size
        reach = min(B, reach + n_ok - 1)
        lo = max(0, B - int(rest))
        # row j - lo, column b: best[j - b] for the totals j = lo..reach (the window starting
        # at best[j - n_ok + 1], reversed)
        start = w + lo - n_ok + 1
        cand = windows[cur][start : start + reach - lo + 1, :n_ok][:, ::-1] + head
        pick = np.argmax(cand, axis=1)
        nxt = bufs[1 - cur]
        nxt[w : w + B + 1] = -np.inf
        nxt[w + lo : w + reach + 1] = cand.max(axis=1)
        cur = 1 - cur
        args.append((lo, pick))
    best_B = bufs[cur][w + B]
    if not np.isfinite(best_B):
        return None
    # walking back from B every total is finite, so within its rank's lo..reach
    split, rest_b = [], B
    for lo, pick in reversed(args):
        b = int(pick[rest_b - lo])
        split.append(b)
        rest_b -= b
    return float(best_B), split[::-1]


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
    groups: list[RankGroup], fs: list[np.ndarray], B: int
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


def use_exact_split(groups: list[RankGroup], B: int) -> bool:
    n = sum(g.size for g in groups)
    return n * (B + 1) * (max(g.bmax for g in groups) + 1) <= EXACT_DP_MAX_WORK


def feasible_split(
    groups: list[RankGroup],
    T: float,
    B: int,
    exact: bool,
    cm: CostModel | None = None,
    allowed: SearchRegime | None = None,
):
    """A split of B whose capacities sum to >= 1 at step time T, or None."""
    fs, bests = [], []
    for g in groups:
        f, best = capacity(g, T, cm, allowed)
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


def fits_at_all(
    cm: CostModel,
    groups: list[RankGroup],
    B: int,
    allowed: SearchRegime,
    cache: TableCache | None = None,
):
    """A split that fits memory when time is no object (tabulating larger batches as needed,
    from `cache` where made before), or None."""
    # First batch range per group: 1.3 x its share by solo speed (plus a margin); the
    # callers grow it whenever the optimum might lie beyond.
    speed = {
        g.type_key: solo_speed(cm, g.type_key, max(1, round(B / len(cm.devices)))) for g in groups
    }
    total_speed = sum(speed[g.type_key] * g.size for g in groups)
    for g in groups:
        share = B * speed[g.type_key] / total_speed
        first = min(B, MAX_BATCH_PER_RANK, max(16, math.ceil(1.3 * share) + 8))
        # never shrink tables the optimiser already grew: it calls this again after growing
        # them, and shrinking them back made it grow and shrink them for ever
        if first > g.bmax or g.time is None:
            tabulate(cm, g, max(first, g.bmax), allowed, cache)
    while True:
        found = feasible_split(groups, math.inf, B, use_exact_split(groups, B), cm, allowed)
        if found is not None:
            return found
        # memory alone rules it out at these batch ranges; larger ranges can only help by
        # giving the batch somewhere to go (cap is non-increasing in b)
        if all(g.bmax >= B for g in groups):
            return None
        for g in groups:
            tabulate(cm, g, min(B, 2 * g.bmax), allowed, cache)
