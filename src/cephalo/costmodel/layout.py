"""What each unit of a model moves, holds and trains under full fine-tuning, LoRA or QLoRA: the
per-unit quantities the cost model's formulas read (`CostModel.layout`).

Full fine-tuning is the special case with nothing frozen, so the cost model has one set of
formulas for all three modes. Per unit kind k (embedding, block, head; a tied head gathers the
token embedding too), with P_k its parameters, W_k its block Linear weights, A_k its LoRA
parameters (`specs.adapter.lora_params`), d the compute dtype's bytes, q = 0.5159 (NF4):

                      full            lora                    qlora
  gather bytes        P_k d           P_k d + A_k d           W_k q + (P_k - W_k) d + A_k d
  held while computing  = gather bytes                        + W_k d (the dequantized weights)
  dequantizing        0               0                       + torchao's temporaries of the
                                                                largest weight (20 B x its chunk)
  gradients (fp32)    P_k             A_k                     A_k
  state at s = 1      16 P            d P + 16 A              q W + d (P - W) + 16 A
  optimizer params    P               A                       A

(the adapters' compute-dtype copy is gathered with the base, as a trained parameter's is; their
fp32 master, gradient and AdamW moments are the 16 B; the frozen base has none of those.)

Time. The profiles (catalog or `cephalo profile`) are measured with every parameter trained.
With a frozen base the backward skips the weight gradients of the frozen matmuls: a frozen
Linear's backward computes only its input gradient, FROZEN_MATMUL_BACKWARD_SHARE (1/2) of a
trained one's FLOPs. Per unit, from forward FLOPs per token (matmuls 2 W_k, attention's
scores and weighted sum 4 * seq * h, the adapters 2 A_k), the measured times are scaled by

  forward   (2W + 4 s h + 2A) / (2W + 4 s h)
  backward  (2 * 2W * share + 2 * 4 s h + 2 * 2A) / (2 * 2W + 2 * 4 s h)

(the attention matmuls and the adapters keep both gradients). The embedding's backward is only
its weight gradient: 0 when frozen. The output head is frozen and not adapted: `share`. Under
QLoRA every pass of a block also dequantizes its W_k weights once (the whole micro-batch loop
of a layer uses them): q + d bytes per weight streamed at the bandwidth the profile's optimizer
step reaches (`optimizer_s_per_param` / the 30 bytes AdamW streams per parameter). A profile
measured on an adapter run (its meta `adapter` names the mode) already holds all of this and is
used as measured; one measured on a model with a frozen base (`cephalo profile` / the
automatic plan of a LoRA or QLoRA job: its meta `adapter` is `lora`) has no factor but still
gets QLoRA's dequantization: timed by the profiler on a QLoRA model (meta
`nf4_dequant_s_per_param`, seconds per weight), else estimated as above.
"""

from __future__ import annotations

from dataclasses import dataclass

from cephalo.specs.adapter import (
    ADAPTER_BYTES_PER_PARAM,
    AdapterSpec,
    check_targets,
    frozen_bytes_per_param,
    lora_params,
    nf4_dequant_transient_bytes,
)
from cephalo.specs.catalog.devices import ADAMW_BYTES_PER_PARAM
from cephalo.specs.model import ModelSpec
from cephalo.specs.profile import DeviceProfile

FULL_STATE_BYTES_PER_PARAM = 16
"""A trained parameter: fp32 master + fp32 gradient + two fp32 Adam moments."""
FROZEN_MATMUL_BACKWARD_SHARE = 0.5
"""Backward FLOPs of a frozen matmul / those of a trained one: only the input gradient (one of
the two matmuls) is computed. The ONE place the frozen-base backward saving is stated."""
KINDS = ("embedding", "block", "head")
NF4_DEQUANT_META = "nf4_dequant_s_per_param"
"""A profile's meta key: seconds per weight of the runtime's NF4 dequantization, measured by the
profiler on a QLoRA model (`profiling.measure.measure_nf4_dequant`)."""


@dataclass(frozen=True)
class UnitLayout:
    """One unit kind's parameters by role."""

    params: int
    """Parameters the unit gathers (a tied head: its own and the token embedding)."""
    quantized: int
    """Of them stored as NF4 (QLoRA: the block Linear weights)."""
    adapter: int
    """LoRA parameters (trained)."""
    trained: int
    """Parameters with a gradient and optimizer state: all (full) or the adapters."""
    gather_bytes: float
    """Bytes one all-gather of the unit moves (and the device holds while it is prefetched)."""
    held_bytes: float
    """Bytes of the gathered unit while it computes (QLoRA: plus its dequantized weights)."""
    dequant_bytes: float
    """Bytes streamed to dequantize the unit once (read NF4, write the compute dtype)."""
    fwd_factor: float = 1.0
    bwd_factor: float = 1.0
    """Factors on the measured forward and backward (without recompute) times."""
    dequant_transient_bytes: float = 0.0
    """QLoRA: torchao's temporaries while the unit's largest NF4 weight is dequantized, on top
    of `held_bytes` (`specs.adapter.nf4_dequant_transient_bytes`); 0 without NF4 weights."""


@dataclass(frozen=True)
class ParamLayout:
    """The model's parameters by role under an adapter mode (see the module docstring)."""

    adapter: AdapterSpec
    units: dict[str, UnitLayout]
    owned_trained: tuple[int, ...]
    """Trained parameters each unit owns, in unit order (a tied matrix once, in the embedding)."""
    state_bytes: float
    """Device bytes of the whole model's sharded state (state fraction 1)."""
    frozen_bytes: float
    """Of them, the frozen base's."""
    trained_params: int
    """Parameters with optimizer state (the optimizer step's work)."""

    def time_factors(self, profile: DeviceProfile) -> dict[str, tuple[float, float, float]]:
        """Per unit kind (forward factor, backward factor, seconds to dequantize once) for a
        device profile; identity for a profile measured on an adapter run."""
        measured = profile.meta.get("adapter", "none")
        if measured == "qlora" or not self.adapter.frozen_base:
            return {k: (1.0, 1.0, 0.0) for k in KINDS}
        rate = profile.meta.get(NF4_DEQUANT_META)
        s_per_byte = profile.optimizer_s_per_param / ADAMW_BYTES_PER_PARAM

        def dequant_s(u: UnitLayout) -> float:
            # measured (a profile of the QLoRA model) or the bytes streamed at the optimizer's
            # bandwidth (a lower bound: torchao's dequantization is slower, e.g. 12x on a CPU)
            return u.quantized * rate if rate is not None else u.dequant_bytes * s_per_byte

        if measured == "lora":  # measured with a frozen base; not the NF4 dequantization
            return {k: (1.0, 1.0, dequant_s(u)) for k, u in self.units.items()}
        return {k: (u.fwd_factor, u.bwd_factor, dequant_s(u)) for k, u in self.units.items()}


def param_layout(
    model: ModelSpec, seq_len: int, dtype_bytes: int, adapter: AdapterSpec | None = None
) -> ParamLayout:
    """The layout of `model` at `seq_len` in a compute dtype of `dtype_bytes` bytes."""
    adapter = adapter or AdapterSpec()
    tied = model.vocab_size * model.hidden_size if model.tied_embeddings else 0
    params = {
        "embedding": model.embedding_params,
        "block": model.params_per_block,
        "head": model.head_params + tied,
    }
    owned = model.unit_params()
    if not adapter.frozen_base:
        units = {
            k: UnitLayout(p, 0, 0, p, p * dtype_bytes, p * dtype_bytes, 0.0)
            for k, p in params.items()
        }
        return ParamLayout(
            adapter,
            units,
            tuple(owned),
            float(model.total_params * FULL_STATE_BYTES_PER_PARAM),
            0.0,
            model.total_params,
        )
    check_targets(model.block_linears, adapter.targets, model.name)
    d = float(dtype_bytes)
    q = frozen_bytes_per_param(dtype_bytes, adapter.quantized)
    weights = sum(lin.weight_params for lin in model.block_linears)
    a_block = lora_params(model.block_linears, adapter.r, adapter.targets)
    share = FROZEN_MATMUL_BACKWARD_SHARE
    matmul, attention, lora = 2.0 * weights, 4.0 * seq_len * model.hidden_size, 2.0 * a_block
    units = {}
    for k, p in params.items():
        w = weights if k == "block" and adapter.quantized else 0
        a = a_block if k == "block" else 0
        gather = w * q + (p - w) * d + a * d
        if k == "block":
            fwd = (matmul + attention + lora) / (matmul + attention)
            # a trained matmul's backward is two matmuls (input and weight gradients)
            bwd = (2 * matmul * share + 2 * attention + 2 * lora) / (2 * matmul + 2 * attention)
        else:  # embedding: a lookup whose backward is its weight gradient; head: a frozen matmul
            fwd, bwd = 1.0, 0.0 if k == "embedding" else share
        transient = (
            nf4_dequant_transient_bytes(max(lin.weight_params for lin in model.block_linears))
            if w
            else 0
        )
        units[k] = UnitLayout(
            p, w, a, a, gather, gather + w * d, w * (q + d), fwd, bwd, float(transient)
        )
    quantized_total = weights * model.num_layers if adapter.quantized else 0
    frozen = quantized_total * q + (model.total_params - quantized_total) * d
    a_total = a_block * model.num_layers
    return ParamLayout(
        adapter,
        units,
        tuple(0 if k != "block" else a_block for k in model.unit_kinds()),
        frozen + a_total * ADAPTER_BYTES_PER_PARAM,
        frozen,
        a_total,
    )
