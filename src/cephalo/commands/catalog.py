"""`cephalo catalog`: the known device types and models, and the published profiles behind them."""

from __future__ import annotations

import argparse

from cephalo.specs.catalog import models
from cephalo.specs.catalog.devices import DTYPES
from cephalo.views.tables import (
    catalog_device_table,
    catalog_devices_table,
    catalog_model_table,
    catalog_models_table,
    catalog_skipped_table,
    make_console,
)

EPILOG = """\
examples:
  cephalo catalog                      # device types, with how many models each has profiles for
  cephalo catalog --models             # the models, with the devices that have their profiles
  cephalo catalog --device a6000       # the profiles published for one device type
  cephalo catalog --model gpt-2.7b     # its per-layer times on every published device
  cephalo catalog --model llama-7b --seq-len 2048 --dtype fp16
  cephalo catalog --skipped            # published entries the converter could not use

Device memory and bandwidth are the vendors' data-sheet figures; per-layer timings are the
Cephalo authors' published measurements (MIT), converted by scripts/build_catalog.py.
"""


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
        "--models", action="store_true", help="the models and the devices with their profiles"
    )
    what.add_argument("--device", metavar="TYPE", help="the profiles published for one device type")
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
    console = make_console()
    if args.skipped:
        console.print(catalog_skipped_table())
    elif args.model:
        console.print(catalog_model_table(args.model, args.seq_len, args.dtype))
    elif args.models:
        console.print(catalog_models_table())
    elif args.device:
        console.print(catalog_device_table(args.device))
    else:
        console.print(catalog_devices_table())
        console.print(
            f"{len(models.list_models())} models: `cephalo catalog --models`; one device's "
            "profiles: `cephalo catalog --device TYPE`"
        )
    return 0
