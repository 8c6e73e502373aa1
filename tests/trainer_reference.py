"""The single-process reference of a whole training job, for the trainer-level equivalence
tests (plan invariance, re-planning, resume, elastic restarts, torchrun).

`job_floor(cfg)` runs the job in this process on one rank (`train(cfg)` with the even plan)
and records what the trainer fed its engine: each step's global batch and learning rate, and
each evaluation's batches. `reference.train_reference` then replays exactly that, in fp64 (the
truth) and in fp32 under other summation orders (the variants): the `equivalence.NoiseFloor`
every run of the same job, under any plan, is checked against (tests/equivalence.py).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch

from cephalo.modeling.units import IGNORE_INDEX
from cephalo.runtime.engine.engine import Engine
from cephalo.train.trainer import TrainResult, train
from engine_common import measure_floor
from equivalence import NoiseFloor
from reference import OptimConfig, model_factory, train_reference


@dataclass
class Recording:
    """What a one-process trainer gave its engine."""

    batches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    evals: dict[int, list[tuple[tuple[torch.Tensor, torch.Tensor], float]]] = field(
        default_factory=dict
    )
    """Step -> the evaluation's batches with their weights (the rows holding labels)."""


@contextlib.contextmanager
def recording():
    """Record every `Engine.train_step` and `Engine.eval_loss` call of this process."""
    rec = Recording()
    step, evaluate = Engine.train_step, Engine.eval_loss

    def recorded_step(self, input_ids, labels, lr, *args, **kwargs):
        rec.batches.append((input_ids.clone(), labels.clone()))
        rec.lrs.append(float(lr))
        return step(self, input_ids, labels, lr, *args, **kwargs)

    def recorded_eval(self, input_ids, labels, *args, **kwargs):
        rows = float((labels != IGNORE_INDEX).any(dim=1).sum())
        rec.evals.setdefault(len(rec.batches), []).append(
            ((input_ids.clone(), labels.clone()), rows)
        )
        return evaluate(self, input_ids, labels, *args, **kwargs)

    Engine.train_step, Engine.eval_loss = recorded_step, recorded_eval
    try:
        yield rec
    finally:
        Engine.train_step, Engine.eval_loss = step, evaluate


@dataclass
class JobFloor:
    """The noise floor of a job's single-process reference, by 1-based step number."""

    floor: NoiseFloor
    """Losses and gradient norms per step, parameters by `<unit>.<param>`, validation losses
    in the order of `eval_steps`."""
    eval_steps: list[int]
    result: TrainResult
    """The recorded one-process run (itself checked against the floor by `job_floor`)."""

    def check(
        self,
        label: str,
        losses: dict[int, float] | None = None,
        val_losses: dict[int, float] | None = None,
        params: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """The run's losses (any subset of steps), validation losses and final parameters
        within the floor (`NoiseFloor.check`)."""
        steps = sorted(losses or {})
        evals = sorted(val_losses or {})
        cut = self.floor.at([s - 1 for s in steps], [self.eval_steps.index(s) for s in evals])
        cut.check(
            label,
            params=params,
            losses=[losses[s] for s in steps] if steps else None,
            val=[val_losses[s] for s in evals] if evals else None,
        )


_FLOORS: dict[str, JobFloor] = {}
"""`job_floor`'s answers this session, by `_job_key`."""
NOT_TRAINING = (
    ("logging", "dir"),
    ("parallel", "timeout_s"),
    ("checkpoint", "every"),
    ("checkpoint", "keep_last"),
)
"""Config fields that do not change what a one-process run computes (where it writes, how long
a collective may wait, which checkpoints it saves: saving changes no state, as the bitwise
resume tests show): jobs differing only there share one reference (test_resume, test_replan,
test_elastic and test_signals run the same job)."""


def _job_key(cfg) -> str:
    import json

    d = cfg.to_dict()
    for section, key in NOT_TRAINING:
        d.get(section, {}).pop(key, None)
    return json.dumps(d, sort_keys=True, default=str)


def job_floor(cfg) -> JobFloor:
    """Run `cfg` in this process (one rank) while recording, then measure the reference's
    noise floor on what was recorded. `cfg.parallel.plan` should be `even` on one rank. The
    same job asked for again (`NOT_TRAINING` aside) gets the answer already measured."""
    key = _job_key(cfg)
    if key not in _FLOORS:
        _FLOORS[key] = _measure_job_floor(cfg)
    return _FLOORS[key]


def _measure_job_floor(cfg) -> JobFloor:
    with recording() as rec:
        result = train(cfg)
    t = cfg.train
    opt = OptimConfig(
        lr=rec.lrs,
        betas=tuple(t.betas),
        eps=t.eps,
        weight_decay=t.weight_decay,
        grad_clip=t.grad_clip,
        seed=cfg.model.seed,
    )
    factory = model_factory(cfg.model.name, cfg.model.seed, **cfg.model.overrides)
    train_job = functools.partial(train_reference, factory, rec.batches, opt, evaluations=rec.evals)
    floor = measure_floor(train_job, rec.batches[0][0].shape[0])
    job = JobFloor(floor, sorted(rec.evals), result)
    job.check("the recorded one-process run", result.losses, result.val_losses)
    return job
