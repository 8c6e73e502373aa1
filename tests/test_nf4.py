"""NF4 bytes (modeling/nf4.py) against torchao's own NF4 tensor, and the frozen base's
layout of plain and NF4 parameters in one float buffer (runtime/state/frozen.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao")

from cephalo.modeling import nf4  # noqa: E402
from cephalo.runtime.state.frozen import FrozenLayout  # noqa: E402


def test_bytes_are_torchaos_and_dequantize_as_torchao():
    w = torch.randn(256, 128, generator=torch.Generator().manual_seed(0))
    fmt = nf4.nf4_format(w.shape)
    assert fmt is not None and (fmt.block_size, fmt.scaler_block_size) == (64, 256)
    raw = nf4.quantize(fmt, w)
    lib = nf4.nf4_backend().to_nf4(w, 64, 256)
    codes, scalers, factors, mean = fmt.pieces(raw)
    assert torch.equal(codes, lib.quantized_data)
    assert torch.equal(scalers, lib.quantized_scalers)
    assert torch.equal(factors, lib.quantization_factor)
    assert torch.equal(mean, lib.scaler_mean)
    assert torch.equal(nf4.dequantize(fmt, raw, torch.float32), lib.get_original_weight())
    # 0.5 B of codes + 1/64 B of scalers per element, and a few bytes more
    assert fmt.nbytes / w.numel() < 0.52


def test_chunked_dequantization_is_bitwise(monkeypatch):
    w = torch.randn(512, 256, generator=torch.Generator().manual_seed(1))
    fmt = nf4.nf4_format(w.shape)
    raw = nf4.quantize(fmt, w)
    whole = nf4.dequantize(fmt, raw, torch.float32)
    monkeypatch.setattr(nf4, "DEQUANT_CHUNK", 64 * 256)  # 8 chunks
    assert nf4.dequant_chunk(fmt) == 64 * 256
    assert torch.equal(nf4.dequantize(fmt, raw, torch.float32), whole)


def test_small_weights():
    """Block counts not a multiple of 256: the largest divisor; sizes not a multiple of 64:
    not quantized."""
    assert nf4.nf4_format((96, 32)).scaler_block_size == 48  # 48 blocks
    assert nf4.nf4_format((10, 10)) is None
    assert nf4.nf4_format((64,)) is None  # vectors stay in the compute dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_layout_packs_plain_and_nf4(dtype):
    g = torch.Generator().manual_seed(2)
    values = {
        "norm.weight": torch.randn(7, generator=g),  # odd size: the NF4 piece after is aligned
        "proj.weight": torch.randn(128, 64, generator=g),
        "bias": torch.randn(3, generator=g),
    }
    named = [(n, torch.empty(v.shape, device="meta")) for n, v in values.items()]
    layout = FrozenLayout("u", named, dtype, frozenset({"u.proj.weight"}))
    flat = layout.pack(values)
    assert flat.dtype == dtype and flat.numel() == layout.numel
    proj = layout.slot("proj.weight")
    assert proj.nf4 is not None and (proj.offset * dtype.itemsize) % 8 == 0
    fmt = proj.nf4
    raw = flat[proj.offset : proj.end].view(torch.uint8)[: fmt.nbytes]
    assert torch.equal(
        nf4.dequantize(fmt, raw, torch.float32), nf4.nf4_roundtrip(values["proj.weight"])
    )
    for name in ("norm.weight", "bias"):
        s = layout.slot(name)
        assert torch.equal(flat[s.offset : s.end], values[name].to(dtype))
