"""Run test bodies on N gloo processes started once per test module.

    from dist_harness import dist_pool_fixture
    pool3 = dist_pool_fixture(3)                    # module-scoped pytest fixture

    def _body(comm_impl):                           # top-level, picklable; runs on every rank
        import torch.distributed as dist
        return dist.get_rank()

    @pytest.mark.slow
    def test_x(pool3):
        assert pool3.run(_body, "gloo") == [0, 1, 2]

Workers initialise a gloo process group (rendezvous through a TCPStore the parent owns, so
there is no free-port race) with a timeout, run each submitted function on every rank and
send back the results (pickled by value) or the exception's traceback text. A call that
takes longer than its timeout (a hung collective) or a worker that dies fails the test with
a clear message; the pool then kills its workers and starts fresh ones on the next `run`,
so one broken test does not break the rest of the module.

Workers run with OMP_NUM_THREADS=1 and `torch.set_num_threads(1)`: N processes on a
2-core machine would otherwise oversubscribe the CPUs badly.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_STOP = "__stop__"


class RemoteError(AssertionError):
    """A function raised on one or more ranks; the message holds their tracebacks."""


def _worker_main(
    rank: int,
    world_size: int,
    store_port: int,
    timeout_s: float,
    tasks: Any,
    results: Any,
) -> None:
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", store_port, world_size + 1, is_master=False)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        results.put(("ready", rank, True, b""))
    except BaseException:  # noqa: BLE001 - report any start-up failure to the parent
        results.put(("ready", rank, False, traceback.format_exc().encode()))
        return
    while True:
        task = tasks.get()
        if task == _STOP:
            break
        call_id, payload = task
        try:
            fn, args, kwargs = pickle.loads(payload)
            value = fn(*args, **kwargs)
            results.put((call_id, rank, True, pickle.dumps(value)))
        except BaseException:  # noqa: BLE001 - the parent re-raises with this text
            results.put((call_id, rank, False, traceback.format_exc().encode()))
    dist.destroy_process_group()


class DistributedPool:
    """`world_size` gloo worker processes, started once, running functions on request."""

    def __init__(self, world_size: int, timeout_s: float = 120.0, start_timeout_s: float = 120.0):
        self.world_size = world_size
        """Number of ranks."""
        self.timeout_s = timeout_s
        """Default per-call timeout and the process group's collective timeout."""
        self.start_timeout_s = start_timeout_s
        """How long start-up (spawn + rendezvous) may take."""
        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self._store: dist.TCPStore | None = None
        self._next_call = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> DistributedPool:
        if self._procs:
            return self
        self._store = dist.TCPStore(
            "127.0.0.1", 0, self.world_size + 1, is_master=True, wait_for_workers=False
        )
        self._results = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(self.world_size)]
        saved_env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        os.environ["OMP_NUM_THREADS"] = "1"  # children inherit the env at spawn
        os.environ["MKL_NUM_THREADS"] = "1"
        try:
            for rank in range(self.world_size):
                proc = self._ctx.Process(
                    target=_worker_main,
                    args=(
                        rank,
                        self.world_size,
                        self._store.port,
                        self.timeout_s,
                        self._tasks[rank],
                        self._results,
                    ),
                    daemon=True,
                )
                proc.start()
                self._procs.append(proc)
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        replies = self._collect("ready", self.start_timeout_s, "start-up")
        failed = {r: text for r, (ok, text) in replies.items() if not ok}
        if failed:
            self.close()
            raise RemoteError(_format_failures("pool start-up", failed))
        return self

    def close(self) -> None:
        """Stop the workers (politely, then by force)."""
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

    def __enter__(self) -> DistributedPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------- calls
    def run(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; return the per-rank results in rank order.

        Raises `RemoteError` with the failing ranks' tracebacks, or `TimeoutError` if some
        rank does not finish within `timeout_s` (the pool restarts on the next call)."""
        self.start()
        call_id = self._next_call
        self._next_call += 1
        payload = pickle.dumps((fn, args, kwargs))
        for q in self._tasks:
            q.put((call_id, payload))
        try:
            replies = self._collect(
                call_id, timeout_s or self.timeout_s, getattr(fn, "__name__", "call")
            )
        except BaseException:
            self.close()  # hung or dead ranks: start afresh next time
            raise
        failed = {r: text for r, (ok, text) in replies.items() if not ok}
        if failed:
            raise RemoteError(_format_failures(getattr(fn, "__name__", "call"), failed))
        return [pickle.loads(replies[r][1]) for r in range(self.world_size)]

    def _collect(
        self, call_id: object, timeout_s: float, what: str
    ) -> dict[int, tuple[bool, bytes]]:
        replies: dict[int, tuple[bool, bytes]] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < self.world_size:
            try:
                got_id, rank, ok, data = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(self._procs) if not p.is_alive() and r not in replies
                ]
                if dead:
                    codes = {r: self._procs[r].exitcode for r in dead}
                    self.close()
                    raise RemoteError(
                        f"{what}: worker rank(s) {dead} died (exit codes {codes})"
                    ) from None
                if time.monotonic() > deadline:
                    missing = [r for r in range(self.world_size) if r not in replies]
                    done = _format_failures(what, {r: t for r, (o, t) in replies.items() if not o})
                    raise TimeoutError(
                        f"{what}: rank(s) {missing} did not finish within {timeout_s:.0f}s "
                        f"(a hung collective?). {done}"
                    ) from None
                continue
            if got_id == call_id:
                replies[rank] = (ok, data)
        return replies


def _format_failures(what: str, failed: dict[int, bytes]) -> str:
    if not failed:
        return ""
    parts = [f"{what} failed on rank(s) {sorted(failed)}"]
    for rank in sorted(failed):
        parts.append(f"--- rank {rank} ---\n{failed[rank].decode(errors='replace')}")
    return "\n".join(parts)


def dist_pool_fixture(world_size: int, timeout_s: float = 120.0, scope: str = "module"):
    """A pytest fixture (assign it to a module-level name) yielding a started pool."""

    @pytest.fixture(scope=scope)
    def _pool():
        pool = DistributedPool(world_size, timeout_s=timeout_s).start()
        try:
            yield pool
        finally:
            pool.close()

    return _pool
