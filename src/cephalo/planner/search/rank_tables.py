"""The planner's per-group tables: ranks grouped by device, and per group its options' time and memory.

Ranks with the same device type, memory, host share and host rates are one `RankGroup`: they
share every table. `tabulate` fills a group's [batch b, option] tables (option: micro-batch m,
offload, reduce overlap): the rank's step time without the optimizer C(b, m, o) and the state
fraction its memory holds after everything else, keeping per b only the Pareto-optimal options
(faster or leaner than every other). `SearchRegime` says what the search may choose and under
which padding charge; the tables depend on it (planner.py has the whole search).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from cephalo.costmodel.model import CostModel
from cephalo.errors import CephaloError

MAX_MICRO_BATCH = 512
"""Largest micro-batch the planner considers (beyond it GPUs gain nothing per sample)."""
MAX_BATCH_PER_RANK = 16384
"""Largest batch one rank may take (the tables grow with it; 16k samples per step per GPU is far beyond use)."""
EXACT_MICRO_BATCH = 64
"""Micro-batches up to this size are all considered; larger ones on a geometric grid."""
MICRO_BATCH_GRID = 1.05
BISECT_REL_TOL = 1e-5
"""Relative precision of the step-time bisection: the plan's step time is within this of
the optimum (tests/test_planner.py holds it to that against an exhaustive search)."""
MEMORY_SLACK_BYTES = 1
"""Kept free so that rounding the state fraction's bytes up never tips a rank over its capacity."""


@dataclass
class RankGroup:
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
    fuse: np.ndarray | None = None
    """[b, option] the option's `fuse_tail` (costmodel/rules.py)."""
    host_boundary: np.ndarray | None = None
    """[b, option] host bytes of the option's offloaded boundaries."""
    host_share: float = math.inf
    """Host memory of one rank: its node's, shared equally by the node's ranks."""
    host_rates: tuple[float, float, float] = (math.inf, math.inf, math.inf)
    """Per host-held parameter: gradient copy, upload, host AdamW seconds (`CostModel.host_rates`)."""
    async_copies: bool = True
    floor: float = 0.0
    """The state fraction this group's one rank must own at least (`SearchRegime.floor_rank`)."""
    host_cap_terms: tuple[float, object] | None = None
    """(padding charge, `rank_capacity.HostCapTerms`) of the current tables: what cap(b; T)
    needs beside T, made on its first evaluation; `tabulate` drops it with the old tables."""

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class SearchRegime:
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


def rank_groups(cm: CostModel, allowed: SearchRegime | None = None) -> list[RankGroup]:
    by_key: dict[tuple, RankGroup] = {}
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
            by_key[key] = RankGroup(
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


def solo_speed(cm: CostModel, type_key: str, ref: int) -> float:
    """Samples/s of a device's compute alone at `ref` samples in one micro-batch."""
    _, compute, _ = cm.step_time_parts(type_key, ref, ref, False)
    return ref / float(compute) if compute > 0 else 1.0


def _largest_micro_batch(cm: CostModel, g: RankGroup, allowed: SearchRegime) -> int:
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


def tabulate(
    cm: CostModel,
    g: RankGroup,
    bmax: int,
    allowed: SearchRegime,
    cache: TableCache | None = None,
) -> None:
    """Fill the group's [b, option] tables for b = 0..bmax, keeping Pareto-optimal options
    (from `cache` where an earlier search of the same plan made them)."""
    if bmax > MAX_BATCH_PER_RANK:
        raise CephaloError(
            f"this plan would put more than {MAX_BATCH_PER_RANK} samples per step on one {g.type_key}, beyond "
            "what the planner tabulates; use a smaller global batch (accumulate over steps instead) or more devices"
        )
    if cache is None:
        tables = _tables(cm, g, bmax, allowed)
    else:
        assert cache.cm is cm, "a TableCache serves the searches of one cost model"
        tables = cache.tables(g, bmax, allowed)
    g.time, g.memcap, g.micro, g.offload, g.overlap, g.host_boundary, g.fuse = tables
    g.bmax = bmax
    g.host_cap_terms = None


_Tables = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""A group's [b, option] tables: time, memcap, micro, offload, overlap, host_boundary, fuse."""


class TableCache:
    """The groups' tables made for one cost model, by everything `tabulate` reads.

    One plan runs many searches on the same cost model: the charge-free relaxation, the
    unpadded sub-problems and the padded branch and bound (padded_search.py), the search
    without host state (`optimiser.unless_marginal`). They differ mostly in what the tables do
    not read (the cap on the fractions, the floor, the bisection's precision) or repeat a
    charge (each interval's bound is charged at an end already searched), so about half their
    tabulations were repeats (the README's advise example: 1,613 tabulations, 859 distinct).
    Tables are a pure function of the key, so a hit gives the very arrays a fresh tabulation
    would; they are read-only, as every search sharing them only reads them."""

    def __init__(self, cm: CostModel) -> None:
        self.cm = cm
        self._made: dict[tuple, _Tables] = {}

    def tables(self, g: RankGroup, bmax: int, allowed: SearchRegime) -> _Tables:
        # what `_tables` reads besides the cost model: the group's device, memory and host
        # share, and the regime's offload, host state, serial reduces and padding charge
        key = (
            g.type_key,
            g.capacity,
            g.host_share,
            allowed.offload,
            allowed.host,
            allowed.serial,
            allowed.pad,
            bmax,
        )
        made = self._made.get(key)
        if made is None:
            made = _tables(self.cm, g, bmax, allowed)
            for a in made:
                a.flags.writeable = False
            self._made[key] = made
        return made


def _tables(cm: CostModel, g: RankGroup, bmax: int, allowed: SearchRegime) -> _Tables:
    """The group's [b, option] tables for b = 0..bmax (see `tabulate`)."""
    mmax = max(1, min(_largest_micro_batch(cm, g, allowed), bmax))
    bs = np.arange(bmax + 1)[:, None]
    ms = _micro_batch_candidates(mmax)[None, :]
    offs = [False, True] if allowed.offload else [False]
    overlaps = [True, False] if allowed.serial else [True]
    # the fused tail is an option where the model allows it: faster, more memory in the
    # head's pass (costmodel/rules.py)
    fuses = [True, False] if cm.fused_tail_possible and cm.fuse_tail else [True]
    # every (offload, overlap, fuse) choice in one evaluation: axes b, m, offload, overlap, fuse
    o_axis = np.array(offs)[None, None, :, None, None]
    ov_axis = np.array(overlaps)[None, None, None, :, None]
    f_axis = np.array(fuses)[None, None, None, None, :]
    b5, m5 = bs[..., None, None, None], ms[..., None, None, None]
    t_all, _, _ = cm.step_time_parts(
        g.type_key, b5, m5, o_axis, ov_axis, pad=allowed.pad, fuse=f_axis
    )
    mem_all = cm.memory_without_state(
        g.type_key, g.capacity, b5, m5, o_axis, ov_axis, allowed.pad, fuse=f_axis
    )
    shape = (bmax + 1, ms.shape[1], len(offs), len(overlaps), len(fuses))
    t_all, mem_all = np.broadcast_to(t_all, shape), np.broadcast_to(mem_all, shape)
    blocks = []
    for (io, o), (iv, ov), (jf, fu) in itertools.product(
        enumerate(offs), enumerate(overlaps), enumerate(fuses)
    ):
        t, mem = t_all[:, :, io, iv, jf], mem_all[:, :, io, iv, jf]
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
                np.full(t.shape, fu),
            )
        )
    # Pareto filter per row; with host state the offloaded options compete only among
    # themselves (they use host memory the others leave to the state)
    classes = [[b for b in blocks if b[3][0, 0] == o] for o in offs] if allowed.host else [blocks]
    kept = [_pareto([np.concatenate([b[i] for b in c], axis=1) for i in range(7)]) for c in classes]
    width = max(k[0].shape[1] for k in kept)
    fills = (np.inf, -np.inf, 1, False, True, 0.0, True)
    time, memcap, micro, offload, overlap, host_boundary, fuse = (
        np.concatenate([_pad(k[i], width, fill) for k in kept], axis=1)
        for i, fill in enumerate(fills)
    )
    return time, memcap, micro, offload, overlap, host_boundary, fuse


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
