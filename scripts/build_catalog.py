"""Convert the Cephalo authors' published profiles into the package's own catalog JSON.

    python scripts/build_catalog.py [--src ../shared/data/published-profiles/cephalo]
                                    [--out src/cephalo/_data/catalog.json]

Run once when the source data changes; the output is committed and shipped, so the package
never reads the original files. What it does (see src/cephalo/_data/README.md):

- timings (model_latencies.json): per (model, GPU, seq_len, dtype) the forward and backward
  time of ONE block vs batch size, in seconds. Measured arrays win over the fitted lines;
  fit-only entries are sampled at batch 1..16. Non-positive points are dropped (negative
  intercepts make small batches negative). Bare numbers are skipped. A single line (forward
  + backward together) is split with the device's median backward/forward ratio. Keys are mapped to the catalog's friendly model names
  and device keys; when two keys measured the same thing the model's first key wins.
- memory (model_memory.json): per (model, dtype) the activation memory per extra sample
  (least-squares slope of the GB-vs-batch profile), from the authors' `paper` cluster when
  they profiled it there.
- published parameter counts (model_stats.json), for the tests to compare shapes against.
- derived cards (consumer and workstation GPUs nobody published, `cephalo.specs.catalog.derived`):
  every entry a same-architecture sibling measured, scaled by SMs x boost clock, with
  `source: derived`, and the method's measured error (predicting measured cards from their
  siblings). The cards' public spec numbers (SMs, boost clock, memory, bandwidth; from
  NVIDIA's spec pages) are the table `SPECS` in src/cephalo/specs/derived.py, which this
  script and the package both read (one table: the package needs memory and bandwidth too);
  this script prints it.

Every entry not used is listed under `skipped` with its reason (`cephalo catalog --skipped`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from cephalo.specs.catalog.derived import (  # noqa: E402
    DERIVED,
    FILLS,
    SIBLINGS,
    SPECS,
    derivation_errors,
    derive_timings,
    error_scope,
    method_of,
    siblings_of,
)
from cephalo.specs.catalog.devices import DEVICE_ALIASES  # noqa: E402
from cephalo.specs.catalog.models import MODELS  # noqa: E402

DEFAULT_SRC = ROOT.parent / "shared" / "data" / "published-profiles" / "cephalo"
DEFAULT_OUT = ROOT / "src" / "cephalo" / "_data" / "catalog.json"
DTYPE = {"float16": "fp16", "float32": "fp32"}
FIT_SAMPLES = 16  # fit-only entries are sampled at batch 1..16
# model_memory.json clusters, most relevant first (`paper` = 2xL4 + A6000 + P40)
MEMORY_CLUSTERS = ("paper", "paper_4gpu", "aws-16gpu", "aws-8gpu", "aws-8v100-8a10g", "trpro")
# the authors profiled memory at their default sequence length
MEMORY_SEQ_LEN = 512
GiB = 1024**3
SIG = 6  # significant digits kept


def _round(x: float) -> float:
    return float(f"{x:.{SIG}g}")


def _is_fit(x) -> bool:
    return isinstance(x, list) and len(x) == 2 and all(isinstance(v, (int, float)) for v in x)


def _is_series(x) -> bool:
    return isinstance(x, list) and len(x) >= 1 and all(isinstance(v, (int, float)) for v in x)


def _points(ms: list[float]) -> tuple[list[float], list[float], int]:
    """(batch sizes, seconds, dropped count) of a measured array, non-positive points dropped."""
    xs, ys, dropped = [], [], 0
    for i, v in enumerate(ms):
        if v > 0:
            xs.append(float(i + 1))
            ys.append(_round(v / 1000.0))
        else:
            dropped += 1
    return xs, ys, dropped


def _fit_points(fit: list[float]) -> tuple[list[float], list[float], int]:
    slope, intercept = fit
    return _points([slope * b + intercept for b in range(1, FIT_SAMPLES + 1)])


def convert_entry(entry, bwd_fwd_ratio: float | None = None) -> tuple[dict | None, str]:
    """One latency entry -> ({fwd_s, bwd_s, source}, note) or (None, reason).

    A single line `[slope, intercept]` is the forward + backward time together (it matches
    the sum of the split fits where both exist, within 2%); it is split with the device's
    backward/forward ratio `bwd_fwd_ratio` (median over its split entries in that dtype, or
    over every device's if it has none).
    """
    if isinstance(entry, (int, float)):
        return None, "bare number (old format, no batch dependence)"
    if _is_fit(entry):
        if bwd_fwd_ratio is None:
            return (
                None,
                "a single forward+backward line, and no split entry on this device to divide it by",
            )
        if entry[0] <= 0:
            return None, "fitted line with a non-positive slope"
        share = 1.0 / (1.0 + bwd_fwd_ratio)
        fwd = [entry[0] * share, entry[1] * share]
        bwd = [entry[0] * (1 - share), entry[1] * (1 - share)]
        conv, note = convert_entry([fwd, bwd])
        if conv is not None:
            conv["source"] = "fit-total"
        return conv, note
    if (
        isinstance(entry, list)
        and len(entry) == 4
        and all(_is_fit(f) for f in entry[:2])
        and all(_is_series(a) for a in entry[2:])
    ):
        (fx, fy, fd), (bx, by, bd) = _points(entry[2]), _points(entry[3])
        source = "measured"
    elif isinstance(entry, list) and len(entry) == 2 and all(_is_fit(f) for f in entry):
        if entry[0][0] <= 0 or entry[1][0] <= 0:
            return None, "fitted line with a non-positive slope"
        (fx, fy, fd), (bx, by, bd) = _fit_points(entry[0]), _fit_points(entry[1])
        source = "fit"
    else:
        return None, "unrecognised entry shape"
    if len(fx) < 2 or len(bx) < 2:
        return None, "fewer than two positive points"
    note = ""
    if fd or bd:
        note = f"dropped {fd} forward / {bd} backward non-positive point(s) ({source})"
    return {"fwd_s": {"xs": fx, "ys": fy}, "bwd_s": {"xs": bx, "ys": by}, "source": source}, note


def key_to_model() -> dict[str, tuple[str, int, bool]]:
    """data key -> (model name, priority, is_fallback); a key can serve several models."""
    table: dict[str, list[tuple[str, int, bool]]] = {}
    for m in MODELS.values():
        for i, k in enumerate(m.data_keys):
            table.setdefault(k, []).append((m.name, i, False))
        for i, k in enumerate(m.fallback_keys):
            table.setdefault(k, []).append((m.name, len(m.data_keys) + i, True))
    return table


def bwd_fwd_ratios(lat: dict) -> dict[tuple[str, str], float]:
    """(device, data dtype) -> median backward/forward slope ratio over the split entries."""
    ratios: dict[tuple[str, str], list[float]] = {}
    for by_dev in lat.values():
        for dev_key, by_seq in by_dev.items():
            dev = DEVICE_ALIASES.get(dev_key.lower())
            for by_dtype in by_seq.values():
                for dt, e in by_dtype.items():
                    if (
                        isinstance(e, list)
                        and len(e) in (2, 4)
                        and all(_is_fit(f) for f in e[:2])
                        and e[0][0] > 0
                        and e[1][0] > 0
                    ):
                        ratios.setdefault((dev, dt), []).append(e[1][0] / e[0][0])
    out = {k: sorted(v)[len(v) // 2] for k, v in ratios.items()}
    # a device with no split entry in a dtype uses the median over all devices of that dtype
    for dt in {dt for _, dt in ratios}:
        pooled = sorted(r for (_, d), v in ratios.items() if d == dt for r in v)
        out[(None, dt)] = pooled[len(pooled) // 2]
    return out


def build_timings(lat: dict, skipped: list, notes: list) -> dict:
    owners = key_to_model()
    ratios = bwd_fwd_ratios(lat)
    chosen: dict[
        tuple, tuple[int, str, dict]
    ] = {}  # (model, dev, seq, dtype) -> (priority, key, entry)
    for key, by_dev in lat.items():
        for dev_key, by_seq in by_dev.items():
            for seq, by_dtype in by_seq.items():
                for dt, entry in by_dtype.items():
                    where = {"key": key, "device": dev_key, "seq_len": int(seq), "dtype": dt}
                    if key not in owners:
                        skipped.append(
                            {**where, "reason": "model has no known shape in the catalog"}
                        )
                        continue
                    dev = DEVICE_ALIASES.get(dev_key.lower())
                    if dev is None or dev == "cpu":
                        skipped.append({**where, "reason": "unknown device key"})
                        continue
                    if dt not in DTYPE:
                        skipped.append({**where, "reason": "unknown dtype"})
                        continue
                    conv, note = convert_entry(entry, ratios.get((dev, dt), ratios.get((None, dt))))
                    if conv is None:
                        skipped.append({**where, "reason": note})
                        continue
                    if note:
                        notes.append({**where, "note": note})
                    conv["key"] = key
                    for model, prio, _ in owners[key]:
                        slot = (model, dev, int(seq), DTYPE[dt])
                        if slot not in chosen or prio < chosen[slot][0]:
                            chosen[slot] = (prio, key, conv)
    # report the entries a better key shadowed (fallback use of another model's data is not news)
    for key, by_dev in lat.items():
        for model, _, is_fallback in owners.get(key, []):
            if is_fallback:
                continue
            for dev_key, by_seq in by_dev.items():
                dev = DEVICE_ALIASES.get(dev_key.lower())
                for seq, by_dtype in by_seq.items():
                    for dt in by_dtype:
                        slot = (model, dev, int(seq), DTYPE.get(dt))
                        if (
                            slot in chosen
                            and chosen[slot][1] != key
                            and convert_entry(by_dtype[dt], 1.0)[0] is not None
                        ):
                            skipped.append(
                                {
                                    "key": key,
                                    "device": dev_key,
                                    "seq_len": int(seq),
                                    "dtype": dt,
                                    "reason": f"also published under {chosen[slot][1]}, which {model} prefers",
                                }
                            )
    out: dict = {}
    for (model, dev, seq, dt), (_, _, conv) in sorted(chosen.items()):
        out.setdefault(model, {}).setdefault(dev, {}).setdefault(str(seq), {})[dt] = conv
    return out


def _slope(ys: list[float]) -> float:
    n = len(ys)
    xs = list(range(1, n + 1))
    mx, my = sum(xs) / n, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )


def build_memory(mem: dict, skipped: list) -> dict:
    out: dict = {}
    for m in MODELS.values():
        for dt in ("float16", "float32"):
            for key in (*m.data_keys, *m.fallback_keys):
                found = None
                for cluster in MEMORY_CLUSTERS:
                    gb = (
                        mem.get(cluster, {}).get(key, {}).get("profiled_compute_memory", {}).get(dt)
                    )
                    if gb and len(gb) >= 2 and _slope(gb) > 0:
                        found = (cluster, gb)
                        break
                if found:
                    cluster, gb = found
                    out.setdefault(m.name, {})[DTYPE[dt]] = {
                        "gib": [_round(g) for g in gb],
                        "slope_bytes_per_sample": _round(_slope(gb) * GiB),
                        "seq_len": MEMORY_SEQ_LEN,
                        "cluster": cluster,
                        "key": key,
                    }
                    break
    known = {k for m in MODELS.values() for k in (*m.data_keys, *m.fallback_keys)}
    for cluster, by_model in mem.items():
        for key in by_model:
            if key not in known:
                skipped.append(
                    {
                        "key": key,
                        "device": f"memory:{cluster}",
                        "seq_len": MEMORY_SEQ_LEN,
                        "dtype": "*",
                        "reason": "memory profile of a model with no known shape",
                    }
                )
    return out


def build_params(stats: dict) -> dict:
    out = {}
    for m in MODELS.values():
        for key in m.data_keys:
            if key in stats:
                s = stats[key]
                out[m.name] = {
                    "key": key,
                    "parameters_per_layer": s["parameters_per_layer"],
                    "total_parameters": s["total_parameters"],
                }
                break
    return out


def build(src: Path) -> dict:
    lat = json.loads((src / "model_latencies.json").read_text())
    mem = json.loads((src / "model_memory.json").read_text())
    stats = json.loads((src / "model_stats.json").read_text())
    skipped: list = []
    notes: list = []
    timings = build_timings(lat, skipped, notes)
    memory = build_memory(mem, skipped)
    errors = derivation_errors(timings)  # on the measured timings only
    for model, by_dev in derive_timings(timings).items():  # beside the measured entries
        for dev, by_seq in by_dev.items():
            for seq, by_dtype in by_seq.items():
                timings[model].setdefault(dev, {}).setdefault(seq, {}).update(by_dtype)
    derived = {
        card: {
            "from": list(siblings_of(card)),
            "method": method_of(card),
            "error_scope": error_scope(card),
            "fills_gaps": card in FILLS,
        }
        for card in (*DERIVED, *FILLS)
    }
    return {
        "format": 1,
        "source": "Cephalo authors' published profiles (MIT, see LICENSE): model_latencies.json, model_memory.json, model_stats.json",
        "units": {
            "timings": "seconds of ONE block vs batch size",
            "memory": "GiB vs batch size; slope in bytes per sample",
        },
        "timings": timings,
        "memory": memory,
        "published_params": build_params(stats),
        "derived": derived,
        "derivation_errors": errors,
        "skipped": sorted(skipped, key=lambda d: (d["key"], d["device"], d["seq_len"], d["dtype"])),
        "notes": notes,
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--src", type=Path, default=DEFAULT_SRC)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    catalog = build(args.src)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(catalog, separators=(",", ":"), sort_keys=True) + "\n")
    n = sum(len(s) for d in catalog["timings"].values() for v in d.values() for s in v.values())
    print(
        f"wrote {args.out}: {len(catalog['timings'])} models, {n} timing profiles, {len(catalog['memory'])} memory profiles"
    )
    print("card specs (src/cephalo/specs/derived.py, NVIDIA spec pages):")
    print(f"  {'card':<18} {'chip':<6} {'SMs':>4} {'boost MHz':>9} {'GB':>4} {'GB/s':>7}  from")
    for c in SPECS.values():
        print(
            f"  {c.name:<18} {c.chip:<6} {c.sms:>4} {c.boost_mhz:>9} {c.memory_gib:>4g} "
            f"{c.bandwidth_gb_s:>7g}  "
            + ", ".join(SIBLINGS.get(c.key, ("measured", *FILLS.get(c.key, ()))))
        )
    for scope, e in catalog["derivation_errors"].items():
        print(f"derivation error ({scope}): {e}")
    print(f"skipped {len(catalog['skipped'])} entries:")
    for s in catalog["skipped"]:
        print(f"  {s['key']} {s['device']} seq {s['seq_len']} {s['dtype']}: {s['reason']}")
    for s in catalog["notes"]:
        print(f"  note: {s['key']} {s['device']} seq {s['seq_len']} {s['dtype']}: {s['note']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
