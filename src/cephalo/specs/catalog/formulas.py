"""The catalog's formulas: FLOPs of a block and of the head per sample, the embedding's and head's
time relative to a block, activation bytes (Korthikanti et al.), boundary and logits bytes."""

from __future__ import annotations

from cephalo.specs.catalog.devices import DTYPE_BYTES
from cephalo.specs.catalog.models import VIT_CHANNELS, VIT_PATCH, VIT_TOKENS
from cephalo.specs.model import ModelSpec


def block_flops_per_sample(spec: ModelSpec, seq_len: int) -> float:
    """Forward FLOPs of one block for one sample: 2 per weight per token (the matmuls) plus
    attention scores and weighted sum, 2 * 2 * seq^2 * h (Narayanan et al. 2021). The weights
    are those a token uses: a mixture-of-experts block's active ones (top-k routed + shared
    experts, `ModelSpec.compute_params_per_block`), assuming tokens spread evenly over the
    experts (imbalance is not modelled)."""
    return (
        2.0 * spec.compute_params_per_block * seq_len + 4.0 * seq_len * seq_len * spec.hidden_size
    )


def head_flops_per_sample(spec: ModelSpec, seq_len: int) -> float:
    """Forward FLOPs of the output projection: 2 * tokens * h * V (ViT classifies one token)."""
    tokens = 1 if spec.arch == "vit" else seq_len
    return 2.0 * tokens * spec.hidden_size * spec.vocab_size


# An embedding lookup is a gather: memory-bound and tiny next to a block's matmuls. Its time
# is taken as this fraction of a block's (ViT's patch projection is a real matmul and uses
# its FLOP ratio instead, when larger).
EMBEDDING_TIME_FRACTION = 0.02


def embedding_time_ratio(spec: ModelSpec, seq_len: int) -> float:
    """Embedding time / block time."""
    if spec.arch == "vit":
        patch_flops = 2.0 * VIT_TOKENS * VIT_CHANNELS * VIT_PATCH * VIT_PATCH * spec.hidden_size
        return max(EMBEDDING_TIME_FRACTION, patch_flops / block_flops_per_sample(spec, seq_len))
    return EMBEDDING_TIME_FRACTION


def head_time_ratio(spec: ModelSpec, seq_len: int) -> float:
    """Head time / block time, by FLOP ratio (the published data times blocks only)."""
    return head_flops_per_sample(spec, seq_len) / block_flops_per_sample(spec, seq_len)


def korthikanti_block_activation_bytes(spec: ModelSpec, seq_len: int, dtype: str) -> float:
    """Activation bytes one block saves for backward, per sample, without recomputation:
    s*h*(34 + 5*a*s/h) in 16-bit training (Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models", eq. 1 with b=1, t=1); doubled in fp32."""
    s, h, a = seq_len, spec.hidden_size, spec.num_heads
    return s * h * (34 + 5 * a * s / h) * DTYPE_BYTES[dtype] / 2


def boundary_activation_bytes(spec: ModelSpec, seq_len: int, dtype: str) -> float:
    """One layer-boundary activation (a block's input kept for recomputation), per sample."""
    return seq_len * spec.hidden_size * DTYPE_BYTES[dtype]


def head_logits_bytes(spec: ModelSpec, seq_len: int, dtype: str) -> float:
    """The head's activations per sample: the logits in the compute dtype plus the fp32
    copy the loss (log-softmax) works on; in fp32 training that is two fp32 copies."""
    tokens = 1 if spec.arch == "vit" else seq_len
    return tokens * spec.vocab_size * (DTYPE_BYTES[dtype] + 4)
