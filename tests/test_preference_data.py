"""Preference data (issue 42, the data half): TRL's formats in JSON Lines, Parquet and datasets
directories, their rows and labels against the tokenizer's own `apply_chat_template` (what
TRL's DPOTrainer tokenizes), TRL's truncation, plan-invariant pairs, and one message per bad
input with nothing left behind. No process group: the data needs none."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cephalo.data.chat import detect_inputs_format
from cephalo.data.job import open_batches, resolve_job_dataset
from cephalo.errors import CephaloError
from cephalo.modeling.units import IGNORE_INDEX
from cephalo.preference.data import (
    PREFERENCE_META,
    PreferenceBatches,
    is_preference_dataset,
    prepare_preference_dataset,
)
from chat_helpers import CHATML, LLAMA3, save_chat_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return save_chat_tokenizer(tmp_path_factory.mktemp("tok") / "model", CHATML)


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


def _conv_pairs(n: int = 8) -> list[dict]:
    """Conversational pairs of different lengths, some with a system turn and earlier turns."""
    out = []
    for i in range(n):
        prompt = [{"role": "system", "content": "Answer briefly."}] if i % 3 == 0 else []
        if i % 2:
            prompt += [
                {"role": "user", "content": f"first question {i}"},
                {"role": "assistant", "content": "an earlier answer"},
            ]
        prompt.append({"role": "user", "content": f"which plan for batch {i}?"})
        out.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": "the plan " + "shard " * (i % 4)}],
                "rejected": [{"role": "assistant", "content": f"no {i}"}],
            }
        )
    return out


def _std_pairs(n: int = 8) -> list[dict]:
    return [
        {
            "prompt": f"Question {i}: which rank holds the shard?",
            "chosen": " rank " + "one " * (1 + i % 3),
            "rejected": f" none {i}",
        }
        for i in range(n)
    ]


def _write(records: list[dict], path: Path, kind: str = "jsonl") -> Path:
    """The records as JSON Lines, a Parquet file or a datasets directory."""
    if kind == "jsonl":
        path = path.with_suffix(".jsonl")
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = path.with_suffix(".parquet")
        pq.write_table(pa.Table.from_pylist(records), path, row_group_size=3)
    else:
        import datasets

        datasets.Dataset.from_list(records).save_to_disk(str(path))
    return path


def _expected(tok, record: dict) -> tuple[list[int], list[int], list[int]]:
    """(prompt, prompt + chosen, prompt + rejected) ids as TRL's DPOTrainer computes them, with
    transformers' own chat template application (conversational) or tokenizer call (standard,
    the EOS text appended to each completion)."""
    p, c, r = record["prompt"], record["chosen"], record["rejected"]
    if isinstance(p, list):

        def ids(messages, gen=False):
            out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
            return list(out["input_ids"] if hasattr(out, "keys") else out)

        return ids(p, True), ids(p + c), ids(p + r)
    return (
        tok(p)["input_ids"],
        tok(p + c + tok.eos_token)["input_ids"],
        tok(p + r + tok.eos_token)["input_ids"],
    )


def _check_rows(batches, records, tok, step: int = 0, seq_len: int | None = None, mpl=None):
    """Every row and label of step's batch equals the independent computation, cut by TRL's
    rule (prompt to its last `mpl` tokens, then the row to seq_len)."""
    seq_len = seq_len or batches.seq_len
    ids, labels = batches.batch(step)
    pairs = batches.rank_pairs(step, 0, batches.global_batch_size)
    assert ids.shape == labels.shape == (2 * len(pairs), seq_len)
    assert ids.dtype == labels.dtype == torch.int64
    for i, p in enumerate(pairs):
        prompt, *rows = _expected(tok, records[int(p)])
        cut = max(0, len(prompt) - mpl) if mpl else 0
        for r, row in enumerate(rows):
            assert row[: len(prompt)] == prompt  # the prompt's tokens start both rows
            row = row[cut:][:seq_len]
            got = ids[2 * i + r]
            assert got[: len(row)].tolist() == row and not got[len(row) :].any()
            want = [IGNORE_INDEX] * seq_len
            for j in range(len(row) - 1):
                if j + 1 >= len(prompt) - cut:  # token j+1 is a completion token
                    want[j] = row[j + 1]
            assert labels[2 * i + r].tolist() == want


# ----------------------------------------------------------------------------- formats x files
@pytest.mark.parametrize("kind", ["jsonl", "parquet", "datasets"])
def test_conversational_rows_and_labels_equal_the_chat_template(tmp_path, tok_dir, tok, kind):
    records = _conv_pairs(8)
    src = _write(records, tmp_path / "pairs", kind)
    assert detect_inputs_format([src]) == "preference"
    out = prepare_preference_dataset([src], tmp_path / "out", tok_dir, val_fraction=0.25)
    assert is_preference_dataset(out.path) and out.meta.kind == "conversational"
    assert out.meta.stats.pairs == 8 and out.meta.stats.retokenized == 0
    b = PreferenceBatches(out.path, 128, 6)
    assert b.is_preference and b.window == 128 and b.tokens_per_step == 2 * 6 * 128
    assert (b.num_train_windows, b.num_val_windows) == (6, 2)
    assert b.rank_positions(0, 0, 6) is None and b.val_positions(0, 2) is None
    _check_rows(b, records, tok)
    # validation: the last quarter of the pairs, in file order, the same layout
    ids, labels = b.val_batch(0, 2)
    want = [_expected(tok, records[6 + i])[1] for i in range(2)]
    assert ids[0, : len(want[0])].tolist() == want[0]
    assert ids[2, : len(want[1])].tolist() == want[1]
    assert (labels[::2] != IGNORE_INDEX).sum() > 0
    parts = [b.val_batch(0, 2, 0, 1), b.val_batch(0, 2, 1, 1)]  # a rank's slice of it
    assert torch.equal(torch.cat([p[0] for p in parts]), ids)
    assert torch.equal(torch.cat([p[1] for p in parts]), labels)
    assert b.val_pairs(0, 2).tolist() == [0, 1]


def test_standard_and_implicit_prompt_pairs_as_trl(tmp_path, tok_dir, tok):
    records = _std_pairs(6)
    out = prepare_preference_dataset(
        [_write(records, tmp_path / "std")], tmp_path / "std-out", tok_dir, val_fraction=0.0
    )
    assert out.meta.kind == "standard"
    b = PreferenceBatches(out.path, 48, 6)
    _check_rows(b, records, tok)
    # the implicit-prompt forms (TRL's extract_prompt) make the same rows as the explicit ones
    for form, recs in (("std", records), ("conv", _conv_pairs(6))):
        implicit = [
            {"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
            for r in recs
        ]
        a = prepare_preference_dataset(
            [_write(recs, tmp_path / f"{form}-x")], tmp_path / f"{form}-xo", tok_dir, val_fraction=0
        )
        c = prepare_preference_dataset(
            [_write(implicit, tmp_path / f"{form}-i")],
            tmp_path / f"{form}-io",
            tok_dir,
            val_fraction=0,
        )
        ba, bc = PreferenceBatches(a.path, 128, 6), PreferenceBatches(c.path, 128, 6)
        assert torch.equal(ba.batch(0)[0], bc.batch(0)[0])
        assert torch.equal(ba.batch(0)[1], bc.batch(0)[1])


def test_a_template_without_generation_markers(tmp_path):
    from transformers import AutoTokenizer

    directory = save_chat_tokenizer(tmp_path / "llama", LLAMA3)
    records = _conv_pairs(4)
    out = prepare_preference_dataset(
        [_write(records, tmp_path / "p")], tmp_path / "o", directory, val_fraction=0
    )
    _check_rows(
        PreferenceBatches(out.path, 160, 4), records, AutoTokenizer.from_pretrained(directory)
    )


# ----------------------------------------------------------------------------- truncation
def test_truncation_keeps_the_prompts_end_cuts_the_completion_and_drops_full_prompts(
    tmp_path, tok_dir, tok
):
    records = _conv_pairs(8)
    out = prepare_preference_dataset(
        [_write(records, tmp_path / "p")], tmp_path / "o", tok_dir, val_fraction=0
    )
    prompts = [len(_expected(tok, r)[0]) for r in records]
    rows = [max(len(x) for x in _expected(tok, r)[1:]) for r in records]
    # max_prompt_len: the prompt's last tokens; seq_len then cuts the completion
    mpl, seq = min(prompts) - 3, min(prompts) + 2
    b = PreferenceBatches(out.path, seq, 8, max_prompt_len=mpl)
    assert b.train.stats.dropped == 0 and b.train.stats.truncated == 8
    _check_rows(b, records, tok, mpl=mpl)
    # no max_prompt_len: a pair whose prompt fills seq_len is dropped, counted, never read
    seq = sorted(prompts)[3]
    b = PreferenceBatches(out.path, seq, 2)
    dropped = sum(p >= seq for p in prompts)
    assert b.train.stats.dropped == dropped > 0 and b.num_train_windows == 8 - dropped
    assert b.train.stats.truncated == sum(p < seq < r for p, r in zip(prompts, rows, strict=True))
    assert f"{dropped} dropped" in b.describe() and "preference pairs" in b.describe()
    _check_rows(b, records, tok)
    assert {int(p) for p in b.rank_pairs(0, 0, 2)} <= {i for i, p in enumerate(prompts) if p < seq}
    # every pair dropped: one message
    with pytest.raises(CephaloError, match="all 8 training pairs have a prompt of seq_len"):
        PreferenceBatches(out.path, min(prompts), 1)
    with pytest.raises(CephaloError, match="max_prompt_len must be a positive integer"):
        PreferenceBatches(out.path, 64, 1, max_prompt_len=0)


# ----------------------------------------------------------------------------- plan invariance
def test_rank_slices_of_any_split_concatenate_to_the_global_batch(tmp_path, tok_dir):
    out = prepare_preference_dataset(
        [_write(_conv_pairs(12), tmp_path / "p")], tmp_path / "o", tok_dir, val_fraction=0
    )
    b = PreferenceBatches(out.path, 128, 6, seed=3)
    for step in (0, 1, 2, 5):  # across epochs (2 steps each)
        ids, labels = b.batch(step)
        for split in ([6], [1, 2, 3], [0, 4, 2], [3, 0, 0, 3]):
            offsets = np.cumsum([0, *split[:-1]])
            parts = [b.rank_slice(step, int(o), s) for o, s in zip(offsets, split, strict=True)]
            assert torch.equal(torch.cat([p[0] for p in parts]), ids)
            assert torch.equal(torch.cat([p[1] for p in parts]), labels)
        # an epoch visits every pair once
    seen = np.concatenate([b.rank_pairs(s, 0, 6) for s in (0, 1)])
    assert sorted(seen.tolist()) == list(range(12))
    # the same step, another batch object (a resumed run): the same pairs
    assert torch.equal(PreferenceBatches(out.path, 128, 6, seed=3).batch(5)[0], b.batch(5)[0])
    with pytest.raises(CephaloError, match="outside the global batch"):
        b.rank_slice(0, 4, 3)


# ----------------------------------------------------------------------------- bad input
_SYS = [{"role": "user", "content": "q"}]
_A = [{"role": "assistant", "content": "a"}]
BAD = {
    "empty chosen string": (
        {"prompt": "q", "chosen": "  ", "rejected": "b"},
        "'chosen' is an empty completion",
    ),
    "empty rejected list": (
        {"prompt": _SYS, "chosen": _A, "rejected": []},
        "'rejected' is an empty completion",
    ),
    "empty content": (
        {"prompt": _SYS, "chosen": [{"role": "assistant", "content": ""}], "rejected": _A},
        "'chosen' is an empty completion",
    ),
    "missing rejected": ({"prompt": "q", "chosen": "a"}, "the record has no 'rejected'"),
    "mixed record": ({"prompt": "q", "chosen": _A, "rejected": _A}, "mixes formats"),
    "not a string": ({"prompt": "q", "chosen": 3, "rejected": "b"}, "holds a int"),
    "implicit, different first turns": (
        {"chosen": _SYS + _A, "rejected": [{"role": "user", "content": "other"}] + _A},
        "different prompts",
    ),
    "implicit, parting at a user turn": (
        {
            "chosen": _SYS + _A + _SYS + _A,
            "rejected": _SYS + _A + [{"role": "user", "content": "x"}] + _A,
        },
        "different prompts: they part at turn 3, a user turn",
    ),
    "implicit, identical": ({"chosen": _SYS + _A, "rejected": _SYS + _A}, "empty completion"),
    "bad role": (
        {"prompt": _SYS, "chosen": [{"role": "robot", "content": "a"}], "rejected": _A},
        "unknown role 'robot'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_records_are_one_message_and_leave_nothing(tmp_path, tok_dir, case):
    record, message = BAD[case]
    good = _conv_pairs(3) if isinstance(record.get("chosen"), list) else _std_pairs(3)
    src = _write([*good, record], tmp_path / "p")
    out = tmp_path / "o"
    prepare_preference_dataset([_write(good, tmp_path / "g")], out, tok_dir)  # a dataset there
    with pytest.raises(CephaloError, match=message) as e:
        prepare_preference_dataset([src], out, tok_dir)
    assert f"{src}, line 4" in str(e.value)
    assert not is_preference_dataset(out)
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == [".prepare.lock"]


def test_mixed_kinds_files_and_templates_are_refused(tmp_path, tok_dir):
    # a file whose records change kind
    src = _write([*_conv_pairs(2), *_std_pairs(1)], tmp_path / "mixed")
    with pytest.raises(CephaloError, match=r"line 3: a standard record, but .*line 1 was conv"):
        prepare_preference_dataset([src], tmp_path / "o", tok_dir)
    # files of different formats
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": _SYS + _A}) + "\n")
    with pytest.raises(CephaloError, match="the inputs mix formats"):
        prepare_preference_dataset(
            [_write(_std_pairs(2), tmp_path / "s"), chat], tmp_path / "o", tok_dir
        )
    with pytest.raises(CephaloError, match="holds chat records, not preference pairs"):
        prepare_preference_dataset([chat], tmp_path / "o", tok_dir)
    # pairs given as text (data.format = text): said what they are
    from cephalo.data.corpus import Corpus
    from cephalo.data.text import prepare_dataset

    with pytest.raises(CephaloError, match=r"s\.jsonl, line 1: .*a preference pair.*format"):
        prepare_dataset(Corpus.from_paths([tmp_path / "s.jsonl"]), tmp_path / "t", tokenizer="byte")
    # a template whose prompt render is not a prefix of the whole exchange
    odd = CHATML.replace("'<|im_start|>assistant\n'", "'<|im_start|>model\n'")
    assert odd != CHATML
    with pytest.raises(CephaloError, match="line 1: the chat template renders the prompt"):
        prepare_preference_dataset(
            [_write(_conv_pairs(2), tmp_path / "c")], tmp_path / "o", tok_dir, chat_template=odd
        )


# ----------------------------------------------------------------------------- job, CLI, example
def test_a_job_prepares_once_and_opens_preference_batches(tmp_path, tok_dir):
    src = _write(_conv_pairs(10), tmp_path / "pairs")
    kw = dict(cache_dir=tmp_path / "cache", val_fraction=0.2, model_name=str(tok_dir))
    path = resolve_job_dataset(src, "auto", 320, **kw)
    assert is_preference_dataset(path) and path.parent == tmp_path / "cache"
    meta = (path / PREFERENCE_META).stat().st_mtime_ns
    assert resolve_job_dataset(src, "auto", 320, **kw) == path  # reused, not rewritten
    assert (path / PREFERENCE_META).stat().st_mtime_ns == meta
    assert resolve_job_dataset(path, "auto", 320, **kw) == path  # a prepared one as it is
    b = open_batches(path, 128, 4, max_prompt_len=32)
    assert isinstance(b, PreferenceBatches) and b.max_prompt_len == 32
    with pytest.raises(CephaloError, match="holds preference pairs"):
        open_batches(path, 128, 4, packing=True)
    with pytest.raises(CephaloError, match="smaller train.global_batch_size"):
        open_batches(path, 128, 9)
    with pytest.raises(CephaloError, match="loss_on = assistant does not apply to preference"):
        resolve_job_dataset(src, "auto", 320, loss_on="assistant", **kw)
    with pytest.raises(CephaloError, match="has only 100 embedding rows"):
        prepare_preference_dataset([src], tmp_path / "small", tok_dir, max_vocab_size=100)


def test_prepare_data_cli_and_the_example_config(tmp_path, tok_dir, capsys):
    from cephalo.cli import main
    from cephalo.train.config_manager import load_config

    src = _write(_std_pairs(6), tmp_path / "pairs")
    out = tmp_path / "data"
    argv = ["prepare-data", "--input", str(src), "--output", str(out), "--tokenizer", str(tok_dir)]
    assert main([*argv, "--seq-len", "20", "--max-prompt-len", "8"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "6 standard preference pairs" in text and "seq_len 20, train: 6 pairs" in text
    assert main(argv) == 0 and "up to date" in capsys.readouterr().out
    # configs/dpo.toml without the objective's keys (the other half of issue 42): its [data]
    lines = (ROOT / "configs" / "dpo.toml").read_text().splitlines()
    keep = [x for x in lines if not x.split("=")[0].strip().startswith(("objective", "dpo_"))]
    (tmp_path / "dpo.toml").write_text("\n".join(keep) + "\n")
    cfg = load_config(tmp_path / "dpo.toml")
    assert cfg.data.format == "preference" and cfg.data.max_prompt_len is not None
    assert cfg.model.adapter == "lora" and len(cfg.parallel.devices.split(",")) == 3


def test_the_example_prefers_the_real_answer(tmp_path):
    from cephalo.preference.example import UNHELPFUL, write_preference_example

    example = write_preference_example(tmp_path / "ex", pairs=40)
    records = [json.loads(x) for x in example.jsonl.read_text().splitlines()]
    assert len(records) == 40 and not (tmp_path / "ex" / "chat.jsonl").exists()
    for r in records:
        assert r["prompt"][-1]["role"] == "user"
        assert r["chosen"][0]["content"] != r["rejected"][0]["content"]
    assert 5 < sum(r["rejected"][0]["content"] in UNHELPFUL for r in records) < 35
    out = prepare_preference_dataset([example.jsonl], tmp_path / "o", example.model)
    b = PreferenceBatches(out.path, 256, 4, max_prompt_len=192)
    assert b.num_train_windows + b.num_val_windows == 40 and b.train.stats.dropped == 0
