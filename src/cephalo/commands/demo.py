"""`cephalo demo`: profile, plan and train on four emulated devices of this CPU, then write a report."""

from __future__ import annotations

import argparse
from pathlib import Path

from cephalo.errors import CephaloError

EPILOG = """\
what it does (about 3 minutes on 2 cores; profiles are cached, so a rerun is faster):
  1. profiles four emulated devices: cpu, cpu:slowdown=1.5, cpu:slowdown=3 and
     cpu:slowdown=3 with a 32 MiB memory budget (too little for an even share)
  2. plans the job (cephalo vs even vs proportional, predicted samples/s)
  3. runs the even plan for a few steps to measure its throughput (and this machine's speed)
  4. trains a small GPT on the bundled corpus under the cephalo plan for the time budget
     (elastic launch of 4 `cephalo train` workers, rank 0 shows a progress bar)
  5. re-plans while training: the job under its own plan, rank 0 throttled 4x from step 9;
     calibration sees it, the next calibration confirms, every rank switches (no restart)
  6. writes runs/demo/report.md with loss, per-rank busy/idle, throughput and re-plan plots

examples:
  cephalo demo
  cephalo demo --minutes 3 --out runs/demo-long
  cephalo demo --quick --out /tmp/demo         # tiny model, a few steps: a smoke test
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="profile, plan and train on an emulated 4-device CPU cluster; write a report",
        description=__doc__.split(":", 1)[1].strip(),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        default="runs/demo",
        help="report and run directory (default runs/demo)",
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=None,
        metavar="M",
        help="training budget of the cephalo run in minutes (default 1.25)",
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny model and a few steps (a smoke test, < 1 minute)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cephalo.demo.pipeline import run_demo
    from cephalo.demo.result import DemoOptions
    from cephalo.log import init_logging

    init_logging()
    options = DemoOptions(out=Path(args.out), quick=args.quick)
    if args.minutes is not None:
        if not 0 < args.minutes <= 600:
            raise CephaloError(f"--minutes must be in (0, 600], got {args.minutes}")
        options.minutes = args.minutes
    run_demo(options)
    return 0
