"""Re-planning while training: calibrate the cost model from the running job, re-plan with
it, and switch every rank to the new plan at a step boundary without a restart.

    after each step: StepLog.add(gathered stats)
    at calibrate_after, then every calibrate_every steps: refit -> re-plan -> decide (rank 0)
    switch: new engine under the new plan -> state re-laid out (collectives) -> continue

Damping. A switch needs the gain to persist: two calibrations in a row, each fitted on its
own steps (StepLog.mark), must each predict the new plan at least `replan_min_gain` faster
than the running one (the plan is made from the second fit and checked against the first's).
The one that confirms comes early, `calibrate_after` steps after the first (a real change is
followed within calibrate_every + calibrate_after steps of being seen); a gain that one
window's noise or a passing stall predicted is not confirmed by the next, and the plan stays.
After a switch the log starts afresh: the old plan's measurements (other batches, micro-batches, shards)
never drive the new plan's fit, and the new plan must itself be measured twice before the job
moves again, so it cannot flip back and forth on every calibration. Nor does it go back to a plan
it left unless that plan's own measured step was `replan_min_gain` faster than the running
plan's now (`Replanner._went_slower`): one compute scale per device type cannot fit an error
that depends on the plan, so each plan's fit may predict the other faster.

The global batch of a step depends only on the step number (the data contract), so the new
plan trains exactly what the old one would have: a switch equals a checkpoint save + resume
under the new plan (tests/test_replan.py checks it to 1e-5).

Every rank holds the same gathered measurements, so every rank could decide alike; rank 0's
decision is nevertheless the one all take (one small all-gather), so that floating-point
differences between hosts can never split the job.

A switch that fails (out of memory while both engines exist, a lost rank) raises: under
`cephalo run --max-restarts N` the elastic agent restarts the job from its last checkpoint,
under the plan the config names (nothing is trained twice: metrics are truncated to it).
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from cephalo import envvars
from cephalo.costmodel.model import CostModel
from cephalo.errors import CephaloError, first_line
from cephalo.log import logger
from cephalo.planner.plan import Plan, RankPlan
from cephalo.runtime.collectives.shard_groups import saved_state
from cephalo.runtime.state.relayout import WINDOW_ELEMS, relayout, staged_bytes, to_host
from cephalo.train.calibration import Calibration, StepLog, predicted_step_s, refit
from cephalo.train.discovery import available_host_bytes


class _Trainer(Protocol):
    """What a switch reads and replaces in the trainer (train/trainer.py `_Trainer`)."""

    cfg: Any
    comm: Any
    rank: int
    step: int
    plan: Plan
    rank_plan: Any
    engine: Any
    result: Any
    run_dir: Path

    def make_engine(self, plan: Plan) -> Any: ...

    def write_run_files(self) -> None: ...

    def save(self) -> Path: ...


@dataclass
class Switch:
    """One re-plan that happened."""

    step: int
    """Steps done when the new plan took over (it runs from step + 1)."""
    reason: str
    predicted_gain: float | None
    seconds: float
    """Wall time of the switch: engine, re-layout, plan file (re-planning itself excluded)."""
    replan_s: float
    """Wall time of the calibration and re-planning before it."""
    batches: list[int]
    micro_batches: list[int]
    staged: list[int] = field(default_factory=list)
    """The ranks whose state waited in host memory while their engine was rebuilt
    (`must_stage`: each rank decides for its own device)."""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "replan", **vars(self)}


def switch_plan(trainer: _Trainer, plan: Plan) -> tuple[float, list[int]]:
    """Every rank (collective): continue `trainer`'s job under `plan` from the next step.
    Returns the seconds it took and the ranks that staged their state through the host
    (`must_stage`)."""
    started = time.perf_counter()
    plan.validate(world_size=trainer.comm.world_size, model=trainer.cfg.model.name)
    if plan.global_batch_size != trainer.plan.global_batch_size:
        raise CephaloError(
            f"a re-plan must keep the global batch of {trainer.plan.global_batch_size} (data contract), "
            f"the new plan has {plan.global_batch_size}"
        )
    # test hook, first attempt only: a restarted job gets past it (as CEPHALO_TEST_KILL_AT_STEP)
    if (
        os.environ.get(envvars.TEST_REPLAN_FAIL)
        and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    ):
        raise torch.OutOfMemoryError(f"{envvars.TEST_REPLAN_FAIL}: out of memory (test hook)")
    old = trainer.engine
    comm, device, extra = old.world, old.device, old.extra_state()
    pieces = saved_state(old)
    staged = must_stage(old, plan.ranks[trainer.rank], trainer.cfg.parallel.replan_staging)
    copied = staged_bytes(pieces) if staged else 0
    # every rank must be able to switch before any drops its engine: a rank whose host cannot
    # take its state (its device cannot hold both engines) keeps the whole job on its plan.
    # One all-gather: (stages, bytes its node lacks) of every rank
    short = host_shortfall(copied, old.ledger.host_budget_bytes, old.ledger.host_current_bytes)
    ranks = trainer.comm.all_gather_object((staged, short))
    if any(short for _, short in ranks):
        raise SwitchNotPossible(
            "the re-plan needs host memory to stage the state of "
            + ", ".join(
                f"rank {r} ({short / 2**30:.2f} GiB more than its node has free)"
                for r, (_, short) in enumerate(ranks)
                if short
            )
            + ", whose devices cannot hold both engines; the job stays on its plan (give the "
            "nodes more host memory, or set parallel.replan = off)"
        )
    if staged:
        # the old engine's device memory is free before the new one allocates: the state waits
        # on the host (one copy down; the re-layout reads it from there)
        freed = old.ledger.current_bytes
        pieces = to_host(pieces)
        old.close()  # its process sub-groups (hierarchical plans): the new engine makes its own
        trainer.engine = old = None
        release_device_memory(device)
        logger.info(
            "rank %d: the re-plan stages the state through host memory (%.2f GiB copied, "
            "%.2f GiB of device memory freed) before the new engine allocates",
            trainer.rank,
            copied / 2**30,
            freed / 2**30,
        )
    new = trainer.make_engine(plan)
    relayout(pieces, new.sharded_state(), comm, device)
    del pieces
    new.state_written()
    new.load_extra_state(extra)
    trainer.engine, trainer.plan, trainer.rank_plan = new, plan, plan.ranks[trainer.rank]
    trainer.result.plan = plan
    if old is not None:
        old.close()  # its process sub-groups: a re-plan every few steps must not pile them up
    del old
    trainer.write_run_files()  # rank 0: plan.json is the plan now running
    return time.perf_counter() - started, [r for r, (stages, _) in enumerate(ranks) if stages]


class SwitchNotPossible(CephaloError):
    """Every rank agreed before anything changed: the job goes on under its plan."""


def host_shortfall(copied: int, host_budget: int | None = None, host_held: int = 0) -> int:
    """Bytes this rank's node lacks to stage `copied` bytes on every one of its ranks (the
    ranks of a node stage at once: `LOCAL_WORLD_SIZE` of torchrun, each about as much);
    0 where it has room or cannot tell. An emulated node has a host of its own: its budget
    (`host_budget`, this rank's share, of which the engine holds `host_held`), not the
    machine's available memory, which all the emulated nodes share."""
    if copied <= 0:
        return 0
    if host_budget is not None:
        return max(0, host_held + copied - host_budget)
    available = available_host_bytes()
    if available is None:
        return 0
    need = copied * int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(0, need - available)


def must_stage(old: Any, rank_plan: RankPlan, mode: str) -> bool:
    """Whether a switch frees the old engine before building the new one (`parallel.
    replan_staging`). `auto`: when the device cannot hold the new plan's predicted peak for
    this rank (the planner's `predicted_peak_memory_bytes`; unknown: assume it cannot) and the
    re-layout's window beside what the old engine holds: free CUDA memory, the caching
    allocator's unused reserve included, or an emulated device's budget. A device without a
    limit (a plain CPU rank) never stages."""
    if mode != "auto":
        return mode == "host"
    need = rank_plan.predicted_peak_memory_bytes
    window = WINDOW_ELEMS * 4
    device = old.device
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return need is None or need + window > free
    budget = old.ledger.budget_bytes
    if budget is None:
        return False
    return need is None or old.ledger.current_bytes + need + window > budget


def release_device_memory(device: torch.device) -> None:
    """Return a dropped engine's memory: its reference cycles collected now (not at some later
    collection), and on CUDA the caching allocator's blocks handed back, so that the new
    engine, whose buffers have other sizes, finds them free."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _forced(step: int) -> Plan | None:
    """Test hook `CEPHALO_TEST_REPLAN=STEP:PLAN.json[,STEP:PLAN.json...]`: that plan after
    that step."""
    for item in filter(None, os.environ.get(envvars.TEST_REPLAN, "").split(",")):
        at, _, path = item.partition(":")
        if int(at) == step:
            return Plan.from_json(path)
    return None


class Replanner:
    """Calibration and re-planning of one job (the same object state on every rank)."""

    def __init__(self, cfg, cost_model: CostModel | None, plan_is_own: bool, rank: int):
        p = cfg.parallel
        self.cfg, self.rank = cfg, rank
        self.cost_model = cost_model
        self.log = StepLog()
        self.switches: list[Switch] = []
        self.last_calibration: Calibration | None = None
        """The newest refit (older ones are dropped: each holds a cost model)."""
        self.sync_s = 0.0
        """The newest refit's synchronisation per step (`Calibration.sync_s`)."""
        self.next_due: int | None = p.calibrate_after
        """Steps logged under the running plan at which the next calibration comes (None: no more)."""
        self.pending_gain: float | None = None
        """The gain the previous calibration predicted and the next must confirm (None: none)."""
        self.left: dict[tuple, tuple[int, float]] = {}
        """Plans this job ran and switched away from (`plan_key`): the step it left each after
        and its median measured step there. A plan's own measurement outranks a prediction
        of it, so the job does not go back to a plan it measured slower (see `_went_slower`)."""
        wanted = p.replan == "auto" or (p.replan == "own" and plan_is_own)
        self.enabled = wanted and cost_model is not None
        if rank == 0 and wanted and cost_model is None:
            logger.info(
                "parallel.replan: no cost model for this plan (no profiles): not re-planning"
            )
        if self.enabled and p.calibrate_after >= cfg.train.steps:
            if rank == 0:
                logger.info(
                    "parallel.calibrate_after = %d >= train.steps = %d: no calibration in this run",
                    p.calibrate_after,
                    cfg.train.steps,
                )
            self.enabled = False

    def _due(self) -> bool:
        return len(self.log.steps) == self.next_due

    def _schedule(self, confirming: bool) -> int:
        """After a calibration: steps until the next one (0: none). A gain to confirm is
        checked early, on as many fresh steps as a plan's first calibration reads."""
        p = self.cfg.parallel
        if confirming:
            return min(p.calibrate_after, p.calibrate_every or p.calibrate_after)
        return p.calibrate_every

    def after_step(self, trainer: _Trainer, ranks, metrics) -> None:
        """Record the step's gathered stats; calibrate, re-plan and switch when due."""
        self.log.add(ranks)
        forced = _forced(trainer.step)
        if forced is not None:
            self._switch(trainer, forced, "test hook", None, 0.0, metrics)
            return
        if not self.enabled or not self._due():
            return
        last = trainer.step >= self.cfg.train.steps  # calibrated and logged, not re-planned
        started = time.perf_counter()
        # the previous calibration's fit (on other, earlier steps)
        before, before_sync = self.cost_model, self.sync_s
        calibration = refit(self.cost_model, trainer.plan, self.log, self.sync_s)
        now_s = self.log.job_step_s()  # the running plan as measured, on the steps just read
        self.log.mark()  # the next calibration reads only the steps after these
        self.cost_model, self.sync_s = calibration.cost_model, calibration.sync_s
        self.last_calibration = calibration
        current = predicted_step_s(calibration.cost_model, trainer.plan, self.sync_s)
        candidate, gain, why_not = (
            (None, None, "the run's last step")
            if last
            else self._replan(calibration.cost_model, current, trainer.plan)
        )
        if candidate is not None and (back := self._went_slower(candidate, now_s)):
            candidate, why_not = None, back
        earlier = None
        if candidate is not None and self.pending_gain is not None:
            # the previous calibration saw a gain too: does its fit, on its own steps, predict
            # this very plan faster by the margin? (Two windows that blame different ranks
            # each predict a gain, for opposite plans: that is noise, not a change.)
            before_s = predicted_step_s(before, candidate, before_sync)
            running_s = predicted_step_s(before, trainer.plan, before_sync)
            earlier = running_s / before_s - 1.0 if before_s else 0.0
            if earlier < self.cfg.parallel.replan_min_gain:
                earlier = None
        pending = None
        if candidate is not None and earlier is None:
            # a first sighting: switch only if the next calibration, on fresh steps, agrees
            candidate, pending = None, gain
            why_not = (
                f"a new plan would gain {gain:.1%}; confirming on the next "
                f"{self._schedule(confirming=True)} steps before switching"
            )
        # rank 0 decides for everyone, the schedule of the next calibration included: ranks
        # that calibrated at different steps would deadlock in this very all-gather
        decided, pending, gain, earlier = trainer.comm.all_gather_object(
            (candidate.to_dict() if candidate else None, pending, gain, earlier)
        )[0]
        self.pending_gain = pending
        every = self._schedule(confirming=pending is not None)
        self.next_due = len(self.log.steps) + every if every else None
        replan_s = time.perf_counter() - started
        if self.rank == 0:
            for fit in calibration.ranks:
                logger.info("calibration after step %d: %s", trainer.step, fit.line())
            changes = calibration.changes()
            logger.info(
                "calibration after step %d: %s; %s",
                trainer.step,
                ", ".join(changes) if changes else "the cost model matched",
                f"re-planning (predicted gain {gain:.1%}, {earlier:.1%} by the calibration before)"
                if decided
                else why_not,
            )
        if metrics is not None:
            metrics.write(
                {
                    "kind": "calibration",
                    "step": trainer.step,
                    **calibration.to_dict(),
                    "current_predicted_step_s": current,
                    # the plan calibrated (the running one)
                    "batches": trainer.plan.batch_sizes,
                    "micro_batches": [r.micro_batch_size for r in trainer.plan.ranks],
                    # a staged plan's stages: [ranks, [first unit, last unit]] each
                    "stages": [[st.ranks, list(st.units)] for st in trainer.plan.stages]
                    if trainer.plan.staged
                    else None,
                    "predicted_gain": gain,
                    "confirming": pending is not None,
                    "replanned": decided is not None,
                    "why_not": None if decided else why_not,
                }
            )
        if decided is not None:
            reason = (
                f"calibration predicts {gain:.1%} faster steps, {earlier:.1%} by the calibration "
                f"before ({', '.join(calibration.changes())})"
            )
            self._switch(trainer, Plan.from_dict(decided), reason, gain, replan_s, metrics)

    def _went_slower(self, candidate: Plan, now_s: float) -> str:
        """Why not to go back to `candidate` ("" if it is new, or measured fast enough): a plan
        the job ran before and left, whose measured step there was not `replan_min_gain` faster
        than the running plan's now. Calibration fits one compute scale per device type, so a
        profile whose error depends on the plan (its curve's shape over micro-batch sizes, a
        rank's memory pressure) makes each plan's fit predict the other faster, and the job
        would flip between them; the measurement of that very plan settles it. (Measured at
        another time, under another load: a plan left because a device slowed down was fast
        then, so this never blocks going back to it when the device recovers, and the fit
        itself still has to predict the gain.)"""
        seen = self.left.get(plan_key(candidate))
        if seen is None:
            return ""
        step, measured_s = seen
        if now_s / measured_s - 1.0 >= self.cfg.parallel.replan_min_gain:
            return ""
        return (
            f"keeping the plan (the new one is the plan run until step {step}, measured at "
            f"{measured_s:.3f} s per step there against {now_s:.3f} s now: not going back)"
        )

    def _replan(
        self, cm: CostModel, current_s: float, running: Plan
    ) -> tuple[Plan | None, float | None, str]:
        """(the new plan or None, its predicted gain, why not)."""
        from cephalo.errors import PlanDoesNotFit

        p = self.cfg.parallel
        try:
            plan = self.planned(cm)
        except PlanDoesNotFit as e:
            return None, None, f"no plan fits the measured memory ({e})"
        except CephaloError as e:  # (parallel.stages = N on a cluster of fewer nodes)
            return None, None, f"no new plan ({first_line(e)})"
        new_s = predicted_step_s(cm, plan, self.sync_s)
        gain = current_s / new_s - 1.0 if new_s > 0 else 0.0
        if gain < p.replan_min_gain:
            return (
                None,
                gain,
                (
                    f"keeping the plan (a new one would gain {gain:.1%} < parallel.replan_min_gain "
                    f"{p.replan_min_gain:.0%})"
                ),
            )
        # where the profiles came from stays true of the new plan; say what it replaced
        plan.meta = {**{k: v for k, v in running.meta.items() if k == "profiles"}, **plan.meta}
        plan.meta["calibrated"] = {"replaces": running.strategy, "predicted_gain": gain}
        return plan, gain, ""

    def planned(self, cm: CostModel) -> Plan:
        """The plan `cephalo plan` makes with `cm` for this job: flat, shard groups and, as
        `parallel.stages` allows, pipeline stages (`make_staged_plan`, the candidates of the
        job's automatic plan), the fastest predicted. A staged candidate the job cannot run
        (`stage_refusals`: its mode, objective, adapter) is not one: today's plan then."""
        from cephalo.planner.plan import check_stages_runnable
        from cephalo.planner.stages.search import make_staged_plan
        from cephalo.train.config import stage_refusals

        p = self.cfg.parallel
        refusals = stage_refusals(self.cfg)
        kw = dict(
            hierarchy=p.hierarchy,
            reduce_dtype=p.cross_node_reduce_dtype,
            model_name=self.cfg.model.name,
        )
        batch = self.cfg.train.global_batch_size
        plan = make_staged_plan(cm, batch, stages="off" if refusals else p.stages, **kw)
        if plan.staged:
            try:
                check_stages_runnable(plan, "the re-plan", refusals)
            except CephaloError:
                plan = make_staged_plan(cm, batch, stages="off", **kw)
        return plan

    def _switch(self, trainer, plan: Plan, reason: str, gain, replan_s: float, metrics) -> None:
        every = self.cfg.checkpoint.every
        if not (every and trainer.step % every == 0):
            trainer.save()  # a failed switch then restarts from this very step: nothing lost
        old_plan = trainer.plan
        try:
            seconds, staged = switch_plan(trainer, plan)
        except SwitchNotPossible as e:
            if self.rank == 0:
                logger.warning("after step %d: %s", trainer.step, e)
            # measured afresh before it is proposed again (as after a switch)
            self.log.clear()
            self.next_due, self.pending_gain = self.cfg.parallel.calibrate_after, None
            return
        except (RuntimeError, CephaloError) as e:
            raise CephaloError(
                f"rank {self.rank}: the re-plan after step {trainer.step} failed ({first_line(e)}); "
                f"the job stops with its checkpoint {trainer.result.last_checkpoint}: under "
                "`cephalo run --max-restarts N` it restarts from there under the configured plan, "
                "else resume with checkpoint.resume = auto (parallel.replan = off to stay on it)"
            ) from e
        if len(self.log.steps) > 1:  # the plan left, as measured (its first step warms up)
            measured_s = statistics.median(max(r.step_s for r in st) for st in self.log.steps[1:])
            self.left[plan_key(old_plan)] = (trainer.step, measured_s)
        self.log.clear()  # the old plan's measurements do not describe the new one
        self.next_due, self.pending_gain = self.cfg.parallel.calibrate_after, None
        event = Switch(
            trainer.step,
            reason,
            gain,
            seconds,
            replan_s,
            plan.batch_sizes,
            [r.micro_batch_size for r in plan.ranks],
            staged,
        )
        self.switches.append(event)
        if self.rank == 0:
            logger.info(
                "re-planned after step %d (%s) in %.2f s + %.2f s switch: batches %s, micro-batches %s",
                trainer.step,
                reason,
                replan_s,
                seconds,
                event.batches,
                event.micro_batches,
            )
        if metrics is not None:
            metrics.write(event.to_dict())


def plan_key(plan: Plan) -> tuple:
    """What makes two plans the same plan to run: every rank's batch, micro-batch, shard,
    host state, offload and reduce overlap, and a staged plan's stages (ranks, units, kept
    gathered), schedule and micro-batch count."""
    stages = tuple((tuple(st.ranks), tuple(st.units), st.keep_gathered) for st in plan.stages or [])
    return (
        stages,
        plan.schedule if stages else None,
        plan.num_micro_batches if stages else None,
    ) + tuple(
        (
            r.batch_size,
            r.micro_batch_size,
            round(r.state_fraction, 6),
            round(r.host_state_fraction, 6),
            r.offload_activations,
            r.overlap_reduce,
        )
        for r in plan.ranks
    )


def catalog_model_or_none(cfg, model_spec, cluster) -> CostModel | None:
    """The cost model to calibrate for a plan cephalo did not profile for (`even`,
    `proportional`, a plan file) under `parallel.replan = auto`: the catalog's profiles of the
    cluster's devices, or None where the catalog has none (an emulated CPU)."""
    if cfg.parallel.replan != "auto" or cfg.parallel.plan == "auto":
        return None
    from cephalo.costmodel.sources import catalog_cost_model

    try:
        kw = {}
        if cfg.parallel.backend == "gloo":  # GPUs forced onto gloo: the engine pads nothing
            kw["padded_collectives"] = False
        return catalog_cost_model(cluster, model_spec, cfg.data.seq_len, cfg.model.dtype, **kw)
    except CephaloError:
        return None
