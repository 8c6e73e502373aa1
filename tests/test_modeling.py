"""Runnable models as units: forward/gradient equivalence, tied weights, deterministic init,
dropout replay. Single process, fp32, fast."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from cephalo.errors import CephaloError
from cephalo.modeling import IGNORE_INDEX, build_model, list_runnable_models, model_spec_of
from cephalo.modeling.gpt import GPT_PRESETS


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tiny_gpt(seed: int = 0, **overrides):
    return build_model("gpt-tiny", **overrides).materialize("cpu", gen(seed))


def batch(vocab: int, b: int = 3, s: int = 16, seed: int = 1):
    g = gen(seed)
    tokens = torch.randint(0, vocab, (b, s + 1), generator=g)
    input_ids, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    labels[0, :3] = IGNORE_INDEX  # some ignored targets
    return input_ids, labels


def manual_gpt_loss(model, input_ids, labels):
    """A straightforward GPT-2 forward written against the raw parameters (explicit masked
    softmax attention), independent of the unit modules."""
    cfg = model.config
    p = {f"{u}.{n}": t for u, n, t in model.named_unit_parameters()}
    b, s = input_ids.shape
    d, nh = cfg.n_embd, cfg.n_head
    h = p["embedding.wte.weight"][input_ids] + p["embedding.wpe.weight"][:s]
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(cfg.n_layer):
        w = lambda name, i=i: p[f"blocks.{i}.{name}"]  # noqa: E731
        x = F.layer_norm(h, (d,), w("ln_1.weight"), w("ln_1.bias"))
        qkv = x @ w("attn.c_attn.weight").T + w("attn.c_attn.bias")
        q, k, v = (t.reshape(b, s, nh, d // nh).transpose(1, 2) for t in qkv.split(d, dim=2))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // nh)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, d)
        h = h + y @ w("attn.c_proj.weight").T + w("attn.c_proj.bias")
        x = F.layer_norm(h, (d,), w("ln_2.weight"), w("ln_2.bias"))
        x = F.gelu(x @ w("mlp.c_fc.weight").T + w("mlp.c_fc.bias"))
        h = h + x @ w("mlp.c_proj.weight").T + w("mlp.c_proj.bias")
    h = F.layer_norm(h, (d,), p["head.ln_f.weight"], p["head.ln_f.bias"])
    logits = h @ p["embedding.wte.weight"].T
    return F.cross_entropy(
        logits.reshape(-1, cfg.vocab_size), labels.reshape(-1), ignore_index=IGNORE_INDEX
    )


# ---------------------------------------------------------------- built-in GPT


def test_gpt_units_equal_manual_forward_and_gradients():
    model = tiny_gpt().eval()
    input_ids, labels = batch(model.config.vocab_size)
    loss = model(input_ids, labels)
    ref = manual_gpt_loss(model, input_ids, labels)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    params = [p for _, _, p in model.named_unit_parameters()]
    grads = torch.autograd.grad(loss, params)
    ref_grads = torch.autograd.grad(ref, params)
    for g, rg in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg, rtol=1e-4, atol=1e-6)


def test_gpt_head_returns_fp32_sum_over_labelled_tokens():
    model = tiny_gpt().eval()
    input_ids, labels = batch(model.config.vocab_size)
    units = model.units
    h = units[0].module(input_ids)
    for u in units[1:-1]:
        h = u.module(h)
    loss_sum = units[-1].module(h, labels)
    assert loss_sum.dtype == torch.float32 and loss_sum.dim() == 0
    n_tokens = (labels != IGNORE_INDEX).sum()
    torch.testing.assert_close(loss_sum / n_tokens, model(input_ids, labels))
    all_ignored = torch.full_like(labels, IGNORE_INDEX)
    assert units[-1].module(h, all_ignored).item() == 0.0


def test_gpt_unit_names_and_kinds():
    model = build_model("gpt-tiny")
    assert [u.name for u in model.units] == ["embedding", "blocks.0", "blocks.1", "head"]
    assert [u.kind for u in model.units] == ["embedding", "block", "block", "head"]
    assert all(p.device.type == "meta" for p in model.parameters())


def test_gpt_tied_weight_is_one_parameter_after_materialize():
    model = tiny_gpt()
    wte = model.units[0].module.wte.weight
    assert model.units[-1].module.lm_head.weight is wte
    names = [(u, n) for u, n, _ in model.named_unit_parameters()]
    assert ("embedding", "wte.weight") in names
    assert not any(u == "head" and n == "lm_head.weight" for u, n in names)
    assert len({id(p) for _, _, p in model.named_unit_parameters()}) == len(names)
    # the spec counts it once, in the embedding
    spec = model_spec_of(model)
    assert spec.total_params == sum(p.numel() for p in model.parameters())
    owned = {u.name: 0 for u in model.units}
    for unit_name, _, p in model.named_unit_parameters():
        owned[unit_name] += p.numel()
    assert spec.unit_params() == [owned[u.name] for u in model.units]
    # by hand: wte 256x64 + wpe 32x64; block = 2 LN (2x128) + qkv (64x192+192) + proj (64x64+64)
    # + fc (64x256+256) + proj (256x64+64); head = ln_f only
    assert spec.unit_params() == [18432, 49984, 49984, 128]
    # a gradient step through the head reaches the shared tensor
    input_ids, labels = batch(model.config.vocab_size)
    model(input_ids, labels).backward()
    assert wte.grad is not None and wte.grad.abs().sum() > 0


def test_gpt_untied_has_its_own_output_projection():
    model = tiny_gpt(tie_embeddings=False)
    assert model.units[-1].module.lm_head.weight is not model.units[0].module.wte.weight
    assert model_spec_of(model).head_params == 64 * 2 + 256 * 64


def test_gpt_init_is_deterministic_and_device_independent():
    a = tiny_gpt(seed=3)
    torch.manual_seed(123)  # the global RNG must not matter
    b = tiny_gpt(seed=3)
    c = tiny_gpt(seed=4)
    direct = build_model("gpt-tiny", device="cpu")  # built on CPU, no meta step
    direct.init_weights(gen(3))
    sa, sb, sc, sd = (m.state_dict() for m in (a, b, c, direct))
    for k in sa:
        assert torch.equal(sa[k], sb[k]) and torch.equal(sa[k], sd[k]), k
    assert not torch.equal(
        sa["unit_modules.embedding.wte.weight"], sc["unit_modules.embedding.wte.weight"]
    )


def test_gpt_init_follows_gpt2_scheme():
    model = build_model("gpt-nano").materialize("cpu", gen(0))
    blk = model.units[1].module
    assert torch.equal(blk.ln_1.weight, torch.ones_like(blk.ln_1.weight))
    assert torch.equal(blk.attn.c_attn.bias, torch.zeros_like(blk.attn.c_attn.bias))
    assert blk.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual_std = 0.02 / math.sqrt(2 * model.config.n_layer)
    assert blk.mlp.c_proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)


@pytest.mark.parametrize("name", ["gpt-tiny", "hf-gpt2-tiny", "hf-llama-tiny"])
def test_building_and_materializing_draw_nothing_from_the_global_rng(name):
    state = torch.get_rng_state()
    model = build_model(name, dropout=0.1).materialize("cpu", gen(0))
    build_model(name, device="cpu")  # a direct build runs torch/HF default init: forked away
    if name.startswith("hf-"):
        from cephalo.modeling.hf.export import to_hf_model

        to_hf_model(model)
    model.eval()
    input_ids, labels = batch(model.spec.vocab_size)
    model(input_ids, labels)  # eval forward: no dropout draws either
    assert torch.equal(state, torch.get_rng_state())


def test_gpt_dropout_replays_with_restored_rng_state():
    model = tiny_gpt(dropout=0.3).train()
    input_ids, _ = batch(model.config.vocab_size)
    h = model.units[0].module(input_ids)
    block = model.units[1].module
    state = torch.get_rng_state()
    out1 = block(h)
    out_other = block(h)  # RNG moved on: different masks
    torch.set_rng_state(state)
    out2 = block(h)
    assert torch.equal(out1, out2)
    assert not torch.equal(out1, out_other)


def test_gpt_rejects_too_long_sequences_and_bad_configs():
    model = tiny_gpt()
    with pytest.raises(CephaloError, match="seq_len"):
        model.units[0].module(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(CephaloError, match="multiple of n_head"):
        build_model("gpt-tiny", n_head=3)


def test_registry_errors_list_choices():
    with pytest.raises(CephaloError, match="gpt-tiny"):
        build_model("no-such-model")
    with pytest.raises(CephaloError, match="unknown setting"):
        build_model("gpt-tiny", n_layers=3)
    assert set(GPT_PRESETS) <= set(list_runnable_models())
    assert build_model("gpt-tiny", block_size=16).config.seq_len == 16


@pytest.mark.parametrize("name", sorted(GPT_PRESETS))
def test_gpt_presets_build_on_meta(name):
    model = build_model(name)
    spec = model_spec_of(model)
    assert spec.num_layers == model.config.n_layer
    assert spec.total_params == sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- transformers GPT-2 / Llama

HF_MODELS = ["hf-gpt2-tiny", "hf-llama-tiny"]


def hf_pair(name: str, seed: int = 0, **overrides):
    """Our units and an HF model loaded (strictly) from their exported weights."""
    from cephalo.modeling.hf.export import to_hf_model

    model = build_model(name, **overrides).materialize("cpu", gen(seed))
    return model, to_hf_model(model)


def hf_batch(vocab: int, b: int = 3, s: int = 20):
    """(input_ids, HF-style unshifted labels, our pre-shifted labels)."""
    g = gen(7)
    input_ids = torch.randint(0, vocab, (b, s), generator=g)
    hf_labels = input_ids.clone()
    hf_labels[1, 5:9] = IGNORE_INDEX
    ours = torch.full_like(hf_labels, IGNORE_INDEX)
    ours[:, :-1] = hf_labels[:, 1:]
    return input_ids, hf_labels, ours


def unit_logits(model, input_ids):
    h = model.units[0].module(input_ids)
    for u in model.units[1:-1]:
        h = u.module(h)
    return model.units[-1].module.logits(h)


@pytest.mark.parametrize("name", HF_MODELS)
def test_hf_units_match_hf_loss_logits_and_gradients(name):
    model, hf_model = hf_pair(name)
    model.eval()
    hf_model.eval()
    input_ids, hf_labels, labels = hf_batch(model.spec.vocab_size)
    loss = model(input_ids, labels)
    out = hf_model(input_ids, labels=hf_labels)
    torch.testing.assert_close(loss, out.loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unit_logits(model, input_ids), out.logits, rtol=1e-5, atol=1e-5)

    loss.backward()
    out.loss.backward()
    hf_params = dict(hf_model.named_parameters())
    for unit_name, pname, p in model.named_unit_parameters():
        hf_name = model.hf_names[f"{unit_name}.{pname}"][0]
        torch.testing.assert_close(p.grad, hf_params[hf_name].grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", HF_MODELS)
def test_hf_units_hold_no_buffers_and_init_is_deterministic(name):
    assert list(build_model(name).buffers()) == []
    a = build_model(name).materialize("cpu", gen(5))
    torch.manual_seed(99)
    b = build_model(name).materialize("cpu", gen(5))
    c = build_model(name).materialize("cpu", gen(6))
    for (k, ta), tb, tc in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        assert torch.equal(ta, tb), k
        if "weight" in k and ta.dim() == 2:
            assert not torch.equal(ta, tc), k
    assert model_spec_of(a).total_params == sum(p.numel() for p in a.parameters())


def test_builtin_gpt_exports_as_gpt2_with_the_same_loss():
    from cephalo.modeling.hf.export import to_hf_model

    model = tiny_gpt(seed=4).eval()
    hf_model = to_hf_model(model)
    assert hf_model.lm_head.weight is hf_model.transformer.wte.weight
    input_ids, hf_labels, labels = hf_batch(model.spec.vocab_size)
    torch.testing.assert_close(
        model(input_ids, labels), hf_model(input_ids, labels=hf_labels).loss, rtol=1e-5, atol=1e-5
    )
    untied = tiny_gpt(seed=4, tie_embeddings=False).eval()
    hf_untied = to_hf_model(untied)
    assert hf_untied.lm_head.weight is not hf_untied.transformer.wte.weight
    torch.testing.assert_close(
        unit_logits(untied, input_ids), hf_untied(input_ids).logits, rtol=1e-5, atol=1e-5
    )


def test_hf_gpt2_tied_weight_is_one_parameter():
    model, hf_model = hf_pair("hf-gpt2-tiny")
    assert model.units[-1].module.lm_head.weight is model.units[0].module.wte.weight
    names = [f"{u}.{n}" for u, n, _ in model.named_unit_parameters()]
    assert "head.lm_head.weight" not in names
    assert sorted(model.hf_names["embedding.wte.weight"]) == [
        "lm_head.weight",
        "transformer.wte.weight",
    ]
    assert model_spec_of(model).tied_embeddings


def test_hf_llama_ties_on_request():
    model = build_model("hf-llama-tiny", tie_embeddings=True).materialize("cpu", gen(0))
    assert model.units[-1].module.lm_head.weight is model.units[0].module.embed_tokens.weight
    assert model_spec_of(model).head_params == 64  # the final RMSNorm only


@pytest.mark.parametrize("name", ["gpt-tiny", *HF_MODELS])
def test_export_after_training_loads_strictly_into_transformers(name):
    from cephalo.modeling.hf.export import export_hf_state_dict, to_hf_model

    model = build_model(name).materialize("cpu", gen(1)).eval()
    input_ids, _, labels = hf_batch(model.spec.vocab_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(input_ids, labels).backward()
    opt.step()
    # through the `state=` path, as `cephalo export` does with Engine.full_state_dict()
    state = {f"{u}.{n}": p.detach().clone() for u, n, p in model.named_unit_parameters()}
    hf_model = to_hf_model(model, state)
    torch.testing.assert_close(
        hf_model(input_ids).logits, unit_logits(model, input_ids), rtol=1e-5, atol=1e-5
    )
    with pytest.raises(CephaloError, match="missing"):
        export_hf_state_dict(model, {})
    with pytest.raises(CephaloError, match="no biases"):
        export_hf_state_dict(tiny_gpt(bias=False))


@pytest.mark.parametrize("name", HF_MODELS)
def test_hf_dropout_replays_with_restored_rng_state(name):
    model = build_model(name, dropout=0.3).materialize("cpu", gen(0)).train()
    input_ids, _, _ = hf_batch(model.spec.vocab_size)
    h = model.units[0].module(input_ids)
    block = model.units[1].module
    state = torch.get_rng_state()
    out1 = block(h)
    out_other = block(h)
    torch.set_rng_state(state)
    assert torch.equal(out1, block(h))
    assert not torch.equal(out1, out_other)


def test_hf_bad_settings_and_missing_transformers(monkeypatch):
    with pytest.raises(CephaloError, match="unknown setting"):
        build_model("hf-gpt2-tiny", n_layers=3)
    with pytest.raises(CephaloError, match="maximum 32"):
        build_model("hf-llama-tiny").materialize("cpu", gen(0)).units[0].module(
            torch.zeros(1, 40, dtype=torch.long)
        )
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    with pytest.raises(CephaloError, match=r"pip install 'cephalo\[hf\]'"):
        build_model("hf-gpt2-tiny")


@pytest.mark.parametrize("name", ["gpt-tiny", *HF_MODELS])
def test_unit_by_unit_init_equals_whole_model_init(name):
    from cephalo.modeling.units import retie, tied_parameter_slots

    whole = build_model(name).materialize("cpu", gen(11))
    by_unit = build_model(name)
    slots = tied_parameter_slots(by_unit)
    by_unit.to_empty(device="cpu")
    retie(slots)
    g = gen(11)
    for unit in by_unit.units:
        by_unit.init_unit_weights(unit.name, g)
    for (k, a), b in zip(whole.state_dict().items(), by_unit.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert list(build_model(name).buffers()) == []


@pytest.mark.parametrize("name", ["gpt-tiny", *HF_MODELS])
def test_bf16_compute_gives_an_fp32_loss_close_to_fp32(name):
    model = build_model(name).materialize("cpu", gen(2)).eval()
    input_ids, labels = batch(model.spec.vocab_size)
    loss32 = model(input_ids, labels)
    model.to(torch.bfloat16)
    h = model.units[0].module(input_ids)
    assert h.dtype == torch.bfloat16
    for u in model.units[1:-1]:
        h = u.module(h)
    loss_sum = model.units[-1].module(h, labels)
    assert loss_sum.dtype == torch.float32
    n_tokens = (labels != IGNORE_INDEX).sum()
    assert (loss_sum / n_tokens).item() == pytest.approx(loss32.item(), rel=2e-2)


def test_meta_build_skips_and_restores_torch_init():
    """A meta build runs no `torch.nn.init` filler (they are no-ops inside) and leaves them
    as they were; a build on the CPU runs them."""
    import torch.nn.init as init

    from cephalo.modeling.units import skip_init_on_meta

    original = init.normal_
    with skip_init_on_meta("meta"):
        assert init.normal_ is not original
        t = torch.empty(3, device="meta")
        assert init.normal_(t) is t
    assert init.normal_ is original
    with skip_init_on_meta("cpu"):
        assert init.normal_ is original
    build_model("gpt-tiny")
    assert init.normal_ is original
