"""Tiny random configs of every supported transformers family, saved with `save_pretrained`
into a directory (tests never download). Shapes are small but exercise each family's
peculiarities: grouped-query attention, sliding windows shorter than the test sequences
(Mistral, Phi-3, StarCoder2, Qwen2/3, Gemma 2, SmolLM3, Cohere2, EXAONE 4: per-layer full /
sliding attention), tied and untied embeddings, soft-capping, multipliers, learned positions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from cephalo.modeling.hf.families import FAMILIES

VOCAB = 96
SEQ = 16
WINDOW = 5  # shorter than SEQ: the sliding-window masks differ from the causal one

_LLAMA_LIKE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

_MOE = dict(
    _LLAMA_LIKE,
    num_experts_per_tok=2,
    output_router_logits=True,
    router_aux_loss_coef=0.5,  # large, so the aux term shows in the checks
)

TINY: dict[str, dict[str, Any]] = {
    "llama": dict(_LLAMA_LIKE, tie_word_embeddings=False),
    "mistral": dict(_LLAMA_LIKE, sliding_window=WINDOW),
    "qwen2": dict(
        _LLAMA_LIKE,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
        tie_word_embeddings=True,
    ),
    "qwen3": dict(
        _LLAMA_LIKE, head_dim=8, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
    "gemma": dict(_LLAMA_LIKE, head_dim=8),
    "gemma2": dict(
        _LLAMA_LIKE,
        head_dim=8,
        sliding_window=WINDOW,
        final_logit_softcapping=3.0,
        attn_logit_softcapping=5.0,
    ),
    # 3 layers: sliding, sliding, full (local / global rotary bases differ), q/k norms
    "gemma3_text": dict(
        _LLAMA_LIKE,
        head_dim=8,
        num_hidden_layers=3,
        sliding_window=WINDOW,
        sliding_window_pattern=3,
        final_logit_softcapping=3.0,
        query_pre_attn_scalar=8,
    ),
    # MoE: 4 experts, top 2, the router loss on; windows where the family has them
    "qwen2_moe": dict(
        _MOE,
        num_experts=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
    ),
    "qwen3_moe": dict(
        _MOE, num_experts=4, head_dim=8, moe_intermediate_size=16, norm_topk_prob=True
    ),
    "mixtral": dict(_MOE, num_local_experts=4, sliding_window=WINDOW),
    "olmoe": dict(_MOE, num_experts=4, intermediate_size=16),
    "gpt_oss": dict(
        _MOE, head_dim=8, num_local_experts=4, intermediate_size=16, sliding_window=WINDOW
    ),
    "granitemoe": dict(
        _MOE,
        num_local_experts=4,
        embedding_multiplier=3.0,
        logits_scaling=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.3,
    ),
    "flex_olmo": dict(_MOE, num_experts=4),
    "phi3": dict(_LLAMA_LIKE, sliding_window=WINDOW, resid_pdrop=0.0, embd_pdrop=0.0),
    "phi": dict(_LLAMA_LIKE, partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0),
    "gpt_neox": dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        rotary_pct=0.5,
        bos_token_id=None,
        eos_token_id=None,
    ),
    "gpt2": dict(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    ),
    "olmo": dict(_LLAMA_LIKE),
    "olmo2": dict(_LLAMA_LIKE),
    "granite": dict(
        _LLAMA_LIKE,
        embedding_multiplier=3.0,
        logits_scaling=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.3,
    ),
    "smollm3": dict(
        _LLAMA_LIKE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
    "starcoder2": dict(_LLAMA_LIKE, sliding_window=WINDOW, embedding_dropout=0.0),
    "cohere": dict(_LLAMA_LIKE, logit_scale=0.5),
    "cohere2": dict(_LLAMA_LIKE, sliding_window=WINDOW, logit_scale=0.5),
    "stablelm": dict(_LLAMA_LIKE, partial_rotary_factor=0.5),
    "helium": dict(_LLAMA_LIKE, head_dim=8),
    "glm": dict(_LLAMA_LIKE, head_dim=8),
    "glm4": dict(_LLAMA_LIKE, head_dim=8),
    "exaone4": dict(_LLAMA_LIKE, sliding_window=WINDOW, sliding_window_pattern=2),
    "arcee": dict(_LLAMA_LIKE),
    "seed_oss": dict(_LLAMA_LIKE, head_dim=8, attention_dropout=0.0, residual_dropout=0.0),
    "ernie4_5": dict(_LLAMA_LIKE, head_dim=8),
}
assert set(TINY) == set(FAMILIES), set(TINY) ^ set(FAMILIES)


def tiny_config(model_type: str, **changes: Any):
    import transformers

    return transformers.AutoConfig.for_model(model_type, **{**TINY[model_type], **changes})


def quiet_transformers() -> None:
    """No progress bars or warnings from transformers in test output."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def save_tiny_model(
    model_type: str,
    directory: Path,
    seed: int = 0,
    dtype=torch.float32,
    max_shard_size: str | None = None,
    **changes: Any,
) -> Path:
    """A random tiny model of `model_type` (transformers' own init, seeded) written with
    save_pretrained in `dtype`, sharded when `max_shard_size` is given; returns `directory`."""
    import transformers

    quiet_transformers()
    config = tiny_config(model_type, **changes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(directory), **kwargs)
    return directory


def save_tiny_gemma3_multimodal(directory: Path, seed: int = 0, dtype=torch.bfloat16) -> Path:
    """A tiny `Gemma3ForConditionalGeneration` (vision tower, projector, the language model
    of TINY["gemma3_text"]) written with save_pretrained; returns `directory`."""
    import transformers

    quiet_transformers()
    vision = dict(
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=TINY["gemma3_text"],
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=VOCAB - 1,
        boi_token_index=VOCAB - 3,
        eoi_token_index=VOCAB - 2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Gemma3ForConditionalGeneration(config).to(dtype)
    model.save_pretrained(str(directory))
    return directory
