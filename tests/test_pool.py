"""`cephalo.launch.pool.RankPool` workers do not outlive their parent.

The pool's own behaviour (results, errors, hangs, crashes) is tested through the tests that
use it (tests/test_comm.py `test_harness_reports_errors_hangs_and_crashes`); here: a parent
holding a pool is SIGKILLed (no `close`, no teardown) while its workers are busy in a call,
and the workers must be gone within a few seconds instead of sleeping on forever.
"""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import processes, tagged_pids

__all__ = ["processes"]

# the parent: a 2-rank pool, its workers' pids on stdout, then a call that lasts 10 minutes
_PARENT = """
import time
from cephalo.launch.pool import RankPool
pool = RankPool(2, timeout_s=900).start()
print(" ".join(str(p.pid) for p in pool._procs), flush=True)
pool.run(time.sleep, 600)
"""
GONE_WITHIN_S = 5.0
"""The watch thread sees the parent's pipe close at once (measured: ~0.1 s after the kill
on the loaded 2-core machine); 5 s leaves room for a descheduled worker."""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie has exited; only its parent may reap it


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="watches processes in /proc")
def test_workers_exit_when_the_parent_is_killed(processes):
    parent = processes.start(
        [sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    ready, _, _ = select.select([parent.stdout], [], [], 120)
    assert ready, "the pool did not start within 120 s"
    workers = [int(p) for p in parent.stdout.readline().split()]
    assert len(workers) == 2 and all(_alive(p) for p in workers), workers
    # the tagged processes: the parent, its workers and multiprocessing's resource tracker
    assert {parent.pid, *workers} <= set(tagged_pids(processes.tag))
    time.sleep(1.0)  # the workers are inside time.sleep(600) now
    killed = time.monotonic()
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    while any(_alive(p) for p in workers) and time.monotonic() - killed < 30:
        time.sleep(0.05)
    gone_after = time.monotonic() - killed
    print(f"workers gone {gone_after:.2f} s after the parent's SIGKILL")
    assert not any(_alive(p) for p in workers), f"workers still alive after {gone_after:.0f} s"
    assert gone_after < GONE_WITHIN_S
    # and nothing else of the parent's is left (the resource tracker ends with its last user)
    deadline = time.monotonic() + GONE_WITHIN_S
    while tagged_pids(processes.tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tagged_pids(processes.tag) == []
    assert "the parent process died; exiting" in parent.stderr.read()
