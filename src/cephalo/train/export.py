"""A checkpoint's weights out of cephalo: whole tensors (safetensors), a `transformers` model
directory, or a peft adapter directory, loaded in one process from any saved layout."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ExportResult:
    """What an export wrote."""

    checkpoint: Path
    step: int
    model: str
    num_params: int
    out: Path | None
    hf_dir: Path | None
    copied: list[str]
    """Tokenizer (and generation) files copied from the model's source directory."""
    peft_copied: list[str] = field(default_factory=list)
    """The tokenizer files and chat template written next to the adapters (`--peft`)."""


def find_checkpoint(source: str | Path) -> Path:
    """The checkpoint `source` names: a step_N directory, a root of them (newest complete
    one), or a run directory (its checkpoints/)."""
    from cephalo.errors import CephaloError
    from cephalo.train.checkpoint import MARKER, latest_checkpoint, verify_checkpoint

    path = Path(source)
    if not path.exists():
        raise CephaloError(f"export: {path} does not exist; give a run directory or a checkpoint")
    if (path / MARKER).is_file():
        verify_checkpoint(path)
        return path
    for root in (path / "checkpoints", path):
        if root.is_dir():
            found = latest_checkpoint(root)
            if found is not None:
                return found
    raise CephaloError(f"export: no complete checkpoint in {path} (nor in {path / 'checkpoints'})")


def _run_config(checkpoint: Path) -> dict[str, Any]:
    """The config the checkpoint was trained with (saved in its trainer state); its [model]
    section must be there."""
    import torch

    from cephalo.errors import CephaloError
    from cephalo.train.checkpoint import TRAINER_STATE_FILE

    state = torch.load(checkpoint / TRAINER_STATE_FILE, weights_only=True)
    config = state.get("config") or {}
    if not config.get("model"):
        raise CephaloError(
            f"export: {checkpoint} does not record its model config (not written by `cephalo train`?)"
        )
    return config


def export_tokenizer(out: Path, run_config: dict[str, Any], model_dir: Path | None) -> list[str]:
    """The tokenizer the run trained with, and its chat template, written next to exported
    weights (an adapter directory has no other way to carry them): `data.tokenizer = auto`
    -> the model directory's tokenizer files, a tokenizer directory or JSON -> its files;
    `data.chat_template` (a file or the template itself) -> `chat_template.jinja`, which
    transformers' `AutoTokenizer` reads. The byte and BPE tokenizers have no files. Returns
    the names written."""
    import shutil

    from cephalo.data.chat import load_chat_template
    from cephalo.modeling.hf.config import TOKENIZER_FILES

    data = run_config.get("data") or {}
    name = str(data.get("tokenizer") or "auto")
    source: Path | None = None
    if name == "auto":
        source = model_dir
    elif Path(name).is_dir():
        source = Path(name)
    out.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    if name not in ("auto", "builtin", "byte", "bpe") and Path(name).is_file():
        shutil.copyfile(name, out / "tokenizer.json")
        written.append("tokenizer.json")
    elif source is not None and source.resolve() != out.resolve():
        for file in TOKENIZER_FILES:
            if (source / file).is_file():
                shutil.copyfile(source / file, out / file)
                written.append(file)
    template = load_chat_template(data.get("chat_template"))
    if template:  # the run's own template wins over the tokenizer's
        (out / "chat_template.jinja").write_text(template)
        written.append("chat_template.jinja")
    return sorted(set(written))


def export_checkpoint(
    source: str | Path,
    out: str | Path | None = None,
    hf_dir: str | Path | None = None,
    peft_dir: str | Path | None = None,
) -> ExportResult:
    """Load a checkpoint in one process (any saved layout) and write its weights."""
    from safetensors.torch import save_file

    from cephalo.errors import CephaloError
    from cephalo.modeling.hf.export import save_hf_directory
    from cephalo.modeling.registry import build_model
    from cephalo.planner.makers import simple_plan
    from cephalo.runtime.collectives.comm import LocalComm
    from cephalo.runtime.engine.engine import Engine, EngineConfig
    from cephalo.specs.cluster import Cluster
    from cephalo.train.checkpoint import load_checkpoint

    if out is None and hf_dir is None and peft_dir is None:
        raise CephaloError(
            "export: say where to write: --out FILE.safetensors, --hf DIR and/or --peft DIR"
        )
    checkpoint = find_checkpoint(source)
    run_config = _run_config(checkpoint)
    mc = run_config["model"]
    adapter = mc.get("adapter", "none")
    if peft_dir is not None and adapter == "none":
        raise CephaloError(
            f'export --peft: {checkpoint} is a full fine-tune (model.adapter = "none"), it has '
            "no adapters; export it with --hf DIR or --out FILE"
        )
    if adapter == "none":
        # the checkpoint holds the weights: the model's own (pretrained) files are not read
        model = build_model(mc["name"], init="random", **mc.get("overrides", {}))
    else:
        # it holds only the adapters: the base is the model directory's, as in training
        from cephalo.modeling.lora import AdapterSettings, apply_adapter

        model = build_model(mc["name"], init=mc.get("init", "auto"), **mc.get("overrides", {}))
        targets = list(mc.get("lora_target_modules", ["all-linear"]))
        apply_adapter(
            model,
            AdapterSettings(
                adapter,
                int(mc.get("lora_r", 16)),
                float(mc.get("lora_alpha", 32)),
                float(mc.get("lora_dropout", 0.0)),
                "all-linear" if targets == ["all-linear"] else targets,
                mc.get("adapter_path"),
            ),
        )
    spec = model.spec
    plan = simple_plan("even", Cluster.parse("cpu"), mc["name"], spec.max_seq_len or 1, 1, "fp32")
    comm = LocalComm()
    engine = Engine(
        model, plan, comm, EngineConfig(compute_dtype="fp32", seed=int(mc.get("seed", 0)))
    )
    step, _, _ = load_checkpoint(checkpoint, engine.sharded_state(), comm)
    engine.state_written()
    state = engine.full_state_dict()
    if engine.frozen is not None:  # LoRA: the adapters, and the base they were trained on
        from cephalo.modeling.lora import merged_state, save_peft_directory

        if peft_dir is not None:
            save_peft_directory(model, Path(peft_dir), state)
        names = [u.name for u in model.units]
        state = merged_state(model, state, engine.frozen.full_state_dict(names.__getitem__))
    out_path = Path(out) if out is not None else None
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        save_file(
            state,
            str(out_path),
            metadata={"format": "cephalo", "model": mc["name"], "step": str(step)},
        )
    hf_path = Path(hf_dir) if hf_dir is not None else None
    copied: list[str] = []
    model_dir = getattr(model, "directory", None)
    model_dir = Path(model_dir) if model_dir is not None else None
    if hf_path is not None:
        copied = save_hf_directory(model, hf_path, state)
        copied = sorted({*copied, *export_tokenizer(hf_path, run_config, model_dir)})
    peft_copied: list[str] = []
    if peft_dir is not None:
        peft_copied = export_tokenizer(Path(peft_dir), run_config, model_dir)
    return ExportResult(
        checkpoint,
        step,
        mc["name"],
        sum(t.numel() for t in state.values()),
        out_path,
        hf_path,
        copied,
        peft_copied,
    )
