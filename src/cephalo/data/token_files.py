"""Token files: a dataset directory's `train` / `val` token arrays and their metadata (format in
docs/data.md), read memory-mapped (`TokenFile`) and written in pieces (`_TokenWriter`)."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from cephalo.data.tokenizer import (
    BYTE_TOKENIZER,
    TextTokenizer,
    load_tokenizer,
)
from cephalo.errors import CephaloError

TOKEN_FORMAT = "cephalo-tokens"
TOKEN_FORMAT_VERSION = 1
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_DIR = "tokenizer"
"""Where a dataset keeps a copy of the Hugging Face tokenizer its ids came from."""
PREPARE_HINT = "run `cephalo prepare-data --input FILES_OR_DIRS --output DIR` first"


# ----------------------------------------------------------------------------- token files
@dataclass
class TokenFileMeta:
    """The JSON sidecar of a token file: what the `.bin` next to it holds."""

    dtype: str
    """numpy dtype of the ids: `uint16` when the vocab fits in 16 bits, else `uint32`."""
    num_tokens: int
    """Number of ids in the `.bin` file (its size is num_tokens x itemsize)."""
    vocab_size: int
    """Every id is < vocab_size (the tokenizer's vocabulary)."""
    tokenizer: str
    """`byte`, or where the tokenizer is, relative to the sidecar's directory: `tokenizer.json`
    (a tokenizer JSON) or `tokenizer` (a Hugging Face tokenizer directory)."""
    source_sha256: str
    """Checksum of the source texts (in order) this file was tokenized from."""
    split: str = "train"
    """`train` or `val`."""
    num_documents: int = 0
    """Number of source documents (text files, JSON lines, rows) with text the whole dataset
    was built from."""
    val_fraction: float = 0.0
    """Fraction of the dataset's tokens that went to the `val` split."""
    tokenizer_key: str = ""
    """What was asked for: `byte`, `bpe-<vocab>` (trained on this corpus),
    `json-<sha256 prefix>` (a given tokenizer file) or `hf-<sha256 prefix>` (a Hugging Face
    tokenizer directory, by its files). A rebuild is skipped when it matches."""
    source_stat: str = ""
    """Paths, sizes and modification times of the source files (a hash): when they match, the
    sources are not read again to check `source_sha256`. Empty for texts given in memory."""
    format: str = TOKEN_FORMAT
    version: int = TOKEN_FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def read(cls, path: Path) -> TokenFileMeta:
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise CephaloError(
                f"cannot read token file sidecar {path} ({e}); {PREPARE_HINT}"
            ) from e
        if not isinstance(d, dict) or d.get("format") != TOKEN_FORMAT:
            raise CephaloError(f"{path} is not a cephalo token file sidecar; {PREPARE_HINT}")
        if d.get("version") != TOKEN_FORMAT_VERSION:
            raise CephaloError(
                f"{path} has token format version {d.get('version')}, this cephalo reads "
                f"{TOKEN_FORMAT_VERSION}: prepare the data again with `cephalo prepare-data`"
            )
        known = set(cls.__dataclass_fields__)
        try:
            return cls(**{k: v for k, v in d.items() if k in known})
        except TypeError as e:
            raise CephaloError(f"{path} is missing fields ({e}); {PREPARE_HINT}") from e


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest id type for a vocabulary (ids go up to vocab_size - 1)."""
    return np.dtype(np.uint16 if vocab_size <= (1 << 16) else np.uint32)


def resolve_token_file(path: str | Path, split: str = "train") -> Path:
    """The sidecar of a token file given as a dataset dir, `X.bin`, `X.json` or `X`."""
    path = Path(path)
    if path.is_dir():
        sidecar = path / f"{split}.json"
    elif path.suffix in (".bin", ".json"):
        sidecar = path.with_suffix(".json")
    else:
        sidecar = path.with_name(path.name + ".json")
    if not sidecar.is_file():
        raise CephaloError(f"no token file at {path} (looked for {sidecar}); {PREPARE_HINT}")
    return sidecar


class TokenFile:
    """A token file opened read-only as a memory map (nothing is read until indexed)."""

    def __init__(self, path: str | Path, split: str = "train"):
        self.sidecar = resolve_token_file(path, split)
        self.meta = TokenFileMeta.read(self.sidecar)
        self.bin_path = self.sidecar.with_suffix(".bin")
        dtype = np.dtype(self.meta.dtype)
        if not self.bin_path.is_file():
            raise CephaloError(f"{self.bin_path} is missing (its sidecar exists); {PREPARE_HINT}")
        size = self.bin_path.stat().st_size
        if size != self.meta.num_tokens * dtype.itemsize:
            raise CephaloError(
                f"{self.bin_path} holds {size} bytes, its sidecar says {self.meta.num_tokens} "
                f"{dtype} ids: the file is truncated or corrupt; prepare the data again"
            )
        # np.memmap cannot map an empty file
        self.tokens: np.ndarray = (
            np.memmap(self.bin_path, dtype=dtype, mode="r")
            if self.meta.num_tokens
            else np.zeros(0, dtype=dtype)
        )

    @property
    def num_tokens(self) -> int:
        return self.meta.num_tokens

    @property
    def vocab_size(self) -> int:
        return self.meta.vocab_size

    def tokenizer(self) -> TextTokenizer:
        """The tokenizer these ids came from (to decode samples)."""
        if self.meta.tokenizer == BYTE_TOKENIZER:
            return load_tokenizer(BYTE_TOKENIZER)
        return load_tokenizer(self.sidecar.parent / self.meta.tokenizer)


class _TokenWriter:
    """Appends ids to `<stem>.bin.tmp`; `finish` splits off the val tail and publishes.

    Files appear under their final names only when complete (bin first, sidecar last), so a
    crash never leaves a dataset that looks whole.
    """

    def __init__(self, out_dir: Path, dtype: np.dtype, vocab_size: int):
        self.out_dir, self.dtype, self.vocab_size = out_dir, dtype, vocab_size
        self.tmp = out_dir / "train.bin.tmp"
        self.file = open(self.tmp, "wb")  # noqa: SIM115 (closed in finish or abort)
        self.num_tokens = 0

    def abort(self) -> None:
        """Drop what was written (an error stopped the preparation)."""
        self.file.close()
        self.tmp.unlink(missing_ok=True)

    def append(self, ids: Sequence[int] | np.ndarray) -> None:
        arr = np.asarray(ids)
        if arr.dtype.kind not in "iu":
            arr = arr.astype(np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise CephaloError(
                f"the tokenizer produced id {int(arr.max())}, outside its vocab of "
                f"{self.vocab_size}: the tokenizer file is inconsistent; use another one"
            )
        arr.astype(self.dtype, copy=False).tofile(self.file)
        self.num_tokens += arr.size

    def finish(
        self, meta: TokenFileMeta, val_fraction: float
    ) -> tuple[TokenFileMeta, TokenFileMeta]:
        self.file.close()
        num_val = math.floor(self.num_tokens * val_fraction)
        num_train = self.num_tokens - num_val
        itemsize = self.dtype.itemsize
        val_tmp = self.out_dir / "val.bin.tmp"
        with open(self.tmp, "rb") as src, open(val_tmp, "wb") as dst:
            src.seek(num_train * itemsize)
            shutil.copyfileobj(src, dst, 1 << 20)
        os.truncate(self.tmp, num_train * itemsize)
        metas = []
        for split, tmp, n in (("train", self.tmp, num_train), ("val", val_tmp, num_val)):
            m = TokenFileMeta(**{**asdict(meta), "split": split, "num_tokens": n})
            os.replace(tmp, self.out_dir / f"{split}.bin")
            _write_atomic(self.out_dir / f"{split}.json", m.to_json())
            metas.append(m)
        return metas[0], metas[1]


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
