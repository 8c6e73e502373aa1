"""The `transformers` model families the HF adapter trains, and what each one's own `forward`
does besides running its modules (read from transformers' modeling files, version 5).

Every family listed has the common decoder layout: a causal-LM wrapper holding a base model
(token embedding, a list of decoder layers, a final norm, usually a rotary-embedding module)
and an LM head. The adapter runs transformers' own modules for everything that has
parameters; a `Family` names only the glue the base model's and the wrapper's `forward`
compute in between, so the adapter can supply it:

- which attention mask each layer gets (`masks`): the plain causal mask for every layer, the
  sliding-window mask for every layer when `config.sliding_window` is set (Mistral,
  Phi-3, StarCoder2), or one mask per `config.layer_types[i]` (Qwen2/3, Gemma 2, SmolLM3:
  full or sliding attention per layer);
- what happens to the token embeddings before the first layer (learned absolute positions,
  a dropout module or a dropout probability, a constant multiplier);
- what happens to the logits (a constant multiplier or divisor, tanh soft-capping).

Gemma's embedding scale lives inside its own embedding module, so it needs no entry. To add a
family, read its `XModel.forward` and `XForCausalLM.forward`, add a row, and add its tiny
config to tests/hf_configs.py (docs/models.md, "Adding a family").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from cephalo.errors import CephaloError

MaskRule = Literal["causal", "sliding_window", "layer_types"]


@dataclass(frozen=True)
class Family:
    """One `model_type` and the glue its `forward` adds around its modules."""

    label: str
    """Display name (docs, errors)."""
    masks: MaskRule = "causal"
    """Attention mask per layer: `causal`; `sliding_window` (every layer, when
    `config.sliding_window` is set); `layer_types` (by `config.layer_types[i]`)."""
    position_embedding: str | None = None
    """Base-model attribute of a learned absolute position embedding added to the tokens."""
    embedding_dropout: str | None = None
    """Base-model attribute of a dropout module applied to the embeddings."""
    embedding_dropout_p: str | None = None
    """Config field: dropout probability applied functionally to the embeddings."""
    embedding_multiplier: str | None = None
    """Config field: constant the embeddings are multiplied by."""
    logit_multiplier: str | None = None
    """Config field: constant the logits are multiplied by."""
    logit_divisor: str | None = None
    """Config field: constant the logits are divided by."""
    logit_softcapping: str | None = None
    """Config field: c in logits = c * tanh(logits / c) (None in the config: off)."""


FAMILIES: dict[str, Family] = {
    "llama": Family("Llama"),
    "mistral": Family("Mistral", masks="sliding_window"),
    "qwen2": Family("Qwen2", masks="layer_types"),
    "qwen3": Family("Qwen3", masks="layer_types"),
    "gemma": Family("Gemma"),
    "gemma2": Family("Gemma 2", masks="layer_types", logit_softcapping="final_logit_softcapping"),
    "gemma3_text": Family(
        "Gemma 3", masks="layer_types", logit_softcapping="final_logit_softcapping"
    ),
    # mixture of experts: every decoder layer one unit, its experts in the unit's parameters;
    # the router loss is `moe.RouterAux`
    "qwen2_moe": Family("Qwen2-MoE", masks="layer_types"),
    "qwen3_moe": Family("Qwen3-MoE", masks="sliding_window"),
    "mixtral": Family("Mixtral", masks="sliding_window"),
    "olmoe": Family("OLMoE"),
    "gpt_oss": Family("gpt-oss", masks="layer_types"),
    "granitemoe": Family(
        "GraniteMoE", embedding_multiplier="embedding_multiplier", logit_divisor="logits_scaling"
    ),
    "flex_olmo": Family("FlexOlmo"),
    "phi3": Family("Phi-3", masks="sliding_window"),
    "phi": Family("Phi", embedding_dropout="embed_dropout"),
    "gpt_neox": Family("GPT-NeoX", embedding_dropout="emb_dropout"),
    "gpt2": Family("GPT-2", position_embedding="wpe", embedding_dropout="drop"),
    "olmo": Family("OLMo"),
    "olmo2": Family("OLMo 2"),
    "granite": Family(
        "Granite", embedding_multiplier="embedding_multiplier", logit_divisor="logits_scaling"
    ),
    "smollm3": Family("SmolLM3", masks="layer_types"),
    "starcoder2": Family(
        "StarCoder2", masks="sliding_window", embedding_dropout_p="embedding_dropout"
    ),
    "cohere": Family("Cohere (Command R)", logit_multiplier="logit_scale"),
    "cohere2": Family("Cohere2", masks="layer_types", logit_multiplier="logit_scale"),
    "stablelm": Family("StableLM"),
    "helium": Family("Helium"),
    "glm": Family("GLM"),
    "glm4": Family("GLM-4"),
    "exaone4": Family("EXAONE 4", masks="layer_types"),
    "arcee": Family("Arcee"),
    "seed_oss": Family("Seed-OSS"),
    "ernie4_5": Family("ERNIE 4.5"),
}


def supported_families() -> str:
    """The families as one line, for error messages and docs."""
    return ", ".join(f"{f.label} ({t})" for t, f in FAMILIES.items())


def family_of(config: Any) -> Family:
    """The `Family` of a transformers config, or one `CephaloError` naming what is supported."""
    model_type = getattr(config, "model_type", None) or "?"
    family = FAMILIES.get(model_type)
    if family is not None:
        return family
    if getattr(config, "is_encoder_decoder", False):
        what = "an encoder-decoder model"
    elif any(hasattr(config, k) for k in ("vision_config", "text_config", "audio_config")):
        what = "a multimodal model"
    else:
        what = "a model type the adapter does not know"
    architectures = ", ".join(getattr(config, "architectures", None) or []) or "no architectures"
    raise CephaloError(
        f"model type {model_type!r} ({architectures}) is {what}: cephalo trains decoder-only "
        f"causal LMs of these transformers families: {supported_families()}. See docs/models.md "
        "for how to add a family"
    )


def config_value(config: Any, field: str | None) -> Any:
    """`config.field`, or None when the family has no such glue."""
    return None if field is None else getattr(config, field, None)


__all__ = ["FAMILIES", "Family", "config_value", "family_of", "supported_families"]
