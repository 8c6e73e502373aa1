"""Block times for a model the published profiles never measured, from those of other
models on the same GPU, scaled by FLOPs; and how wrong that estimate is on the published
data itself (leave-one-out).

The estimate. On one GPU and dtype, a published entry gives a block's forward / backward
seconds at micro-batch b for a model of F FLOPs per sample (`catalog.block_flops_per_sample`:
2 per weight per token + attention). What varies between model sizes is the efficiency,
seconds per FLOP: larger blocks use the GPU better. For a new model of F* FLOPs, the entries
of the same kind of block (`group_of`: the Llama-style decoders with SwiGLU and RMSNorm,
GPT-style with GELU and LayerNorm; never a different group when the group has data there),
preferring the same sequence length, are ordered by F; the two that bracket F* (or the
nearest one, outside their range) give log(seconds per FLOP) at each micro-batch, which is
interpolated linearly in log F and multiplied by F* x b.

Leave-one-out. Each published entry is estimated from the entries of the OTHER model shapes
(same group, GPU and dtype; aliases of one shape, e.g. llama-7b and llama2-7b, are left out
together) and compared with its measurement, as the mean relative error over its micro-batch
points. Measured on the shipped catalog (`leave_one_out`, docs/models.md): Llama group
forward median 5.1 % / 90th percentile 16 %, backward 3.6 % / 13 % (311 entries).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from cephalo.errors import CephaloError
from cephalo.specs.profile import Curve

GROUPS = {"llama": "llama", "mistral": "llama", "gpt": "gpt", "bert": "bert", "vit": "vit"}
"""Published model arch -> block group. A transformers model is in `llama` unless listed in
`GPT_STYLE_TYPES` (GELU MLP + LayerNorm + its own attention layout)."""
GPT_STYLE_TYPES = ("gpt", "gpt2", "gpt_neox", "phi", "starcoder2", "stablelm")


def group_of(arch: str) -> str:
    """The block group of a `ModelSpec.arch` (a published arch or a transformers model_type)."""
    if arch in GROUPS:
        return GROUPS[arch]
    return "gpt" if arch in GPT_STYLE_TYPES else "llama"


@dataclass(frozen=True)
class Published:
    """One published block timing: a model shape on one GPU and dtype at one length."""

    model: str
    shape: tuple[int, int, int]
    """(params_per_block, hidden_size, num_heads): entries of one shape are one model."""
    group: str
    seq_len: int
    flops: float
    """Forward FLOPs of one block for one sample at `seq_len`."""
    fwd: Curve
    bwd: Curve


@dataclass(frozen=True)
class Estimate:
    """Estimated block curves and what they were made from."""

    fwd: Curve
    bwd: Curve
    sources: tuple[str, ...]
    """`model@seq_len` of the published entries used."""


def _choose(candidates: Sequence[Published], group: str, seq_len: int) -> list[Published]:
    same_group = [c for c in candidates if c.group == group]
    pool = same_group or [c for c in candidates if c.group in ("llama", "gpt")]
    same_seq = [c for c in pool if c.seq_len == seq_len]
    return same_seq or pool


def estimate(flops: float, group: str, seq_len: int, candidates: Sequence[Published]) -> Estimate:
    """Block curves for a model of `flops` forward FLOPs per sample (see the module docstring)."""
    pool = _choose(candidates, group, seq_len)
    if not pool:
        raise CephaloError("no published block timings to scale from")
    target = math.log(flops)
    below = [c for c in pool if math.log(c.flops) <= target]
    above = [c for c in pool if math.log(c.flops) > target]
    lo = max(below, key=lambda c: c.flops) if below else None
    hi = min(above, key=lambda c: c.flops) if above else None
    used = [c for c in (lo, hi) if c is not None]
    weight = 0.0
    if lo is not None and hi is not None:
        weight = (target - math.log(lo.flops)) / (math.log(hi.flops) - math.log(lo.flops))
    xs = sorted(set((lo or hi).fwd.xs))

    def curve(kind: str) -> Curve:
        ys = []
        for b in xs:
            logs = [math.log(getattr(c, kind)(b) / (c.flops * b)) for c in used]
            per_flop = logs[0] if len(logs) == 1 else (1 - weight) * logs[0] + weight * logs[1]
            ys.append(math.exp(per_flop) * flops * b)
        return Curve(list(xs), ys)

    return Estimate(curve("fwd"), curve("bwd"), tuple(f"{c.model}@{c.seq_len}" for c in used))


def _mean_relative_error(predicted: Curve, measured: Curve) -> float:
    errors = [abs(predicted(x) / y - 1.0) for x, y in zip(measured.xs, measured.ys, strict=True)]
    return sum(errors) / len(errors)


@dataclass(frozen=True)
class LeaveOneOut:
    """Estimation error on the published entries themselves."""

    n: int
    fwd_median: float
    fwd_p90: float
    bwd_median: float
    bwd_p90: float

    def describe(self) -> str:
        return (
            f"forward median {100 * self.fwd_median:.1f} % / 90th percentile "
            f"{100 * self.fwd_p90:.0f} %, backward {100 * self.bwd_median:.1f} % / "
            f"{100 * self.bwd_p90:.0f} % over {self.n} published entries"
        )


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def leave_one_out(by_device: Sequence[Sequence[Published]], group: str) -> LeaveOneOut | None:
    """Each published entry of `group` estimated from the other shapes' entries of its GPU
    and dtype (`by_device`: one list of entries per GPU and dtype), pooled; None when no entry
    has another shape to be estimated from."""
    fwd, bwd = [], []
    for entries in by_device:
        for e in entries:
            if e.group != group:
                continue
            others = [c for c in entries if c.shape != e.shape]
            if not _choose(others, group, e.seq_len):
                continue
            est = estimate(e.flops, group, e.seq_len, others)
            fwd.append(_mean_relative_error(est.fwd, e.fwd))
            bwd.append(_mean_relative_error(est.bwd, e.bwd))
    if not fwd:
        return None
    return LeaveOneOut(
        len(fwd),
        statistics.median(fwd),
        _quantile(fwd, 0.9),
        statistics.median(bwd),
        _quantile(bwd, 0.9),
    )


__all__ = [
    "Estimate",
    "LeaveOneOut",
    "Published",
    "estimate",
    "group_of",
    "leave_one_out",
]
