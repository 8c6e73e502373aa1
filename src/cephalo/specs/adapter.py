"""Adapter fine-tuning (LoRA, QLoRA) as the planner sees it: what a frozen base parameter and a
trained adapter parameter cost in bytes, and how many adapter parameters a unit has.

The ONE place these numbers live; the cost model (`cephalo.costmodel.model`, through
`cephalo.costmodel.layout`) reads them, and so do the plan printout and the docs' tables.

- A frozen base parameter is stored (and gathered) in the compute dtype: 2 bytes in bf16 /
  fp16, 4 in fp32. It has no fp32 master, no gradient, no AdamW moments.
- Under QLoRA the block Linear weights are stored as NF4 with double quantization (QLoRA,
  Dettmers et al. 2023; bitsandbytes and torchao's `NF4Tensor` alike): 4 bits per weight, one
  absmax per block of 64 weights quantized to 8 bits, and one fp32 scale per 256 of those
  absmaxes (`nf4_bytes_per_param`). Everything else of the base (norms, biases, embedding,
  output head) stays in the compute dtype, as bitsandbytes' QLoRA leaves it.
- An adapter parameter is trained: fp32 master + fp32 gradient + two fp32 AdamW moments = 16
  bytes, as a fully trained parameter.
- LoRA of rank r on a Linear of shape (in, out) adds A (r x in) and B (out x r): r * (in + out)
  parameters. `all-linear` means what peft means: every Linear of the Transformer blocks, not
  the output head (the embedding has none).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from cephalo.errors import CephaloError

ADAPTER_MODES = ("none", "lora", "qlora")
"""`model.adapter`: full fine-tuning, LoRA on a frozen compute-dtype base, LoRA on an NF4 base."""
DEFAULT_LORA_R = 16
ALL_LINEAR = "all-linear"

ADAPTER_BYTES_PER_PARAM = 16
"""A trained adapter parameter on its owner: fp32 master (4) + fp32 gradient (4) + AdamW
exp_avg (4) + exp_avg_sq (4)."""

# NF4 with double quantization: the block sizes bitsandbytes (`blocksize=64`, nested absmax in
# blocks of 256) and torchao (`NF4Tensor`: block_size 64, scaler_block_size 256) both use.
NF4_BITS = 4
NF4_BLOCK = 64
"""Weights sharing one absmax."""
NF4_ABSMAX_BITS = 8
"""The absmaxes are quantized to 8 bits (the 'double' quantization)."""
NF4_ABSMAX_BLOCK = 256
"""Absmaxes sharing one fp32 second-level scale."""
NF4_SCALE_BYTES = 4
NF4_DEQUANT_CHUNK = 1 << 20
"""Elements the runtime dequantizes at a time, at most (whole scaler blocks; modeling/nf4.py)."""
NF4_DEQUANT_TRANSIENT_BYTES = 20
"""Bytes per element of a chunk that torchao's `get_original_weight` holds in temporaries at
its peak (int64 codes, fp32 values and scales; measured 20.06 on the CPU)."""


def nf4_bytes_per_param() -> float:
    """Bytes of one NF4 weight with double quantization: 4/8 + 1/64 + 4/(64*256) =
    0.515869140625 (4.127 bits). Per-tensor constants (the 16-entry code book, one fp32 mean
    of the absmaxes) are a few dozen bytes per tensor and left out."""
    return (
        NF4_BITS / 8
        + NF4_ABSMAX_BITS / 8 / NF4_BLOCK
        + NF4_SCALE_BYTES / (NF4_BLOCK * NF4_ABSMAX_BLOCK)
    )


def nf4_dequant_transient_bytes(numel: int) -> int:
    """Bytes of torchao's temporaries while one NF4 weight of `numel` elements is dequantized:
    `NF4_DEQUANT_TRANSIENT_BYTES` per element of a chunk (whole scaler blocks, at most about
    `NF4_DEQUANT_CHUNK` elements; the whole weight when it is smaller). The runtime charges
    this to its ledger (runtime/state/frozen.py) and the cost model counts it (costmodel/layout.py)."""
    unit = NF4_BLOCK * NF4_ABSMAX_BLOCK
    chunk = min(numel, max(unit, NF4_DEQUANT_CHUNK // unit * unit))
    return NF4_DEQUANT_TRANSIENT_BYTES * chunk


@dataclass(frozen=True)
class Linear:
    """One Linear (or transformers Conv1D) layer of a block: its name inside the block and shape."""

    name: str
    """Dotted name relative to the block, e.g. `self_attn.q_proj`."""
    in_features: int
    out_features: int

    @property
    def weight_params(self) -> int:
        return self.in_features * self.out_features


@dataclass(frozen=True)
class AdapterSpec:
    """What is trained: `none` (every parameter), or LoRA of rank `r` on `targets`, over a base in
    the compute dtype (`lora`) or in NF4 (`qlora`)."""

    mode: str = "none"
    r: int = DEFAULT_LORA_R
    targets: str | tuple[str, ...] = ALL_LINEAR
    """`all-linear`; a tuple of module names matched as peft matches a list (a name equal to
    the target or ending in `.target`); another string is a regular expression, as peft takes
    one (matched here against the block-relative name: in full, else anywhere in it)."""
    objective: str = "sft"
    """`train.objective`: `sft`, or `dpo`, whose sample is a preference pair (2 rows) and,
    under an adapter, also runs the reference's forward (the base with the adapters off)."""

    def __post_init__(self) -> None:
        if self.mode not in ADAPTER_MODES:
            raise CephaloError(
                f"adapter must be one of {', '.join(ADAPTER_MODES)}, got {self.mode!r}"
            )
        if self.mode != "none" and self.r <= 0:
            raise CephaloError(f"lora_r must be a positive integer, got {self.r}")
        if isinstance(self.targets, list):  # a config's list: keep the spec hashable
            object.__setattr__(self, "targets", tuple(self.targets))

    @property
    def frozen_base(self) -> bool:
        return self.mode != "none"

    @property
    def quantized(self) -> bool:
        return self.mode == "qlora"

    @property
    def rows_per_sample(self) -> int:
        """Sequences a planned sample runs: a DPO pair is two (chosen, rejected)."""
        return 2 if self.objective == "dpo" else 1

    @property
    def reference_forward(self) -> bool:
        """DPO under an adapter: every unit also runs its base forward (the reference) in the
        step's forward (runtime/engine/step_passes.py)."""
        return self.objective == "dpo" and self.frozen_base

    def describe(self) -> str:
        if self.mode == "none":
            return "full fine-tuning"
        targets = self.targets if isinstance(self.targets, str) else ",".join(self.targets)
        base = "NF4 base" if self.quantized else "frozen base"
        return f"{self.mode} r={self.r} on {targets} ({base})"

    def to_dict(self) -> dict:
        targets = self.targets if isinstance(self.targets, str) else list(self.targets)
        out = {"mode": self.mode, "r": self.r, "targets": targets}
        if self.objective != "sft":
            out["objective"] = self.objective
        return out

    @classmethod
    def from_dict(cls, data: dict | None) -> AdapterSpec:
        if not data:
            return cls()
        return cls(
            data.get("mode", "none"),
            int(data.get("r", DEFAULT_LORA_R)),
            data.get("targets", ALL_LINEAR),
            data.get("objective", "sft"),
        )


def adapter_spec(
    adapter: str = "none",
    lora_r: int = DEFAULT_LORA_R,
    target_modules: str | Sequence[str] = ALL_LINEAR,
    objective: str = "sft",
) -> AdapterSpec:
    """The planner's view of a job's `model.adapter`, `model.lora_r`,
    `model.lora_target_modules` and `train.objective` (what `trainer.auto_plan` passes to the
    cost model)."""
    targets = target_modules if isinstance(target_modules, str) else tuple(target_modules)
    return AdapterSpec(adapter, int(lora_r), targets, objective)


def frozen_bytes_per_param(dtype_bytes: int, quantized: bool) -> float:
    """Bytes of one frozen base parameter: the compute dtype's, or NF4's."""
    return nf4_bytes_per_param() if quantized else float(dtype_bytes)


def targeted(linears: Sequence[Linear], targets: str | tuple[str, ...]) -> list[Linear]:
    """The Linear layers LoRA adapts: all of them for `all-linear`; for a regular expression
    those it matches; for names those whose name is a target or ends in `.target` (peft's
    suffix match)."""
    if targets == ALL_LINEAR:
        return list(linears)
    if isinstance(targets, str):
        try:
            pattern = re.compile(targets)
        except re.error as e:
            raise CephaloError(
                f"lora target modules {targets!r}: not a regular expression ({e})"
            ) from None
        return [lin for lin in linears if _regex_targets(pattern, lin.name)]
    names = targets
    return [
        lin for lin in linears if any(lin.name == t or lin.name.endswith("." + t) for t in names)
    ]


BLOCK_PATHS = (
    "model.layers.0",
    "model.language_model.layers.0",
    "model.decoder.layers.0",
    "transformer.h.0",
    "transformer.blocks.0",
    "gpt_neox.layers.0",
    "base_model.model.model.layers.0",
)
"""Where transformers families keep their first decoder block: a peft regex (matched in full
against the model's module names) is tried against the block's names under each of them."""


def _regex_targets(pattern: re.Pattern, name: str) -> bool:
    """Whether peft's `fullmatch` of `pattern` would take this block Linear. Our names are
    relative to the block (with the unit's own `layer.` wrapper for transformers blocks)."""
    tail = name.removeprefix("layer.")
    candidates = (name, tail, *(f"{path}.{tail}" for path in BLOCK_PATHS))
    return any(pattern.fullmatch(c) for c in candidates)


def lora_params(linears: Sequence[Linear], r: int, targets: str | tuple[str, ...]) -> int:
    """LoRA parameters on these layers: r * (in + out) per targeted layer."""
    return sum(r * (lin.in_features + lin.out_features) for lin in targeted(linears, targets))


def check_targets(linears: Sequence[Linear], targets: str | tuple[str, ...], model: str) -> None:
    """A clear error when the targets match no Linear of the blocks (naming the ones there are)."""
    if not linears:
        raise CephaloError(
            f"model {model}: its blocks' Linear layers are unknown, so LoRA cannot be planned"
        )
    if not targeted(linears, targets):
        names = ", ".join(sorted({lin.name for lin in linears}))
        raise CephaloError(
            f"lora target modules {targets!r} match no Linear of {model}'s blocks; "
            f"its Linear layers are: {names}"
        )


def default_block_linears(
    arch: str, hidden: int, ffn: int, num_heads: int, num_kv_heads: int | None = None
) -> tuple[Linear, ...]:
    """The Linear layers of one block of a catalog family, named as its runnable module names
    them (cephalo's GPT, transformers' Llama/Mistral and BERT/ViT)."""
    h, f = hidden, ffn
    if arch in ("llama", "mistral"):
        kv = h * (num_kv_heads or num_heads) // num_heads
        return (
            Linear("self_attn.q_proj", h, h),
            Linear("self_attn.k_proj", h, kv),
            Linear("self_attn.v_proj", h, kv),
            Linear("self_attn.o_proj", h, h),
            Linear("mlp.gate_proj", h, f),
            Linear("mlp.up_proj", h, f),
            Linear("mlp.down_proj", f, h),
        )
    if arch == "gpt":
        return (
            Linear("attn.c_attn", h, 3 * h),
            Linear("attn.c_proj", h, h),
            Linear("mlp.c_fc", h, f),
            Linear("mlp.c_proj", f, h),
        )
    if arch in ("bert", "vit"):
        qkv = "attention.self" if arch == "bert" else "attention.attention"
        return (
            Linear(f"{qkv}.query", h, h),
            Linear(f"{qkv}.key", h, h),
            Linear(f"{qkv}.value", h, h),
            Linear("attention.output.dense", h, h),
            Linear("intermediate.dense", h, f),
            Linear("output.dense", f, h),
        )
    return ()
