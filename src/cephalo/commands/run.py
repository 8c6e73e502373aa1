"""`cephalo run`: train on an emulated cluster on this machine: one process per device."""

from __future__ import annotations

import argparse
import sys

from cephalo.train.config_manager import add_config_arguments, config_from_args, overrides_from_args

EPILOG = """\
examples:
  cephalo run --devices cpu,cpu:slowdown=2,cpu:slowdown=4,mem=2GiB --config configs/demo.toml
  cephalo run --config configs/demo.toml --parallel.plan=even     # devices from the config
  cephalo run --nproc 3 --config my.toml                          # three plain CPU ranks

A device is `cpu` with options `slowdown=F` (compute F times slower) and `mem=SIZE` (the
rank's memory budget); see `cephalo catalog` for the spec grammar. On real GPUs use torchrun
(`cephalo train --help`).
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="train on emulated devices on this machine (local launcher)",
        description=__doc__.split(":", 1)[1].strip(),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--devices",
        metavar="SPEC",
        default=None,
        help="one device per rank, e.g. cpu,cpu:slowdown=2 (default: the config's parallel.devices)",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="ranks to start when no devices are given (default 1)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        metavar="N",
        help="restart the workers up to N times after a failure (default: the config's "
        "parallel.max_restarts, 0)",
    )
    add_config_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cephalo.launch.elastic import run_elastic
    from cephalo.launch.preempt import stop_line
    from cephalo.log import init_logging
    from cephalo.train.config import preflight

    init_logging()
    cfg = config_from_args(args)  # a bad config fails here, once, not in every worker
    from cephalo.modeling.registry import initial_weights_note

    # adapters on a weightless directory: refused here, once (rank 0 warns of a random init)
    initial_weights_note(cfg.model.name, cfg.model.init, cfg.model.adapter)
    preflight(cfg)  # so do missing packages and data files, before any worker starts
    devices = args.devices or cfg.parallel.devices
    worker_args = (["--config", args.config] if args.config else []) + overrides_from_args(args)
    max_restarts = cfg.parallel.max_restarts if args.max_restarts is None else args.max_restarts
    note = run_elastic(
        worker_args,
        devices=devices,
        nproc=args.nproc,
        max_restarts=max_restarts,
        stop_signals=cfg.checkpoint.save_on_signals,
    )
    if note is not None:  # a signal stopped the job: where it saved, how to resume
        print(stop_line(note, cfg.checkpoint.resume), file=sys.stderr, flush=True)
    return 0
