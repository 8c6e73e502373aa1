"""Run a function on N local gloo ranks, once (the CPU emulation's launcher for `cephalo
profile`), on the package's rank pool (`cephalo.launch.pool`).

The function gets the job's `Comm` and a `progress(text)` callable whose lines reach the
parent's `on_progress` callback (a rich progress bar in the CLI). A rank that raises, dies or
outlives `timeout_s` ends every rank and raises one `CephaloError`; nothing is left running.

Threads: the cores are split evenly between the ranks (at least one each) through
OMP_NUM_THREADS and `torch.set_num_threads`, so N ranks do not oversubscribe the machine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cephalo.errors import CephaloError
from cephalo.launch.pool import RankFailure, RankPool, progress, threads_per_rank
from cephalo.runtime.collectives.comm import make_comm


def _with_comm(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """On a rank: `fn(comm, *args, progress=..., **kwargs)` with this job's `Comm`."""
    return fn(make_comm("auto"), *args, progress=progress, **kwargs)


def run_ranks(
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
    with RankPool(world_size, timeout_s=timeout_s, threads=threads_per_rank(world_size)) as pool:
        try:
            return pool.run(_with_comm, fn, args, kwargs, on_progress=on_progress)
        except RankFailure as e:
            if not e.errors:  # died or hung: the pool's message says which ranks
                raise CephaloError(str(e)) from None
            first = min(e.errors)
            raise CephaloError(f"rank {first} failed: {e.errors[first]}") from None
