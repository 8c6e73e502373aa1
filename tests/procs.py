"""Processes the tests start, and how every one of them (and all it started) gets killed.

    from procs import processes, run_tagged      # `processes`: a pytest fixture

    def test_x(processes, tmp_path):
        agent = processes.start([sys.executable, "-m", "torch.distributed.run", ...])
        ...                                      # assertions may fail: teardown kills

    proc = run_tagged([sys.executable, "-m", "cephalo", "run", ...], timeout_s=240)

`subprocess.run(timeout=)` kills only its direct child: the ranks `cephalo run` or torchrun
started live on (torch's elastic agent even starts each worker in its own session, out of
reach of a process-group kill). So every process started here is

- started in its own session (`start_new_session=True`: its own process group, and a Ctrl-C
  at the terminal does not reach it, only the test's cleanup does), and
- tagged: its environment carries `TAG_ENV=<a fresh id>`, which every descendant inherits
  (torch elastic and multiprocessing copy the environment), so a descendant whose parent
  died and was re-parented is still found (tags nest: a tagged process's own helpers append
  theirs, `TAG_ENV=<outer>,<inner>`, so scripts/check_interrupted_tests.py, which tags the
  whole pytest run, finds them all);

and the cleanup, run in a `finally` (or the fixture's teardown) whatever happened,
KeyboardInterrupt included, SIGKILLs the process group and then every process carrying the
tag, found by scanning /proc (Linux; elsewhere the group kill alone). bench/run_all.py does
the group part for the benchmarks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

TAG_ENV = "TESTS_CEPHALO_PROCESS_TAG"
"""Environment variable naming the cleanup a process belongs to (tests only, so not a
`CEPHALO_*` name: the package never reads it)."""
_PROC = Path("/proc")
LEFT_RUNNING_GRACE_S = 5.0
"""How long what a finished command started may take to end by itself (multiprocessing's
resource tracker ends when its last user has)."""


def tagged_pids(tag: str) -> list[int]:
    """Live (not zombie) processes whose `TAG_ENV` holds `tag`, by /proc (Linux; [] elsewhere).
    Processes of other users are not readable and never match."""
    prefix, wanted = f"{TAG_ENV}=".encode(), tag.encode()
    found = []
    for entry in _PROC.glob("[0-9]*"):
        try:
            tags = [
                item[len(prefix) :].split(b",")
                for item in (entry / "environ").read_bytes().split(b"\0")
                if item.startswith(prefix)
            ]
            if not tags or wanted not in tags[0]:
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone, or not ours
        if state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def kill_tagged(tag: str, leaders: Sequence[int] = ()) -> list[int]:
    """SIGKILL the process groups of `leaders` (session leaders we started) and every live
    process tagged `tag`; repeat until none is left (a dying parent may still have forked).
    Returns the pids that had to be killed besides the leaders' groups."""
    for pid in leaders:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    stragglers: list[int] = []
    for _ in range(50):
        alive = [p for p in tagged_pids(tag) if p != os.getpid()]
        if not alive:
            break
        for pid in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        stragglers += [p for p in alive if p not in stragglers]
        time.sleep(0.05)
    return stragglers


class Processes:
    """Starts tagged processes in their own sessions; `kill_all()` ends them and everything
    they started (the `processes` fixture calls it at teardown)."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex
        """The value of `TAG_ENV` every process started here carries."""
        self.started: list[subprocess.Popen] = []
        """Every process `start` returned, in order."""

    def env(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """`env` (default: this process's environment) with the tag added to any it has."""
        env = dict(os.environ if env is None else env)
        outer = env.get(TAG_ENV) or os.environ.get(TAG_ENV)
        env[TAG_ENV] = f"{outer},{self.tag}" if outer else self.tag
        return env

    def start(self, cmd: Sequence[str], env: dict[str, str] | None = None, **popen_kwargs):
        """`subprocess.Popen(cmd, ...)` in a new session, tagged (see the module docstring)."""
        proc = subprocess.Popen(
            list(cmd), env=self.env(env), start_new_session=True, **popen_kwargs
        )
        self.started.append(proc)
        return proc

    def kill_all(self) -> list[int]:
        """SIGKILL every process started here and all their descendants; reap ours."""
        stragglers = kill_tagged(self.tag, [p.pid for p in self.started if p.poll() is None])
        for proc in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        return stragglers


@contextlib.contextmanager
def started_processes() -> Iterator[Processes]:
    """A `Processes` whose `kill_all()` runs on leaving the block, however it is left."""
    procs = Processes()
    try:
        yield procs
    finally:
        procs.kill_all()


@pytest.fixture
def processes() -> Iterator[Processes]:
    """A `Processes` for one test: whatever it started is killed at teardown."""
    with started_processes() as procs:
        yield procs


def run_tagged(
    cmd: Sequence[str],
    timeout_s: float,
    env: dict[str, str] | None = None,
    left_running_grace_s: float = LEFT_RUNNING_GRACE_S,
    **popen_kwargs,
) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)`, except that
    the timeout (or any exception, Ctrl-C included) kills the whole process tree, not just
    the direct child. A command that exits but leaves processes running (a leak of the
    command under test) fails the test, after `left_running_grace_s`; they are killed."""
    with started_processes() as procs:
        proc = procs.start(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **popen_kwargs,
        )
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            exited = proc.poll()
            left = [_describe(pid) for pid in tagged_pids(procs.tag) if pid != proc.pid]
            procs.kill_all()
            stdout, stderr = proc.communicate()
            what = (
                f"did not finish within {timeout_s:.0f} s"
                if exited is None
                else f"exited {exited} but left process(es) holding its output until the "
                f"{timeout_s:.0f} s timeout: {'; '.join(left)}"
            )
            pytest.fail(
                f"{' '.join(map(str, cmd[:6]))} ... {what}; killed with its process tree. "
                f"stderr:\n{stderr[-3000:]}"
            )
        deadline = time.monotonic() + left_running_grace_s
        while (left := tagged_pids(procs.tag)) and time.monotonic() < deadline:
            time.sleep(0.05)
        if left:
            pytest.fail(
                f"{' '.join(map(str, cmd[:6]))} ... exited {proc.returncode} but left "
                f"{len(left)} process(es) running: " + "; ".join(_describe(pid) for pid in left)
            )
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _describe(pid: int) -> str:
    try:
        cmd = (_PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        cmd = "?"
    return f"{pid} {cmd[:120]}"
