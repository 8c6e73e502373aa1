"""Autograd helpers shared by the engine and the profiler, which replays the engine's backward
(`profiling/measure.py`) and must charge the same transient bytes and drain gradients alike."""

from __future__ import annotations

import torch

from cephalo.runtime.memory import MemoryLedger


def drain_grad(dst: torch.Tensor, leaf: torch.Tensor) -> None:
    """Post-accumulate hook: add a parameter's fresh gradient into its fp32 slot, free it."""
    dst.add_(leaf.grad.reshape(-1))
    leaf.grad = None


_SAVED_ATTRS: dict[type, tuple[str, ...]] = {}
"""Names of the saved-tensor attributes of each autograd node type (dir() is slow)."""


def largest_saved_bytes(root, ledger: MemoryLedger) -> int:
    """Largest storage any node of the autograd graph under `root` saved for backward
    (ledger buffers, i.e. gathered parameters and boundaries, excluded): the transient bytes
    a unit's backward holds beyond what the ledger allocated."""
    largest, seen, stack = 0, set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        attrs = _SAVED_ATTRS.get(type(node))
        if attrs is None:
            attrs = _SAVED_ATTRS[type(node)] = tuple(
                a for a in dir(node) if a.startswith("_saved_")
            )
        for attr in attrs:
            value = getattr(node, attr)
            if isinstance(value, torch.Tensor) and value.numel() and not ledger.owns(value):
                largest = max(largest, value.untyped_storage().nbytes())
        stack.extend(fn for fn, _ in node.next_functions)
    return largest
