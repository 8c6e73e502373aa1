"""Consumer and workstation GPUs nobody published profiles of, derived from a measured card of
the same architecture by spec ratios; and how wrong that derivation is on cards that were
measured.

The method. A Transformer block's forward and backward at the published lengths (seq >= 512)
are matmul-bound: its time on card X is the sibling S's measured time x (SMs_S x boost_S) /
(SMs_X x boost_X), the ratio of their peak compute at equal work per SM and clock (same
architecture: same tensor cores per SM). Bandwidth-bound work, the optimizer step (and QLoRA's
dequantization, derived from it), scales with the card's own memory bandwidth through
`catalog.optimizer_s_per_param`, which reads the table below. `scripts/build_catalog.py` writes
the derived curves into the catalog beside the measured ones (`source: derived`), so a derived
card plans like a measured one, FLOP-scaled estimates for unmeasured models included.

Its error, measured (`derivation_errors`): each pair of MEASURED cards of one architecture that
share published entries (model, length, dtype) is predicted one from the other by the same
ratio and compared point by point (the mean relative error over an entry's micro-batch points,
as the FLOP-scaling estimate's leave-one-out error): the RTX 3090 from the RTX A6000 and both
ways between the A6000, 3090 and A10G (GA102), the L4 from the L40S and back (Ada). Across
architectures (the RTX 5090, Blackwell, from Ada cards; the RTX 2080 Ti, Turing, from
Ampere cards) the measured error is that of predicting Ada cards from Ampere ones and back, a
stated larger error. Turing's SM has half the fp32 lanes of Ampere's, Ada's and Blackwell's
(64 vs 128; its tensor cores do the same fp16 work per SM and clock as GA10x's), so an fp32
entry is scaled by the lanes too (`CardSpec.fp32_lanes`). `cephalo plan` prints
the error with a plan that uses a derived card.

Spec numbers: NVIDIA's product pages and data sheets (GeForce RTX 20/30/40/50 series "full
specs" pages: RTX 2080 Ti, 3060 Ti, 3070, 4070 among them; RTX A4000/A4500/A5000/A6000, A10,
L4, L40, L40S data sheets; SMs are the CUDA cores / 128, / 64 on Turing; the A10G is AWS's
A10 variant, per the EC2 G5 documentation and NVIDIA's A10G listing). Memory in the vendors'
GB, taken as GiB as `catalog.DeviceSpec.memory_gib` explains.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cephalo.specs.profile import Curve


@dataclass(frozen=True)
class CardSpec:
    """What the derivation and the catalog need of a GPU's data sheet."""

    key: str
    name: str
    chip: str
    """GA102, AD102, ... (its architecture: the first two letters)."""
    sms: int
    boost_mhz: int
    memory_gib: float
    bandwidth_gb_s: float
    pcie_gen: int
    """x16 generation (a x8 gen-4 card is listed as gen 3: the same bandwidth)."""
    aliases: tuple[str, ...] = ()

    @property
    def arch(self) -> str:
        return {"TU": "turing", "GA": "ampere", "AD": "ada", "GB": "blackwell"}[self.chip[:2]]

    @property
    def fp32_lanes(self) -> int:
        """fp32 lanes per SM: 64 on Turing, 128 from Ampere on (what an fp32 block runs on;
        fp16 / bf16 blocks run on the tensor cores, the same work per SM and clock)."""
        return 64 if self.arch == "turing" else 128

    @property
    def compute(self) -> float:
        """SMs x boost clock: peak tensor throughput up to the per-SM rate of its architecture."""
        return self.sms * self.boost_mhz


SPECS: dict[str, CardSpec] = {
    c.key: c
    for c in [
        # measured cards (the published profiles): the siblings
        CardSpec("a6000", "RTX A6000", "GA102", 84, 1800, 48, 768, 4),
        CardSpec("rtx3090", "RTX 3090", "GA102", 82, 1695, 24, 936, 4),
        CardSpec("a10g", "A10G", "GA102", 80, 1710, 24, 600, 4),
        CardSpec("l40s", "L40S", "AD102", 142, 2520, 48, 864, 4),
        CardSpec("l4", "L4", "AD104", 58, 2040, 24, 300, 4),
        # derived cards
        CardSpec("rtx3060", "RTX 3060 12GB", "GA106", 28, 1777, 12, 360, 4, ("3060",)),
        CardSpec("rtx3060ti", "RTX 3060 Ti", "GA104", 38, 1665, 8, 448, 4, ("3060ti",)),
        CardSpec("rtx3070", "RTX 3070", "GA104", 46, 1725, 8, 448, 4, ("3070",)),
        CardSpec("rtx3080", "RTX 3080 10GB", "GA102", 68, 1710, 10, 760, 4, ("3080",)),
        CardSpec("rtx3090ti", "RTX 3090 Ti", "GA102", 84, 1860, 24, 1008, 4, ("3090ti",)),
        CardSpec("rtxa4000", "RTX A4000", "GA104", 48, 1560, 16, 448, 4, ("a4000", "rtx-a4000")),
        CardSpec("rtxa4500", "RTX A4500", "GA102", 56, 1650, 20, 640, 4, ("a4500", "rtx-a4500")),
        CardSpec("rtxa5000", "RTX A5000", "GA102", 64, 1695, 24, 768, 4, ("a5000", "rtx-a5000")),
        CardSpec("rtx4060ti", "RTX 4060 Ti 16GB", "AD106", 34, 2535, 16, 288, 3, ("4060ti",)),
        CardSpec(
            "rtx4070tisuper",
            "RTX 4070 Ti SUPER",
            "AD103",
            66,
            2610,
            16,
            672,
            4,
            ("4070tisuper", "rtx4070ti-super"),
        ),
        CardSpec("rtx4070", "RTX 4070", "AD104", 46, 2475, 12, 504, 4, ("4070",)),
        CardSpec("rtx4080", "RTX 4080", "AD103", 76, 2505, 16, 716.8, 4, ("4080",)),
        CardSpec("rtx4090", "RTX 4090", "AD102", 128, 2520, 24, 1008, 4, ("4090",)),
        CardSpec("l40", "L40", "AD102", 142, 2490, 48, 864, 4),
        CardSpec("rtx5090", "RTX 5090", "GB202", 170, 2407, 32, 1792, 5, ("5090",)),
        CardSpec("rtx2080ti", "RTX 2080 Ti", "TU102", 68, 1545, 11, 616, 3, ("2080ti",)),
    ]
}

SIBLINGS: dict[str, tuple[str, ...]] = {
    # GeForce Ampere: the measured GeForce GA102 first, the A6000 where it has no entry
    "rtx3060": ("rtx3090", "a6000"),
    "rtx3060ti": ("rtx3090", "a6000"),
    "rtx3070": ("rtx3090", "a6000"),
    "rtx3080": ("rtx3090", "a6000"),
    "rtx3090ti": ("rtx3090", "a6000"),
    # workstation Ampere: the workstation GA102 first
    "rtxa4000": ("a6000", "rtx3090"),
    "rtxa4500": ("a6000", "rtx3090"),
    "rtxa5000": ("a6000", "rtx3090"),
    # Ada: the measured AD102 (L40S) first, the AD104 (L4) where it has no entry (the L40S was
    # published in fp32 only)
    "rtx4060ti": ("l40s", "l4"),
    "rtx4070": ("l40s", "l4"),
    "rtx4070tisuper": ("l40s", "l4"),
    "rtx4080": ("l40s", "l4"),
    "rtx4090": ("l40s", "l4"),
    "l40": ("l40s", "l4"),
    # Blackwell has no measured sibling: the nearest, Ada (its predecessor)
    "rtx5090": ("l40s", "l4"),
    # Turing has no measured sibling of its own kind (the T4 is a 70 W Tesla whose tensor
    # cores run fp32 accumulation at twice a GeForce's rate): the GeForce Ampere GA102
    "rtx2080ti": ("rtx3090", "a6000"),
}
"""Derived card -> the measured cards it is derived from, in order of preference per entry."""

DERIVED = tuple(SIBLINGS)
FILLS: dict[str, tuple[str, ...]] = {
    "rtx3090": ("a6000",),
    "l40s": ("l4",),
}
"""Measured cards whose missing entries are derived the same way from a sibling: the RTX 3090
was published for five models (GPT, ViT; fp16 at 512 tokens) and the L40S in fp32 only, so
without these a Llama plan (or any fp16 plan on the L40S) could not use them. Their measured
entries stay as measured."""
SAME_ARCH_PAIRS = (
    ("rtx3090", "a6000"),
    ("a6000", "rtx3090"),
    ("a10g", "a6000"),
    ("a6000", "a10g"),
    ("rtx3090", "a10g"),
    ("a10g", "rtx3090"),
    ("l4", "l40s"),
    ("l40s", "l4"),
)
"""(predicted, from) pairs of measured cards of one architecture: the derivation's error."""
CROSS_ARCH_PAIRS = (
    ("l4", "a10g"),
    ("a10g", "l4"),
    ("l40s", "a6000"),
    ("a6000", "l40s"),
    ("l4", "a6000"),
    ("l40s", "a10g"),
)
"""(predicted, from) pairs across architectures (Ampere <-> Ada): the error of a card whose
siblings are of another architecture (the RTX 5090)."""


def time_ratio(card: str, sibling: str, dtype: str = "fp16") -> float:
    """Block time on `card` / block time on `sibling` (compute-bound: inverse peak compute;
    in fp32, on the SMs' fp32 lanes)."""
    a, b = SPECS[card], SPECS[sibling]
    lanes = b.fp32_lanes / a.fp32_lanes if dtype in ("fp32", "float32") else 1.0
    return b.compute / a.compute * lanes


def same_architecture(card: str, sibling: str) -> bool:
    return SPECS[card].arch == SPECS[sibling].arch


def derive_entry(entry: Mapping, card: str, sibling: str, dtype: str = "fp16") -> dict:
    """A published timing entry of `sibling` ({fwd_s, bwd_s: {xs, ys}, ...}) in `dtype` (the
    catalog's `fp16` / `fp32`) scaled to `card`."""
    r = time_ratio(card, sibling, dtype)
    out = {
        k: {"xs": list(entry[k]["xs"]), "ys": [float(f"{y * r:.6g}") for y in entry[k]["ys"]]}
        for k in ("fwd_s", "bwd_s")
    }
    out.update(source="derived", derived_from=sibling, key=entry.get("key", ""))
    return out


def derive_timings(timings: Mapping) -> dict:
    """Derived cards' entries for every (model, seq_len, dtype) one of their siblings measured
    (`timings[model][device][seq][dtype]`, the catalog's layout); measured entries untouched."""
    out: dict = {}
    for model, by_dev in timings.items():
        for card, siblings in (*SIBLINGS.items(), *FILLS.items()):
            slots = {
                (seq, dt)
                for s in siblings
                for seq, by_dt in by_dev.get(s, {}).items()
                for dt in by_dt
                if dt not in by_dev.get(card, {}).get(seq, {})  # never over a measurement
            }
            for seq, dt in sorted(slots):
                sibling = next(s for s in siblings if dt in by_dev.get(s, {}).get(seq, {}))
                entry = derive_entry(by_dev[sibling][seq][dt], card, sibling, dt)
                out.setdefault(model, {}).setdefault(card, {}).setdefault(seq, {})[dt] = entry
    return out


def _mean_relative_error(predicted: Curve, measured: Curve) -> float:
    errors = [abs(predicted(x) / y - 1.0) for x, y in zip(measured.xs, measured.ys, strict=True)]
    return sum(errors) / len(errors)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True)
class DerivationError:
    """The derivation's error on measured cards: per entry the mean relative error over its
    micro-batch points, summarised over entries (signed bias: median of predicted / measured - 1)."""

    n: int
    fwd_median: float
    fwd_p90: float
    bwd_median: float
    bwd_p90: float
    bias: float
    pairs: tuple[str, ...]

    def describe(self) -> str:
        return (
            f"forward median {100 * self.fwd_median:.0f} % / 90th percentile "
            f"{100 * self.fwd_p90:.0f} %, backward {100 * self.bwd_median:.0f} % / "
            f"{100 * self.bwd_p90:.0f} % (median bias {100 * self.bias:+.0f} %) over {self.n} "
            f"entries predicting {', '.join(self.pairs)}"
        )

    def to_dict(self) -> dict:
        return {
            "n": self.n,
            "fwd_median": round(self.fwd_median, 4),
            "fwd_p90": round(self.fwd_p90, 4),
            "bwd_median": round(self.bwd_median, 4),
            "bwd_p90": round(self.bwd_p90, 4),
            "bias": round(self.bias, 4),
            "pairs": list(self.pairs),
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> DerivationError:
        return cls(
            int(d["n"]),
            float(d["fwd_median"]),
            float(d["fwd_p90"]),
            float(d["bwd_median"]),
            float(d["bwd_p90"]),
            float(d["bias"]),
            tuple(d["pairs"]),
        )


def derivation_error(timings: Mapping, pairs: Iterable[tuple[str, str]]) -> DerivationError | None:
    """Predict each (card, sibling) pair's shared entries by `derive_entry` and compare with the
    card's measurements (the catalog's measured timings only)."""
    fwd, bwd, ratios, used = [], [], [], []
    for card, sibling in pairs:
        n_before = len(fwd)
        for by_dev in timings.values():
            mine, theirs = by_dev.get(card, {}), by_dev.get(sibling, {})
            for seq, by_dt in mine.items():
                for dt, measured in by_dt.items():
                    src = theirs.get(seq, {}).get(dt)
                    if src is None or "derived" in (measured.get("source"), src.get("source")):
                        continue
                    pred = derive_entry(src, card, sibling, dt)
                    m_f, m_b = (Curve.from_dict(measured[k]) for k in ("fwd_s", "bwd_s"))
                    p_f, p_b = (Curve.from_dict(pred[k]) for k in ("fwd_s", "bwd_s"))
                    fwd.append(_mean_relative_error(p_f, m_f))
                    bwd.append(_mean_relative_error(p_b, m_b))
                    ratios.extend(
                        p(x) / y - 1
                        for p, c in ((p_f, m_f), (p_b, m_b))
                        for x, y in zip(c.xs, c.ys, strict=True)
                    )
        if len(fwd) > n_before:
            used.append(f"{SPECS[card].name} from {SPECS[sibling].name} ({len(fwd) - n_before})")
    if not fwd:
        return None
    return DerivationError(
        len(fwd),
        statistics.median(fwd),
        _quantile(fwd, 0.9),
        statistics.median(bwd),
        _quantile(bwd, 0.9),
        statistics.median(ratios),
        tuple(used),
    )


def derivation_errors(timings: Mapping) -> dict[str, dict]:
    """The two measured errors the catalog ships: `same-architecture` and `cross-architecture`."""
    out = {}
    for name, pairs in (
        ("same-architecture", SAME_ARCH_PAIRS),
        ("cross-architecture", CROSS_ARCH_PAIRS),
    ):
        err = derivation_error(timings, pairs)
        if err is not None:
            out[name] = err.to_dict()
    return out


def siblings_of(card: str) -> tuple[str, ...]:
    """The measured cards a derived card (or a filled one's missing entries) comes from."""
    return SIBLINGS.get(card) or FILLS[card]


def method_of(card: str) -> str:
    """How a derived card's timings were made, in words."""
    spec = SPECS[card]
    froms = " / ".join(f"{SPECS[s].name} ({SPECS[s].chip})" for s in siblings_of(card))
    what = f"{spec.name}'s unmeasured entries" if card in FILLS else spec.name
    lanes = (
        f", fp32 by its {spec.fp32_lanes} fp32 lanes per SM"
        if any(SPECS[s].fp32_lanes != spec.fp32_lanes for s in siblings_of(card))
        else ""
    )
    return (
        f"{what} ({spec.chip}, {spec.sms} SMs @ {spec.boost_mhz} MHz, "
        f"{spec.bandwidth_gb_s:g} GB/s) derived from the measured {froms} by SMs x boost clock "
        f"(blocks{lanes}) and memory bandwidth (optimizer)"
    )


def error_scope(card: str) -> str:
    """Which measured error applies to a derived card."""
    same = any(same_architecture(card, s) for s in siblings_of(card))
    return "same-architecture" if same else "cross-architecture"
