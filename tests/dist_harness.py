"""Run test bodies on N gloo processes started once per test session.

    from dist_harness import dist_pool_fixture
    pool3 = dist_pool_fixture(3)                    # module-scoped pytest fixture

    def _body(comm_impl):                           # top-level, picklable; runs on every rank
        import torch.distributed as dist
        return dist.get_rank()

    @pytest.mark.slow
    def test_x(pool3):
        assert pool3.run(_body, "gloo") == [0, 1, 2]

The pool is the package's own `cephalo.launch.pool.RankPool` (the profiler's local launch and
the benchmarks use it too): gloo workers with a collective timeout, results pickled back, a
raising, dying or hung rank reported as `RankFailure` with the ranks' tracebacks (a hung or
dead pool restarts on the next `run`, so one broken test does not break the rest of the
module). Workers run one intra-op thread each: N processes on a 2-core machine would
otherwise oversubscribe the CPUs badly.

One pool per world size serves every module of the session (`shared_pool`): starting N
processes (spawn, torch import, gloo rendezvous) and stopping them costs several seconds of a
2-core machine, once per module it was paid ~20 times per suite. Each module still gets its
own default call timeout (`ModulePool`), and each module starts from a worker state like a
fresh process's where bodies can change it (`_fresh_state`: torch's default RNG, dtype,
grad mode, determinism, threads, the environment). The pool's collective timeout is
`SHARED_COLLECTIVE_TIMEOUT_S`; a hung call is still caught by the call timeout in the parent,
which stops the workers (the next call starts fresh ones).
"""

from __future__ import annotations

from typing import Any

import pytest

import compiled_suites
from cephalo.launch.pool import RankFailure, RankPool

RemoteError = RankFailure
"""What a failing body raises in the test (the ranks' tracebacks in its message)."""
__all__ = ["ModulePool", "RankPool", "RemoteError", "dist_pool_fixture", "shared_pool"]

SHARED_COLLECTIVE_TIMEOUT_S = 600.0
"""The shared pools' process-group timeout: the longest call timeout any module asks for (a
collective that hangs longer than a module's call timeout is ended by the parent, not gloo)."""
_POOLS: dict[int, RankPool] = {}
_FRESH_ENV: dict[int, dict[str, str]] = {}
"""Per world size: the workers' environment when they started (what `_fresh_state` restores)."""
_TORCH_DEFAULT_SEED = 67280421310721
"""torch's default CPU generator seed in a new process (`torch.initial_seed()`)."""


def _environment() -> dict[str, str]:
    import os

    return dict(os.environ)


def _fresh_state(environment: dict[str, str], threads: int) -> None:
    """On every rank: undo what a body of an earlier module may have left behind that a
    fresh worker would not have (so the module sees what it saw with a pool of its own)."""
    import os

    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(environment)
    torch.manual_seed(_TORCH_DEFAULT_SEED)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.use_deterministic_algorithms(False)
    torch.set_num_threads(threads)
    compiled_suites.install()  # CEPHALO_TEST_COMPILE: blocks compiled (tests/compiled_suites.py)
    dist.barrier()  # every rank is back in step


def shared_pool(world_size: int) -> RankPool:
    """The session's started pool of `world_size` ranks (started on first use)."""
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = RankPool(world_size, timeout_s=SHARED_COLLECTIVE_TIMEOUT_S)
    pool.start()  # a no-op unless it is new or a failure stopped its workers
    return pool


def close_shared_pools() -> None:
    """Stop every shared pool's workers (end of the session)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()


class ModulePool:
    """A module's view of a shared pool: `run` with the module's default call timeout."""

    def __init__(self, pool: RankPool, timeout_s: float):
        self.pool = pool
        self.timeout_s = timeout_s
        """Default per-call timeout of this module's calls."""
        self.world_size = pool.world_size

    def run(self, fn: Any, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list:
        """`RankPool.run` with this module's default timeout."""
        return self.pool.run(fn, *args, timeout_s=timeout_s or self.timeout_s, **kwargs)


def dist_pool_fixture(world_size: int, timeout_s: float = 120.0, scope: str = "module"):
    """A pytest fixture (assign it to a module-level name) yielding the shared pool of
    `world_size` ranks, reset to a fresh worker's state, with `timeout_s` per call."""

    @pytest.fixture(scope=scope)
    def _pool():
        pool = shared_pool(world_size)
        if world_size not in _FRESH_ENV:
            _FRESH_ENV[world_size] = pool.run(_environment)[0]
        timeout = compiled_suites.timeout(timeout_s)
        pool.run(_fresh_state, _FRESH_ENV[world_size], pool.threads, timeout_s=timeout)
        yield ModulePool(pool, timeout)

    return _pool
