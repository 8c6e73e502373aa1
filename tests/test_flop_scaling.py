"""Catalog profiles for models the published data never measured: FLOP scaling from the same
GPU's published blocks, its leave-one-out error on the published data, and `cephalo plan`
on a transformers directory printing it."""

from __future__ import annotations

import dataclasses

import pytest

from cephalo.specs.catalog import formulas, models, published
from cephalo.specs.catalog.flop_scaling import estimate, group_of


def test_leave_one_out_error_on_the_published_data():
    """Every published Llama-group entry estimated from the other Llama sizes on its GPU:
    the estimate is within a few percent for most entries (the numbers docs/models.md quotes)."""
    llama = published.estimate_error(None, None, "llama")
    print(f"llama blocks: {llama.describe()}")
    assert llama.n > 200
    assert llama.fwd_median < 0.08 and llama.bwd_median < 0.08
    assert llama.fwd_p90 < 0.25 and llama.bwd_p90 < 0.25
    for group in ("gpt", "bert", "vit"):
        print(f"{group} blocks: {published.estimate_error(None, None, group).describe()}")


def test_llama_7b_from_the_other_llama_sizes():
    """The issue's example: llama-7b on an A100 80GB (fp16, 2048 tokens) estimated with
    llama-7b and llama2-7b (one shape) left out, against its measurement."""
    spec = models.get_model_spec("llama-7b")
    others = [
        e
        for e in published.published_entries("a100x80", "fp16")
        if e.shape != (spec.params_per_block, spec.hidden_size, spec.num_heads)
    ]
    est = estimate(formulas.block_flops_per_sample(spec, 2048), "llama", 2048, others)
    measured = published.catalog_profile("a100x80", "llama-7b", 2048, "fp16").units["block"]
    for b in (1, 4, 8):
        err_f = est.fwd(b) / measured.fwd_s(b) - 1
        err_b = est.bwd(b) / measured.bwd_s(b) - 1
        print(
            f"llama-7b b={b}: forward {100 * err_f:+.1f} %, backward {100 * err_b:+.1f} % ({est.sources})"
        )
        assert abs(err_f) < 0.15 and abs(err_b) < 0.15
    assert "llama-7b" not in " ".join(est.sources) and "llama2-7b" not in " ".join(est.sources)


def test_unmeasured_model_is_estimated_and_a_known_shape_uses_its_data():
    llama7 = models.get_model_spec("llama-7b")
    same_blocks = dataclasses.replace(llama7, name="/models/Llama-2-7b-hf", arch="llama")
    p = published.catalog_profile("a100x80", same_blocks, 2048, "bf16")
    assert p.meta["timing_model"] in ("llama-7b", "llama2-7b")
    assert p.units["block"].fwd_s(2) == published.catalog_profile(
        "a100x80", "llama-7b", 2048, "bf16"
    ).units["block"].fwd_s(2)
    smaller = dataclasses.replace(
        llama7, name="/models/tiny", params_per_block=llama7.params_per_block // 3, hidden_size=2048
    )
    q = published.catalog_profile("a100x80", smaller, 2048, "bf16")
    assert q.meta["timing_source"] == "flop-scaled"
    assert "median" in q.meta["estimate_error"]
    assert q.units["block"].fwd_s(2) < p.units["block"].fwd_s(2)
    # catalog models keep their explicit error when a profile is missing
    with pytest.raises(Exception, match="no published fp16 profile of gpt-2.7b on a10g"):
        published.catalog_profile("a10g", "gpt-2.7b", 512, "fp16")


def test_groups():
    assert group_of("qwen2") == "llama" and group_of("gemma2") == "llama"
    assert group_of("gpt2") == "gpt" and group_of("gpt_neox") == "gpt"
    assert group_of("mistral") == "llama"


def test_cephalo_plan_on_a_model_directory(tmp_path, capsys):
    from cephalo.cli import main as cli_main
    from hf_configs import save_tiny_model

    directory = save_tiny_model(
        "qwen2", tmp_path / "qwen", seed=1, max_position_embeddings=512
    )  # a context of the planned --seq-len (plan refuses one past it)
    assert (
        cli_main(
            [
                "plan",
                "--cluster",
                "2xl4,a6000",
                "--model",
                str(directory),
                "--global-batch",
                "16",
                "--seq-len",
                "512",
                "--dtype",
                "bf16",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "block times scaled by FLOPs" in out and "Leave-one-out error" in out
    assert "cephalo:" in out
