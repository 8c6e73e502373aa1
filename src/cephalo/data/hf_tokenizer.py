"""A model directory's own tokenizer (`tokenizer.json` / `tokenizer_config.json`), local files only.

Loaded with `transformers.AutoTokenizer(..., local_files_only=True)` when `transformers` is
installed (the `hf` extra), else straight from `tokenizer.json` with the `tokenizers`
library (its end-of-document token read from `tokenizer_config.json` or `config.json`).
Nothing is ever downloaded. Texts are encoded without the tokenizer's special tokens (no
BOS); the data pipeline puts the tokenizer's EOS after every document, as in the
pretraining of GPT-2, Llama and Qwen.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from cephalo.errors import CephaloError, first_line
from cephalo.modeling.hf.config import TOKENIZER_FILES

TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json")
"""A directory holding one of these has a tokenizer."""


def has_tokenizer(directory: str | Path) -> bool:
    """True if `directory` holds a saved Hugging Face tokenizer."""
    directory = Path(directory)
    return directory.is_dir() and any((directory / m).is_file() for m in TOKENIZER_MARKERS)


def tokenizer_files(directory: Path) -> list[Path]:
    return [directory / name for name in TOKENIZER_FILES if (directory / name).is_file()]


def tokenizer_fingerprint(directory: str | Path) -> str:
    """sha256 prefix of the tokenizer files (names and bytes): the cache key of its tokens."""
    h = hashlib.sha256()
    for f in tokenizer_files(Path(directory)):
        data = f.read_bytes()
        h.update(f"{f.name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:16]


def declared_vocab_size(directory: str | Path) -> int | None:
    """The embedding rows a model directory's `config.json` declares (`vocab_size`, or that
    of its `text_config`), or None when there is no such file or field."""
    config = _read_json(Path(directory) / "config.json")
    for section in (config, config.get("text_config") or {}):
        value = section.get("vocab_size") if isinstance(section, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


class HFTokenizer:
    """A saved Hugging Face tokenizer, with the id it puts between documents."""

    def __init__(
        self,
        directory: Path,
        encode_batch: Callable[[list[str]], list[list[int]]],
        decode: Callable[[list[int]], str],
        vocab_size: int,
        eos_id: int | None,
        backend: str,
        transformers_tokenizer: Any = None,
    ):
        self.directory = directory
        self.transformers_tokenizer = transformers_tokenizer
        """The transformers tokenizer object (None without transformers): chat data renders
        with its `apply_chat_template` and takes token offsets from it."""
        self._encode_batch, self._decode = encode_batch, decode
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        """Appended after every document (None: the tokenizer has no EOS; documents are
        then separated by a blank line of text, like the byte tokenizer's)."""
        self.backend = backend
        """Which library encodes: `transformers` (the tokenizer's own call), `transformers,
        Rust backend` (its `tokenizers` backend, checked to give the same ids) or
        `tokenizers` (no transformers installed)."""

    @property
    def name(self) -> str:
        return f"{self.directory.name} ({self.backend}, vocab {self.vocab_size})"

    def encode(self, text: str) -> list[int]:
        return self._encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._encode_batch(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        return self._decode([int(i) for i in ids])

    def save(self, directory: str | Path) -> None:
        """Copy the tokenizer files into `directory` (replaced atomically as a whole)."""
        directory = Path(directory)
        if directory.resolve() == self.directory.resolve():
            return
        tmp = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for f in tokenizer_files(self.directory):
            shutil.copyfile(f, tmp / f.name)
        old = directory.with_name(directory.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if directory.exists():
            os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)

    @classmethod
    def load(cls, directory: str | Path) -> HFTokenizer:
        directory = Path(directory)
        if not has_tokenizer(directory):
            raise CephaloError(
                f"{directory} holds no tokenizer (no {' or '.join(TOKENIZER_MARKERS)}): pass a "
                f"directory written by a tokenizer's save_pretrained, a tokenizer JSON, or `byte`"
            )
        try:
            import transformers
        except ImportError:
            return cls._load_with_tokenizers(directory)
        return cls._load_with_transformers(directory, transformers)

    @classmethod
    def _load_with_transformers(cls, directory: Path, transformers: Any) -> HFTokenizer:
        try:
            tok = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as e:  # transformers raises ValueError, OSError, ImportError, ...
            raise CephaloError(
                f"cannot load the tokenizer in {directory} ({first_line(e)}); check its "
                f"tokenizer files, or pass another tokenizer"
            ) from e
        vocab = tok.get_vocab()
        vocab_size = max(len(tok), max(vocab.values(), default=-1) + 1)

        def call_tokenizer(texts: list[str]) -> list[list[int]]:
            # verbose=False: pieces are longer than model_max_length on purpose
            out = tok(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)
            return out["input_ids"]

        def decode(ids: list[int]) -> str:
            return tok.decode(ids)

        encode_batch, backend = call_tokenizer, "transformers"
        fast = _fast_backend(tok)
        if fast is not None and fast(SELF_CHECK_TEXTS) == call_tokenizer(SELF_CHECK_TEXTS):
            encode_batch, backend = fast, "transformers, Rust backend"
        return cls(directory, encode_batch, decode, vocab_size, tok.eos_token_id, backend, tok)

    @classmethod
    def _load_with_tokenizers(cls, directory: Path) -> HFTokenizer:
        from tokenizers import Tokenizer

        path = directory / "tokenizer.json"
        if not path.is_file():
            raise CephaloError(
                f"the tokenizer in {directory} has no tokenizer.json; loading it needs the "
                f"`transformers` package: pip install 'cephalo[hf]'"
            )
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises plain Exceptions on bad JSON
            raise CephaloError(f"{path} is not a tokenizer JSON ({first_line(e)})") from e
        vocab_size = max(
            tok.get_vocab_size(with_added_tokens=True),
            max(tok.get_vocab().values(), default=-1) + 1,
        )

        def encode_batch(texts: list[str]) -> list[list[int]]:
            encode = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
            return [e.ids for e in encode(texts, add_special_tokens=False)]

        def decode(ids: list[int]) -> str:
            return tok.decode(ids)

        return cls(
            directory, encode_batch, decode, vocab_size, _eos_id(directory, tok), "tokenizers"
        )


SELF_CHECK_TEXTS = [
    "Hello, world! It's 2024: caf\u00e9, na\u00efve, \u65e5\u672c\u8a9e, emoji \U0001f642.\n",
    "  leading spaces\n\n\ttabs\r\nand CRLF  trailing  \n",
    "def f(x):\n    return x ** 2  # code\n" * 3,
]
"""Texts on which the Rust backend must give exactly the ids of the tokenizer's own call."""


def _fast_backend(tok: Any) -> Callable[[list[str]], list[list[int]]] | None:
    """The Rust tokenizer behind a fast transformers tokenizer, called without offsets
    (`encode_batch_fast`): 2-4x the speed of the tokenizer's own `__call__` (measured on
    pydoc text), which builds offsets and Python-side structures we do not use. Used only
    where it gives the same ids (`SELF_CHECK_TEXTS`), so a tokenizer class that changes the
    text in Python first keeps its own path."""
    backend = getattr(tok, "backend_tokenizer", None) if getattr(tok, "is_fast", False) else None
    if backend is None:
        return None
    encode = getattr(backend, "encode_batch_fast", None) or backend.encode_batch

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    return encode_batch


def _eos_id(directory: Path, tok: Any) -> int | None:
    """The EOS of a tokenizer saved without transformers' help: tokenizer_config.json's
    `eos_token`, else config.json's `eos_token_id`."""
    eos = _read_json(directory / "tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):  # AddedToken serialised as {"content": ...}
        eos = eos.get("content")
    if isinstance(eos, str) and tok.token_to_id(eos) is not None:
        return int(tok.token_to_id(eos))
    eos_id = _read_json(directory / "config.json").get("eos_token_id")
    if isinstance(eos_id, list) and eos_id:
        eos_id = eos_id[0]
    return eos_id if isinstance(eos_id, int) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CephaloError(f"cannot read {path} ({e})") from e
    return data if isinstance(data, dict) else {}
