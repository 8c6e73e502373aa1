"""Calibration (train/calibration.py): the cost model refitted from per-step measurements, and
the re-planner's decisions (train/replan.py) on synthetic measurements."""

from __future__ import annotations

import logging

import pytest

from cephalo import CephaloError
from cephalo.planning.planner import make_plan
from cephalo.train.calibration import StepLog, refit
from cephalo.train.config import load_config
from cephalo.train.metrics import RankStats
from cephalo.train.replan import Replanner
from planner_helpers import FakeDevice, cost_model, linear_profile


def _cm(reserve_bytes: int = 0):
    devices = [FakeDevice("a", 10**6), FakeDevice("a", 10**6), FakeDevice("b", 10**6)]
    profiles = {
        "a": linear_profile("a", 0.01, 0.02, 100, 1e-6),
        "b": linear_profile("b", 0.01, 0.02, 100, 1e-6),
    }
    return cost_model(devices, profiles, reserve_bytes=reserve_bytes)


def _stats(cm, plan, compute_factor: dict[str, float], noise: float = 0.0, peak_extra: int = 0):
    """One step's measurements: the prediction with each type's compute x factor."""
    pred = cm.evaluate(plan).ranks
    busy = [p.compute_s * compute_factor[p.device] * (1 + noise) for p in pred]
    opt = [p.optimizer_s for p in pred]
    return RankStats(
        busy_s=busy,
        comm_wait_s=[0.0] * len(pred),
        idle_s=[0.0] * len(pred),
        peak_bytes=[p.peak_bytes - p.memory.reserve + peak_extra for p in pred],
        optimizer_s=opt,
        host_s=[0.0] * len(pred),
        step_s=[b + o for b, o in zip(busy, opt, strict=True)],
    )


def test_refit_scales_compute_per_device_type_with_medians():
    cm = _cm()
    plan = make_plan(cm, 12)
    log = StepLog()
    log.add(_stats(cm, plan, {"a": 50.0, "b": 50.0}))  # the warm-up step: not read
    for noise in (0.0, 0.02, -0.02, 0.5):  # one outlier: the median ignores it
        log.add(_stats(cm, plan, {"a": 1.0, "b": 3.0}, noise=noise))
    cal = refit(cm, plan, log)
    assert cal.compute_scale["a"] == pytest.approx(1.01, rel=1e-6)
    assert cal.compute_scale["b"] == pytest.approx(3.03, rel=1e-6)
    assert any("b compute x3.030" in c for c in cal.changes())
    after = cal.cost_model.evaluate(plan).ranks
    for r, fit in enumerate(cal.ranks):
        assert after[r].compute_s == pytest.approx(fit.measured_compute_s, rel=0.02)
    # the slow type now gets fewer samples
    new = make_plan(cal.cost_model, 12)
    assert new.batch_sizes[2] < plan.batch_sizes[2]
    assert cal.reserve_bytes is None  # measured peaks within the predicted ones


def test_refit_raises_the_reserve_to_the_measured_peak():
    cm = _cm()
    plan = make_plan(cm, 12)
    log = StepLog()
    for _ in range(3):
        log.add(_stats(cm, plan, {"a": 1.0, "b": 1.0}, peak_extra=5000))
    cal = refit(cm, plan, log)
    assert cal.reserve_bytes == 5000
    for r, p in enumerate(cal.cost_model.evaluate(plan).ranks):
        assert p.peak_bytes >= cal.ranks[r].measured_peak_bytes


def test_refit_needs_two_steps():
    cm = _cm()
    plan = make_plan(cm, 12)
    log = StepLog()
    log.add(_stats(cm, plan, {"a": 1.0, "b": 1.0}))
    with pytest.raises(ValueError, match="two measured steps"):
        refit(cm, plan, log)


def _cfg(tmp_path, *extra):
    return load_config(
        None, [f"--logging.dir={tmp_path}", "--parallel.plan=even", "--train.steps=20", *extra]
    )


def test_calibrate_after_steps_is_said_once_and_disables(tmp_path, caplog):
    cfg = _cfg(tmp_path, "--parallel.calibrate_after=20", "--parallel.replan=auto")
    with caplog.at_level(logging.INFO, logger="cephalo"):
        r = Replanner(cfg, _cm(), plan_is_own=False, rank=0)
    assert not r.enabled
    assert sum("no calibration in this run" in m for m in caplog.messages) == 1


def test_user_plans_are_followed_unless_replan_auto(tmp_path):
    assert not Replanner(_cfg(tmp_path), _cm(), plan_is_own=False, rank=0).enabled
    assert Replanner(_cfg(tmp_path), _cm(), plan_is_own=True, rank=0).enabled
    auto = _cfg(tmp_path, "--parallel.replan=auto")
    assert Replanner(auto, _cm(), plan_is_own=False, rank=0).enabled
    off = _cfg(tmp_path, "--parallel.replan=off")
    assert not Replanner(off, _cm(), plan_is_own=True, rank=0).enabled
    assert not Replanner(auto, None, plan_is_own=False, rank=0).enabled  # nothing to calibrate


@pytest.mark.parametrize(
    "override, message",
    [
        ("--parallel.replan=sometimes", 'expected "own" | "auto" | "off"'),
        ("--parallel.calibrate_after=1", "parallel.calibrate_after must be >= 2"),
        ("--parallel.calibrate_every=-1", "parallel.calibrate_every must be >= 0"),
        ("--parallel.replan_min_gain=1.5", "parallel.replan_min_gain must be in [0, 1)"),
    ],
)
def test_bad_settings_are_one_clear_message(tmp_path, override, message):
    with pytest.raises(CephaloError, match=message.replace("[", r"\[").replace(")", r"\)")):
        _cfg(tmp_path, override).validate()


def test_relayout_moves_pieces_between_any_tilings_in_small_windows():
    import torch

    from cephalo.runtime.comm import LocalComm
    from cephalo.runtime.flat import FlatShard
    from cephalo.runtime.relayout import relayout

    a, b = torch.arange(10.0), torch.arange(100.0, 106.0).view(2, 3)
    old = [
        FlatShard("w", (10,), 0, a[:7].clone()),
        FlatShard("w", (10,), 7, a[7:].clone()),
        FlatShard("v", (2, 3), 0, b.flatten().clone()),
    ]
    new_w, new_v = torch.zeros(10), torch.zeros(6)
    new = [
        FlatShard("v", (2, 3), 0, new_v[:1]),
        FlatShard("v", (2, 3), 1, new_v[1:]),
        FlatShard("w", (10,), 0, new_w[:2]),
        FlatShard("w", (10,), 2, new_w[2:]),
    ]
    moved = relayout(old, new, LocalComm(), torch.device("cpu"), window_elems=3)
    assert moved == 16
    assert torch.equal(new_w, a) and torch.equal(new_v, b.flatten())
