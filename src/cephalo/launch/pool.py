"""Local gloo ranks started once, running functions on request: one pool for `cephalo
profile`'s local launch, the benchmarks and the multi-process tests.

    with RankPool(3, timeout_s=120) as pool:
        per_rank = pool.run(fn, arg)          # fn(arg) on every rank, results in rank order

The parent owns the rendezvous store (a `TCPStore` on a port the OS picks, so there is no
free-port race) and spawns one process per rank; each initialises a gloo process group with
the pool's timeout and then runs the functions it is sent (top-level, picklable), returning
each result or the exception's traceback through a queue. A function may report progress
lines with `progress(text)` (inside a call, on any rank); `run(..., on_progress=...)` receives
them in the parent.

Failures never hang the parent: a rank that raises makes `run` raise `RankFailure` naming the
ranks and their errors; a rank that dies, or a call that outlives its timeout (a hung
collective), too, after which the pool stops its workers and starts fresh ones on the next
`run`. When every rank answered (some with errors), the workers are still in step and stay.
Nor do they outlive the parent: a worker whose parent dies (SIGKILL, a crash: no `close`)
exits within `PARENT_CHECK_S`, busy in a call or idle (`_exit_with_parent`).

Threads: each rank runs `threads` intra-op threads (default 1; `OMP_NUM_THREADS` too), so N
ranks on a small machine do not oversubscribe its cores; `nice` sets the ranks' scheduling
priority (the benchmarks run ahead of other jobs where allowed).
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cephalo.envvars import scoped_environ
from cephalo.errors import CephaloError
from cephalo.log import logger

_STOP = "__stop__"
_GRACE_S = 2.0
"""After one rank fails, how long the others get to answer before the pool gives up on them
(they may be waiting for the failed rank in a collective)."""
PARENT_CHECK_S = 1.0
"""How often a worker also checks that its parent still runs (see `_exit_with_parent`)."""
ORPHANED_EXIT_CODE = 3
"""Exit status of a worker that ended because its parent died."""
_sink: tuple[Any, int, int] | None = None
"""In a worker during a call: (results queue, rank, call id), for `progress`."""


class RankFailure(CephaloError):
    """A function failed on one or more ranks (raised, died, or did not finish in time)."""

    def __init__(self, message: str, errors: dict[int, str] | None = None):
        super().__init__(message)
        self.errors = dict(errors or {})
        """Per failed rank: its error (a `CephaloError`'s message, else the traceback)."""


def threads_per_rank(world_size: int) -> int:
    """Intra-op threads per local rank: the machine's cores shared evenly, at least one
    (N ranks x T threads beyond the cores spin OpenMP threads against each other and every
    rank slows down)."""
    return max(1, (os.cpu_count() or 1) // world_size)


def progress(text: str) -> None:
    """Send a progress line to the parent's `on_progress` (no-op outside a pool call)."""
    if _sink is not None:
        results, rank, call_id = _sink
        results.put((call_id, rank, "progress", text))


def _exit_with_parent(rank: int) -> None:
    """In a worker: end this process as soon as the parent is gone, instead of waiting
    forever for tasks (or in a collective) that no one will send.

    A daemon thread waits on multiprocessing's parent sentinel (the read end of the pipe the
    parent spawned us through: it becomes readable when the parent dies, on every platform
    and start method), every `PARENT_CHECK_S` also comparing `os.getppid()` with the parent
    it started under (the pipe stays open if the parent forked a child that outlives it). It
    does not need the main thread: a worker busy in a call or blocked in a queue ends alike.
    No `PR_SET_PDEATHSIG`: Linux-only, and it fires when the parent's spawning THREAD ends."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    sentinel, parent_pid = parent.sentinel, os.getppid()

    def watch() -> None:
        while not multiprocessing.connection.wait([sentinel], timeout=PARENT_CHECK_S):
            if os.getppid() != parent_pid:
                break
        with contextlib.suppress(Exception):  # stderr may have gone with the parent
            logger.warning("pool rank %d: the parent process died; exiting", rank)
        os._exit(ORPHANED_EXIT_CODE)

    threading.Thread(target=watch, name="cephalo-pool-parent-watch", daemon=True).start()


def _worker_main(
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    threads: int,
    nice: int | None,
    tasks: Any,
    results: Any,
) -> None:
    global _sink
    _exit_with_parent(rank)
    torch.set_num_threads(threads)
    if nice is not None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, nice)
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=timeout)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        results.put(("ready", rank, "done", b""))
    except BaseException:  # noqa: BLE001 - report any start-up failure to the parent
        results.put(("ready", rank, "error", ("", traceback.format_exc())))
        return
    while True:
        task = tasks.get()
        if task == _STOP:
            break
        call_id, payload = task
        _sink = (results, rank, call_id)
        try:
            fn, args, kwargs = pickle.loads(payload)
            results.put((call_id, rank, "done", pickle.dumps(fn(*args, **kwargs))))
        except BaseException as e:  # noqa: BLE001 - the parent raises with this text
            clean = str(e) if isinstance(e, CephaloError) else ""
            results.put((call_id, rank, "error", (clean, traceback.format_exc())))
        finally:
            _sink = None
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    # Every result is on its way (flushed below): end without Python's module teardown, which
    # with torch loaded takes seconds on a busy machine, all of them waited for in `close`.
    results.close()
    results.join_thread()
    os._exit(0)


class RankPool:
    """`world_size` local gloo ranks, started on first use, running functions on request."""

    def __init__(
        self,
        world_size: int,
        timeout_s: float = 120.0,
        threads: int = 1,
        nice: int | None = None,
        start_timeout_s: float = 120.0,
    ):
        if world_size < 1:
            raise CephaloError(f"world size must be >= 1, got {world_size}")
        self.world_size = world_size
        """Number of ranks."""
        self.timeout_s = timeout_s
        """Default per-call timeout, and the process group's collective timeout."""
        self.threads = threads
        """torch intra-op threads per rank."""
        self.nice = nice
        """Scheduling niceness of the ranks (None: inherited)."""
        self.start_timeout_s = start_timeout_s
        """How long start-up (spawn + rendezvous) may take."""
        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self._store: dist.TCPStore | None = None
        self._next_call = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> RankPool:
        if self._procs:
            return self
        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            self.world_size + 1,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=max(self.timeout_s, self.start_timeout_s)),
        )
        self._results = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(self.world_size)]
        threads = {"OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)}
        with scoped_environ(threads):  # children inherit the environment at spawn
            for rank in range(self.world_size):
                proc = self._ctx.Process(
                    target=_worker_main,
                    daemon=True,
                    args=(
                        rank,
                        self.world_size,
                        self._store.port,
                        self.timeout_s,
                        self.threads,
                        self.nice,
                        self._tasks[rank],
                        self._results,
                    ),
                )
                proc.start()
                self._procs.append(proc)
        self._collect("ready", "start-up", self.start_timeout_s, None)
        return self

    def close(self, stuck: Sequence[int] = ()) -> None:
        """Stop the workers (politely, then by force); the ranks in `stuck` (still inside a
        call that will not finish: waiting in a collective for a failed rank) at once."""
        for rank in stuck:
            if self._procs[rank].is_alive():
                self._procs[rank].kill()
        for q in self._tasks:
            with contextlib.suppress(OSError, ValueError):
                q.put(_STOP)
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for q in [*self._tasks, self._results]:
            if q is not None:
                q.close()
                q.cancel_join_thread()
        self._procs, self._tasks, self._results, self._store = [], [], None, None

    def __enter__(self) -> RankPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------- calls
    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout_s: float | None = None,
        on_progress: Callable[[int, str], None] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """`fn(*args, **kwargs)` on every rank; the per-rank results in rank order. Raises
        `RankFailure` if it raised, died or hung anywhere."""
        self.start()
        call_id = self._next_call
        self._next_call += 1
        payload = pickle.dumps((fn, args, kwargs))
        for q in self._tasks:
            q.put((call_id, payload))
        what = getattr(fn, "__name__", "call")
        replies = self._collect(call_id, what, timeout_s or self.timeout_s, on_progress)
        return [pickle.loads(replies[r]) for r in range(self.world_size)]

    def _collect(
        self,
        call_id: object,
        what: str,
        timeout_s: float,
        on_progress: Callable[[int, str], None] | None,
    ) -> dict[int, bytes]:
        replies: dict[int, bytes] = {}
        errors: dict[int, tuple[str, str]] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) + len(errors) < self.world_size:
            try:
                got, rank, kind, data = self._results.get(timeout=0.2)
            except queue.Empty:
                answered = set(replies) | set(errors)
                dead = [
                    r for r, p in enumerate(self._procs) if not p.is_alive() and r not in answered
                ]
                if dead:
                    codes = {r: self._procs[r].exitcode for r in dead}
                    # the others are waiting for the dead in a collective, or soon will be
                    self.close(stuck=[r for r in range(self.world_size) if r not in answered])
                    raise RankFailure(
                        f"{what}: rank(s) {dead} died (exit codes {codes})"
                        + _describe(errors, " Before that: ")
                    ) from None
                if time.monotonic() > deadline:
                    missing = [r for r in range(self.world_size) if r not in answered]
                    self.close(stuck=missing)
                    if errors:  # the others were waiting for the failed rank
                        raise RankFailure(
                            _describe(errors, f"{what} failed: "), _clean(errors)
                        ) from None
                    raise RankFailure(
                        f"{what}: rank(s) {missing} did not finish within {timeout_s:.0f} s "
                        "(a hung collective?)"
                    ) from None
                continue
            if got != call_id:
                continue
            if kind == "progress":
                if on_progress is not None:
                    on_progress(rank, data)
            elif kind == "done":
                replies[rank] = data
            else:
                if not errors:
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
                errors[rank] = data
        if errors:
            raise RankFailure(_describe(errors, f"{what} failed: "), _clean(errors))
        return replies


def _clean(errors: dict[int, tuple[str, str]]) -> dict[int, str]:
    return {r: clean or text for r, (clean, text) in errors.items()}


def _describe(errors: dict[int, tuple[str, str]], prefix: str) -> str:
    if not errors:
        return ""
    parts = [f"{prefix}rank(s) {sorted(errors)}"]
    for rank in sorted(errors):
        parts.append(f"--- rank {rank} ---\n{errors[rank][1]}")
    return "\n".join(parts)
