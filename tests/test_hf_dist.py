"""Hugging Face models on 3 gloo ranks (one process pool for the module), checked against
plain transformers: every supported family trains like `AutoModelForCausalLM` + AdamW on the
whole global batch; pretrained weights give transformers' loss at the first step, and a
fine-tuned model exports to a directory `from_pretrained` loads with the same logits; loading
a 12-layer model stored in 14 shards costs each rank its own shard plus two units."""

from __future__ import annotations

import pytest
import torch

from cephalo.modeling.hf.families import FAMILIES
from cephalo.modeling.registry import build_model
from cephalo.modeling.units import IGNORE_INDEX
from cephalo.runtime.collectives.comm import make_comm
from cephalo.runtime.engine.engine import Engine, EngineConfig
from cephalo.runtime.state.adamw import AdamWHyper
from dist_harness import dist_pool_fixture
from engine_common import (
    LR,
    TEST_EPS,
    assert_one_read_per_step,
    counted_steps,
    gradient_mutation,
    make_data,
    make_plan,
    one_thread,
    rank_slice,
    transformers_floor,
)
from hf_configs import SEQ, TINY, VOCAB, quiet_transformers, save_tiny_model

__all__ = ["one_thread"]
pool3 = dist_pool_fixture(3, timeout_s=600)
STEPS = 5
UNEVEN = dict(batches=[5, 2, 1], fractions=[0.6, 0.3, 0.1], micro=[2, 1, 1])
CONFIG = EngineConfig(grad_clip=0.5, adamw=AdamWHyper(eps=TEST_EPS, weight_decay=0.1))


def _engine_run(
    directory: str, plan, cfg: EngineConfig, data, export_to: str | None = None, mutate=False
):
    """On every rank: the model directory's pretrained weights, `len(data)` steps; rank 0
    returns the trained parameters under transformers' names (and writes `export_to`).
    `mutate`: under `gradient_mutation` (the bug the comparison must catch)."""
    from cephalo.modeling.hf.export import export_hf_state_dict, save_hf_directory

    torch.set_num_threads(1)
    quiet_transformers()
    comm = make_comm("gloo")
    model = build_model(directory)
    engine = Engine(model, plan, comm, cfg)
    with gradient_mutation(mutate):
        stats = [
            engine.train_step(rank_slice(plan, comm.rank, x), rank_slice(plan, comm.rank, y), lr=LR)
            for x, y in data
        ]
    full = engine.full_state_dict()
    if comm.rank == 0 and export_to is not None:
        save_hf_directory(model, __import__("pathlib").Path(export_to), full)
    return {
        "params": export_hf_state_dict(model, full) if comm.rank == 0 else None,
        "state": full if comm.rank == 0 else None,
        "losses": [s.loss for s in stats],
        "norms": [s.grad_norm for s in stats],
    }


def _transformers_floor(directory: str, data):
    """(plain transformers' noise floor on `data`, the engine config with its clip)."""
    return transformers_floor(directory, data, CONFIG)


def _check(results, floor, label: str) -> None:
    """Rank 0's parameters (transformers' names) and every rank's losses and norms within the
    noise floor of plain transformers."""
    floor.check(label, params={k: results[0]["params"][k] for k in floor.truth.params})
    for r in results:
        floor.check(label, losses=r["losses"], norms=r["norms"])


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_trains_like_transformers(pool3, tmp_path, model_type):
    """3 ranks, batches 5/2/1, micro-batches 2/1/1, state 60/30/10 %: loss, gradient norm
    and parameters of 5 AdamW steps (clipped) equal plain transformers' on the whole batch."""
    directory = str(save_tiny_model(model_type, tmp_path / model_type, seed=3))
    plan = make_plan(**UNEVEN, seq_len=SEQ, model=directory)
    data = make_data(STEPS, plan.global_batch_size, seq_len=SEQ, vocab=VOCAB)
    floor, cfg = _transformers_floor(directory, data)
    results = pool3.run(_engine_run, directory, plan, cfg, data)
    assert any(n > cfg.grad_clip for n in floor.truth.grad_norms), "clipping must be active"
    _check(results, floor, model_type)
    if model_type == "llama":  # the same comparison catches one wrong gradient element
        mutated = pool3.run(_engine_run, directory, plan, cfg, data, None, True)
        with pytest.raises(AssertionError, match="beyond"):
            _check(mutated, floor, "mutated")


def _lm_batches(steps: int, batch: int, seed: int = 5):
    """Language-model batches as the data pipeline makes them (labels = the next token),
    the last position unlabelled so transformers' own shifted loss covers the same tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        y = torch.full_like(x, IGNORE_INDEX)
        y[:, :-1] = x[:, 1:]
        out.append((x, y))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen2", "gemma2", "gemma3_text", "qwen3_moe"])
def test_pretrained_loss_finetune_export_roundtrip(pool3, tmp_path, model_type):
    """bf16 pretrained files: the first step's loss is transformers' own loss on the batch;
    5 fine-tuning steps on 3 ranks; the exported directory (with the tokenizer files) loads
    with from_pretrained and gives the fine-tuned weights' logits."""
    import transformers

    source = save_tiny_model(model_type, tmp_path / "src", seed=4, dtype=torch.bfloat16)
    (source / "tokenizer.json").write_text('{"version": "1.0"}')
    (source / "tokenizer_config.json").write_text("{}")
    plan = make_plan(**UNEVEN, seq_len=SEQ, model=str(source))
    data = _lm_batches(STEPS, plan.global_batch_size)
    out = tmp_path / "export"
    results = pool3.run(_engine_run, str(source), plan, CONFIG, data, str(out))

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    x, _ = data[0]
    first = hf(input_ids=x, labels=x).loss.item()  # transformers shifts the labels itself
    print(
        f"{model_type}: first-step loss cephalo {results[0]['losses'][0]:.7f}, transformers {first:.7f}"
    )
    assert results[0]["losses"][0] == pytest.approx(first, rel=1e-6)

    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    # the checkpoint's logits: cephalo's units holding the fine-tuned state
    units = build_model(str(source), init="random").materialize("cpu", torch.Generator())
    with torch.no_grad():
        for unit, name, p in units.named_unit_parameters():
            p.copy_(results[0]["state"][f"{unit}.{name}"])
    units.eval()
    probe = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        h = units.units[0].module(probe)
        for u in units.units[1:-1]:
            h = u.module(h)
        ours = units.units[-1].module.logits(h)
        theirs = exported(probe).logits
    err = ((theirs - ours).abs().max() / ours.abs().max()).item()
    print(
        f"{model_type}: from_pretrained(export) logits vs the checkpoint's: max relative {err:.2e}"
    )
    assert err <= 1e-5
    assert not torch.allclose(theirs, hf.eval()(probe).logits), "fine-tuning changed the model"


def _load_memory(directory: str, plan) -> dict:
    """Peak live CPU tensor bytes (`LiveTensorBytes`: every storage, the memory-mapped views
    of the safetensors files included) while one rank builds its engine, the pretrained
    weights read unit by unit, against its state (master, grad, 2 moments) + two fp32 units."""
    from cephalo.runtime.live_bytes import LiveTensorBytes

    torch.set_num_threads(1)
    quiet_transformers()
    comm = make_comm("gloo")
    model = build_model(directory)
    unit_bytes = [4 * n for n in model.spec.unit_params()]
    files = len(model.weights.files())
    with LiveTensorBytes() as live:
        engine = Engine(model, plan, comm, EngineConfig())
    return {
        "peak": live.peak,
        "state": engine.state_bytes(),
        "two_units": 2 * max(unit_bytes),
        "model_fp32": sum(unit_bytes),
        "files": files,
    }


@pytest.mark.slow
def test_loading_holds_one_shard_and_two_units(pool3, tmp_path):
    """12 layers in 14 safetensors shards (bf16): no rank ever holds the whole model."""
    directory = save_tiny_model(
        "llama",
        tmp_path / "big",
        dtype=torch.bfloat16,
        num_hidden_layers=12,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=512,
        max_shard_size="80KB",
    )
    plan = make_plan([2, 1, 1], [0.5, 0.3, 0.2], [1, 1, 1], seq_len=SEQ, model=str(directory))
    results = pool3.run(_load_memory, str(directory), plan)
    for rank, r in enumerate(results):
        bound = r["state"] + r["two_units"]
        print(
            f"rank {rank}: peak while loading {r['peak'] / 1e6:.3f} MB; bound (own state {r['state'] / 1e6:.3f} MB + two units {r['two_units'] / 1e6:.3f} MB) "
            f"{bound / 1e6:.3f} MB; whole model fp32 {r['model_fp32'] / 1e6:.3f} MB, "
            f"{r['files']} files"
        )
        assert r["files"] >= 4
        assert r["peak"] <= bound, rank
        assert r["peak"] - r["state"] < r["model_fp32"], rank  # never the whole model


MOE_FAMILIES = sorted(t for t, c in TINY.items() if "router_aux_loss_coef" in c)


def _moe_engine_run(directory: str, plan, cfg: EngineConfig, data):
    torch.set_num_threads(1)
    quiet_transformers()
    comm = make_comm("gloo")
    engine = Engine(build_model(directory), plan, comm, cfg)
    stats, syncs = counted_steps(engine, plan, comm.rank, data)
    return {"losses": [s.loss for s in stats], "aux": [s.aux_loss for s in stats], "syncs": syncs}


def _per_micro_batch_aux(directory: str, x: torch.Tensor, micro: list[int]) -> float:
    """What a per-micro-batch router loss would be: transformers' aux of each micro-batch,
    weighted by its size (the wrong objective the global statistics avoid)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    total, start = 0.0, 0
    with torch.no_grad():
        for m in micro:
            total += hf(input_ids=x[start : start + m]).aux_loss.item() * m
            start += m
    return total / x.shape[0]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", MOE_FAMILIES)
def test_moe_router_loss_over_the_global_batch(pool3, tmp_path, model_type):
    """MoE with output_router_logits and router_aux_loss_coef 0.5: 3 uneven ranks train like
    transformers + AdamW whose loss is transformers' own `outputs.loss` on the whole batch
    (cross-entropy + coef x aux); the reported aux_loss is transformers' `aux_loss`. The
    samples differ, so the per-micro-batch aux (shown to differ) would fail the check."""
    import transformers

    directory = str(save_tiny_model(model_type, tmp_path / model_type, seed=3))
    plan = make_plan(**UNEVEN, seq_len=SEQ, model=directory)
    data = make_data(STEPS, plan.global_batch_size, seq_len=SEQ, vocab=VOCAB)
    floor, cfg = _transformers_floor(directory, data)
    ref_aux = floor.variants[0].aux_losses  # fp32, the whole batch
    # the reference's objective is transformers' own outputs.loss (which shifts its labels)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    x, y = _lm_batches(1, plan.global_batch_size)[0]
    with torch.no_grad():
        own = hf(input_ids=x, labels=x)
        out = hf(input_ids=x)
        ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())
    assert (ce + hf.config.router_aux_loss_coef * out.aux_loss).item() == pytest.approx(
        own.loss.item(), rel=1e-6
    )
    x = data[0][0]
    micro_sizes = [2, 2, 1, 2, 1]  # ranks' micro-batches in global order (5 = 2+2+1, 2, 1)
    wrong = _per_micro_batch_aux(directory, x, micro_sizes)
    results = pool3.run(_engine_run, directory, plan, cfg, data)
    aux = pool3.run(_moe_engine_run, directory, plan, cfg, data)
    print(
        f"{model_type}: aux cephalo {aux[0]['aux'][0]:.7f}, transformers {ref_aux[0]:.7f}, "
        f"per-micro-batch {wrong:.7f}; loss {results[0]['losses'][0]:.7f} vs "
        f"{floor.truth.losses[0]:.7f}"
    )
    assert abs(wrong - ref_aux[0]) > 1e-4 * ref_aux[0]
    for r in aux:
        floor.check(model_type, losses=r["losses"], aux=r["aux"])
    _check(results, floor, model_type)
    # the router statistics stay on the device: after the first step, no host sync but the
    # update's one read (which carries the aux loss)
    assert_one_read_per_step([r["syncs"] for r in aux], f"{model_type} MoE")
