"""Re-planning without a restart equals a checkpoint save + resume under the new plan.

Run A switches plans in memory (train/replan.py, forced by the `CEPHALO_TEST_REPLAN` hook)
after step 5 (even -> uneven batches, micro-batching, state shards, host state on rank 0, an
offloading rank) and after step 10 (another micro-batching, host state on another rank). The
reference is built from what we did not write for the switch: the even run's step-5
checkpoint resumed under the first uneven plan, whose step-10 checkpoint is resumed under the
second. Losses of every step, validation losses and final parameters of both are within the
fp32 noise of the single-process reference (tests/trainer_reference.py, fp32).

A failing switch is one clear error on every rank, not a hang; the elastic restart resumes
from the last checkpoint (tests/test_elastic.py covers the restart itself). Staged through
host memory (`parallel.replan_staging = host`), the switched run is the same bit for bit.
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from cephalo import envvars
from cephalo.envvars import scoped_environ
from cephalo.planner.plan import Plan, RankPlan
from cephalo.train.config_manager import load_config
from cephalo.train.export import export_checkpoint
from cephalo.train.metrics import read_metrics
from cephalo.train.trainer import train
from dist_harness import RemoteError, dist_pool_fixture
from trainer_reference import job_floor

pool3 = dist_pool_fixture(3, timeout_s=120)

STEPS = 20


def job_config(run_dir, plan: str, *extra: str):
    return load_config(
        None,
        [
            f"--logging.dir={run_dir}",
            "--logging.progress=false",
            "--model.name=gpt-tiny",
            "--model.overrides",
            "dropout=0.1",
            "--model.dtype=fp32",
            "--data.seq_len=16",
            "--train.global_batch_size=8",
            f"--train.steps={STEPS}",
            "--train.warmup_steps=3",
            "--train.lr=1e-3",
            "--train.min_lr=1e-4",
            "--train.eps=1e-6",
            "--train.eval_every=10",
            "--train.eval_batches=2",
            f"--parallel.plan={plan}",
            "--checkpoint.every=5",
            "--checkpoint.keep_last=10",
            *extra,
        ],
    )


def first_plan(path) -> str:
    ranks = [
        RankPlan(0, "cpu", 4, 2, 2, 0.5, host_state_fraction=0.5),
        RankPlan(1, "cpu", 1, 1, 1, 0.2),
        RankPlan(2, "cpu", 3, 2, 2, 0.3, offload_activations=True),
    ]
    Plan("manual", "gpt-tiny", 16, 8, "fp32", ranks).to_json(path)
    return str(path)


def second_plan(path) -> str:
    ranks = [
        RankPlan(0, "cpu", 2, 1, 2, 0.2, offload_activations=True),
        RankPlan(1, "cpu", 3, 3, 1, 0.5, host_state_fraction=1.0),
        RankPlan(2, "cpu", 3, 1, 3, 0.3),
    ]
    Plan("manual", "gpt-tiny", 16, 8, "fp32", ranks).to_json(path)
    return str(path)


def _train_on_rank(cfg, env: dict[str, str]):
    with scoped_environ(env):
        result = train(cfg)
    return result.losses, result.val_losses, str(result.last_checkpoint), result.replans


def _params(checkpoint, out):
    export_checkpoint(checkpoint, out=out)
    return load_file(str(out))


@pytest.mark.slow
def test_switch_equals_checkpoint_resume_under_the_new_plan(pool3, tmp_path):
    p1, p2 = first_plan(tmp_path / "p1.json"), second_plan(tmp_path / "p2.json")
    # A: one run, switching in memory after steps 5 and 10
    runs = pool3.run(
        _train_on_rank,
        job_config(tmp_path / "switched", "even"),
        {envvars.TEST_REPLAN: f"5:{p1},10:{p2}"},
    )
    losses, val, ckpt, replans = runs[0]
    assert all(r[0] == losses for r in runs), "ranks disagree on the losses"
    assert [(e["step"], e["batches"]) for e in replans] == [(5, [4, 1, 3]), (10, [2, 3, 3])]
    assert all(e["seconds"] < 30 for e in replans)
    recorded = read_metrics(tmp_path / "switched" / "metrics.jsonl", kind="replan")
    assert [r["step"] for r in recorded] == [5, 10]
    assert Plan.from_json(tmp_path / "switched" / "plan.json").batch_sizes == [2, 3, 3]
    # the same switches with the state staged through host memory (the old engine freed
    # first, train/replan.py `must_stage`): the same run, bit for bit
    staged = pool3.run(
        _train_on_rank,
        job_config(tmp_path / "staged", "even", "--parallel.replan_staging=host"),
        {envvars.TEST_REPLAN: f"5:{p1},10:{p2}"},
    )[0]
    assert staged[0] == losses and staged[1] == val
    assert [e["staged"] for e in staged[3]] == [[0, 1, 2], [0, 1, 2]]
    assert [e["staged"] for e in replans] == [[], []]

    # reference: stop at 5, resume under p1; stop at 10, resume under p2
    even = pool3.run(_train_on_rank, job_config(tmp_path / "even", "even"), {})[0]
    five = tmp_path / "even" / "checkpoints" / "step_000005"
    first = pool3.run(
        _train_on_rank,
        job_config(tmp_path / "first", p1, f"--checkpoint.resume={five}"),
        {},
    )[0]
    ten = tmp_path / "first" / "checkpoints" / "step_000010"
    second = pool3.run(
        _train_on_rank,
        job_config(tmp_path / "second", p2, f"--checkpoint.resume={ten}"),
        {},
    )[0]
    reference = {
        **{s: even[0][s] for s in range(1, 6)},
        **{s: first[0][s] for s in range(6, 11)},
        **{s: second[0][s] for s in range(11, STEPS + 1)},
    }
    assert sorted(losses) == sorted(reference) == list(range(1, STEPS + 1))
    job = job_floor(job_config(tmp_path / "one", "even", "--checkpoint.every=0"))
    job.check("switched in memory", losses, val, _params(ckpt, tmp_path / "switched.safetensors"))
    job.check(
        "checkpoint + resume under each plan",
        reference,
        {10: first[1][10], 20: second[1][20]},
        _params(second[2], tmp_path / "reference.safetensors"),
    )


def _failing_switch(cfg, env):
    with scoped_environ(env):
        train(cfg)


@pytest.mark.slow
def test_failed_switch_is_one_clear_error(pool3, tmp_path):
    p1 = first_plan(tmp_path / "p1.json")
    with pytest.raises(RemoteError) as info:
        pool3.run(
            _failing_switch,
            job_config(tmp_path / "fails", "even"),
            {envvars.TEST_REPLAN: f"5:{p1}", envvars.TEST_REPLAN_FAIL: "1"},
        )
    assert "re-plan after step 5 failed" in str(info.value)
    # the step-5 checkpoint was written before the switch: the restart loses nothing
    assert (tmp_path / "fails" / "checkpoints" / "step_000005").is_dir()


@pytest.mark.slow
def test_failed_switch_restarts_from_its_checkpoint_and_trains_each_step_once(tmp_path):
    """Under `cephalo run --max-restarts 1` a switch that fails after step 7 (no checkpoint
    due there: the switch writes one first) restarts from step 7 under the configured plan:
    every step once in metrics.jsonl, the losses of an uninterrupted run."""
    import os
    import sys

    from procs import run_tagged
    from run_common import tiny_job_args

    ranks = [RankPlan(0, "cpu", 3, 1, 3, 0.5), RankPlan(1, "cpu", 1, 1, 1, 0.2)]
    ranks.append(RankPlan(2, "cpu", 2, 2, 1, 0.3, host_state_fraction=1.0))
    plan = tmp_path / "p.json"
    Plan("manual", "gpt-tiny", 16, 6, "fp32", ranks).to_json(plan)
    job = job_floor(load_config(None, tiny_job_args(tmp_path / "reference")))
    run = tmp_path / "run"
    proc = run_tagged(
        [sys.executable, "-m", "cephalo", "run", "--devices", "cpu,cpu,cpu", "--max-restarts", "1"]
        + tiny_job_args(run),
        timeout_s=300,
        env={**os.environ, envvars.TEST_REPLAN: f"7:{plan}", envvars.TEST_REPLAN_FAIL: "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the agent restarted the job (the failure's message: test_failed_switch_is_one_clear_error)
    # and it resumed from the checkpoint the switch wrote first, under the configured plan
    assert "step_000007 at step 7 (saved under plan even, now even)" in proc.stderr
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # no step twice
    job.check("restarted after a failed switch", {r["step"]: r["loss"] for r in records})
