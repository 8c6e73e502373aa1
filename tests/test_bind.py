"""runtime/bind.py: a unit's module called on given tensors, as torch.func.functional_call."""

import pytest
import torch
from torch import nn
from torch.func import functional_call

from cephalo.errors import CephaloError
from cephalo.runtime.bind import UnitBinding


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.mid = nn.Sequential(nn.LayerNorm(6), nn.GELU())
        self.out = nn.Linear(6, 4, bias=False)
        self.back = nn.Linear(6, 4, bias=False)
        self.back.weight = self.out.weight  # tied inside the module
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        h = self.mid(self.inp(x))
        return (self.out(h) + self.back(h)) * self.scale


def _given(module: nn.Module, seed: int, skip: tuple[str, ...] = ()):
    gen = torch.Generator().manual_seed(seed)
    return {
        n: torch.randn(p.shape, generator=gen).requires_grad_()
        for n, p in module.named_parameters()
        if n not in skip
    }


@pytest.mark.parametrize("skip", [(), ("inp.bias",)])
def test_binding_equals_functional_call_and_restores_the_module(skip):
    module = _Tied()
    before = {n: p for n, p in module.named_parameters()}
    x = torch.randn(3, 4)
    ours, theirs = _given(module, 1, skip), _given(module, 1, skip)
    y_ours = UnitBinding(module)(ours, (x,))
    y_theirs = functional_call(module, theirs, (x,), strict=False)
    assert torch.equal(y_ours, y_theirs)
    y_ours.square().sum().backward()
    y_theirs.square().sum().backward()
    for name in ours:
        assert torch.equal(ours[name].grad, theirs[name].grad), name
    # the module's own parameters are back, tied as before
    assert all(p is before[n] for n, p in module.named_parameters())
    assert module.back.weight is module.out.weight


def test_a_tied_parameter_takes_the_tensor_given_under_its_other_name():
    module = _Tied()
    x = torch.randn(2, 4)
    given = _given(module, 2)
    given["back.weight"] = given.pop("out.weight")  # named_parameters lists it once
    assert torch.equal(
        UnitBinding(module)(given, (x,)), functional_call(module, given, (x,), strict=False)
    )


def test_an_unknown_name_is_an_error_and_the_module_is_left_as_it_was():
    module = _Tied()
    weight = module.inp.weight
    given = {"inp.weight": torch.zeros(6, 4), "nope": torch.zeros(1)}
    with pytest.raises(CephaloError, match="no parameter 'nope'"):
        UnitBinding(module)(given, (torch.randn(1, 4),))
    assert module.inp.weight is weight


def test_block_type_tells_apart_what_changes_a_blocks_code():
    """runtime/capture/blocks.py: the blocks of one model share a block type (one compiled
    callable), a layer number does not split them (`layer_idx`: a KV-cache slot), and what
    changes the code a block runs does: a plain attribute its forward may branch on, another
    shape, another dropout probability."""
    from cephalo.modeling.registry import build_model
    from cephalo.runtime.capture.blocks import block_type

    blocks = [u.module for u in build_model("gpt-tiny").units if u.kind == "block"]
    for i, b in enumerate(blocks):
        b.attn.layer_idx = i
    assert block_type(blocks[0]) == block_type(blocks[1])
    blocks[1].attn.attention_type = "sliding_attention"
    assert block_type(blocks[0]) != block_type(blocks[1])
    nano = next(u.module for u in build_model("gpt-nano").units if u.kind == "block")
    dropped = next(
        u.module for u in build_model("gpt-tiny", dropout=0.1).units if u.kind == "block"
    )
    assert block_type(blocks[0]) != block_type(nano)
    assert block_type(blocks[0]) != block_type(dropped)
