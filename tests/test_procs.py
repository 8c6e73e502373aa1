"""tests/procs.py, the tests' process handling: whole trees killed, leaks reported.

Commands here are shell one-liners whose children outlive them in the ways test jobs do:
a grandchild of a timed-out command, a background process left behind by a command that
exited, a process in a session of its own (as torch elastic starts its workers).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from procs import TAG_ENV, run_tagged, started_processes, tagged_pids

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/environ").exists(), reason="finds processes through /proc"
)


@pytest.fixture
def outer_tag(monkeypatch) -> str:
    """Tag everything started below (tags nest), so the test can look for leftovers."""
    tag = "test-procs-outer"
    monkeypatch.setenv(TAG_ENV, tag)
    return tag


def test_timeout_kills_the_grandchildren(outer_tag):
    with pytest.raises(pytest.fail.Exception, match="did not finish within 1 s"):
        run_tagged(["bash", "-c", "sleep 60 & sleep 60"], timeout_s=1)
    assert tagged_pids(outer_tag) == []


def test_a_command_that_leaves_processes_running_fails(outer_tag):
    # setsid: the leftover is in a session of its own, as torch elastic starts its workers
    # (the short sleep: the leftover exists before the shell exits, also on a loaded machine,
    # where its exec could otherwise still be under way when the check looks)
    leak = "setsid sleep 60 >/dev/null 2>&1 & sleep 0.2; exit 0"
    with pytest.raises(pytest.fail.Exception, match=r"exited 0 but left 1 process\(es\) running"):
        run_tagged(["bash", "-c", leak], timeout_s=30, left_running_grace_s=0.5)
    assert tagged_pids(outer_tag) == []
    # a leftover that keeps the command's output open holds it until the timeout
    with pytest.raises(pytest.fail.Exception, match=r"exited 0 but left process\(es\) holding"):
        run_tagged(["bash", "-c", "setsid sleep 60 & exit 0"], timeout_s=1)
    assert tagged_pids(outer_tag) == []


def test_a_clean_command_returns_its_output(outer_tag):
    proc = run_tagged([sys.executable, "-c", "print('hi')"], timeout_s=30)
    assert (proc.returncode, proc.stdout) == (0, "hi\n")


def test_kill_all_ends_reparented_descendants(outer_tag):
    with started_processes() as procs:
        # the shell exits at once; its child, in a new session, is re-parented
        procs.start(["bash", "-c", "setsid sleep 60 & exit 0"]).wait(timeout=10)
        # the background child may still be between fork and exec (its /proc entry briefly
        # unreadable) when the shell has exited: look again for a few seconds
        deadline = time.monotonic() + 10
        while len(tagged_pids(procs.tag)) != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(tagged_pids(procs.tag)) == 1
    assert tagged_pids(procs.tag) == [] and tagged_pids(outer_tag) == []
