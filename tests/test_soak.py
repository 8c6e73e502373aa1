"""Soak: 500 steps of the real training loop on an emulated 2-rank cluster, no memory growth.

The job is `train(cfg)` itself (data, engine, metrics every step, validation and checkpoints
every 50 steps) on two gloo ranks emulating `cpu:mem=64MiB` devices (the engine's memory
ledger enforces the budget). Inside each worker the engine's `train_step` is wrapped to record,
after every step, the ledger's peak and current bytes and the process's anonymous resident
memory (RssAnon: heap and allocator pages; file-backed pages such as the memory-mapped token
file are excluded, they grow as the sample order touches new pages and are not a leak).

Bounds:
- ledger: the peak after step 500 equals the peak after step 100, and the bytes in use at the
  end of every step are the same (the ledger counts exact tensor sizes; any growth is a leak
  of an engine-owned buffer).
- RSS: median RssAnon over steps 481-500 vs steps 91-110 may grow by at most
  max(8 MiB, 3 x the spread (max - min) seen over steps 101-200). After the first 100 steps
  every allocator pool is warm, so later steps should only move within that spread; 8 MiB
  floors it because the allocator hands whole pages/arenas back and forth (a few MiB moves
  without any leak), while a leak of a step's activations or gathered parameters (~0.1-1 MiB
  per step here) would add 40-400 MiB over 400 steps, far above the bound.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from dist_harness import dist_pool_fixture

STEPS = 500
EARLY, LATE = range(91, 111), range(481, 501)
RSS_FLOOR = 8 << 20

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="reads RssAnon from /proc"
)
pool2 = dist_pool_fixture(2, timeout_s=60)


def _rss_anon_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def _soak(run_dir: str) -> list[tuple[int, int, int]]:
    """Runs on each rank: the training job, sampling (RssAnon, ledger peak, ledger current)
    after every step."""
    from cephalo.runtime.engine.engine import Engine
    from cephalo.train.config_manager import load_config
    from cephalo.train.trainer import train

    samples: list[tuple[int, int, int]] = []
    original = Engine.train_step

    def recording_train_step(self, *args, **kwargs):
        stats = original(self, *args, **kwargs)
        samples.append((_rss_anon_bytes(), self.ledger.peak_bytes, self.ledger.current_bytes))
        return stats

    cfg = load_config(
        None,
        [
            f"--logging.dir={run_dir}",
            "--logging.progress=false",
            "--logging.log_every=1",
            "--model.name=gpt-tiny",
            "--data.seq_len=16",
            "--train.global_batch_size=4",
            f"--train.steps={STEPS}",
            "--train.warmup_steps=10",
            "--train.eval_every=50",
            "--train.eval_batches=1",
            "--parallel.plan=even",
            "--parallel.devices=cpu:mem=64MiB,cpu:mem=64MiB",
            "--parallel.timeout_s=60",
            "--checkpoint.every=50",
            "--checkpoint.keep_last=2",
        ],
    )
    Engine.train_step = recording_train_step
    try:
        result = train(cfg)
    finally:
        Engine.train_step = original
    assert result.final_step == STEPS and len(samples) == STEPS
    return samples


@pytest.mark.slow
def test_500_steps_without_memory_growth(pool2, tmp_path):
    per_rank = pool2.run(_soak, str(tmp_path / "run"), timeout_s=400)
    for rank, samples in enumerate(per_rank):
        rss = [s[0] for s in samples]
        peak = {step: samples[step - 1][1] for step in (100, STEPS)}
        in_use = {s[2] for s in samples}
        early = statistics.median(rss[i - 1] for i in EARLY)
        late = statistics.median(rss[i - 1] for i in LATE)
        spread = max(rss[100:200]) - min(rss[100:200])
        bound = max(RSS_FLOOR, 3 * spread)
        print(
            f"rank {rank}: RssAnon median {early / 2**20:.1f} MiB (steps 91-110) -> {late / 2**20:.1f} MiB "
            f"(steps 481-500), growth {(late - early) / 2**20:+.2f} MiB, bound {bound / 2**20:.1f} MiB "
            f"(spread 101-200: {spread / 2**20:.2f} MiB); ledger peak {peak[100]} B at step 100, "
            f"{peak[STEPS]} B at step {STEPS}; in use after a step: {sorted(in_use)} B"
        )
        assert peak[STEPS] == peak[100], (rank, peak)
        assert len(in_use) == 1, (rank, sorted(in_use))
        assert late - early <= bound, (rank, early, late, bound)
