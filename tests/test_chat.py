"""Chat data: loss masks from the chat template, bad input, the samples a chat dataset makes
(padded and packed), and one process's loss on them against plain transformers.

Tokenizers are trained in-process (`chat_helpers.save_chat_tokenizer`); the templates are
written for the tests: ChatML with `{% generation %}` markers, a Llama-3-style one without,
a Gemma-style one with no system role."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cephalo.data.chat import ChatRenderer, Record
from cephalo.data.chat_data import DocumentBatches, prepare_chat_dataset
from cephalo.data.job import open_batches
from cephalo.data.packing import best_fit_decreasing, piece_bounds
from cephalo.errors import CephaloError
from cephalo.modeling.units import IGNORE_INDEX
from chat_helpers import (
    CHATML,
    END_OF_TURN,
    GEMMA,
    LLAMA3,
    TEMPLATES,
    conversations,
    reference_loss,
    save_chat_tokenizer,
    write_chat_jsonl,
)
from engine_common import one_thread
from hf_configs import quiet_transformers, save_tiny_model

__all__ = ["one_thread"]
SEQ = 256  # longer than every test conversation: nothing truncated


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return save_chat_tokenizer(tmp_path_factory.mktemp("tok") / "chat-tok")


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer

    quiet_transformers()
    return AutoTokenizer.from_pretrained(str(tok_dir))


def _encode(tok, template, record, fmt="chat", loss_on="auto"):
    ((ids, mask),) = ChatRenderer(tok, template, fmt, loss_on).encode([Record("r", record, 0)])
    return ids, mask


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.diff(np.concatenate([[0], mask.astype(int), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True))


# ----------------------------------------------------------------------------- masks
def test_chatml_masks_equal_transformers_assistant_tokens_mask(tok):
    """With `{% generation %}` markers, the masks are transformers' own
    `return_assistant_tokens_mask`, token for token, for multi-turn conversations."""
    for record in conversations(9):
        ids, mask = _encode(tok, CHATML, record)
        ref = tok.apply_chat_template(
            record["messages"],
            chat_template=CHATML,
            return_assistant_tokens_mask=True,
            return_dict=True,
        )
        assert ids.tolist() == ref["input_ids"]
        assert mask.astype(int).tolist() == ref["assistant_masks"]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_every_assistant_turn_and_its_end_of_turn_are_the_loss_tokens(tok, name):
    """Each assistant turn is one run of loss tokens: its content and the end-of-turn token
    (and the newline the template puts after it); nothing else is."""
    suffix = {"chatml": "\n", "llama3": "", "gemma": "\n"}[name]
    for record in conversations(9, system=name != "gemma"):
        ids, mask = _encode(tok, TEMPLATES[name], record)
        turns = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        runs = _runs(mask)
        assert len(runs) == len(turns) > 0
        for (a, b), content in zip(runs, turns, strict=True):
            assert tok.decode(ids[a:b].tolist()) == content + END_OF_TURN[name] + suffix
        assert int(mask.sum()) == sum(b - a for a, b in runs)


def test_tool_turns_and_text_parts(tok):
    """A tool call (no content) and the tool's answer: both assistant turns are loss tokens,
    the tool's turn is not; content given as text parts is joined."""
    call = {"name": "add", "arguments": {"a": 2, "b": 3}}
    record = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "2+3"}, {"text": "?"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"function": call}]},
            {"role": "tool", "content": "5"},
            {"role": "assistant", "content": "It is 5."},
        ]
    }
    ids, mask = _encode(tok, CHATML, record)
    text = tok.decode(ids.tolist())
    assert "<|im_start|>user\n2+3?<|im_end|>" in text
    assert [tok.decode(ids[a:b].tolist()) for a, b in _runs(mask)] == [
        "<|im_end|>\n",
        "It is 5.<|im_end|>\n",
    ]


def test_loss_on_all_and_prompt_completion(tok):
    record = conversations(1)[0]
    ids, mask = _encode(tok, CHATML, record, loss_on="all")
    assert mask.all()
    # prompt-completion, strings: the completion and an EOS
    pc = {"prompt": "Q: two plus two?", "completion": " A: four."}
    ids, mask = _encode(tok, CHATML, pc, fmt="prompt_completion")
    assert ids[-1] == tok.eos_token_id
    assert tok.decode(ids[mask].tolist()) == " A: four." + tok.eos_token
    # prompt-completion, messages: what follows the prompt and its generation prompt
    msgs = record["messages"]
    pc = {"prompt": msgs[:-1], "completion": msgs[-1:]}
    ids, mask = _encode(tok, CHATML, pc, fmt="prompt_completion")
    assert tok.decode(ids[mask].tolist()) == msgs[-1]["content"] + "<|im_end|>\n"
    with pytest.raises(CephaloError, match="loss_on = completion is for prompt-completion"):
        _encode(tok, CHATML, record, loss_on="completion")


def test_a_template_whose_partial_renders_are_not_prefixes_is_refused_naming_the_turn(tok):
    # renders an earlier assistant turn differently once later turns follow it
    record = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "ok"},
            {"role": "assistant", "content": "fine"},
        ]
    }
    odd = CHATML.replace(
        "{% generation %}{{ m['content']",
        "{% generation %}{{ ('' if loop.last else '[old] ') + m['content']",
    )
    with pytest.raises(CephaloError, match=r"r: .*turn 2 \(assistant\)"):
        _encode(tok, odd, record)


# ----------------------------------------------------------------------------- bad input
BAD = {
    "no messages": ({"text": "hello"}, "has no 'messages' field"),
    "unknown role": (
        {"messages": [{"role": "wizard", "content": "hi"}]},
        "unknown role 'wizard'",
    ),
    "content not a string": (
        {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},
        "content of type int",
    ),
    "empty conversation": ({"messages": []}, "empty conversation"),
    "no assistant turn": (
        {"messages": [{"role": "user", "content": "hi"}]},
        "no assistant turn",
    ),
    "template raises": (
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
        "the chat template raised .*System role not supported",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_records_are_one_message_with_file_and_line(tmp_path, tok_dir, case):
    record, message = BAD[case]
    good = conversations(2, system=False)
    data = write_chat_jsonl(tmp_path / "chat.jsonl", [*good, record])
    template = GEMMA if case == "template raises" else None
    out = tmp_path / "out"
    with pytest.raises(CephaloError, match=rf"chat\.jsonl, line 3: .*{message}"):
        prepare_chat_dataset([data], out, tok_dir, fmt="chat", chat_template=template)
    assert [p.name for p in out.iterdir()] == [".prepare.lock"]  # nothing half-written


def test_a_chat_file_given_as_text_and_a_tokenizer_without_template(tmp_path, tok_dir):
    from cephalo.data.corpus import Corpus
    from cephalo.data.text import prepare_dataset

    data = write_chat_jsonl(tmp_path / "chat.jsonl", conversations(2))
    with pytest.raises(CephaloError, match=r"chat\.jsonl, line 1: .*conversation.*data\.format"):
        prepare_dataset(Corpus.from_paths([data]), tmp_path / "t", tokenizer="byte")
    bare = save_chat_tokenizer(tmp_path / "bare", template=None)
    with pytest.raises(CephaloError, match="no chat template.*data.chat_template"):
        prepare_chat_dataset([data], tmp_path / "o", bare)
    # a template given as a file works for it
    (tmp_path / "t.jinja").write_text(LLAMA3)
    done = prepare_chat_dataset(
        [data], tmp_path / "o", bare, chat_template=str(tmp_path / "t.jinja")
    )
    assert done.meta.stats.documents == 2


# ----------------------------------------------------------------------------- samples
def test_best_fit_decreasing():
    lengths = [5, 9, 3, 7, 2, 4, 10, 1]
    windows = best_fit_decreasing(lengths, 10)
    assert sorted(i for w in windows for i in w) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in w) <= 10 for w in windows)
    assert len(windows) == 5  # 41 tokens: at least 5 windows of 10
    assert windows[0] == [6]  # the longest first, alone (full)
    docs, starts, long = piece_bounds(np.array([3, 25, 10]), 10, split=True)
    assert docs.tolist() == [0, 1, 1, 1, 2] and starts.tolist() == [0, 0, 10, 20, 0] and long == 1


def _prepared(tmp_path, tok_dir, n=12, **kw) -> Path:
    data = write_chat_jsonl(tmp_path / "chat.jsonl", conversations(n))
    return prepare_chat_dataset([data], tmp_path / "ds", tok_dir, val_fraction=0.0, **kw).path


@pytest.mark.parametrize("packing", [False, True])
def test_samples_keep_labels_inside_documents(tmp_path, tok_dir, packing):
    """Labels are the next token of the same document where it is a loss token; padding and
    every document boundary carry none; packed positions restart at 0 per document."""
    path = _prepared(tmp_path, tok_dir)
    b = DocumentBatches(path, SEQ, 1, packing=packing)
    n = b.num_train_windows
    x, y = b.rank_slice(0, 0, 1)
    assert x.shape == y.shape == (1, SEQ)
    b = DocumentBatches(path, SEQ, n, packing=packing)
    x, y = b.batch(0)
    pos = b.rank_positions(0, 0, n)
    meta = b.meta.stats
    assert int((y != IGNORE_INDEX).sum()) == meta.loss_tokens == b.train.stats.loss_tokens
    if not packing:
        assert pos is None and n == meta.documents
        return
    assert n < meta.documents  # several conversations per window
    starts = pos == 0
    # the label before each document start (a boundary), and at the end of each row, is masked
    before_start = torch.zeros_like(starts)
    before_start[:, :-1] = starts[:, 1:]
    assert (y[before_start] == IGNORE_INDEX).all()
    assert (y[:, -1] == IGNORE_INDEX).all()
    for row in range(n):  # each label is the next input of its own document
        keep = (y[row, :-1] != IGNORE_INDEX) & ~before_start[row, :-1]
        assert torch.equal(y[row, :-1][keep], x[row, 1:][keep])
    # a window's documents are whole: positions count up by one inside each
    diffs = pos[:, 1:] - pos[:, :-1]
    assert ((diffs == 1) | (pos[:, 1:] == 0)).all()


def test_truncation_split_drop_and_statistics(tmp_path, tok_dir):
    path = _prepared(tmp_path, tok_dir)
    full = DocumentBatches(path, SEQ, 1)
    lengths = np.diff(np.fromfile(path / "train.docs.bin", np.int64))
    short = int(np.median(lengths))
    b = DocumentBatches(path, short, 1)
    assert b.train.stats.truncated == int((lengths > short).sum()) > 0
    assert b.train.stats.loss_tokens < full.train.stats.loss_tokens
    split = DocumentBatches(path, short, 1, packing=True, packing_split=True)
    assert split.train.stats.split == b.train.stats.truncated and split.train.stats.truncated == 0
    # a window too short for any assistant token: every sample dropped, one clear error
    with pytest.raises(CephaloError, match="0 training samples"):
        DocumentBatches(path, 4, 1)
    assert 0 < full.train.stats.padding_fraction < 1
    packed = DocumentBatches(path, SEQ, 1, packing=True)
    assert packed.train.stats.padding_fraction < full.train.stats.padding_fraction
    assert "packed windows" in packed.describe()


def test_rerun_is_cached_and_text_datasets_refuse_packing(tmp_path, tok_dir):
    path = _prepared(tmp_path, tok_dir)
    data = tmp_path / "chat.jsonl"
    again = prepare_chat_dataset([data], path, tok_dir, val_fraction=0.0)
    assert again.cached
    other = prepare_chat_dataset([data], path, tok_dir, val_fraction=0.0, loss_on="all")
    assert not other.cached and other.meta.stats.loss_tokens > again.meta.stats.loss_tokens
    from cephalo.data.text import prepare_default_corpus

    text = prepare_default_corpus(tmp_path / "text", 256).path
    with pytest.raises(CephaloError, match="data.packing = false"):
        open_batches(text, 16, 2, packing=True)


def test_parquet_and_datasets_directories(tmp_path, tok_dir):
    datasets = pytest.importorskip("datasets")
    records = conversations(6)
    jsonl = prepare_chat_dataset(
        [write_chat_jsonl(tmp_path / "c.jsonl", records)], tmp_path / "a", tok_dir
    )
    ds = datasets.Dataset.from_list(records)
    ds.to_parquet(str(tmp_path / "c.parquet"))
    ds.save_to_disk(str(tmp_path / "dsdir"))
    for source in (tmp_path / "c.parquet", tmp_path / "dsdir"):
        got = prepare_chat_dataset([source], tmp_path / source.stem, tok_dir)
        assert got.meta.format == "chat"
        assert got.meta.stats == jsonl.meta.stats
        for name in ("train.bin", "train.mask.bin", "train.docs.bin"):
            assert (tmp_path / source.stem / name).read_bytes() == (
                tmp_path / "a" / name
            ).read_bytes()


# ----------------------------------------------------------------------------- one process
@pytest.mark.parametrize("model_type", ["qwen2", "gpt2", "mistral", "gemma2"])
def test_padded_and_packed_losses_equal_transformers_per_conversation(
    tmp_path, tok_dir, model_type
):
    """The whole file as one batch: padded, and packed with per-document positions, the loss
    is plain transformers' on each conversation alone (1e-5 relative). Without the positions
    the packed loss is not (documents would see each other / continue positions)."""
    from cephalo.modeling.registry import build_model

    path = _prepared(tmp_path, tok_dir)
    size = {"n_positions": SEQ} if model_type == "gpt2" else {"max_position_embeddings": SEQ}
    directory = save_tiny_model(model_type, tmp_path / model_type, seed=1, vocab_size=320, **size)
    ref = reference_loss(directory, path)
    model = build_model(str(directory)).materialize("cpu", torch.Generator().manual_seed(0)).eval()
    for packing in (False, True):
        n = DocumentBatches(path, SEQ, 1, packing=packing).num_train_windows
        b = DocumentBatches(path, SEQ, n, packing=packing)
        x, y = b.batch(0)
        with torch.no_grad():
            loss = float(model(x, y, b.rank_positions(0, 0, n)))
        print(
            f"{model_type} packing={packing}: {loss:.7f} vs {ref:.7f} ({abs(loss - ref) / ref:.1e})"
        )
        assert loss == pytest.approx(ref, rel=1e-5)
        if packing:  # the control: without its positions, a packed row is one sequence
            pos = b.rank_positions(0, 0, n)
            assert (_hidden(model, x, pos) - _hidden(model, x, None)).abs().max() > 1e-3


def _hidden(model, x: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
    kw = {} if pos is None else {"position_ids": pos}
    with torch.no_grad():
        h = model.units[0].module(x, **kw)
        for u in model.units[1:-1]:
            h = u.module(h, **kw)
    return h


def test_the_builtin_gpt_refuses_packed_samples():
    from cephalo.modeling.registry import build_model

    model = build_model("gpt-tiny").materialize("cpu", torch.Generator().manual_seed(0))
    x = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(CephaloError, match="cannot train on packed samples"):
        model(x, x, torch.arange(8)[None])


# ----------------------------------------------------------------------------- a job
def test_a_job_trains_on_chat_jsonl_packed(tmp_path, tok_dir, monkeypatch):
    """`cephalo prepare-data` on a chat file (statistics printed), then a 2-step job on the
    raw file with packing: the conversations are rendered into the cache once and trained."""
    from cephalo.cli import main as cli_main
    from cephalo.train.config_manager import load_config
    from cephalo.train.trainer import train

    monkeypatch.setenv("CEPHALO_CACHE", str(tmp_path / "cache"))
    model_dir = save_tiny_model(
        "qwen2", tmp_path / "model", seed=2, vocab_size=320, max_position_embeddings=256
    )
    for f in (tok_dir).iterdir():
        if f.name != "config.json":
            (model_dir / f.name).write_bytes(f.read_bytes())
    data = write_chat_jsonl(tmp_path / "chat.jsonl", conversations(24))
    assert (
        cli_main(
            [
                "prepare-data",
                "--input",
                str(data),
                "--output",
                str(tmp_path / "ds"),
                "--tokenizer",
                str(model_dir),
                "--seq-len",
                "128",
            ]
        )
        == 0
    )
    cfg = load_config(
        None,
        [
            f"--model.name={model_dir}",
            f"--data.path={data}",
            "--data.seq_len=128",
            "--data.packing=true",
            "--data.val_fraction=0.1",
            f"--logging.dir={tmp_path / 'run'}",
            "--logging.progress=false",
            "--train.steps=2",
            "--train.warmup_steps=1",
            "--train.global_batch_size=2",
            "--train.eval_every=2",
            "--train.eval_batches=1",
            "--parallel.plan=even",
        ],
    )
    result = train(cfg)
    assert len(result.losses) == 2 and all(np.isfinite(list(result.losses.values())))
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert any("loss" in json.loads(line) for line in lines)


def test_prompt_completion_files_are_detected_and_mixed_formats_refused(tmp_path, tok_dir, tok):
    strings = write_chat_jsonl(
        tmp_path / "pc.jsonl", [{"prompt": "Q: one plus one?", "completion": " two."}] * 3
    )
    done = prepare_chat_dataset([strings], tmp_path / "pc", tok_dir, val_fraction=0.0)
    assert done.meta.format == "prompt_completion" and done.meta.loss_on == "completion"
    mask = np.fromfile(tmp_path / "pc" / "train.mask.bin", np.uint8)
    ids = np.fromfile(tmp_path / "pc" / "train.bin", np.uint16)
    first = np.fromfile(tmp_path / "pc" / "train.docs.bin", np.int64)[1]
    assert tok.decode(ids[:first][mask[:first] == 1].tolist()) == " two." + tok.eos_token
    chat = write_chat_jsonl(tmp_path / "c.jsonl", conversations(3))
    with pytest.raises(CephaloError, match="the inputs mix formats"):
        prepare_chat_dataset([strings, chat], tmp_path / "mixed", tok_dir)


def test_engine_on_one_rank_with_more_micro_batches_than_cached_masks(tmp_path, tok_dir):
    """Packed windows one per micro-batch (more micro-batches than `LayerInputs` keeps
    masks for): the engine's loss is still transformers' per conversation."""
    from cephalo.modeling.hf.model import LayerInputs
    from cephalo.modeling.registry import build_model
    from cephalo.planner.makers import manual_plan
    from cephalo.runtime.collectives.comm import LocalComm
    from cephalo.runtime.engine.engine import Engine, EngineConfig

    path = _prepared(tmp_path, tok_dir)
    directory = save_tiny_model(
        "qwen2", tmp_path / "m", seed=1, vocab_size=320, max_position_embeddings=SEQ
    )
    n = DocumentBatches(path, SEQ, 1, packing=True).num_train_windows
    assert n > LayerInputs.MAX_CACHED_PACKED
    b = DocumentBatches(path, SEQ, n, packing=True)
    plan = manual_plan(str(directory), SEQ, [n], [1], [1.0])
    engine = Engine(build_model(str(directory)), plan, LocalComm(), EngineConfig())
    x, y = b.batch(0)
    loss = engine.eval_loss(x, y, position_ids=b.rank_positions(0, 0, n))
    assert loss == pytest.approx(reference_loss(directory, path), rel=1e-5)
    stats = engine.train_step(x, y, 1e-3, position_ids=b.rank_positions(0, 0, n))
    assert (
        stats.loss == pytest.approx(loss, rel=1e-5) and stats.n_tokens == b.meta.stats.loss_tokens
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_packed_loss_on_cuda_equals_transformers_per_conversation(tmp_path, tok_dir):
    """The packed path on a GPU (SDPA's CUDA kernels with transformers' block-diagonal
    masks), fp32: the same loss as plain transformers on each conversation alone."""
    from cephalo.modeling.registry import build_model

    path = _prepared(tmp_path, tok_dir)
    directory = save_tiny_model(
        "mistral", tmp_path / "m", seed=1, vocab_size=320, max_position_embeddings=SEQ
    )
    ref = reference_loss(directory, path)
    model = build_model(str(directory)).materialize("cuda", torch.Generator().manual_seed(0))
    n = DocumentBatches(path, SEQ, 1, packing=True).num_train_windows
    b = DocumentBatches(path, SEQ, n, packing=True)
    x, y = b.batch(0)
    with torch.no_grad():
        loss = float(model.eval()(x.cuda(), y.cuda(), b.rank_positions(0, 0, n).cuda()))
    assert loss == pytest.approx(ref, rel=1e-5)
