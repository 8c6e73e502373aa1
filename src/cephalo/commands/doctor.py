"""`cephalo doctor`: check a cluster before a long job, under the same launch as the job."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from cephalo import envvars
from cephalo.train.config_manager import add_config_arguments, config_from_args, overrides_from_args

EPILOG = """\
Run it under the exact launch of the job, before the job:
  torchrun --nproc-per-node 4 -m cephalo doctor --config job.toml
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
      -m cephalo doctor --config job.toml --plan plan.json
On an emulated cluster on this machine (one process per device, as `cephalo run`):
  cephalo doctor --devices cpu,cpu:slowdown=2,mem=64MiB --plan plan.json

Every rank checks, rank 0 prints one row per check (ok / FAIL / warn, what was found, the fix):
  ranks          each rank's node and device (type, memory), one job on every rank
  plan           the plan file (--plan, or parallel.plan) matched to the devices that came up
  device memory  free device memory vs the plan's predicted peak per rank
  host memory    each node's MemAvailable vs what the plan puts on its host
  checkpoints    every rank writes a probe into the checkpoint directory and sees the others'
  NCCL           NCCL_SOCKET_IFNAME, NCCL_IB_DISABLE, NCCL_P2P_DISABLE, NCCL_DEBUG
  collectives    uneven all-gather / reduce-scatter / all-reduce values, all-gather rate
Exit code 0 when no row fails (warnings pass), 1 otherwise; 2 when the ranks cannot start.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check the cluster before a job (run it under the job's launch)",
        description=__doc__.split(":", 1)[1].strip(),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--plan",
        metavar="PLAN.json",
        default=None,
        help="the plan file the job will run (default: parallel.plan where it is a file)",
    )
    p.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        default=None,
        help="the directory to probe (default: checkpoint.dir, else <logging.dir>/checkpoints)",
    )
    p.add_argument(
        "--devices",
        metavar="SPEC",
        default=None,
        help="emulated devices, one process each on this machine (as `cephalo run --devices`)",
    )
    p.add_argument(
        "--nproc", type=int, default=None, metavar="N", help="local ranks when no devices are given"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds a collective may take before its row fails (default 30)",
    )
    add_config_arguments(p)
    p.set_defaults(func=run)


def _worker_args(args: argparse.Namespace) -> list[str]:
    out = ["--config", args.config] if args.config else []
    if args.plan:
        out += ["--plan", str(Path(args.plan).resolve())]
    if args.checkpoint_dir:
        out += ["--checkpoint-dir", str(Path(args.checkpoint_dir).resolve())]
    return [*out, "--timeout", str(args.timeout), *overrides_from_args(args)]


def launch_local(args: argparse.Namespace) -> int:
    """One `cephalo doctor` process per device on this machine; rank 0 leaves the verdict."""
    from cephalo.launch.elastic import run_elastic
    from cephalo.log import init_logging

    init_logging()
    cfg = config_from_args(args)
    devices = args.devices or cfg.parallel.devices
    with tempfile.TemporaryDirectory(prefix="cephalo-doctor-") as where:
        verdict = Path(where, "verdict")
        run_elastic(
            _worker_args(args),
            devices=devices,
            nproc=args.nproc,
            env={envvars.DOCTOR_VERDICT: str(verdict)},
            command="doctor",
        )
        return int(verdict.read_text().strip()) if verdict.exists() else 1


def run(args: argparse.Namespace) -> int:
    if "RANK" not in os.environ and (args.devices or args.nproc):
        return launch_local(args)
    from cephalo.commands.train import report_failure
    from cephalo.errors import CephaloError
    from cephalo.log import init_logging
    from cephalo.runtime.collectives.dist import init_distributed, shutdown
    from cephalo.train.doctor import DoctorOptions, passed, run_doctor
    from cephalo.views.tables import doctor_table

    init_logging()
    failed = False
    try:
        cfg = config_from_args(args)
        cfg.validate()
        backend = None if cfg.parallel.backend == "auto" else cfg.parallel.backend
        comm = init_distributed(backend, timeout_s=args.timeout)
        options = DoctorOptions(plan=args.plan, checkpoint_dir=args.checkpoint_dir)
        checks = run_doctor(cfg, comm, options)
    except Exception as err:
        failed = True
        report_failure(
            str(err) if isinstance(err, CephaloError) else f"{type(err).__name__}: {err}"
        )
        if isinstance(err, CephaloError) and os.environ.get(envvars.ERROR_DIR):
            return 2  # the launcher prints the first failure once
        raise
    finally:
        shutdown(failed)
    ok = passed(checks)
    if comm.rank == 0:
        from rich.console import Console

        title = f"cephalo doctor: {comm.world_size} rank(s), {'ok' if ok else 'FAILED'}"
        Console(width=80).print(doctor_table(checks, title))
        verdict = os.environ.get(envvars.DOCTOR_VERDICT)
        if verdict:
            Path(verdict).write_text("0\n" if ok else "1\n")
    if os.environ.get(envvars.DOCTOR_VERDICT):
        return 0  # the local launcher reads the verdict; a failed worker would be an error
    return 0 if ok else 1
