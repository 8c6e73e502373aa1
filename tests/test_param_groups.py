"""The weight-decay rule (runtime/state/param_groups.py), pinned by parameter name.

The engine and every reference trainer (tests/reference.py) take the rule from the same
function, so the equivalence tests cannot see a wrong rule: both would apply it. Here the
rule's choice is written out by name for our GPT and for a Hugging Face GPT-2, and checked
on every runnable test model against a rule of another form (GPT-2 / nanoGPT / minGPT
practice, by module type): the weights of linear layers (transformers' `Conv1D` included)
and embeddings decay; biases and normalisation gains do not.
"""

from __future__ import annotations

import pytest
from torch import nn

from cephalo.modeling.registry import build_model
from cephalo.runtime.state.param_groups import adamw_param_groups, wants_weight_decay

_BLOCK_MATRICES = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
_GPT_VECTORS = ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias") + tuple(
    f"{m}.bias" for m in _BLOCK_MATRICES
)


def _decays(model_name: str) -> dict[str, bool]:
    model = build_model(model_name)  # meta device: names and shapes only
    return {
        f"{u}.{n}": wants_weight_decay(f"{u}.{n}", p) for u, n, p in model.named_unit_parameters()
    }


def _split(decays: dict[str, bool]) -> tuple[set[str], set[str]]:
    return {n for n, d in decays.items() if d}, {n for n, d in decays.items() if not d}


def test_gpt_decays_matrices_and_embeddings_by_name():
    decayed, kept = _split(_decays("gpt-tiny"))
    blocks = [f"blocks.{i}" for i in range(2)]
    assert decayed == {"embedding.wte.weight", "embedding.wpe.weight"} | {
        f"{b}.{m}.weight" for b in blocks for m in _BLOCK_MATRICES
    }
    # the output projection is tied to wte (reported once, under the embedding)
    assert kept == {f"{b}.{v}" for b in blocks for v in _GPT_VECTORS} | {
        "head.ln_f.weight",
        "head.ln_f.bias",
    }


def test_hf_gpt2_decays_matrices_and_embeddings_by_name():
    pytest.importorskip("transformers")
    decayed, kept = _split(_decays("hf-gpt2-tiny"))
    blocks = [f"blocks.{i}.layer" for i in range(2)]
    # transformers' GPT-2 stores its projections as Conv1D ([in, out] weights): still matrices
    assert decayed == {"embedding.wte.weight", "embedding.wpe.weight"} | {
        f"{b}.{m}.weight" for b in blocks for m in _BLOCK_MATRICES
    }
    assert kept == {f"{b}.{v}" for b in blocks for v in _GPT_VECTORS} | {
        "head.norm.weight",
        "head.norm.bias",
    }


def _by_module_type(model_name: str) -> dict[str, bool]:
    """Decay iff the parameter is the `weight` of a linear layer or an embedding."""
    from transformers.pytorch_utils import Conv1D

    model = build_model(model_name)
    expected: dict[str, bool] = {}
    for unit in model.units:
        for module_name, module in unit.module.named_modules():
            for pname, _ in module.named_parameters(recurse=False):
                name = (
                    f"{unit.name}.{module_name}.{pname}" if module_name else f"{unit.name}.{pname}"
                )
                matrix = isinstance(module, nn.Linear | nn.Embedding | Conv1D)
                expected.setdefault(name, matrix and pname == "weight")
    return expected


@pytest.mark.parametrize("model_name", ["gpt-tiny", "hf-gpt2-tiny", "hf-llama-tiny"])
def test_rule_agrees_with_the_module_types(model_name):
    pytest.importorskip("transformers")
    decays, expected = _decays(model_name), _by_module_type(model_name)
    assert set(decays) <= set(expected)  # tied parameters: once, under the first unit
    assert decays == {n: expected[n] for n in decays}
    assert any(decays.values()) and not all(decays.values())


def test_param_groups_carry_the_rule():
    model = build_model("gpt-tiny")
    named = [(f"{u}.{n}", p) for u, n, p in model.named_unit_parameters()]
    groups = adamw_param_groups(named, 0.1)
    decayed, kept = _split(_decays("gpt-tiny"))
    by_id = {id(p): n for n, p in named}
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert {by_id[id(p)] for p in groups[0]["params"]} == decayed
    assert {by_id[id(p)] for p in groups[1]["params"]} == kept
    # no decayed parameter: no empty group
    vectors = [(n, p) for n, p in named if n in kept]
    assert [g["weight_decay"] for g in adamw_param_groups(vectors, 0.1)] == [0.0]
