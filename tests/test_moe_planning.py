"""Mixture-of-experts models in the cost model: memory from every expert, compute from the
active ones (top-k routed + shared), for the FLOP-scaled catalog profiles; `cephalo plan
--model DIR` on Qwen3-30B-A3B- and gpt-oss-20b-shaped config.json files (no weights)."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from cephalo.cli import main
from cephalo.modeling.registry import model_spec_for
from cephalo.specs.catalog.formulas import block_flops_per_sample
from cephalo.specs.catalog.published import catalog_profile

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def _shapes(tmp_path: Path) -> dict[str, Path]:
    spec = importlib.util.spec_from_file_location("moe_shapes", ROOT / "scripts" / "moe_shapes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {d.name: d for d in module.write(tmp_path)}


def test_moe_specs_count_all_experts_for_memory_and_the_active_ones_for_compute(tmp_path):
    dirs = _shapes(tmp_path)
    qwen = model_spec_for(str(dirs["qwen3-30b-a3b"]))
    oss = model_spec_for(str(dirs["gpt-oss-20b"]))
    # published sizes: 30.5 B total / 3.3 B active; 21 B total
    assert qwen.total_params == pytest.approx(30.5e9, rel=0.01)
    active = qwen.num_layers * qwen.compute_params_per_block + qwen.embedding_params
    assert active + qwen.head_params == pytest.approx(3.35e9, rel=0.02)
    assert (qwen.num_experts, qwen.experts_per_token) == (128, 8)
    assert oss.total_params == pytest.approx(20.9e9, rel=0.01)
    assert (oss.num_experts, oss.experts_per_token) == (32, 4)
    for spec in (qwen, oss):
        assert spec.compute_params_per_block < spec.params_per_block / 5
        dense = dataclasses.replace(spec, active_params_per_block=0)
        assert block_flops_per_sample(spec, 512) < block_flops_per_sample(dense, 512) / 3
        moe_profile = catalog_profile("l4", spec, 512, "bf16")
        dense_profile = catalog_profile("l4", dense, 512, "bf16")
        assert moe_profile.meta["timing_source"] == "flop-scaled"
        assert moe_profile.units["block"].fwd_s(1) < dense_profile.units["block"].fwd_s(1) / 3


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b"])
def test_plan_moe_directory(tmp_path, capsys, name):
    directory = _shapes(tmp_path)[name]
    args = ["plan", "--cluster", "2xl4,a6000,p40", "--model", str(directory)]
    assert main([*args, "--global-batch", "8", "--dtype", "bf16", "--adapter", "lora"]) == 0
    text = capsys.readouterr().out
    assert "mixture of experts" in text and "Memory counts every expert" in text
    assert "compute counts the active ones" in text
    assert "cephalo:" in text
