"""A re-plan that stages the state through host memory (train/replan.py `must_stage`): the old
engine is gone before the new one allocates, and the job goes on exactly as a switch that keeps
both engines alive (tests/test_replan.py checks that one against checkpoint + resume)."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from cephalo.modeling.registry import build_model
from cephalo.planner.plan import Plan, RankPlan
from cephalo.runtime.collectives.comm import LocalComm
from cephalo.runtime.engine.engine import Engine, EngineConfig
from cephalo.runtime.state.relayout import WINDOW_ELEMS
from cephalo.train.replan import must_stage, switch_plan

SEQ, BATCH = 16, 4


def _plan(micro: int, host: float = 0.0, offload: bool = False) -> Plan:
    rank = RankPlan(0, "cpu", BATCH, micro, -(-BATCH // micro), 1.0, offload_activations=offload)
    rank.host_state_fraction = host
    return Plan("manual", "gpt-tiny", SEQ, BATCH, "fp32", [rank])


def _engine(plan: Plan, budget: int | None = None) -> Engine:
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0)
    return Engine(model, plan, LocalComm(), EngineConfig(seed=0, memory_budget_bytes=budget))


class _Trainer:
    """What `switch_plan` reads and replaces (train/replan.py `_Trainer`), around real engines;
    `alive_at_build` records whether the old engine still existed when the new one was made."""

    def __init__(self, staging: str):
        self.cfg = SimpleNamespace(
            model=SimpleNamespace(name="gpt-tiny"),
            parallel=SimpleNamespace(replan_staging=staging),
        )
        self.comm, self.rank, self.step = LocalComm(), 0, 0
        self.plan = _plan(4)
        self.rank_plan = self.plan.ranks[0]
        self.engine = _engine(self.plan)
        self.result = SimpleNamespace(plan=self.plan)
        self.alive_at_build: bool | None = None
        self._old: weakref.ref | None = None

    def make_engine(self, plan: Plan) -> Engine:
        gc.collect()
        self.alive_at_build = self._old is not None and self._old() is not None
        return _engine(plan)

    def write_run_files(self) -> None:
        pass

    def train(self, batches) -> list[float]:
        return [self.engine.train_step(x, y, 1e-2).loss for x, y in batches]

    def switch(self, plan: Plan) -> list[int]:
        self._old = weakref.ref(self.engine)
        _, staged = switch_plan(self, plan)
        return staged


def _batches(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, 256, (BATCH, SEQ), generator=gen)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def test_staged_switch_frees_the_old_engine_first_and_trains_alike():
    """Two switches (to micro-batches of 2 with half the state on the host and offloaded
    boundaries, then back to one micro-batch): staged through the host and not, the same
    losses bit for bit and the same parameters; staged, the old engine is collected before the
    new one is built, and not otherwise."""
    runs = {}
    for staging in ("host", "device"):
        t = _Trainer(staging)
        losses = t.train(_batches(2, 1))
        staged = [t.switch(_plan(2, host=0.5, offload=True))]
        losses += t.train(_batches(2, 2))
        alive = [t.alive_at_build]
        staged.append(t.switch(_plan(4)))
        alive.append(t.alive_at_build)
        losses += t.train(_batches(2, 3))
        runs[staging] = (losses, t.engine.full_state_dict(), staged, alive, t.engine.step_index)
    host, device = runs["host"], runs["device"]
    assert host[2] == [[0], [0]] and host[3] == [False, False]
    assert device[2] == [[], []] and device[3] == [True, True]
    assert host[0] == device[0], "staging changed the losses"
    assert host[4] == device[4] == 6, "the step count must carry over the switches"
    for name, value in device[1].items():
        assert torch.equal(host[1][name], value), name


def test_auto_stages_when_the_budget_cannot_hold_both_engines():
    """`auto` on an emulated device: stage exactly when what the old engine holds, the new
    plan's predicted peak and the re-layout window exceed the budget; an unknown peak
    stages; a device without a budget never does."""
    old = _engine(_plan(4), budget=1 << 40)
    held = old.ledger.current_bytes
    assert held > 0
    need = 10 << 20
    rank = _plan(2).ranks[0]
    rank.predicted_peak_memory_bytes = need
    fits = held + need + WINDOW_ELEMS * 4
    old.ledger.budget_bytes = fits
    assert not must_stage(old, rank, "auto")
    old.ledger.budget_bytes = fits - 1
    assert must_stage(old, rank, "auto")
    assert not must_stage(old, rank, "device") and must_stage(old, rank, "host")
    rank.predicted_peak_memory_bytes = None
    old.ledger.budget_bytes = 1 << 40
    assert must_stage(old, rank, "auto"), "an unknown peak must stage"
    old.ledger.budget_bytes = None
    assert not must_stage(old, rank, "auto"), "no budget: nothing to free"


@pytest.mark.parametrize("value", ["gpu", "always"])
def test_bad_staging_value_is_one_clear_error(value):
    from cephalo.errors import CephaloError
    from cephalo.train.config_manager import load_config

    with pytest.raises(CephaloError, match="replan_staging"):
        load_config(None, [f"--parallel.replan_staging={value}"])


def test_no_room_on_the_host_keeps_the_job_on_its_plan(monkeypatch):
    """A rank that must stage but whose node's host memory cannot take its state: every rank
    learns it before anything is dropped, the switch does not happen (one clear message), and
    the old engine trains on."""
    import cephalo.train.replan as replan

    monkeypatch.setattr(replan, "staged_bytes", lambda pieces: 3 << 30)
    monkeypatch.setattr(replan, "available_host_bytes", lambda: 1 << 30)
    t = _Trainer("host")
    before = t.train(_batches(1, 1))
    engine, plan = t.engine, t.plan
    with pytest.raises(replan.SwitchNotPossible, match=r"rank 0 \(2\.00 GiB more"):
        switch_plan(t, _plan(2))
    assert t.engine is engine and t.plan is plan
    assert t.train(_batches(1, 2))[0] != before[0]  # it trains on


def test_host_shortfall_counts_every_rank_of_the_node(monkeypatch):
    import cephalo.train.replan as replan

    monkeypatch.setattr(replan, "available_host_bytes", lambda: 10 << 30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert replan.host_shortfall(2 << 30) == 0
    assert replan.host_shortfall(3 << 30) == 2 << 30
    assert replan.host_shortfall(0) == 0
    monkeypatch.setattr(replan, "available_host_bytes", lambda: None)
    assert replan.host_shortfall(3 << 30) == 0, "unknown: do not block"
