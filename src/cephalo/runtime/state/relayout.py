"""Moving the training state from one plan's shards to another's in memory, through the
logical layout the checkpoints use (`FlatShard`s), with collectives instead of files.

Every rank writes the pieces it holds under the old plan (`saved_state`: each element once,
the first shard group's replica in a hierarchical plan) into a zeroed buffer covering a
window of the logical tensors; one all-reduce (sum) gives every rank the whole window; each
rank copies out the pieces the new plan gives it. A sum with zeros is exact, so the new
state is the old state bit for bit (what a checkpoint save + load under the new plan gives).
The windows hold at most `window_elems` fp32 elements, so the extra memory is bounded
whatever the model's size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cephalo.errors import CephaloError
from cephalo.runtime.collectives.comm import Comm
from cephalo.runtime.device_memory import device_memory_counted, free_device_bytes, host_memory
from cephalo.runtime.state.flat import FlatShard, overlap

WINDOW_ELEMS = 1 << 24
"""Elements (fp32: 64 MiB) re-laid out per all-reduce."""


def _tensors(pieces: Sequence[FlatShard]) -> dict[str, int]:
    """Logical tensor name -> element count, in the pieces' order."""
    out: dict[str, int] = {}
    for p in pieces:
        out.setdefault(p.name, p.global_numel)
    return out


@torch.no_grad()
def relayout(
    old: Sequence[FlatShard],
    new: Sequence[FlatShard],
    comm: Comm,
    device: torch.device,
    window_elems: int = WINDOW_ELEMS,
) -> int:
    """Copy the logical state `old` (this rank's pieces under the old plan; empty outside the
    first shard group) into `new` (its pieces under the new plan, live views). Collective over
    `comm` (every rank of the job). Returns the number of elements moved per rank."""
    # a pipeline stage's ranks hold their stage's tensors only: the union of every rank's
    sizes: dict[str, int] = {}
    for mine in comm.all_gather_object(sorted(_tensors(new).items())):
        for name, numel in mine:
            if sizes.setdefault(name, numel) != numel:
                raise CephaloError(
                    f"ranks disagree on the model's tensor {name!r} ({sizes[name]} vs {numel} "
                    "elements): cannot re-lay out the state"
                )
    # one global coordinate: the logical tensors one after another, in sorted name order
    start: dict[str, int] = {}
    total = 0
    for name, numel in sorted(sizes.items()):
        start[name] = total
        total += numel
    for p in old:
        if p.name not in start:
            raise CephaloError(f"the old state has tensor {p.name!r} the new plan does not")
    # the window lives on the device beside the new engine: at most half of what the fullest
    # device has free (one size on every rank: the all-reduces must match)
    free = free_device_bytes(device)
    caps = comm.all_gather_object(None if free is None else free // 2 // 4)
    fits = [c for c in caps if c is not None]
    if fits:
        window_elems = max(min(window_elems, *fits), 1 << 10)
    buf = torch.empty(min(window_elems, max(total, 1)), dtype=torch.float32, device=device)
    lo = 0
    while lo < total:
        hi = min(total, lo + buf.numel())
        window = buf[: hi - lo]
        window.zero_()
        for p in old:
            a, b = overlap(start[p.name] + p.offset, p.local.numel(), lo, hi - lo)
            if b > a:
                first = a - start[p.name] - p.offset
                window[a - lo : b - lo].copy_(p.local[first : first + b - a])
        comm.all_reduce(window, "sum")
        for p in new:
            a, b = overlap(start[p.name] + p.offset, p.local.numel(), lo, hi - lo)
            if b > a:
                first = a - start[p.name] - p.offset
                p.local[first : first + b - a].copy_(window[a - lo : b - lo])
        lo = hi
    return total


@torch.no_grad()
def to_host(pieces: Sequence[FlatShard]) -> list[FlatShard]:
    """`pieces` with every device-held piece copied to host memory, so that the engine holding
    them can be freed before the next one allocates (a re-plan on a full device,
    train/replan.py). Pieces already on the host (host state) are kept as they are: their
    views keep those buffers alive without a copy."""
    out = []
    for p in pieces:
        if p.local.device.type != "cpu":
            local = p.local.to("cpu")
        elif device_memory_counted():
            # an emulated device (its pieces are CPU tensors too): copied to host memory, so
            # that the old engine's buffers die as they do on a GPU
            with host_memory():
                local = p.local.clone()
        else:
            local = p.local
        out.append(FlatShard(p.name, p.global_shape, p.offset, local))
    return out


def staged_bytes(pieces: Sequence[FlatShard]) -> int:
    """Bytes of the device-held pieces of `pieces` (what `to_host` copies)."""
    return sum(
        p.local.numel() * p.local.element_size() for p in pieces if p.local.device.type != "cpu"
    )
