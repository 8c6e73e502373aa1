"""Corpora: the texts a token dataset is made from, read as a bounded stream.

A corpus is a list of sources, each read lazily, in order:

    text / markdown   *.txt *.md          one document per file, read in chunks
    JSON Lines        *.jsonl *.ndjson    one document per line: the record's text field
    Parquet           *.parquet           one document per row of the text column, by row group
    datasets dir      save_to_disk(DIR)   one document per row of the text column, in row batches
    the bundled corpus                    Python's help topics, in memory (~465 KB)

No source holds more than one chunk of a text file or one batch of rows at a time, and
`Corpus.pieces` cuts long documents into pieces of about `piece_chars` characters, so a
corpus larger than RAM streams through in bounded memory. Parquet files are read with
`pyarrow`, datasets directories with `datasets` (the `data` extra); JSON Lines line by line
with the standard library, so that a bad line can be named by file and line number.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cephalo.errors import CephaloError
from cephalo.log import logger

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
DEFAULT_TEXT_FIELD = "text"
PIECE_CHARS = 1 << 20
"""Documents are cut (after a newline) into pieces of about this many characters: the
tokenizer never sees more at once, and the progress bar moves."""
ROWS_PER_BATCH = 1024
"""At most this many rows of a Parquet file or datasets directory are turned into Python
strings at a time ..."""
BATCH_BYTES = 1 << 20
"""... and fewer when the rows are large: about this many bytes of the source per batch."""
READ_BYTES = 1 << 20
"""Bytes read at a time when checksumming source files."""
DATA_EXTRA_HINT = "pip install 'cephalo[data]'"


@dataclass(frozen=True)
class Document:
    """One source text held in memory (an entry of the bundled corpus, or a test's text)."""

    name: str
    """Where it came from (a path, or `pydoc:<topic>`); for messages only."""
    text: str
    """Its contents."""


@dataclass(frozen=True)
class Chunk:
    """What a source yields: some text of the current document, as it was read."""

    text: str
    """The text (may be empty: a blank JSON line, a null value)."""
    ends_document: bool
    """True on the last chunk of a document (a file, a record, a row)."""
    source_bytes: int
    """Bytes of the source this chunk accounts for (drives the progress bar)."""


@dataclass(frozen=True)
class Piece:
    """Tokenizer input: at most about `piece_chars` characters of one document."""

    text: str
    ends_document: bool
    """The document ends here: the caller puts the end-of-document token after it."""
    source_bytes: int


# ----------------------------------------------------------------------------- sources
class Source:
    """One input: a file, a datasets directory, or documents in memory."""

    kind = "source"
    path: Path | None = None

    @property
    def name(self) -> str:
        return str(self.path) if self.path is not None else self.kind

    def files(self) -> list[Path]:
        """The files whose bytes determine the texts (checksummed, in order)."""
        return []

    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files())

    def settings(self) -> str:
        """What besides the files' bytes decides the texts (e.g. the text field)."""
        return ""

    def chunks(self, piece_chars: int) -> Iterator[Chunk]:
        raise NotImplementedError


class MemorySource(Source):
    """Documents already in memory (the bundled corpus, `prepare_dataset(documents)`)."""

    kind = "documents"

    def __init__(self, documents: Sequence[Document]):
        self.documents = list(documents)

    def size_bytes(self) -> int:
        return sum(len(d.text.encode("utf-8")) for d in self.documents)

    def chunks(self, piece_chars: int) -> Iterator[Chunk]:
        for doc in self.documents:
            yield Chunk(doc.text, True, len(doc.text.encode("utf-8")))


class TextFileSource(Source):
    """A UTF-8 text or markdown file: one document, read `piece_chars` characters at a time."""

    kind = "text"

    def __init__(self, path: Path):
        self.path = path

    def files(self) -> list[Path]:
        return [self.path]

    def chunks(self, piece_chars: int) -> Iterator[Chunk]:
        # text mode: universal newlines (CRLF -> LF), incremental UTF-8 decoding
        try:
            with open(self.path, encoding="utf-8") as f:
                text = f.read(piece_chars)
                if not text:
                    yield Chunk("", True, 0)  # an empty file: an empty document
                while text:
                    following = f.read(piece_chars)
                    yield Chunk(text, not following, len(text.encode("utf-8")))
                    text = following
        except UnicodeDecodeError as e:
            raise CephaloError(
                f"{self.path} is not UTF-8 text ({e}); convert it or leave it out"
            ) from e
        except OSError as e:
            raise CephaloError(f"cannot read {self.path} ({e})") from e


class JsonLinesSource(Source):
    """JSON Lines: one JSON object per line; its `text_field` holds the document."""

    kind = "jsonl"

    def __init__(self, path: Path, text_field: str):
        self.path, self.text_field = path, text_field

    def files(self) -> list[Path]:
        return [self.path]

    def settings(self) -> str:
        return f"jsonl:{self.text_field}"

    def chunks(self, piece_chars: int) -> Iterator[Chunk]:
        try:
            with open(self.path, "rb") as f:
                for lineno, line in enumerate(f, 1):
                    yield self._record(line, lineno)
        except OSError as e:
            raise CephaloError(f"cannot read {self.path} ({e})") from e

    def _record(self, line: bytes, lineno: int) -> Chunk:
        where = f"{self.path}, line {lineno}"
        if not line.strip():
            return Chunk("", False, len(line))  # a blank line is no record
        try:
            record = json.loads(line)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            raise CephaloError(
                f"{where}: not valid JSON ({e}); each line of a JSON Lines file must be one "
                f"JSON object"
            ) from e
        if not isinstance(record, dict):
            raise CephaloError(
                f"{where}: a JSON {type(record).__name__}, not an object with a "
                f"{self.text_field!r} field; each line must be one JSON object"
            )
        if self.text_field not in record:
            raise CephaloError(
                f"{where}: the record has no {self.text_field!r} field (its fields: "
                f"{_listing(record)}); "
                + (_chat_hint(record) or "pass the field that holds the text with --text-field ")
                + "(data.text_field)"
            )
        return Chunk(_text_value(record[self.text_field], where, self.text_field), True, len(line))


class ParquetSource(Source):
    """A Parquet file: the string column `text_field`, read in batches of rows (pyarrow)."""

    kind = "parquet"

    def __init__(self, path: Path, text_field: str):
        self.path, self.text_field = path, text_field
        pa, pq = _pyarrow(f"reading the Parquet file {path}")
        try:
            # buffered reads, no pre-buffering: memory is one row group, not the file
            self._file = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)
        except (OSError, pa.ArrowException) as e:
            raise CephaloError(f"cannot read the Parquet file {path} ({e})") from e
        schema = self._file.schema_arrow
        _check_string_column(
            path, text_field, schema.names, lambda: schema.field(text_field).type, pa
        )
        self.num_rows = self._file.metadata.num_rows
        self.rows_per_batch = rows_per_batch(self.num_rows, self.size_bytes())

    def files(self) -> list[Path]:
        return [self.path]

    def settings(self) -> str:
        return f"parquet:{self.text_field}"

    def _batches(self) -> Iterator[list[Any]]:
        # One row group at a time: ParquetFile.iter_batches (pyarrow 26) holds on to memory
        # as it goes (measured: +177 MiB peak RSS over a 60 MB file, against +24 MiB this
        # way, flat in the file size; apache/arrow#39808 is the same effect in to_batches).
        for group in range(self._file.metadata.num_row_groups):
            table = self._file.read_row_group(group, columns=[self.text_field], use_threads=False)
            for batch in table.to_batches(max_chunksize=self.rows_per_batch):
                yield batch.column(0).to_pylist()
            del table

    def chunks(self, piece_chars: int) -> Iterator[Chunk]:
        import pyarrow as pa

        batches = self._batches()
        try:
            yield from _row_chunks(
                batches,
                self.num_rows,
                self.size_bytes(),
                self.name,
                self.text_field,
            )
        except pa.ArrowException as e:
            raise CephaloError(f"cannot read the Parquet file {self.path} ({e})") from e


class DatasetsDirSource(Source):
    """A directory written by `datasets`' `save_to_disk`: the string column `text_field`."""

    kind = "datasets"

    def __init__(self, path: Path, text_field: str):
        self.path, self.text_field = path, text_field
        datasets = _datasets(f"reading the datasets directory {path}")
        path, split = _dataset_split_dir(path)
        self.split = split
        state = _read_json(path / "state.json")
        if not state.get("_data_files"):
            # save_to_disk writes no shard for an empty dataset (and load_from_disk fails on it)
            raise CephaloError(
                f"the dataset {self.path} is empty: it holds no rows (no data files in "
                f"{path / 'state.json'}); pass a dataset with text"
            )
        try:
            dataset = datasets.load_from_disk(str(path))
        except Exception as e:  # the library raises many kinds on damaged directories
            raise CephaloError(f"cannot load the datasets directory {path} ({e})") from e
        features = dataset.features
        _check_string_column(
            self.path,
            text_field,
            list(features),
            lambda: getattr(features[text_field], "dtype", type(features[text_field]).__name__),
            None,
        )
        self.dataset = dataset.select_columns([text_field])
        self.num_rows = dataset.num_rows
        self._files = [Path(f["filename"]) for f in dataset.cache_files]
        self.rows_per_batch = rows_per_batch(self.num_rows, self.size_bytes())

    @property
    def name(self) -> str:
        return f"{self.path} (split {self.split})" if self.split else str(self.path)

    def files(self) -> list[Path]:
        return self._files

    def settings(self) -> str:
        return f"datasets:{self.split}:{self.text_field}"

    def chunks(self, piece_chars: int) -> Iterator[Chunk]:
        batches = self.dataset.iter(batch_size=self.rows_per_batch)
        yield from _row_chunks(
            (b[self.text_field] for b in batches),
            self.num_rows,
            self.size_bytes(),
            self.name,
            self.text_field,
        )


def rows_per_batch(num_rows: int, size_bytes: int) -> int:
    """Rows read at a time: `ROWS_PER_BATCH`, fewer when that would be more than about
    `BATCH_BYTES` of the source (long documents), at least one."""
    mean_row = size_bytes / max(num_rows, 1)
    return max(1, min(ROWS_PER_BATCH, int(BATCH_BYTES / max(mean_row, 1.0))))


def _row_chunks(
    batches: Iterable[list[Any]], num_rows: int, size: int, where: str, text_field: str
) -> Iterator[Chunk]:
    """One chunk per row; the file's bytes spread over the rows for the progress bar."""
    done_rows = done_bytes = 0
    for values in batches:
        for value in values:
            done_rows += 1
            reached = size * done_rows // max(num_rows, 1)
            yield Chunk(_text_value(value, where, text_field), True, reached - done_bytes)
            done_bytes = reached


def _text_value(value: Any, where: str, text_field: str) -> str:
    if value is None:
        return ""  # a null text is an empty document: skipped and counted
    if not isinstance(value, str):
        raise CephaloError(
            f"{where}: field {text_field!r} holds a {type(value).__name__}, not a string; "
            f"pass the field that holds the text with --text-field (data.text_field)"
        )
    return value


def _check_string_column(
    path: Path, text_field: str, names: list[str], type_of: Callable[[], Any], pa: Any
) -> None:
    if text_field not in names:
        raise CephaloError(
            f"{path} has no column {text_field!r} (its columns: {_listing(names)}); "
            + (_chat_hint(names) or "pass the column that holds the text with --text-field ")
            + "(data.text_field)"
        )
    kind = type_of()
    if pa is not None:
        ok = pa.types.is_string(kind) or pa.types.is_large_string(kind)
        ok = ok or getattr(pa.types, "is_string_view", lambda _: False)(kind)
    else:
        ok = kind in ("string", "large_string", "string_view")
    if not ok:
        raise CephaloError(
            f"{path}: column {text_field!r} holds {kind}, not strings; pass the column that "
            f"holds the text with --text-field (data.text_field)"
        )


def _chat_hint(fields: Iterable[str]) -> str:
    """What to say when text was asked of chat records (data.format = text)."""
    fields = set(fields)
    if {"chosen", "rejected"} <= fields:
        return (
            "it holds a preference pair ('chosen' and 'rejected'), not text: set data.format = "
            "auto or preference (--format) to render it with the tokenizer's chat template, or "
            "name a text field "
        )
    if "messages" in fields:
        kind = "a conversation ('messages')"
    elif {"prompt", "completion"} <= fields:
        kind = "a prompt and a completion"
    else:
        return ""
    return (
        f"it holds {kind}, which is chat data, not text: set data.format = auto or chat "
        f"(--format) to render it with the tokenizer's chat template, or name a text field "
    )


def _listing(names: Iterable[str], limit: int = 12) -> str:
    names = [str(n) for n in names]
    shown = ", ".join(names[:limit]) or "none"
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CephaloError(f"cannot read {path} ({e}); save the dataset again") from e
    if not isinstance(data, dict):
        raise CephaloError(f"{path} is not a JSON object; save the dataset again")
    return data


def is_datasets_dir(path: Path) -> bool:
    """A directory written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def _dataset_split_dir(path: Path) -> tuple[Path, str | None]:
    """A `Dataset` directory as is; of a `DatasetDict`: its `train` split, or its only one."""
    if not (path / "dataset_dict.json").is_file():
        return path, None
    splits = _read_json(path / "dataset_dict.json").get("splits") or []
    if "train" in splits:
        split = "train"
    elif len(splits) == 1:
        split = splits[0]
    else:
        raise CephaloError(
            f"the datasets directory {path} holds the splits {_listing(splits)} and none is "
            f"called 'train': pass the split's own directory, e.g. {path / str(splits[0])}"
            if splits
            else f"the datasets directory {path} lists no splits in dataset_dict.json"
        )
    return path / split, split


def _pyarrow(what: str) -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise CephaloError(f"{what} needs the `pyarrow` package: {DATA_EXTRA_HINT}") from e
    return pa, pq


def _datasets(what: str) -> Any:
    try:
        import datasets
    except ImportError as e:
        raise CephaloError(f"{what} needs the `datasets` package: {DATA_EXTRA_HINT}") from e
    return datasets


def check_data_path(path: str | Path, what: str = "data.path") -> None:
    """Before any process starts: the data exists, can be read and holds something, and the
    packages its formats need import (Parquet: pyarrow; a `datasets` directory: datasets).
    Cheap (sizes and names, no reading): the full checks follow when the data is read."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CephaloError(
            f"{what} {path} does not exist: give a text, JSON Lines or Parquet file, a directory "
            "of them, or a dataset from `cephalo prepare-data`"
        )
    if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
        raise CephaloError(f"{what} {path} cannot be read (permissions): make it readable")
    if path.is_file():
        if path.stat().st_size == 0:
            raise CephaloError(f"{what} {path} is empty (0 bytes): give a file with data in it")
        if path.suffix in PARQUET_SUFFIXES:
            _pyarrow(f"{what} {path} (Parquet)")
        return
    if is_datasets_dir(path):
        _datasets(f"{what} {path} (a datasets directory)")
        _pyarrow(f"{what} {path} (a datasets directory)")
        return
    files = [p for p in path.rglob("*") if p.is_file()]
    if not files or all(p.stat().st_size == 0 for p in files):
        raise CephaloError(f"{what} {path} is an empty directory: put the data files in it")
    if any(p.suffix in PARQUET_SUFFIXES for p in files):
        _pyarrow(f"{what} {path} (Parquet files)")


# ----------------------------------------------------------------------------- the corpus
@dataclass
class SourceCounts:
    """What reading one source found (filled while `Corpus.pieces` runs)."""

    documents: int = 0
    """Documents with text."""
    empty: int = 0
    """Documents (records, rows, files) with no text: skipped."""


@dataclass
class Corpus:
    """Sources in order, read as one stream of documents."""

    sources: list[Source]
    counts: dict[int, SourceCounts] = field(default_factory=dict)

    # ---------------------------------------------------------------- making one
    @classmethod
    def from_documents(cls, documents: Sequence[Document]) -> Corpus:
        return cls([MemorySource(documents)])

    @classmethod
    def bundled(cls) -> Corpus:
        return cls.from_documents(default_corpus())

    @classmethod
    def from_paths(
        cls, inputs: Sequence[str | Path], text_field: str = DEFAULT_TEXT_FIELD
    ) -> Corpus:
        """Files named directly, or found under directories (recursively, sorted by path).

        A directory written by `save_to_disk` is one source; any other directory is searched
        for the supported suffixes. A file is read by its suffix (unknown suffixes as text).
        """
        if not inputs:
            raise CephaloError(
                "no input given: pass text, JSON Lines or Parquet files, or directories"
            )
        if not text_field:
            raise CephaloError("the text field must not be empty (--text-field, data.text_field)")
        sources: list[Source] = []
        for item in inputs:
            path = Path(item)
            if path.is_dir() and is_datasets_dir(path):
                sources.append(DatasetsDirSource(path, text_field))
            elif path.is_dir():
                found = sorted(
                    p for p in path.rglob("*") if p.is_file() and p.suffix in SUPPORTED_SUFFIXES
                )
                if not found:
                    kinds = ", ".join(SUPPORTED_SUFFIXES[:-1]) + " or " + SUPPORTED_SUFFIXES[-1]
                    raise CephaloError(
                        f"directory {path} holds no {kinds} files and "
                        f"is not a datasets directory (save_to_disk): point --input at files "
                        f"of those kinds or a directory of them"
                    )
                sources.extend(_file_source(p, text_field) for p in found)
            elif path.is_file():
                sources.append(_file_source(path, text_field))
            else:
                raise CephaloError(
                    f"input {path} does not exist: pass text, JSON Lines or Parquet files, "
                    f"or directories"
                )
        return cls(sources)

    # ---------------------------------------------------------------- identity
    def size_bytes(self) -> int:
        return sum(s.size_bytes() for s in self.sources)

    def describe(self) -> str:
        if len(self.sources) == 1:
            return self.sources[0].name
        kinds = sorted({s.kind for s in self.sources})
        return f"{len(self.sources)} {'/'.join(kinds)} sources"

    def stat_fingerprint(self) -> str | None:
        """A cheap identity from the files' paths, sizes and modification times (None for
        documents in memory): when it matches, the corpus is taken as unchanged, as `make`
        does; otherwise `checksum` decides."""
        if any(isinstance(s, MemorySource) for s in self.sources):
            return None
        h = hashlib.sha256()
        for s in self.sources:
            h.update(f"{s.kind}|{s.settings()}\0".encode())
            for f in s.files():
                st = f.stat()
                h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\0".encode())
        return h.hexdigest()

    def checksum(self, advance: Callable[[int], None] | None = None) -> str:
        """sha256 of what decides the texts, in order: each file's bytes (length-prefixed),
        read in 1 MiB blocks, and the reading settings of structured sources. File names are
        left out: renaming a file changes no token. Documents in memory hash as their UTF-8
        texts, so plain text hashes the same from memory as from a file."""
        h = hashlib.sha256()
        for s in self.sources:
            if s.settings():
                h.update(f"[{s.settings()}]".encode())
            if isinstance(s, MemorySource):
                _hash_texts(h, s.documents)
                continue
            for f in s.files():
                h.update(f.stat().st_size.to_bytes(8, "little"))
                with open(f, "rb") as fh:
                    while block := fh.read(READ_BYTES):
                        h.update(block)
                        if advance is not None:
                            advance(len(block))
        return h.hexdigest()

    # ---------------------------------------------------------------- reading
    def pieces(self, separator: str, piece_chars: int = PIECE_CHARS) -> Iterator[Piece]:
        """Every document with text, cut after newlines into pieces of at most about
        `piece_chars` characters. Without an end-of-document token (`separator` non-empty) a
        document's trailing newlines become `separator`; with one (`separator == ""`) its text
        is kept as is. Documents without text are skipped and counted in `counts`."""
        self.counts = {}
        for index, source in enumerate(self.sources):
            counts = self.counts[index] = SourceCounts()
            yield from _pieces(source.chunks(piece_chars), separator, piece_chars, counts)
            if counts.empty:
                logger.warning("%s: %d document(s) with no text skipped", source.name, counts.empty)

    @property
    def num_documents(self) -> int:
        """Documents with text seen by the last `pieces` pass."""
        return sum(c.documents for c in self.counts.values())

    def check_not_empty(self, text_field: str | None = None) -> None:
        """After a `pieces` pass: one clear error naming the inputs if nothing had text."""
        if self.num_documents:
            return
        empty = sum(c.empty for c in self.counts.values())
        names = ", ".join(s.name for s in self.sources[:5])
        more = f" and {len(self.sources) - 5} more" if len(self.sources) > 5 else ""
        structured = [s for s in self.sources if s.settings()]
        field_note = f" in field {getattr(structured[0], 'text_field', '')!r}" if structured else ""
        verb = "holds" if len(self.sources) == 1 else "hold"
        raise CephaloError(
            f"the dataset is empty: {names}{more} {verb} no text{field_note} ({empty} "
            f"document(s), all empty or null); pass data with text"
        )


def _file_source(path: Path, text_field: str) -> Source:
    if path.suffix in JSONL_SUFFIXES:
        return JsonLinesSource(path, text_field)
    if path.suffix in PARQUET_SUFFIXES:
        return ParquetSource(path, text_field)
    return TextFileSource(path)


def _pieces(
    chunks: Iterable[Chunk], separator: str, piece_chars: int, counts: SourceCounts
) -> Iterator[Piece]:
    buffer, pending_bytes, cut_any = "", 0, False
    for chunk in chunks:
        buffer += chunk.text
        pending_bytes += chunk.source_bytes
        while len(buffer) > piece_chars:
            cut = buffer.rfind("\n", 0, piece_chars)
            end = cut + 1 if cut > 0 else piece_chars
            yield Piece(buffer[:end], False, pending_bytes)
            buffer, pending_bytes, cut_any = buffer[end:], 0, True
        if not chunk.ends_document:
            continue
        if cut_any or buffer.strip():
            text = buffer.rstrip("\n") + separator if separator else buffer
            yield Piece(text, True, pending_bytes)
            counts.documents += 1
            pending_bytes = 0
        else:
            counts.empty += 1  # its bytes count towards the next piece's progress
        buffer, cut_any = "", False


# ----------------------------------------------------------------------------- helpers
def default_corpus() -> list[Document]:
    """The bundled corpus: Python's own help topics (`pydoc_data.topics`, ~465 KB of English).

    It ships with every CPython, so the demo needs no download. Topics are taken in sorted
    order, so the corpus (and everything built from it) is deterministic for a Python version.
    """
    from pydoc_data.topics import topics

    return [Document(f"pydoc:{key}", topics[key]) for key in sorted(topics)]


def _hash_texts(h: Any, documents: Iterable[Document]) -> None:
    for doc in documents:
        data = doc.text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))  # length prefix: no two corpora collide
        h.update(data)
