"""Hugging Face model directories in one process: every supported family's units give
transformers' logits, loss and gradients; pretrained weights load from single, sharded,
bf16, base-model and legacy-named checkpoints; random init follows transformers' scheme;
export writes what from_pretrained loads; bad directories and weights get one clear error."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from cephalo.errors import CephaloError
from cephalo.modeling.hf.families import FAMILIES
from cephalo.modeling.registry import build_model, model_directory, model_spec_for
from cephalo.modeling.units import IGNORE_INDEX
from engine_common import one_thread
from hf_configs import SEQ, TINY, VOCAB, quiet_transformers, save_tiny_model

transformers = pytest.importorskip("transformers")
__all__ = ["one_thread"]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def unit_logits(model, input_ids):
    h = model.units[0].module(input_ids)
    for u in model.units[1:-1]:
        h = u.module(h)
    return model.units[-1].module.logits(h)


def batch(b: int = 3):
    """(input_ids, transformers' unshifted labels, our pre-shifted labels)."""
    input_ids = torch.randint(0, VOCAB, (b, SEQ), generator=gen(7))
    hf_labels = input_ids.clone()
    hf_labels[1, 5:9] = IGNORE_INDEX
    ours = torch.full_like(hf_labels, IGNORE_INDEX)
    ours[:, :-1] = hf_labels[:, 1:]
    return input_ids, hf_labels, ours


def load_hf(directory: Path, **changes):
    quiet_transformers()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, **changes
    )


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_units_match_transformers(tmp_path, model_type):
    """Logits, loss and every parameter's gradient equal transformers' own model loaded
    from the same directory; the spec's parameter counts are the transformers model's. (MoE:
    the units' own loss is the cross-entropy; the router loss is the engine's step, checked
    in test_hf_dist.)"""
    directory = save_tiny_model(model_type, tmp_path / model_type, seed=1)
    moe = "router_aux_loss_coef" in TINY[model_type]
    hf = load_hf(directory, **({"output_router_logits": False} if moe else {})).train()
    model = build_model(str(directory)).materialize("cpu", gen(0)).train()
    input_ids, hf_labels, labels = batch()
    out = hf(input_ids=input_ids, labels=hf_labels)
    loss = model(input_ids, labels)
    torch.testing.assert_close(unit_logits(model, input_ids), out.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, out.loss, rtol=1e-5, atol=1e-6)
    loss.backward()
    out.loss.backward()
    hf_params = dict(hf.named_parameters())
    for unit, pname, p in model.named_unit_parameters():
        name = next(n for n in model.hf_names[f"{unit}.{pname}"] if n in hf_params)
        torch.testing.assert_close(p.grad, hf_params[name].grad, rtol=1e-4, atol=1e-6)
    assert model.spec.total_params == sum(p.numel() for p in hf.parameters())
    assert model_spec_for(str(directory)) == model.spec
    assert model.spec.tied_embeddings == (
        hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    )


def test_sliding_window_reaches_the_layers(tmp_path):
    """The tiny configs' windows (5) are shorter than the sequences (16), so the equivalence
    above would fail with the plain causal mask: the window changes transformers' own output."""
    directory = save_tiny_model("mistral", tmp_path / "m", seed=1)
    input_ids, _, _ = batch()
    windowed = load_hf(directory).eval()(input_ids).logits
    config = transformers.AutoConfig.from_pretrained(str(directory))
    config.sliding_window = None
    full = transformers.AutoModelForCausalLM.from_pretrained(str(directory), config=config)
    assert not torch.allclose(full.eval()(input_ids).logits, windowed, atol=1e-3)
    kinds = [u.module.mask_kind for u in build_model(str(directory)).units[1:-1]]
    assert kinds == ["sliding_attention", "sliding_attention"]


@pytest.mark.parametrize("model_type", ["llama", "gemma", "gpt2"])
def test_random_init_is_transformers_scheme_unit_by_unit(tmp_path, model_type):
    """init = random: transformers' own init (Gemma's zero-centred norms, GPT-2's scaled
    residual projections), the same whether drawn for the whole model or a unit at a time as
    the engine does, deterministic in the seed, and never from the global RNG."""
    directory = str(save_tiny_model(model_type, tmp_path / model_type))
    state = torch.get_rng_state()
    whole = build_model(directory, init="random").materialize("cpu", gen(3))
    assert torch.equal(state, torch.get_rng_state())
    meta = build_model(directory, init="random")
    g = gen(3)
    owned: dict[str, list] = {}
    for unit, pname, p in meta.named_unit_parameters():
        owned.setdefault(unit, []).append((pname, p))
    by_unit = {}
    for unit in meta.units:
        values = meta.initial_values(unit.name, owned.get(unit.name, []), g)
        by_unit.update({f"{unit.name}.{k}": v for k, v in values.items()})
    other = build_model(directory, init="random").materialize("cpu", gen(4))
    for (unit, pname, p), (_, _, q) in zip(
        whole.named_unit_parameters(), other.named_unit_parameters(), strict=True
    ):
        assert torch.equal(p, by_unit[f"{unit}.{pname}"]), pname
        if p.dim() == 2:
            assert not torch.equal(p, q), pname
    params = {f"{u}.{n}": p for u, n, p in whole.named_unit_parameters()}
    std = whole.hf_config.initializer_range
    if model_type == "gemma":
        assert torch.equal(params["head.norm.weight"], torch.zeros(32))  # (1 + w) scaling
    if model_type == "gpt2":
        c_proj = params["blocks.0.layer.attn.c_proj.weight"]
        assert c_proj.std().item() == pytest.approx(std / 2**0.5 / 2**0.5, rel=0.15)
    else:
        q = params["blocks.0.layer.self_attn.q_proj.weight"]
        assert q.std().item() == pytest.approx(std, rel=0.15)


def test_pretrained_formats_sharded_bf16_base_model_and_legacy_names(tmp_path):
    """bf16 shards upcast exactly; a checkpoint of the bare base model (no `model.` prefix)
    and GPT-NeoX's legacy `embed_out` name load as transformers loads them."""
    sharded = save_tiny_model(
        "llama", tmp_path / "s", seed=2, dtype=torch.bfloat16, max_shard_size="8KB"
    )
    assert (sharded / "model.safetensors.index.json").is_file()
    model = build_model(str(sharded))
    assert len(model.weights.files()) >= 4
    model.materialize("cpu", gen(0))
    hf = load_hf(sharded)
    hf_params = dict(hf.named_parameters())
    for unit, pname, p in model.named_unit_parameters():
        assert torch.equal(p, hf_params[model.hf_names[f"{unit}.{pname}"][0]]), pname

    base_dir = tmp_path / "base"
    full = load_hf(save_tiny_model("qwen2", tmp_path / "q", seed=2))
    full.model.save_pretrained(str(base_dir))  # keys without the "model." prefix
    (base_dir / "config.json").write_text((tmp_path / "q" / "config.json").read_text())
    loaded = build_model(str(base_dir)).materialize("cpu", gen(0))
    input_ids, _, _ = batch()
    torch.testing.assert_close(
        unit_logits(loaded, input_ids), full.eval()(input_ids).logits, rtol=1e-5, atol=1e-5
    )

    neox = save_tiny_model("gpt_neox", tmp_path / "n", seed=2)
    from safetensors import safe_open

    with safe_open(str(neox / "model.safetensors"), "pt") as f:
        assert "embed_out.weight" in f.keys()  # noqa: SIM118 (not a mapping); the legacy name
    assert build_model(str(neox)).weights.sources["head.lm_head.weight"].key == "embed_out.weight"


def test_export_directory_loads_with_from_pretrained_and_keeps_the_tokenizer(tmp_path):
    from cephalo.modeling.hf.export import save_hf_directory

    source = save_tiny_model("phi3", tmp_path / "src", seed=5)
    (source / "tokenizer.json").write_text('{"version": "1.0"}')
    (source / "special_tokens_map.json").write_text("{}")
    model = build_model(str(source)).materialize("cpu", gen(0))
    with torch.no_grad():
        for _, _, p in model.named_unit_parameters():
            p.add_(0.01)  # "trained": not the source's weights
    copied = save_hf_directory(model, tmp_path / "out")
    assert {"tokenizer.json", "special_tokens_map.json"} <= set(copied)
    exported = load_hf(tmp_path / "out").eval()
    input_ids, _, _ = batch()
    torch.testing.assert_close(
        exported(input_ids).logits, unit_logits(model.eval(), input_ids), rtol=1e-5, atol=1e-5
    )
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "phi3"


def test_cli_trains_a_model_directory_and_exports_it(tmp_path):
    """`cephalo train --model.name DIR` starts from the directory's weights; `cephalo export
    --hf` writes a directory transformers loads with the trained weights' logits."""
    from safetensors.torch import load_file

    from cephalo.cli import main as cli_main

    source = save_tiny_model("qwen2", tmp_path / "qwen", seed=6, vocab_size=256)
    (source / "tokenizer_config.json").write_text("{}")
    run = tmp_path / "run"
    args = [
        "train",
        f"--model.name={source}",
        f"--logging.dir={run}",
        "--logging.progress=false",
        "--data.seq_len=16",
        "--train.steps=2",
        "--train.warmup_steps=1",
        "--train.global_batch_size=4",
        "--train.eval_every=0",
        "--parallel.plan=even",
    ]
    assert cli_main(args) == 0
    out = tmp_path / "hf-out"
    assert (
        cli_main(["export", str(run), "--out", str(tmp_path / "w.safetensors"), "--hf", str(out)])
        == 0
    )
    assert (out / "tokenizer_config.json").is_file()
    state = load_file(str(tmp_path / "w.safetensors"))
    model = build_model(str(source), init="random").materialize("cpu", gen(0))
    with torch.no_grad():
        for unit, name, p in model.named_unit_parameters():
            p.copy_(state[f"{unit}.{name}"])
    input_ids = torch.randint(0, 256, (2, 16), generator=gen(0))
    exported = load_hf(out).eval()
    torch.testing.assert_close(
        exported(input_ids).logits, unit_logits(model.eval(), input_ids), rtol=1e-5, atol=1e-5
    )
    start = load_hf(source)
    assert not torch.equal(exported.model.norm.weight, start.model.norm.weight), "trained"


def test_cached_model_id_resolves_without_downloading(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    snapshot = tmp_path / "models--acme--tiny-qwen" / "snapshots" / ("a" * 40)
    save_tiny_model("qwen2", snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert model_directory("acme/tiny-qwen") == snapshot
    assert build_model("acme/tiny-qwen").spec.arch == "qwen2"
    assert model_directory("acme/not-cached") is None
    with pytest.raises(CephaloError, match="unknown model 'acme/not-cached'"):
        build_model("acme/not-cached")


# ----------------------------------------------------------------------------- bad input
def _rewrite(file: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _bad_weights(kind: str, d: Path) -> None:
    weights = d / "model.safetensors"
    if kind == "missing tensor":
        _rewrite(weights, lambda t: t.pop("model.norm.weight"))
    elif kind == "unexpected tensor":
        _rewrite(weights, lambda t: t.update({"model.extra.weight": torch.ones(2)}))
    elif kind == "wrong shape":
        _rewrite(weights, lambda t: t.update({"model.norm.weight": torch.ones(33)}))
    elif kind == "integer tensor":
        _rewrite(
            weights, lambda t: t.update({"model.norm.weight": torch.ones(32, dtype=torch.int8)})
        )
    elif kind == "damaged header":
        weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    elif kind == "truncated file":
        weights.write_bytes(weights.read_bytes()[:-1000])
    elif kind == "NaN values":
        _rewrite(
            weights,
            lambda t: t["model.layers.0.mlp.up_proj.weight"].__setitem__((0, 0), float("nan")),
        )
    elif kind == "pytorch .bin only":
        weights.rename(d / "pytorch_model.bin")
    elif kind == "missing shard":
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})
        )


BAD_WEIGHTS = {
    "missing tensor": "lack tensor 'model.norm.weight'",
    "unexpected tensor": "'model.extra.weight' \\(in model.safetensors\\) have no place",
    "wrong shape": "tensor 'model.norm.weight' in .*model.safetensors has shape \\[33\\]",
    "integer tensor": "is I8",
    "damaged header": "cannot read .*model.safetensors.*damaged",
    "truncated file": "cannot read .*model.safetensors.*damaged",
    "NaN values": "'model.layers.0.mlp.up_proj.weight' in .*model.safetensors holds NaN",
    "pytorch .bin only": "holds pytorch_model.bin, and cephalo reads safetensors only",
    "missing shard": "model-00002-of-00002.safetensors is missing",
}


@pytest.mark.parametrize("kind", sorted(BAD_WEIGHTS))
def test_bad_weights_get_one_clear_error(tmp_path, kind):
    d = save_tiny_model("llama", tmp_path / "m")
    _bad_weights(kind, d)
    with pytest.raises(CephaloError, match=BAD_WEIGHTS[kind]):
        model = build_model(str(d))
        model.materialize("cpu", gen(0))  # NaN is seen when the values are read
    assert build_model(str(d), init="random").spec.num_layers == 2  # the config is fine


def test_bad_directories_and_architectures(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CephaloError, match="has no config.json"):
        build_model(str(empty))
    with pytest.raises(CephaloError, match="has no config.json"):
        model_spec_for(str(empty))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{model_type: llama")
    with pytest.raises(CephaloError, match="not valid JSON"):
        build_model(str(tmp_path / "broken"))
    cases = {
        "t5": (
            transformers.T5Config(num_layers=1, d_model=8, d_ff=8, num_heads=1),
            "an encoder-decoder model",
        ),
        "llava": (transformers.LlavaConfig(), "a multimodal model"),
        "bert": (
            transformers.BertConfig(
                num_hidden_layers=1, hidden_size=8, num_attention_heads=1, intermediate_size=8
            ),
            "does not know",
        ),
    }
    for name, (config, what) in cases.items():
        config.save_pretrained(str(tmp_path / name))
        with pytest.raises(CephaloError, match=f"{what}.*Llama \\(llama\\).*GPT-2 \\(gpt2\\)"):
            build_model(str(tmp_path / name))
    (tmp_path / "alien").mkdir()
    (tmp_path / "alien" / "config.json").write_text('{"model_type": "alien-lm"}')
    with pytest.raises(CephaloError, match="model type 'alien-lm'.*does not know"):
        build_model(str(tmp_path / "alien"))


def test_init_choices(tmp_path):
    with pytest.raises(CephaloError, match="without pretrained weights"):
        build_model("hf-llama-tiny", init="pretrained")
    with pytest.raises(CephaloError, match="without pretrained weights"):
        build_model("gpt-tiny", init="pretrained")
    with pytest.raises(CephaloError, match="model.init must be one of"):
        build_model("gpt-tiny", init="pretraind")
    no_weights = tmp_path / "cfg"
    transformers.AutoConfig.for_model(
        "llama", num_hidden_layers=1, hidden_size=16, intermediate_size=16, num_attention_heads=2
    ).save_pretrained(str(no_weights))
    assert build_model(str(no_weights)).weights is None  # auto: random
    with pytest.raises(CephaloError, match="has no model.safetensors"):
        build_model(str(no_weights), init="pretrained")
    with pytest.raises(CephaloError, match="unknown setting 'n_layers'"):
        build_model(str(no_weights), n_layers=2)
    assert build_model(str(no_weights), num_hidden_layers=3, dropout=0.1).spec.num_layers == 3


def test_a_size_of_zero_is_one_error():
    """transformers builds empty modules for hidden_size = 0 (torch accepts 0-element
    parameters); the adapter refuses them by name instead of training a 0-parameter model."""
    with pytest.raises(CephaloError, match="without parameters"):
        build_model("hf-llama-tiny", hidden_size=0)


def test_moe_bad_inputs(tmp_path, monkeypatch):
    """A quantized checkpoint, experts without a top-k, the router loss asked for without its
    coefficient: one clear error each; output_router_logits off: said once, no aux term."""
    from cephalo.modeling.hf import model as hf_module

    quantized = save_tiny_model("gpt_oss", tmp_path / "q", seed=1)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(CephaloError, match="quantized checkpoint.*'mxfp4'.*bf16"):
        build_model(str(quantized))

    directory = save_tiny_model("qwen3_moe", tmp_path / "m", seed=1)
    config = json.loads((directory / "config.json").read_text())
    with pytest.raises(CephaloError, match="num_experts_per_tok"):
        build_model(str(directory), num_experts_per_tok=0)
    with pytest.raises(CephaloError, match="router_aux_loss_coef"):
        build_model(str(directory), router_aux_loss_coef=None)

    config["output_router_logits"] = False
    (directory / "config.json").write_text(json.dumps(config))
    said = []
    monkeypatch.setattr(hf_module, "log_without_aux", lambda *a: said.append(a))
    hf_module._SAID_NO_AUX.discard(str(directory))
    model = build_model(str(directory))
    build_model(str(directory))
    assert model.router_aux is None
    assert len(said) == 1, said


def test_moe_standard_mode_refuses_the_router_loss(tmp_path):
    from cephalo.runtime.collectives.comm import make_comm
    from cephalo.runtime.engine.engine import Engine, EngineConfig
    from engine_common import make_plan

    directory = str(save_tiny_model("olmoe", tmp_path / "o", seed=1))
    plan = make_plan([2], [1.0], [1], seq_len=SEQ, model=directory)
    engine = Engine(build_model(directory), plan, make_comm("local"), EngineConfig(mode="standard"))
    x = torch.randint(0, VOCAB, (2, SEQ), generator=gen(1))
    with pytest.raises(CephaloError, match="lga"):
        engine.train_step(x, x, lr=1e-3)


def test_gemma3_multimodal_trains_the_language_model_and_carries_the_vision_tower(tmp_path):
    """A Gemma3ForConditionalGeneration directory (bf16): its language model is the units
    (transformers' multimodal model's text logits, 0 difference); the export loads with
    AutoModelForImageTextToText, the vision tower and projector bit-identical, the language
    model the trained weights."""
    from cephalo.modeling.hf.export import save_hf_directory
    from hf_configs import save_tiny_gemma3_multimodal

    source = save_tiny_gemma3_multimodal(tmp_path / "mm", seed=2)
    (source / "tokenizer.json").write_text('{"version": "1.0"}')
    model = build_model(str(source)).materialize("cpu", gen(0)).eval()
    assert model.multimodal is not None and model.hf_config.model_type == "gemma3_text"
    hf = transformers.AutoModelForImageTextToText.from_pretrained(str(source), dtype=torch.float32)
    input_ids, _, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(
            unit_logits(model, input_ids), hf.eval()(input_ids=input_ids).logits, rtol=0, atol=0
        )
        for _, _, p in model.named_unit_parameters():
            p.add_(0.01)  # "trained"
    assert "tokenizer.json" in save_hf_directory(model, tmp_path / "out")
    out = transformers.AutoModelForImageTextToText.from_pretrained(
        str(tmp_path / "out"), dtype=torch.float32
    ).eval()
    before, after = dict(hf.named_parameters()), dict(out.named_parameters())
    assert set(before) == set(after)
    carried = [k for k in before if not k.startswith(("model.language_model.", "lm_head."))]
    assert any("vision_tower" in k for k in carried) and any("projector" in k for k in carried)
    for k in carried:
        assert torch.equal(before[k], after[k]), k
    for k in set(before) - set(carried):
        assert not torch.equal(before[k], after[k]), k
    with torch.no_grad():
        torch.testing.assert_close(
            out(input_ids=input_ids).logits, unit_logits(model, input_ids), rtol=1e-6, atol=1e-6
        )


def test_cli_trains_an_moe_directory_logs_the_router_loss_and_exports_it(tmp_path):
    """`cephalo train` on a Qwen3-MoE directory (per-expert checkpoint tensors, router loss
    on): metrics.jsonl holds `aux_loss` beside `loss`; `cephalo export --hf` loads in
    transformers with the trained weights' logits."""
    from safetensors.torch import load_file

    from cephalo.cli import main as cli_main

    source = save_tiny_model("qwen3_moe", tmp_path / "moe", seed=6, vocab_size=256)
    run = tmp_path / "run"
    args = [
        "train",
        f"--model.name={source}",
        f"--logging.dir={run}",
        "--logging.progress=false",
        "--data.seq_len=16",
        "--train.steps=2",
        "--train.warmup_steps=1",
        "--train.global_batch_size=4",
        "--train.eval_every=0",
        "--parallel.plan=even",
    ]
    assert cli_main(args) == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r.get("kind") == "step"]
    assert steps and all(r["aux_loss"] > 0 for r in steps)
    out = tmp_path / "hf-out"
    assert (
        cli_main(["export", str(run), "--out", str(tmp_path / "w.safetensors"), "--hf", str(out)])
        == 0
    )
    state = load_file(str(tmp_path / "w.safetensors"))
    model = build_model(str(source), init="random").materialize("cpu", gen(0))
    with torch.no_grad():
        for unit, name, p in model.named_unit_parameters():
            p.copy_(state[f"{unit}.{name}"])
    input_ids = torch.randint(0, 256, (2, 16), generator=gen(0))
    exported = load_hf(out).eval()
    torch.testing.assert_close(
        exported(input_ids).logits, unit_logits(model.eval(), input_ids), rtol=1e-5, atol=1e-5
    )


def test_moe_router_loss_one_rank_micro_batches(tmp_path):
    """One rank, 5 samples in micro-batches of 2: the router loss of the whole batch (not of
    each micro-batch), as transformers + AdamW: losses, aux losses and parameters (the fast
    counterpart of test_hf_dist's 3-rank check)."""
    from cephalo.runtime.collectives.comm import make_comm
    from cephalo.runtime.engine.engine import Engine, EngineConfig
    from cephalo.runtime.state.adamw import AdamWHyper
    from engine_common import LR, TEST_EPS, make_data, make_plan, measure_floor, optim_config
    from reference import train_transformers

    directory = str(save_tiny_model("qwen3_moe", tmp_path / "m", seed=3))
    plan = make_plan([5], [1.0], [2], seq_len=SEQ, model=directory)
    data = make_data(3, 5, seq_len=SEQ, vocab=VOCAB)
    cfg = EngineConfig(grad_clip=0.0, adamw=AdamWHyper(eps=TEST_EPS, weight_decay=0.1))
    # the router's aux loss is of the whole batch: the fp32 variants: the batch as it is and reversed
    train = functools.partial(train_transformers, directory, data, optim_config(cfg))
    floor = measure_floor(train, 5)
    model = build_model(directory)
    engine = Engine(model, plan, make_comm("local"), cfg)
    stats = [engine.train_step(x, y, lr=LR) for x, y in data]
    from cephalo.modeling.hf.export import export_hf_state_dict

    ours = export_hf_state_dict(model, engine.full_state_dict())
    floor.check(
        "qwen3_moe one rank",
        params={k: ours[k] for k in floor.truth.params},
        losses=[s.loss for s in stats],
        aux=[s.aux_loss for s in stats],
    )
