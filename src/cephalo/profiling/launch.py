"""Run a function on N local gloo ranks (the CPU emulation's launcher for `cephalo profile`
and the benchmarks).

The parent owns the rendezvous store (a `TCPStore` on a free port it picks itself, so there
is no port race), spawns one process per rank, and collects each rank's return value or
traceback through a queue. Ranks may send progress lines (`progress(text)` inside the
function) that the parent hands to its `on_progress` callback (a rich progress bar in the
CLI). A rank that dies or a job that outlives `timeout_s` ends every rank and raises a
`CephaloError`; nothing is left running.

Threads: the cores are split evenly between the ranks (at least one each) through
OMP_NUM_THREADS and `torch.set_num_threads`, so N ranks do not oversubscribe the machine.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cephalo.errors import CephaloError
from cephalo.runtime.comm import make_comm


def threads_per_rank(world_size: int) -> int:
    """The cores this machine has, shared evenly, at least one per rank."""
    return max(1, (os.cpu_count() or 1) // world_size)


def _rank_main(fn, args, kwargs, rank, world_size, port, timeout_s, threads, results) -> None:
    torch.set_num_threads(threads)
    try:
        store = dist.TCPStore(
            "127.0.0.1",
            port,
            world_size + 1,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        comm = make_comm("auto")

        def progress(text: str) -> None:
            results.put(("progress", rank, text))

        value = fn(comm, *args, progress=progress, **kwargs)
        results.put(("done", rank, pickle.dumps(value)))
    except BaseException as e:  # noqa: BLE001 - every failure goes to the parent
        message = str(e) if isinstance(e, CephaloError) else traceback.format_exc()
        results.put(("error", rank, message))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 600.0,
    on_progress: Callable[[int, str], None] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """`fn(comm, *args, progress=..., **kwargs)` on `world_size` local gloo ranks; returns
    the per-rank results in rank order. `fn` must be importable (top level of a module)."""
    if world_size < 1:
        raise CephaloError(f"world size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size + 1,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    results = ctx.Queue()
    threads = threads_per_rank(world_size)
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_rank_main,
                daemon=True,
                args=(fn, args, kwargs, rank, world_size, store.port, timeout_s, threads, results),
            )
            p.start()
            procs.append(p)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    done: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(done) + len(errors) < world_size:
            try:
                kind, rank, payload = results.get(timeout=0.2)
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if not p.is_alive() and r not in done and r not in errors
                ]
                if dead and results.empty():
                    time.sleep(0.5)  # a last message may still be in flight
                    if results.empty():
                        raise CephaloError(
                            f"rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})"
                        ) from None
                if time.monotonic() > deadline:
                    raise CephaloError(
                        f"the local ranks did not finish within {timeout_s:.0f} s"
                    ) from None
                continue
            if kind == "progress":
                if on_progress:
                    on_progress(rank, payload)
            elif kind == "done":
                done[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                # the others would wait for this rank in a collective until the timeout
                break
        if errors:
            first = min(errors)
            raise CephaloError(f"rank {first} failed: {errors[first]}")
        return [done[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5.0 if not errors and len(done) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results.close()
        results.cancel_join_thread()
