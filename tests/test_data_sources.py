"""Bring your own data and tokenizer: JSON Lines, Parquet, datasets directories, a model
directory's tokenizer (`data.tokenizer = "auto"`), streaming in bounded memory, bad input.

Every tokenizer here is trained in-process (the `tokenizers` library, on pydoc_data.topics)
and saved with `PreTrainedTokenizerFast.save_pretrained`: nothing is downloaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from cephalo import CephaloError, envvars
from cephalo.cli import main as cli_main
from cephalo.data.batches import GlobalBatches
from cephalo.data.corpus import Corpus, Document
from cephalo.data.hf_tokenizer import HFTokenizer
from cephalo.data.text import prepare_dataset, resolve_dataset, resolve_tokenizer
from cephalo.data.token_files import TokenFile
from data_helpers import (
    DOCS,
    EOS,
    save_tokenizer,
    tokens,
    topics,
    write_corpus,
    write_jsonl,
    write_parquet,
)

PIECE = 1 << 16
"""Piece size of the memory tests: the corpora there are 32-640x larger."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("model") / "tiny-model")


# ------------------------------------------------------------------ the model's tokenizer
def test_auto_picks_the_model_directory_tokenizer_with_eos_between_documents(tmp_path, model_dir):
    from transformers import AutoTokenizer

    (tmp_path / "docs").mkdir()
    for i, text in enumerate(DOCS):
        (tmp_path / "docs" / f"{i}.txt").write_text(text)
    assert resolve_tokenizer("auto", str(model_dir)) == str(model_dir)
    path = resolve_dataset(
        tmp_path / "docs",
        "auto",
        vocab_size=512,
        cache_dir=tmp_path / "cache",
        val_fraction=0.0,
        model_name=str(model_dir),
    )
    train = TokenFile(path)
    assert train.meta.tokenizer == "tokenizer" and train.meta.tokenizer_key.startswith("hf-")
    assert train.meta.num_documents == 3 and train.vocab_size == 400

    # the reference: transformers' own tokenizer, each document then EOS
    ref = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    expected = []
    for text in DOCS:
        expected += ref(text, add_special_tokens=False)["input_ids"] + [ref.eos_token_id]
    assert tokens(path).tolist() == expected
    assert int((tokens(path) == ref.eos_token_id).sum()) == len(DOCS)
    # the dataset keeps its tokenizer: it decodes without the model directory
    assert train.tokenizer().decode(train.tokens) == EOS.join(DOCS) + EOS
    # and it trains: windows of that vocabulary, checked against the model's
    batches = GlobalBatches(path, 8, 2, val_fraction=0.0, model_vocab_size=512)
    assert int(batches.batch(0)[0].max()) < 400


def test_auto_without_a_model_tokenizer_is_the_byte_tokenizer(tmp_path):
    assert resolve_tokenizer("auto", "gpt-tiny") == "byte"  # a registry name
    assert resolve_tokenizer("auto", None) == "byte"
    bare = tmp_path / "bare-model"
    bare.mkdir()
    (bare / "config.json").write_text('{"model_type": "llama"}')
    assert resolve_tokenizer("auto", str(bare)) == "byte"  # a model directory, no tokenizer
    assert resolve_tokenizer("builtin") == resolve_tokenizer("byte") == "byte"
    assert resolve_tokenizer("bpe") is None
    d = resolve_dataset(None, "auto", cache_dir=tmp_path / "cache", model_name=str(bare))
    assert TokenFile(d).meta.tokenizer_key == "byte" and d.name.startswith("pydoc-byte")


def test_tokenizer_directory_loads_without_transformers(model_dir, monkeypatch):
    with_transformers = HFTokenizer.load(model_dir)
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    plain = HFTokenizer.load(model_dir)
    assert (with_transformers.backend, plain.backend) == (
        "transformers, Rust backend",
        "tokenizers",
    )
    assert plain.eos_id == with_transformers.eos_id == 0
    assert plain.vocab_size == with_transformers.vocab_size == 400
    assert plain.encode_batch(DOCS) == with_transformers.encode_batch(DOCS)


def test_cache_keys_distinguish_tokenizers(tmp_path, model_dir):
    other = save_tokenizer(tmp_path / "other-model", vocab_size=300)
    write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in topics(5)])
    kw = dict(vocab_size=512, cache_dir=tmp_path / "cache", val_fraction=0.0)
    a = resolve_dataset(tmp_path / "c.jsonl", "auto", model_name=str(model_dir), **kw)
    b = resolve_dataset(tmp_path / "c.jsonl", "auto", model_name=str(other), **kw)
    c = resolve_dataset(tmp_path / "c.jsonl", str(other), **kw)  # the directory given directly
    d = resolve_dataset(tmp_path / "c.jsonl", "byte", **kw)
    assert len({a, b, d}) == 3 and b == c
    assert (TokenFile(a).vocab_size, TokenFile(b).vocab_size, TokenFile(d).vocab_size) == (
        400,
        300,
        256,
    )
    assert not np.array_equal(tokens(a), tokens(b))
    again = prepare_dataset(Corpus.from_paths([tmp_path / "c.jsonl"]), a, 512, model_dir, 0.0)
    assert again.cached  # switching back rebuilds nothing


def test_token_dtype_holds_large_vocabularies(tmp_path):
    big = save_tokenizer(tmp_path / "big", vocab_size=300)
    # add tokens past 65535 (a Qwen- or Llama-3-sized vocabulary) so the top ids need uint32
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(big), local_files_only=True)
    tok.add_tokens([f"<extra_{i}>" for i in range(len(tok), 70_000)])  # <extra_N> is id N
    tok.save_pretrained(big)
    (tmp_path / "t.txt").write_text("hello <extra_69999> world <extra_65536>\n")
    res = prepare_dataset(
        Corpus.from_paths([tmp_path / "t.txt"]), tmp_path / "d", tokenizer=big, val_fraction=0.0
    )
    ids = tokens(res.path)
    assert res.train.dtype == "uint32" and res.train.vocab_size == 70_000
    assert 69_999 in ids and 65_536 in ids


# ------------------------------------------------------------------ formats
def test_jsonl_with_a_custom_text_field(tmp_path, capsys):
    records: list[dict | str] = [{"id": i, "content": t} for i, t in enumerate(DOCS)]
    records.insert(1, "")  # a blank line: no record
    records.insert(2, {"id": 99, "content": None})  # a null text: skipped, counted
    write_jsonl(tmp_path / "a.jsonl", records)
    argv = ["prepare-data", "--input", str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "d")]
    assert cli_main([*argv, "--text-field", "content", "--tokenizer", "byte"]) == 0
    assert "3 documents" in capsys.readouterr().out
    meta = TokenFile(tmp_path / "d").meta
    assert meta.num_documents == 3
    # the byte tokenizer has no EOS: documents end in one blank line
    expected = "".join(t.rstrip("\n") + "\n\n" for t in DOCS)
    assert bytes(tokens(tmp_path / "d").astype(np.uint8)).decode() == expected
    # the default field is `text`: these records have none
    assert cli_main([*argv[:-1], str(tmp_path / "e"), "--tokenizer", "byte"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'a.jsonl'}, line 1: the record has no 'text' field" in err
    assert "its fields: id, content" in err and "--text-field" in err and err.count("\n") == 1


def test_parquet_datasets_and_jsonl_give_the_same_tokens(tmp_path, model_dir):
    import datasets

    texts = topics(30)
    write_jsonl(tmp_path / "c.jsonl", [{"body": t} for t in texts])
    write_parquet(tmp_path / "c.parquet", texts, column="body", n=list(range(len(texts))))
    datasets.Dataset.from_dict({"body": texts, "n": list(range(len(texts)))}).save_to_disk(
        str(tmp_path / "ds")
    )
    dd = datasets.DatasetDict(
        {
            "validation": datasets.Dataset.from_dict({"body": ["held out"]}),
            "train": datasets.Dataset.from_dict({"body": texts}),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    got = {}
    for name in ("c.jsonl", "c.parquet", "ds", "dd"):
        corpus = Corpus.from_paths([tmp_path / name], text_field="body")
        res = prepare_dataset(
            corpus, tmp_path / f"out-{name}", tokenizer=model_dir, val_fraction=0.1, progress=False
        )
        assert res.train.num_documents == len(texts)
        got[name] = tokens(res.path)
    for name in ("c.parquet", "ds", "dd"):
        assert np.array_equal(got[name], got["c.jsonl"]), name
    ref = HFTokenizer.load(model_dir)
    expected = [i for t in texts for i in [*ref.encode(t), ref.eos_id]]
    assert got["c.jsonl"].tolist() == expected


def test_directory_mixes_formats_in_path_order(tmp_path):
    root = tmp_path / "mixed"
    (root / "b").mkdir(parents=True)
    (root / "a.md").write_text("markdown doc\n")
    write_jsonl(root / "b" / "c.jsonl", [{"text": "json doc"}])
    write_parquet(root / "b" / "d.parquet", ["parquet doc"])
    (root / "notes.csv").write_text("ignored,file\n")
    corpus = Corpus.from_paths([root])
    assert [s.kind for s in corpus.sources] == ["text", "jsonl", "parquet"]
    res = prepare_dataset(corpus, tmp_path / "d", tokenizer="byte", val_fraction=0.0)
    text = bytes(tokens(res.path).astype(np.uint8)).decode()
    assert text == "markdown doc\n\njson doc\n\nparquet doc\n\n"


def test_long_documents_stream_in_pieces(tmp_path):
    text = "".join(f"line {i} " + "word " * (i % 13) + "\n" for i in range(20_000))
    (tmp_path / "long.txt").write_text(text)
    # pieces of 1000 characters: the bytes are exactly the file's, then the blank line
    res = prepare_dataset(
        Corpus.from_paths([tmp_path / "long.txt"]),
        tmp_path / "d",
        tokenizer="byte",
        val_fraction=0.0,
        piece_chars=1000,
    )
    assert bytes(tokens(res.path).astype(np.uint8)).decode() == text.rstrip("\n") + "\n\n"
    pieces = list(Corpus.from_paths([tmp_path / "long.txt"]).pieces("", 1000))
    assert len(pieces) > len(text) // 1000 and max(len(p.text) for p in pieces) <= 1000
    assert (
        all(p.text.endswith("\n") for p in pieces)
        and [p.ends_document for p in pieces].count(True) == 1
    )


def test_unchanged_sources_are_not_read_again(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in topics(3)])
    corpus = Corpus.from_paths([tmp_path / "c.jsonl"])
    first = prepare_dataset(corpus, tmp_path / "d", tokenizer="byte")
    assert first.train.source_stat

    def no_reading(self, advance=None):
        raise AssertionError("the sources were read again")

    with monkeypatch.context() as m:
        m.setattr(Corpus, "checksum", no_reading)
        assert prepare_dataset(corpus, tmp_path / "d", tokenizer="byte").cached
    # touched, same bytes: read once to check, still up to date, new stat remembered
    os.utime(tmp_path / "c.jsonl", ns=(1, 1))
    second = prepare_dataset(corpus, tmp_path / "d", tokenizer="byte")
    assert second.cached and second.train.source_stat != first.train.source_stat
    # changed: rebuilt
    write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in topics(4)])
    third = prepare_dataset(corpus, tmp_path / "d", tokenizer="byte")
    assert not third.cached and third.train.source_sha256 != first.train.source_sha256


# ------------------------------------------------------------------ bounded memory
def _python_peak(fn) -> int:
    """Peak bytes of Python (and numpy) allocations while `fn` runs."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "datasets", "text"])
def test_streaming_python_memory_is_flat(tmp_path, fmt):
    """Tokenizing 2 MiB or 16 MiB (32x and 256x the piece size) peaks at the same Python
    memory: one piece and its ids, not the corpus."""
    peaks = {}
    for mib in (2, 16):
        path = write_corpus(tmp_path / f"c{mib}.{fmt}", fmt, mib)
        corpus = Corpus.from_paths([path])
        out = tmp_path / f"d{mib}"
        peaks[mib] = _python_peak(
            lambda corpus=corpus, out=out: prepare_dataset(
                corpus, out, tokenizer="byte", progress=False, piece_chars=PIECE
            )
        )
        assert TokenFile(out).num_tokens + TokenFile(out, "val").num_tokens > mib << 20
    print(
        f"{fmt}: Python peak {peaks[2] / 2**20:.2f} MiB (2 MiB), {peaks[16] / 2**20:.2f} MiB (16 MiB)"
    )
    assert peaks[16] < peaks[2] + (1 << 20), peaks  # flat in the corpus size
    assert peaks[16] < (16 << 20) / 2, peaks


RSS_SCRIPT = """
import sys
from pathlib import Path
from cephalo.data.corpus import Corpus
from cephalo.data.text import prepare_dataset

def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

corpus = Corpus.from_paths([sys.argv[1]])
Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current RSS
before = status("VmRSS")
prepare_dataset(corpus, sys.argv[2], tokenizer="byte", progress=False, piece_chars=int(sys.argv[3]))
print(status("VmHWM") - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "text"])
def test_streaming_resident_memory_is_bounded(tmp_path, fmt):
    """The whole process, in a fresh interpreter: the peak resident set grows by a fixed
    amount (the reader's buffers, one row group), far below a 40 MiB corpus."""
    growth = {}
    for mib in (4, 40):
        path = write_corpus(tmp_path / f"c{mib}.{fmt}", fmt, mib)
        out = subprocess.run(
            [sys.executable, "-c", RSS_SCRIPT, str(path), str(tmp_path / f"d{mib}"), str(PIECE)],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        ).stdout
        growth[mib] = int(out.split()[-1])
    print(
        f"{fmt}: peak RSS +{growth[4] / 2**20:.1f} MiB (4 MiB), +{growth[40] / 2**20:.1f} MiB (40 MiB)"
    )
    assert growth[40] < growth[4] + (8 << 20), growth
    assert growth[40] < (40 << 20) * 3 // 4, growth


# ------------------------------------------------------------------ bad input
def test_tokenizer_larger_than_the_model_vocabulary(tmp_path, model_dir, capsys):
    (tmp_path / "a.txt").write_text("some text\n")
    with pytest.raises(CephaloError) as e:
        resolve_dataset(
            tmp_path / "a.txt",
            "auto",
            vocab_size=300,
            cache_dir=tmp_path / "cache",
            model_name=str(model_dir),
        )
    assert f"the tokenizer in {model_dir} has 400 ids but model {model_dir} has only 300" in str(
        e.value
    )
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.bin"))
    # prepare-data checks the directory's own config.json
    small = save_tokenizer(tmp_path / "small", vocab_size=400, model_vocab=320)
    argv = ["prepare-data", "--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "o")]
    assert cli_main([*argv, "--tokenizer", str(small)]) == 2
    err = capsys.readouterr().err
    assert (
        f"has 400 ids but {small}/config.json has only 320" in err and "320 embedding rows" in err
    )
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    "lines, message",
    [
        (
            ['{"text": "ok"}', '{"txt": "typo"}'],
            "line 2: the record has no 'text' field (its fields: txt)",
        ),
        (['{"text": "ok"}', "", '{"text": "unterminated'], "line 3: not valid JSON"),
        (['["a", "list"]'], "line 1: a JSON list, not an object"),
        (['{"text": 42}'], "line 1: field 'text' holds a int, not a string"),
    ],
    ids=["missing field", "bad json", "not an object", "not a string"],
)
def test_bad_jsonl_names_the_file_and_line(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(CephaloError, match="^" + str(path).replace(".", r"\.")) as e:
        prepare_dataset(Corpus.from_paths([path]), tmp_path / "d", tokenizer="byte")
    assert message in str(e.value)
    assert not list((tmp_path / "d").glob("*.bin*")) and not list((tmp_path / "d").glob("*.json"))


def test_empty_datasets_name_the_path(tmp_path):
    import datasets

    (tmp_path / "empty.jsonl").write_text("\n\n")
    write_jsonl(tmp_path / "nulls.jsonl", [{"text": None}, {"text": ""}])
    write_parquet(tmp_path / "empty.parquet", [])
    (tmp_path / "empty.txt").write_text("")
    datasets.Dataset.from_dict(
        {"text": []}, features=datasets.Features({"text": datasets.Value("string")})
    ).save_to_disk(str(tmp_path / "ds-empty"))
    datasets.Dataset.from_dict({"text": ["x"]}).filter(lambda r: False).save_to_disk(
        str(tmp_path / "ds-filtered")
    )
    for name in ("empty.jsonl", "nulls.jsonl", "empty.parquet", "empty.txt", "ds-filtered"):
        path = tmp_path / name
        with pytest.raises(CephaloError, match="the dataset is empty") as e:
            prepare_dataset(Corpus.from_paths([path]), tmp_path / "d", tokenizer="byte")
        assert str(path) in str(e.value), name
    with pytest.raises(CephaloError, match=f"the dataset {tmp_path / 'ds-empty'} is empty"):
        Corpus.from_paths([tmp_path / "ds-empty"])
    # an empty file among others is skipped with a warning, not an error
    (tmp_path / "good.txt").write_text("text\n")
    res = prepare_dataset(
        Corpus.from_paths([tmp_path / "empty.txt", tmp_path / "good.txt"]),
        tmp_path / "d",
        tokenizer="byte",
        val_fraction=0.0,
    )
    assert res.train.num_documents == 1


def test_bad_columns_splits_and_missing_extra(tmp_path, monkeypatch):
    import datasets

    write_parquet(tmp_path / "a.parquet", ["x"], column="body", n=[1])
    with pytest.raises(
        CephaloError, match=r"a\.parquet has no column 'text' \(its columns: body, n\)"
    ):
        Corpus.from_paths([tmp_path / "a.parquet"])
    with pytest.raises(CephaloError, match="column 'n' holds int64, not strings"):
        Corpus.from_paths([tmp_path / "a.parquet"], text_field="n")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(CephaloError, match="cannot read the Parquet file"):
        Corpus.from_paths([tmp_path / "junk.parquet"])
    one = datasets.Dataset.from_dict({"text": ["a"]})
    datasets.DatasetDict({"a": one, "b": one}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(CephaloError, match="holds the splits a, b and none is called 'train'"):
        Corpus.from_paths([tmp_path / "dd"])
    assert Corpus.from_paths([tmp_path / "dd" / "b"]).sources[0].num_rows == 1
    with pytest.raises(CephaloError, match="has no column 'body'"):
        Corpus.from_paths([tmp_path / "dd" / "a"], text_field="body")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(
        CephaloError, match=r"needs the `pyarrow` package: pip install 'cephalo\[data\]'"
    ):
        Corpus.from_paths([tmp_path / "a.parquet"])
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(
        CephaloError, match=r"needs the `datasets` package: pip install 'cephalo\[data\]'"
    ):
        Corpus.from_paths([tmp_path / "dd" / "a"])


def test_documents_in_memory_hash_like_files(tmp_path):
    (tmp_path / "a.txt").write_text(DOCS[0])
    (tmp_path / "b.txt").write_text(DOCS[1])
    from_files = Corpus.from_paths([tmp_path / "a.txt", tmp_path / "b.txt"]).checksum()
    in_memory = Corpus.from_documents([Document("x", DOCS[0]), Document("y", DOCS[1])]).checksum()
    assert from_files == in_memory


# ------------------------------------------------------------------ the trainer path
def test_trainer_trains_on_a_tokenizer_directory_and_jsonl(tmp_path, model_dir, monkeypatch):
    """`cephalo train` with data.tokenizer = a tokenizer directory and data.path = JSON Lines
    with a custom text field. (`auto` with model.name = DIR needs the HF model adapter.)"""
    from cephalo.train.config_manager import load_config
    from cephalo.train.trainer import train

    monkeypatch.setenv(envvars.CACHE_ROOT, str(tmp_path / "cache"))
    write_jsonl(tmp_path / "c.jsonl", [{"body": t} for t in topics(40)])
    cfg = load_config(
        None,
        [
            f"--logging.dir={tmp_path / 'run'}",
            "--logging.progress=false",
            "--model.name=gpt-tiny",
            "--model.overrides=vocab_size=400",
            f"--data.path={tmp_path / 'c.jsonl'}",
            f"--data.tokenizer={model_dir}",
            "--data.text_field=body",
            "--data.seq_len=16",
            "--train.global_batch_size=4",
            "--train.steps=3",
            "--train.warmup_steps=1",
            "--train.eval_every=0",
            "--parallel.plan=even",
            "--checkpoint.every=0",
        ],
    )
    result = train(cfg)
    assert result.final_step == 3 and all(np.isfinite(list(result.losses.values())))
    (prepared,) = [p for p in (tmp_path / "cache" / "data").iterdir() if p.is_dir()]
    meta = TokenFile(prepared).meta
    assert meta.tokenizer_key.startswith("hf-") and meta.vocab_size == 400
    # a model whose embedding is smaller than the tokenizer: refused before tokenizing
    cfg.model.overrides = {"vocab_size": 399}
    with pytest.raises(CephaloError, match="has 400 ids but model gpt-tiny has only 399"):
        train(cfg)


def test_trainer_auto_tokenizer_of_a_model_directory(tmp_path, monkeypatch):
    """The default `data.tokenizer = auto` with `model.name` = a Hugging Face model directory
    (a tiny Qwen2 written by save_pretrained, its tokenizer saved next to it): the job trains
    on that directory's tokenizer, EOS between documents, with the model's pretrained weights."""
    from cephalo.train.config_manager import load_config
    from cephalo.train.trainer import train
    from hf_configs import save_tiny_model

    monkeypatch.setenv(envvars.CACHE_ROOT, str(tmp_path / "cache"))
    model = save_tiny_model("qwen2", tmp_path / "qwen2", vocab_size=400)
    save_tokenizer(model, vocab_size=400, model_vocab=None)  # keeps the model's config.json
    write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in topics(40)])
    cfg = load_config(
        None,
        [
            f"--logging.dir={tmp_path / 'run'}",
            "--logging.progress=false",
            f"--model.name={model}",
            f"--data.path={tmp_path / 'c.jsonl'}",
            "--data.seq_len=16",
            "--train.global_batch_size=4",
            "--train.steps=2",
            "--train.warmup_steps=1",
            "--train.eval_every=0",
            "--parallel.plan=even",
            "--checkpoint.every=0",
        ],
    )
    assert cfg.data.tokenizer == "auto"
    result = train(cfg)
    assert result.final_step == 2 and all(np.isfinite(list(result.losses.values())))
    (prepared,) = [p for p in (tmp_path / "cache" / "data").iterdir() if p.is_dir()]
    meta = TokenFile(prepared).meta
    assert meta.tokenizer_key.startswith("hf-") and meta.vocab_size == 400
    ids = tokens(prepared)
    eos = HFTokenizer.load(model).eos_id
    assert (ids == eos).sum() == 40  # one EOS after each document


def test_the_rust_backend_is_used_only_where_it_gives_the_same_ids(model_dir, monkeypatch):
    from cephalo.data import hf_tokenizer

    def off_by_one(tok):
        return lambda texts: [[i + 1 for i in ids] for ids in tok(texts)["input_ids"]]

    monkeypatch.setattr(hf_tokenizer, "_fast_backend", off_by_one)
    tok = HFTokenizer.load(model_dir)
    assert tok.backend == "transformers"  # the self-check failed: the tokenizer's own call
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    assert tok.encode_batch(DOCS) == [ref(t, add_special_tokens=False)["input_ids"] for t in DOCS]


def test_a_prepared_dataset_of_another_tokenizer_is_used_with_a_warning(
    tmp_path, model_dir, caplog
):
    import logging

    from cephalo.log import logger

    (tmp_path / "a.txt").write_text("some text\n" * 50)
    corpus = Corpus.from_paths([tmp_path / "a.txt"])
    own = prepare_dataset(corpus, tmp_path / "own", tokenizer=model_dir).path
    other = prepare_dataset(corpus, tmp_path / "bytes", tokenizer="byte").path

    def warnings() -> set[str]:
        # (a record may arrive twice: through our handler and, if it propagates, the root's)
        return {r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING}

    caplog.clear()
    logger.addHandler(caplog.handler)  # the cephalo logger does not propagate
    try:
        with caplog.at_level(logging.WARNING, logger="cephalo"):
            assert resolve_dataset(own, "auto", 512, model_name=str(model_dir)) == own
            assert not warnings()
            assert resolve_dataset(other, "auto", 512, model_name=str(model_dir)) == other
    finally:
        logger.removeHandler(caplog.handler)
    (message,) = warnings()
    assert "was tokenized with byte, not with the tokenizer of model" in message
