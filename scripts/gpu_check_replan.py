"""scripts/gpu_check.py's `replan_staging` check: a re-plan that stages the training state
through host memory (train/replan.py `must_stage`, `parallel.replan_staging = host`) on the
GPU. The state goes down from CUDA to the host, the old engine's device memory is handed back
before the new engine allocates (measured with torch.cuda.memory_allocated), the re-layout
reads the host copies into CUDA windows, and training goes on with the same losses as a
switch that keeps both engines on the device. On the CPU (`--cpu`) the same runs compare the
two paths without the memory figure."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import torch

BATCH = 4
STEPS = 2


class _Job:
    """The part of a trainer `switch_plan` reads and replaces, around real engines."""

    def __init__(self, setup, staging: str, plans):
        self.setup, self.plans = setup, plans
        self.cfg = SimpleNamespace(
            model=SimpleNamespace(name=plans[0].model),
            parallel=SimpleNamespace(replan_staging=staging),
        )
        self.comm, self.rank, self.step = setup.comm, 0, 0
        self.plan, self.rank_plan = plans[0], plans[0].ranks[0]
        self.result = SimpleNamespace(plan=self.plan)
        self.old: weakref.ref | None = None
        self.allocated_at_build: int | None = None
        self.alive_at_build: bool | None = None
        self.engine = self.make_engine(self.plan)

    def make_engine(self, plan):
        from cephalo.modeling.registry import build_model
        from cephalo.runtime.engine.engine import Engine, EngineConfig

        gc.collect()
        self.alive_at_build = self.old is not None and self.old() is not None
        if self.setup.cuda:
            torch.cuda.synchronize(self.setup.device)
            self.allocated_at_build = torch.cuda.memory_allocated(self.setup.device)
        torch.manual_seed(0)
        model = build_model(plan.model, dropout=0.0)
        return Engine(model, plan, self.comm, EngineConfig(device=str(self.setup.device), seed=0))

    def write_run_files(self) -> None:
        pass


def _plans(setup):
    from cephalo.planner.plan import Plan, RankPlan

    seq = 32 if setup.big_model == "gpt-tiny" else setup.seq

    def plan(micro: int, host: float) -> Plan:
        rank = RankPlan(0, "gpu", BATCH, micro, -(-BATCH // micro), 1.0)
        rank.host_state_fraction = host
        return Plan("manual", setup.big_model, seq, BATCH, setup.low, [rank])

    return plan(BATCH, 0.0), plan(2, 0.5), seq


def _run(setup, staging: str):
    from cephalo.train.replan import switch_plan

    first, second, seq = _plans(setup)
    job = _Job(setup, staging, [first, second])
    vocab = 50257 if setup.cuda else 256
    gen = torch.Generator().manual_seed(0)
    losses = []
    before = None
    for k in range(2 * STEPS):
        if k == STEPS:
            if setup.cuda:
                torch.cuda.synchronize(setup.device)
                before = torch.cuda.memory_allocated(setup.device)
            job.old = weakref.ref(job.engine)
            _, staged = switch_plan(job, second)
        x = torch.randint(0, vocab, (BATCH, seq), generator=gen)
        losses.append(job.engine.train_step(x, torch.roll(x, -1, dims=1), 1e-3).loss)
    return losses, staged, job, before


def check_replan_staging(setup) -> tuple[list[str], str]:
    failures: list[str] = []
    direct, direct_staged, _, _ = _run(setup, "device")
    staged, was_staged, job, before = _run(setup, "host")
    if direct_staged != [] or was_staged != [0]:
        failures.append(f"ranks that staged: {direct_staged}, {was_staged}; expected [], [0]")
    if job.alive_at_build:
        failures.append("the old engine was still alive when the new one was built")
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(staged, direct, strict=True))
    if worst > 1e-5:
        failures.append(f"losses after a staged switch differ by {worst:.2e} (relative)")
    note = f"losses equal to {worst:.1e}"
    if setup.cuda and before is not None and job.allocated_at_build is not None:
        freed = before - job.allocated_at_build
        state = job.engine.state_bytes()  # the same model: the old engine's state was as large
        note += (
            f"; {freed / 2**20:.0f} MiB freed before the new engine (state {state / 2**20:.0f} MiB)"
        )
        if freed < 0.5 * state:  # the old engine, still alive, would free about nothing
            failures.append(
                f"only {freed / 2**20:.0f} MiB of device memory was freed before the new engine "
                f"allocated; the old engine's state alone held {state / 2**20:.0f} MiB"
            )
    return failures, note
