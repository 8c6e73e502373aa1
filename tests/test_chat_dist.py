"""Chat data on 3 uneven gloo ranks (one process pool for the module): one step over a whole
chat file logs plain transformers' loss on each conversation alone, padded and packed, on a
RoPE family (Qwen2), GPT-2 (absolute positions) and a sliding-window family (Mistral); and
5 steps (padded and packed) under an uneven plan train like transformers on the whole
global batch."""

from __future__ import annotations

import math

import pytest
import torch

from cephalo.data.chat_data import DocumentBatches, prepare_chat_dataset
from cephalo.modeling.registry import build_model
from cephalo.runtime.collectives.comm import make_comm
from cephalo.runtime.engine.engine import Engine, EngineConfig
from cephalo.runtime.state.adamw import AdamWHyper
from chat_helpers import conversations, reference_loss, save_chat_tokenizer, write_chat_jsonl
from dist_harness import dist_pool_fixture
from engine_common import LR, TEST_EPS, make_plan, one_thread, transformers_floor
from hf_configs import quiet_transformers, save_tiny_model

__all__ = ["one_thread"]
pool3 = dist_pool_fixture(3, timeout_s=600)
SEQ = 256
CONFIG = EngineConfig(grad_clip=0.5, adamw=AdamWHyper(eps=TEST_EPS, weight_decay=0.1))


def _uneven(batch: int) -> dict:
    """A 3-rank plan for `batch` samples: about 60 / 30 / 10 %, every rank at least one,
    micro-batches of 2 on the first rank (several micro-batches, LGA across them)."""
    b2 = max(1, batch // 10)
    b1 = max(1, (batch * 3) // 10)
    b0 = batch - b1 - b2
    return dict(batches=[b0, b1, b2], fractions=[0.6, 0.3, 0.1], micro=[2, 1, 1])


def _engine_run(directory: str, plan, cfg: EngineConfig, data):
    """On every rank: `len(data)` steps on this rank's slices; rank 0 returns the parameters."""
    from cephalo.modeling.hf.export import export_hf_state_dict

    torch.set_num_threads(1)
    quiet_transformers()
    comm = make_comm("gloo")
    model = build_model(directory)
    engine = Engine(model, plan, comm, cfg)
    start = plan.batch_offsets()[comm.rank]
    size = plan.ranks[comm.rank].batch_size
    stats = []
    for x, y, pos in data:
        part = slice(start, start + size)
        stats.append(engine.train_step(x[part], y[part], LR, None if pos is None else pos[part]))
    full = engine.full_state_dict()
    return {
        "params": export_hf_state_dict(model, full) if comm.rank == 0 else None,
        "losses": [s.loss for s in stats],
        "norms": [s.grad_norm for s in stats],
        "tokens": [s.n_tokens for s in stats],
    }


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    tok = save_chat_tokenizer(root / "tok")
    data = write_chat_jsonl(root / "chat.jsonl", conversations(12))
    return prepare_chat_dataset([data], root / "ds", tok, val_fraction=0.0).path


def _model(model_type: str, root, seed: int = 1) -> str:
    size = {"n_positions": SEQ} if model_type == "gpt2" else {"max_position_embeddings": SEQ}
    return str(save_tiny_model(model_type, root / model_type, seed=seed, vocab_size=320, **size))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen2", "gpt2", "mistral"])
def test_one_step_over_a_chat_file_on_uneven_ranks_is_the_reference_loss(
    pool3, chat_data, tmp_path, model_type
):
    directory = _model(model_type, tmp_path)
    ref = reference_loss(directory, chat_data)
    for packing in (False, True):
        n = DocumentBatches(chat_data, SEQ, 1, packing=packing).num_train_windows
        b = DocumentBatches(chat_data, SEQ, n, packing=packing)
        x, y = b.batch(0)
        plan = make_plan(**_uneven(n), seq_len=SEQ, model=directory)
        results = pool3.run(
            _engine_run, directory, plan, CONFIG, [(x, y, b.rank_positions(0, 0, n))]
        )
        loss = results[0]["losses"][0]
        print(
            f"{model_type} packing={packing}: {n} samples on ranks "
            f"{[r.batch_size for r in plan.ranks]}: loss {loss:.7f} vs {ref:.7f} "
            f"({abs(loss - ref) / ref:.1e})"
        )
        assert results[0]["tokens"][0] == b.meta.stats.loss_tokens
        for r in results:
            assert r["losses"][0] == pytest.approx(ref, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_five_steps_on_uneven_ranks_train_like_transformers(pool3, chat_data, tmp_path, packing):
    """Samples of 128 tokens (padded: long conversations truncated; packed: split), 5 steps
    of 6 samples on ranks 3 / 2 / 1: losses, gradient norms and parameters equal
    transformers' (packed: its own packed-sequence path from the same position ids) on the
    whole global batch."""
    directory = _model("qwen2", tmp_path, seed=4)
    b = DocumentBatches(chat_data, 128, 6, packing=packing, packing_split=packing)
    data = [(*b.batch(t), b.rank_positions(t, 0, 6)) for t in range(5)]
    floor, cfg = transformers_floor(directory, data, CONFIG)
    plan = make_plan(
        batches=[3, 2, 1], fractions=[0.6, 0.3, 0.1], micro=[2, 1, 1], seq_len=128, model=directory
    )
    results = pool3.run(_engine_run, directory, plan, cfg, data)
    label = f"5 steps, packing={packing}"
    floor.check(label, params={k: results[0]["params"][k] for k in floor.truth.params})
    for r in results:
        floor.check(label, losses=r["losses"], norms=r["norms"])
    assert all(math.isfinite(v) for v in floor.truth.losses)
