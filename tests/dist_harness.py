"""Run test bodies on N gloo processes started once per test module.

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
"""

from __future__ import annotations

import pytest

from cephalo.launch.pool import RankFailure, RankPool

RemoteError = RankFailure
"""What a failing body raises in the test (the ranks' tracebacks in its message)."""
__all__ = ["RankPool", "RemoteError", "dist_pool_fixture"]


def dist_pool_fixture(world_size: int, timeout_s: float = 120.0, scope: str = "module"):
    """A pytest fixture (assign it to a module-level name) yielding a started pool."""

    @pytest.fixture(scope=scope)
    def _pool():
        pool = RankPool(world_size, timeout_s=timeout_s).start()
        try:
            yield pool
        finally:
            pool.close()

    return _pool
