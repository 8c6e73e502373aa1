"""Tokenizers: a byte-level BPE trained in-process, raw bytes, or a model's own tokenizer.

A model's own tokenizer (a directory written by `save_pretrained`) lives in
`hf_tokenizer.py`; `load_tokenizer` opens all three kinds.

Both turn any text into ids and back without loss (`decode(encode(text)) == text`): the BPE
starts from the 256 byte symbols (ByteLevel pre-tokenizer and decoder), so nothing is ever
out of vocabulary. The BPE is trained with the `tokenizers` library on the corpus itself and
saved as a tokenizer JSON next to the token files; the same corpus and vocab size always give
the same tokenizer (the trainer breaks count ties by the pair itself, and we train it
serially so that nothing depends on scheduling; `tests/test_data.py` checks it across
processes).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cephalo.errors import CephaloError
from cephalo.log import logger

BYTE_TOKENIZER = "byte"
"""The name that selects `ByteTokenizer` wherever a tokenizer path is expected."""
BYTE_VOCAB_SIZE = 256
MAX_VOCAB_SIZE = 1 << 20


class TextTokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def name(self) -> str:
        """`byte`, `bpe-<vocab>`, or the tokenizer directory's name: for messages."""
        ...

    @property
    def eos_id(self) -> int | None:
        """The id put after every document, or None: documents are then separated by a
        blank line of text (`DOCUMENT_SEPARATOR`)."""
        ...

    def encode_batch(self, texts: Sequence[str]) -> Sequence[Sequence[int]]:
        """Ids of each text: lists, or 1-D integer numpy arrays."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids (vocab 256): no training, no file, works on anything."""

    vocab_size = BYTE_VOCAB_SIZE
    name = BYTE_TOKENIZER
    eos_id = None  # 256 ids are all bytes: none is free for an end-of-document token

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # uint8 arrays: a megabyte of text stays a megabyte (a list of ints would be 8x)
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        # a window cut mid-character decodes with a replacement mark instead of failing
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class BPETokenizer:
    """A byte-level BPE held by a `tokenizers.Tokenizer`."""

    eos_id = None  # trained without special tokens: documents end in a blank line

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def name(self) -> str:
        return f"bpe-{self.vocab_size}"

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    def save(self, path: str | Path) -> None:
        """Write the tokenizer JSON atomically (a crash never leaves half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        self.tokenizer.save(str(tmp))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        path = Path(path)
        if not path.is_file():
            raise CephaloError(
                f"tokenizer file {path} does not exist: pass a tokenizer JSON written by "
                f"`cephalo prepare-data` (or the `tokenizers` library), or `byte`"
            )
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as e:  # the library raises plain Exceptions on bad JSON
            raise CephaloError(
                f"{path} is not a tokenizer JSON ({e}); pass a file saved by the `tokenizers` "
                f"library, or `byte`"
            ) from e


def train_bpe(texts: Iterable[str], vocab_size: int, serial: bool = True) -> BPETokenizer:
    """Train a byte-level BPE of `vocab_size` ids on `texts` (deterministic).

    serial=False lets the library use its thread pool (the tests check it gives the same
    tokenizer)."""
    if not BYTE_VOCAB_SIZE < vocab_size <= MAX_VOCAB_SIZE:
        raise CephaloError(
            f"BPE vocab size must be in ({BYTE_VOCAB_SIZE}, {MAX_VOCAB_SIZE}], got {vocab_size}; "
            f"use a value like 512-8192, or the byte tokenizer (vocab {BYTE_VOCAB_SIZE})"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        # all 256 byte symbols from the start: any text encodes, even bytes the corpus lacks
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    # Train serially: merge ties are broken by the pair, so threads give the same result
    # (measured), but serial training rules out any scheduling dependence. The library reads
    # this variable on every parallel call (unlike RAYON_NUM_THREADS, read once per process).
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false" if serial else "true"
    try:
        tokenizer.train_from_iterator(texts, trainer)
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous
    bpe = BPETokenizer(tokenizer)
    if bpe.vocab_size < vocab_size:
        logger.info(
            "BPE stopped at %d ids (asked for %d): the corpus has no more pairs to merge",
            bpe.vocab_size,
            vocab_size,
        )
    return bpe


def load_tokenizer(spec: str | Path) -> TextTokenizer:
    """`byte` -> `ByteTokenizer`; a directory -> its saved Hugging Face tokenizer
    (`HFTokenizer`); anything else is the path of a tokenizer JSON."""
    if str(spec) == BYTE_TOKENIZER:
        return ByteTokenizer()
    if Path(spec).is_dir():
        from cephalo.data.hf_tokenizer import HFTokenizer

        return HFTokenizer.load(spec)
    return BPETokenizer.load(spec)


def load_or_train_tokenizer(
    texts: Iterable[str], vocab_size: int, path: str | Path | None
) -> TextTokenizer:
    """The tokenizer for a corpus: reuse the one saved at `path`, else train and save it.

    `vocab_size == 256` means the byte tokenizer (nothing is trained or saved). A saved
    tokenizer is reused only if it has this vocab size (else it is retrained: a fraction of a
    second per MB); the caller keys `path` by the corpus (the token file's sidecar records
    the corpus checksum).
    """
    if vocab_size == BYTE_VOCAB_SIZE:
        return ByteTokenizer()
    if path is not None and Path(path).is_file():
        saved = BPETokenizer.load(path)
        if saved.vocab_size == vocab_size:
            logger.debug("reusing tokenizer %s", path)
            return saved
        logger.info(
            "tokenizer %s has %d ids, %d asked: training a new one",
            path,
            saved.vocab_size,
            vocab_size,
        )
    bpe = train_bpe(texts, vocab_size)
    if path is not None:
        bpe.save(path)
    return bpe
