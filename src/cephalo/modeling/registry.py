"""Runnable models by name: `build_model("gpt-tiny", dropout=0.1)` -> a meta-built `UnitModel`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cephalo.errors import CephaloError
from cephalo.modeling.gpt import GPT, GPT_PRESETS, GPTConfig
from cephalo.modeling.units import UnitModel
from cephalo.specs.catalog import get_model_spec
from cephalo.specs.model import ModelSpec


def _build_gpt(name: str, device: torch.device | str, overrides: dict[str, Any]) -> UnitModel:
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


def _hf_builders() -> dict[str, Callable[[str, torch.device | str, dict[str, Any]], UnitModel]]:
    # hf.py imports transformers only when a model is built, so listing names never needs it.
    from cephalo.modeling import hf

    return {name: hf.build_hf_unit_model for name in hf.HF_PRESETS}


def _builders() -> dict[str, Callable[[str, torch.device | str, dict[str, Any]], UnitModel]]:
    builders: dict[str, Callable[[str, torch.device | str, dict[str, Any]], UnitModel]] = {
        name: _build_gpt for name in GPT_PRESETS
    }
    builders.update(_hf_builders())
    return builders


def list_runnable_models() -> list[str]:
    """Names `build_model` accepts."""
    return sorted(_builders())


def build_model(name: str, device: torch.device | str = "meta", **overrides: Any) -> UnitModel:
    """Build the named model as units on `device` (meta by default: call
    `model.materialize(device, generator)` to allocate and initialise it). `overrides` replace
    fields of the preset's config (e.g. `vocab_size=`, `seq_len=`, `dropout=`)."""
    builders = _builders()
    if name not in builders:
        raise CephaloError(f"unknown model {name!r}; choose one of: {', '.join(sorted(builders))}")
    return builders[name](name, device, overrides)


def model_directory(name: str) -> Path | None:
    """The local directory a model name stands for: a directory holding a transformers
    `config.json`, else None (a registry or catalog name). Nothing is ever downloaded."""
    path = Path(name).expanduser()
    return path if (path / "config.json").is_file() else None


def model_spec_of(model: UnitModel) -> ModelSpec:
    """The `ModelSpec` of a runnable model (parameter counts measured on its modules)."""
    return model.spec


def model_spec_for(name: str) -> ModelSpec:
    """What the planner needs of a model name: a catalog model's published shape, or else a
    runnable model's, read off its modules (built on the meta device: no weights)."""
    try:
        return get_model_spec(name)
    except CephaloError:
        if name not in list_runnable_models():
            raise
        return model_spec_of(build_model(name, "meta"))


__all__ = [
    "GPTConfig",
    "build_model",
    "list_runnable_models",
    "model_directory",
    "model_spec_for",
    "model_spec_of",
]
