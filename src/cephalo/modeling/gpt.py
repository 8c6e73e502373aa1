"""A compact GPT (GPT-2 architecture, our own code) expressed as units.

    embedding: token + position embedding, dropout
    block:     pre-LN causal self-attention (SDPA) + pre-LN GELU MLP, residual dropout
    head:      final LayerNorm, output projection (tied to the token embedding by default),
               summed fp32 cross-entropy

Randomness is drawn only inside `forward` (dropout, through the global generator), so the
engine can replay a block's forward in backward by restoring the RNG state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cephalo.errors import CephaloError
from cephalo.modeling.units import (
    LMHead,
    Unit,
    UnitModel,
    fill_normal_,
    skip_init_on_meta,
    spec_from_units,
)

# Every block is a module built up front (on the meta device, but still one Python object
# graph per block): a typo like n_layer = 1e9 would otherwise build for hours.
MAX_LAYERS = 10_000
MAX_PARAMS = 10**13


@dataclass
class GPTConfig:
    """Shape and regularisation of a built-in GPT."""

    vocab_size: int = 256
    """Size of the token vocabulary (and of the output layer)."""
    seq_len: int = 32
    """Longest sequence the position embedding covers (nanoGPT's block_size)."""
    n_layer: int = 2
    """Number of Transformer blocks."""
    n_head: int = 2
    """Attention heads per block; must divide `n_embd`."""
    n_embd: int = 64
    """Hidden width."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention weights and residual branches."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers (GPT-2 has them)."""
    tie_embeddings: bool = True
    """The output projection is the token embedding matrix (the same Parameter)."""

    def validate(self) -> None:
        # overrides come from TOML / the command line: check types before comparing values
        for field_name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise CephaloError(f"GPT config: {field_name} must be an integer, got {value!r}")
        for field_name in ("bias", "tie_embeddings"):
            if not isinstance(getattr(self, field_name), bool):
                raise CephaloError(
                    f"GPT config: {field_name} must be true or false, got {getattr(self, field_name)!r}"
                )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, int | float):
            raise CephaloError(
                f"GPT config: dropout must be a number in [0, 1), got {self.dropout!r}"
            )
        # ~12 d^2 per block plus the embeddings: a typo like n_embd = 1e9 fails here, not as a
        # storage-size overflow inside torch
        approx_params = (
            12 * self.n_layer * self.n_embd**2 + (self.vocab_size + self.seq_len) * self.n_embd
        )
        if approx_params > MAX_PARAMS:
            raise CephaloError(
                f"GPT config: about {approx_params:.2e} parameters (n_layer {self.n_layer}, n_embd {self.n_embd}, "
                f"vocab_size {self.vocab_size}, seq_len {self.seq_len}) is more than {MAX_PARAMS:.0e}; is it a typo?"
            )
        if self.n_layer > MAX_LAYERS:
            raise CephaloError(
                f"GPT config: n_layer = {self.n_layer} is more than {MAX_LAYERS} blocks; is it a typo?"
            )
        for field_name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd"):
            if getattr(self, field_name) < 1:
                raise CephaloError(
                    f"GPT config: {field_name} must be >= 1, got {getattr(self, field_name)}"
                )
        if self.n_embd % self.n_head != 0:
            raise CephaloError(
                f"GPT config: n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise CephaloError(f"GPT config: dropout must be in [0, 1), got {self.dropout}")

    @property
    def block_size(self) -> int:
        """nanoGPT's name for `seq_len`."""
        return self.seq_len


class GPTEmbedding(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.seq_len = config.seq_len
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.seq_len, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        if seq > self.seq_len:
            raise CephaloError(
                f"sequence length {seq} exceeds the model's seq_len {self.seq_len}; "
                "shorten the data's sequences or build the model with a larger seq_len"
            )
        positions = torch.arange(seq, device=input_ids.device)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        # [b, s, d] -> [b, heads, s, d/heads]
        q, k, v = (t.view(b, s, self.n_head, d // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, s, d)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class GPTBlock(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln_1(h))
        return h + self.mlp(self.ln_2(h))


class GPTHead(LMHead):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(h))


class GPT(UnitModel):
    """The built-in GPT as units: `embedding`, `blocks.0` .. `blocks.{n-1}`, `head`."""

    def __init__(self, config: GPTConfig, name: str = "gpt", device: torch.device | str = "meta"):
        config.validate()
        self.config = config
        # fork_rng: a non-meta build runs nn.Linear's default init; keep the global RNG
        # (dropout's source) untouched by construction.
        with torch.random.fork_rng(devices=[]), torch.device(device), skip_init_on_meta(device):
            embedding = GPTEmbedding(config)
            blocks = [GPTBlock(config) for _ in range(config.n_layer)]
            head = GPTHead(config)
        if config.tie_embeddings:
            head.lm_head.weight = embedding.wte.weight
        units = (
            [Unit("embedding", "embedding", embedding)]
            + [Unit(f"blocks.{i}", "block", blk) for i, blk in enumerate(blocks)]
            + [Unit("head", "head", head)]
        )
        spec = spec_from_units(
            units,
            name=name,
            arch="gpt",
            hidden_size=config.n_embd,
            num_heads=config.n_head,
            vocab_size=config.vocab_size,
            ffn_hidden_size=4 * config.n_embd,
            tied_embeddings=config.tie_embeddings,
            max_seq_len=config.seq_len,
        )
        super().__init__(spec, units)

    def init_parameter(
        self, unit_name: str, param_name: str, param: nn.Parameter, generator: torch.Generator
    ) -> None:
        """GPT-2 init: N(0, 0.02) for matrices and embeddings, N(0, 0.02/sqrt(2 n_layer)) for
        the projections that write into the residual stream, zero biases, unit LayerNorm
        scales. Drawn on the CPU from `generator` (see `fill_normal_`), so the values do not
        depend on the device or on which rank materialises them."""
        if param_name.startswith("ln_") or ".ln_" in param_name:
            param.fill_(1.0 if param_name.endswith("weight") else 0.0)
        elif param_name.endswith("bias"):
            param.zero_()
        elif param_name.endswith("c_proj.weight"):
            fill_normal_(param, 0.02 / math.sqrt(2 * self.config.n_layer), generator)
        else:
            fill_normal_(param, 0.02, generator)


GPT_PRESETS: dict[str, GPTConfig] = {
    # ~0.12M parameters: unit tests, equivalence tests.
    "gpt-tiny": GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, n_embd=64),
    # ~0.8M: fast multi-process runs on CPU.
    "gpt-nano": GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, n_embd=128),
    # ~3.3M, byte-level: trains visibly on 2 CPU cores in a couple of minutes.
    "gpt-small-demo": GPTConfig(
        vocab_size=256, seq_len=128, n_layer=4, n_head=4, n_embd=256, dropout=0.1
    ),
    # GPT-2 small (124M; vocab padded to a multiple of 64): GPU checks.
    "gpt2-124m": GPTConfig(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, n_embd=768),
}
