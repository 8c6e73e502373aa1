"""Token datasets and plan-invariant global batches.

A dataset is a directory written by `cephalo prepare-data` (format in docs/data.md):

    train.bin  train.json   flat token ids (uint16 / uint32) + JSON sidecar
    val.bin    val.json     held-out tokens (optional)
    tokenizer.json          the byte-level BPE (absent for the byte tokenizer)

`GlobalBatches` turns the train tokens into the training contract of DESIGN.md: the global
batch of step t is a fixed set of samples, whatever the plan. Ranks read consecutive slices
of it (`rank_slice`) and only those samples; `batch(step)` depends on the step alone, so a
resumed run (under any plan) sees exactly the batches it would have seen.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import operator
import os
import shutil
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from cephalo import envvars
from cephalo.errors import CephaloError
from cephalo.log import logger
from cephalo.train.tokenizer import (
    BYTE_TOKENIZER,
    BYTE_VOCAB_SIZE,
    BPETokenizer,
    TextTokenizer,
    load_or_train_tokenizer,
    load_tokenizer,
)

TOKEN_FORMAT = "cephalo-tokens"
TOKEN_FORMAT_VERSION = 1
TOKENIZER_FILE = "tokenizer.json"
TEXT_SUFFIXES = (".txt", ".md")
DEFAULT_VOCAB_SIZE = 2048
DEFAULT_VAL_FRACTION = 0.05
# Documents are joined with one blank line, so a sample may span two documents (as in
# GPT-2's pretraining); a separator token would not fit the 256-id byte vocabulary.
DOCUMENT_SEPARATOR = "\n\n"
# Long files are tokenized in pieces of about this many characters (cut after a newline) so
# memory stays bounded and the progress bar moves.
PIECE_CHARS = 1 << 20
PREPARE_HINT = "run `cephalo prepare-data --input TEXT_FILES_OR_DIRS --output DIR` first"


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
    """`byte`, or the tokenizer JSON's path relative to the sidecar's directory."""
    source_sha256: str
    """Checksum of the source texts (in order) this file was tokenized from."""
    split: str = "train"
    """`train` or `val`."""
    num_documents: int = 0
    """Number of source documents (files) the whole dataset was built from."""
    val_fraction: float = 0.0
    """Fraction of the dataset's tokens that went to the `val` split."""
    tokenizer_key: str = ""
    """What was asked for: `byte`, `bpe-<vocab>` (trained on this corpus) or
    `json-<sha256 prefix>` (a given tokenizer file). A rebuild is skipped when it matches."""
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
        self.file = open(self.tmp, "wb")  # noqa: SIM115 (closed in finish)
        self.num_tokens = 0

    def append(self, ids: Sequence[int]) -> None:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise CephaloError(
                f"the tokenizer produced id {int(arr.max())}, outside its vocab of "
                f"{self.vocab_size}: the tokenizer file is inconsistent; use another one"
            )
        arr.astype(self.dtype).tofile(self.file)
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
            shutil.copyfileobj(src, dst, 1 << 24)
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


# ----------------------------------------------------------------------------- corpora
@dataclass(frozen=True)
class Document:
    """One source text (a file, or one entry of the bundled corpus)."""

    name: str
    """Where it came from (a path, or `pydoc:<topic>`); for messages only."""
    text: str
    """Its contents."""


def default_corpus() -> list[Document]:
    """The bundled corpus: Python's own help topics (`pydoc_data.topics`, ~465 KB of English).

    It ships with every CPython, so the demo needs no download. Topics are taken in sorted
    order, so the corpus (and everything built from it) is deterministic for a Python version.
    """
    from pydoc_data.topics import topics

    return [Document(f"pydoc:{key}", topics[key]) for key in sorted(topics)]


def read_documents(inputs: Sequence[str | Path]) -> list[Document]:
    """Text files named directly, or found under directories (`*.txt`, `*.md`, recursively).

    Order: inputs as given; files inside a directory sorted by path (deterministic).
    """
    if not inputs:
        raise CephaloError("no input given: pass text files or directories with --input")
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
            if not found:
                raise CephaloError(
                    f"directory {path} holds no {' or '.join(TEXT_SUFFIXES)} files: "
                    f"point --input at text files or a directory of them"
                )
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise CephaloError(f"input {path} does not exist: pass text files or directories")
    docs = []
    for f in files:
        try:
            docs.append(Document(str(f), f.read_text(encoding="utf-8")))
        except UnicodeDecodeError as e:
            raise CephaloError(f"{f} is not UTF-8 text ({e}); convert it or leave it out") from e
    return docs


def corpus_checksum(documents: Iterable[Document]) -> str:
    """sha256 of the texts in order (names excluded: renaming a file changes no token)."""
    h = hashlib.sha256()
    for doc in documents:
        data = doc.text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))  # length prefix: no two corpora collide
        h.update(data)
    return h.hexdigest()


def _pieces(documents: Sequence[Document]) -> Iterator[str]:
    """The corpus as tokenizer input: each document cut after newlines into ~1 MB pieces,
    its last piece ending in the document separator."""
    for doc in documents:
        text = doc.text.rstrip("\n") + DOCUMENT_SEPARATOR
        start = 0
        while start < len(text):
            end = start + PIECE_CHARS
            if end < len(text):
                cut = text.rfind("\n", start, end)
                end = cut + 1 if cut > start else end
            yield text[start:end]
            start = end


# ----------------------------------------------------------------------------- preparation
@dataclass
class PreparedDataset:
    """What `prepare_dataset` made (or found already made)."""

    path: Path
    """The dataset directory."""
    train: TokenFileMeta
    """Sidecar of the train split."""
    val: TokenFileMeta
    """Sidecar of the validation split."""
    seconds: float
    """Time taken (tokenizer training + tokenization + writing); ~0 when cached."""
    cached: bool = False
    """True if an identical dataset already existed and was reused."""

    @property
    def num_tokens(self) -> int:
        return self.train.num_tokens + self.val.num_tokens


def _existing(out_dir: Path, want: dict) -> tuple[TokenFileMeta, TokenFileMeta] | None:
    """The dataset in `out_dir` if it was built from the same corpus with the same settings."""
    try:
        train, val = TokenFile(out_dir, "train"), TokenFile(out_dir, "val")
    except CephaloError:
        return None
    for meta in (train.meta, val.meta):
        if any(getattr(meta, k) != v for k, v in want.items()):
            return None
    if train.meta.tokenizer != BYTE_TOKENIZER and not (out_dir / train.meta.tokenizer).is_file():
        return None
    return train.meta, val.meta


def _same_corpus_tokenizer(out_dir: Path, source_sha: str, key: str) -> bool:
    try:
        old = TokenFileMeta.read(resolve_token_file(out_dir, "train"))
    except CephaloError:
        return False
    return old.source_sha256 == source_sha and old.tokenizer_key == key


def prepare_dataset(
    documents: Sequence[Document],
    out_dir: str | Path,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    tokenizer: str | Path | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    progress: bool = True,
    force: bool = False,
) -> PreparedDataset:
    """Tokenize `documents` into `out_dir` (train / val token files + tokenizer JSON).

    tokenizer: None trains a byte-level BPE of `vocab_size` on the documents; `byte` uses
    raw bytes (vocab 256); a path reuses that tokenizer JSON (copied into `out_dir`).
    A dataset already in `out_dir` from the same texts and settings is reused unless `force`.
    """
    started = time.perf_counter()
    out_dir = Path(out_dir)
    if not documents:
        raise CephaloError("the corpus is empty: pass at least one non-empty text file")
    if not 0.0 <= val_fraction < 1.0:
        raise CephaloError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if out_dir.exists() and not out_dir.is_dir():
        raise CephaloError(f"output {out_dir} exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)

    # Every rank of a job may call this at once: one builds, the others wait and reuse.
    with _exclusive(out_dir / ".prepare.lock"):
        return _prepare_locked(
            documents, out_dir, vocab_size, tokenizer, val_fraction, progress, force, started
        )


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _prepare_locked(
    documents: Sequence[Document],
    out_dir: Path,
    vocab_size: int,
    tokenizer: str | Path | None,
    val_fraction: float,
    progress: bool,
    force: bool,
    started: float,
) -> PreparedDataset:
    source_sha = corpus_checksum(documents)
    tokenizer_file = out_dir / TOKENIZER_FILE
    given: BPETokenizer | None = None
    if str(tokenizer) == BYTE_TOKENIZER or (tokenizer is None and vocab_size == BYTE_VOCAB_SIZE):
        key = BYTE_TOKENIZER
    elif tokenizer is None:
        key = f"bpe-{vocab_size}"
    else:
        given = BPETokenizer.load(tokenizer)
        key = "json-" + hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()[:16]
    want = {"source_sha256": source_sha, "val_fraction": val_fraction, "tokenizer_key": key}
    if not force and (found := _existing(out_dir, want)) is not None:
        logger.info(
            "dataset in %s is up to date (%d tokens)",
            out_dir,
            found[0].num_tokens + found[1].num_tokens,
        )
        return PreparedDataset(
            out_dir, found[0], found[1], time.perf_counter() - started, cached=True
        )

    # tokenizer.json depends only on the corpus and vocab size: keep the one in out_dir
    # only if it was trained on this corpus for this size
    keep_tokenizer = _same_corpus_tokenizer(out_dir, source_sha, key)
    # the old dataset (if any) stops being one before anything is overwritten: a crash from
    # here on leaves no sidecar, so nothing half-written can be mistaken for a dataset
    for split in ("train", "val"):
        (out_dir / f"{split}.json").unlink(missing_ok=True)

    from rich.progress import (
        BarColumn,
        Progress,
        SpinnerColumn,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = (
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
    )
    total_chars = sum(len(d.text) for d in documents)
    with Progress(*columns, disable=not progress) as bar:
        if key == BYTE_TOKENIZER:
            tok: TextTokenizer = load_tokenizer(BYTE_TOKENIZER)
        elif given is not None:
            tok = given
            given.save(tokenizer_file)
        else:
            if keep_tokenizer and tokenizer_file.is_file():
                # loaded as is: on a small corpus the BPE may hold fewer ids than asked
                tok = BPETokenizer.load(tokenizer_file)
            else:
                tokenizer_file.unlink(missing_ok=True)
                task = bar.add_task(f"training BPE tokenizer (vocab {vocab_size})", total=None)
                tok = load_or_train_tokenizer(_pieces(documents), vocab_size, tokenizer_file)
                bar.update(task, total=1, completed=1)

        writer = _TokenWriter(out_dir, token_dtype(tok.vocab_size), tok.vocab_size)
        task = bar.add_task(
            f"tokenizing {len(documents)} documents ({total_chars / 1e6:.1f}M chars)",
            total=total_chars,
        )
        batch: list[str] = []
        for piece in _pieces(documents):
            batch.append(piece)
            if sum(map(len, batch)) >= PIECE_CHARS:
                _encode_into(tok, batch, writer, bar, task)
                batch = []
        _encode_into(tok, batch, writer, bar, task)
        bar.update(task, completed=total_chars)

    if writer.num_tokens == 0:
        raise CephaloError("the corpus tokenized to 0 tokens: pass non-empty text files")
    meta = TokenFileMeta(
        dtype=writer.dtype.name,
        num_tokens=writer.num_tokens,
        vocab_size=tok.vocab_size,
        tokenizer=BYTE_TOKENIZER if key == BYTE_TOKENIZER else TOKENIZER_FILE,
        source_sha256=source_sha,
        num_documents=len(documents),
        val_fraction=val_fraction,
        tokenizer_key=key,
    )
    train, val = writer.finish(meta, val_fraction)
    seconds = time.perf_counter() - started
    logger.info(
        "prepared %s: %d train + %d val tokens, %s tokenizer (vocab %d), %.1fs",
        out_dir,
        train.num_tokens,
        val.num_tokens,
        tok.name,
        tok.vocab_size,
        seconds,
    )
    return PreparedDataset(out_dir, train, val, seconds)


def _encode_into(tok: TextTokenizer, batch: list[str], writer: _TokenWriter, bar, task) -> None:
    if not batch:
        return
    for ids in tok.encode_batch(batch):
        writer.append(ids)
    bar.advance(task, sum(map(len, batch)))


def prepare_default_corpus(
    out_dir: str | Path,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    progress: bool = False,
) -> PreparedDataset:
    """Build (or reuse) the bundled corpus's dataset in `out_dir`; a second call is instant."""
    tokenizer = BYTE_TOKENIZER if vocab_size == BYTE_VOCAB_SIZE else None
    return prepare_dataset(
        default_corpus(), out_dir, vocab_size, tokenizer, val_fraction, progress=progress
    )


BUILTIN_TOKENIZER = "builtin"
"""Config name of the byte tokenizer (`data.tokenizer = "builtin"`); same as `byte`."""
TRAINED_BPE = "bpe"
"""Config name for a byte-level BPE trained on the corpus with the model's vocab size."""


def default_cache_dir() -> Path:
    """Where prepared datasets are cached: `$CEPHALO_CACHE/data`, else `~/.cache/cephalo/data`."""
    root = os.environ.get(envvars.CACHE_ROOT)
    return (Path(root) if root else Path.home() / ".cache" / "cephalo") / "data"


def is_token_dataset(path: str | Path) -> bool:
    """True for a dataset directory or a token file (anything `GlobalBatches` opens)."""
    try:
        resolve_token_file(path)
    except CephaloError:
        return False
    return True


def resolve_dataset(
    path: str | Path | None,
    tokenizer: str = BUILTIN_TOKENIZER,
    vocab_size: int = BYTE_VOCAB_SIZE,
    cache_dir: str | Path | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    progress: bool = False,
) -> Path:
    """The token dataset a job's `[data]` config names, prepared and cached if needed.

    path: unset -> the bundled corpus; a dataset directory or token file -> used as is (it
    carries its own tokenizer); a text file or a directory of text files -> tokenized into
    `cache_dir` (default `default_cache_dir()`), once.
    tokenizer: `builtin` / `byte` -> bytes (vocab 256); `bpe` -> a byte-level BPE of
    `vocab_size` (the model's) trained on the corpus; else the path of a tokenizer JSON.
    Safe to call from every rank at once (one prepares, the others wait for it).
    """
    if path is not None and is_token_dataset(path):
        return Path(path)
    if tokenizer in (BUILTIN_TOKENIZER, BYTE_TOKENIZER):
        spec, vocab, key = BYTE_TOKENIZER, BYTE_VOCAB_SIZE, BYTE_TOKENIZER
    elif tokenizer == TRAINED_BPE:
        spec, vocab, key = None, vocab_size, f"bpe{vocab_size}"
    else:
        spec, vocab = tokenizer, vocab_size
        key = "tok-" + hashlib.sha256(str(Path(tokenizer).resolve()).encode()).hexdigest()[:8]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if path is None:
        documents, name = default_corpus(), "pydoc"
    else:
        documents = read_documents([path])
        where = hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:8]
        name = f"{Path(path).name}-{where}"
    out_dir = cache / f"{name}-{key}-val{val_fraction:g}"
    return prepare_dataset(documents, out_dir, vocab, spec, val_fraction, progress=progress).path


# ----------------------------------------------------------------------------- batches
class GlobalBatches:
    """Plan-invariant global batches over a token dataset.

    Samples are non-overlapping windows of `seq_len + 1` consecutive tokens (input_ids =
    window[:-1], labels = window[1:]). Each epoch visits the training windows in a seeded
    random order (seed and epoch number), `global_batch_size` windows per step; the last
    `num_train_windows % global_batch_size` windows of an epoch's order are skipped, so a
    batch never spans two epochs. Step t's batch is a pure function of (dataset, seq_len,
    global_batch_size, seed, t): there is no iterator state, so resuming is exact.

    Validation windows come from the dataset's `val` split if it has one, else they are the
    last `val_fraction` of the windows of the given token file (held out of training).
    """

    def __init__(
        self,
        data: str | Path,
        seq_len: int,
        global_batch_size: int,
        seed: int = 0,
        val_fraction: float = DEFAULT_VAL_FRACTION,
        model_vocab_size: int | None = None,
    ):
        for name, value in (("seq_len", seq_len), ("global_batch_size", global_batch_size)):
            if not isinstance(value, int) or value < 1:
                raise CephaloError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(seed, int) or seed < 0:
            raise CephaloError(f"seed must be a non-negative integer, got {seed!r}")
        if not 0.0 <= val_fraction < 1.0:
            raise CephaloError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.seq_len, self.global_batch_size, self.seed = seq_len, global_batch_size, seed
        self.window = seq_len + 1
        self.train_file = TokenFile(data, "train")
        self.vocab_size = self.train_file.vocab_size
        if model_vocab_size is not None and model_vocab_size < self.vocab_size:
            raise CephaloError(
                f"dataset {data} uses a vocabulary of {self.vocab_size} ids but the model has "
                f"only {model_vocab_size}: set the model's vocab_size to >= {self.vocab_size}"
            )

        windows = self.train_file.num_tokens // self.window
        sidecar = self.train_file.sidecar
        if sidecar.name == "train.json" and sidecar.with_name("val.json").is_file():
            self.val_file = TokenFile(sidecar.with_name("val.json"))
            if self.val_file.vocab_size != self.vocab_size:
                raise CephaloError(
                    f"{self.val_file.sidecar} and {self.train_file.sidecar} disagree on the "
                    f"vocab size: prepare the dataset again"
                )
            self.num_train_windows = windows
            self.num_val_windows = self.val_file.num_tokens // self.window
            self._val_start = 0
        else:
            self.val_file = self.train_file
            held_out = math.ceil(windows * val_fraction) if windows > 1 else 0
            self.num_train_windows = windows - held_out
            self.num_val_windows = held_out
            self._val_start = self.num_train_windows

        if self.num_train_windows < global_batch_size:
            raise CephaloError(
                f"dataset {data} has {self.num_train_windows} training windows of "
                f"{self.window} tokens ({self.train_file.num_tokens} tokens), but one global "
                f"batch needs {global_batch_size}: use a smaller seq_len or global batch size, "
                f"or more data (`cephalo prepare-data`)"
            )
        self.steps_per_epoch = self.num_train_windows // global_batch_size
        self._order_cache: dict[int, np.ndarray] = {}

    # ---------------------------------------------------------------- train
    @property
    def tokens_per_step(self) -> int:
        """Tokens predicted per step (global batch x seq_len)."""
        return self.global_batch_size * self.seq_len

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The training windows in the order epoch `epoch` visits them."""
        order = self._order_cache.get(epoch)
        if order is None:
            # seeded by (seed, epoch) through SeedSequence: epochs of different seeds
            # never share an order (seed + epoch would make seed 0 epoch 1 == seed 1 epoch 0)
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_train_windows)
            if len(self._order_cache) >= 2:  # consecutive steps need at most two epochs
                self._order_cache.pop(min(self._order_cache))
            self._order_cache[epoch] = order
        return order

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole global batch of `step`: (input_ids, labels), each [B, seq_len] int64."""
        return self.rank_slice(step, 0, self.global_batch_size)

    def rank_slice(self, step: int, offset: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples [offset, offset + size) of step's global batch; reads only those windows.

        Rank i passes offset = plan.batch_offsets()[i], size = its batch_size (may be 0).
        """
        step, offset, size = operator.index(step), operator.index(offset), operator.index(size)
        if step < 0:
            raise CephaloError(f"step must be a non-negative integer, got {step}")
        if offset < 0 or size < 0 or offset + size > self.global_batch_size:
            raise CephaloError(
                f"slice [{offset}, {offset + size}) is outside the global batch of "
                f"{self.global_batch_size}: the plan's batch sizes must sum to the global batch"
            )
        epoch, index = divmod(step, self.steps_per_epoch)
        start = index * self.global_batch_size + offset
        windows = self.epoch_order(epoch)[start : start + size]
        return self._read(self.train_file, windows)

    # ---------------------------------------------------------------- validation
    def num_val_batches(self, batch_size: int) -> int:
        return math.ceil(self.num_val_windows / batch_size)

    def val_batch(
        self, index: int, batch_size: int, offset: int = 0, size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Validation batch `index` (windows in file order, the last one may be smaller),
        or samples [offset, offset + size) of it."""
        if self.num_val_windows == 0:
            raise CephaloError(
                "the dataset has no validation windows: prepare it with a val fraction > 0 "
                "(`cephalo prepare-data --val-fraction`) or pass val_fraction > 0"
            )
        if batch_size < 1:
            raise CephaloError(f"validation batch size must be >= 1, got {batch_size}")
        if not 0 <= index < self.num_val_batches(batch_size):
            raise CephaloError(
                f"validation batch {index} does not exist: there are "
                f"{self.num_val_batches(batch_size)} of {batch_size} windows"
            )
        first = index * batch_size
        count = min(batch_size, self.num_val_windows - first)
        size = count - offset if size is None else size
        if offset < 0 or size < 0 or offset + size > count:
            raise CephaloError(f"slice [{offset}, {offset + size}) is outside a batch of {count}")
        windows = np.arange(
            self._val_start + first + offset, self._val_start + first + offset + size
        )
        return self._read(self.val_file, windows)

    def val_batches(self, n: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first `n` validation batches (fewer if the split is smaller); always the same."""
        if n <= 0:
            return []
        if self.num_val_windows == 0:
            self.val_batch(0, batch_size)  # raises the explanatory error
        count = min(n, self.num_val_batches(batch_size))
        return [self.val_batch(i, batch_size) for i in range(count)]

    # ---------------------------------------------------------------- reading
    def _read(self, file: TokenFile, windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        index = np.asarray(windows, dtype=np.int64)[:, None] * self.window + np.arange(self.window)
        samples = np.asarray(file.tokens[index], dtype=np.int64).reshape(len(windows), self.window)
        if samples.size and samples.max() >= self.vocab_size:
            raise CephaloError(
                f"{file.bin_path} holds token id {int(samples.max())}, but its vocab size is "
                f"{self.vocab_size}: the file is corrupt; prepare the data again"
            )
        t = torch.from_numpy(samples)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def describe(self) -> str:
        return (
            f"{self.train_file.num_tokens} train tokens, vocab {self.vocab_size}: "
            f"{self.num_train_windows} windows of {self.window}, {self.steps_per_epoch} "
            f"steps/epoch at batch {self.global_batch_size}; {self.num_val_windows} val windows"
        )
