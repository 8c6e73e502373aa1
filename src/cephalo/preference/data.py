"""Preference datasets: pairs of completions rendered once (`render.PairRenderer`), and their
plan-invariant batches for DPO (`PreferenceBatches`).

A preference dataset is a directory (like a chat dataset, docs/data.md "Preference data"):

    train.bin  train.json   each pair's two rows back to back: prompt + chosen, prompt + rejected
                            (+ the usual sidecar; `num_documents` counts pairs)
    train.docs.bin          int64 row starts, 2 x pairs + 1 (the end)
    train.prompt.bin        int64 per pair: its prompt's tokens (the rest of a row is its
                            completion: the loss mask, stored as one number per pair)
    val.*                   the same for the last `val_fraction` of the pairs
    tokenizer/              the tokenizer's files (its chat template included)
    preference.json         kind, template, statistics: written last (what makes it a dataset)

Rows are stored whole; truncation is applied when the batches are opened, so one prepared
dataset trains under any `seq_len` / `data.max_prompt_len` (as chat data's packing is): TRL's
rule, the prompt cut to its last `max_prompt_len` tokens, then the row to `seq_len` (the
completion's end goes); a pair whose prompt alone fills `seq_len` is dropped and counted.

A sample is a pair: `rank_slice` gives 2 rows per pair, interleaved (row 2i: pair i's prompt +
chosen, row 2i+1: prompt + rejected), right-padded with id 0; labels[j] is token j+1 when that
token is a completion token, else IGNORE_INDEX, so the prompt and the padding are never scored.
The plan's batch sizes count pairs, so a chosen and its rejected are always on the same rank.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from cephalo.data.batches import EpochOrder, val_range
from cephalo.data.chat import chat_sources, detect_inputs_format, load_chat_template
from cephalo.data.chat_data import (
    _checksum,
    _complete,
    _copy_bytes,
    _memmap,
    _sources_identity,
    load_template_tokenizer,
    render_all,
)
from cephalo.data.hf_tokenizer import tokenizer_fingerprint
from cephalo.data.text import DEFAULT_VAL_FRACTION, _exclusive, vocab_too_large
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
from cephalo.preference.render import PairRenderer, PairTokens

PREFERENCE_META = "preference.json"
PREFERENCE_FORMAT_VERSION = 1
SPLIT_FILES = (".json", ".bin", ".docs.bin", ".prompt.bin")


@dataclass
class PreferenceStats:
    """What preparation found (also in preference.json)."""

    pairs: int = 0
    tokens: int = 0
    """Tokens of both rows of every pair (the prompt counted twice), before truncation."""
    completion_tokens: int = 0
    """Tokens of the chosen and rejected completions."""
    retokenized: int = 0
    """Pairs whose prompt's tokens were not a prefix of a row's (a tokenizer merging across the
    boundary): that completion was tokenized on its own after the prompt."""


@dataclass
class PreferenceMeta:
    """preference.json: how a preference dataset was made."""

    kind: str
    """`conversational` or `standard` (render.py)."""
    template_sha256: str
    tokenizer_key: str
    source_sha256: str
    source_stat: str
    val_fraction: float
    stats: PreferenceStats = field(default_factory=PreferenceStats)
    version: int = PREFERENCE_FORMAT_VERSION

    def settings(self) -> dict:
        """What a rebuild is skipped on (the kind follows from the sources)."""
        skip = ("stats", "source_stat", "source_sha256", "kind")
        return {k: v for k, v in asdict(self).items() if k not in skip}

    @classmethod
    def read(cls, path: Path) -> PreferenceMeta | None:
        try:
            d = json.loads(path.read_text())
            d["stats"] = PreferenceStats(**d.get("stats", {}))
            return cls(**d)
        except (OSError, ValueError, TypeError, AttributeError):
            return None


def is_preference_dataset(path: str | Path) -> bool:
    """A prepared preference dataset: a directory whose `preference.json` (written last) is
    there."""
    path = Path(path)
    return path.is_dir() and (path / PREFERENCE_META).is_file()


def check_preference_loss_on(loss_on: str) -> None:
    """`data.loss_on` has one meaning for pairs: the completions (what DPO compares)."""
    if loss_on not in ("auto", "completion"):
        raise CephaloError(
            f"data.loss_on = {loss_on} does not apply to preference pairs: their loss is on the "
            f"completions (chosen and rejected); leave data.loss_on = auto (--loss-on auto)"
        )


@dataclass
class PreferencePrepared:
    path: Path
    meta: PreferenceMeta
    seconds: float
    cached: bool = False


# ----------------------------------------------------------------------------- preparation
class _PairWriter:
    """Rows appended to a temporary file; `finish` splits the pairs into train and val and
    publishes them (bin files first, sidecars after; preference.json is the caller's, last)."""

    def __init__(self, out_dir: Path, vocab_size: int):
        self.out_dir, self.vocab_size = out_dir, vocab_size
        self.dtype = token_dtype(vocab_size)
        self.tmp = out_dir / "all.bin.tmp"
        self.file = open(self.tmp, "wb")  # noqa: SIM115 (closed in finish or abort)
        self.row_lengths: list[int] = []
        self.prompt_lengths: list[int] = []

    def append(self, pair: PairTokens) -> None:
        for completion in (pair.chosen, pair.rejected):
            row = np.concatenate([pair.prompt, completion])
            if row.min() < 0 or row.max() >= self.vocab_size:
                raise CephaloError(
                    f"the tokenizer produced id {int(row.max())}, outside its vocab of "
                    f"{self.vocab_size}: the tokenizer files are inconsistent"
                )
            row.astype(self.dtype).tofile(self.file)
            self.row_lengths.append(int(row.size))
        self.prompt_lengths.append(int(pair.prompt.size))

    def abort(self) -> None:
        self.file.close()
        for p in self.out_dir.glob("*.tmp"):
            p.unlink(missing_ok=True)

    def finish(self, meta: TokenFileMeta, val_fraction: float) -> None:
        self.file.close()
        n = len(self.prompt_lengths)
        n_val = math.floor(n * val_fraction) if n > 1 else 0
        bounds = np.concatenate([[0], np.cumsum(self.row_lengths, dtype=np.int64)])
        prompts = np.asarray(self.prompt_lengths, dtype=np.int64)
        for split, (p0, p1) in (("train", (0, n - n_val)), ("val", (n - n_val, n))):
            t0, t1 = int(bounds[2 * p0]), int(bounds[2 * p1])
            tmp = self.out_dir / f"{split}.bin.tmp"
            with open(self.tmp, "rb") as fi, open(tmp, "wb") as fo:
                fi.seek(t0 * self.dtype.itemsize)
                _copy_bytes(fi, fo, (t1 - t0) * self.dtype.itemsize)
            os.replace(tmp, self.out_dir / f"{split}.bin")
            for suffix, values in (
                (".docs.bin", bounds[2 * p0 : 2 * p1 + 1] - t0),
                (".prompt.bin", prompts[p0:p1]),
            ):
                tmp = self.out_dir / f"{split}{suffix}.tmp"
                values.astype(np.int64).tofile(tmp)
                os.replace(tmp, self.out_dir / f"{split}{suffix}")
            m = TokenFileMeta(
                **{**asdict(meta), "split": split, "num_tokens": t1 - t0, "num_documents": p1 - p0}
            )
            _write_atomic(self.out_dir / f"{split}.json", m.to_json())
        self.tmp.unlink()


def prepare_preference_dataset(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    tokenizer: str | Path,
    fmt: str = "auto",
    chat_template: str | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    progress: bool = False,
    force: bool = False,
    max_vocab_size: int | None = None,
    model: str = "the model",
) -> PreferencePrepared:
    """Render and tokenize preference pairs (render.py's formats) into `out_dir`.

    tokenizer: a directory with a transformers tokenizer (its chat template, or
    `chat_template`). fmt: `auto` (detected: records with `chosen` and `rejected`) or
    `preference`. A bad record is one error naming its file and line; nothing of this run is
    left in `out_dir` then (and an earlier dataset there stops being one). Reused when the
    sources and settings are those of the dataset already there."""
    started = time.perf_counter()
    out_dir = Path(out_dir)
    paths = chat_sources(inputs)
    if not paths:
        raise CephaloError("no input given: pass JSON Lines, Parquet or datasets directories")
    fmt = detect_inputs_format(paths, fmt)
    if fmt != "preference":
        raise CephaloError(
            f"{paths[0]} holds {fmt} records, not preference pairs: a preference record has "
            f"'chosen' and 'rejected' (and 'prompt'); prepare {fmt} data without "
            f"data.format = preference"
        )
    if not 0.0 <= val_fraction < 1.0:
        raise CephaloError(f"val_fraction must be in [0, 1), got {val_fraction}")
    directory = Path(tokenizer)
    hf = load_template_tokenizer(
        tokenizer, "preference data", "its chat template", max_vocab_size, model
    )
    renderer = PairRenderer(hf.transformers_tokenizer, load_chat_template(chat_template))
    files, stat = _sources_identity(paths)
    meta = PreferenceMeta(
        kind="",
        template_sha256=hashlib.sha256((renderer.chat.template or "").encode()).hexdigest()[:16],
        tokenizer_key="hf-" + tokenizer_fingerprint(directory),
        source_sha256="",
        source_stat=stat,
        val_fraction=val_fraction,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(out_dir / ".prepare.lock"):
        old = PreferenceMeta.read(out_dir / PREFERENCE_META)
        same = (
            old is not None
            and old.settings() == meta.settings()
            and _complete(out_dir, SPLIT_FILES)
        )
        if not force and same and old.source_stat == stat:
            return PreferencePrepared(out_dir, old, time.perf_counter() - started, cached=True)
        meta.source_sha256 = _checksum(files)
        if not force and same and old.source_sha256 == meta.source_sha256:
            old.source_stat = stat
            _write_atomic(out_dir / PREFERENCE_META, json.dumps(asdict(old), indent=2) + "\n")
            return PreferencePrepared(out_dir, old, time.perf_counter() - started, cached=True)
        (out_dir / PREFERENCE_META).unlink(missing_ok=True)  # no longer a dataset from here on
        for name in ("train.json", "val.json"):
            (out_dir / name).unlink(missing_ok=True)
        writer = _PairWriter(out_dir, hf.vocab_size)
        try:
            render_all(
                paths,
                files,
                progress,
                "rendering preference pairs",
                lambda batch: _write_batch(batch, renderer, writer, meta.stats),
            )
            if not meta.stats.pairs:
                raise CephaloError(f"the dataset is empty: {len(paths)} input(s) hold no pair")
            meta.kind = renderer.kind or ""
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
        _write_atomic(out_dir / PREFERENCE_META, json.dumps(asdict(meta), indent=2) + "\n")
    s = meta.stats
    logger.info(
        "%s: %d %s preference pairs, %d tokens (%d in completions), %d retokenized at the "
        "prompt's end",
        out_dir,
        s.pairs,
        meta.kind,
        s.tokens,
        s.completion_tokens,
        s.retokenized,
    )
    return PreferencePrepared(out_dir, meta, time.perf_counter() - started)


def _write_batch(batch: list, renderer: PairRenderer, writer: _PairWriter, stats) -> None:
    for pair in renderer.encode(batch):
        writer.append(pair)
        stats.pairs += 1
        stats.completion_tokens += int(pair.chosen.size + pair.rejected.size)
        stats.tokens += int(2 * pair.prompt.size + pair.chosen.size + pair.rejected.size)
        stats.retokenized += int(pair.retokenized)


# ----------------------------------------------------------------------------- batches
@dataclass
class PairSampleStats:
    """What the pairs of one split are, for a seq_len and max_prompt_len."""

    pairs: int = 0
    """Pairs kept (trained on)."""
    dropped: int = 0
    """Pairs whose prompt alone fills seq_len (after max_prompt_len): no completion token left."""
    truncated: int = 0
    """Kept pairs with a prompt cut to max_prompt_len or a row cut to seq_len."""
    tokens: int = 0
    """Real (non-padding) tokens of the kept pairs' rows."""
    completion_tokens: int = 0
    """Labels of the kept pairs' rows (completion tokens within seq_len)."""
    padding_fraction: float = 0.0


class _PairSplit:
    """One split's pairs, truncated (TRL's rule) and read as interleaved rows."""

    def __init__(self, data: Path, split: str, seq_len: int, max_prompt_len: int | None):
        self.file = TokenFile(data, split)
        base = self.file.sidecar.with_suffix("")
        starts = np.asarray(_memmap(base.with_name(f"{split}.docs.bin"), np.int64))
        prompt = np.asarray(_memmap(base.with_name(f"{split}.prompt.bin"), np.int64))
        n = prompt.size
        if starts.size != 2 * n + 1 or int(starts[-1]) != self.file.num_tokens:
            raise CephaloError(
                f"{data}: the {split} row or prompt files do not match its tokens; {PREPARE_HINT}"
            )
        lengths = np.diff(starts).reshape(n, 2)
        cut = np.maximum(prompt - max_prompt_len, 0) if max_prompt_len else np.zeros_like(prompt)
        prompt_kept = prompt - cut
        keep = prompt_kept < seq_len  # at least one completion token in the window
        rows = np.minimum(lengths - cut[:, None], seq_len)
        self.seq_len = seq_len
        self.kept = np.flatnonzero(keep)
        self.start = starts[:-1].reshape(n, 2)[self.kept] + cut[self.kept, None]
        self.rows = rows[self.kept]
        self.prompt = prompt_kept[self.kept]
        truncated = (cut > 0) | (lengths - cut[:, None] > seq_len).any(axis=1)
        tokens = int(self.rows.sum())
        self.stats = PairSampleStats(
            pairs=int(self.kept.size),
            dropped=int(n - self.kept.size),
            truncated=int(truncated[keep].sum()),
            tokens=tokens,
            completion_tokens=int((self.rows - np.maximum(self.prompt, 1)[:, None]).sum()),
            padding_fraction=1.0 - tokens / (2 * self.kept.size * seq_len)
            if self.kept.size
            else 0.0,
        )

    def read(self, pairs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of kept pairs `pairs` (indices into the kept pairs): [2 x len, seq_len] ids and
        labels, pair i's chosen row at 2i, its rejected row at 2i+1."""
        s, vocab = self.seq_len, self.file.vocab_size
        ids = np.zeros((2 * len(pairs), s), dtype=np.int64)  # padding: id 0, never a label
        labels = np.full((2 * len(pairs), s), IGNORE_INDEX, dtype=np.int64)
        for i, p in enumerate(np.asarray(pairs, dtype=np.int64)):
            first = max(int(self.prompt[p]), 1)  # the first completion token scored
            for r in range(2):
                a, n = int(self.start[p, r]), int(self.rows[p, r])
                toks = np.asarray(self.file.tokens[a : a + n], dtype=np.int64)
                if toks.size and toks.max() >= vocab:
                    raise CephaloError(
                        f"{self.file.bin_path} holds token id {int(toks.max())}, but its vocab "
                        f"size is {vocab}: the file is corrupt; prepare the data again"
                    )
                ids[2 * i + r, :n] = toks
                labels[2 * i + r, first - 1 : n - 1] = toks[first:n]
        return torch.from_numpy(ids), torch.from_numpy(labels)


class PreferenceBatches:
    """Plan-invariant global batches of a preference dataset (`data.batches.Batches`): a sample
    is a pair, step t's batch depends only on the dataset, seq_len, max_prompt_len, the batch
    size (in pairs), the seed and t. Ranks read consecutive pairs of it; each pair is two rows
    (module docstring)."""

    is_preference = True
    """What tells preference batches from the others (the objective checks it)."""

    def __init__(
        self,
        data: str | Path,
        seq_len: int,
        global_batch_size: int,
        seed: int = 0,
        model_vocab_size: int | None = None,
        max_prompt_len: int | None = None,
    ):
        for name, value in (("seq_len", seq_len), ("global_batch_size", global_batch_size)):
            if not isinstance(value, int) or value < 1:
                raise CephaloError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(seed, int) or seed < 0:
            raise CephaloError(f"seed must be a non-negative integer, got {seed!r}")
        if max_prompt_len is not None and (
            not isinstance(max_prompt_len, int) or max_prompt_len < 1
        ):
            raise CephaloError(
                f"data.max_prompt_len must be a positive integer or unset, got {max_prompt_len!r}"
            )
        data = Path(data)
        self.meta = PreferenceMeta.read(data / PREFERENCE_META)
        if self.meta is None or self.meta.version != PREFERENCE_FORMAT_VERSION:
            raise CephaloError(
                f"{data / PREFERENCE_META} is missing, unreadable or of another version; "
                f"{PREPARE_HINT}"
            )
        self.seq_len, self.global_batch_size, self.seed = seq_len, global_batch_size, seed
        self.max_prompt_len = max_prompt_len
        self.window = seq_len
        self.train = _PairSplit(data, "train", seq_len, max_prompt_len)
        self.val = _PairSplit(data, "val", seq_len, max_prompt_len)
        self.vocab_size = self.train.file.vocab_size
        if model_vocab_size is not None and model_vocab_size < self.vocab_size:
            raise CephaloError(
                vocab_too_large(self.vocab_size, f"dataset {data}", model_vocab_size, "the model")
            )
        t = self.train.stats
        if t.pairs == 0:
            prompt = f"max_prompt_len {max_prompt_len}" if max_prompt_len else "no max_prompt_len"
            raise CephaloError(
                f"dataset {data}: all {t.dropped} training pairs have a prompt of seq_len "
                f"{seq_len} tokens or more ({prompt}), so no completion token is left: raise "
                f"data.seq_len or set data.max_prompt_len below it"
            )
        self.num_train_windows = t.pairs
        self.num_val_windows = self.val.stats.pairs
        if self.num_train_windows < global_batch_size:
            raise CephaloError(
                f"dataset {data} has {t.pairs} training pairs ({t.dropped} dropped: prompt fills "
                f"seq_len {seq_len}), but one global batch needs {global_batch_size} pairs: use "
                f"a smaller train.global_batch_size, or more data"
            )
        self.order = EpochOrder(self.num_train_windows, global_batch_size, seed)
        self.steps_per_epoch = self.order.steps_per_epoch

    @property
    def tokens_per_step(self) -> int:
        """Tokens a step runs: two rows of seq_len per pair."""
        return 2 * self.global_batch_size * self.seq_len

    def epoch_order(self, epoch: int) -> np.ndarray:
        return self.order.order(epoch)

    def rank_pairs(self, step: int, offset: int, size: int) -> np.ndarray:
        """The split's pair numbers (their order in the prepared files, dropped pairs counted)
        of pairs [offset, offset + size) of step's batch: a key for per-pair values stored with
        the dataset (reference log-probabilities)."""
        return self.train.kept[self.order.windows(step, offset, size)]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rank_slice(step, 0, self.global_batch_size)

    def rank_slice(self, step: int, offset: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pairs [offset, offset + size) of step's batch: ids and labels [2 x size, seq_len]."""
        return self.train.read(self.order.windows(step, offset, size))

    def rank_positions(self, step: int, offset: int, size: int) -> None:
        """Rows are never packed: positions 0, 1, ... (None)."""
        return None

    def real_tokens(self, step: int) -> int:
        """Tokens of step's batch that are not padding (what throughput counts)."""
        return int(self.train.rows[self.order.windows(step, 0, self.global_batch_size)].sum())

    def num_val_batches(self, batch_size: int) -> int:
        return math.ceil(self.num_val_windows / batch_size)

    def _val_pairs(self, index: int, batch_size: int, offset: int, size: int | None):
        return val_range(self.num_val_windows, index, batch_size, offset, size, "pairs")

    def val_pairs(
        self, index: int, batch_size: int, offset: int = 0, size: int | None = None
    ) -> np.ndarray:
        """As `rank_pairs`, for `val_batch`'s pairs (numbers in the val split)."""
        return self.val.kept[self._val_pairs(index, batch_size, offset, size)]

    def val_batch(
        self, index: int, batch_size: int, offset: int = 0, size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Validation batch `index` (pairs in file order), or its pairs [offset, offset +
        size): the layout of `rank_slice`."""
        return self.val.read(self._val_pairs(index, batch_size, offset, size))

    def val_positions(
        self, index: int, batch_size: int, offset: int = 0, size: int | None = None
    ) -> None:
        return None

    def describe(self) -> str:
        t, m = self.train.stats, self.meta
        prompt = f", prompts to their last {self.max_prompt_len}" if self.max_prompt_len else ""
        return (
            f"{m.stats.pairs} {m.kind} preference pairs: {t.pairs} train pairs ({t.dropped} "
            f"dropped: the prompt fills seq_len {self.seq_len}; {t.truncated} truncated{prompt}), "
            f"{t.tokens} tokens, {t.completion_tokens} completion tokens, padding "
            f"{t.padding_fraction:.1%}; {self.num_val_windows} val pairs; {self.steps_per_epoch} "
            f"steps/epoch at batch {self.global_batch_size} pairs ({2 * self.global_batch_size} "
            f"rows)"
        )


__all__ = [
    "PREFERENCE_META",
    "PreferenceBatches",
    "PreferenceMeta",
    "PreferencePrepared",
    "PreferenceStats",
    "check_preference_loss_on",
    "is_preference_dataset",
    "prepare_preference_dataset",
]
