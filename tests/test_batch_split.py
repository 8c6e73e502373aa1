"""The exact split of the batch (batch_split._split_exact) against the plain max-plus DP it
replaced (a gather through an index matrix): the same sums and the same split, bit for bit,
ties included (the smallest batch of each rank wins)."""

import numpy as np
import pytest

from cephalo.planner.search.batch_split import _split_exact


def _reference(fs: list[np.ndarray], B: int) -> tuple[float, list[int]] | None:
    """The DP as first written: cand[b, j] = best[j - b] + f[b], gathered per rank."""
    heads = []
    for f in fs:
        head = np.asarray(f[: min(len(f) - 1, B) + 1], dtype=np.float64)
        finite = np.isfinite(head)
        n_ok = int(np.argmin(finite)) if not finite.all() else head.size
        if n_ok == 0:
            return None
        heads.append(head[:n_ok])
    most = [h.size - 1 for h in heads]
    after = np.concatenate([np.cumsum(most[::-1])[::-1][1:], [0]])
    best = np.full(B + 1, -np.inf)
    best[0] = 0.0
    args, reach = [], 0
    for head, rest in zip(heads, after, strict=True):
        reach = min(B, reach + head.size - 1)
        cols = np.arange(max(0, B - int(rest)), reach + 1)
        n_ok = head.size
        padded = np.concatenate([np.full(n_ok, -np.inf), best])
        cand = padded[n_ok + cols[None, :] - np.arange(n_ok)[:, None]] + head[:, None]
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
        split.append(int(arg[rest_b]))
        rest_b -= split[-1]
    return float(best[B]), split[::-1]


@pytest.mark.parametrize("seed", range(4))
def test_split_equals_the_plain_dp(seed):
    rng = np.random.default_rng(seed)
    solved = 0
    for _ in range(1500):
        ranks, B = int(rng.integers(1, 7)), int(rng.integers(0, 40))
        kinds = []
        for _ in range(int(rng.integers(1, ranks + 1))):
            n = int(rng.integers(1, 30))
            if rng.random() < 0.5:
                f = rng.integers(-3, 5, n).astype(float) / 4  # many ties
            else:
                f = np.sort(rng.random(n))[::-1] * rng.random()
            f[int(rng.integers(0, n + 1)) :] = -np.inf
            if rng.random() < 0.1:
                f[0] = -np.inf  # a rank that cannot run at all
            # capacities are non-increasing in b; the DP must not rely on it
            kinds.append(np.minimum.accumulate(f) if rng.random() < 0.7 else f)
        # ranks of one kind pass the same array, as the groups' ranks do
        fs = [kinds[int(rng.integers(len(kinds)))] for _ in range(ranks)]
        got, want = _split_exact(fs, B), _reference(fs, B)
        assert got == want
        solved += want is not None
    assert solved > 300
