"""Bad LoRA / QLoRA input: one clear message each (no traceback from peft or torchao)."""

from __future__ import annotations

import sys

import pytest
import torch

from cephalo.errors import CephaloError
from cephalo.modeling.lora import AdapterSettings, apply_adapter
from cephalo.modeling.registry import build_model
from cephalo.train.config_manager import load_config
from hf_configs import quiet_transformers, save_tiny_model

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    quiet_transformers()
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama") / "m", seed=1)


def _peft_adapter(directory, out, **lora):
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    peft.get_peft_model(base, peft.LoraConfig(**lora)).save_pretrained(str(out))
    return out


def test_lora_r_must_be_positive(tmp_path):
    with pytest.raises(CephaloError, match=r"model.lora_r must be >= 1, got 0"):
        load_config(None, ["--model.adapter=lora", "--model.lora_r=0"])
    with pytest.raises(CephaloError, match=r"model.lora_r must be an integer >= 1, got -2"):
        AdapterSettings("lora", r=-2).validate()


def test_targets_matching_nothing_list_the_linear_layers(llama_dir):
    model = build_model(str(llama_dir))
    with pytest.raises(CephaloError) as e:
        apply_adapter(model, AdapterSettings("lora", target_modules=["qkv", "fc1"]))
    message = str(e.value)
    assert "matches no linear layer" in message
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert name in message
    assert "lm_head" in message  # a Linear name, though all-linear leaves it out


def test_adapter_path_for_another_base(llama_dir, tmp_path):
    """Shapes differ (another width) or targets differ (another family): one message each."""
    wider = save_tiny_model("llama", tmp_path / "wide", seed=1, hidden_size=64)
    other_shape = _peft_adapter(wider, tmp_path / "a1", r=4, target_modules=["q_proj"])
    with pytest.raises(
        CephaloError, match=r"was made for another base: .*q_proj.lora_A.weight is \(4, 64\)"
    ):
        apply_adapter(
            build_model(str(llama_dir)), AdapterSettings("lora", adapter_path=str(other_shape))
        )
    neox = save_tiny_model("gpt_neox", tmp_path / "neox", seed=1)
    other_targets = _peft_adapter(neox, tmp_path / "a2", r=4, target_modules=["query_key_value"])
    with pytest.raises(
        CephaloError, match=r"was made for another base: its target modules \['query_key_value'\]"
    ):
        apply_adapter(
            build_model(str(llama_dir)), AdapterSettings("lora", adapter_path=str(other_targets))
        )
    with pytest.raises(CephaloError, match="no adapter_config.json"):
        apply_adapter(
            build_model(str(llama_dir)), AdapterSettings("lora", adapter_path=str(tmp_path))
        )


def test_qlora_without_the_extra(llama_dir, monkeypatch):
    """torchao missing: the message names the extra to install."""
    for name in [n for n in sys.modules if n == "torchao" or n.startswith("torchao.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.quantization.quantize_.workflows.nf4", None)
    with pytest.raises(CephaloError, match=r"pip install 'cephalo\[qlora\]'"):
        apply_adapter(build_model(str(llama_dir)), AdapterSettings("qlora"))


def test_adapter_needs_a_transformers_model():
    with pytest.raises(CephaloError, match="needs a transformers model"):
        apply_adapter(build_model("gpt-tiny"), AdapterSettings("lora"))


# ----------------------------------------------------------------- issue 41: honest start
def test_a_directory_without_weights_is_said_and_refused_under_adapters(
    llama_dir, tmp_path, capsys
):
    """Point 2: config.json alone trains from random values: a warning under `init = auto`,
    refused with adapters (a random frozen base learns nothing), unless `init = random`
    says it is meant; `cephalo run` refuses it before starting any rank."""
    from cephalo.cli import main
    from cephalo.modeling.registry import initial_weights_note

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((llama_dir / "config.json").read_text())
    note = initial_weights_note(str(bare), "auto")
    assert "no weights" in note and "RANDOM" in note and 'model.init = "random"' in note
    assert initial_weights_note(str(bare), "random") is None
    assert initial_weights_note(str(bare), "random", "lora") is None
    assert initial_weights_note(str(llama_dir), "auto", "qlora") is None  # it has weights
    assert initial_weights_note("gpt-tiny", "auto", "none") is None  # a preset: random by design
    with pytest.raises(
        CephaloError, match=r'adapters on a frozen base of random values.*init = "random"'
    ):
        initial_weights_note(str(bare), "auto", "lora")
    rc = main(["run", f"--model.name={bare}", "--model.adapter=lora", f"--logging.dir={tmp_path}"])
    assert rc == 2 and "frozen base of random values" in capsys.readouterr().err


def test_the_adapter_line_counts_what_peft_counts(llama_dir):
    """Point 2: a LoRA run logs rank, alpha, targets and its trainable parameters; the counts
    are peft's own (`get_nb_trainable_parameters` on the same transformers model)."""
    import peft
    import transformers

    model = build_model(str(llama_dir))
    adapter = apply_adapter(model, AdapterSettings("lora", r=4, alpha=8))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(llama_dir))
    reference = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    )
    trainable, total = reference.get_nb_trainable_parameters()
    line = adapter.summary(model)
    assert line.startswith("lora r=4, alpha=8 (scale 2), targets all-linear")
    assert f"{trainable:,} trainable parameters" in line
    assert f"({100 * trainable / total:.2f}% of {total:,})" in line
