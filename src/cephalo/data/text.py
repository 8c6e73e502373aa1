"""Token datasets and plan-invariant global batches.

A dataset is a directory written by `cephalo prepare-data` (format in docs/data.md):

    train.bin  train.json   flat token ids (uint16 / uint32) + JSON sidecar
    val.bin    val.json     held-out tokens (optional)
    tokenizer.json          the byte-level BPE or given tokenizer JSON, or
    tokenizer/              a model's Hugging Face tokenizer (absent for the byte tokenizer)

Corpora (text, JSON Lines, Parquet, datasets directories) are read as a stream by
`corpus.py`; this module tokenizes that stream in pieces and appends the ids to the token
file as it goes, so memory stays bounded whatever the corpus size.

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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from cephalo import envvars
from cephalo.data.corpus import (
    DEFAULT_TEXT_FIELD,
    PIECE_CHARS,
    Corpus,
    Document,
    Piece,
    default_corpus,
)
from cephalo.data.hf_tokenizer import HFTokenizer, has_tokenizer, tokenizer_fingerprint
from cephalo.data.tokenizer import (
    BYTE_TOKENIZER,
    BYTE_VOCAB_SIZE,
    BPETokenizer,
    TextTokenizer,
    load_or_train_tokenizer,
    load_tokenizer,
)
from cephalo.errors import CephaloError
from cephalo.log import logger
from cephalo.modeling.registry import model_directory

TOKEN_FORMAT = "cephalo-tokens"
TOKEN_FORMAT_VERSION = 1
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_DIR = "tokenizer"
"""Where a dataset keeps a copy of the Hugging Face tokenizer its ids came from."""
DEFAULT_VOCAB_SIZE = 2048
DEFAULT_VAL_FRACTION = 0.05
# Without an end-of-document token (the byte tokenizer: all 256 ids are bytes; our BPE:
# trained without special tokens) documents are joined with one blank line, so a sample
# may span two documents, as in GPT-2's pretraining. A tokenizer with an EOS puts it
# between documents instead.
DOCUMENT_SEPARATOR = "\n\n"
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
    if train.meta.tokenizer != BYTE_TOKENIZER and not (out_dir / train.meta.tokenizer).exists():
        return None
    return train.meta, val.meta


def _same_corpus_tokenizer(out_dir: Path, source_sha: str, key: str) -> bool:
    try:
        old = TokenFileMeta.read(resolve_token_file(out_dir, "train"))
    except CephaloError:
        return False
    return old.source_sha256 == source_sha and old.tokenizer_key == key


def vocab_too_large(vocab_size: int, tokenizer: str, model_vocab_size: int, model: str) -> str:
    """The one message for ids that would index past a model's embedding."""
    return (
        f"{tokenizer} has {vocab_size:,} ids but {model} has only {model_vocab_size:,} embedding "
        f"rows (vocab_size): its ids would index past the embedding. Use a tokenizer that fits "
        f'the model (data.tokenizer = "auto" takes the model directory\'s own) or a model whose '
        f"vocab_size is at least {vocab_size:,}"
    )


@dataclass(frozen=True)
class _TokenizerChoice:
    """What a `tokenizer` argument of `prepare_dataset` asks for."""

    key: str
    """The sidecar's `tokenizer_key`."""
    stored_as: str
    """The sidecar's `tokenizer`: `byte`, `tokenizer.json` or `tokenizer`."""
    loaded: TextTokenizer | None
    """The tokenizer, or None: a BPE is to be trained on the corpus."""
    label: str
    """How messages name it."""


def _choose_tokenizer(tokenizer: str | Path | None, vocab_size: int) -> _TokenizerChoice:
    if str(tokenizer) == BYTE_TOKENIZER or (tokenizer is None and vocab_size == BYTE_VOCAB_SIZE):
        return _TokenizerChoice(
            BYTE_TOKENIZER, BYTE_TOKENIZER, load_tokenizer(BYTE_TOKENIZER), "the byte tokenizer"
        )
    if tokenizer is None:
        return _TokenizerChoice(f"bpe-{vocab_size}", TOKENIZER_FILE, None, f"a BPE of {vocab_size}")
    path = Path(tokenizer)
    if path.is_dir():
        loaded = HFTokenizer.load(path)
        key = "hf-" + tokenizer_fingerprint(path)
        return _TokenizerChoice(key, TOKENIZER_DIR, loaded, f"the tokenizer in {path}")
    bpe = BPETokenizer.load(path)
    key = "json-" + hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return _TokenizerChoice(key, TOKENIZER_FILE, bpe, f"the tokenizer {path}")


def prepare_dataset(
    documents: Corpus | Sequence[Document],
    out_dir: str | Path,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    tokenizer: str | Path | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    progress: bool = True,
    force: bool = False,
    max_vocab_size: int | None = None,
    model: str = "the model",
    piece_chars: int = PIECE_CHARS,
) -> PreparedDataset:
    """Tokenize a corpus into `out_dir` (train / val token files + the tokenizer).

    documents: a `Corpus` (files read as a stream) or documents in memory.
    tokenizer: None trains a byte-level BPE of `vocab_size` on the corpus; `byte` uses
    raw bytes (vocab 256); a directory uses its saved Hugging Face tokenizer (EOS between
    documents); another path reuses that tokenizer JSON. The tokenizer is copied into `out_dir`.
    max_vocab_size: the embedding rows of `model`; a tokenizer with more ids is refused
    before anything is read. The corpus is tokenized `piece_chars` characters at a time and
    written as it goes. A dataset already in `out_dir` from the same sources and settings is
    reused unless `force`.
    """
    started = time.perf_counter()
    out_dir = Path(out_dir)
    corpus = documents if isinstance(documents, Corpus) else Corpus.from_documents(documents)
    if not corpus.sources or (
        not isinstance(documents, Corpus) and not any(d.text for d in documents)
    ):
        raise CephaloError("the corpus is empty: pass at least one non-empty text file")
    if not 0.0 <= val_fraction < 1.0:
        raise CephaloError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if piece_chars < 1:
        raise CephaloError(f"piece_chars must be >= 1, got {piece_chars}")
    if out_dir.exists() and not out_dir.is_dir():
        raise CephaloError(f"output {out_dir} exists and is not a directory")
    choice = _choose_tokenizer(tokenizer, vocab_size)
    wanted_vocab = choice.loaded.vocab_size if choice.loaded is not None else vocab_size
    if max_vocab_size is not None and wanted_vocab > max_vocab_size:
        raise CephaloError(vocab_too_large(wanted_vocab, choice.label, max_vocab_size, model))
    out_dir.mkdir(parents=True, exist_ok=True)

    # Every rank of a job may call this at once: one builds, the others wait and reuse.
    with _exclusive(out_dir / ".prepare.lock"):
        return _prepare_locked(
            corpus, out_dir, vocab_size, choice, val_fraction, progress, force, piece_chars, started
        )


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _progress_bar(progress: bool):
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        SpinnerColumn,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    return Progress(
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        disable=not progress,
    )


def _prepare_locked(
    corpus: Corpus,
    out_dir: Path,
    vocab_size: int,
    choice: _TokenizerChoice,
    val_fraction: float,
    progress: bool,
    force: bool,
    piece_chars: int,
    started: float,
) -> PreparedDataset:
    want = {"val_fraction": val_fraction, "tokenizer_key": choice.key}
    stat = corpus.stat_fingerprint()
    if (
        not force
        and stat is not None
        and (found := _existing(out_dir, {**want, "source_stat": stat}))
    ):
        return _cached(out_dir, found, started)

    size = corpus.size_bytes()
    with _progress_bar(progress) as bar:
        task = bar.add_task(f"checking {corpus.describe()}", total=size)
        source_sha = corpus.checksum(lambda n: bar.advance(task, n))
        bar.remove_task(task)
        if not force and (found := _existing(out_dir, {**want, "source_sha256": source_sha})):
            if stat is not None:  # unchanged content, touched files: remember the new stat
                found = tuple(_restamp(out_dir, m, stat) for m in found)  # type: ignore[assignment]
            return _cached(out_dir, found, started)

        # tokenizer.json depends only on the corpus and vocab size: keep the one in out_dir
        # only if it was trained on this corpus for this size
        keep_tokenizer = _same_corpus_tokenizer(out_dir, source_sha, choice.key)
        # the old dataset (if any) stops being one before anything is overwritten: a crash from
        # here on leaves no sidecar, so nothing half-written can be mistaken for a dataset
        for split in ("train", "val"):
            (out_dir / f"{split}.json").unlink(missing_ok=True)

        tokenizer_file = out_dir / TOKENIZER_FILE
        tok: TextTokenizer
        if choice.stored_as != TOKENIZER_DIR:  # no stale copy of another kind of tokenizer
            shutil.rmtree(out_dir / TOKENIZER_DIR, ignore_errors=True)
        if choice.loaded is not None:
            tok = choice.loaded
            if choice.stored_as == TOKENIZER_DIR:
                tokenizer_file.unlink(missing_ok=True)
                tok.save(out_dir / TOKENIZER_DIR)  # type: ignore[attr-defined]
            elif choice.stored_as == TOKENIZER_FILE:
                tok.save(tokenizer_file)  # type: ignore[attr-defined]
        elif keep_tokenizer and tokenizer_file.is_file():
            # loaded as is: on a small corpus the BPE may hold fewer ids than asked
            tok = BPETokenizer.load(tokenizer_file)
        else:
            tokenizer_file.unlink(missing_ok=True)
            task = bar.add_task(f"training BPE tokenizer (vocab {vocab_size})", total=size)
            texts = _advancing(corpus.pieces(DOCUMENT_SEPARATOR, piece_chars), bar, task)
            tok = load_or_train_tokenizer(texts, vocab_size, tokenizer_file)
            corpus.check_not_empty()
            bar.remove_task(task)

        writer = _TokenWriter(out_dir, token_dtype(tok.vocab_size), tok.vocab_size)
        task = bar.add_task(f"tokenizing {corpus.describe()}", total=size)
        try:
            _tokenize_into(corpus, tok, writer, piece_chars, lambda n: bar.advance(task, n))
            corpus.check_not_empty()
            if writer.num_tokens == 0:
                raise CephaloError(
                    f"{corpus.describe()} tokenized to 0 tokens: pass data with text"
                )
        except BaseException:
            writer.abort()
            raise
        bar.update(task, completed=size)

    meta = TokenFileMeta(
        dtype=writer.dtype.name,
        num_tokens=writer.num_tokens,
        vocab_size=tok.vocab_size,
        tokenizer=choice.stored_as,
        source_sha256=source_sha,
        num_documents=corpus.num_documents,
        val_fraction=val_fraction,
        tokenizer_key=choice.key,
        source_stat=stat or "",
    )
    train, val = writer.finish(meta, val_fraction)
    seconds = time.perf_counter() - started
    logger.info(
        "prepared %s: %d documents -> %d train + %d val tokens, %s tokenizer (vocab %d), %.1fs",
        out_dir,
        corpus.num_documents,
        train.num_tokens,
        val.num_tokens,
        tok.name,
        tok.vocab_size,
        seconds,
    )
    return PreparedDataset(out_dir, train, val, seconds)


def _cached(
    out_dir: Path, found: tuple[TokenFileMeta, TokenFileMeta], started: float
) -> PreparedDataset:
    logger.info(
        "dataset in %s is up to date (%d tokens)",
        out_dir,
        found[0].num_tokens + found[1].num_tokens,
    )
    return PreparedDataset(out_dir, found[0], found[1], time.perf_counter() - started, cached=True)


def _restamp(out_dir: Path, meta: TokenFileMeta, stat: str) -> TokenFileMeta:
    meta = TokenFileMeta(**{**asdict(meta), "source_stat": stat})
    _write_atomic(out_dir / f"{meta.split}.json", meta.to_json())
    return meta


def _advancing(pieces: Iterator[Piece], bar, task) -> Iterator[str]:
    for piece in pieces:
        bar.advance(task, piece.source_bytes)
        yield piece.text


def _tokenize_into(
    corpus: Corpus,
    tok: TextTokenizer,
    writer: _TokenWriter,
    piece_chars: int,
    advance: Callable[[int], None],
) -> None:
    """Tokenize the corpus in batches of about `piece_chars` characters, appending each
    batch's ids to `writer` (the tokenizer's EOS after every document, if it has one)."""
    eos = tok.eos_id
    separator = "" if eos is not None else DOCUMENT_SEPARATOR
    batch: list[Piece] = []
    chars = 0
    for piece in corpus.pieces(separator, piece_chars):
        batch.append(piece)
        chars += len(piece.text)
        if chars >= piece_chars:
            _encode_batch_into(tok, batch, eos, writer, advance)
            batch, chars = [], 0
    _encode_batch_into(tok, batch, eos, writer, advance)


def _encode_batch_into(
    tok: TextTokenizer,
    batch: list[Piece],
    eos: int | None,
    writer: _TokenWriter,
    advance: Callable[[int], None],
) -> None:
    if not batch:
        return
    # ids stay in the tokenizer's own integer type until the writer has range-checked them
    parts: list[np.ndarray] = []
    end = np.array([eos if eos is not None else 0])
    for piece, piece_ids in zip(batch, tok.encode_batch([p.text for p in batch]), strict=True):
        parts.append(
            piece_ids if isinstance(piece_ids, np.ndarray) else np.array(piece_ids, np.int64)
        )
        if piece.ends_document and eos is not None:
            parts.append(end)
    writer.append(np.concatenate(parts))
    advance(sum(p.source_bytes for p in batch))


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


AUTO_TOKENIZER = "auto"
"""Config name of the default: the model directory's tokenizer if it has one, else bytes."""
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


def resolve_tokenizer(tokenizer: str, model_name: str | None = None) -> str | None:
    """What a config's `data.tokenizer` asks for, as `prepare_dataset`'s `tokenizer` argument:
    `byte`, None (train a BPE), or a path (a tokenizer JSON or a tokenizer directory).

    `auto`: the tokenizer in the model's directory (`model_directory(model_name)`) when it
    holds one, else the byte tokenizer. `builtin` / `byte`: bytes. `bpe`: a BPE trained on
    the corpus. Anything else: a path.
    """
    if tokenizer == AUTO_TOKENIZER:
        directory = model_directory(model_name) if model_name else None
        if directory is not None and has_tokenizer(directory):
            return str(directory)
        if directory is not None:
            logger.info(
                "model directory %s holds no tokenizer: using the byte tokenizer", directory
            )
        return BYTE_TOKENIZER
    if tokenizer in (BUILTIN_TOKENIZER, BYTE_TOKENIZER):
        return BYTE_TOKENIZER
    if tokenizer == TRAINED_BPE:
        return None
    return tokenizer


def _warn_if_tokenized_otherwise(dataset: Path, model_tokenizer: Path) -> None:
    """A prepared dataset is used as is; say so when its ids come from another tokenizer
    than the model's own (they would then stand for other tokens)."""
    used = TokenFileMeta.read(resolve_token_file(dataset)).tokenizer_key
    own = "hf-" + tokenizer_fingerprint(model_tokenizer)
    if used != own:
        logger.warning(
            "dataset %s was tokenized with %s, not with the tokenizer of model %s (%s): its ids "
            "may stand for other tokens. Prepare it with `cephalo prepare-data --tokenizer %s`",
            dataset,
            used or "an unknown tokenizer",
            model_tokenizer,
            own,
            model_tokenizer,
        )


def _cache_key(spec: str | None, vocab_size: int) -> str:
    """The tokenizer part of a cached dataset's directory name: by content, so two
    tokenizers never share a cache entry and switching back and forth rebuilds nothing."""
    if spec == BYTE_TOKENIZER:
        return BYTE_TOKENIZER
    if spec is None:
        return f"bpe{vocab_size}"
    path = Path(spec)
    if path.is_dir():
        return "hf-" + tokenizer_fingerprint(path)
    if not path.is_file():
        BPETokenizer.load(path)  # raises the explanatory error
    return "json-" + hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def resolve_dataset(
    path: str | Path | None,
    tokenizer: str = AUTO_TOKENIZER,
    vocab_size: int = BYTE_VOCAB_SIZE,
    cache_dir: str | Path | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    progress: bool = False,
    model_name: str | None = None,
    text_field: str = DEFAULT_TEXT_FIELD,
) -> Path:
    """The token dataset a job's `[data]` config names, prepared and cached if needed.

    path: unset -> the bundled corpus; a dataset directory or token file -> used as is (it
    carries its own tokenizer); text, JSON Lines or Parquet files, a directory of them, or a
    datasets directory (`save_to_disk`) -> tokenized into `cache_dir` (default
    `default_cache_dir()`), once. `text_field` names the field / column holding the text.
    tokenizer: see `resolve_tokenizer` (`auto` looks in `model_name`'s directory).
    vocab_size: the model's; a tokenizer with more ids is an error, and `bpe` trains this many.
    Safe to call from every rank at once (one prepares, the others wait for it).
    """
    spec = resolve_tokenizer(tokenizer, model_name)
    if path is not None and is_token_dataset(path):
        if tokenizer == AUTO_TOKENIZER and spec != BYTE_TOKENIZER:
            _warn_if_tokenized_otherwise(Path(path), Path(spec))  # type: ignore[arg-type]
        return Path(path)
    key = _cache_key(spec, vocab_size)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if path is None:
        corpus, name = Corpus.bundled(), "pydoc"
    else:
        corpus = Corpus.from_paths([path], text_field)
        where = f"{Path(path).resolve()}\0{text_field}"
        name = f"{Path(path).name}-{hashlib.sha256(where.encode()).hexdigest()[:8]}"
    out_dir = cache / f"{name}-{key}-val{val_fraction:g}"
    model = f"model {model_name}" if model_name else "the model"
    return prepare_dataset(
        corpus,
        out_dir,
        vocab_size,
        spec,
        val_fraction,
        progress=progress,
        max_vocab_size=vocab_size,
        model=model,
    ).path


# ----------------------------------------------------------------------------- batches
class EpochOrder:
    """Which training windows each step's global batch takes: every epoch visits the
    `num_windows` windows in a permutation seeded by (seed, epoch), `global_batch_size` per
    step; the last incomplete batch of an epoch is skipped. Shared by token windows
    (`GlobalBatches`) and chat samples (`chat_data.DocumentBatches`)."""

    def __init__(self, num_windows: int, global_batch_size: int, seed: int):
        self.num_windows, self.global_batch_size, self.seed = num_windows, global_batch_size, seed
        self.steps_per_epoch = num_windows // global_batch_size
        self._cache: dict[int, np.ndarray] = {}

    def order(self, epoch: int) -> np.ndarray:
        """The windows in the order epoch `epoch` visits them."""
        order = self._cache.get(epoch)
        if order is None:
            # seeded by (seed, epoch) through SeedSequence: epochs of different seeds
            # never share an order (seed + epoch would make seed 0 epoch 1 == seed 1 epoch 0)
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            if len(self._cache) >= 2:  # consecutive steps need at most two epochs
                self._cache.pop(min(self._cache))
            self._cache[epoch] = order
        return order

    def windows(self, step: int, offset: int, size: int) -> np.ndarray:
        """Windows of samples [offset, offset + size) of step's global batch."""
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
        return self.order(epoch)[start : start + size]


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
                vocab_too_large(self.vocab_size, f"dataset {data}", model_vocab_size, "the model")
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
        self.order = EpochOrder(self.num_train_windows, global_batch_size, seed)
        self.steps_per_epoch = self.order.steps_per_epoch

    # ---------------------------------------------------------------- train
    @property
    def tokens_per_step(self) -> int:
        """Tokens predicted per step (global batch x seq_len)."""
        return self.global_batch_size * self.seq_len

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The training windows in the order epoch `epoch` visits them."""
        return self.order.order(epoch)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole global batch of `step`: (input_ids, labels), each [B, seq_len] int64."""
        return self.rank_slice(step, 0, self.global_batch_size)

    def rank_slice(self, step: int, offset: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples [offset, offset + size) of step's global batch; reads only those windows.

        Rank i passes offset = plan.batch_offsets()[i], size = its batch_size (may be 0).
        """
        return self._read(self.train_file, self.order.windows(step, offset, size))

    def rank_positions(self, step: int, offset: int, size: int) -> None:
        """Token windows hold no documents of their own: positions 0, 1, ... (chat data's
        `DocumentBatches` gives per-document positions when packing)."""
        return None

    # ---------------------------------------------------------------- validation
    def num_val_batches(self, batch_size: int) -> int:
        return math.ceil(self.num_val_windows / batch_size)

    def val_positions(self, index: int, batch_size: int, offset: int = 0, size=None) -> None:
        """As `rank_positions`: None."""
        return None

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
