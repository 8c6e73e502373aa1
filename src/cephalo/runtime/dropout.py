"""Plan-invariant dropout: masks drawn per SAMPLE from a key, not from a global RNG stream.

With a global generator, a dropout mask depends on how samples are grouped into
micro-batches and ranks, so two plans (or a sharded run and a single-process reference)
would train different models. Under `SampleDropout`, every `F.dropout` and every
`scaled_dot_product_attention(dropout_p > 0)` call draws the mask of sample j from its own
generator seeded by (seed, step, unit, call number within the unit, GLOBAL sample index).
The mask of a sample is then the same under every plan and in a recompute, and a
single-process reference that runs the units under the same mode (with sample offset 0 and
the whole global batch) replays it exactly. Tensors must be batch-first.

Cost: one small generator and one `bernoulli_` per sample and dropout call; the masks
themselves are the size of the dropped tensor, as with ordinary dropout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from cephalo.errors import CephaloError

_MASK63 = (1 << 63) - 1
_SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}


def sample_key(seed: int, step: int, unit: int, call: int, sample: int) -> int:
    """A 63-bit generator seed for one (seed, step, unit, call, sample) (splitmix64 mixing)."""
    x = 0
    for part in (seed, step, unit, call, sample):
        x = (x ^ (part & _MASK63)) + 0x9E3779B97F4A7C15
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & _MASK63


class SampleDropout(TorchFunctionMode):
    """Run one unit's forward for samples [sample_offset, sample_offset + b) of step `step`
    with per-sample dropout masks (see the module docstring)."""

    def __init__(self, seed: int, step: int, unit: int, sample_offset: int):
        super().__init__()
        self.seed, self.step, self.unit, self.sample_offset = seed, step, unit, sample_offset
        self.calls = 0

    def _mask(self, like: torch.Tensor, keep: float) -> torch.Tensor:
        call = self.calls
        self.calls += 1
        return self.draw(call, like.shape, like.dtype, like.device, keep)

    def draw(
        self, call: int, shape: torch.Size, dtype: torch.dtype, device: torch.device, keep: float
    ) -> torch.Tensor:
        """The mask of dropout call `call` of this unit: what `_mask` draws for it. A compiled
        block (runtime/capture/) draws its masks with it outside its graph, then takes them as
        inputs: the same masks in its forward, its recompute and the eager engine."""
        mask = torch.empty(shape, dtype=dtype, device=device)
        gen = torch.Generator(device=device)
        for j in range(shape[0]):
            gen.manual_seed(
                sample_key(self.seed, self.step, self.unit, call, self.sample_offset + j)
            )
            mask[j].bernoulli_(keep, generator=gen)
        return mask

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            return self._dropout(*args, **kwargs)
        if func in _SDPA:
            return self._sdpa(*args, **kwargs)
        if func in (
            F.dropout1d,
            F.dropout2d,
            F.dropout3d,
            F.alpha_dropout,
            F.feature_alpha_dropout,
        ):
            raise CephaloError(
                f"{func.__name__} is not supported under per-sample dropout; use F.dropout"
            )
        return func(*args, **kwargs)

    def _dropout(self, input, p: float = 0.5, training: bool = True, inplace: bool = False):
        if not training or p == 0.0:
            return input
        if p == 1.0:
            return input * 0.0
        out = input * self._mask(input, 1.0 - p) * (1.0 / (1.0 - p))
        if inplace:
            return input.copy_(out)
        return out

    def _sdpa(
        self,
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ):
        if dropout_p == 0.0:
            return F.scaled_dot_product_attention(
                query,
                key,
                value,
                attn_mask=attn_mask,
                dropout_p=0.0,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        # SDPA's own dropout draws from the global stream: spell the attention out instead
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            rep = query.shape[-3] // key.shape[-3]
            key = key.repeat_interleave(rep, dim=-3)
            value = value.repeat_interleave(rep, dim=-3)
        s_q, s_k = query.shape[-2], key.shape[-2]
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        scores = (query @ key.transpose(-2, -1)) * scale
        if is_causal:
            causal = torch.ones(s_q, s_k, dtype=torch.bool, device=query.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attn_mask, float("-inf"))
            else:
                scores = scores + attn_mask
        weights = torch.softmax(scores, dim=-1)
        weights = self._dropout(weights, dropout_p)
        return weights @ value


def module_uses_dropout(module: torch.nn.Module) -> bool:
    """Whether running `module` in training mode can drop anything: an `nn.Dropout`-like
    submodule with p > 0, or a positive number in an attribute whose name says dropout
    (`dropout`, `attention_dropout`, `dropout_p`: what SDPA-calling attention modules and
    functional dropout read), on the module or on a transformers `config` it holds.
    Conservative: a False here means no dropout call of the unit can draw a mask, so the
    engine may run it without `SampleDropout` (no per-op Python dispatch)."""
    for m in module.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        holders = [vars(m)]
        config = vars(m).get("config")
        if config is not None and hasattr(config, "__dict__"):
            holders.append(vars(config))
        for attrs in holders:
            for key, value in attrs.items():
                if (
                    "drop" in key.lower()
                    and isinstance(value, int | float)
                    and not isinstance(value, bool)
                    and value > 0
                ):
                    return True
    return False
