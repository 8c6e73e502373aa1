"""Runnable models by name: `build_model("gpt-tiny", dropout=0.1)` -> a meta-built `UnitModel`.

A name is a built-in preset (`gpt-tiny`, `hf-llama-tiny`, ...) or a transformers model: a
local directory holding `config.json` (what `save_pretrained` writes), or the id of a model
already in the local Hugging Face cache (`Qwen/Qwen2.5-0.5B`; nothing is ever downloaded).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cephalo.errors import CephaloError
from cephalo.modeling.gpt import GPT, GPT_PRESETS, GPTConfig
from cephalo.modeling.units import UnitModel
from cephalo.specs.catalog.models import get_model_spec
from cephalo.specs.model import ModelSpec

INIT_CHOICES = ("auto", "pretrained", "random")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _build_gpt(
    name: str, device: torch.device | str, overrides: dict[str, Any], init: str = "auto"
) -> UnitModel:
    if init == "pretrained":
        raise CephaloError(
            f"model {name} is a built-in config without pretrained weights: set model.init = "
            '"random" (or "auto"), or give a model directory'
        )
    config = _apply_overrides(name, GPT_PRESETS[name], overrides)
    return GPT(config, name=name, device=device)


def _apply_overrides(name: str, config: Any, overrides: dict[str, Any]) -> Any:
    fields = {f.name for f in dataclasses.fields(config)}
    if "block_size" in overrides:  # nanoGPT's name
        overrides = dict(overrides)
        overrides["seq_len"] = overrides.pop("block_size")
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise CephaloError(
            f"model {name}: unknown setting(s) {unknown}; settings are {sorted(fields)}"
        )
    return dataclasses.replace(config, **overrides)


Builder = Callable[..., UnitModel]


def _hf_builders() -> dict[str, Builder]:
    # hf.py imports transformers only when a model is built, so listing names never needs it.
    from cephalo.modeling.hf import config as hf_config

    def build(name: str, device, overrides, init="auto") -> UnitModel:
        from cephalo.modeling.hf.model import build_hf_unit_model

        return build_hf_unit_model(name, device, overrides, init)

    return {name: build for name in hf_config.HF_PRESETS}


def _builders() -> dict[str, Builder]:
    builders: dict[str, Builder] = {name: _build_gpt for name in GPT_PRESETS}
    builders.update(_hf_builders())
    return builders


def list_runnable_models() -> list[str]:
    """Preset names `build_model` accepts (besides model directories)."""
    return sorted(_builders())


def model_directory(name: str) -> Path | None:
    """The local directory of transformers model `name`: `name` itself when it is a directory
    holding `config.json`; else, for a model id (`org/model`), its snapshot in the local
    Hugging Face cache when `config.json` is there (huggingface_hub's cache lookup: nothing
    is downloaded); else None."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path if (path / "config.json").is_file() else None
    if path.exists() or not _REPO_ID.match(name):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - installed with transformers
        return None
    try:
        found = try_to_load_from_cache(name, "config.json")
    except Exception:  # a malformed id for the hub's rules: not a cached model
        return None
    return Path(found).parent if isinstance(found, str) else None


def build_model(
    name: str, device: torch.device | str = "meta", *, init: str = "auto", **overrides: Any
) -> UnitModel:
    """Build the named model as units on `device` (meta by default: the engine, or
    `model.materialize(device, generator)`, allocates and initialises it). `overrides` replace
    fields of the model's config (e.g. `vocab_size=`, `seq_len=`, `dropout=`). `init`: for a
    model directory, `pretrained` reads its safetensors, `random` draws transformers' init,
    `auto` is pretrained when the directory holds weights; presets have no weights."""
    if init not in INIT_CHOICES:
        raise CephaloError(f"model.init must be one of {', '.join(INIT_CHOICES)}, got {init!r}")
    builders = _builders()
    if name in builders:
        return builders[name](name, device, overrides, init)
    directory = model_directory(name)
    if directory is not None:
        from cephalo.modeling.hf.model import build_hf_directory_model

        return build_hf_directory_model(name, directory, device, overrides, init)
    path = Path(name).expanduser()
    if path.is_dir():
        raise CephaloError(
            f"model directory {path} has no config.json: it is not a transformers model "
            "(write one with model.save_pretrained(DIR), or name a preset)"
        )
    if path.exists():
        raise CephaloError(f"model {name} is a file; give the directory that holds its config.json")
    raise CephaloError(
        f"unknown model {name!r}; choose one of: {', '.join(sorted(builders))}, or a transformers "
        "model directory (config.json + safetensors) or a model id in the local Hugging Face cache"
    )


def model_spec_of(model: UnitModel) -> ModelSpec:
    """The `ModelSpec` of a runnable model (parameter counts measured on its modules)."""
    return model.spec


def initial_weights_note(name: str, init: str, adapter: str = "none") -> str | None:
    """What a job must say of its initial weights before it starts, or None: a model
    directory with no weights under `init = auto` trains from random values, which a user
    who meant to fine-tune must hear (a warning line), and adapters on a random frozen base
    learn nothing worth having (refused unless `init = random` says it is meant)."""
    directory = model_directory(name)
    if directory is None or init != "auto":
        return None
    from cephalo.modeling.hf.weights import weight_files_present

    if weight_files_present(directory):
        return None
    if adapter != "none":
        raise CephaloError(
            f"model {name} has no weights ({directory} holds config.json but no safetensors): "
            f"model.adapter = {adapter} would train adapters on a frozen base of random values, "
            "which learns nothing useful. Put the pretrained weights there "
            "(model.save_pretrained(DIR) writes model.safetensors), or set "
            'model.init = "random" to run it anyway (a test of the machinery)'
        )
    return (
        f"model {name} has no weights ({directory} holds config.json but no safetensors): it "
        "is initialised at RANDOM and trains from scratch. To fine-tune, put its weights "
        'there (model.save_pretrained(DIR)); to say random is meant, set model.init = "random"'
    )


def model_spec_for(name: str, **overrides: Any) -> ModelSpec:
    """What the planner needs of a model name: a runnable model's shape read off its modules
    (a preset or a model directory, built on the meta device: no weights are read), else a
    catalog model's published shape."""
    if name in list_runnable_models() or model_directory(name) is not None:
        return model_spec_of(build_model(name, "meta", init="random", **overrides))
    if Path(name).expanduser().exists():
        build_model(name, init="random")  # raises the clear error for this path
    return get_model_spec(name)


__all__ = [
    "GPTConfig",
    "build_model",
    "initial_weights_note",
    "list_runnable_models",
    "model_directory",
    "model_spec_for",
    "model_spec_of",
]
