"""NF4 with double quantization (QLoRA), as bytes: torchao's `NF4Tensor`, packed.

A weight of n elements becomes, in this order, each piece 8-byte aligned:

    codes      uint8  [n / 2]                 two 4-bit NF4 indices per byte
    scalers    int8   [n / block]             each block's absmax, quantized (double quant)
    factors    fp32   [n / block / sblock]    the scalers' quantization factors
    mean       fp32   [1]                     the scalers' mean

exactly torchao's `to_nf4(w, block_size=64, scaler_block_size=256)` fields (quantized from
the fp32 value, so `factors` and `mean` are fp32): about 0.52 bytes per parameter. The
bytes live inside the frozen base's float-typed flat buffer (runtime/state/frozen.py), so the
uneven-shard all-gathers move them unchanged; after a unit's gather they are put back
into an `NF4Tensor` and dequantized with torchao's own `get_original_weight`.

A weight whose block count is not a multiple of 256 (small models) uses the largest
divisor of its block count below 256 as the scaler block; one whose size is not a
multiple of 64 is not quantized (`nf4_format` returns None; it stays in compute dtype).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from cephalo.errors import CephaloError
from cephalo.log import quiet_imports
from cephalo.specs.adapter import NF4_DEQUANT_CHUNK, NF4_DEQUANT_TRANSIENT_BYTES

BLOCK_SIZE = 64
SCALER_BLOCK_SIZE = 256
_ALIGN = 8


def nf4_backend() -> Any:
    """torchao's NF4 module, or the message naming the extra."""
    try:
        with quiet_torchao():
            try:
                from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
            except ImportError:  # torchao before the module moved
                from torchao.dtypes import nf4tensor as nf4_tensor
    except ImportError:
        raise CephaloError(
            "model.adapter = qlora needs torchao's NF4 tensors: pip install 'cephalo[qlora]'"
        ) from None
    return nf4_tensor


def quiet_torchao() -> contextlib.AbstractContextManager[None]:
    """Importing torchao logs a warning per C++ extension built for another torch version
    (and torch's pytree notes on its Enums); the NF4 tensor is pure PyTorch and needs none of
    them: kept out of the output (`cephalo --verbose` shows them once)."""
    return quiet_imports()


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class Nf4Format:
    """Where the pieces of one NF4 weight lie in its bytes."""

    shape: tuple[int, ...]
    block_size: int
    scaler_block_size: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def n_blocks(self) -> int:
        return self.numel // self.block_size

    def _sizes(self) -> list[int]:
        return [self.numel // 2, self.n_blocks, 4 * (self.n_blocks // self.scaler_block_size), 4]

    def offsets(self) -> list[int]:
        out, at = [], 0
        for size in self._sizes():
            out.append(at)
            at += _aligned(size)
        return out

    @property
    def nbytes(self) -> int:
        return sum(_aligned(s) for s in self._sizes())

    def pieces(self, raw: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(codes uint8, scalers int8, factors fp32, mean fp32) as views of `raw` (uint8)."""
        (a, b, c, d), (na, nb, nc, nd) = self.offsets(), self._sizes()
        return (
            raw[a : a + na],
            raw[b : b + nb].view(torch.int8),
            raw[c : c + nc].view(torch.float32),
            raw[d : d + nd].view(torch.float32)[0],
        )


def nf4_format(shape: tuple[int, ...] | torch.Size) -> Nf4Format | None:
    """The format of a weight of this shape, or None if it cannot be quantized."""
    numel = math.prod(shape)
    if len(shape) != 2 or numel % BLOCK_SIZE:
        return None
    n_blocks = numel // BLOCK_SIZE
    sblock = max(d for d in range(1, min(SCALER_BLOCK_SIZE, n_blocks) + 1) if n_blocks % d == 0)
    return Nf4Format(tuple(shape), BLOCK_SIZE, sblock)


def quantize(fmt: Nf4Format, value: torch.Tensor) -> torch.Tensor:
    """The bytes (uint8 [fmt.nbytes]) of torchao's NF4 of `value` (quantized in fp32)."""
    nf4 = nf4_backend()
    t = nf4.NF4Tensor.from_tensor(
        value.detach().float().reshape(fmt.shape).contiguous(),
        fmt.block_size,
        fmt.scaler_block_size,
    )
    raw = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    codes, scalers, factors, mean = fmt.pieces(raw)
    codes.copy_(t.quantized_data)
    scalers.copy_(t.quantized_scalers)
    factors.copy_(t.quantization_factor)
    mean.copy_(t.scaler_mean)
    return raw


def dequantize(fmt: Nf4Format, raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight the bytes stand for, in `dtype` (torchao's `get_original_weight`)."""
    out = torch.empty(fmt.numel, dtype=dtype, device=raw.device)
    return dequantize_into(fmt, raw, out).view(fmt.shape)


DEQUANT_CHUNK = NF4_DEQUANT_CHUNK
"""Elements dequantized at a time, at most (whole scaler blocks; specs/adapter.py)."""
DEQUANT_TRANSIENT_BYTES = NF4_DEQUANT_TRANSIENT_BYTES
"""Bytes per element of a chunk that torchao's `get_original_weight` holds in temporaries
(specs/adapter.py, where the cost model reads it too)."""


def dequant_chunk(fmt: Nf4Format) -> int:
    """Elements per dequantization call: whole scaler blocks, at most about `DEQUANT_CHUNK`."""
    unit = fmt.block_size * fmt.scaler_block_size
    return min(fmt.numel, max(unit, DEQUANT_CHUNK // unit * unit))


def dequantize_into(fmt: Nf4Format, raw: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Dequantize the bytes `raw` into `out` (1-D, `fmt.numel`, any float dtype), a chunk of
    whole scaler blocks at a time through torchao's `NF4Tensor.get_original_weight`, so the
    temporaries stay near `DEQUANT_TRANSIENT_BYTES x dequant_chunk(fmt)`."""
    nf4 = nf4_backend()
    codes, scalers, factors, mean = fmt.pieces(raw)
    lut = torch.tensor(_NF4_VALUES, dtype=torch.float32, device=raw.device)
    step = dequant_chunk(fmt)
    per_factor = fmt.block_size * fmt.scaler_block_size
    for a in range(0, fmt.numel, step):
        b = min(fmt.numel, a + step)
        meta = nf4.SubclassTensorArgs(
            torch.Size([b - a]), (1,), 0, torch.float32, raw.device, False
        )
        part = nf4.NF4Tensor(
            meta,
            fmt.block_size,
            (b - a) // fmt.block_size,
            fmt.scaler_block_size,
            scalers[a // fmt.block_size : b // fmt.block_size],
            factors[a // per_factor : b // per_factor],
            mean,
            codes[a // 2 : b // 2],
            lut,
        )
        out[a:b].copy_(part.get_original_weight())
    return out


def nf4_roundtrip(value: torch.Tensor) -> torch.Tensor:
    """What QLoRA computes with for this weight (fp32): quantized and dequantized once."""
    fmt = nf4_format(value.shape)
    if fmt is None:
        return value.float().clone()
    return dequantize(fmt, quantize(fmt, value), torch.float32)


# torchao's (and QLoRA's) NF4 code book, as `NF4Tensor.from_tensor` writes it
_NF4_VALUES = (
    -1.0000, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0000,
    0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0000,
)  # fmt: skip
