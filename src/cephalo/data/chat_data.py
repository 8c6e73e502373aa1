"""Chat datasets: rendered conversations with their loss masks, and their batches.

A chat dataset is a token dataset (docs/data.md, "Format") whose documents are kept apart:

    train.bin  train.json   the ids of every document, back to back (+ the usual sidecar)
    train.mask.bin          uint8 per token: 1 where the token is a loss token
    train.docs.bin          int64 document starts, one more than documents (the end)
    val.*                   the same for the last `val_fraction` of the documents
    tokenizer/              the tokenizer's files (its chat template included)
    chat.json               format, loss_on, template, statistics: written last

The mask is stored with the tokens, so a dataset is prepared once and trains under any plan.
`DocumentBatches` makes samples of `seq_len` tokens from it: one document right-padded
(`packing = false`), or whole documents packed best-fit decreasing (`packing.py`) with their
own position ids. Labels stay inside their document: labels[j] is token j+1 of the same
document when that token is a loss token, else IGNORE_INDEX, so the label at every document
boundary, the padding, and a prompt are never trained on. The engine divides the summed
loss by the loss tokens of the whole global batch, so the loss is the same under any plan.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from cephalo.data.batches import EpochOrder, val_range
from cephalo.data.chat import (
    RENDER_BATCH,
    ChatRenderer,
    Record,
    chat_sources,
    default_loss_on,
    detect_inputs_format,
    load_chat_template,
    read_records,
)
from cephalo.data.hf_tokenizer import HFTokenizer, tokenizer_fingerprint
from cephalo.data.packing import best_fit_decreasing, piece_bounds
from cephalo.data.text import (
    DEFAULT_VAL_FRACTION,
    _exclusive,
    _progress_bar,
    vocab_too_large,
)
from cephalo.data.token_files import (
    PREPARE_HINT,
    TOKENIZER_DIR,
    TokenFile,
    TokenFileMeta,
    _write_atomic,
    token_dtype,
)
from cephalo.errors import CephaloError
from cephalo.log import logger
from cephalo.modeling.units import IGNORE_INDEX

CHAT_META = "chat.json"
SPLIT_FILES = (".json", ".bin", ".mask.bin", ".docs.bin")
"""A split's files (after its name: train, val)."""

CHAT_FORMAT_VERSION = 1


@dataclass
class ChatStats:
    """What preparation found (also in chat.json)."""

    conversations: int = 0
    """Records read (conversations or prompt-completion pairs)."""
    documents: int = 0
    """Records kept (with at least one loss token)."""
    dropped: int = 0
    """Records with no loss token (nothing to train on): dropped."""
    tokens: int = 0
    """Tokens of the kept documents."""
    loss_tokens: int = 0
    """Tokens that are a label (a loss token after the document's first token)."""


@dataclass
class ChatMeta:
    """chat.json: how a chat dataset was made."""

    format: str
    loss_on: str
    template_sha256: str
    tokenizer_key: str
    source_sha256: str
    source_stat: str
    val_fraction: float
    stats: ChatStats = field(default_factory=ChatStats)
    version: int = CHAT_FORMAT_VERSION

    def settings(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("stats", "source_stat")}

    @classmethod
    def read(cls, path: Path) -> ChatMeta | None:
        try:
            d = json.loads(path.read_text())
            d["stats"] = ChatStats(**d.get("stats", {}))
            return cls(**d)
        except (OSError, ValueError, TypeError):
            return None


def is_chat_dataset(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / CHAT_META).is_file()


@dataclass
class ChatPrepared:
    path: Path
    meta: ChatMeta
    seconds: float
    cached: bool = False


# ----------------------------------------------------------------------------- preparation
def _sources_identity(paths: list[Path]) -> tuple[list[Path], str]:
    """The files whose bytes make the records, and a hash of their paths, sizes and times."""
    files: list[Path] = []
    for p in paths:
        files.extend(sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p])
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\0".encode())
    return files, h.hexdigest()


def _checksum(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.stat().st_size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
    return h.hexdigest()


class _DocWriter:
    """Ids and masks appended to temporary files; `finish` splits the documents into train and
    val and publishes them (bin files first, sidecars after; chat.json is the caller's, last)."""

    def __init__(self, out_dir: Path, vocab_size: int):
        self.out_dir, self.vocab_size = out_dir, vocab_size
        self.dtype = token_dtype(vocab_size)
        self.ids_tmp, self.mask_tmp = out_dir / "all.bin.tmp", out_dir / "all.mask.tmp"
        self.ids = open(self.ids_tmp, "wb")  # noqa: SIM115 (closed in finish or abort)
        self.mask = open(self.mask_tmp, "wb")  # noqa: SIM115
        self.lengths: list[int] = []

    def append(self, ids: np.ndarray, mask: np.ndarray) -> None:
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise CephaloError(
                f"the tokenizer produced id {int(ids.max())}, outside its vocab of "
                f"{self.vocab_size}: the tokenizer files are inconsistent"
            )
        ids.astype(self.dtype).tofile(self.ids)
        mask.astype(np.uint8).tofile(self.mask)
        self.lengths.append(int(ids.size))

    def abort(self) -> None:
        for f in (self.ids, self.mask):
            f.close()
        for p in self.out_dir.glob("*.tmp"):
            p.unlink(missing_ok=True)

    def finish(self, meta: TokenFileMeta, val_fraction: float) -> tuple[TokenFileMeta, ...]:
        self.ids.close()
        self.mask.close()
        n = len(self.lengths)
        n_val = math.floor(n * val_fraction) if n > 1 else 0
        bounds = np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])
        metas = []
        for split, (d0, d1) in (("train", (0, n - n_val)), ("val", (n - n_val, n))):
            t0, t1 = int(bounds[d0]), int(bounds[d1])
            for src, suffix, itemsize in (
                (self.ids_tmp, ".bin", self.dtype.itemsize),
                (self.mask_tmp, ".mask.bin", 1),
            ):
                tmp = self.out_dir / f"{split}{suffix}.tmp"
                with open(src, "rb") as fi, open(tmp, "wb") as fo:
                    fi.seek(t0 * itemsize)
                    _copy_bytes(fi, fo, (t1 - t0) * itemsize)
                os.replace(tmp, self.out_dir / f"{split}{suffix}")
            docs_tmp = self.out_dir / f"{split}.docs.bin.tmp"
            (bounds[d0 : d1 + 1] - t0).astype(np.int64).tofile(docs_tmp)
            os.replace(docs_tmp, self.out_dir / f"{split}.docs.bin")
            m = TokenFileMeta(
                **{**asdict(meta), "split": split, "num_tokens": t1 - t0, "num_documents": d1 - d0}
            )
            _write_atomic(self.out_dir / f"{split}.json", m.to_json())
            metas.append(m)
        self.ids_tmp.unlink()
        self.mask_tmp.unlink()
        return tuple(metas)


def _copy_bytes(fi, fo, n: int) -> None:
    while n > 0:
        block = fi.read(min(n, 1 << 20))
        if not block:
            break
        fo.write(block)
        n -= len(block)


def prepare_chat_dataset(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    tokenizer: str | Path,
    fmt: str = "auto",
    loss_on: str = "auto",
    chat_template: str | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    progress: bool = False,
    force: bool = False,
    max_vocab_size: int | None = None,
    model: str = "the model",
) -> ChatPrepared:
    """Render and tokenize conversations / prompt-completion records into `out_dir`.

    tokenizer: a directory with a transformers tokenizer (its chat template, or
    `chat_template`: a Jinja file or string). fmt: `auto` (detected), `chat` or
    `prompt_completion`. loss_on: `auto` (assistant for chat, completion for prompt-completion),
    `assistant`, `completion` or `all`. A bad record is one error naming its file and line;
    nothing of this run is left in `out_dir` then (and an earlier dataset there stops being
    one). Reused when the sources and settings are those of the dataset already there."""
    started = time.perf_counter()
    out_dir = Path(out_dir)
    paths = chat_sources(inputs)
    if not paths:
        raise CephaloError("no input given: pass JSON Lines, Parquet or datasets directories")
    fmt = detect_inputs_format(paths, fmt)
    if fmt == "text":
        raise CephaloError(
            f"{paths[0]} holds text, not conversations: prepare it with `cephalo prepare-data` "
            f"as text (data.format = text), or set data.format = chat / prompt_completion"
        )
    if not 0.0 <= val_fraction < 1.0:
        raise CephaloError(f"val_fraction must be in [0, 1), got {val_fraction}")
    directory = Path(tokenizer)
    hf = load_template_tokenizer(
        tokenizer, "chat data", "a chat template and token offsets", max_vocab_size, model
    )
    template = load_chat_template(chat_template)
    renderer = ChatRenderer(hf.transformers_tokenizer, template, fmt, loss_on)
    renderer.require_template()  # before anything is read
    files, stat = _sources_identity(paths)
    meta = ChatMeta(
        format=fmt,
        loss_on=renderer.loss_on,
        template_sha256=hashlib.sha256((renderer.template or "").encode()).hexdigest()[:16],
        tokenizer_key="hf-" + tokenizer_fingerprint(directory),
        source_sha256="",
        source_stat=stat,
        val_fraction=val_fraction,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(out_dir / ".prepare.lock"):
        old = ChatMeta.read(out_dir / CHAT_META)
        wanted = {k: v for k, v in meta.settings().items() if k != "source_sha256"}
        same = (
            old is not None
            and {k: v for k, v in old.settings().items() if k != "source_sha256"} == wanted
        )
        if not force and same and old.source_stat == stat and _complete(out_dir, SPLIT_FILES):
            return ChatPrepared(out_dir, old, time.perf_counter() - started, cached=True)
        meta.source_sha256 = _checksum(files)
        complete = _complete(out_dir, SPLIT_FILES)
        if not force and same and old.source_sha256 == meta.source_sha256 and complete:
            old.source_stat = stat
            _write_atomic(out_dir / CHAT_META, json.dumps(asdict(old), indent=2) + "\n")
            return ChatPrepared(out_dir, old, time.perf_counter() - started, cached=True)
        for name in (CHAT_META, "train.json", "val.json"):  # no longer a dataset from here on
            (out_dir / name).unlink(missing_ok=True)
        writer = _DocWriter(out_dir, hf.vocab_size)
        try:
            render_all(
                paths,
                files,
                progress,
                "rendering conversations",
                lambda batch: _write_batch(batch, renderer, writer, meta.stats),
            )
            if not meta.stats.documents:
                raise CephaloError(
                    f"the dataset is empty: {len(paths)} input(s) hold "
                    f"{meta.stats.conversations} record(s), none with a loss token"
                )
            hf.save(out_dir / TOKENIZER_DIR)
            token_meta = TokenFileMeta(
                dtype=writer.dtype.name,
                num_tokens=0,
                vocab_size=hf.vocab_size,
                tokenizer=TOKENIZER_DIR,
                source_sha256=meta.source_sha256,
                val_fraction=val_fraction,
                tokenizer_key=meta.tokenizer_key,
                source_stat=stat,
            )
            writer.finish(token_meta, val_fraction)
        except BaseException:
            writer.abort()
            for name in ("train", "val"):
                for suffix in SPLIT_FILES:
                    (out_dir / f"{name}{suffix}").unlink(missing_ok=True)
            raise
        _write_atomic(out_dir / CHAT_META, json.dumps(asdict(meta), indent=2) + "\n")
    s = meta.stats
    logger.info(
        "%s: %d %s records -> %d documents (%d dropped with no loss token), %d tokens, %d loss "
        "tokens (%s)",
        out_dir,
        s.conversations,
        fmt,
        s.documents,
        s.dropped,
        s.tokens,
        s.loss_tokens,
        meta.loss_on,
    )
    return ChatPrepared(out_dir, meta, time.perf_counter() - started)


def load_template_tokenizer(
    tokenizer: str | Path, what: str, needs: str, max_vocab_size: int | None, model: str
) -> HFTokenizer:
    """The transformers tokenizer of a model directory, for data rendered with its chat
    template (`what`: chat data, preference data; `needs`: what of the directory it uses)."""
    directory = Path(tokenizer)
    if not directory.is_dir():
        raise CephaloError(
            f"{what} needs a model's tokenizer directory ({needs}), got {tokenizer!r}: "
            f"pass --tokenizer MODEL_DIR (data.tokenizer = auto with a model directory)"
        )
    hf = HFTokenizer.load(directory)
    if hf.transformers_tokenizer is None:
        raise CephaloError(f"{what} needs the `transformers` package: pip install 'cephalo[hf]'")
    if max_vocab_size is not None and hf.vocab_size > max_vocab_size:
        raise CephaloError(
            vocab_too_large(hf.vocab_size, f"the tokenizer in {directory}", max_vocab_size, model)
        )
    return hf


def _complete(out_dir: Path, split_files: Sequence[str]) -> bool:
    """Whether `out_dir` holds both splits' files (`split_files`: their suffixes) and the
    tokenizer (the chat and the preference datasets)."""
    names = [f"{s}{x}" for s in ("train", "val") for x in split_files]
    return all((out_dir / n).is_file() for n in names) and (out_dir / TOKENIZER_DIR).is_dir()


def render_all(
    paths: list[Path],
    files: list[Path],
    progress: bool,
    label: str,
    write_batch: Callable[[list[Record]], None],
) -> None:
    """Every record of `paths` to `write_batch`, `RENDER_BATCH` at a time, with a progress
    bar over the sources' bytes (`files`): the chat and the preference preparers' loop."""
    total = sum(f.stat().st_size for f in files)
    with _progress_bar(progress) as bar:
        task = bar.add_task(label, total=total)
        for path in paths:
            batch: list[Record] = []
            for record in read_records(path):
                batch.append(record)
                if len(batch) >= RENDER_BATCH:
                    write_batch(batch)
                    bar.advance(task, sum(r.source_bytes for r in batch))
                    batch = []
            write_batch(batch)
            bar.advance(task, sum(r.source_bytes for r in batch))


def _write_batch(
    batch: list[Record], renderer: ChatRenderer, writer: _DocWriter, stats: ChatStats
) -> None:
    for ids, mask in renderer.encode(batch):
        stats.conversations += 1
        labels = int(mask[1:].sum())  # the first token is never predicted
        if labels == 0:
            stats.dropped += 1
            continue
        writer.append(ids, mask)
        stats.documents += 1
        stats.tokens += int(ids.size)
        stats.loss_tokens += labels


# ----------------------------------------------------------------------------- batches
@dataclass
class SampleStats:
    """What the samples of one split are, for a seq_len and packing."""

    documents: int = 0
    samples: int = 0
    """Samples (windows when packing)."""
    truncated: int = 0
    """Documents longer than a sample, cut on the right (0 with packing_split)."""
    split: int = 0
    """Documents longer than a window, split into several (packing_split)."""
    dropped: int = 0
    """Pieces left with no loss token (after truncation): not trained on."""
    tokens: int = 0
    """Real (non-padding) tokens in the samples."""
    loss_tokens: int = 0
    """Labels in the samples."""
    padding_fraction: float = 0.0
    """Padding tokens / all tokens of the samples."""


class _Split:
    """One split's documents as samples: a sample is a run of pieces (start, length) of the
    token file; `packed` samples give each piece its own position ids."""

    def __init__(self, data: Path, split: str, seq_len: int, packing: bool, split_long: bool):
        self.file = TokenFile(data, split)
        base = self.file.sidecar.with_suffix("")
        self.mask = _memmap(base.with_name(f"{split}.mask.bin"), np.uint8)
        starts = _memmap(base.with_name(f"{split}.docs.bin"), np.int64)
        if self.mask.size != self.file.num_tokens or (
            starts.size and int(starts[-1]) != self.file.num_tokens
        ):
            raise CephaloError(
                f"{data}: the {split} mask or document files do not match its tokens; {PREPARE_HINT}"
            )
        lengths = np.diff(np.asarray(starts))
        docs, offsets, long = piece_bounds(lengths, seq_len, split_long)
        piece_start = np.asarray(starts[:-1])[docs] + offsets
        piece_len = np.minimum(lengths[docs] - offsets, seq_len)
        labels = np.array(
            [
                int(self.mask[a + 1 : a + n].sum())
                for a, n in zip(piece_start, piece_len, strict=True)
            ],
            dtype=np.int64,
        )
        keep = labels > 0
        self.stats = SampleStats(
            documents=int(lengths.size),
            truncated=0 if split_long else long,
            split=long if split_long else 0,
            dropped=int((~keep).sum()),
        )
        self.piece_start, self.piece_len = piece_start[keep], piece_len[keep]
        if packing:
            windows = best_fit_decreasing(self.piece_len, seq_len)
        else:
            windows = [[i] for i in range(self.piece_start.size)]
        self.windows = windows
        self.packing, self.seq_len = packing, seq_len
        self._last: tuple[bytes, tuple] | None = None
        self.stats.samples = len(windows)
        self.stats.tokens = int(self.piece_len.sum())
        self.stats.loss_tokens = int(labels[keep].sum())
        total = len(windows) * seq_len
        self.stats.padding_fraction = 1.0 - self.stats.tokens / total if total else 0.0

    def read(self, samples: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        # the trainer asks for a slice's tokens and then its positions: read them once
        key = np.asarray(samples, dtype=np.int64).tobytes()
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        out = self._read(samples)
        self._last = (key, out)
        return out

    def _read(self, samples: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        n, s = len(samples), self.seq_len
        ids = np.zeros((n, s), dtype=np.int64)  # padding: id 0, never a label, never attended to
        labels = np.full((n, s), IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros((n, s), dtype=np.int64) if self.packing else None
        vocab = self.file.vocab_size
        for row, w in enumerate(samples):
            at = 0
            for p in self.windows[int(w)]:
                a, length = int(self.piece_start[p]), int(self.piece_len[p])
                toks = np.asarray(self.file.tokens[a : a + length], dtype=np.int64)
                if toks.size and toks.max() >= vocab:
                    raise CephaloError(
                        f"{self.file.bin_path} holds token id {int(toks.max())}, but its vocab "
                        f"size is {vocab}: the file is corrupt; prepare the data again"
                    )
                loss = np.asarray(self.mask[a + 1 : a + length], dtype=bool)
                ids[row, at : at + length] = toks
                labels[row, at : at + length - 1] = np.where(loss, toks[1:], IGNORE_INDEX)
                if positions is not None:
                    positions[row, at : at + length] = np.arange(length)
                at += length
            if positions is not None and at < s:  # padding: a block of its own
                positions[row, at:] = np.arange(s - at)
        pos = torch.from_numpy(positions) if positions is not None else None
        return torch.from_numpy(ids), torch.from_numpy(labels), pos


def _memmap(path: Path, dtype) -> np.ndarray:
    if not path.is_file():
        raise CephaloError(f"{path} is missing; {PREPARE_HINT}")
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


class DocumentBatches:
    """Plan-invariant global batches of a chat dataset (same contract as `GlobalBatches`:
    step t's batch depends only on the dataset, seq_len, packing, the batch size, the seed
    and t). A sample is one document right-padded to `seq_len` or, with `packing`, a window of
    whole documents (best-fit decreasing) with per-document position ids
    (`rank_positions`)."""

    def __init__(
        self,
        data: str | Path,
        seq_len: int,
        global_batch_size: int,
        seed: int = 0,
        model_vocab_size: int | None = None,
        packing: bool = False,
        packing_split: bool = False,
    ):
        for name, value in (("seq_len", seq_len), ("global_batch_size", global_batch_size)):
            if not isinstance(value, int) or value < 1:
                raise CephaloError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(seed, int) or seed < 0:
            raise CephaloError(f"seed must be a non-negative integer, got {seed!r}")
        data = Path(data)
        self.meta = ChatMeta.read(data / CHAT_META)
        if self.meta is None:
            raise CephaloError(f"{data / CHAT_META} is missing or unreadable; {PREPARE_HINT}")
        self.seq_len, self.global_batch_size, self.seed = seq_len, global_batch_size, seed
        self.window = seq_len
        self.packing = packing
        self.train = _Split(data, "train", seq_len, packing, packing_split)
        self.val = _Split(data, "val", seq_len, packing, packing_split)
        self.vocab_size = self.train.file.vocab_size
        if model_vocab_size is not None and model_vocab_size < self.vocab_size:
            raise CephaloError(
                vocab_too_large(self.vocab_size, f"dataset {data}", model_vocab_size, "the model")
            )
        self.num_train_windows = self.train.stats.samples
        self.num_val_windows = self.val.stats.samples
        if self.num_train_windows < global_batch_size:
            raise CephaloError(
                f"dataset {data} makes {self.num_train_windows} training samples of {seq_len} "
                f"tokens, but one global batch needs {global_batch_size}: use a smaller global "
                f"batch size or seq_len (packing), or more data"
            )
        self.order = EpochOrder(self.num_train_windows, global_batch_size, seed)
        self.steps_per_epoch = self.order.steps_per_epoch

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    def epoch_order(self, epoch: int) -> np.ndarray:
        return self.order.order(epoch)

    def _train_samples(self, step: int, offset: int, size: int) -> np.ndarray:
        return self.order.windows(step, offset, size)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rank_slice(step, 0, self.global_batch_size)

    def rank_slice(self, step: int, offset: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, labels, _ = self.train.read(self._train_samples(step, offset, size))
        return ids, labels

    def rank_positions(self, step: int, offset: int, size: int) -> torch.Tensor | None:
        """Position ids of `rank_slice`'s samples (packing), else None (0, 1, ... per row)."""
        if not self.packing:
            return None
        return self.train.read(self._train_samples(step, offset, size))[2]

    def real_tokens(self, step: int) -> int:
        """Tokens of step's global batch that are not padding (what throughput counts)."""
        samples = self._train_samples(step, 0, self.global_batch_size)
        return int(sum(self.train.piece_len[self.train.windows[int(w)]].sum() for w in samples))

    def num_val_batches(self, batch_size: int) -> int:
        return math.ceil(self.num_val_windows / batch_size)

    def _val_samples(self, index: int, batch_size: int, offset: int, size: int | None):
        return val_range(self.num_val_windows, index, batch_size, offset, size, "samples")

    def val_batch(
        self, index: int, batch_size: int, offset: int = 0, size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ids, labels, _ = self.val.read(self._val_samples(index, batch_size, offset, size))
        return ids, labels

    def val_positions(
        self, index: int, batch_size: int, offset: int = 0, size: int | None = None
    ) -> torch.Tensor | None:
        if not self.packing:
            return None
        return self.val.read(self._val_samples(index, batch_size, offset, size))[2]

    def describe(self) -> str:
        t, m = self.train.stats, self.meta.stats
        how = "packed windows" if self.packing else "padded conversations"
        return (
            f"{m.conversations} {self.meta.format} records ({m.dropped} dropped with no loss "
            f"token), loss on {self.meta.loss_on}: {t.samples} train {how} of {self.seq_len} "
            f"tokens, {t.loss_tokens} loss tokens, {t.truncated} truncated, {t.split} split, "
            f"{t.dropped} dropped after truncation, padding {t.padding_fraction:.1%}; "
            f"{self.num_val_windows} val samples; {self.steps_per_epoch} steps/epoch at batch "
            f"{self.global_batch_size}"
        )


__all__ = [
    "CHAT_META",
    "ChatMeta",
    "ChatPrepared",
    "ChatStats",
    "DocumentBatches",
    "default_loss_on",
    "is_chat_dataset",
    "prepare_chat_dataset",
]
