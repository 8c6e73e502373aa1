"""Data files for the tests: a model directory's tokenizer (trained in-process, saved with
`PreTrainedTokenizerFast.save_pretrained`), JSON Lines, Parquet, datasets directories."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from cephalo.data.corpus import default_corpus
from cephalo.data.token_files import TokenFile

EOS = "<|endoftext|>"
DOCS = [
    "The first document.\nIt has two lines.\n",
    "Second: ünïcode, 日本語 and an emoji 🙂.",
    "Third one\n\nwith a blank line inside and trailing newlines\n\n\n",
]


def topics(n: int | None = None) -> list[str]:
    return [d.text for d in default_corpus()[:n]]


def save_tokenizer(directory: Path, vocab_size: int = 400, model_vocab: int | None = 512) -> Path:
    """A byte-level BPE with an EOS token, saved as transformers saves a model's tokenizer,
    next to a config.json (so the directory is a model directory)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS],
        show_progress=False,
    )
    tok.train_from_iterator(topics(20), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(directory)
    if model_vocab is not None:
        config = {
            "model_type": "gpt2",
            "vocab_size": model_vocab,
            "bos_token_id": 0,
            "eos_token_id": 0,
        }
        (directory / "config.json").write_text(json.dumps(config))
    return directory


def write_jsonl(path: Path, records: list[dict | str]) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_parquet(path: Path, texts: list[str | None], column: str = "text", **extra) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({column: pa.array(texts, pa.string()), **extra})
    pq.write_table(table, path, row_group_size=max(1, len(texts) // 7 or 1))
    return path


def tokens(path: Path) -> np.ndarray:
    train, val = TokenFile(path, "train"), TokenFile(path, "val")
    return np.concatenate([train.tokens, val.tokens]).astype(np.int64)


def write_corpus(path: Path, fmt: str, mib: int) -> Path:
    """About `mib` MiB of pydoc topics: one record per topic (jsonl, parquet, datasets) or
    one long document (text). Written in pieces, so the test itself stays small."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = topics()
    repeats = (mib << 20) // sum(map(len, texts)) + 1
    if fmt == "jsonl":
        with open(path, "w") as f:
            for _ in range(repeats):
                f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    elif fmt == "parquet":
        with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as w:
            for _ in range(repeats):
                w.write_table(pa.table({"text": texts}))
    elif fmt == "datasets":
        import datasets

        datasets.Dataset.from_dict({"text": texts * repeats}).save_to_disk(str(path))
    else:
        with open(path, "w") as f:
            f.writelines("\n".join(texts) for _ in range(repeats))
    return path
