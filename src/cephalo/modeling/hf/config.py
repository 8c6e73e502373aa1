"""The `transformers` config of a model: from a preset (`hf-llama-tiny`, a tiny config of a
family) or from a model directory's `config.json`, with the job's overrides applied.

Overrides take transformers' own field names (`num_hidden_layers=4`, GPT-2's `n_layer=4`) or
the generic names every model shares: `seq_len` (the position limit), `dropout` (every dropout
probability the config has), `tie_embeddings`, `vocab_size`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cephalo.errors import CephaloError, first_line
from cephalo.log import quiet_imports
from cephalo.modeling.gpt import MAX_LAYERS
from cephalo.modeling.hf.families import family_of
from cephalo.modeling.hf.multimodal import multimodal_type, text_config

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
"""The files that make up a saved Hugging Face tokenizer (those present are copied and hashed)."""


def transformers_module():
    """`transformers`, or one clear error naming the extra that installs it."""
    try:
        with quiet_imports():
            import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise CephaloError(
            "Hugging Face models need the `transformers` package: pip install 'cephalo[hf]'"
        ) from exc
    return transformers


@dataclass(frozen=True)
class HFPreset:
    """A named tiny (or small) `transformers` model: its family and its config fields."""

    model_type: str
    """transformers' `model_type` (`gpt2`, `llama`, ...)."""
    config: dict[str, Any]
    """Keyword arguments of the family's config class."""


_GPT2_NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

HF_PRESETS: dict[str, HFPreset] = {
    "hf-gpt2-tiny": HFPreset(
        "gpt2",
        dict(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2, **_GPT2_NO_DROPOUT),
    ),
    "hf-llama-tiny": HFPreset(
        "llama",
        # 4 query heads over 2 key/value heads: exercises grouped-query attention.
        dict(
            vocab_size=256,
            max_position_embeddings=32,
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        ),
    ),
    "hf-gpt2-124m": HFPreset(
        "gpt2",
        dict(
            vocab_size=50257,
            n_positions=1024,
            n_embd=768,
            n_layer=12,
            n_head=12,
            **_GPT2_NO_DROPOUT,
        ),
    ),
    "hf-llama-160m": HFPreset(
        "llama",
        dict(
            vocab_size=32000,
            max_position_embeddings=1024,
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=12,
            tie_word_embeddings=False,
        ),
    ),
}

POSITION_FIELDS = ("max_position_embeddings", "n_positions")
DROPOUT_FIELDS = (
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "attention_dropout",
    "hidden_dropout",
    "embedding_dropout",
    "residual_dropout",
)
GENERIC_SETTINGS = ("seq_len", "dropout", "tie_embeddings", "vocab_size")


def preset_config(name: str, overrides: dict[str, Any]):
    """The config of preset `name` with `overrides` applied."""
    tf = transformers_module()
    preset = HF_PRESETS[name]
    kwargs = dict(preset.config)
    # Special tokens are irrelevant to training; GPT-2's defaults (50256) fall outside tiny vocabularies.
    kwargs.setdefault("bos_token_id", None)
    kwargs.setdefault("eos_token_id", None)
    config = tf.AutoConfig.for_model(preset.model_type, **kwargs)
    return apply_overrides(name, config, overrides)


def read_config_json(directory: Path) -> dict[str, Any]:
    """`config.json` of a model directory as a dict (one clear error when it is not JSON)."""
    path = directory / "config.json"
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise CephaloError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise CephaloError(
            f"{path} is not valid JSON ({e}); save the model again with save_pretrained"
        ) from None
    if not isinstance(data, dict):
        raise CephaloError(f"{path} must hold a JSON object (a transformers config)")
    return data


def directory_config(directory: Path, overrides: dict[str, Any]):
    """The config in `directory/config.json` (never downloaded), `overrides` applied. An
    architecture the adapter does not serve is refused before transformers builds anything."""

    class _Raw:  # the family check reads these fields before transformers parses the file
        def __init__(self, data: dict[str, Any]):
            self.model_type = data.get("model_type")
            self.architectures = data.get("architectures")
            self.is_encoder_decoder = data.get("is_encoder_decoder", False)
            for key in ("vision_config", "text_config", "audio_config"):
                if key in data:
                    setattr(self, key, data[key])

    data = read_config_json(directory)
    check_not_quantized(directory, data)
    # Gemma 3 with its vision tower: its language model is what is trained
    multimodal = multimodal_type(data) is not None
    if not multimodal:
        family_of(_Raw(data))
    tf = transformers_module()
    try:
        config = tf.AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CephaloError(
            f"transformers cannot read {directory / 'config.json'}: {first_line(e)}"
        ) from None
    if multimodal:
        config = text_config(config)
    family_of(config)
    return apply_overrides(str(directory), config, overrides)


def check_not_quantized(directory: Path, data: dict[str, Any]) -> None:
    """A checkpoint stored quantized (MXFP4 gpt-oss, FP8, GPTQ, AWQ, bitsandbytes, ...): one
    error saying what to do. Cephalo trains from floating-point weights (its own QLoRA
    quantizes them itself)."""
    qc = data.get("quantization_config")
    if qc is None:
        text = data.get("text_config")
        qc = text.get("quantization_config") if isinstance(text, dict) else None
    if qc is None:
        return
    method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
    raise CephaloError(
        f"{directory} holds a quantized checkpoint (quantization_config: quant_method "
        f"{str(method)!r}); cephalo trains from floating-point (fp32 / bf16 / fp16) weights. Use "
        "the unquantized (bf16) release of the model, or dequantize it once with transformers "
        "(from_pretrained with the method's dequantize option where it has one, then "
        'save_pretrained). For QLoRA set model.adapter = "qlora" on the bf16 weights: cephalo '
        "quantizes them itself"
    )


def apply_overrides(name: str, config, overrides: dict[str, Any]):
    """A new config with `overrides` (HF field names or the generic settings) applied."""
    if not overrides:
        return config
    check_generic_settings(name, overrides)
    known = set(config.to_dict()) | set(getattr(config, "attribute_map", {}))
    changes: dict[str, Any] = {}
    for key, value in overrides.items():
        if key == "seq_len":
            targets = [f for f in POSITION_FIELDS if f in known][:1]
        elif key == "dropout":
            targets = [f for f in DROPOUT_FIELDS if f in known]
        elif key == "tie_embeddings":
            targets = ["tie_word_embeddings"]
        else:
            targets = [key] if key in known else []
        if not targets:
            raise CephaloError(
                f"model {name}: unknown setting {key!r}; use {', '.join(GENERIC_SETTINGS)} or a "
                f"{type(config).__name__} field"
            )
        for target in targets:
            changes[config.attribute_map.get(target, target)] = value
    try:
        return type(config).from_dict({**config.to_dict(), **changes})
    except Exception as e:  # transformers' own validation (types, ranges): say which settings
        raise CephaloError(
            f"model {name}: transformers rejects the settings {overrides}: {first_line(e)}"
        ) from None


def check_generic_settings(name: str, overrides: dict[str, Any]) -> None:
    """Types and ranges of the settings every model family shares (transformers accepts some
    bad ones, e.g. dropout 2.0, and fails only when training starts)."""
    for key in ("seq_len", "vocab_size"):
        value = overrides.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise CephaloError(f"model {name}: {key} must be an integer >= 1, got {value!r}")
    for key in ("n_layer", "num_hidden_layers"):
        value = overrides.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LAYERS
        ):
            raise CephaloError(
                f"model {name}: {key} must be an integer from 1 to {MAX_LAYERS}, got {value!r}"
            )
    if "dropout" in overrides:
        value = overrides["dropout"]
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value < 1.0:
            raise CephaloError(f"model {name}: dropout must be a number in [0, 1), got {value!r}")
    if "tie_embeddings" in overrides and not isinstance(overrides["tie_embeddings"], bool):
        raise CephaloError(
            f"model {name}: tie_embeddings must be true or false, got {overrides['tie_embeddings']!r}"
        )


__all__ = [
    "HF_PRESETS",
    "HFPreset",
    "apply_overrides",
    "directory_config",
    "preset_config",
    "transformers_module",
]
