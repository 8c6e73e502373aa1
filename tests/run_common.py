"""The small training job the crash-recovery and elastic tests run (config overrides)."""

from __future__ import annotations

from pathlib import Path

STEPS = 20
"""Steps of the job; checkpoints every 5."""


def tiny_job_args(
    run_dir: Path | str, *extra: str, timeout_s: int = 30, keep_last: int = 5
) -> list[str]:
    """`cephalo train` overrides: gpt-tiny with dropout, batch 6, seq 16, `STEPS` steps, the
    even plan, a checkpoint every 5 steps; `extra` last (they win)."""
    return [
        f"--logging.dir={run_dir}",
        "--logging.progress=false",
        "--model.name=gpt-tiny",
        "--model.overrides=dropout=0.1",
        "--data.seq_len=16",
        "--train.global_batch_size=6",
        f"--train.steps={STEPS}",
        "--train.warmup_steps=3",
        "--train.lr=1e-3",
        "--train.min_lr=1e-4",
        "--train.eps=1e-6",
        "--train.eval_every=0",
        "--parallel.plan=even",
        f"--parallel.timeout_s={timeout_s}",
        "--checkpoint.every=5",
        f"--checkpoint.keep_last={keep_last}",
        *extra,
    ]
