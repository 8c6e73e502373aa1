"""`cephalo ...`: the command line.

Each subcommand lives in its own module under `cephalo.commands` and exposes
`register(subparsers)` (adds its parser, sets `func`) . This file only wires them together
and turns `CephaloError` into one clear line and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from cephalo import envvars
from cephalo.errors import CephaloError

# order = order in `cephalo --help`
COMMANDS = [
    "demo",
    "run",
    "train",
    "doctor",
    "plan",
    "advise",
    "simulate",
    "profile",
    "catalog",
    "prepare_data",
    "export",
    "launch_files",
]

DESCRIPTION = """\
Cephalo trains Transformer models on heterogeneous GPU clusters: each GPU gets its own
batch size and its own (uneven) fraction of the sharded training state, and layered
gradient accumulation keeps memory independent of the batch size.

typical use:
  cephalo demo                                   # everything on an emulated CPU cluster
  cephalo catalog                                # known GPU types and models
  cephalo plan --cluster 2xl4,a6000,p40 --model gpt-2.7b --global-batch 64
  cephalo advise --offers configs/offers-example.toml --model gpt-2.7b --global-batch 256
  cephalo simulate plan.json                     # evaluate any plan with the cost model
  cephalo launch-files --plan plan.json --config my.toml   # SLURM / SkyPilot files for it
  cephalo run --devices cpu,cpu:slowdown=2 --config configs/demo.toml
  torchrun --nproc-per-node 4 -m cephalo doctor --config my.toml   # pre-flight, then:
  torchrun --nproc-per-node 4 -m cephalo train --config my.toml
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cephalo",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also show third-party warnings on import (torchao, torch), once per process",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"cephalo.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"cephalo.commands.{name}":
                continue  # command not built yet
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.verbose:  # the workers of `cephalo run` inherit it
        os.environ[envvars.VERBOSE] = "1"
    if not getattr(args, "func", None):
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        parser.print_help()
        return 0
    try:
        if extra:
            args.extra_overrides = _config_overrides(args, extra, parser)
        rc = args.func(args)
    except CephaloError as e:
        print(f"cephalo {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"cephalo {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


def _config_overrides(
    args: argparse.Namespace, extra: list[str], parser: argparse.ArgumentParser
) -> list[str]:
    """Arguments argparse did not know: for commands that take a config they are checked as
    `--section.key=value` overrides (unknown keys get a did-you-mean message); elsewhere they
    are an error."""
    if not hasattr(args, "config"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from cephalo.train.config_manager import parse_overrides

    parse_overrides(extra)  # raises CephaloError naming the bad key
    return extra


if __name__ == "__main__":
    sys.exit(main())
