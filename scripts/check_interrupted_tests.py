"""Interrupt a running pytest in the middle of multi-process tests; check nothing is left.

    python scripts/check_interrupted_tests.py                          # the default scenarios
    python scripts/check_interrupted_tests.py tests/test_elastic.py -k node_removed --to group

Each scenario starts `python -m pytest -q <args>` in its own session, tagged (every
descendant inherits `TESTS_CEPHALO_PROCESS_TAG=<id>` from its environment, see
tests/procs.py), waits until the tests have started at least `--procs` processes of their
own (ranks, agents, launchers), then sends SIGINT: `--to group` to pytest's whole process
group, as Ctrl-C at a terminal does, or `--to pytest` to the pytest process alone (what a
CI runner's cancel or `kill -INT` does). It then waits for pytest to exit and, for `--grace`
seconds, scans /proc (no psutil) for processes of this run: tagged ones, and any process
started since the scenario began whose command is this checkout's Python. Any left is
listed, killed, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from procs import TAG_ENV, kill_tagged, tagged_pids  # noqa: E402

SCENARIOS = [
    # torchrun agents (own sessions) and their workers (each in its own session too)
    (["tests/test_elastic.py", "-k", "node_removed"], "group", 4),
    # `cephalo run`: a launcher and 3 ranks, started through run_tagged
    (["tests/test_resume.py"], "pytest", 4),
    # a module-scoped rank pool (3 spawned workers in pytest's own process group)
    (["tests/test_memory_prediction.py"], "pytest", 3),
]


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _ticks_now() -> int:
    """Now, in the units of /proc/<pid>/stat's start time (clock ticks since boot)."""
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return int(uptime * os.sysconf("SC_CLK_TCK"))


def leftovers(tag: str, since_ticks: int) -> dict[int, str]:
    """Live processes of this run: tagged, or started since `since_ticks` running this
    checkout's Python (one that cleared its environment would still be found)."""
    found = {pid: " ".join(_cmdline(pid))[:160] for pid in tagged_pids(tag)}
    venv = str(REPO / ".venv")
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        fields = _stat(pid)
        if pid == os.getpid() or fields is None or fields[0] in ("Z", "X"):
            continue
        cmd = _cmdline(pid)
        if int(fields[19]) >= since_ticks and cmd and cmd[0].startswith(venv):
            found.setdefault(pid, " ".join(cmd)[:160])
    return found


def scenario(
    pytest_args: list[str],
    to: str,
    procs: int,
    grace_s: float,
    limit_s: float,
    sig: signal.Signals = signal.SIGINT,
) -> bool:
    tag = uuid.uuid4().hex
    since = _ticks_now()
    print(f"== pytest {' '.join(pytest_args)}: {sig.name} to {to} once {procs} processes run")
    pytest = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
        cwd=REPO,
        env={**os.environ, TAG_ENV: tag},
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    started = time.monotonic()
    try:
        while pytest.poll() is None and time.monotonic() - started < limit_s:
            mine = [p for p in tagged_pids(tag) if p != pytest.pid]
            if len(mine) >= procs:
                break
            time.sleep(0.1)
        if pytest.poll() is not None:
            print(f"   pytest ended before {procs} processes ran: nothing interrupted")
            print(pytest.stdout.read()[-2000:])
            return False
        time.sleep(1.0)  # well inside the test now
        running = leftovers(tag, since)
        print(
            f"   at the interrupt ({time.monotonic() - started:.0f} s in): {len(running)} processes"
        )
        for pid, cmd in sorted(running.items()):
            print(f"     {pid} {cmd}")
        if to == "group":
            os.killpg(pytest.pid, sig)
        else:
            pytest.send_signal(sig)
        interrupted = time.monotonic()
        try:
            out, _ = pytest.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            print(f"   pytest did not exit within 120 s of {sig.name}")
            return False
        print(
            f"   pytest exited {pytest.returncode} {time.monotonic() - interrupted:.1f} s after "
            f"{sig.name}; last line: {out.strip().splitlines()[-1] if out.strip() else ''}"
        )
        deadline = time.monotonic() + grace_s
        left = leftovers(tag, since)
        at_exit = len(left)
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = leftovers(tag, since)
        if left:
            print(f"   LEFT RUNNING {grace_s:.0f} s after pytest exited:")
            for pid, cmd in sorted(left.items()):
                print(f"     {pid} {cmd}")
            return False
        print(
            f"   nothing left ({at_exit} still running when pytest exited, gone within {grace_s:.0f} s)"
        )
        return True
    finally:
        kill_tagged(tag, [pytest.pid] if pytest.poll() is None else [])


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("pytest_args", nargs="*", help="one scenario: what to run (else the defaults)")
    ap.add_argument("--to", choices=["group", "pytest"], default="group")
    ap.add_argument("--procs", type=int, default=3, help="processes to wait for before SIGINT")
    ap.add_argument("--grace", type=float, default=5.0, help="seconds to wait for stragglers")
    ap.add_argument(
        "--signal",
        choices=["INT", "TERM", "KILL"],
        default="INT",
        help="what to send (KILL: no cleanup can run; shows what then ends by itself)",
    )
    ap.add_argument("--limit", type=float, default=300.0, help="give up waiting after this")
    args, extra = ap.parse_known_args()
    if not Path("/proc/self/stat").exists():
        print("needs /proc (Linux)")
        return 2
    runs = [(args.pytest_args + extra, args.to, args.procs)] if args.pytest_args else SCENARIOS
    sig = signal.Signals[f"SIG{args.signal}"]
    ok = [scenario(a, to, n, args.grace, args.limit, sig) for a, to, n in runs]
    print(f"== {sum(ok)} of {len(ok)} scenarios left nothing running")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
