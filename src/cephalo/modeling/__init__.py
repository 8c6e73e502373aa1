"""Runnable models, expressed as a sequence of units (see `units.py`).

`build_model(name, **overrides)` gives a meta-built `UnitModel`; `model.materialize(device,
generator)` allocates and initialises it. `transformers` models (`hf-*`) need the `hf` extra.
"""

from cephalo.modeling.gpt import GPT, GPTConfig
from cephalo.modeling.registry import build_model, list_runnable_models, model_spec_of
from cephalo.modeling.units import IGNORE_INDEX, Unit, UnitModel

__all__ = [
    "GPT",
    "IGNORE_INDEX",
    "GPTConfig",
    "Unit",
    "UnitModel",
    "build_model",
    "list_runnable_models",
    "model_spec_of",
]
