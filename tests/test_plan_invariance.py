"""The training contract: one config trained under different plans gives the same run.

(a) one process, (b) three ranks with the even plan, (c) three ranks with an uneven plan
(uneven batches, micro-batching, uneven state shards, one rank offloading its boundary
activations): the same loss at every step, the same validation loss and the same final
parameters, within 1e-5 relative. Dropout is on: the engine draws its masks per sample
(runtime/dropout.py), so they do not depend on the plan either.
"""

from __future__ import annotations

import math

import pytest
from safetensors.torch import load_file

from cephalo.planner.plan import Plan, RankPlan
from cephalo.train.config_manager import load_config
from cephalo.train.export import export_checkpoint
from cephalo.train.trainer import train
from dist_harness import dist_pool_fixture

pool3 = dist_pool_fixture(3, timeout_s=120)

STEPS = 20
TOL = 1e-5


def job_config(run_dir, plan: str):
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
            # eps well above the rounding noise of gradients that are exactly zero in exact
            # arithmetic (tests/engine_common.py explains why)
            "--train.eps=1e-6",
            "--train.eval_every=10",
            "--train.eval_batches=2",
            f"--parallel.plan={plan}",
            "--checkpoint.every=0",
        ],
    )


def uneven_plan(path) -> str:
    ranks = [
        RankPlan(0, "cpu", 4, 2, 2, 0.5),
        RankPlan(1, "cpu", 1, 1, 1, 0.2),
        RankPlan(2, "cpu", 3, 2, 2, 0.3, offload_activations=True),
    ]
    Plan("manual", "gpt-tiny", 16, 8, "fp32", ranks).to_json(path)
    return str(path)


def _train_on_rank(cfg):
    result = train(cfg)
    return result.losses, result.val_losses, str(result.last_checkpoint)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _params(checkpoint, out):
    export_checkpoint(checkpoint, out=out)
    return load_file(str(out))


@pytest.mark.slow
def test_same_run_under_any_plan(pool3, tmp_path):
    ref = train(job_config(tmp_path / "one", "even"))
    runs = {"one process": (ref.losses, ref.val_losses, str(ref.last_checkpoint))}
    for name, plan in (
        ("3 ranks even", "even"),
        ("3 ranks uneven", uneven_plan(tmp_path / "uneven.json")),
    ):
        per_rank = pool3.run(_train_on_rank, job_config(tmp_path / name.replace(" ", "-"), plan))
        assert all(r[0] == per_rank[0][0] for r in per_rank), "ranks disagree on the losses"
        runs[name] = per_rank[0]

    ref_losses, ref_val, ref_ckpt = runs["one process"]
    assert sorted(ref_losses) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for v in ref_losses.values())
    assert ref_losses[STEPS] < ref_losses[1]
    ref_params = _params(ref_ckpt, tmp_path / "one.safetensors")
    for name, (losses, val, ckpt) in runs.items():
        worst = max(_rel(losses[s], ref_losses[s]) for s in ref_losses)
        assert sorted(losses) == sorted(ref_losses)
        assert worst <= TOL, f"{name}: loss differs by {worst:.2e} (relative)"
        assert sorted(val) == [10, 20]
        assert max(_rel(val[s], ref_val[s]) for s in val) <= TOL, name
        params = _params(ckpt, tmp_path / f"{name}.safetensors")
        assert set(params) == set(ref_params)
        diffs = {
            key: ((params[key] - ref_t).abs().max() / ref_t.abs().max().clamp(min=1e-12)).item()
            for key, ref_t in ref_params.items()
        }
        worst_key = max(diffs, key=diffs.get)
        assert diffs[worst_key] <= TOL, (
            f"{name}: parameter {worst_key} differs by {diffs[worst_key]:.2e} (relative)"
        )
