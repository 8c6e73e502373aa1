"""Calibration (train/calibration.py): the cost model refitted from per-step measurements, and
the re-planner's decisions (train/replan.py) on synthetic measurements."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from cephalo import CephaloError, Plan
from cephalo.planner.makers import make_plan
from cephalo.train.calibration import StepLog, predicted_step_s, refit
from cephalo.train.config_manager import load_config
from cephalo.train.metrics import RankStats
from cephalo.train.replan import Replanner, plan_key
from planner_helpers import FakeDevice, cost_model, linear_profile


def _cm(reserve_bytes: int = 0):
    devices = [FakeDevice("a", 10**6), FakeDevice("a", 10**6), FakeDevice("b", 10**6)]
    profiles = {
        "a": linear_profile("a", 0.01, 0.02, 100, 1e-6),
        "b": linear_profile("b", 0.01, 0.02, 100, 1e-6),
    }
    return cost_model(devices, profiles, reserve_bytes=reserve_bytes)


def _stats(
    cm,
    plan,
    compute_factor: dict[str, float],
    noise: float = 0.0,
    peak_extra: int = 0,
    sync_s: float = 0.0,
):
    """One step's measurements: the prediction with each type's compute x factor; `sync_s`:
    seconds the step takes beyond its slowest rank's work, waited in collectives by all."""
    pred = cm.evaluate(plan).ranks
    busy = [p.compute_s * compute_factor[p.device] * (1 + noise) for p in pred]
    opt = [p.optimizer_s for p in pred]
    step = max(b + o for b, o in zip(busy, opt, strict=True)) + sync_s  # ranks end together
    return RankStats(
        busy_s=busy,
        comm_wait_s=[step - b - o for b, o in zip(busy, opt, strict=True)],
        idle_s=[0.0] * len(pred),
        peak_bytes=[p.peak_bytes - p.memory.reserve + peak_extra for p in pred],
        optimizer_s=opt,
        host_s=[0.0] * len(pred),
        step_s=[step] * len(pred),
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


def test_refit_adds_the_excess_to_each_devices_own_reserve():
    """A mixed cluster (one device 100x the others' memory, reserves as a share of each):
    a measured peak above the prediction adds the excess to every device's own reserve, not
    the largest device's share to all. (The old refit held the small devices to the large one's
    5 %: make demo's re-plan found no plan that fit, 205 MiB of reserve on a 32 MiB device.)"""
    devices = [FakeDevice("a", 10**8), FakeDevice("b", 10**6), FakeDevice("b", 10**6)]
    profiles = {
        "a": linear_profile("a", 0.01, 0.02, 100, 1e-6),
        "b": linear_profile("b", 0.01, 0.02, 100, 1e-6),
    }
    cm = cost_model(devices, profiles, reserve_bytes=None)  # 5 % of each device
    plan = make_plan(cm, 12)
    before = [p.memory.reserve for p in cm.evaluate(plan).ranks]
    log = StepLog()
    for _ in range(3):  # the small devices' ledger peaks 5000 bytes above peak + reserve
        log.add(_stats(cm, plan, {"a": 1.0, "b": 1.0}, peak_extra=before[1] + 5000))
    cal = refit(cm, plan, log)
    assert cal.reserve_bytes == 5000
    after = [p.memory.reserve for p in cal.cost_model.evaluate(plan).ranks]
    assert after == [b + 5000 for b in before] and after[1] < 10**6 // 10
    assert make_plan(cal.cost_model, 12) is not None  # the small devices still take a plan


def test_refit_measures_the_synchronisation_no_rank_explains():
    # every rank waits 50 ms per step beyond the slowest rank's work (collectives the model
    # takes as hidden, ranks meeting at every unit): the refit's predicted step covers it
    cm = _cm()
    plan = make_plan(cm, 12)
    log = StepLog()
    for noise in (0.3, 0.0, 0.01, -0.01):  # the first (warm-up) step is not read
        log.add(_stats(cm, plan, {"a": 1.0, "b": 3.0}, noise=noise, sync_s=0.05))
    measured = log.job_step_s()
    cal = refit(cm, plan, log)
    assert cal.sync_s == pytest.approx(0.05, rel=0.05)
    assert predicted_step_s(cal.cost_model, plan, cal.sync_s) == pytest.approx(measured, rel=0.01)
    assert cm.evaluate(plan).step_s < 0.8 * measured  # without it: far below the measured step
    assert any("synchronisation 5" in c for c in cal.changes())
    slowest = max(cal.ranks, key=lambda f: f.measured_compute_s)
    assert slowest.measured_other_s == pytest.approx(0.05, rel=0.05)
    # refitted again from the same steps: predicted within 1 %, the term not compounded
    again = refit(cal.cost_model, plan, log, cal.sync_s)
    assert again.sync_s == pytest.approx(cal.sync_s, rel=1e-6)
    assert max(f.predicted_step_s for f in again.ranks) == pytest.approx(measured, rel=0.01)
    # a step the ranks' own times explain leaves none (and never a negative one)
    log = StepLog()
    for _ in range(3):
        log.add(_stats(cm, plan, {"a": 1.0, "b": 3.0}))
    assert refit(cm, plan, log).sync_s == pytest.approx(0.0, abs=1e-9)


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
        ("--parallel.emulate_drift=8:0", "write STEP:RANK:SLOWDOWN"),
        ("--parallel.emulate_drift=8:0:0.5", "the slowdown >= 1"),
    ],
)
def test_bad_settings_are_one_clear_message(tmp_path, override, message):
    with pytest.raises(CephaloError, match=message.replace("[", r"\[").replace(")", r"\)")):
        _cfg(tmp_path, override).validate()


def test_emulated_drift_takes_the_latest_change_of_each_rank(monkeypatch):
    from cephalo import envvars
    from cephalo.runtime.emulation import drifted_slowdown

    spec = "8:0:4, 12:0:2,10:1:3"
    assert [drifted_slowdown(s, 0, spec) for s in (7, 8, 11, 12, 40)] == [None, 4, 4, 2, 2]
    assert drifted_slowdown(9, 1, spec) is None and drifted_slowdown(10, 1, spec) == 3
    # the config's setting wins over the environment's, which serves jobs without one
    monkeypatch.setenv(envvars.EMULATE_DRIFT, "1:1:6")
    assert drifted_slowdown(10, 1, spec) == 3 and drifted_slowdown(10, 1) == 6


def test_relayout_moves_pieces_between_any_tilings_in_small_windows():
    import torch

    from cephalo.runtime.collectives.comm import LocalComm
    from cephalo.runtime.state.flat import FlatShard
    from cephalo.runtime.state.relayout import relayout

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


def test_relayout_window_fits_what_the_device_has_free():
    """The re-layout's window lives on the device beside the new engine: on a device with
    little free memory it shrinks to fit (`make demo`'s 32 MiB device once ran out of memory
    on a 37 MiB window under the strict accounting), and the state still arrives whole."""
    import torch

    from cephalo.runtime.collectives.comm import LocalComm
    from cephalo.runtime.device_memory import EmulatedDeviceMemory, host_memory
    from cephalo.runtime.state.flat import FlatShard
    from cephalo.runtime.state.relayout import relayout

    n = 1 << 18  # 1 MiB of fp32
    with host_memory():
        old = [FlatShard("w", (n,), 0, torch.arange(n, dtype=torch.float32))]
    mode = EmulatedDeviceMemory(0, budget_bytes=(n * 4) + (256 << 10))  # 256 KiB to spare
    with mode:
        new_w = torch.zeros(n)
        moved = relayout(old, [FlatShard("w", (n,), 0, new_w)], LocalComm(), torch.device("cpu"))
        peak = mode.peak_bytes
    assert moved == n and torch.equal(new_w, old[0].local)
    assert peak <= n * 4 + (128 << 10)  # the window took at most half of what was free


# ----------------------------------------------------------------------------- damping
class _Comm:
    """One rank: rank 0's decision is its own."""

    world_size = 1

    def all_gather_object(self, obj):
        return [obj]


class _Metrics:
    def __init__(self):
        self.records: list[dict] = []

    def write(self, record: dict) -> None:
        self.records.append(record)


def _drive(
    tmp_path, monkeypatch, truth, steps: int, *extra: str, sync_s: float = 0.0, by_plan=False
):
    """A Replanner over `steps` synthetic steps: after step s every rank measures the profile's
    prediction for the running plan with its type's compute x `truth(s)[type]`
    (`by_plan`: `truth(s, running plan)`). A switch
    (patched: no engines) just puts the new plan in place. Returns (steps after which it
    switched, plans switched to, calibration records)."""
    cfg = load_config(
        None,
        [
            f"--logging.dir={tmp_path}",
            "--parallel.plan=even",
            "--parallel.replan=auto",
            f"--train.steps={steps}",
            "--train.global_batch_size=12",
            *extra,
        ],
    )
    cm = _cm()

    def switch(trainer, plan):
        trainer.plan = plan
        return 0.01, []

    monkeypatch.setattr("cephalo.train.replan.switch_plan", switch)
    trainer = SimpleNamespace(
        step=0,
        plan=make_plan(cm, 12),
        comm=_Comm(),
        save=lambda: None,
        result=SimpleNamespace(last_checkpoint=None),
    )
    replanner = Replanner(cfg, cm, plan_is_own=False, rank=0)
    metrics = _Metrics()
    for s in range(1, steps + 1):
        trainer.step = s
        factors = truth(s, trainer.plan) if by_plan else truth(s)
        stats = _stats(cm, trainer.plan, factors, sync_s=sync_s)
        metrics.write({"kind": "step", "step": s, "step_s": stats.step_s[0]})
        replanner.after_step(trainer, stats, metrics)
    _drive.steps = {r["step"]: r["step_s"] for r in metrics.records if r["kind"] == "step"}
    calibrations = [r for r in metrics.records if r["kind"] == "calibration"]
    switches = replanner.switches
    return [w.step for w in switches], [w.batches for w in switches], calibrations


def test_a_wrong_profile_is_replanned_once_then_the_plan_stays(tmp_path, monkeypatch):
    # type b is 3x slower than profiled, steadily (+-2 % noise): one switch, confirmed by the
    # calibration after the first on fresh steps, then the plan holds for the whole run
    def truth(step):
        noise = 0.02 if step % 2 else -0.02
        return {"a": 1.0 + noise, "b": 3.0 - noise}

    at, batches, calibrations = _drive(tmp_path, monkeypatch, truth, 60)
    assert at == [10]  # seen at step 5 (calibrate_after), confirmed 5 steps later
    assert batches[0][2] < 4  # the slow type gets fewer samples
    first, second = calibrations[:2]
    assert first["step"] == 5 and first["confirming"] and not first["replanned"]
    assert "confirming on the next 5 steps" in first["why_not"]
    assert second["step"] == 10 and second["replanned"]
    later = calibrations[2:]
    assert [c["step"] for c in later] == [15, 25, 35, 45, 55]  # calibrate_every after the switch
    assert not any(c["replanned"] or c["confirming"] for c in later)


def test_calibrate_every_0_calibrates_once_per_plan_and_confirms(tmp_path, monkeypatch):
    at, _, calibrations = _drive(
        tmp_path, monkeypatch, lambda s: {"a": 1.0, "b": 3.0}, 40, "--parallel.calibrate_every=0"
    )
    assert at == [10]
    # the first plan's calibration and the one confirming it; the new plan's one
    assert [c["step"] for c in calibrations] == [5, 10, 15]


def test_a_passing_stall_does_not_replan(tmp_path, monkeypatch):
    # type b is 2x slower in the first calibration's steps only, then as profiled: the gain
    # that calibration predicts is not confirmed by the next, and the plan stays
    at, _, calibrations = _drive(
        tmp_path, monkeypatch, lambda s: {"a": 1.0, "b": 2.0 if s <= 5 else 1.0}, 30
    )
    assert at == []
    assert calibrations[0]["confirming"] and calibrations[0]["predicted_gain"] >= 0.03
    assert not calibrations[1]["confirming"] and not calibrations[1]["replanned"]


def test_noise_that_blames_each_type_in_turn_never_switches(tmp_path, monkeypatch):
    # each calibration's steps make another type look 2x slow: each predicts a gain, for an
    # opposite plan; the previous fit does not see that plan faster, so nothing is confirmed
    def truth(step):
        window = (step - 1) // 5  # calibrate_every = calibrate_after = 5: one window each
        return {"a": 2.0, "b": 1.0} if window % 2 == 0 else {"a": 1.0, "b": 2.0}

    at, _, calibrations = _drive(tmp_path, monkeypatch, truth, 40, "--parallel.calibrate_every=5")
    assert at == []
    # the gains were there, one calibration at a time
    assert sum(c["confirming"] for c in calibrations) == len(calibrations) - 1


def test_the_predicted_gain_counts_the_synchronisation(tmp_path, monkeypatch):
    # a wrong profile (type b 3x slower) and 0.3 s of synchronisation per step that no plan
    # removes: the re-plan's predicted gain is the one measured after the switch (without
    # the synchronisation term it would predict the gain of the ranks' work alone, far more)
    at, _, calibrations = _drive(
        tmp_path, monkeypatch, lambda s: {"a": 1.0, "b": 3.0}, 30, sync_s=0.3
    )
    assert at == [10]
    steps = _drive.steps
    measured_gain = steps[9] / steps[12] - 1.0
    switch = next(c for c in calibrations if c["replanned"])
    assert switch["predicted_gain"] == pytest.approx(measured_gain, abs=0.01)
    assert switch["sync_s"] == pytest.approx(0.3, rel=0.01)
    # after the switch the calibrated model predicts the step as measured
    after = next(c for c in calibrations if c["step"] == 15)
    predicted = max(f["predicted_step_s"] for f in after["ranks"])  # the slowest rank's
    assert predicted == pytest.approx(steps[15], rel=0.01)


def test_a_real_change_replans_within_the_window(tmp_path, monkeypatch):
    # as profiled until step 23, then type a (ranks 0 and 1) computes 4x slower (throttling):
    # the first calibration that reads only changed steps (after step 35: steps 26-35) sees
    # it, the next, 5 steps later, confirms it; then the new plan holds
    at, batches, calibrations = _drive(
        tmp_path, monkeypatch, lambda s: {"a": 4.0 if s >= 23 else 1.0, "b": 1.0}, 70
    )
    assert at == [40]
    assert batches[0][0] < 4 and batches[0][2] > 4
    assert [c["step"] for c in calibrations if c["confirming"]] == [35]


def test_a_plan_measured_slower_is_not_gone_back_to(tmp_path, monkeypatch):
    # the profile is wrong for the first plan only (type b 3x slower under it: an error that
    # depends on the plan, as a curve wrong at one micro-batch size), right for every other.
    # The fit on the first plan re-plans away from it; the fit on the new plan, where b is as
    # profiled, predicts the first plan faster again, but that plan was measured slower: the
    # job stays instead of flipping between the two for the rest of the run
    first: list[tuple] = []

    def truth(step, plan):
        if not first:
            first.append(plan_key(plan))
        return {"a": 1.0, "b": 3.0 if plan_key(plan) == first[0] else 1.0}

    at, batches, calibrations = _drive(tmp_path, monkeypatch, truth, 60, by_plan=True)
    assert at == [10]
    assert batches[0][2] < 4
    refused = [c for c in calibrations if "not going back" in (c["why_not"] or "")]
    assert refused and refused[0]["step"] == 15  # the new plan's first calibration
    assert refused[0]["predicted_gain"] >= 0.03  # the fit alone would have gone back
    assert not any(c["confirming"] for c in calibrations if c["step"] > 10)


def test_a_plan_left_when_a_device_slowed_is_gone_back_to_when_it_recovers(tmp_path, monkeypatch):
    # type a 4x slower from step 23 to 50, then as profiled again: the job leaves its first
    # plan, measured fast before the slowdown, and returns to it after the recovery
    at, batches, _ = _drive(
        tmp_path,
        monkeypatch,
        lambda s: {"a": 4.0 if 23 <= s <= 50 else 1.0, "b": 1.0},
        90,
    )
    assert len(at) == 2 and at[0] == 40 and at[1] > 50
    assert batches[1] == [4, 4, 4]


def test_a_switch_the_hosts_cannot_stage_is_skipped_not_fatal(tmp_path, monkeypatch, caplog):
    """`SwitchNotPossible` (every rank agreed, nothing changed): a warning, the plan stays, no
    switch recorded, and the plan is measured afresh before it is proposed again."""
    from cephalo.train.replan import SwitchNotPossible

    cfg = load_config(None, [f"--logging.dir={tmp_path}", "--parallel.replan=auto"])
    cm = _cm()

    def switch(trainer, plan):
        raise SwitchNotPossible("the re-plan needs host memory to stage the state of rank 1")

    monkeypatch.setattr("cephalo.train.replan.switch_plan", switch)
    running = make_plan(cm, 12)
    trainer = SimpleNamespace(
        step=7,
        plan=running,
        comm=_Comm(),
        save=lambda: None,
        result=SimpleNamespace(last_checkpoint=None),
    )
    replanner = Replanner(cfg, cm, plan_is_own=False, rank=0)
    replanner.next_due = 99
    with caplog.at_level(logging.WARNING, logger="cephalo"):
        replanner._switch(trainer, make_plan(cm, 12), "test", 0.2, 0.0, _Metrics())
    assert trainer.plan is running and replanner.switches == []
    assert replanner.next_due == cfg.parallel.calibrate_after
    assert "stage the state of rank 1" in caplog.text


# ----------------------------------------------------------------------------- pipeline stages
STAGED_CLUSTER = "2xl4@node0,a6000@node1,2xt4@node2;inter=1GB/s"


def _staged_cm():
    """gpt-2.7b's units with 6 blocks on 3 nodes over a slow link: the planner stages it."""
    import dataclasses

    from cephalo.costmodel.sources import catalog_cost_model
    from cephalo.specs.catalog.models import get_model_spec
    from cephalo.specs.cluster import Cluster

    spec = dataclasses.replace(get_model_spec("gpt-2.7b"), num_layers=6)
    return catalog_cost_model(Cluster.parse(STAGED_CLUSTER), spec, 512, "fp16")


def _measured(truth, plan):
    """One step of `plan` on a cluster that runs as the cost model `truth` says: each rank's
    compute and optimizer, the rest of the pipeline's step waited (receives, the bubble)."""
    ranks = truth.evaluate(plan).ranks
    step = ranks[0].step_s  # a pipeline's step ends at once on every rank
    return RankStats(
        busy_s=[r.compute_s for r in ranks],
        comm_wait_s=[step - r.compute_s - r.optimizer_s for r in ranks],
        idle_s=[0.0] * len(ranks),
        peak_bytes=[r.peak_bytes - r.memory.reserve for r in ranks],
        optimizer_s=[r.optimizer_s for r in ranks],
        host_s=[0.0] * len(ranks),
        step_s=[step] * len(ranks),
    )


def test_a_staged_run_whose_stage_slows_calibrates_and_replans_its_stages(tmp_path, monkeypatch):
    """Issue 40: a staged plan (3 stages on 3 nodes, slow link) whose last stage's devices (the
    t4s) compute 4x slower from step 8 on. The refit reads the staged step as a flat one's (per
    rank compute, optimizer, the waits): it finds the t4s' x4 and nothing else, its stage times
    are then the throttled cluster's, and the re-plan (confirmed, as every switch) is the plan
    the planner makes for the throttled cluster itself, stages moved off the slow node."""
    from cephalo.planner.stages.search import make_staged_plan
    from cephalo.train.calibration import rebuilt, scaled_profile

    cm = _staged_cm()
    batch = 16
    start = make_staged_plan(cm, batch, stages="auto", model_name="gpt-2.7b")
    assert start.staged and len(start.stages) == 3
    slow = "t4"
    throttled = rebuilt(
        cm, {k: scaled_profile(p, 4.0 if k == slow else 1.0, 1.0) for k, p in cm.profiles.items()}
    )
    cfg = load_config(
        None,
        [
            f"--logging.dir={tmp_path}",
            "--parallel.plan=auto",
            "--parallel.stages=auto",
            "--model.name=gpt-2.7b",
            "--train.steps=22",
            f"--train.global_batch_size={batch}",
        ],
    )

    def switch(trainer, plan):
        trainer.plan = plan
        return 0.01, []

    monkeypatch.setattr("cephalo.train.replan.switch_plan", switch)
    trainer = SimpleNamespace(
        step=0,
        plan=start,
        comm=_Comm(),
        save=lambda: None,
        result=SimpleNamespace(last_checkpoint=None),
    )
    replanner = Replanner(cfg, cm, plan_is_own=True, rank=0)
    metrics = _Metrics()
    for s in range(1, 23):
        trainer.step = s
        replanner.after_step(trainer, _measured(throttled if s >= 8 else cm, trainer.plan), metrics)
    calibrations = [r for r in metrics.records if r["kind"] == "calibration"]
    first = calibrations[0]  # as profiled: the staged step's prediction is what ran
    assert first["step"] == 5 and not first["confirming"] and not first["replanned"]
    assert all(v == pytest.approx(1.0, abs=1e-6) for v in first["compute_scale"].values())
    # a stage's rank updates its share of its stage's parameters, not of the whole model's
    assert all(v == pytest.approx(1.0, abs=1e-6) for v in first["optimizer_scale"].values())
    assert first["sync_s"] == pytest.approx(0.0, abs=1e-6)
    assert first["current_predicted_step_s"] == pytest.approx(cm.evaluate(start).step_s)
    # steps 6-15 (8 of them throttled): the t4 stage x4, every other device as profiled
    seen, confirmed = calibrations[1], calibrations[2]
    assert seen["step"] == 15 and seen["confirming"]
    assert seen["compute_scale"][slow] == pytest.approx(4.0, rel=1e-6)
    assert all(v == pytest.approx(1.0) for k, v in seen["compute_scale"].items() if k != slow)
    assert seen["current_predicted_step_s"] == pytest.approx(throttled.evaluate(start).step_s)
    assert confirmed["step"] == 20 and confirmed["replanned"]
    assert [w.step for w in replanner.switches] == [20]
    expected = make_staged_plan(throttled, batch, stages="auto", model_name="gpt-2.7b")
    assert plan_key(trainer.plan) == plan_key(expected) != plan_key(start)
    assert trainer.plan.staged and trainer.plan.meta["calibrated"]["replaces"] == start.strategy
    gain = throttled.evaluate(start).step_s / throttled.evaluate(expected).step_s - 1.0
    assert confirmed["predicted_gain"] == pytest.approx(gain, rel=1e-6) and gain > 0.5


def test_a_staged_replan_keeps_to_the_jobs_stages_setting(tmp_path):
    """`parallel.stages = off` (a staged plan file run as such): the re-plan's candidates are
    today's (flat or shard groups), as `cephalo plan --stages off` makes them; and a job the
    pipeline cannot run (DPO) never gets a staged plan."""
    from cephalo.planner.shard_groups import make_hierarchical_plan

    cm = _staged_cm()
    for extra in (["--parallel.stages=off"], ["--parallel.stages=auto", "--train.objective=dpo"]):
        cfg = load_config(
            None,
            [f"--logging.dir={tmp_path}", "--model.name=gpt-2.7b", "--train.global_batch_size=16"]
            + extra,
        )
        plan = Replanner(cfg, cm, plan_is_own=True, rank=0).planned(cm)
        assert not plan.staged
        assert plan_key(plan) == plan_key(make_hierarchical_plan(cm, 16, model_name="gpt-2.7b"))
    # two plans that differ only in their stages are two plans
    from cephalo.planner.stages.search import make_staged_plan

    staged = make_staged_plan(cm, 16, stages="auto", model_name="gpt-2.7b")
    other = Plan.from_dict(staged.to_dict())
    other.stages[0].keep_gathered = not other.stages[0].keep_gathered
    assert plan_key(other) != plan_key(staged)
