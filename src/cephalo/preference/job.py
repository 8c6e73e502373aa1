"""What a training job adds for the DPO objective (`PreferenceRun`): the objective / data
cross-check before anything runs, the reference log-probabilities of full fine-tuning
(preference/reference.py) computed before the first step and handed to each step with its
batch, and the evaluation's metrics. train/trainer.py holds one for every job; under SFT it
only passes the engine's calls through."""

from __future__ import annotations

from collections.abc import Callable
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
        self.last: dict[str, float] | None = None
        """TRL's metrics of the last step (DPO), for the run's closing line."""
        self._collecting = False
        self._eval: list[tuple[float, dict[str, float]]] = []

    def prepare(self, engine: Engine, steps: int, evaluate: Callable[[], float]) -> None:
        """Before training, under the job's plan (collective): every training row of the
        run's `steps` and of the evaluation (`evaluate`, the trainer's, run once with its
        engine calls collecting instead of evaluating, if the job evaluates) gets its
        reference log-probability from the starting weights (before a resume loads a
        checkpoint); the table is saved beside the dataset. Nothing under SFT or LoRA."""
        if self.table is None:
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
        self.table.save()
        if engine.rank == 0:
            known = len(self.table.values)
            logger.info(
                "DPO reference: %d row log-probabilities (%d computed now, the rest from %s)",
                known,
                self.table.computed,
                self.table.path,
            )

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
