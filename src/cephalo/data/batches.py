"""Plan-invariant global batches over a token dataset (`GlobalBatches`).

The global batch of step t is a fixed set of samples, whatever the plan (DESIGN.md's training
contract). Ranks read consecutive slices of it (`rank_slice`) and only those samples;
`batch(step)` depends on the step alone, so a resumed run (under any plan) sees exactly the
batches it would have seen."""

from __future__ import annotations

import math
import operator
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from cephalo.data.text import DEFAULT_VAL_FRACTION, vocab_too_large
from cephalo.data.token_files import TokenFile
from cephalo.errors import CephaloError


# ----------------------------------------------------------------------------- batches
class Batches(Protocol):
    """What the trainer reads of a dataset's batches, text (`GlobalBatches`) or chat
    (`chat_data.DocumentBatches`) alike: step t's global batch is a pure function of t (no
    iterator state), ranks read their consecutive slice of it, and the validation batches are
    fixed. Positions are per-document position ids of packed chat samples, else None."""

    seq_len: int
    global_batch_size: int
    window: int
    """Tokens a sample spans in its token file (seq_len + 1 for text: the shifted label)."""
    vocab_size: int
    num_train_windows: int
    num_val_windows: int
    steps_per_epoch: int

    @property
    def tokens_per_step(self) -> int: ...

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rank_slice(
        self, step: int, offset: int, size: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rank_positions(self, step: int, offset: int, size: int) -> torch.Tensor | None: ...

    def num_val_batches(self, batch_size: int) -> int: ...

    def val_batch(
        self, index: int, batch_size: int, offset: int = 0, size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def val_positions(
        self, index: int, batch_size: int, offset: int = 0, size: int | None = None
    ) -> torch.Tensor | None: ...

    def describe(self) -> str: ...


Rows = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]
"""Input ids, labels, and the positions of packed samples (None where not packed)."""


def _joined(parts: list[Rows]) -> Rows:
    """Consecutive runs of rows as one tensor each (one run: as it is)."""
    if len(parts) == 1:
        return parts[0]
    ids, labels, positions = zip(*parts, strict=True)
    pos = None if positions[0] is None else torch.cat(positions)
    return torch.cat(ids), torch.cat(labels), pos


def rank_rows(batches: Batches, step: int, ranges: list[tuple[int, int]]) -> Rows:
    """A rank's rows of global batch `step`: its (offset, size) runs of samples, in order (a
    flat plan's one slice; a staged plan's rows of each micro-batch: `Engine.sample_ranges`)."""
    return _joined(
        [(*batches.rank_slice(step, a, n), batches.rank_positions(step, a, n)) for a, n in ranges]
    )


def rank_val_rows(
    batches: Batches,
    index: int,
    batch_size: int,
    windows: int,
    ranges: list[tuple[int, int]],
    rows_per_sample: int,
    packing: bool,
) -> Rows:
    """A rank's rows of held-out batch `index` of `batch_size` (of which `windows` samples exist), its runs as
    in `rank_rows`: a short last batch is padded with ignored samples so every rank keeps its
    plan's size (and, packed, positions 0, 1, ... on the padding)."""
    from cephalo.modeling.units import IGNORE_INDEX

    b = batch_size
    parts: list[Rows] = []
    for offset, size in ranges:
        take = max(0, min(size, windows - offset))
        positions = None
        if take:
            x, y = batches.val_batch(index, b, offset, take)
            positions = batches.val_positions(index, b, offset, take)
        else:
            x = y = torch.empty(0, batches.seq_len, dtype=torch.long)
        pad = rows_per_sample * (size - take)
        if pad:
            x = torch.cat([x, torch.zeros(pad, x.shape[1], dtype=x.dtype)])
            y = torch.cat([y, torch.full((pad, y.shape[1]), IGNORE_INDEX, dtype=y.dtype)])
        if packing:  # every rank passes positions (a padded row: 0, 1, ...)
            arange = torch.arange(x.shape[1]).expand(x.shape[0] - take, -1)
            positions = torch.cat([positions, arange]) if positions is not None else arange
        parts.append((x, y, positions))
    return _joined(parts)


def val_range(
    num_val: int, index: int, batch_size: int, offset: int, size: int | None, unit: str
) -> np.ndarray:
    """The samples [offset, offset + size) of validation batch `index` (samples in file
    order, `batch_size` a batch, the last one may be smaller; `size` None: to its end), of a
    split of `num_val` (`unit`: what a sample is, for the messages). Chat and preference data."""
    if num_val == 0:
        raise CephaloError(
            f"the dataset has no validation {unit}: prepare it with a val fraction > 0"
        )
    first = index * batch_size
    count = min(batch_size, num_val - first)
    size = count - offset if size is None else size
    if index < 0 or count <= 0 or offset < 0 or size < 0 or offset + size > count:
        raise CephaloError(f"validation batch {index} [{offset}, +{size}) does not exist")
    return np.arange(first + offset, first + offset + size)


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
