"""What a training job adds for the DPO objective (`PreferenceRun`): the objective / data
cross-check before anything runs, the reference log-probabilities of full fine-tuning
(preference/reference.py) computed before the first step and handed to each step with its
batch, and the evaluation's metrics. train/trainer.py holds one for every job; under SFT it
only passes the engine's calls through.

A run's start walks every step of the run (reads each batch, hashes its rows, one all-reduce
per step) to find the rows the sidecar lacks: seconds to minutes on a 10k-step run. The sidecar
therefore also records the walks it covers (`walk_key`: the rows a run reads follow from the
prepared dataset, seq_len, max_prompt_len, the seed, the global batch size, the steps and the
evaluation's batches), so a run the sidecar covers skips the walk after one all-reduce that
every rank agrees on."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cephalo.log import logger
from cephalo.preference.objective import METRICS, DpoSettings, check_objective
from cephalo.preference.reference import ReferenceTable, model_identity, sidecar_path
from cephalo.specs.model import ModelSpec

__all__ = ["DpoSettings", "PreferenceRun"]

if TYPE_CHECKING:
    from cephalo.runtime.engine.config import StepStats
    from cephalo.runtime.engine.engine import Engine


class PreferenceRun:
    """A job's DPO parts. Given the job config, its batches and the prepared dataset's path
    (the sidecar's place); `prepare` computes the reference before training."""

    def __init__(self, cfg: Any, batches: Any, data_path: Path | str, spec: ModelSpec):
        check_objective(cfg.train.objective, bool(getattr(batches, "is_preference", False)))
        self.dpo = cfg.train.objective == "dpo"
        self.batches = batches
        self.table: ReferenceTable | None = None
        """Full fine-tuning under DPO: the precomputed reference (None: SFT, or LoRA's
        adapters-off forward)."""
        if self.dpo and cfg.model.adapter == "none":
            m = cfg.model
            identity = model_identity(
                m.name, m.init, m.seed, m.dtype, cfg.train.dpo_loss, spec.shape_fingerprint()
            )
            self.table = ReferenceTable(sidecar_path(Path(data_path), identity), identity)
        self.evaluates = cfg.train.eval_every > 0
        self.eval_batches = cfg.train.eval_batches if self.evaluates else 0
        self.last: dict[str, float] | None = None
        """TRL's metrics of the last step (DPO), for the run's closing line."""
        self._collecting = False
        self._eval: list[tuple[float, dict[str, float]]] = []

    def prepare(self, engine: Engine, steps: int, evaluate: Callable[[], float]) -> None:
        """Before training, under the job's plan (collective): every training row of the
        run's `steps` and of the evaluation (`evaluate`, the trainer's, run once with its
        engine calls collecting instead of evaluating, if the job evaluates) gets its
        reference log-probability from the starting weights (before a resume loads a
        checkpoint); the table is saved beside the dataset. Nothing under SFT or LoRA, and no
        walk over the run's batches where the sidecar already covers this run (`covered`)."""
        if self.table is None:
            return
        walk = walk_key(self.batches)
        if self.covered(engine, walk, steps):
            if engine.rank == 0:
                logger.info(
                    "DPO reference: %s already covers this run's %d steps (%d rows known)",
                    self.table.path,
                    steps,
                    len(self.table.values),
                )
            return
        rp = engine.rank_plan
        for step in range(steps):
            where = (step, engine.sample_offset, rp.batch_size)
            ids, labels = self.batches.rank_slice(*where)
            self.table.ensure(engine, ids, labels, self.batches.rank_positions(*where))
        if self.evaluates:
            self._collecting = True
            try:
                evaluate()
            finally:
                self._collecting = False
        if walk is not None:
            self.table.cover(walk, steps, self.eval_batches)
        self.table.save()
        if engine.rank == 0:
            known = len(self.table.values)
            logger.info(
                "DPO reference: %d row log-probabilities (%d computed now, the rest from %s)",
                known,
                self.table.computed,
                self.table.path,
            )

    def covered(self, engine: Engine, walk: str | None, steps: int) -> bool:
        """Whether the sidecar has recorded a walk over this run's rows (the same `walk` for
        at least `steps` steps and the evaluation's batches): decided by every rank together
        (one all-reduce: a rank whose copy of the sidecar lacks it makes all of them walk)."""
        assert self.table is not None
        mine = walk is not None and self.table.covers(walk, steps, self.eval_batches)
        flag = torch.tensor([0.0 if mine else 1.0], dtype=torch.float64, device=engine.device)
        engine.collectives.all_reduce(flag)
        return float(flag.item()) == 0.0

    def _reference(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        return None if self.table is None else self.table.lookup(ids, labels)

    def step(
        self,
        engine: Engine,
        ids: torch.Tensor,
        labels: torch.Tensor,
        lr: float,
        positions: torch.Tensor | None,
    ) -> StepStats:
        """`engine.train_step`, with the rows' reference log-probabilities under full
        fine-tuning DPO."""
        ref = self._reference(ids, labels)
        stats = engine.train_step(ids, labels, lr, position_ids=positions, ref_logps=ref)
        self.last = stats.dpo
        return stats

    def done_note(self, checkpoint: object | None) -> str:
        """The end of the run's closing `done:` line: under DPO the last step's reward
        accuracy and margin (TRL's `rewards/accuracies`, `rewards/margins`), then the last
        checkpoint if any."""
        note = ""
        if self.last is not None:
            note = (
                f", rewards/accuracies {self.last['rewards/accuracies']:.3f}, "
                f"rewards/margins {self.last['rewards/margins']:.4f}"
            )
        return note + (f", checkpoint {checkpoint}" if checkpoint else "")

    def eval_loss(
        self,
        engine: Engine,
        ids: torch.Tensor,
        labels: torch.Tensor,
        positions: torch.Tensor | None,
    ) -> float:
        """`engine.eval_loss` (DPO: its metrics kept for `eval_metrics`); while `prepare`
        collects, the batch's reference instead (0.0 returned)."""
        if self._collecting:
            assert self.table is not None
            self.table.ensure(engine, ids, labels, positions)
            return 0.0
        loss = engine.eval_loss(
            ids, labels, position_ids=positions, ref_logps=self._reference(ids, labels)
        )
        if engine.eval_metrics is not None:
            self._eval.append((engine.eval_metrics.get("pairs", 0.0), engine.eval_metrics))
        return loss

    def eval_metrics(self) -> dict[str, float]:
        """TRL's metrics of the evaluation just run (the batches' means weighted by their
        pairs); empty under SFT. Reading them starts the next evaluation's."""
        runs, self._eval = self._eval, []
        total = sum(n for n, _ in runs)
        if not runs or total <= 0:
            return {}
        return {k: sum(n * m[k] for n, m in runs) / total for k in METRICS}


def walk_key(batches: Any) -> str | None:
    """What the rows of a run's steps and evaluation follow from, for preference batches
    (preference/data.py `PreferenceBatches`: plan-invariant global batches): the prepared
    dataset (its `preference.json`: sources, tokenizer, template, split, statistics), seq_len,
    max_prompt_len, the seed and the global batch size. None for batches that do not say
    (their run is always walked)."""
    meta = getattr(batches, "meta", None)
    try:
        described = {
            "meta": asdict(meta),
            "seq_len": batches.seq_len,
            "max_prompt_len": batches.max_prompt_len,
            "seed": batches.seed,
            "global_batch_size": batches.global_batch_size,
        }
    except (AttributeError, TypeError):
        return None
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]
