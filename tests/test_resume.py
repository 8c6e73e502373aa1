"""Crash and resume: kill -9 one rank at step 12 of 20, resume from the step-10 checkpoint.

The killed job runs under `cephalo run` (3 ranks); the test hook `CEPHALO_TEST_KILL_AT_STEP`
makes rank 1 SIGKILL itself before step 12. Resuming under the same plan recomputes step 11
bit for bit; the resumed job's losses, and those of a resume under another plan (one process),
are within the fp32 noise of the single-process reference of the uninterrupted job
(tests/trainer_reference.py; plan invariance, test_plan_invariance.py, makes it the same run
as 3 ranks).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cephalo import envvars
from cephalo.train.config_manager import load_config
from cephalo.train.metrics import read_metrics
from cephalo.train.trainer import train
from procs import run_tagged
from run_common import STEPS, tiny_job_args
from trainer_reference import job_floor


def overrides(run_dir, *extra: str) -> list[str]:
    return tiny_job_args(run_dir, *extra, timeout_s=30, keep_last=5)


def cephalo_run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`cephalo run` on 3 CPU ranks; a timeout (or Ctrl-C) kills the launcher and its ranks."""
    return run_tagged(
        [sys.executable, "-m", "cephalo", "run", "--devices", "cpu,cpu,cpu", *args],
        timeout_s=240,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.slow
def test_kill_one_rank_then_resume(tmp_path):
    job = job_floor(load_config(None, overrides(tmp_path / "reference")))
    run = tmp_path / "killed"

    killed = cephalo_run(overrides(run), env={envvars.KILL_AT_STEP: "12"})
    assert killed.returncode == 2, killed.stderr[-3000:]
    assert "cephalo run: error: rank 1 was killed by signal SIGKILL" in killed.stderr
    assert "Traceback" not in killed.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000005", "step_000010"]
    before = {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl")}
    assert sorted(before) == list(range(1, 12))  # step 11 ran; rank 1 died before step 12

    resumed = cephalo_run(overrides(run))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in after] == list(range(1, STEPS + 1))  # no step twice
    losses = {r["step"]: r["loss"] for r in after}
    assert losses[11] == before[11]  # same plan, same state: step 11 again, bit for bit
    job.check("killed and resumed on 3 ranks", losses)

    # another plan (one process, another world size) from the same step-10 checkpoint
    other = train(
        load_config(
            None,
            overrides(
                tmp_path / "other-plan",
                f"--checkpoint.resume={run / 'checkpoints' / 'step_000010'}",
            ),
        )
    )
    assert other.start_step == 10 and sorted(other.losses) == list(range(11, STEPS + 1))
    job.check("resumed under another plan", other.losses)
