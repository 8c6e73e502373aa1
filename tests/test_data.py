"""Data: tokenizers, token files, `cephalo prepare-data`, plan-invariant global batches."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from cephalo import CephaloError
from cephalo.cli import main as cli_main
from cephalo.data.batches import GlobalBatches
from cephalo.data.text import (
    Document,
    default_corpus,
    prepare_dataset,
    prepare_default_corpus,
    resolve_dataset,
)
from cephalo.data.token_files import TokenFile, TokenFileMeta
from cephalo.data.tokenizer import BPETokenizer, ByteTokenizer, load_or_train_tokenizer, train_bpe

TRICKY_TEXT = "héllo  wörld\n\n\tindented\r\nx = 日本語 🙂  trailing   \n"


def write_token_file(path, tokens, vocab_size, dtype="uint16"):
    """A bare token file (no val split): tokens 0..n-1 make every window recognisable."""
    np.asarray(tokens, dtype=dtype).tofile(path.with_suffix(".bin"))
    meta = TokenFileMeta(dtype, len(tokens), vocab_size, "byte", "test")
    path.with_suffix(".json").write_text(meta.to_json())
    return path.with_suffix(".bin")


@pytest.fixture(scope="module")
def counting_file(tmp_path_factory):
    """10_000 tokens whose value is their position (mod 60_000): windows are traceable."""
    path = tmp_path_factory.mktemp("tok") / "count.bin"
    return write_token_file(path, np.arange(10_000) % 60_000, 60_000)


@pytest.fixture(scope="module")
def pydoc512(tmp_path_factory):
    return prepare_default_corpus(tmp_path_factory.mktemp("pydoc") / "p512", vocab_size=512)


# ------------------------------------------------------------------ tokenizers
def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode(TRICKY_TEXT)
    assert max(ids) < 256 and tok.vocab_size == 256
    assert tok.decode(ids) == TRICKY_TEXT


def test_bpe_round_trip_and_vocab():
    texts = [d.text for d in default_corpus()[:20]]
    tok = train_bpe(texts, 400)
    assert tok.vocab_size == 400
    for text in [TRICKY_TEXT, texts[3], "\x00\x01 bytes unseen in training: \u0394\u03b1"]:
        ids = tok.encode(text)
        assert all(0 <= i < 400 for i in ids)
        assert tok.decode(ids) == text
    # merges compress: fewer ids than bytes on in-domain text
    assert len(tok.encode(texts[3])) < 0.8 * len(texts[3].encode())


def test_bpe_rejects_bad_vocab():
    with pytest.raises(CephaloError, match="byte tokenizer"):
        train_bpe(["abc"], 256)


_TRAIN_SNIPPET = """
import hashlib, sys
from cephalo.data.text import default_corpus
from cephalo.data.tokenizer import train_bpe
tok = train_bpe([d.text for d in default_corpus()], 700, serial=sys.argv[1] == "serial")
print(hashlib.sha256(tok.tokenizer.to_str().encode()).hexdigest())
"""


def test_bpe_deterministic_across_processes():
    """Same corpus + vocab -> byte-identical tokenizer: fresh processes, serial or threaded."""
    digests = set()
    for mode, threads in (("serial", "1"), ("threaded", "2"), ("threaded", "4")):
        out = subprocess.run(
            [sys.executable, "-c", _TRAIN_SNIPPET, mode],
            capture_output=True,
            text=True,
            env={**os.environ, "RAYON_NUM_THREADS": threads},
            check=True,
        )
        digests.add(out.stdout.strip())
    in_process = train_bpe([d.text for d in default_corpus()], 700)
    digests.add(hashlib.sha256(in_process.tokenizer.to_str().encode()).hexdigest())
    assert len(digests) == 1


def test_load_or_train_reuses_and_retrains(tmp_path):
    path = tmp_path / "tok.json"
    texts = [d.text for d in default_corpus()[:10]]
    first = load_or_train_tokenizer(texts, 300, path)
    assert path.is_file()
    mtime = path.stat().st_mtime_ns
    again = load_or_train_tokenizer(["unrelated text"], 300, path)  # reused, not retrained
    assert path.stat().st_mtime_ns == mtime
    assert again.encode(texts[0]) == first.encode(texts[0])
    bigger = load_or_train_tokenizer(texts, 350, path)  # other size -> retrained
    assert bigger.vocab_size == 350
    assert isinstance(load_or_train_tokenizer(texts, 256, None), ByteTokenizer)


def test_bad_tokenizer_file(tmp_path):
    with pytest.raises(CephaloError, match="does not exist"):
        BPETokenizer.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CephaloError, match="not a tokenizer JSON"):
        BPETokenizer.load(bad)


# ------------------------------------------------------------------ preparation
def test_default_corpus_prepared_and_cached(tmp_path, pydoc512):
    assert pydoc512.train.num_tokens > 150_000 and pydoc512.val.num_tokens > 5_000
    assert pydoc512.train.vocab_size == 512 and pydoc512.train.dtype == "uint16"
    train = TokenFile(pydoc512.path, "train")
    assert int(train.tokens.max()) < 512
    # the tokens decode back to the corpus text (joined by blank lines)
    text = train.tokenizer().decode(train.tokens[:2000])
    first = default_corpus()[0].text
    assert text.startswith(first.rstrip("\n")[:500])
    again = prepare_default_corpus(pydoc512.path, vocab_size=512)
    assert again.cached and again.seconds < 0.5
    assert again.train == pydoc512.train


def test_prepare_data_cli(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 300)
    (corpus / "sub" / "b.md").write_text("# Title\n\nSome *markdown* text, ünïcode.\n" * 200)
    (corpus / "ignored.bin").write_bytes(b"\xff\xfe binary")
    out = tmp_path / "data"
    assert (
        cli_main(
            ["prepare-data", "--input", str(corpus), "--output", str(out), "--vocab-size", "300"]
        )
        == 0
    )
    assert "written" in capsys.readouterr().out
    meta = json.loads((out / "train.json").read_text())
    assert meta["num_documents"] == 2 and meta["vocab_size"] == 300
    assert (out / "tokenizer.json").is_file()
    train, val = TokenFile(out, "train"), TokenFile(out, "val")
    total = train.num_tokens + val.num_tokens
    assert val.num_tokens == int(total * 0.05)
    # files in sorted order, joined by a blank line
    decoded = train.tokenizer().decode(np.concatenate([train.tokens, val.tokens]))
    assert (
        decoded
        == (corpus / "a.txt").read_text().rstrip("\n")
        + "\n\n"
        + (corpus / "sub" / "b.md").read_text().rstrip("\n")
        + "\n\n"
    )

    # second run: cached; byte tokenizer and a reused tokenizer JSON
    assert (
        cli_main(
            ["prepare-data", "--input", str(corpus), "--output", str(out), "--vocab-size", "300"]
        )
        == 0
    )
    assert "up to date" in capsys.readouterr().out
    assert (
        cli_main(
            [
                "prepare-data",
                "--input",
                str(corpus / "a.txt"),
                "--output",
                str(tmp_path / "b"),
                "--tokenizer",
                "byte",
            ]
        )
        == 0
    )
    assert TokenFile(tmp_path / "b").meta.tokenizer == "byte"
    assert (
        cli_main(
            [
                "prepare-data",
                "--input",
                str(corpus / "a.txt"),
                "--output",
                str(tmp_path / "c"),
                "--tokenizer",
                str(out / "tokenizer.json"),
            ]
        )
        == 0
    )
    assert TokenFile(tmp_path / "c").vocab_size == 300


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--input", "MISSING"], "does not exist"),
        (["--input", "EMPTYDIR"], "holds no .txt, .md, .jsonl, .ndjson or .parquet files"),
        (["--input", "LATIN1"], "not UTF-8"),
        (["--input", "GOOD", "--vocab-size", "100"], "vocab size must be"),
        (["--input", "GOOD", "--tokenizer", "nope.json"], "does not exist"),
        (["--input", "GOOD", "--val-fraction", "1.5"], "val_fraction"),
    ],
)
def test_prepare_data_cli_errors(tmp_path, capsys, argv, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "good.txt").write_text("hello world " * 50)
    names = {
        "MISSING": tmp_path / "missing.txt",
        "EMPTYDIR": tmp_path / "empty",
        "LATIN1": tmp_path / "latin1.txt",
        "GOOD": tmp_path / "good.txt",
    }
    argv = [str(names.get(a, a)) for a in argv]
    assert cli_main(["prepare-data", *argv, "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1  # one clear line, no traceback


# ------------------------------------------------------------------ global batches
PLANS = [[8], [5, 2, 1], [3, 3, 2], [0, 8, 0], [2, 0, 5, 0, 1], [1] * 8]


@pytest.mark.parametrize("sizes", PLANS)
def test_batch_is_concatenation_of_rank_slices(counting_file, sizes):
    gb = GlobalBatches(counting_file, seq_len=15, global_batch_size=8, seed=3)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    for step in [0, 1, 7, gb.steps_per_epoch - 1, gb.steps_per_epoch, 3 * gb.steps_per_epoch + 2]:
        x, y = gb.batch(step)
        assert x.shape == y.shape == (8, 15) and x.dtype == y.dtype == torch.int64
        parts = [gb.rank_slice(step, o, s) for o, s in zip(offsets, sizes, strict=True)]
        assert all(p[0].shape == (s, 15) for p, s in zip(parts, sizes, strict=True))
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)


def test_samples_are_shifted_windows(counting_file):
    gb = GlobalBatches(counting_file, seq_len=15, global_batch_size=8, seed=0)
    x, y = gb.batch(5)
    assert torch.equal(y[:, :-1], x[:, 1:])  # labels = inputs shifted by one
    # each sample is one window of 16 tokens starting at a multiple of 16
    assert torch.all(x[:, 0] % 16 == 0)
    assert torch.equal(x, x[:, :1] + torch.arange(15))


def test_epochs_cover_every_window_once_and_reshuffle(counting_file):
    gb = GlobalBatches(counting_file, seq_len=15, global_batch_size=8, seed=1, val_fraction=0.1)
    n, per_epoch = gb.num_train_windows, gb.steps_per_epoch
    assert per_epoch == n // 8
    firsts = []
    for epoch in range(2):
        starts = torch.cat([gb.batch(epoch * per_epoch + t)[0][:, 0] for t in range(per_epoch)])
        windows = (starts // 16).tolist()
        assert len(set(windows)) == len(windows) == per_epoch * 8  # no window twice in an epoch
        assert max(windows) < n  # never a held-out window
        firsts.append(windows)
    assert firsts[0] != firsts[1]  # reshuffled per epoch
    assert gb.epoch_of(per_epoch) == 1 and gb.epoch_of(per_epoch - 1) == 0


def test_seed_changes_order(counting_file):
    a = GlobalBatches(counting_file, 15, 8, seed=0).batch(0)[0]
    b = GlobalBatches(counting_file, 15, 8, seed=1).batch(0)[0]
    assert not torch.equal(a, b)


_BATCH_SNIPPET = """
import sys, torch
from cephalo.data.batches import GlobalBatches
gb = GlobalBatches(sys.argv[1], 15, 8, seed=7)
print([gb.batch(t)[0].sum().item() for t in (0, 3, 100)], gb.rank_slice(9, 2, 3)[1].tolist())
"""


def test_batches_deterministic_across_processes(counting_file):
    """Step t's batch depends on the step only: fresh processes (and order of calls) agree."""
    outs = {
        subprocess.run(
            [sys.executable, "-c", _BATCH_SNIPPET, str(counting_file)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for _ in range(2)
    }
    assert len(outs) == 1
    gb = GlobalBatches(counting_file, 15, 8, seed=7)
    gb.batch(100)  # visiting a later epoch first changes nothing
    expect = (
        str([gb.batch(t)[0].sum().item() for t in (0, 3, 100)])
        + " "
        + str(gb.rank_slice(9, 2, 3)[1].tolist())
    )
    assert outs.pop().strip() == expect


def test_holdout_val_disjoint_from_train(counting_file):
    gb = GlobalBatches(counting_file, seq_len=15, global_batch_size=8, seed=0, val_fraction=0.1)
    windows = 10_000 // 16
    assert gb.num_val_windows == 63 and gb.num_train_windows == windows - 63
    val = torch.cat([x for x, _ in gb.val_batches(100, 10)])
    assert val.shape[0] == 63  # capped at what exists; last batch smaller
    assert len(gb.val_batches(2, 10)) == 2
    val_tokens = set(torch.cat([val, gb.val_batch(6, 10)[1]]).flatten().tolist())
    train_tokens = set()
    for t in range(gb.steps_per_epoch):
        x, y = gb.batch(t)
        train_tokens |= set(x.flatten().tolist()) | set(y.flatten().tolist())
    assert not (val_tokens & train_tokens)
    assert torch.equal(gb.val_batches(3, 10)[2][0], gb.val_batches(3, 10)[2][0])  # fixed
    # slices of a val batch
    full = gb.val_batch(1, 10)[0]
    assert torch.equal(
        torch.cat([gb.val_batch(1, 10, 0, 4)[0], gb.val_batch(1, 10, 4, 6)[0]]), full
    )


def test_val_split_file_used(pydoc512):
    gb = GlobalBatches(pydoc512.path, seq_len=64, global_batch_size=16, seed=0)
    assert gb.num_val_windows == pydoc512.val.num_tokens // 65
    assert gb.num_train_windows == pydoc512.train.num_tokens // 65  # nothing held out of train
    x, y = gb.val_batches(1, 4)[0]
    val = TokenFile(pydoc512.path, "val")
    assert x[0].tolist() == val.tokens[:64].tolist() and y[0].tolist() == val.tokens[1:65].tolist()
    assert gb.vocab_size == 512
    # naming the train file inside the dataset directory finds the same val split
    same = GlobalBatches(pydoc512.path / "train.bin", seq_len=64, global_batch_size=16, seed=0)
    assert same.num_val_windows == gb.num_val_windows
    assert torch.equal(same.val_batch(0, 4)[0], x) and torch.equal(same.batch(3)[0], gb.batch(3)[0])


# ------------------------------------------------------------------ errors
def test_too_small_dataset_error(counting_file):
    with pytest.raises(
        CephaloError, match=r"has 55 training windows .* needs 64: use a smaller seq_len"
    ):
        GlobalBatches(counting_file, seq_len=159, global_batch_size=64, val_fraction=0.1)


def test_missing_token_file_error(tmp_path):
    with pytest.raises(CephaloError, match="cephalo prepare-data"):
        GlobalBatches(tmp_path / "nothing", 16, 4)
    with pytest.raises(CephaloError, match="cephalo prepare-data"):
        GlobalBatches(tmp_path, 16, 4)  # a directory without train.json


def test_token_id_out_of_vocab_error(tmp_path):
    path = write_token_file(tmp_path / "bad.bin", np.r_[np.zeros(250), [999], np.zeros(250)], 256)
    gb = GlobalBatches(path, seq_len=9, global_batch_size=50, val_fraction=0.0)
    with pytest.raises(CephaloError, match="token id 999, but its vocab size is 256"):
        for t in range(gb.steps_per_epoch):
            gb.batch(t)


def test_truncated_file_and_bad_args(tmp_path, counting_file):
    path = write_token_file(tmp_path / "t.bin", np.arange(100), 256)
    with open(path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(CephaloError, match="truncated or corrupt"):
        GlobalBatches(path, 4, 2)
    with pytest.raises(
        CephaloError, match="dataset .* has 60,000 ids but the model has only 1,000 embedding rows"
    ):
        GlobalBatches(counting_file, 15, 8, model_vocab_size=1000)
    gb = GlobalBatches(counting_file, 15, 8)
    with pytest.raises(CephaloError, match="outside the global batch of 8"):
        gb.rank_slice(0, 6, 3)
    with pytest.raises(CephaloError, match="seq_len must be a positive integer"):
        GlobalBatches(counting_file, 0, 8)


def test_documents_api_without_cli(tmp_path):
    docs = [Document("a", "alpha beta gamma\n" * 50), Document("b", "delta epsilon\n" * 50)]
    res = prepare_dataset(docs, tmp_path / "d", vocab_size=256, val_fraction=0.0, progress=False)
    assert res.val.num_tokens == 0 and res.train.tokenizer == "byte"
    with pytest.raises(CephaloError, match="no validation windows"):
        GlobalBatches(res.path, 7, 4).val_batches(1, 4)


def test_rebuild_on_change_keeps_tokenizer_only_for_same_corpus(tmp_path):
    docs = [Document("a", "alpha beta gamma delta\n" * 200)]
    out = tmp_path / "d"
    first = prepare_dataset(docs, out, vocab_size=300, val_fraction=0.1, progress=False)
    tok_mtime = (out / "tokenizer.json").stat().st_mtime_ns
    # another val fraction: re-split, same tokenizer file reused
    second = prepare_dataset(docs, out, vocab_size=300, val_fraction=0.2, progress=False)
    assert not second.cached and (out / "tokenizer.json").stat().st_mtime_ns == tok_mtime
    assert second.num_tokens == first.num_tokens and second.val.num_tokens > first.val.num_tokens
    # another corpus: tokenizer retrained
    third = prepare_dataset([Document("b", "zeta eta theta\n" * 200)], out, 300, progress=False)
    assert third.train.source_sha256 != first.train.source_sha256
    assert (out / "tokenizer.json").stat().st_mtime_ns != tok_mtime
    assert (
        prepare_dataset(docs, out, 300, val_fraction=0.1, progress=False, force=True).train
        == first.train
    )


def test_resolve_dataset_from_config_values(tmp_path, pydoc512):
    cache = tmp_path / "cache"
    # a prepared dataset is used as is, whatever the tokenizer setting
    assert resolve_dataset(pydoc512.path, "builtin", cache_dir=cache) == pydoc512.path
    # bundled corpus, byte tokenizer; then cached
    d = resolve_dataset(None, "builtin", cache_dir=cache)
    assert TokenFile(d).vocab_size == 256 and resolve_dataset(None, "byte", cache_dir=cache) == d
    # a directory of text files with a BPE of the model's vocab
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("some words to learn merges from\n" * 100)
    d2 = resolve_dataset(tmp_path / "txt", "bpe", vocab_size=270, cache_dir=cache)
    assert d2.parent == cache and TokenFile(d2).vocab_size == 270
    gb = GlobalBatches(d2, 8, 4, model_vocab_size=270)
    assert gb.batch(0)[0].shape == (4, 8)
    with pytest.raises(CephaloError, match="does not exist"):
        resolve_dataset(tmp_path / "nope", cache_dir=cache)
