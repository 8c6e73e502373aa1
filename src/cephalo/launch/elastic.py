"""A local launcher for emulated clusters: one `cephalo train` process per device.

`launch(LocalJob(...))` starts the workers with torch's elastic launch API (what torchrun
uses): a c10d rendezvous on 127.0.0.1 at a free port, `nproc` = number of devices, each
worker running `python -m cephalo train <config> <overrides> --parallel.devices=<spec>`, so
rank i emulates device i. Workers are whole processes (not forked functions): the job runs
exactly as it would under torchrun.

Failures: each failing worker writes its one-line error into a directory the launcher gives
it (`CEPHALO_ERROR_DIR`), tagged with the restart it belongs to; the launcher raises ONE
`CephaloError` with the first failure (by time) of the last attempt instead of every rank's
traceback. A worker killed by a signal, which writes
nothing, is reported by its exit signal.

Signals (`LocalJob.stop_signals`: the job's `checkpoint.save_on_signals`): the launcher
handles them itself, not torch elastic (which would raise `SignalException` and SIGKILL the
workers 30 s later): the first is forwarded once to every worker, which finish their step,
save and exit 0 (launch/preempt.py); rank 0 leaves its note (`STOP_NOTE`) and `launch`
returns it. A second signal SIGKILLs the workers and exits at once (128 + its number).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cephalo import envvars
from cephalo.envvars import scoped_environ
from cephalo.errors import CephaloError
from cephalo.launch.pool import threads_per_rank
from cephalo.log import logger
from cephalo.runtime.collectives.dist import SHARED_STORE_ENV
from cephalo.specs.cluster import Cluster


@dataclass
class LocalJob:
    """What to launch on this machine."""

    nproc: int
    """Worker processes (ranks)."""
    worker_args: list[str]
    """Arguments after `python -m cephalo train` (config and overrides)."""
    devices: str | None = None
    """Cluster spec passed to every worker as `--parallel.devices` (one device per rank)."""
    max_restarts: int = 0
    """Restarts of the whole worker group after a failure (elastic agent)."""
    threads_per_worker: int | None = None
    """OMP/MKL threads per worker; None: the cores divided among the workers (at least 1)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the workers."""
    rdzv_timeout_s: int = 120
    """How long the workers may take to meet at the rendezvous."""
    command: str = "train"
    """The `cephalo` subcommand each worker runs (`train`, or `doctor`: the pre-flight)."""
    stop_signals: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGUSR1")
    """Signals forwarded to the workers, which then save and stop (`checkpoint.save_on_signals`)."""


STOP_NOTE = "stopped.txt"
"""The file (in the launcher's error directory) where rank 0 of a job stopped by a signal
says where it saved."""


def _children() -> list[int]:
    """This process's child processes (the workers), from /proc (Linux; [] elsewhere)."""
    me, found = os.getpid(), []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == me:
                found.append(int(entry.name))
    return found


class SignalForwarder:
    """The launcher's handlers of the stop signals (main thread): the first signal goes to
    every worker once (also to workers that start later: a thread checks while it is set), a
    second one SIGKILLs them and exits."""

    def __init__(self, names: Sequence[str]):
        self.numbers = [int(getattr(signal, n)) for n in names if hasattr(signal, n)]
        self.received: int | None = None
        self._sent: set[int] = set()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._previous: dict[int, object] = {}

    def _forward(self) -> None:
        if self.received is None:
            return
        with self._lock:
            for pid in _children():
                if pid not in self._sent:
                    self._sent.add(pid)
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, self.received)

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            for pid in _children():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            sys.stderr.write(f"cephalo run: second {name}: stopped the workers without saving\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        self.received = signum
        self._forward()

    def _watch(self) -> None:
        while not self._done.wait(0.2):
            self._forward()

    def __enter__(self) -> SignalForwarder:
        if threading.current_thread() is threading.main_thread():
            for number in self.numbers:
                self._previous[number] = signal.signal(number, self._handle)
            threading.Thread(target=self._watch, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        for number, handler in self._previous.items():
            signal.signal(number, handler)  # type: ignore[arg-type]

    def note(self, error_dir: Path) -> str | None:
        """What the stopped job said (rank 0's note), None if no signal came."""
        if self.received is None:
            return None
        name = signal.Signals(self.received).name
        try:
            return (error_dir / STOP_NOTE).read_text().strip()
        except OSError:
            return f"stopped by {name}: the job ended without saving"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the rendezvous store binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def nproc_for(devices: str | None, nproc: int | None) -> int:
    """Processes to start: one per device of `devices`, or `nproc`; both given must agree."""
    if devices:
        count = Cluster.parse(devices).world_size
        if nproc is not None and nproc != count:
            raise CephaloError(
                f"--nproc {nproc} but --devices lists {count} device(s): give one or make them agree"
            )
        return count
    if nproc is None:
        return 1
    if nproc < 1:
        raise CephaloError(f"--nproc must be >= 1, got {nproc}")
    return nproc


def first_failure(error_dir: Path, failures: dict[int, object] | None = None) -> str:
    """One message for a failed job: the earliest error a worker reported in the job's last
    attempt (restarts run again in the same directory), else the exit code or signal of the
    failed ranks."""
    by_attempt: dict[int, list[tuple[float, int, str]]] = {}
    for path in error_dir.glob("attempt*-rank*.txt"):
        attempt, _, rank = path.stem.partition("-")
        stamp, _, message = path.read_text().partition("\n")
        with contextlib.suppress(ValueError):
            report = (float(stamp), int(rank.removeprefix("rank")), message.strip())
            by_attempt.setdefault(int(attempt.removeprefix("attempt")), []).append(report)
    reports = by_attempt[max(by_attempt)] if by_attempt else []
    failures = failures or {}
    # A rank killed by a signal writes nothing and is the cause; SIGTERM is how the agent
    # stops the other ranks after a failure, so those are consequences.
    killed = {
        r: f
        for r, f in failures.items()
        if getattr(f, "exitcode", 0) < 0 and -f.exitcode not in (signal.SIGTERM, signal.SIGINT)
    }
    if killed:
        rank = min(killed)
        name = killed[rank].signal_name()
        return f"rank {rank} was killed by signal {name}; the other ranks were stopped"
    if reports:
        reports.sort()
        _, rank, message = reports[0]
        more = len({r for _, r, _ in reports}) - 1
        tail = f" ({more} other rank(s) failed after it)" if more > 0 else ""
        return (
            f"{message}{tail}" if message.startswith("rank ") else f"rank {rank}: {message}{tail}"
        )
    if failures:
        rank = min(failures)
        code = getattr(failures[rank], "exitcode", "?")
        return f"rank {rank} exited with code {code} (no error message; see its output above)"
    return "the workers failed without an error message (see their output above)"


def launch(job: LocalJob) -> str | None:
    """Run the job's workers to completion; raise `CephaloError` (the first failure) if any
    fails. Returns None, or the stopped job's note where a stop signal came (see above)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if job.max_restarts < 0:
        raise CephaloError(f"max_restarts must be >= 0, got {job.max_restarts}")
    args: list[str] = ["-m", "cephalo", job.command, *job.worker_args]
    if job.devices:
        args.append(f"--parallel.devices={job.devices}")
    threads = str(job.threads_per_worker or threads_per_rank(job.nproc))
    port = free_port()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=job.nproc,
        run_id=f"cephalo-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_configs={"timeout": job.rdzv_timeout_s},
        max_restarts=job.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        # elastic's own handlers (SignalException) only for the signals we do not forward
        signals_to_handle=",".join(
            s for s in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if s not in job.stop_signals
        ),
    )
    # The elastic agent logs every worker failure with a full table at ERROR level; the one
    # message below says the same thing once.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="cephalo-errors-") as error_dir:
        # SHARED_STORE_ENV=1: the agent (in this process) gives each restart its own rendezvous
        # store; on torch's shared one a restarted group cannot connect (pytorch#135712).
        env = {
            "OMP_NUM_THREADS": threads,
            "MKL_NUM_THREADS": threads,
            envvars.ERROR_DIR: error_dir,
            SHARED_STORE_ENV: "1",
            # a failing rank's peers lose the store it hosted: torch's C++ warnings about it
            # come with native stack frames; the launcher says what failed in one line
            # (set either variable yourself to see them)
            "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
            "TORCH_SHOW_CPP_STACKTRACES": os.environ.get("TORCH_SHOW_CPP_STACKTRACES", "0"),
            **job.env,
        }
        logger.info(
            "launching %d worker(s) (%s threads each)%s",
            job.nproc,
            threads,
            f" on devices {job.devices}" if job.devices else "",
        )
        forwarder = SignalForwarder(job.stop_signals)
        try:
            with scoped_environ(env), forwarder:
                elastic_launch(config, sys.executable)(*args)
            return forwarder.note(Path(error_dir))
        except ChildFailedError as e:
            logger.debug(
                "worker failures: %s",
                {r: (f.exitcode, f.signal_name()) for r, f in e.failures.items()},
            )
            raise CephaloError(first_failure(Path(error_dir), dict(e.failures))) from None


def run_elastic(
    worker_args: Sequence[str],
    devices: str | None = None,
    nproc: int | None = None,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
    command: str = "train",
    stop_signals: Sequence[str] = ("SIGTERM", "SIGINT", "SIGUSR1"),
) -> str | None:
    """`cephalo run` as a function: launch `cephalo <command> <worker_args>` on `devices`; the
    note of a job a signal stopped (else None)."""
    return launch(
        LocalJob(
            nproc=nproc_for(devices, nproc),
            worker_args=list(worker_args),
            devices=devices,
            max_restarts=max_restarts,
            env=dict(env or {}),
            command=command,
            stop_signals=tuple(stop_signals),
        )
    )
