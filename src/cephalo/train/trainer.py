"""The training loop: `train(cfg)` runs on every rank (under torchrun or `cephalo run`).

    process group -> model (meta) -> plan -> engine -> data -> [resume] -> steps -> checkpoint

Every rank builds the same model, the same plan and the same data view from the same config;
rank i then reads only its slice of each global batch (`plan.batch_offsets()[i]`, its
`batch_size` samples). Since the global batch of step t depends only on t, the learning
rate only on t, and the engine's dropout masks only on (seed, t, sample), the run's loss
trajectory is the same under any plan and continues exactly after a resume.

Step numbers: step n (1-based) is the n-th optimizer step; it reads global batch n-1 and
uses learning rate schedule(n-1). A checkpoint `step_000010` holds the state after step 10.

Rank 0 writes the run directory (`logging.dir`): the resolved config.toml, plan.json,
metrics.jsonl (docs/training.md lists the fields) and, by default, checkpoints/.

Test hook (documented in docs/training.md): with `CEPHALO_TEST_KILL_AT_STEP=N`, rank
`CEPHALO_TEST_KILL_RANK` (default 1, or 0 in a one-process job) kills itself with SIGKILL
just before step N, to test crash recovery (in the first attempt only: under restarts the
resumed job gets past it). With `CEPHALO_TEST_OOM_AT_STEP=N`, that rank raises an
out-of-memory error at step N instead, to test that the other ranks stop at once.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cephalo import envvars
from cephalo.costmodel.host import check_host_memory
from cephalo.costmodel.memory import device_reserve_bytes
from cephalo.costmodel.model import CostModel
from cephalo.costmodel.stages import STAGE_PROCESS_GROUPS
from cephalo.data.batches import rank_rows, rank_val_rows
from cephalo.data.job import open_batches, resolve_job_dataset
from cephalo.data.text import default_cache_dir
from cephalo.errors import CephaloError
from cephalo.launch.preempt import StopSignals, TimedSaves, stop_note
from cephalo.log import init_logging, logger
from cephalo.modeling.lora import adapter_settings, apply_adapter
from cephalo.modeling.registry import build_model, initial_weights_note
from cephalo.modeling.units import UnitModel
from cephalo.planner.makers import simple_plan
from cephalo.planner.plan import Plan, check_stages_runnable
from cephalo.planner.rank_match import describe_remap, match_plan, plan_devices
from cephalo.preference.job import PreferenceRun
from cephalo.runtime.collectives.comm import Comm
from cephalo.runtime.collectives.dist import init_distributed, peer_failure, startup_barrier
from cephalo.runtime.collectives.shard_groups import emulate_links, saved_state
from cephalo.runtime.device_memory import (
    EmulatedDeviceMemory,
    host_memory,
    out_of_memory_message,
    outside_allocator_bytes,
    reserve_note,
    startup_out_of_memory,
)
from cephalo.runtime.emulation import drifted_slowdown, start_delay_s
from cephalo.runtime.engine.engine import Engine, StepStats
from cephalo.runtime.step_timing import format_split, split_step
from cephalo.specs.cluster import Cluster, Device
from cephalo.train.checkpoint import load_checkpoint, resume_target, save_checkpoint
from cephalo.train.config import JobConfig, preflight, stage_refusals, steps_for_epochs
from cephalo.train.config_manager import config_to_toml, engine_config
from cephalo.train.discovery import (
    discover_cluster,
    is_emulated,
    job_torch_device,
    node_local_config,
    node_view,
)
from cephalo.train.doctor import OK, checkpoint_check
from cephalo.train.lr import LRSchedule
from cephalo.train.metrics import (
    TRACKERS,
    MetricsLog,
    ProgressDisplay,
    RankStats,
    StepRecord,
    TrackerSettings,
    require_tensorboard,
    truncate_metrics,
)
from cephalo.train.replan import Replanner, catalog_model_or_none

PLAN_FILE = "plan.json"
CONFIG_FILE = "config.toml"
# Per-rank values gathered each step for the metrics: busy, comm wait, step time, peak bytes,
# optimizer, host; then the stop flags every rank decides on (launch/preempt.py): a signal
# received, a time-based save due (rank 0's clock).
_RANK_FIELDS = 8


@dataclass
class TrainResult:
    """What `train` did (the same on every rank, except `rank`)."""

    rank: int
    world_size: int
    run_dir: Path
    plan: Plan
    start_step: int
    """Steps already done when this run started (from a resumed checkpoint), else 0."""
    final_step: int
    """Steps done when it ended."""
    losses: dict[int, float] = field(default_factory=dict)
    """Training loss of each step this run executed, by 1-based step number."""
    val_losses: dict[int, float] = field(default_factory=dict)
    """Validation loss by step number."""
    last_checkpoint: Path | None = None
    tokens_per_s: float = 0.0
    """Mean throughput over the run's steps (the first step, which warms up, excluded if possible)."""
    replans: list[dict[str, Any]] = field(default_factory=list)
    """Each switch to a new plan during the run: when, why, how long (train/replan.py)."""
    stopped_by: str | None = None
    """The signal that stopped the run before `train.steps` (saved at `final_step`), else None."""
    stop_note: str | None = None
    """What rank 0 says of that stop (where it saved): launch/preempt.py `stop_note`."""
    device_peak_bytes: int | None = None
    """This rank's peak of emulated device memory over the whole job (profiling, engine, steps,
    checkpoints; its reserve included): `runtime.device_memory`. None: not emulated, or
    `CEPHALO_STRICT_MEMORY=0`."""
    profile_peak_bytes: int | None = None
    """Of that, the peak up to the end of `parallel.plan = auto`'s profiling; else None."""


# ----------------------------------------------------------------------------- cluster and plan
def resolve_plan(
    cfg: JobConfig,
    cluster: Cluster,
    world_size: int,
    rank: int = 0,
    model_shape: str | None = None,
) -> Plan:
    """The plan `parallel.plan` names (`even`, `proportional` or a plan file), checked against
    this job (world size, model: by its `model_shape` fingerprint where the plan file records
    one, so not by how its path is spelled; global batch) and matched to the devices that came up: a plan
    file's rank-plans reordered where the ranks came up in another order than its devices,
    refused where its devices are not the discovered ones (planner/rank_match.py). `auto` is
    `auto_plan`'s."""
    choice = cfg.parallel.plan
    seq_len, batch, dtype = cfg.data.seq_len, cfg.train.global_batch_size, cfg.model.dtype
    if choice in ("even", "proportional"):
        return simple_plan(choice, cluster, cfg.model.name, seq_len, batch, dtype)
    if choice == "auto":
        raise CephaloError(
            "parallel.plan = auto is made by `auto_plan` (it profiles on every rank)"
        )
    plan = Plan.from_json(choice)
    check_stages_runnable(plan, f"plan {choice}", stage_refusals(cfg))
    plan.validate(world_size=world_size, model=cfg.model.name, model_shape=model_shape)
    if plan.global_batch_size != batch:
        raise CephaloError(
            f"plan {choice} splits a global batch of {plan.global_batch_size} but train.global_batch_size is "
            f"{batch}: set train.global_batch_size = {plan.global_batch_size} or make a plan for {batch}"
        )
    matched, order = match_plan(plan, cluster, choice)
    if order is not None and rank == 0:
        logger.info("plan %s: %s", choice, describe_remap(order, plan_devices(plan)))
    return matched


def auto_plan(
    cfg: JobConfig, model: UnitModel, cluster: Cluster, comm: Comm
) -> tuple[Plan, CostModel]:
    """`parallel.plan = auto`: profile every device type of the job (collective; cached in
    the profile database `cfg.profile_cache`, so a second run is instant), then the cephalo
    plan from the measured cost model (returned too: calibration refits it). Every rank gets
    the same profiles (broadcast by the profiler) and the planner is deterministic, so every
    rank makes the same plan; one tiny all-reduce checks it."""
    from cephalo.costmodel.sources import measured_cost_model
    from cephalo.planner.stages.search import make_staged_plan
    from cephalo.profiling.profiler import profile_devices
    from cephalo.specs.adapter import ALL_LINEAR, adapter_spec

    seq_len, batch, dtype = cfg.data.seq_len, cfg.train.global_batch_size, cfg.model.dtype
    measured = profile_devices(
        model,
        seq_len,
        dtype,
        cluster,
        comm,
        settings=cfg.profile,
        cache=cfg.profile_cache,
        device=job_torch_device(cfg, comm),
        startup_timeout_s=cfg.parallel.startup_timeout_s,
        compile_mode=cfg.parallel.compile,
    )
    targets = cfg.model.lora_target_modules
    cost_model = measured_cost_model(
        cluster,
        model.spec,
        seq_len,
        dtype,
        measured,
        # the job's adapter: frozen base bytes, adapter state, a backward without base grads
        adapter=adapter_spec(
            cfg.model.adapter,
            cfg.model.lora_r,
            targets[0] if list(targets) == [ALL_LINEAR] else targets,
            cfg.train.objective,  # DPO: a sample is 2 sequences (and the LoRA reference)
        ),
        # the engine pads near-even splits exactly where this comm has the even collectives
        # (EngineConfig.padded_collectives' default): the planner charges it there
        padded_collectives=comm.even_gather,
    )
    plan = make_staged_plan(
        cost_model,
        batch,
        stages=cfg.parallel.stages,
        hierarchy=cfg.parallel.hierarchy,
        reduce_dtype=cfg.parallel.cross_node_reduce_dtype,
        model_name=cfg.model.name,
    )
    check_stages_runnable(plan, "the automatic plan (parallel.stages)", stage_refusals(cfg))
    plan.meta["profiles"] = {
        "measured": measured.measured,
        "cached": measured.cached,
        "database": str(cfg.profile_cache),
    }
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if comm.backend == "nccl"
        else torch.device("cpu")
    )
    mine = torch.tensor(
        plan.batch_sizes + [r.micro_batch_size for r in plan.ranks],
        dtype=torch.float64,
        device=device,
    )
    agreed = mine.clone()
    comm.all_reduce(agreed, "max")
    if not torch.equal(mine, agreed):
        raise CephaloError(
            "ranks made different automatic plans (different profiles?); write one plan with "
            "`cephalo plan --out plan.json` and set parallel.plan to it"
        )
    return plan, cost_model


def _consequence(error: CephaloError) -> CephaloError:
    """Mark an error as the consequence of another rank's failure: this rank does not announce
    it as the cause (runtime/collectives/dist.py `announce_failure`)."""
    error.consequence = True
    return error


def strict_device_memory(cfg: JobConfig, device: Device, rank: int) -> EmulatedDeviceMemory | None:
    """The byte-by-byte accounting of an emulated rank's device memory (runtime/device_memory.py),
    charged the reserve the planner keeps on that device type; None on a real device or with
    `CEPHALO_STRICT_MEMORY=0`."""
    if not is_emulated(cfg) or os.environ.get(envvars.STRICT_MEMORY, "1") == "0":
        return None
    return EmulatedDeviceMemory(
        rank, int(device.memory_bytes), device_reserve_bytes(device.type_key)
    )


def build_job_model(cfg: JobConfig) -> UnitModel:
    """The config's model on the meta device, checked against the data's sequence length."""
    model = build_model(cfg.model.name, init=cfg.model.init, **cfg.model.overrides)
    if cfg.model.adapter != "none":
        apply_adapter(model, adapter_settings(cfg.model))
    model.spec.check_seq_len(cfg.data.seq_len, "data.seq_len", cfg.model.name)
    return model


# ----------------------------------------------------------------------------- the loop
class _Trainer:
    """One rank's training job; `train()` drives it."""

    def __init__(self, cfg: JobConfig, comm: Comm, stack: contextlib.ExitStack):
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size
        if cfg.logging.tensorboard:
            require_tensorboard()
        # the ranks start at different times (a node boots or loads late): they meet first at a
        # barrier with the start-up's timeout, which names a late rank (runtime/collectives/dist.py)
        startup = cfg.parallel.startup_timeout_s
        startup_barrier(comm, "discovery", startup)
        # every rank describes its own device; all build the same cluster from the descriptions
        self.cluster = discover_cluster(cfg, comm)
        self.device = self.cluster.devices[self.rank]
        # an emulated node of its own writes to its own filesystem (parallel.emulate_node_fs)
        self.cfg = cfg = node_local_config(cfg, self.device.node) if is_emulated(cfg) else cfg
        self.run_dir = Path(cfg.logging.dir)
        # an emulated device counts every byte from here on (`stack` ends it with the job)
        self.device_memory = strict_device_memory(cfg, self.device, self.rank)
        if self.device_memory is not None:
            stack.enter_context(self.device_memory)
        model = build_job_model(cfg)
        profile_peak = None
        if cfg.parallel.plan == "auto":
            self.plan, cost_model = auto_plan(cfg, model, self.cluster, comm)
            profile_peak = self.device_memory.peak_bytes if self.device_memory else None
        else:
            self.plan = resolve_plan(
                cfg, self.cluster, self.world_size, self.rank, model.spec.shape_fingerprint()
            )
            cost_model = catalog_model_or_none(cfg, model.spec, self.cluster)
        self.rank_plan = self.plan.ranks[self.rank]
        data_path = resolve_job_dataset(
            cfg.data.path,
            cfg.data.tokenizer,
            model.spec.vocab_size,
            fmt=cfg.data.format,
            loss_on=cfg.data.loss_on,
            chat_template=cfg.data.chat_template,
            val_fraction=cfg.data.val_fraction,
            progress=self.rank == 0,
            model_name=cfg.model.name,
            text_field=cfg.data.text_field,
            cache_dir=node_view(cfg, default_cache_dir(), self.device.node),
        )
        # one rank per host tokenised (a file lock) while the others waited; the nodes differ
        startup_barrier(comm, "data", startup)
        self.batches = open_batches(
            data_path,
            cfg.data.seq_len,
            cfg.train.global_batch_size,
            cfg.data.seed,
            cfg.data.val_fraction,
            model_vocab_size=model.spec.vocab_size,
            packing=cfg.data.packing,
            packing_split=cfg.data.packing_split,
            max_prompt_len=cfg.data.max_prompt_len,
        )
        self.preference = PreferenceRun(cfg, self.batches, data_path, model.spec)
        if cfg.train.epochs > 0:  # train.epochs: the steps follow from the data
            self.derive_steps(cfg, self.batches.steps_per_epoch)
        self.replanner = Replanner(cfg, cost_model, cfg.parallel.plan == "auto", self.rank)
        if cfg.train.eval_every > 0 and self.batches.num_val_windows == 0:
            raise CephaloError(
                f"train.eval_every = {cfg.train.eval_every} but dataset {data_path} has no validation windows of "
                f"{self.batches.window} tokens: raise data.val_fraction or set train.eval_every = 0"
            )
        self.model_spec = model.spec
        self.engine = self.make_engine(self.plan, model)
        self.preference.prepare(self.engine, cfg.train.steps, self.evaluate)
        t = cfg.train
        warmup, warmup_note = t.warmup()
        self.schedule = LRSchedule(t.lr, t.min_lr, warmup, t.steps, t.lr_schedule)
        self.step = 0
        self.nonfinite_streak = 0
        self.signals = StopSignals([])  # `train()` hands the job's handlers in
        self.checkpoint_sites: tuple[int, ...] | None = None  # check_checkpoint_dir finds them
        self.timed_saves = TimedSaves(cfg.checkpoint.every_minutes)
        self.result = TrainResult(self.rank, self.world_size, self.run_dir, self.plan, 0, 0)
        self.result.profile_peak_bytes = profile_peak
        if self.rank == 0:
            logger.info(
                "model %s (%.2fM parameters), %d rank(s), plan %s: batches %s, micro-batches %s",
                cfg.model.name,
                model.spec.total_params / 1e6,
                self.world_size,
                self.plan.strategy,
                self.plan.batch_sizes,
                [r.micro_batch_size for r in self.plan.ranks],
            )
            logger.info("data: %s", self.batches.describe())
            if warmup_note:
                logger.info(warmup_note)
            if model.adapter is not None:
                logger.info("adapter: %s", model.adapter.summary(model))

    def make_engine(self, plan: Plan, model: UnitModel | None = None) -> Engine:
        """An engine for this rank under `plan` (a fresh model unless given; collective).
        Every node's host memory must hold what the plan puts there: checked first, on every
        rank alike, before any allocation."""
        cfg, comm = self.cfg, self.comm
        node_of = [d.node for d in self.cluster.devices]
        host_memory = {n: self.cluster.host_memory_of(n) for n in self.cluster.nodes()}
        check_host_memory(plan, self.model_spec, node_of, host_memory)
        local = len(self.cluster.ranks_on_node(self.device.node))
        share = host_memory[self.device.node] // local
        emulated = is_emulated(cfg)
        config = engine_config(
            cfg, self.device, emulated, share, job_torch_device(cfg, comm), local_ranks=local
        )
        return Engine(
            model if model is not None else build_job_model(cfg),
            plan,
            comm,
            emulate_links(config, self.cluster, emulated),
        )

    # ------------------------------------------------------------------ run directory
    def write_run_files(self) -> None:
        if self.rank != 0:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / CONFIG_FILE).write_text(config_to_toml(self.cfg, comments=False))
        self.plan.to_json(self.run_dir / PLAN_FILE)

    # ------------------------------------------------------------------ checkpoints
    def _trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "nonfinite_streak": self.nonfinite_streak,
            "config": self.cfg.to_dict(),
            "plan_strategy": self.plan.strategy,
        }

    def save(self) -> Path:
        extra = {**self.engine.extra_state(), "rng_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            extra["rng_cuda"] = torch.cuda.get_rng_state()
        state = saved_state(self.engine)
        with host_memory():  # staged and written from host memory, as on a GPU
            path = save_checkpoint(
                self.cfg.checkpoint_dir,
                self.step,
                state,
                extra,
                self._trainer_state(),
                self.comm,
                keep_last=self.cfg.checkpoint.keep_last,
                sites=self.checkpoint_sites,
            )
        self.result.last_checkpoint = path
        self.timed_saves.saved()
        return path

    def _stopped(self) -> None:
        """Every rank stops here, after the same step and its checkpoint (launch/preempt.py)."""
        name = self.signals.received or "a signal on another rank"
        self.result.stopped_by = name
        self.result.stop_note = stop_note(name, self.step, self.result.last_checkpoint)

    def check_checkpoint_dir(self) -> None:
        """Before any step: the checkpoint directory is one every rank writes and sees (the
        doctor's probe, one function for both), else the first save, maybe at the end of the
        run, would fail. Node-local checkpoints: the sets of ranks that see one directory."""
        row = checkpoint_check(self.cfg.checkpoint_dir, self.comm, self.cfg.checkpoint.node_local)
        self.checkpoint_sites = row.sites
        if row.status != OK:
            raise CephaloError(
                f"the checkpoint directory is not one every rank can use: {row.found}. Before "
                f"training: {row.fix}; on an emulated cluster with parallel.emulate_node_fs = "
                "private, a checkpoint.dir under parallel.shared_dir"
            )

    def resume(self) -> None:
        target = resume_target(self.cfg.checkpoint.resume, self.cfg.checkpoint_dir)
        # every rank must agree on whether to load (a checkpoint root not shared between
        # nodes would otherwise send some ranks into the load's collectives and not others)
        found = torch.tensor(
            [1.0 if target is not None else 0.0], dtype=torch.float64, device=self.engine.device
        )
        self.comm.all_reduce(found, "sum")
        if 0 < found.item() < self.world_size:
            raise CephaloError(
                f"only {int(found.item())} of {self.world_size} ranks see a checkpoint under "
                f"{self.cfg.checkpoint_dir}: the checkpoint directory must be on storage every rank shares"
                + (
                    ", or each node's own copy of it (checkpoint.node_local)"
                    if self.checkpoint_sites
                    else ""
                )
            )
        if target is None:
            return
        with host_memory():  # read through host memory into the state's buffers, as on a GPU
            # node-local `auto`: the newest step complete on every node (load walks the root)
            auto = self.checkpoint_sites and self.cfg.checkpoint.resume == "auto"
            step, extra, state = load_checkpoint(
                self.cfg.checkpoint_dir if auto else target,
                self.engine.sharded_state(),
                self.comm,
                self.checkpoint_sites,
            )
        self.engine.state_written()
        self.engine.load_extra_state(extra)
        if "rng_cpu" in extra:
            torch.set_rng_state(extra["rng_cpu"])
        if "rng_cuda" in extra and torch.cuda.is_available():
            torch.cuda.set_rng_state(extra["rng_cuda"])
        self.step = int(state.get("step", step))
        self.nonfinite_streak = int(state.get("nonfinite_streak", 0))
        saved = state.get("config", {})
        for section, key in (
            ("data", "seq_len"),
            ("data", "seed"),
            ("train", "global_batch_size"),
            ("model", "name"),
            ("model", "seed"),
        ):
            old = saved.get(section, {}).get(key)
            new = getattr(getattr(self.cfg, section), key)
            if old is not None and old != new and self.rank == 0:
                logger.warning(
                    "resuming with %s.%s = %r (the checkpoint was trained with %r): the loss "
                    "trajectory will differ from the original run",
                    section,
                    key,
                    new,
                    old,
                )
        if self.rank == 0:
            logger.info(
                "resumed from %s at step %d (saved under plan %s, now %s)",
                target,
                self.step,
                state.get("plan_strategy", "?"),
                self.plan.strategy,
            )

    # ------------------------------------------------------------------ steps
    def _gather_rank_stats(self, stats: StepStats) -> tuple[RankStats, float]:
        """Every rank's timings and peak memory (one small all-gather), and the step time
        (the slowest rank's). The same gather carries the stop flags: `self._stop` (a signal
        reached some rank) and `self._save_due` (rank 0's `checkpoint.every_minutes`)."""
        mine = torch.tensor(
            [
                stats.busy_s,
                stats.comm_wait_s,
                stats.step_s,
                float(stats.peak_bytes),
                stats.optimizer_s,
                stats.host_s,
                float(self.signals.received is not None),
                float(self.rank == 0 and self.timed_saves.due()),
            ],
            dtype=torch.float64,
            device=self.engine.device,
        )
        out = torch.empty(
            _RANK_FIELDS * self.world_size, dtype=torch.float64, device=self.engine.device
        )
        handle = self.comm.all_gather_v(out, mine, [_RANK_FIELDS] * self.world_size)
        if handle is not None:
            handle.wait()
        rows = out.view(self.world_size, _RANK_FIELDS).cpu().tolist()
        self._stop = any(r[6] for r in rows)
        self._save_due = bool(rows[0][7])
        return RankStats(
            busy_s=[r[0] for r in rows],
            comm_wait_s=[r[1] for r in rows],
            idle_s=[max(0.0, r[2] - r[0]) for r in rows],
            peak_bytes=[int(r[3]) for r in rows],
            optimizer_s=[r[4] for r in rows],
            host_s=[r[5] for r in rows],
            step_s=[r[2] for r in rows],
        ), max(r[2] for r in rows)

    def _log_time_split(self, ranks: RankStats) -> None:
        """Where each rank's step went (runtime/step_timing.py), every `log_every` steps."""
        for r in range(len(ranks.busy_s)):
            one = StepStats(
                loss=0.0,
                grad_norm=0.0,
                n_tokens=0,
                skipped=False,
                busy_s=ranks.busy_s[r],
                comm_wait_s=ranks.comm_wait_s[r],
                step_s=ranks.step_s[r],
                peak_bytes=0,
                host_s=ranks.host_s[r],
                optimizer_s=ranks.optimizer_s[r],
            )
            logger.info(
                "step %d rank %d time: %s",
                self.step,
                r,
                format_split(split_step(one), ranks.step_s[r]),
            )

    def _log_reserve(self) -> None:
        """On a GPU, after the first step (every NCCL communicator of the job exists by then):
        the memory outside PyTorch's allocator against the reserve the planner kept
        (costmodel/memory.py `device_reserve_bytes`)."""
        measured = outside_allocator_bytes(self.engine.device)
        if measured is None:
            return
        # (a pipeline stage's rank: the world's, its stage's and the crossing's communicators)
        groups = STAGE_PROCESS_GROUPS if self.plan.staged else len(self.plan.groups)
        planned = device_reserve_bytes(self.device.type_key, groups)
        note = reserve_note(measured, planned)
        (logger.info if measured <= planned else logger.warning)("rank %d: %s", self.rank, note)

    def _maybe_kill(self, step_number: int) -> None:
        """Test hook: SIGKILL this rank just before `step_number` (see module docstring)."""
        at = os.environ.get(envvars.KILL_AT_STEP)
        if at is None or int(at) != step_number:
            return
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return  # once per job: a restarted attempt that resumes before step N goes past it
        victim = int(os.environ.get(envvars.KILL_RANK, "1" if self.world_size > 1 else "0"))
        if victim == self.rank:
            logger.warning("%s=%s: killing rank %d (SIGKILL)", envvars.KILL_AT_STEP, at, self.rank)
            os.kill(os.getpid(), signal.SIGKILL)

    def _maybe_run_out_of_memory(self, step_number: int) -> None:
        """Test hook: this rank raises the device's out-of-memory error at `step_number`
        (`CEPHALO_TEST_OOM_AT_STEP`, rank `CEPHALO_TEST_KILL_RANK`), as a GPU that runs out."""
        at = os.environ.get(envvars.OOM_AT_STEP)
        if at is None or int(at) != step_number:
            return
        victim = int(os.environ.get(envvars.KILL_RANK, "1" if self.world_size > 1 else "0"))
        if victim == self.rank:
            raise torch.OutOfMemoryError(f"{envvars.OOM_AT_STEP}={at}: out of memory (test hook)")

    def derive_steps(self, cfg: JobConfig, steps_per_epoch: int) -> None:
        """`train.epochs` as `train.steps` (the rest of the job reads the steps)."""
        t = cfg.train
        t.steps = steps_for_epochs(t.epochs, steps_per_epoch)
        if t.warmup_steps is not None and t.warmup_steps >= t.steps:
            raise CephaloError(
                f"train.epochs = {t.epochs:g} is {t.steps} step(s) ({steps_per_epoch} per epoch), "
                f"not more than train.warmup_steps ({t.warmup_steps}): lower the warmup or train "
                "longer"
            )
        if self.rank == 0:
            logger.info(
                "train.epochs = %g: %d steps (%d per epoch)", t.epochs, t.steps, steps_per_epoch
            )

    def train_step(self, metrics: MetricsLog | None, progress: ProgressDisplay) -> None:
        number = self.step + 1
        self._maybe_kill(number)
        lr = self.schedule(self.step)
        input_ids, labels, positions = rank_rows(self.batches, self.step, self.engine.sample_ranges)
        drift = drifted_slowdown(number, self.rank, self.cfg.parallel.emulate_drift)
        if drift is not None:
            self.engine.emulator.slowdown = drift
        try:
            self._maybe_run_out_of_memory(number)
            stats = self.preference.step(self.engine, input_ids, labels, lr, positions)
        except torch.OutOfMemoryError as err:
            raise CephaloError(
                out_of_memory_message(
                    self.rank, self.step + 1, self.engine.device, self.engine.ledger.peak_bytes, err
                )
            ) from err
        ranks, step_s = self._gather_rank_stats(stats)
        self._last_ranks = ranks
        if number == self.result.start_step + 1:
            self._log_reserve()
        self.step = number
        finite = not stats.skipped and math.isfinite(stats.loss)
        tokens_per_s = stats.n_tokens / step_s if step_s > 0 else 0.0
        self.result.losses[number] = stats.loss
        if metrics is not None and (
            number % self.cfg.logging.log_every == 0 or number == self.cfg.train.steps
        ):
            record = StepRecord(
                step=number,
                loss=stats.loss,
                lr=lr,
                grad_norm=stats.grad_norm,
                tokens=stats.n_tokens,
                step_s=step_s,
                tokens_per_s=tokens_per_s,
                skipped=not finite,
                ranks=ranks,
                aux_loss=stats.aux_loss,
                dpo=stats.dpo,
            )
            metrics.write(record.to_dict())
            self._log_time_split(ranks)
        progress.update(number, stats.loss, tokens_per_s, step_s, aux_loss=stats.aux_loss)
        self._throughput.append(tokens_per_s)
        if finite:
            self.nonfinite_streak = 0
            return
        self.nonfinite_streak += 1
        limit = self.cfg.train.max_nonfinite_skips
        if self.nonfinite_streak <= limit:
            if self.rank == 0:
                logger.warning(
                    "step %d: loss %s / gradient norm %s not finite: update skipped (%d of %d allowed "
                    "in a row)",
                    number,
                    stats.loss,
                    stats.grad_norm,
                    self.nonfinite_streak,
                    limit,
                )
            return
        where = self.save()
        raise CephaloError(
            f"the loss or gradient was not finite for {self.nonfinite_streak} steps in a row (up to step {number}; "
            f"train.max_nonfinite_skips = {limit}); stopped with a checkpoint at {where}. Lower train.lr, raise "
            "train.warmup_steps, or use fp32/bf16 instead of fp16"
        )

    def evaluate(self) -> float:
        """Token-mean loss over the first `eval_batches` held-out batches (same on every plan:
        a short last batch is padded with ignored samples so every rank keeps its plan size)."""
        b = self.cfg.train.global_batch_size
        count = min(self.cfg.train.eval_batches, self.batches.num_val_batches(b))
        total, weight = 0.0, 0
        for index in range(count):
            windows = min(b, self.batches.num_val_windows - index * b)
            x, y, positions = rank_val_rows(
                self.batches,
                index,
                b,
                windows,
                self.engine.sample_ranges,
                self.engine.rows_per_sample,
                self.cfg.data.packing,
            )
            total += self.preference.eval_loss(self.engine, x, y, positions) * windows
            weight += windows
        return total / max(weight, 1)

    def _collective_failure(self, error: BaseException, what: str) -> BaseException:
        """A backend error in a multi-rank job almost always means another rank is gone: say
        so in one line (a one-process job, or our own error, passes through unchanged). A
        device's out-of-memory outside the step (a checkpoint, an evaluation) is said as one."""
        if isinstance(error, torch.OutOfMemoryError):
            return CephaloError(
                out_of_memory_message(
                    self.rank,
                    self.step + 1,
                    self.engine.device,
                    self.engine.ledger.peak_bytes,
                    error,
                )
            )
        if isinstance(error, CephaloError) or self.world_size == 1:
            return error
        peer = peer_failure(
            wait_s=2.0
        )  # the failed rank announced why (runtime/collectives/dist.py)
        if peer is not None:
            return _consequence(
                CephaloError(
                    f"rank {self.rank}: {what} stopped because {peer}; resume from the last "
                    "checkpoint with checkpoint.resume = auto once that is fixed"
                )
            )
        return _consequence(
            CephaloError(
                f"rank {self.rank}: {what} failed in a collective ({_short(error)}); another rank probably died or "
                "stopped (see its error); resume from the last checkpoint with checkpoint.resume = auto"
            )
        )

    def run(self) -> TrainResult:
        cfg = self.cfg
        self.write_run_files()
        try:
            self.check_checkpoint_dir()
            self.resume()
        except (RuntimeError, TimeoutError) as e:
            raise self._collective_failure(e, "resuming") from None
        self.result.start_step = self.step
        steps = cfg.train.steps
        if self.step >= steps:  # a finished run started again: say so, train nothing, exit 0
            if self.rank == 0:
                logger.info(
                    "nothing to train: the checkpoint in %s is at step %d and train.steps = %d; "
                    "to train further, raise it (e.g. --train.steps %d)",
                    cfg.checkpoint_dir,
                    self.step,
                    steps,
                    self.step + steps,
                )
            self.result.final_step = self.step
            return self.result
        metrics = None
        if self.rank == 0:
            truncate_metrics(cfg.metrics_path, self.step)
            log = cfg.logging
            metrics = MetricsLog(
                cfg.metrics_path,
                TrackerSettings(
                    self.run_dir,
                    [name for name in TRACKERS if getattr(log, name)],
                    tensorboard=log.tensorboard,
                    project=log.project,
                    run_name=log.run_name or self.run_dir.resolve().name,
                    offline=log.offline,
                    config=cfg.to_dict(),
                ),
            )
        progress = ProgressDisplay(
            steps,
            self.step,
            enabled=cfg.logging.progress and self.rank == 0,
            description=f"{cfg.model.name} x{self.world_size}",
        )
        self._throughput: list[float] = []
        every, eval_every = cfg.checkpoint.every, cfg.train.eval_every
        self._stop = self._save_due = False
        self.timed_saves.saved()  # the clock starts with the steps
        try:
            while self.step < steps:
                self.train_step(metrics, progress)
                if eval_every and (self.step % eval_every == 0 or self.step == steps):
                    val = self.evaluate()
                    self.result.val_losses[self.step] = val
                    if metrics is not None:
                        dpo = self.preference.eval_metrics()
                        metrics.write({"kind": "eval", "step": self.step, "val_loss": val, **dpo})
                    if self.rank == 0:
                        progress.message(f"step {self.step}: validation loss {val:.4f}")
                if (
                    (every and self.step % every == 0)
                    or self.step == steps
                    or self._stop
                    or self._save_due
                ):
                    self.save()
                if self._stop and self.step < steps:
                    self._stopped()
                    break
                # calibration, and a switch to a better plan at this step boundary
                self.replanner.after_step(self, self._last_ranks, metrics)
        except (RuntimeError, TimeoutError) as e:
            raise self._collective_failure(e, f"step {self.step + 1}") from None
        finally:
            progress.close()
            if metrics is not None:
                metrics.close()
        self.result.final_step = self.step
        if self.device_memory is not None:
            self.result.device_peak_bytes = self.device_memory.peak_bytes
        self.result.replans = [s.to_dict() for s in self.replanner.switches]
        rates = self._throughput[1:] or self._throughput
        self.result.tokens_per_s = sum(rates) / len(rates) if rates else 0.0
        if self.rank == 0 and self.result.losses and self.result.stopped_by is None:
            last = max(self.result.losses)
            logger.info(
                "done: step %d, loss %.4f, %.0f tokens/s%s",
                self.step,
                self.result.losses[last],
                self.result.tokens_per_s,
                self.preference.done_note(self.result.last_checkpoint),
            )
        return self.result


def _short(error: BaseException) -> str:
    """The gist of a backend error: gloo's start with a source location and run on."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". ")[0]


def train(cfg: JobConfig) -> TrainResult:
    """Run (or resume) the job on this rank; every rank of the job calls it."""
    init_logging()
    cfg.validate()
    preflight(cfg)  # missing packages and data: one line, before the process group is up
    backend = None if cfg.parallel.backend == "auto" else cfg.parallel.backend
    m = cfg.model
    weights_note = initial_weights_note(m.name, m.init, m.adapter)  # refused before any group
    with StopSignals(cfg.checkpoint.save_on_signals) as signals, contextlib.ExitStack() as stack:
        comm = init_distributed(backend, timeout_s=cfg.parallel.timeout_s)
        delay = start_delay_s(cfg.parallel.emulate_start_delay, comm.rank)
        if delay > 0 and is_emulated(cfg):  # the emulator's late node
            logger.info(
                "rank %d: starting %.3g s late (parallel.emulate_start_delay)", comm.rank, delay
            )
            time.sleep(delay)
        torch.manual_seed(cfg.model.seed)  # any randomness outside the engine's own streams
        if weights_note and comm.rank == 0:
            logger.warning(weights_note)
        try:
            trainer = _Trainer(cfg, comm, stack)
        except torch.OutOfMemoryError as err:
            raise startup_out_of_memory(comm.rank, err) from err
        trainer.signals = signals
        return trainer.run()
