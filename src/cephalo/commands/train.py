"""`cephalo train`: run a training job on this process's rank (start it with torchrun or `cephalo run`)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

from cephalo import envvars
from cephalo.errors import CephaloError
from cephalo.runtime.collectives.dist import announce_failure, peer_failure, shutdown
from cephalo.train.config_manager import add_config_arguments, config_from_args

EPILOG = """\
examples:
  cephalo train --config configs/demo.toml --parallel.plan=even        # one process
  torchrun --nproc-per-node 4 -m cephalo train --config configs/gpt-small.toml
  torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
      -m cephalo train --config configs/gpt-small.toml
  cephalo run --devices cpu,cpu:slowdown=2 --config configs/demo.toml   # emulated devices

Every config key is also an option (--section.key=value); docs/config.md lists them and
docs/training.md explains the run directory, metrics, checkpoints and resuming.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train on this rank (under torchrun, or one process)",
        description=__doc__.split(":", 1)[1].strip(),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(p)
    p.set_defaults(func=run)


def report_failure(message: str) -> None:
    """Leave this rank's error where `cephalo run` looks for it (no-op outside the launcher)."""
    where = os.environ.get(envvars.ERROR_DIR)
    if not where:
        return
    rank = os.environ.get("RANK", "0")
    # which restart of the job this is: the launcher reads the last attempt's reports only
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    # the timestamp orders failures: the first one is usually the cause, the rest follow from
    # it; if the file cannot be written the launcher falls back to exit codes
    with contextlib.suppress(OSError, ValueError):
        name = f"attempt{int(attempt):03d}-rank{int(rank):05d}.txt"
        Path(where, name).write_text(f"{time.time():.6f}\n{message}\n")


def report_stop(note: str, resume: str) -> None:
    """A job stopped by a signal (rank 0): under `cephalo run` the note goes where the launcher
    reads it (it prints the one line); alone, this process prints it."""
    from cephalo.launch.elastic import STOP_NOTE
    from cephalo.launch.preempt import stop_line

    where = os.environ.get(envvars.ERROR_DIR)
    if where:
        with contextlib.suppress(OSError):
            Path(where, STOP_NOTE).write_text(note + "\n")
            return
    print(stop_line(note, resume), file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from cephalo.train.trainer import train  # torch import deferred: `cephalo --help` stays fast

    failed = False
    try:
        cfg = config_from_args(args)
        result = train(cfg)
        if result.stop_note is not None and result.rank == 0:
            report_stop(result.stop_note, cfg.checkpoint.resume)
    except Exception as err:
        failed = True
        error: BaseException = err
        peer = peer_failure()
        if peer is not None:  # stopped because another rank failed: say so, not what broke here
            error = CephaloError(f"stopped because {peer}")
        if isinstance(error, CephaloError):
            message = str(error)
        else:
            message = f"{type(error).__name__}: {error}"
        if not getattr(error, "consequence", False):  # only the cause, not its echoes
            announce_failure(message)
        report_failure(message)
        if peer is not None and os.environ.get(envvars.ERROR_DIR):
            # the launcher prints the cause once; this rank's process group and store died
            # with the failing rank, and tearing them down prints native stack dumps
            # (TCPStore ... Broken pipe, frame #0 ...): leave without the teardown
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(2)
        if isinstance(error, CephaloError):
            if os.environ.get(envvars.ERROR_DIR):
                return 2  # the launcher prints the first failure once, for the whole job
            if error is err:
                raise
            raise error from None
        raise
    finally:
        shutdown(failed)
    return 0
