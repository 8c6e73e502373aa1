"""The job configuration: TOML sections backed by dataclasses whose fields carry docstrings.

Each section is a dataclass below; each field has a type, a default and a docstring written
right under it. Those docstrings are the ONE source of the `--help` text, of `config_help()`
and of docs/config.md (`scripts/gen_config_docs.py`). What reads them, and the TOML and
command-line machinery, is `config_manager.py`; `_validate` here says which values are out of
range, with one `CephaloError` each."""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cephalo.errors import CephaloError
from cephalo.launch.preempt import SIGNAL_NAMES
from cephalo.profiling.settings import ProfileSettings
from cephalo.runtime.emulation import parse_join_order, parse_start_delay
from cephalo.specs.cluster import parse_bytes
from cephalo.specs.drift import parse_drift

Dtype = Literal["fp32", "bf16", "fp16"]
DEFAULT_WARMUP_STEPS = 10
"""`train.warmup_steps` when unset, in runs of 100 steps or more (`TrainConfig.warmup`)."""


@dataclass
class ModelConfig:
    """What to train."""

    name: str = "gpt-tiny"
    """A preset (`gpt-tiny`, `gpt-small-demo`, `hf-gpt2-tiny`, `hf-llama-tiny`), a transformers
    model directory (`config.json` + safetensors, as `save_pretrained` writes it: Llama,
    Mistral, Qwen2/3, Gemma 2, Phi-3, GPT-NeoX, GPT-2 and more, docs/models.md), or the id of a
    model in the local Hugging Face cache (never downloaded)."""
    init: Literal["auto", "pretrained", "random"] = "auto"
    """Initial weights: `pretrained` (the directory's safetensors, each rank reading only its
    units), `random` (transformers' init scheme, seeded by `model.seed`), or `auto`: pretrained
    when `model.name` is a directory holding weights, else random."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Changes to the model's config, e.g. `{ dropout = 0.1, n_layer = 4 }` (on the command line:
    `--model.overrides dropout=0.1,n_layer=4`): the preset's fields or a transformers config's,
    or the generic `seq_len`, `dropout`, `tie_embeddings`, `vocab_size`."""
    dtype: Dtype = "fp32"
    """Compute precision: `fp32`, `bf16`, or `fp16` (with loss scaling). Master weights, gradient
    reduction and optimizer state stay fp32."""
    seed: int = 0
    """Seed of the weight initialisation (every rank draws the same initial weights)."""
    adapter: Literal["none", "lora", "qlora"] = "none"
    """`none`: full fine-tuning. `lora`: peft's LoRA adapters trained on a frozen base (the base
    sharded unevenly by the plan, in `model.dtype`, never reduced). `qlora`: the same on a base
    stored in NF4 with double quantization (needs the `qlora` extra). docs/adapters.md."""
    lora_r: int = 16
    """LoRA rank r (>= 1)."""
    lora_alpha: float = 32
    """LoRA alpha: the adapters' output is scaled by alpha / r."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input, in [0, 1)."""
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Modules that get adapters: `all-linear` (peft's meaning: every linear layer but the output
    head), or module names matched as peft matches them (`q_proj,v_proj`: every module whose
    name ends in one)."""
    adapter_path: str | None = None
    """An existing PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`)
    to continue training: its config sets r, alpha, dropout and the targets."""


@dataclass
class DataConfig:
    """Where the tokens come from."""

    path: str | None = None
    """A token dataset (from `cephalo prepare-data`), or data to tokenize once into the cache: text /
    markdown, JSON Lines (`.jsonl`) or Parquet files, a directory of them, or a `datasets` directory
    (`save_to_disk`). Unset: the bundled corpus."""
    tokenizer: str = "auto"
    """`auto`: the tokenizer in the model's directory (`model.name` = a directory with `tokenizer.json` /
    `tokenizer_config.json`; EOS between documents), else the byte tokenizer. `builtin` / `byte`: bytes
    (vocab 256). `bpe`: a byte-level BPE of the model's vocab size trained on the corpus. Else the path of
    a tokenizer directory or tokenizer JSON."""
    text_field: str = "text"
    """The field of JSON Lines records, or the column of Parquet files and `datasets` directories, that
    holds the text."""
    format: Literal["auto", "text", "chat", "prompt_completion", "preference"] = "auto"
    """What the records are: `text` (the `text_field`), `chat` (`messages`: a list of `role` /
    `content` turns), `prompt_completion` (`prompt` and `completion`: strings, or lists of
    messages), `preference` (TRL's `prompt`, `chosen`, `rejected`: strings, or lists of
    messages; without `prompt`, the shared start of `chosen` and `rejected`). `auto` detects it
    per file (`chosen` and `rejected` -> preference, `messages` -> chat, `prompt` and
    `completion` -> prompt_completion, else text). Chat and preference data are rendered with
    the tokenizer's chat template."""
    loss_on: Literal["auto", "assistant", "completion", "all"] = "auto"
    """Which tokens of chat data are in the loss: `assistant` (the assistant's turns with their
    end-of-turn tokens; the default for chat), `completion` (what follows the prompt; the
    default for prompt_completion) or `all`. Text trains on every token."""
    chat_template: str | None = None
    """A Jinja chat template (a file, or the template string itself) for a tokenizer that has
    none, or to use instead of its own. Unset: the tokenizer's `chat_template`."""
    packing: bool = False
    """Chat data: pack whole conversations into `seq_len` windows (best-fit decreasing), each with
    its own position ids, so attention never crosses conversations (transformers'
    packed-sequence masks). Off: one conversation per sample, right-padded to `seq_len`."""
    packing_split: bool = False
    """With `packing`: split a conversation longer than `seq_len` into several windows instead of
    truncating it (its pieces are then trained as separate documents)."""
    max_prompt_len: int | None = None
    """Preference data: keep only the last this many tokens of each prompt (TRL's
    `max_prompt_length`); then each row is cut to `seq_len` (the completion's end goes), and a
    pair whose prompt alone fills `seq_len` is dropped (counted in the log). Unset: the prompt
    is only limited by `seq_len`."""
    seq_len: int = 32
    """Tokens per sample (inputs; labels are the same tokens shifted by one). The model's context
    (`model.overrides.seq_len`) must be at least this long."""
    val_fraction: float = 0.05
    """Fraction of the tokens held out for the validation loss (0 disables validation)."""
    seed: int = 0
    """Seed of the sample order. The global batch of step t depends only on this seed, never on the plan."""


@dataclass
class TrainConfig:
    """The optimisation loop."""

    steps: int = 100
    """Optimizer steps to run (in total, counting the steps of a resumed checkpoint). Or set
    `epochs` instead (one of the two)."""
    epochs: float = 0.0
    """Passes over the training data to run instead of `steps` (0: `steps` counts). The steps
    are then derived once the data is known: ceil(epochs x the steps of one epoch at
    `global_batch_size`), logged at the start; a fraction (0.5) is half an epoch. Leave `steps`
    unset when you set this."""
    global_batch_size: int = 8
    """Samples per step, summed over all ranks; the plan splits them."""
    lr: float = 3e-4
    """Peak learning rate (reached at the end of the warmup)."""
    min_lr: float = 3e-5
    """Learning rate at the last step of the cosine schedule."""
    warmup_steps: int | None = None
    """Steps of linear warmup from 0 to `lr`; must be smaller than `steps`. Unset: 10, or a
    tenth of `steps` in a run of fewer than 100 steps (said once), so a short trial run
    (`--train.steps 5`) needs no second setting."""
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    """After the warmup: `cosine` decay to `min_lr` at the last step, or `constant` at `lr`."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not applied to norms and biases)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW moment coefficients (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (across all shards) to this value; 0 disables clipping."""
    eval_every: int = 50
    """Compute the validation loss every this many steps (and at the end); 0 disables."""
    eval_batches: int = 4
    """Global batches of held-out data averaged for one validation loss."""
    max_nonfinite_skips: int = 3
    """Steps with a non-finite loss or gradient are skipped; stop with an error after this many in a row."""
    objective: Literal["sft", "dpo"] = "sft"
    """`sft`: the mean token loss. `dpo`: Direct Preference Optimization on preference pairs
    (prompt / chosen / rejected; docs/dpo.md): a sample is a pair and
    `global_batch_size` counts pairs; the reference is the frozen base with the adapters off
    under `model.adapter`, else log-probabilities computed once before training."""
    dpo_beta: float = 0.1
    """DPO's temperature beta (TRL's default 0.1; IPO's tau); > 0."""
    dpo_loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """`sigmoid` (the DPO paper's loss, TRL's default) or `ipo` (TRL's IPO: log-probabilities
    averaged over the completion's tokens)."""

    def warmup(self) -> tuple[int, str | None]:
        """(the warmup steps this run uses, the note to log when the default was shortened).
        A set `warmup_steps` is used as given (`_validate` refuses one >= `steps`); unset, it
        is DEFAULT_WARMUP_STEPS, cut to a tenth of a shorter run, never the whole run."""
        if self.warmup_steps is not None:
            return self.warmup_steps, None
        if self.steps >= 10 * DEFAULT_WARMUP_STEPS:
            return DEFAULT_WARMUP_STEPS, None
        short = max(0, self.steps // 10)
        return short, (
            f"train.warmup_steps unset: {short} warmup step(s) for a run of {self.steps} "
            f"(a tenth; the default {DEFAULT_WARMUP_STEPS} is for runs of "
            f"{10 * DEFAULT_WARMUP_STEPS}+ steps)"
        )


@dataclass
class ParallelConfig:
    """How the work is split across ranks."""

    plan: str = "auto"
    """`auto` (profile + optimise at start, cached), `even` (plain FSDP split), `proportional`
    (compute-proportional batches, even shards), or the path to a plan JSON file."""
    mode: Literal["lga", "standard"] = "lga"
    """Schedule: `lga` (layered gradient accumulation: memory independent of the batch) or
    `standard` (one forward/backward per micro-batch, as FSDP does)."""
    prefetch: bool = True
    """Gather the next unit's parameters while the current one computes."""
    overlap_reduce: bool = True
    """Reduce-scatter a unit's gradient while the next unit's backward computes (faster; one
    more unit's fp32 gradient in memory). The planner assumes it on: off, a step takes a little
    longer and a little less memory than planned."""
    check_collectives: Literal["first_step", "every_step", "off"] = "first_step"
    """Cross-check every collective's sizes across ranks (a mismatch is an error on every rank,
    not a hang): in the first training step and evaluation only (the plan fixes the calls after
    that), in `every_step` (a small blocking exchange per collective), or `off` (also
    `CEPHALO_COMM_VALIDATE=0`)."""
    compile: Literal["auto", "off", "graphs", "inductor"] = "auto"
    """Compile the model's blocks (docs/gpu.md, "Compiled blocks"): `inductor` (torch.compile,
    one compiled callable per block type, shared by its blocks; a compile of tens of seconds
    per block type and micro-batch size at the start), `graphs` (CUDA graphs of each block type
    per micro-batch shape: the host launches one graph per block; CUDA only), `off` (eager), or
    `auto`: what was measured to pay on the device (today eager everywhere: on the CPU a 4 %
    faster step for minutes of compile, the GPU paths await a lent GPU's check). MoE and
    LoRA / QLoRA models run eagerly."""
    hierarchy: bool = True
    """Let the automatic plan shard per node (or per group of nodes) and all-reduce the gradients
    between the groups once per step where the cost model predicts that faster than one flat
    ring over every rank (docs/planner.md, "Shard groups"); false: always the flat plan."""
    cross_node_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of the once-per-step gradient all-reduce between shard groups (hierarchical plans):
    `fp32` (exact: the same result as one flat replica) or `bf16` (half the bytes over the
    inter-node network; accumulated in fp32 either way). The planner costs whichever is set."""
    stages: str = "off"
    """Pipeline stages for the automatic plan (`cephalo plan --stages`): `off`, `auto` or a
    number of stages (issue 40): the planner keeps a staged plan only where it predicts it
    faster, and the job runs it as a pipeline (docs/planner.md, "Pipeline stages"); `off`
    keeps today's flat or shard-group plans. Re-planning (`parallel.replan`) chooses among
    the same candidates."""
    offload: Literal["auto", "always", "never"] = "auto"
    """Keep layer-boundary activations on the host: `auto` (as the plan says), `always`, `never`."""
    host_memory: str | None = None
    """Host memory of every node, e.g. `64GiB`, shared by the node's ranks for host-held training
    state (the plan's `host_state_fraction`) and offloaded activations; checked against the plan
    before training (emulated devices: each rank's share is its host budget). Unset: 256 GiB.
    Cluster files set it per node (`host_memory`)."""
    devices: str | None = None
    """Emulated devices for `cephalo run`, one per rank, e.g. `cpu,cpu:slowdown=2,cpu:slowdown=4:mem=2GiB`;
    unset: one plain CPU rank per `--nproc`."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend: `auto` picks nccl on CUDA and gloo on CPU."""
    timeout_s: float = 300.0
    """Timeout of every collective, in seconds: a lost rank becomes an error instead of a hang."""
    startup_timeout_s: float = 1800.0
    """How long the ranks wait for each other at the start-up's barriers (before discovery, each
    profiled device type, after the data is tokenised): its phases take very different times on
    different nodes (a node that tokenises, a slow device measured while the others wait), longer
    than a step's `timeout_s`. A rank later than this is named in one message."""
    max_restarts: int = 0
    """`cephalo run`: restart the whole worker group up to this many times after a failure (the
    elastic agent); with `checkpoint.resume = auto` the restarted workers continue from the newest
    checkpoint. `--max-restarts N` on the command line wins."""
    replan: Literal["own", "auto", "off"] = "own"
    """Re-plan while training, from the job's own measurements (docs/calibration.md): `own`
    (default) re-plans only a plan cephalo made itself (`plan = auto`: its profiles may be
    wrong, and the job measures better), and follows `even`, `proportional` and plan files as
    given; `auto` re-plans any plan, a plan file too (calibrating the catalog's profiles for
    `even` / `proportional`); `off` never re-plans."""
    calibrate_after: int = 5
    """Steps under a plan before its first calibration (the first of them, the warm-up, is not
    measured); at or above `train.steps`, calibration never happens (said once). Also the steps
    after a calibration that predicted a gain until the one that must confirm it."""
    calibrate_every: int = 10
    """After the first calibration, calibrate again every this many steps (0: only once per
    plan, and the confirming one). A switch to a new plan starts the count again. A calibration
    reads only the steps since the previous one, so a device that changed speed is seen as it
    is now."""
    replan_min_gain: float = 0.03
    """Switch only when the re-made plan's predicted step is at least this fraction faster than
    the running plan's, both predicted by the calibrated cost model (0.03: 3 %), at two
    calibrations in a row (the second confirms the first on fresh steps: no flip-flop on noise)."""
    replan_staging: Literal["auto", "host", "device"] = "auto"
    """Where the training state waits while a re-plan rebuilds the engine: `device` keeps the
    old engine alive until the new one holds the state (fastest, but both engines' memory at
    once: the planner fills a GPU's memory, so that usually does not fit); `host` first copies
    this rank's shards to host memory and frees the old engine; `auto` (default) stages
    through the host when the device cannot hold the new plan's predicted peak beside the old
    engine (free CUDA memory, or an emulated device's budget)."""
    emulate_start_delay: str | None = None
    """Emulated clusters: `RANK:SECONDS[,...]` makes rank RANK start its job that much later (a
    node that boots or loads late), to test `startup_timeout_s`."""
    emulate_join_order: str | None = None
    """Emulated clusters: the ranks join in another order than the devices of `parallel.devices`
    (as torchrun's c10d rendezvous numbers them as they arrive): `reverse`, or `P0,P1,...` (rank
    i emulates the spec's device P_i). A plan file is then matched to the ranks by device."""
    emulate_node_fs: Literal["shared", "private"] = "shared"
    """Emulated clusters: `private` gives every emulated node but the first its own filesystem,
    as separate machines have: a path its ranks write (checkpoints, the run directory, the data
    cache) that is not under `parallel.shared_dir` lands under `<logging.dir>/node-fs/nodeK/`;
    `shared`: one filesystem for all (docs/training.md, "Emulated clusters")."""
    shared_dir: str | None = None
    """A directory every node sees (an NFS or cluster filesystem mount): with `emulate_node_fs =
    private`, paths under it are shared by all the emulated nodes."""
    emulate_drift: str | None = None
    """Emulated devices: `STEP:RANK:SLOWDOWN[,...]` makes rank RANK compute at SLOWDOWN from step
    STEP on, whatever its profile says (a GPU that throttles mid-run; `cephalo demo` shows
    calibration and re-planning with it). Unset: `CEPHALO_EMULATE_DRIFT`, else none."""


@dataclass
class CheckpointConfig:
    """Saving and resuming (logical layout: loads under any plan or world size)."""

    dir: str | None = None
    """Checkpoint root directory; unset: `<logging.dir>/checkpoints`."""
    every: int = 0
    """Save every this many steps (and at the end of training); 0 saves only at the end."""
    every_minutes: float = 0.0
    """Also save once this many minutes have passed since the last save (rank 0's clock, decided
    by every rank at the same step); 0: no time-based saves."""
    save_on_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"])
    """Signals that make every rank finish its step, save a checkpoint there and exit 0 with the
    command that resumes (preemption: SIGTERM; SLURM: SIGUSR1; Ctrl-C: SIGINT); a second signal
    exits at once. Any of SIGTERM, SIGINT, SIGUSR1, SIGUSR2, SIGHUP; [] keeps the defaults."""
    keep_last: int = 3
    """Complete checkpoints to keep; older ones are deleted after a successful save."""
    resume: str = "auto"
    """`auto` (newest complete checkpoint in `dir`, if any), `never`, or the path of a checkpoint to load."""
    node_local: bool = False
    """`dir` is on each node's own disk, not storage every rank shares (machines without a
    shared filesystem): each node writes its own ranks' shards and its own copy of the
    metadata there, and resumes from them with the same ranks on the same nodes and the same
    plan. Copied together into one directory, a step's copies are one checkpoint that
    resumes under any plan (docs/checkpoints.md, "Node-local checkpoints")."""


@dataclass
class LoggingConfig:
    """What a run writes and shows."""

    dir: str = "runs/default"
    """Run directory: metrics, the resolved config, the plan, checkpoints (by default)."""
    metrics_jsonl: str = "metrics.jsonl"
    """Per-step metrics file (JSON lines), relative to `dir`."""
    progress: bool = True
    """Show a progress bar on rank 0 (loss, tokens/s, step time)."""
    tensorboard: bool = False
    """Also write TensorBoard event files under `<dir>/tb` (needs the `tensorboard` extra:
    `pip install -e '.[tensorboard]'`)."""
    log_every: int = 1
    """Write a metrics record every this many steps."""
    wandb: bool = False
    """Also log the metrics to Weights & Biases (`pip install 'cephalo[wandb]'`), project
    `project`, run `run_name`; with `offline` the run is written under `<dir>/wandb` for
    `wandb sync` later."""
    mlflow: bool = False
    """Also log to MLflow (`pip install 'cephalo[mlflow]'`): the server in MLFLOW_TRACKING_URI,
    else a file store under `<dir>/mlruns`; the config's keys as the run's parameters."""
    trackio: bool = False
    """Also log to trackio (`pip install 'cephalo[trackio]'`), local-first."""
    project: str = "cephalo"
    """The trackers' project (W&B project, MLflow experiment, trackio project)."""
    run_name: str | None = None
    """The trackers' run name (unset: the name of `dir`)."""
    offline: bool = False
    """Trackers that can, log without a network (W&B offline mode)."""


@dataclass
class JobConfig:
    """A whole training job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profile: ProfileSettings = field(default_factory=ProfileSettings)

    # Paths whose default depends on another section: resolved here so callers never guess.
    @property
    def checkpoint_dir(self) -> Path:
        return (
            Path(self.checkpoint.dir)
            if self.checkpoint.dir
            else Path(self.logging.dir) / "checkpoints"
        )

    @property
    def profile_cache(self) -> Path:
        return (
            Path(self.profile.cache)
            if self.profile.cache
            else Path(self.logging.dir) / "profile.json"
        )

    @property
    def metrics_path(self) -> Path:
        return Path(self.logging.dir) / self.logging.metrics_jsonl

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in section_names()}

    def validate(self) -> None:
        """Range and consistency checks beyond the types; raises CephaloError on the first problem."""
        _validate(self)


def steps_for_epochs(epochs: float, steps_per_epoch: int) -> int:
    """`train.epochs` as optimizer steps: ceil(epochs x steps per epoch), at least one (the
    small tolerance keeps 3 x 1/3 of an epoch from rounding up to a step more)."""
    if steps_per_epoch < 1:
        raise CephaloError(
            "train.epochs: the training data holds less than one global batch; lower "
            "train.global_batch_size or give more data"
        )
    return max(1, math.ceil(epochs * steps_per_epoch - 1e-9))


def preflight(cfg: JobConfig) -> None:
    """What can fail a job before its process group is up, checked before it is: the optional
    packages the config needs import (peft for `model.adapter`, torchao for qlora, transformers
    for Hugging Face models, pyarrow / datasets for those data formats) and the data exists, is
    readable and not empty. `cephalo run` calls it before it launches, every rank before
    `init_distributed`: one clear line instead of a failing rank, its peers' stack dumps and
    12-16 s of start-up."""
    from cephalo.data.corpus import check_data_path
    from cephalo.modeling.hf.config import HF_PRESETS, transformers_module
    from cephalo.modeling.registry import model_directory

    m = cfg.model
    if m.name in HF_PRESETS or model_directory(m.name) is not None:
        transformers_module()
    if m.adapter == "qlora":
        from cephalo.modeling.nf4 import nf4_backend

        nf4_backend()
    if m.adapter in ("lora", "qlora"):
        from cephalo.modeling.lora import peft_module

        peft_module()
    if cfg.data.path is not None:
        check_data_path(cfg.data.path)
    from cephalo.train.metrics import TRACKERS, require_tensorboard, require_trackers

    if cfg.logging.tensorboard:
        require_tensorboard()
    require_trackers([name for name in TRACKERS if getattr(cfg.logging, name)])
    if cfg.parallel.plan not in ("auto", "even", "proportional"):
        from cephalo.planner.plan import Plan, check_stages_runnable

        plan = Plan.from_json(cfg.parallel.plan)
        check_stages_runnable(plan, f"plan {cfg.parallel.plan}", stage_refusals(cfg))


def stage_refusals(cfg: JobConfig) -> list[str]:
    """What of a job a pipeline stage cannot run yet (runtime/pipeline/stage_step.py
    `check_runnable` says the same of the engine): the plan's own options are
    `planner.plan.check_stages_runnable`'s."""
    why = []
    if cfg.parallel.mode != "lga":
        why.append(f"the {cfg.parallel.mode!r} mode")
    if cfg.parallel.compile not in ("off", "auto"):
        why.append(f"compiled blocks (parallel.compile = {cfg.parallel.compile})")
    if cfg.train.objective == "dpo":
        why.append("the DPO objective")
    if cfg.model.adapter != "none":
        why.append(f"an adapter ({cfg.model.adapter})")
    return why


# --------------------------------------------------------------------------------------------
# Introspection: sections, fields, their types and docstrings
def section_names() -> list[str]:
    return [f.name for f in dataclasses.fields(JobConfig)]


def section_class(section: str) -> type:
    return _section_types()[section]


@functools.cache
def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {name: hints[name] for name in section_names()}


# --------------------------------------------------------------------------------------------
# Validation beyond types


# Collective timeouts become a timedelta and then int64 milliseconds in c10d: inf or 1e300
# would overflow there, long after the config was accepted.
MAX_TIMEOUT_S = 1e7


def _stages_ok(value: object) -> bool:
    """Whether `parallel.stages` reads as the planner's `--stages` does."""
    from cephalo.planner.stages.search import parse_stages

    try:
        parse_stages(value)  # type: ignore[arg-type]
    except CephaloError:
        return False
    return True


def _is_file(text: str) -> bool:
    """`Path(text).is_file()`, False (not an OSError) for names the OS rejects (too long, ...)."""
    try:
        return Path(text).is_file()
    except OSError:
        return False


def _validate(cfg: JobConfig) -> None:
    problems: list[str] = []

    def check(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    m, d, t, p = cfg.model, cfg.data, cfg.train, cfg.parallel
    check(bool(m.name.strip()), "model.name must not be empty")
    if m.adapter != "none" or m.adapter_path:
        check(
            m.lora_r >= 1,
            f"model.lora_r must be >= 1, got {m.lora_r}",
        )
        check(
            0.0 <= m.lora_dropout < 1.0,
            f"model.lora_dropout must be in [0, 1), got {m.lora_dropout}",
        )
        check(bool(m.lora_target_modules), "model.lora_target_modules must not be empty")
        check(m.adapter != "none", "model.adapter_path needs model.adapter = lora or qlora")
    check(d.seq_len >= 1, f"data.seq_len must be >= 1, got {d.seq_len}")
    check(
        d.max_prompt_len is None or d.max_prompt_len >= 1,
        f"data.max_prompt_len must be >= 1 (or unset), got {d.max_prompt_len}",
    )
    check(0.0 <= d.val_fraction < 1.0, f"data.val_fraction must be in [0, 1), got {d.val_fraction}")
    check(
        bool(d.tokenizer.strip()),
        "data.tokenizer must be `auto`, `builtin`, `bpe`, a tokenizer directory or a tokenizer file",
    )
    check(bool(d.text_field.strip()), "data.text_field must name the field that holds the text")
    check(
        not d.packing_split or d.packing,
        "data.packing_split splits conversations across packed windows: set data.packing = true",
    )
    check(t.steps >= 1, f"train.steps must be >= 1, got {t.steps}")
    check(
        t.global_batch_size >= 1, f"train.global_batch_size must be >= 1, got {t.global_batch_size}"
    )
    check(t.lr > 0 and math.isfinite(t.lr), f"train.lr must be a positive number, got {t.lr}")
    check(
        0.0 <= t.min_lr <= t.lr, f"train.min_lr must be in [0, train.lr = {t.lr}], got {t.min_lr}"
    )
    if t.warmup_steps is not None:
        check(t.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {t.warmup_steps}")
        check(
            t.epochs > 0 or t.warmup_steps < t.steps or t.steps < 1,
            f"train.warmup_steps ({t.warmup_steps}) must be smaller than train.steps "
            f"({t.steps}): lower it, or leave it unset (a tenth of a short run)",
        )
    check(
        t.epochs >= 0 and math.isfinite(t.epochs),
        f"train.epochs must be >= 0 (0: train.steps counts), got {t.epochs}",
    )
    check(
        t.epochs == 0 or t.steps == TrainConfig.steps,
        f"train.epochs = {t.epochs:g} and train.steps = {t.steps} are both set: keep one of the two",
    )
    check(t.weight_decay >= 0, f"train.weight_decay must be >= 0, got {t.weight_decay}")
    check(
        all(0.0 <= b < 1.0 for b in t.betas),
        f"train.betas must both be in [0, 1), got {list(t.betas)}",
    )
    check(t.eps > 0, f"train.eps must be > 0, got {t.eps}")
    check(
        t.grad_clip >= 0, f"train.grad_clip must be >= 0 (0 disables clipping), got {t.grad_clip}"
    )
    check(
        isinstance(t.dpo_beta, int | float) and math.isfinite(t.dpo_beta) and t.dpo_beta > 0,
        f"train.dpo_beta must be > 0 (DPO's temperature; TRL's default 0.1), got {t.dpo_beta}",
    )
    check(t.eval_every >= 0, f"train.eval_every must be >= 0 (0 disables), got {t.eval_every}")
    check(t.eval_batches >= 1, f"train.eval_batches must be >= 1, got {t.eval_batches}")
    check(
        t.max_nonfinite_skips >= 0,
        f"train.max_nonfinite_skips must be >= 0, got {t.max_nonfinite_skips}",
    )
    check(
        t.eval_every == 0 or d.val_fraction > 0,
        f"train.eval_every = {t.eval_every} needs held-out data: set data.val_fraction > 0 "
        "or train.eval_every = 0",
    )
    check(
        p.cross_node_reduce_dtype in ("fp32", "bf16"),
        f"parallel.cross_node_reduce_dtype must be fp32 or bf16, got {p.cross_node_reduce_dtype!r}",
    )
    check(
        _stages_ok(p.stages),
        f"parallel.stages must be off, auto or a number of stages >= 1, got {p.stages!r}",
    )
    if p.plan not in ("auto", "even", "proportional"):
        check(
            _is_file(p.plan),
            f"parallel.plan = {p.plan!r} is neither `auto`, `even`, `proportional` nor an existing "
            "plan file (write one with `cephalo plan ... --json plan.json`)",
        )
    check(
        0 < p.timeout_s <= MAX_TIMEOUT_S,
        f"parallel.timeout_s must be > 0 and at most {MAX_TIMEOUT_S:.0e} seconds, got {p.timeout_s}",
    )
    check(p.max_restarts >= 0, f"parallel.max_restarts must be >= 0, got {p.max_restarts}")
    check(
        p.calibrate_after >= 2,
        f"parallel.calibrate_after must be >= 2 (the first step is not measured), got {p.calibrate_after}",
    )
    check(p.calibrate_every >= 0, f"parallel.calibrate_every must be >= 0, got {p.calibrate_every}")
    check(
        0 <= p.replan_min_gain < 1,
        f"parallel.replan_min_gain must be in [0, 1) (0.03: 3 %), got {p.replan_min_gain}",
    )
    check(
        0 < p.startup_timeout_s <= MAX_TIMEOUT_S,
        f"parallel.startup_timeout_s must be > 0 and at most {MAX_TIMEOUT_S:.0e} seconds, got "
        f"{p.startup_timeout_s}",
    )
    for parse in (
        lambda: parse_drift(p.emulate_drift),
        lambda: parse_start_delay(p.emulate_start_delay),
        lambda: parse_join_order(p.emulate_join_order),
    ):
        try:
            parse()
        except CephaloError as e:
            problems.append(str(e))
    check(
        p.emulate_node_fs in ("shared", "private"),
        f"parallel.emulate_node_fs must be `shared` or `private`, got {p.emulate_node_fs!r}",
    )
    check(
        p.devices is None or bool(p.devices.strip()),
        "parallel.devices must not be empty (leave it unset)",
    )
    if p.host_memory is not None:
        try:
            parse_bytes(p.host_memory, "parallel.host_memory")
        except CephaloError as e:
            problems.append(str(e))
    c = cfg.checkpoint
    check(c.every >= 0, f"checkpoint.every must be >= 0 (0 saves only at the end), got {c.every}")
    check(
        c.every_minutes >= 0 and math.isfinite(c.every_minutes),
        f"checkpoint.every_minutes must be >= 0 (0: no time-based saves), got {c.every_minutes}",
    )
    bad = [n for n in c.save_on_signals if n not in SIGNAL_NAMES]
    check(
        not bad,
        f"checkpoint.save_on_signals: {', '.join(map(repr, bad))} is not one of "
        f"{', '.join(SIGNAL_NAMES)}",
    )
    check(c.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {c.keep_last}")
    check(bool(c.resume.strip()), "checkpoint.resume must be `auto`, `never` or a checkpoint path")
    lg = cfg.logging
    check(bool(lg.dir.strip()), "logging.dir must not be empty")
    check(bool(lg.metrics_jsonl.strip()), "logging.metrics_jsonl must not be empty")
    check(lg.log_every >= 1, f"logging.log_every must be >= 1, got {lg.log_every}")
    problems.extend(cfg.profile.problems())
    if problems:
        more = (
            f" (and {len(problems) - 1} more: {'; '.join(problems[1:])})"
            if len(problems) > 1
            else ""
        )
        raise CephaloError(f"invalid config: {problems[0]}{more}.")
