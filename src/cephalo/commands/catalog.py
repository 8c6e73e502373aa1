"""`cephalo catalog`: the known device types and models, and the published profiles behind them."""

from __future__ import annotations

import argparse
from collections import defaultdict

from rich.console import Console
from rich.table import Table

from cephalo import catalog
from cephalo.catalog import DTYPES, GiB

EPILOG = """\
examples:
  cephalo catalog                      # device types and models
  cephalo catalog --model gpt-2.7b     # its per-layer times on every published device
  cephalo catalog --model llama-7b --seq-len 2048 --dtype fp16
  cephalo catalog --skipped            # published entries the converter could not use

Device memory and bandwidth are the vendors' data-sheet figures; per-layer timings are the
Cephalo authors' published measurements (MIT), converted by scripts/build_catalog.py.
"""

BATCHES = (1, 2, 4, 8, 16)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "catalog",
        help="list known device types and models",
        description=__doc__.split(":", 1)[1].strip(),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--model", metavar="NAME", help="per-device block forward/backward ms at batch 1..16"
    )
    what.add_argument(
        "--skipped",
        action="store_true",
        help="list the published entries that were not used, and why",
    )
    p.add_argument(
        "--seq-len", type=int, metavar="N", help="with --model: only this sequence length"
    )
    p.add_argument(
        "--dtype", choices=DTYPES, help="with --model: only this dtype (bf16 reads the fp16 data)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    console = Console()
    if args.skipped:
        console.print(skipped_table())
    elif args.model:
        console.print(model_table(args.model, args.seq_len, args.dtype))
    else:
        console.print(devices_table())
        console.print(models_table())
    return 0


def _profiles_by(index: int) -> dict[str, set[str]]:
    """device -> models (index 1) or model -> devices (index 0) with a published profile."""
    out: dict[str, set[str]] = defaultdict(set)
    for entry in catalog.available_profiles():
        out[entry[index]].add(entry[1 - index])
    return out


def devices_table() -> Table:
    models_on = _profiles_by(1)
    t = Table(title="Device types (`--cluster 2xl4,a6000,p40`)", title_justify="left")
    for col in (
        "type",
        "name",
        "memory",
        "mem BW",
        "PCIe",
        "link",
        "aliases",
        "models with profiles",
    ):
        t.add_column(
            col, justify="right" if col in ("memory", "mem BW", "PCIe", "link") else "left"
        )
    for key, d in catalog.DEVICES.items():
        models = sorted(models_on.get(key, ()), key=list(catalog.MODELS).index)
        t.add_row(
            key,
            d.name,
            f"{d.memory_gib:g} GiB",
            f"{d.memory_bandwidth_gb_s:g} GB/s",
            f"gen{d.pcie_gen}",
            f"{catalog.intra_node_bytes_per_s(key) / 1e9:g} GB/s",
            ", ".join(d.aliases),
            ", ".join(models) or "-",
        )
    t.add_row(
        "cpu",
        "emulated (CPU)",
        f"{catalog.CPU_DEFAULT_MEMORY_BYTES / GiB:g} GiB",
        "-",
        "-",
        f"{catalog.CPU_LINK_BYTES_PER_S / 1e9:g} GB/s",
        "",
        "measure with `cephalo profile`; cpu:slowdown=2,mem=1GiB",
    )
    return t


def models_table() -> Table:
    devices_for = _profiles_by(0)
    t = Table(title="Models (`--model gpt-2.7b`)", title_justify="left")
    for col in (
        "name",
        "arch",
        "layers",
        "hidden",
        "heads",
        "params",
        "aliases",
        "devices with profiles",
    ):
        t.add_column(
            col, justify="right" if col in ("layers", "hidden", "heads", "params") else "left"
        )
    for spec in catalog.list_models():
        devices = sorted(devices_for.get(spec.name, ()), key=catalog.list_device_types().index)
        t.add_row(
            spec.name,
            spec.arch,
            str(spec.num_layers),
            str(spec.hidden_size),
            str(spec.num_heads),
            f"{spec.total_params / 1e9:.2f} B",
            ", ".join(spec.aliases),
            ", ".join(devices) or "-",
        )
    return t


def model_table(name: str, seq_len: int | None, dtype: str | None) -> Table:
    spec = catalog.get_model_spec(name)
    data_dtype = None if dtype is None else ("fp32" if dtype == "fp32" else "fp16")
    rows = [
        e
        for e in catalog.available_profiles()
        if e[0] == spec.name
        and (seq_len is None or e[2] == seq_len)
        and (data_dtype is None or e[3] == data_dtype)
    ]
    t = Table(
        title=f"{spec.name}: one block's forward / backward ms at micro-batch {', '.join(map(str, BATCHES))}",
        title_justify="left",
        caption="source: measured arrays, fitted lines (fit), or a split forward+backward line (fit-total)",
    )
    for col in ("device", "seq", "dtype", "source", *[f"b={b}" for b in BATCHES], "act MiB/sample"):
        t.add_column(col, justify="left" if col in ("device", "dtype", "source") else "right")
    for _, device, seq, dt in sorted(
        rows, key=lambda e: (catalog.list_device_types().index(e[1]), e[2], e[3])
    ):
        p = catalog.catalog_profile(device, spec, seq, dt)
        block = p.units["block"]
        cells = [f"{block.fwd_s(b) * 1e3:.1f} / {block.bwd_s(b) * 1e3:.1f}" for b in BATCHES]
        act = block.activation_bytes(1) / 2**20
        t.add_row(
            device,
            str(seq),
            dt,
            p.meta["timing_source"],
            *cells,
            f"{act:.0f} ({p.meta['activation_source']})",
        )
    if not rows:
        t.caption = (
            f"no published profile of {spec.name} matches; `cephalo catalog` lists what exists"
        )
    return t


def skipped_table() -> Table:
    skipped = catalog.skipped_entries()
    t = Table(title=f"{len(skipped)} published entries not used", title_justify="left")
    for col in ("key", "device", "seq", "dtype", "reason"):
        t.add_column(col)
    for s in skipped:
        t.add_row(s["key"], s["device"], str(s["seq_len"]), s["dtype"], s["reason"])
    return t
