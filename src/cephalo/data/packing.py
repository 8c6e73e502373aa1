"""Packing documents into windows: best-fit decreasing, as TRL's `packing_strategy="bfd"`.

Documents (pieces of at most `capacity` tokens) are taken longest first (ties by index: the
result is a pure function of the lengths) and each goes into the open window with the least
room that still holds it, else into a new window. A window is then a list of piece indices,
longest first. Inside a window each piece keeps its own positions (0, 1, ...), which is how
transformers recognises packed sequences (`masking_utils.find_packed_sequence_indices`):
attention never crosses a document, and no label predicts one document from another.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from cephalo.errors import CephaloError


def best_fit_decreasing(lengths: Sequence[int] | np.ndarray, capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into windows of at most `capacity` tokens (best-fit
    decreasing). Every length must be in [1, capacity]."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if capacity < 1:
        raise CephaloError(f"window capacity must be >= 1, got {capacity}")
    if lengths.size and (lengths.min() < 1 or lengths.max() > capacity):
        raise CephaloError(
            f"pieces must hold 1 to {capacity} tokens to be packed, got "
            f"{int(lengths.min())}..{int(lengths.max())}"
        )
    order = np.lexsort((np.arange(lengths.size), -lengths))  # longest first, then by index
    windows: list[list[int]] = []
    # open windows as (room left, window index), sorted: the best fit is the first with
    # room >= length (bisect); full windows leave the list
    open_rooms: list[tuple[int, int]] = []
    for i in order.tolist():
        n = int(lengths[i])
        at = bisect.bisect_left(open_rooms, (n, -1))
        if at < len(open_rooms):
            room, w = open_rooms.pop(at)
        else:
            room, w = capacity, len(windows)
            windows.append([])
        windows[w].append(i)
        if room - n > 0:
            bisect.insort(open_rooms, (room - n, w))
    return windows


def piece_bounds(
    doc_lengths: np.ndarray, capacity: int, split: bool
) -> tuple[np.ndarray, np.ndarray, int]:
    """(document index, start within it, length) of every piece: a document longer than
    `capacity` is cut into consecutive pieces of `capacity` (`split`) or truncated to its
    first `capacity` tokens. Returns (doc, start) arrays, the lengths follow from them, and
    the number of documents that were longer than a window."""
    doc_lengths = np.asarray(doc_lengths, dtype=np.int64)
    long = int((doc_lengths > capacity).sum())
    if not split:
        return np.arange(doc_lengths.size), np.zeros(doc_lengths.size, dtype=np.int64), long
    counts = np.maximum(1, -(-doc_lengths // capacity))
    docs = np.repeat(np.arange(doc_lengths.size), counts)
    first = np.cumsum(counts) - counts
    starts = (np.arange(docs.size) - np.repeat(first, counts)) * capacity
    return docs, starts, long
