"""A preempted job keeps its work (launch/preempt.py): SIGTERM / SIGINT / SIGUSR1 make every
rank finish its step, save a checkpoint at that step and exit 0 with one line (where it saved,
the command that resumes); a second signal exits at once without saving.

The step at which to signal is found by watching metrics.jsonl in the run directory.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cephalo.train.config_manager import load_config
from cephalo.train.metrics import read_metrics
from procs import processes  # noqa: F401  (a fixture)
from run_common import tiny_job_args
from trainer_reference import job_floor

STEPS = 20
"""Long enough that the signal lands well before the end."""


def job_args(run_dir: Path, *extra: str) -> list[str]:
    return tiny_job_args(
        run_dir, f"--train.steps={STEPS}", "--checkpoint.every=0", *extra, timeout_s=30
    )


def wait_for_step(proc: subprocess.Popen, metrics: Path, step: int, timeout_s: float = 120) -> None:
    """Until metrics.jsonl holds `step` records (the job is at step `step` or later)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the job ended before the signal"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= step:
            return
        time.sleep(0.02)
    pytest.fail(f"the job did not reach step {step} in {timeout_s} s")


def signal_and_wait(
    proc: subprocess.Popen, *signums: int, timeout_s: float = 60
) -> tuple[int, str, float]:
    """Send `signums` (back to back); the exit code, stderr and seconds from signal to exit."""
    start = time.monotonic()
    for signum in signums:
        os.kill(proc.pid, signum)
    _, err = proc.communicate(timeout=timeout_s)
    return proc.returncode, err, time.monotonic() - start


def checkpoints(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def start(processes, command: str, args: list[str], *pre: str) -> subprocess.Popen:  # noqa: F811
    return processes.start(
        [sys.executable, "-m", "cephalo", command, *pre, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_sigterm_to_cephalo_run_saves_and_resumes(processes, tmp_path):  # noqa: F811
    job = job_floor(load_config(None, job_args(tmp_path / "reference")))
    run = tmp_path / "stopped"
    args = job_args(run)
    at = random.randint(3, 8)

    proc = start(processes, "run", args, "--devices", "cpu,cpu,cpu")
    wait_for_step(proc, run / "metrics.jsonl", at)
    code, err, seconds = signal_and_wait(proc, signal.SIGTERM)
    assert code == 0, err[-3000:]
    assert "Traceback" not in err
    before = {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl")}
    stopped = max(before)
    assert at <= stopped < STEPS
    assert checkpoints(run) == [f"step_{stopped:06d}"]  # the step it stopped at, and only it
    line = f"stopped by SIGTERM after step {stopped}: saved {run / 'checkpoints'}"
    lines = [x for x in err.splitlines() if line in x]
    assert len(lines) == 1 and "resume with: cephalo run --devices cpu,cpu,cpu" in lines[0], err
    assert seconds < 30

    resumed = start(processes, "run", args, "--devices", "cpu,cpu,cpu")
    _, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err[-3000:]
    after = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in after] == list(range(1, STEPS + 1))
    job.check("stopped by SIGTERM and resumed on 3 ranks", {r["step"]: r["loss"] for r in after})


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGUSR1])
def test_signal_to_lone_train_saves(processes, tmp_path, signum):  # noqa: F811
    run = tmp_path / "run"
    args = job_args(run)
    proc = start(processes, "train", args)
    wait_for_step(proc, run / "metrics.jsonl", 3)
    code, err, seconds = signal_and_wait(proc, signum)
    assert code == 0, err[-3000:]
    assert "Traceback" not in err and "interrupted" not in err
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl")]
    stopped = max(steps)
    assert steps == list(range(1, stopped + 1)) and stopped < STEPS
    assert checkpoints(run) == [f"step_{stopped:06d}"]
    name = signal.Signals(signum).name
    assert f"stopped by {name} after step {stopped}: saved " in err
    assert "resume with: cephalo train " in err
    assert seconds < 30

    # the same command resumes from there
    resumed = start(processes, "train", args)
    _, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err[-3000:]
    assert f"resumed from {run / 'checkpoints' / f'step_{stopped:06d}'}" in err
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, STEPS + 1))


def test_second_signal_exits_at_once(processes, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    proc = start(processes, "train", job_args(run))
    wait_for_step(proc, run / "metrics.jsonl", 3)
    code, err, seconds = signal_and_wait(proc, signal.SIGUSR1, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert "second SIGTERM: exiting at once without saving" in err
    assert "Traceback" not in err
    assert checkpoints(run) == []
    assert seconds < 10


def test_signal_config_is_checked():
    from cephalo.errors import CephaloError

    with pytest.raises(CephaloError, match="save_on_signals: 'SIGKILL' is not one of"):
        load_config(None, ["--checkpoint.save_on_signals=SIGKILL"]).validate()
    with pytest.raises(CephaloError, match="every_minutes must be >= 0"):
        load_config(None, ["--checkpoint.every_minutes=-1"]).validate()


def test_every_minutes_saves_by_the_clock(tmp_path):
    from cephalo.train.trainer import train

    run = tmp_path / "run"
    cfg = load_config(
        None,
        tiny_job_args(
            run, "--train.steps=4", "--checkpoint.every=0", "--checkpoint.every_minutes=1e-9"
        ),
    )
    result = train(cfg)
    assert result.stopped_by is None and result.final_step == 4
    assert checkpoints(run) == [f"step_{s:06d}" for s in range(1, 5)]
