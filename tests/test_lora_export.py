"""A LoRA / QLoRA job end to end in one process (`cephalo train`'s `train`): checkpoints hold
only the adapters and their optimizer state; `export --peft` gives a directory
`PeftModel.from_pretrained` loads and `export --hf` the merged model, both with the trained
run's logits (fp32, 1e-5); a LoRA checkpoint does not resume a full fine-tune, nor the
reverse, and `export --peft` of a full fine-tune says why not."""

from __future__ import annotations

import pytest
import torch

from cephalo.errors import CephaloError
from cephalo.modeling.lora import apply_adapter
from cephalo.modeling.registry import build_model
from cephalo.planner.makers import simple_plan
from cephalo.runtime.collectives.comm import LocalComm
from cephalo.runtime.engine.engine import Engine, EngineConfig
from cephalo.specs.cluster import Cluster
from cephalo.train.checkpoint import latest_checkpoint, load_checkpoint, verify_checkpoint
from cephalo.train.config_manager import load_config
from cephalo.train.export import export_checkpoint
from cephalo.train.trainer import train
from data_helpers import EOS, save_tokenizer
from engine_common import one_thread
from hf_configs import SEQ, quiet_transformers, save_tiny_model
from run_common import tiny_job_args

pytest.importorskip("peft")
__all__ = ["one_thread"]
STEPS = 4
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"


def _job(run_dir, directory, *extra: str) -> list[str]:
    return tiny_job_args(
        run_dir,
        f"--model.name={directory}",
        "--model.overrides={}",
        f"--data.seq_len={SEQ}",
        f"--train.steps={STEPS}",
        "--train.warmup_steps=1",
        "--checkpoint.every=2",
        *extra,
    )


def _run_logits(directory, run_dir, adapter: str, probe: torch.Tensor) -> torch.Tensor:
    """The trained run's logits: cephalo's units (peft's layers) holding the checkpoint's
    adapters on the base the run trained on (the engine's frozen base, NF4 dequantized)."""
    from cephalo.modeling.lora import adapter_settings

    cfg = load_config(
        None, _job(run_dir, directory, f"--model.adapter={adapter}", "--model.lora_r=4")
    )
    model = build_model(str(directory))
    apply_adapter(model, adapter_settings(cfg.model))
    plan = simple_plan("even", Cluster.parse("cpu"), str(directory), SEQ, 1, "fp32")
    engine = Engine(model, plan, LocalComm(), EngineConfig(compute_dtype="fp32"))
    load_checkpoint(latest_checkpoint(run_dir / "checkpoints"), engine.sharded_state())
    names = [u.name for u in model.units]
    state = {**engine.full_state_dict(), **engine.frozen.full_state_dict(names.__getitem__)}
    units = build_model(str(directory))
    apply_adapter(units, adapter_settings(cfg.model))
    units.materialize("cpu", torch.Generator())
    with torch.no_grad():
        for unit, name, p in units.named_unit_parameters():
            p.copy_(state[f"{unit}.{name}"])
    units.eval()
    with torch.no_grad():
        h = units.units[0].module(probe)
        for u in units.units[1:-1]:
            h = u.module(h)
        return units.units[-1].module.logits(h)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["lora", "qlora"])
def test_export_roundtrip(tmp_path, adapter):
    """Train 4 steps (checkpoints of adapters only), export --peft and --hf: peft's loaded
    adapter on the base and the merged model give the run's logits to 1e-5."""
    import peft
    import transformers

    if adapter == "qlora":
        pytest.importorskip("torchao")
    quiet_transformers()
    directory = save_tiny_model(
        "llama", tmp_path / "base", seed=2, vocab_size=256, hidden_size=64, intermediate_size=128
    )
    run_dir = tmp_path / "run"
    train(
        load_config(
            None, _job(run_dir, directory, f"--model.adapter={adapter}", "--model.lora_r=4")
        )
    )
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    saved = list(verify_checkpoint(checkpoint)["tensors"])
    assert saved and all(".lora_A." in n or ".lora_B." in n for n in saved), saved[:4]

    # the tokenizer and chat template the run used (data.tokenizer = auto: the model
    # directory's; it trained with bytes, the files arrive now) go with the adapters
    save_tokenizer(directory, model_vocab=None)
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    r = export_checkpoint(run_dir, hf_dir=tmp_path / "merged", peft_dir=tmp_path / "adapter")
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(r.peft_copied)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "adapter"))
    assert tok.chat_template == TEMPLATE and tok.eos_token == EOS
    probe = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(9))
    ours = _run_logits(directory, run_dir, adapter, probe)

    base = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    if adapter == "qlora":  # the adapters were trained on the NF4 base: load them onto it
        from cephalo.modeling.nf4 import nf4_roundtrip

        with torch.no_grad():
            for m in base.modules():
                if isinstance(m, torch.nn.Linear) and m is not base.get_output_embeddings():
                    m.weight.copy_(nf4_roundtrip(m.weight))
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        via_peft = loaded(input_ids=probe).logits
        via_merged = merged(input_ids=probe).logits
    e1, e2 = _rel(via_peft, ours), _rel(via_merged, ours)
    print(f"{adapter}: logits vs the run's: peft-loaded {e1:.2e}, merged {e2:.2e}")
    assert e1 <= 1e-5 and e2 <= 1e-5
    assert any(v.abs().max() > 0 for k, v in loaded.state_dict().items() if "lora_B" in k), (
        "training moved B"
    )


@pytest.mark.slow
def test_resume_mismatch_and_export_of_full_run(tmp_path):
    """A LoRA checkpoint into a full fine-tune and the reverse: one message each; export
    --peft of a full fine-tune: one message."""
    quiet_transformers()
    directory = save_tiny_model("llama", tmp_path / "base", seed=2, vocab_size=256)
    lora_run, full_run = tmp_path / "lora", tmp_path / "full"
    train(load_config(None, _job(lora_run, directory, "--model.adapter=lora", "--model.lora_r=4")))
    train(load_config(None, _job(full_run, directory)))
    more = f"--train.steps={STEPS + 2}"
    with pytest.raises(CephaloError, match="holds LoRA adapters .* this run is a full fine-tune"):
        train(load_config(None, _job(lora_run, directory, more)))
    with pytest.raises(CephaloError, match="is a full fine-tune and this run trains LoRA"):
        train(load_config(None, _job(full_run, directory, more, "--model.adapter=lora")))
    with pytest.raises(CephaloError, match="was it written for another model.lora_r"):
        train(
            load_config(
                None, _job(lora_run, directory, more, "--model.adapter=lora", "--model.lora_r=8")
            )
        )
    with pytest.raises(CephaloError, match="is a full fine-tune .* it has no adapters"):
        export_checkpoint(full_run, peft_dir=tmp_path / "adapter")


def test_export_tokenizer_follows_the_runs_tokenizer_and_template(tmp_path):
    """Issue 41, point 10: next to exported adapters, the tokenizer the run trained with
    (the model directory's for `auto`, else the named directory; none for bytes) and the
    run's own `data.chat_template` over the tokenizer's, as `AutoTokenizer` loads them."""
    import transformers

    from cephalo.train.export import export_tokenizer

    model_dir = save_tokenizer(tmp_path / "model", model_vocab=None)
    (model_dir / "chat_template.jinja").write_text("{{ 'theirs' }}")
    auto = export_tokenizer(tmp_path / "a", {"data": {"tokenizer": "auto"}}, model_dir)
    assert {"tokenizer.json", "chat_template.jinja"} <= set(auto)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "a").chat_template == (
        "{{ 'theirs' }}"
    )
    ours = {"data": {"tokenizer": str(model_dir), "chat_template": TEMPLATE}}
    assert "chat_template.jinja" in export_tokenizer(tmp_path / "b", ours, None)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "b")
    assert tok.chat_template == TEMPLATE and tok.eos_token == EOS
    assert export_tokenizer(tmp_path / "c", {"data": {"tokenizer": "byte"}}, model_dir) == []
