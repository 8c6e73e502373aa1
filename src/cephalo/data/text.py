"""Plain-text datasets: a corpus (text, JSON Lines, Parquet, `datasets` directories, read as a
stream by `corpus.py`) tokenized in pieces and appended to token files as it goes, so memory
stays bounded whatever the corpus size; the cached default corpus; which dataset and tokenizer
a job uses (`resolve_dataset`, `resolve_tokenizer`)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

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
from cephalo.data.token_files import (
    TOKENIZER_DIR,
    TOKENIZER_FILE,
    TokenFile,
    TokenFileMeta,
    _TokenWriter,
    _write_atomic,
    resolve_token_file,
    token_dtype,
)
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

DEFAULT_VOCAB_SIZE = 2048


DEFAULT_VAL_FRACTION = 0.05


# Without an end-of-document token (the byte tokenizer: all 256 ids are bytes; our BPE:
# trained without special tokens) documents are joined with one blank line, so a sample
# may span two documents, as in GPT-2's pretraining. A tokenizer with an EOS puts it
# between documents instead.
DOCUMENT_SEPARATOR = "\n\n"


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
