"""What a training run shows and records (rank 0 only): JSONL metrics, a progress bar,
and the same scalars fed to TensorBoard, Weights & Biases, MLflow and trackio where asked for
(`[logging]`; each an optional extra).

`metrics.jsonl` holds one JSON object per line. Step records have `"kind": "step"` and the
fields of `StepRecord`; validation results are `{"kind": "eval", "step", "val_loss"}`. Lists
under `ranks` are per rank, in rank order. docs/training.md documents the fields.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from cephalo.errors import CephaloError
from cephalo.log import logger
from cephalo.preference.objective import METRICS as DPO_METRICS


@dataclass
class RankStats:
    """Per-rank values of one step, in rank order (gathered from every rank)."""

    busy_s: list[float] = field(default_factory=list)
    """Seconds of compute (stretched by the emulated slowdown)."""
    comm_wait_s: list[float] = field(default_factory=list)
    """Seconds blocked in collectives."""
    idle_s: list[float] = field(default_factory=list)
    """Step time minus busy time: waiting for data, collectives or slower ranks."""
    peak_bytes: list[int] = field(default_factory=list)
    """Peak device memory of the engine's ledger during the step."""
    optimizer_s: list[float] = field(default_factory=list)
    """Seconds of the device optimizer phase (runtime/step_timing.py)."""
    host_s: list[float] = field(default_factory=list)
    """Seconds of host-held state work (its AdamW and copies)."""
    step_s: list[float] = field(default_factory=list)
    """The rank's own step time."""


@dataclass
class StepRecord:
    """One line of metrics.jsonl for a training step."""

    step: int
    """Steps completed, counting this one (1-based)."""
    loss: float
    """Mean token loss of the global batch, before the update."""
    lr: float
    """Learning rate used by this step."""
    grad_norm: float
    """Global gradient norm before clipping."""
    tokens: int
    """Tokens with a label in the global batch."""
    step_s: float
    """Wall-clock seconds of the step (the slowest rank's)."""
    tokens_per_s: float
    """tokens / step_s."""
    skipped: bool
    """The update was skipped (non-finite loss or gradient)."""
    ranks: RankStats
    """Per-rank timings and memory."""
    kind: str = "step"
    aux_loss: float | None = None
    """MoE with the router loss: transformers' `aux_loss` of the global batch (`loss`
    includes `router_aux_loss_coef` x it); absent for other models."""
    dpo: dict[str, float] | None = None
    """`train.objective = "dpo"`: TRL's metrics of the global batch (`rewards/chosen`,
    `rewards/rejected`, `rewards/accuracies`, `rewards/margins`, `logps/chosen`,
    `logps/rejected`), written as fields of their own; absent under SFT."""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if out["aux_loss"] is None:
            del out["aux_loss"]
        out.update(out.pop("dpo") or {})
        return out


def _json_safe(value: Any) -> Any:
    """JSON has no NaN/Infinity: write them as strings so every line stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, record) pairs of a metrics file. A line that does not parse is dropped: a job
    killed while writing leaves its last line cut off, and that must not break a resume."""
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            out.append((line, record))
    return out


def read_metrics(path: str | Path, kind: str | None = "step") -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file (only those of `kind`, unless None)."""
    return [r for _, r in _records(Path(path)) if kind is None or r.get("kind") == kind]


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records after `last_step`: a run resumed from step N re-runs the steps after N,
    and their old records (from the interrupted run) would otherwise appear twice."""
    if not path.is_file():
        return
    kept = [line for line, record in _records(path) if record.get("step", 0) <= last_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


def require_tensorboard() -> None:
    """Raise the install hint now if TensorBoard is asked for but missing (every rank checks,
    so the job stops before its first collective instead of rank 0 failing alone later)."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise CephaloError(
            "logging.tensorboard = true needs the `tensorboard` package: pip install -e "
            "'.[tensorboard]' (or pip install tensorboard), or set logging.tensorboard = false"
        ) from None


TRACKERS = ("wandb", "mlflow", "trackio")
"""The experiment trackers `logging.<name> = true` feeds (each an optional extra)."""


def require_trackers(names: list[str]) -> None:
    """Import each tracker asked for, or raise its install hint (before the process group:
    `train.config.preflight`)."""
    from cephalo.log import quiet_imports

    for name in names:
        try:
            with quiet_imports():
                __import__(name)
        except ImportError:
            raise CephaloError(
                f"logging.{name} = true needs the `{name}` package: pip install "
                f"'cephalo[{name}]', or set logging.{name} = false"
            ) from None


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """The one flat view of a metrics record that every tracker receives (TensorBoard, W&B,
    MLflow, trackio): `train/<field>` of a step (DPO: `train/rewards/chosen`, ...),
    `rank<r>/<field>` per rank, `val/loss` (and `val/rewards/...`) of an evaluation; other
    records (re-plan events) carry no scalars."""
    dpo = [k for k in DPO_METRICS if record.get(k) is not None]  # train.objective = "dpo"
    if record.get("kind") == "eval":
        return {"val/loss": float(record["val_loss"]), **{f"val/{k}": record[k] for k in dpo}}
    if record.get("kind") != "step":
        return {}
    out = {
        f"train/{key}": float(record[key])
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_s", "aux_loss", *dpo)
        if record.get(key) is not None
    }
    for key, values in record.get("ranks", {}).items():
        for rank, v in enumerate(values):
            out[f"rank{rank}/{key}"] = float(v)
    return out


@dataclass
class TrackerSettings:
    """Where a run's scalars go besides metrics.jsonl (from `[logging]`)."""

    run_dir: Path
    names: list[str] = field(default_factory=list)
    """Trackers to feed: any of `TRACKERS`."""
    tensorboard: bool = False
    project: str = "cephalo"
    run_name: str | None = None
    offline: bool = False
    config: dict[str, Any] = field(default_factory=dict)
    """The job's config, recorded with the run."""


class _TensorBoard:
    def __init__(self, s: TrackerSettings):
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(s.run_dir / "tb"))

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class _WandB:
    """Weights & Biases; offline (`logging.offline`, or WANDB_MODE=offline) writes the run
    under `<run dir>/wandb` for `wandb sync` later."""

    def __init__(self, s: TrackerSettings):
        import wandb

        self.run = wandb.init(
            project=s.project,
            name=s.run_name,
            dir=str(s.run_dir),
            config=s.config,
            mode="offline" if s.offline else None,
        )

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    """MLflow: the server in MLFLOW_TRACKING_URI, else a file store under `<run dir>/mlruns`."""

    def __init__(self, s: TrackerSettings):
        import os

        import mlflow

        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri((s.run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(s.project)
        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=s.run_name)
        flat = {
            f"{section}.{key}": str(value)[:250]
            for section, table in s.config.items()
            if isinstance(table, dict)
            for key, value in table.items()
        }
        mlflow.log_params(flat)

    def log(self, values: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class _Trackio:
    """trackio: local-first (its own local database; a Space only where configured)."""

    def __init__(self, s: TrackerSettings):
        import trackio

        self.trackio = trackio
        trackio.init(project=s.project, name=s.run_name, config=s.config)

    def log(self, values: dict[str, float], step: int) -> None:
        self.trackio.log(values, step=step)

    def close(self) -> None:
        self.trackio.finish()


_SINKS = {"wandb": _WandB, "mlflow": _MLflow, "trackio": _Trackio}


class MetricsLog:
    """Appends records to the JSONL file (flushed per line) and feeds each record's scalars
    (`scalars_of`) to TensorBoard and the trackers asked for: one record, every sink."""

    def __init__(self, path: Path, trackers: TrackerSettings | None = None):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a")
        self._sinks: list[Any] = []
        if trackers is not None:
            if trackers.tensorboard:
                self._sinks.append(_TensorBoard(trackers))
            require_trackers(trackers.names)
            for name in trackers.names:
                try:
                    self._sinks.append(_SINKS[name](trackers))
                except CephaloError:
                    raise
                except Exception as err:  # a tracker's own failure (login, server): say which
                    raise CephaloError(
                        f"logging.{name}: could not start the run: {type(err).__name__}: {err} "
                        f"(offline: logging.offline = true; or set logging.{name} = false)"
                    ) from None

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(_json_safe(record)) + "\n")
        self._file.flush()
        values = scalars_of(record) if self._sinks else {}
        if values:
            for sink in self._sinks:
                sink.log(values, int(record["step"]))

    def close(self) -> None:
        self._file.close()
        for sink in self._sinks:
            sink.close()


class ProgressDisplay:
    """Rank 0's view of the run: a rich progress bar on a terminal (loss, tokens/s, step
    time), else one log line every few steps (so redirected logs stay readable)."""

    def __init__(
        self, total_steps: int, start_step: int, enabled: bool, description: str = "train"
    ):
        self.total_steps = total_steps
        self.enabled = enabled
        self.console = Console(file=sys.stderr)
        self._bar: Progress | None = None
        self._task = None
        self._log_every = max(1, total_steps // 20)
        self._last_log = time.monotonic()
        if enabled and self.console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[tps]} tok/s"),
                TextColumn("{task.fields[step_s]} s/step"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._bar.add_task(
                description, total=total_steps, completed=start_step, loss="-", tps="-", step_s="-"
            )
            self._bar.start()
            # log records go through the bar's console while it is live, so they print
            # above it instead of tearing it
            self._handlers = [h for h in logger.handlers if isinstance(h, logging.StreamHandler)]
            self._streams = [h.setStream(sys.stderr) for h in self._handlers]

    def update(
        self,
        step: int,
        loss: float,
        tokens_per_s: float,
        step_s: float,
        aux_loss: float | None = None,
    ) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(
                self._task,
                completed=step,
                loss=f"{loss:.4f}",
                tps=f"{tokens_per_s:,.0f}",
                step_s=f"{step_s:.3f}",
            )
        elif step % self._log_every == 0 or step == self.total_steps:
            logger.info(
                "step %d/%d  loss %.4f%s  %s tok/s  %.3f s/step",
                step,
                self.total_steps,
                loss,
                "" if aux_loss is None else f"  aux_loss {aux_loss:.4f}",
                f"{tokens_per_s:,.0f}",
                step_s,
            )

    def message(self, text: str) -> None:
        """A line that must not be torn by the bar (validation results, checkpoints)."""
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            logger.info(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
            for handler, stream in zip(self._handlers, self._streams, strict=True):
                handler.setStream(stream)
