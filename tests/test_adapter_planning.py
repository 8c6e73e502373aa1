"""Planning LoRA and QLoRA: the byte and parameter formulas (exact values), the cost model's
time and memory under a frozen base, the planner against the exhaustive search, and the CLI."""

import json
import math

import numpy as np
import pytest

from cephalo import CephaloError
from cephalo.cli import main
from cephalo.costmodel.layout import FROZEN_MATMUL_BACKWARD_SHARE, param_layout
from cephalo.costmodel.sources import catalog_cost_model
from cephalo.errors import PlanDoesNotFit
from cephalo.planner.makers import make_plan
from cephalo.specs.adapter import (
    AdapterSpec,
    Linear,
    adapter_spec,
    lora_params,
    nf4_bytes_per_param,
)
from cephalo.specs.catalog.models import get_model_spec
from cephalo.specs.cluster import Cluster
from cephalo.specs.model import ModelSpec
from planner_helpers import FakeDevice, cost_model, linear_profile
from test_planner import _check_against_exhaustive

Q = 0.515869140625  # NF4 + double quantization: 4/8 + 1/64 + 4/(64*256) bytes per weight


def adapter_model() -> ModelSpec:
    """tiny_model's sizes (embedding 50, 2 blocks of 100, head 20: P = 270; seq 3, hidden 4) with
    named Linear layers: q (4x4), v (4x4), fc (4x8), proj (8x4) = 96 weights + 4 norm params."""
    return ModelSpec(
        name="tiny-lora",
        arch="gpt",
        num_layers=2,
        hidden_size=4,
        num_heads=1,
        vocab_size=10,
        ffn_hidden_size=8,
        params_per_block=100,
        embedding_params=50,
        head_params=20,
        block_linears=(
            Linear("attn.q", 4, 4),
            Linear("attn.v", 4, 4),
            Linear("mlp.fc", 4, 8),
            Linear("mlp.proj", 8, 4),
        ),
    )


QV = AdapterSpec("lora", 1, ("q", "v"))  # r=1 on q and v: 1*(4+4) * 2 = 16 per block
QLORA_QV = AdapterSpec("qlora", 1, ("q", "v"))


def _cm(adapter=None, opt=0.01, mem=10_000):
    """The formulas' cost model, in the unfused order (the fused tail, costmodel/rules.py,
    has its own tests in test_costmodel.py and test_memory_prediction.py)."""
    prof = linear_profile("x", 1.0, 2.0, 1000.0, optimizer_s_per_param=opt)
    devs = [FakeDevice("x", mem), FakeDevice("x", mem)]
    cm = cost_model(devs, {"x": prof}, model=adapter_model(), reserve_bytes=100, fuse_tail=False)
    if adapter is None:
        return cm
    return type(cm)(
        cm.model,
        cm.seq_len,
        cm.dtype,
        devs,
        cm.profiles,
        cm.comm,
        reserve_bytes=100,
        adapter=adapter,
        fuse_tail=False,
    )


# ------------------------------------------------------------------ the formulas
def test_nf4_bytes_from_the_block_sizes():
    assert nf4_bytes_per_param() == Q
    assert nf4_bytes_per_param() * 8 == pytest.approx(4.127, abs=1e-3)  # QLoRA paper's 4.127 bits
    assert nf4_bytes_per_param() / 2 < 0.3  # the "at most 0.3x bf16" per quantized weight


def test_lora_params_match_peft_counts():
    # peft's print_trainable_parameters for r=16, all-linear: Llama-2-7B 39,976,960;
    # Llama-3-8B (GQA: k/v 4096 -> 1024) 41,943,040
    llama = get_model_spec("llama-7b")
    assert lora_params(llama.block_linears, 16, "all-linear") * 32 == 39_976_960
    cm = catalog_cost_model(
        Cluster.parse("a10g"), llama, 512, "bf16", adapter=adapter_spec("lora", 16)
    )
    assert cm.optimizer_params == 39_976_960
    # q_proj, v_proj only (peft's old default): 16 * (8192 + 8192) * 32
    assert lora_params(llama.block_linears, 16, ("q_proj", "v_proj")) * 32 == 8_388_608
    with pytest.raises(CephaloError, match="match no Linear.*q_proj"):
        param_layout(llama, 512, 2, AdapterSpec("lora", 16, ("query_key_value",)))
    with pytest.raises(CephaloError, match="lora_r must be a positive"):
        AdapterSpec("lora", 0)


def test_state_gather_and_gradient_bytes_exact():
    full, lora, qlora = (param_layout(adapter_model(), 3, 2, a) for a in (None, QV, QLORA_QV))
    # full: 16 B x 270; a block gathers 100 fp16 params and reduces 100 fp32 gradients
    assert full.state_bytes == 270 * 16 and full.trained_params == 270
    assert (full.units["block"].gather_bytes, full.units["block"].trained) == (200, 100)
    # lora: the frozen base in fp16 (270 x 2) + 16 B x 32 adapter params (16 per block)
    assert lora.state_bytes == 270 * 2 + 32 * 16 == 1052
    assert lora.trained_params == 32 and lora.owned_trained == (0, 16, 16, 0)
    b = lora.units["block"]
    assert (b.gather_bytes, b.held_bytes, b.trained) == (100 * 2 + 16 * 2, 232, 16)
    assert lora.units["head"].trained == 0 and lora.units["embedding"].gather_bytes == 100
    # qlora: the 2 x 96 block Linear weights in NF4, the other 78 parameters in fp16
    assert qlora.frozen_bytes == 192 * Q + 78 * 2
    assert qlora.state_bytes == 192 * Q + 78 * 2 + 32 * 16
    b = qlora.units["block"]
    assert b.gather_bytes == 96 * Q + 4 * 2 + 16 * 2
    assert b.held_bytes == b.gather_bytes + 96 * 2  # + its dequantized weights while it computes
    assert b.dequant_bytes == 96 * (Q + 2)


def test_cost_model_bytes_lora_and_qlora_vs_full():
    cm_full, cm_lora, cm_q = _cm(), _cm(QV), _cm(QLORA_QV)
    # what grows with the state fraction: the state + the largest unit's reduce-scatter output
    assert cm_full.bytes_per_fraction == 270 * 16 + 100 * 4
    assert cm_lora.bytes_per_fraction == 1052 + 16 * 4
    assert cm_q.bytes_per_fraction == 192 * Q + 78 * 2 + 32 * 16 + 16 * 4
    # the peak of b=5, m=2 (full: test_costmodel's arithmetic, the block before the last, whose
    # two block gradients no longer weigh): with lora the last block's backward,
    #   gathered 232 + the prefetched block 232, grads (16 + head's 0) x 4, act 2000,
    #   3 x 5 x 24 boundaries = 2888  (the block before it: 232 + 100 + 128 + 2000 + 240 = 2700)
    c = cm_lora.rank_cost(0, 5, 2, 0.5)
    m = c.memory
    assert (m.state, m.gathered, m.grad_accum, m.activations, m.boundary) == (
        526,
        464,
        64 + 32,  # + this rank's half of the reduce-scatter output 0.5 * 16 * 4
        2000,
        360,
    )
    q = cm_q.rank_cost(0, 5, 2, 0.5).memory
    assert q.state == math.ceil(0.5 * (192 * Q + 78 * 2 + 32 * 16))
    # the computing block with its dequantized weights, the prefetched one packed
    assert q.gathered == math.ceil((96 * Q + 40 + 96 * 2) + (96 * Q + 40))
    assert cm_full.rank_cost(0, 5, 2, 0.5).memory.state == 2160


def test_collectives_move_frozen_bytes_and_adapter_gradients():
    cm = cost_model(
        [FakeDevice("x", 10_000)] * 2,
        {"x": linear_profile("x", 1.0, 2.0, 0.0, 0.01)},
        model=adapter_model(),
        bytes_per_s=100.0,
    )
    lora = type(cm)(cm.model, 3, "fp16", cm.devices, cm.profiles, cm.comm, adapter=QV)
    # ring (n-1)/n = 1/2 over 100 B/s: a block gathers 232 B, reduce-scatters 16 x 4 B
    assert lora.gather_s["block"] == pytest.approx(0.5 * 232 / 100)
    assert lora.scatter_s["block"] == pytest.approx(0.5 * 64 / 100)
    assert lora.scatter_s["head"] == 0.0 and lora.scatter_s["embedding"] == 0.0
    assert cm.scatter_s["block"] == pytest.approx(0.5 * 400 / 100)


def test_frozen_backward_and_optimizer_time():
    # b=1, m=1, no collectives: F = 1, B = 2 per unit. Forward FLOPs per token: matmuls 2 x 96,
    # attention 4 x 3 x 4 = 48, adapters 2 x 16 = 32.
    #   block forward   (192 + 48 + 32) / 240           = 1.1333...
    #   block backward  (2*192*0.5 + 2*48 + 2*32) / 480 = 0.7333... of B
    #   embedding backward 0 (a frozen lookup), head backward 0.5 of B (a frozen matmul)
    assert FROZEN_MATMUL_BACKWARD_SHARE == 0.5
    fwd, bwd = 272 / 240, 352 / 480
    emb, blocks, head = 1 + 1, 2 * (fwd + fwd + 2 * bwd), 1 + 2 * 0.5  # the head: no recompute
    c = _cm(QV).rank_cost(0, 1, 1, 0.5)
    assert c.compute_s == pytest.approx(emb + blocks + head)
    # the optimizer steps only this rank's half of the 32 adapter parameters
    assert c.optimizer_s == pytest.approx(0.5 * 32 * 0.01)
    assert _cm().rank_cost(0, 1, 1, 0.5).compute_s == pytest.approx(4 * (1 + 3) - 1)
    # QLoRA adds one dequantization per pass of a block: 96 x (Q + 2) bytes at the bandwidth
    # the optimizer streams (0.01 s per parameter / 30 bytes)
    deq = 96 * (Q + 2) * 0.01 / 30
    cq = _cm(QLORA_QV).rank_cost(0, 1, 1, 0.5)
    assert cq.compute_s == pytest.approx(c.compute_s + 2 * 2 * deq)


def test_profile_measured_on_an_adapter_run_is_used_as_measured():
    cm = _cm(QV)
    cm.profiles["x"].meta["adapter"] = "lora"
    again = type(cm)(
        cm.model, 3, "fp16", cm.devices, cm.profiles, cm.comm, adapter=QV, fuse_tail=False
    )
    assert again.rank_cost(0, 1, 1, 0.0).compute_s == pytest.approx(4 * (1 + 3) - 1)


def test_profile_measured_with_a_frozen_base_keeps_qloras_dequantization():
    """A profile of the model with adapters (meta adapter `lora`: what the profiler records for
    a frozen base) has no time factor, but the profiler never dequantizes NF4: QLoRA adds it."""
    cm = _cm(QLORA_QV)
    cm.profiles["x"].meta["adapter"] = "lora"
    again = type(cm)(cm.model, 3, "fp16", cm.devices, cm.profiles, cm.comm, adapter=QLORA_QV)
    deq = 96 * (Q + 2) * 0.01 / 30
    assert again.rank_cost(0, 1, 1, 0.0).compute_s == pytest.approx(4 * (1 + 3) - 1 + 2 * 2 * deq)


def test_measured_dequantization_rate_replaces_the_estimate():
    """A profile of a QLoRA model carries the measured seconds per NF4 weight dequantized: each
    pass of a block costs its 96 quantized weights at that rate instead of the bytes estimate."""
    cm = _cm(QLORA_QV)
    cm.profiles["x"].meta.update(adapter="lora", nf4_dequant_s_per_param=1e-3)
    again = type(cm)(cm.model, 3, "fp16", cm.devices, cm.profiles, cm.comm, adapter=QLORA_QV)
    assert again.rank_cost(0, 1, 1, 0.0).compute_s == pytest.approx(4 * (1 + 3) - 1 + 2 * 2 * 0.096)


def test_qlora_dequantization_moment():
    """QLoRA's peak can fall as a block's weights are dequantized: the unit held with torchao's
    temporaries of its largest weight (20 B per element; fc: 32), no activations, no gradient
    of its own, the next block's in flight; LoRA has no such moment."""
    from cephalo.specs.adapter import nf4_dequant_transient_bytes

    assert nf4_dequant_transient_bytes(32) == 20 * 32
    assert nf4_dequant_transient_bytes(10**8) == 20 * (1 << 20)  # one chunk at a time
    cq, cl = _cm(QLORA_QV), _cm(QV)
    block = cq.layout.units["block"]
    assert block.dequant_transient_bytes == 20 * 32
    assert cl.layout.units["block"].dequant_transient_bytes == 0
    args = ("x", np.array(4), np.array(4), np.array(False))
    phases, lora = cq._phases(*args), cl._phases(*args)
    # QLoRA: the last block's and the one before it's dequantization; LoRA: the fused tail's
    # two moments (costmodel/rules.py), which QLoRA does not have
    assert cq.fused_tail_possible is False and cl.fused_tail_possible is True
    assert len(phases) == len(lora)
    before_last = phases[-1]
    assert before_last["gathered"] == block.held_bytes + 20 * 32
    assert before_last["grad_accum"] == block.trained * 4  # the last block's, in flight
    assert "activations" not in before_last
    # the predicted peak is never below it
    parts = cq.memory_parts("x", 10_000, 4, 4, False)
    peak = sum(float(v) for c, v in parts.items() if c != "reserve")
    assert peak >= sum(float(v) for v in before_last.values())


def test_host_state_is_full_fine_tuning_only():
    with pytest.raises(CephaloError, match="lora does not support"):
        _cm(QV).rank_cost(0, 1, 1, 0.5, host_fraction=0.5)


# ------------------------------------------------------------------ the planner
def _hetero(adapter, mem=(2500, 2500, 4000)):
    keys = ["d0", "d1", "d2"]
    speeds = (1.0, 0.5, 2.0)
    profiles = {
        k: linear_profile(k, 1.0 / s, 2.0 / s, 300.0, 1e-3, fwd_intercept=0.3 / s)
        for k, s in zip(keys, speeds, strict=True)
    }
    devices = [FakeDevice(k, m) for k, m in zip(keys, mem, strict=True)]
    cm = cost_model(devices, profiles, model=adapter_model(), bytes_per_s=5000.0, latency_s=0.01)
    return type(cm)(
        cm.model, 3, "fp16", devices, profiles, cm.comm, reserve_bytes=0, adapter=adapter
    )


@pytest.mark.parametrize("adapter", [QV, QLORA_QV, AdapterSpec("lora", 2)])
@pytest.mark.parametrize("B", [1, 4, 7])
def test_adapter_plans_match_exhaustive(adapter, B):
    out = _check_against_exhaustive(_hetero(adapter), B)
    assert out is not None
    plan, ev, _ = out
    assert plan.meta["adapter"] == adapter.to_dict()


def test_qlora_fits_what_full_fine_tuning_cannot():
    # three small devices: full fine-tuning's 16 B x 270 = 4320 bytes of state do not fit
    # beside the working memory; QLoRA's 767 do
    with pytest.raises(PlanDoesNotFit):
        make_plan(_hetero(None, mem=(1800, 1800, 1800)), 3)
    plan = make_plan(_hetero(QLORA_QV, mem=(1800, 1800, 1800)), 3)
    assert _hetero(QLORA_QV, mem=(1800, 1800, 1800)).evaluate(plan).fits


def test_qlora_fits_llama_13b_on_consumer_memory_where_full_does_not():
    llama = get_model_spec("llama-13b")
    cluster = Cluster.parse("a10g,t4")
    full = catalog_cost_model(cluster, llama, 512, "fp16")
    with pytest.raises(PlanDoesNotFit, match="16 bytes x"):
        make_plan(full, 8, allow_host_state=False)
    qlora = catalog_cost_model(cluster, llama, 512, "fp16", adapter=adapter_spec("qlora", 16))
    plan = make_plan(qlora, 8)
    ev = qlora.evaluate(plan)
    assert ev.fits and all(r.host_state_fraction == 0 for r in plan.ranks)
    # the frozen NF4 base is about a quarter of the fp16 one
    lora = catalog_cost_model(cluster, llama, 512, "fp16", adapter=adapter_spec("lora", 16))
    ratio = qlora.layout.frozen_bytes / lora.layout.frozen_bytes
    assert 0.25 < ratio < 0.3


def test_adapter_mismatch_between_plan_and_cost_model():
    plan = make_plan(_hetero(QV), 4)
    with pytest.raises(CephaloError, match="the plan is for lora"):
        _hetero(QLORA_QV).evaluate(plan)


# ------------------------------------------------------------------ the CLI
ARGS = ["--cluster", "a10g,t4", "--model", "llama-7b", "--global-batch", "8", "--seq-len", "512"]


def test_plan_and_simulate_take_adapter_flags(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", *ARGS, "--adapter", "qlora", "--lora-r", "8", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "qlora r=8 on all-linear" in text and "19,988,480 adapter parameters" in text
    assert json.loads(out.read_text())["meta"]["adapter"] == {
        "mode": "qlora",
        "r": 8,
        "targets": "all-linear",
    }
    assert main(["simulate", str(out)]) == 0  # the plan's own adapter settings
    assert "qlora r=8" in capsys.readouterr().out
    assert main(["plan", *ARGS, "--lora-r", "8"]) == 2
    assert "--lora-r needs --adapter" in capsys.readouterr().err


def test_advise_takes_adapter_flags(tmp_path, capsys):
    offers = tmp_path / "offers.toml"
    offers.write_text(
        '[[offer]]\ntype = "a10g"\nmax_count = 2\nprice_per_hour = 1.0\n'
        '[[offer]]\ntype = "t4"\nmax_count = 2\nprice_per_hour = 0.5\n'
    )
    args = ["advise", "--offers", str(offers), "--model", "llama-7b", "--global-batch", "8"]
    assert main([*args, "--adapter", "qlora", "--seq-len", "512"]) == 0
    text = capsys.readouterr().out
    assert "qlora r=16" in text


# ------------------------------------------------------------------ the model spec
def test_block_linears_read_off_runnable_models():
    from cephalo.modeling.registry import build_model, model_spec_for
    from cephalo.modeling.units import block_linears

    # GPT-2's Conv1D counts as peft's all-linear counts it: c_attn (64 -> 192), c_proj, c_fc, c_proj
    gpt2 = model_spec_for("hf-gpt2-tiny")
    assert [(lin.in_features, lin.out_features) for lin in gpt2.block_linears] == [
        (64, 192),
        (64, 64),
        (64, 256),
        (256, 64),
    ]
    assert lora_params(gpt2.block_linears, 8, "all-linear") == 8 * (256 + 128 + 320 + 320)
    # a catalog model's shape and its runnable twin agree (llama: q, k, v, o, gate, up, down)
    llama = model_spec_for("hf-llama-tiny")
    assert [lin.name.rsplit(".", 1)[-1] for lin in llama.block_linears] == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    # a block already wrapped by peft reads the same
    peft = pytest.importorskip("peft")
    block = build_model("hf-llama-tiny").units[1].module
    before = block_linears(block)
    peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), block)
    assert block_linears(block) == before


def test_advisor_is_exact_and_bounded_under_qlora():
    """`cephalo advise --adapter qlora`: the search's frontier equals planning every cluster,
    and no plan beats the bound it prunes with (llama-7b: full state 100 GiB, QLoRA's 4 GiB)."""
    from cephalo.advise.advisor import Advisor
    from cephalo.costmodel.sources import build_cost_model
    from cephalo.specs.offers import Offers
    from test_advise import brute_force, planned

    offers = {
        "offer": [
            {"type": "t4", "max_count": 2, "price_per_hour": 0.35},
            {"type": "l4", "max_count": 2, "price_per_hour": 0.80},
            {"type": "a10g", "max_count": 2, "price_per_hour": 1.00},
        ]
    }
    q = adapter_spec("qlora", 16)
    adv = Advisor(
        Offers.from_dict(offers),
        lambda spec: build_cost_model(spec, "llama-7b", 512, "fp16", adapter=q),
        8,
    )
    table = planned(adv)
    assert table[(1, 0, 0)] is not None  # one T4 holds the NF4 base
    found = adv.search(plans_per_level=None)
    assert found.bound.exact
    got = [(p.cluster, p.samples_per_s) for p in found.frontier]
    assert got == brute_force(adv, table, adv._max_units)
    for units, sps in table.items():
        if sps is not None:
            assert sps <= adv.upper_bound(units) * (1 + 1e-12), units


def test_target_modules_as_names_or_regex():
    llama = get_model_spec("llama-7b").block_linears
    assert lora_params(llama, 8, ("q_proj", "v_proj")) == lora_params(llama, 8, r".*\.(q|v)_proj")
    # peft fullmatches the model's module names: a pattern anchored on the model's path works
    anchored = r"model\.layers\.\d+\.self_attn\.(q|v)_proj"
    assert lora_params(llama, 8, anchored) == 8 * 4 * 4096
    assert lora_params(llama, 8, r"self_attn\.(q|v)_proj") == 8 * 4 * 4096
    assert lora_params(llama, 8, r".*q_proj") == 8 * 2 * 4096
    assert lora_params(llama, 8, r"q_proj") == 0  # a bare name as a regex: peft's fullmatch too
    with pytest.raises(CephaloError, match="not a regular expression"):
        lora_params(llama, 8, "q_proj[")


def test_dpo_pair_costs_two_sequences_and_the_lora_reference():
    """DPO (issue 42): a planned sample is a pair, so a pair's passes cost what two
    sequences' cost (the profile read at 2 m), its boundary doubles, the head adds the
    log-probability pass (a forward), and under LoRA every forward runs twice (the
    reference, adapters off); the objective survives a plan file's round trip."""
    full_sft, full_dpo = _cm(), _cm(AdapterSpec(objective="dpo"))
    sft_rows = full_sft._pass_times("x", 6, 2)  # 3 pairs as 6 sequences, 2 per micro-batch
    pairs = full_dpo._pass_times("x", 3, 1)
    assert pairs["block"] == pytest.approx(sft_rows["block"])
    assert pairs["embedding"] == pytest.approx(sft_rows["embedding"])
    fwd, bwd = sft_rows["head"]
    assert pairs["head"] == pytest.approx((fwd, bwd + fwd))
    assert full_dpo.sample_boundary_bytes == 2 * full_sft.sample_boundary_bytes
    lora_dpo = AdapterSpec("lora", 1, ("q", "v"), "dpo")
    lora = _cm(QV)._pass_times("x", 6, 2)["block"]
    ref = _cm(lora_dpo)._pass_times("x", 3, 1)["block"]
    assert ref == pytest.approx((2 * lora[0], lora[1]))  # backward: the policy's alone
    assert AdapterSpec.from_dict(lora_dpo.to_dict()) == lora_dpo
    assert "objective" not in QV.to_dict()  # an SFT plan file is as before
