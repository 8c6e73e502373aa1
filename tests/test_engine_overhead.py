"""The engine's own per-step work (issue #24): what it skips when the step does not need it."""

from __future__ import annotations

from cephalo.modeling.registry import build_model
from cephalo.runtime import dropout as dropout_mod
from cephalo.runtime.comm import LocalComm
from cephalo.runtime.dropout import module_uses_dropout
from cephalo.runtime.engine import Engine, EngineConfig
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
