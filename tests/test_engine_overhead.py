"""The engine's own per-step work (issue #24): what it skips when the step does not need it."""

from __future__ import annotations

import pytest
import torch

from cephalo.modeling.registry import build_model
from cephalo.runtime import dropout as dropout_mod
from cephalo.runtime.comm import LocalComm
from cephalo.runtime.dropout import module_uses_dropout
from cephalo.runtime.engine import Engine, EngineConfig
from cephalo.runtime.optim import ADAMW_KERNELS
from engine_common import make_data, make_plan, one_thread  # noqa: F401


def test_dropout_detection():
    assert not any(module_uses_dropout(u.module) for u in build_model("gpt-tiny").units)
    on = [module_uses_dropout(u.module) for u in build_model("gpt-tiny", dropout=0.1).units]
    assert on == [True, True, True, False]


def _count_modes(monkeypatch, **overrides) -> int:
    entered = []
    real = dropout_mod.SampleDropout.__enter__

    def enter(self):
        entered.append(self.unit)
        return real(self)

    monkeypatch.setattr(dropout_mod.SampleDropout, "__enter__", enter)
    plan = make_plan([4], [1.0], [2])
    engine = Engine(build_model("gpt-tiny", **overrides), plan, LocalComm(), EngineConfig())
    x, y = make_data(1, 4)[0]
    engine.train_step(x, y, 1e-3)
    return len(entered)


def test_no_dropout_mode_without_dropout(monkeypatch):
    assert _count_modes(monkeypatch) == 0
    # with dropout: every unit that drops, per micro-batch, forward and recompute
    assert _count_modes(monkeypatch, dropout=0.1) == 3 * 2 * 2


def test_cached_charges_match_exact_tracking():
    """After the first step, activations are charged as measured: the same peaks."""
    plan = make_plan([4], [1.0], [2])
    x, y = make_data(1, 4)[0]
    peaks = []
    for exact in (True, False):
        engine = Engine(build_model("gpt-tiny"), plan, LocalComm(), EngineConfig())
        engine._charges.exact = exact
        stats = [engine.train_step(x, y, 1e-3) for _ in range(2)]
        peaks.append([(s.peak_bytes, s.peak_by_category) for s in stats])
    assert peaks[0] == peaks[1]


def _train(monkeypatch, chunk_tokens: int | None, kernel: str | None = None, steps: int = 2):
    from cephalo.runtime import head_loss

    if chunk_tokens is not None:
        monkeypatch.setattr(head_loss, "head_chunk_tokens", lambda vocab: chunk_tokens)
    plan = make_plan([4], [1.0], [2])
    engine = Engine(build_model("gpt-tiny"), plan, LocalComm(), EngineConfig(adamw_kernel=kernel))
    stats = [engine.train_step(x, y, 1e-3) for x, y in make_data(steps, 4)]
    eval_loss = engine.eval_loss(*make_data(1, 4, seed=5)[0])
    return engine, stats, eval_loss


def test_head_chunks_give_the_unchunked_values(monkeypatch):
    """The head over 8-token chunks (4 per sample of 16, 2 samples per micro-batch: 4 chunks)
    gives the losses and weights of one chunk, to fp32 summation order; its logits peak
    (activations + transient) is smaller."""
    whole, whole_stats, whole_eval = _train(monkeypatch, None)
    chunked, chunked_stats, chunked_eval = _train(monkeypatch, 8)
    for a, b in zip(whole_stats, chunked_stats, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-6)
    assert whole_eval == pytest.approx(chunked_eval, rel=1e-6)
    ours, ref = chunked.full_state_dict(), whole.full_state_dict()
    for k in ref:
        torch.testing.assert_close(ours[k], ref[k], rtol=1e-5, atol=1e-6)


def test_adamw_kernels_agree(monkeypatch):
    """fused, foreach and single-tensor AdamW give the same training to fp32 rounding."""
    runs = {k: _train(monkeypatch, None, k)[0].full_state_dict() for k in ADAMW_KERNELS}
    for k in ("fused", "foreach"):
        for name, ref in runs["single"].items():
            torch.testing.assert_close(runs[k][name], ref, rtol=1e-5, atol=1e-6)


def test_world_size_one_gathers_in_place():
    """One rank in fp32: the gathered unit is the fp32 shard itself (no `gathered` bytes)."""
    plan = make_plan([4], [1.0], [2])
    engine = Engine(build_model("gpt-tiny"), plan, LocalComm(), EngineConfig())
    stats = engine.train_step(*make_data(1, 4)[0], 1e-3)
    assert stats.peak_by_category.get("gathered", 0) == 0
