"""`torch.distributed.checkpoint` planners that write and read a rank's `FlatShard`s as 1-D
chunks of whole logical tensors (store.py saves and loads with them).

Why a custom planner. DCP describes every piece as a rectangular chunk (offsets, sizes). Its
built-in routes to chunks are DTensor (placements split a dimension `torch.chunk`-style: no
arbitrary uneven fractions) and the legacy ShardedTensor (uneven shards, but it needs a
process group even for one process and lives in the deprecated `torch.distributed._shard`).
A 1-D range IS a chunk, though: `DefaultSavePlanner` / `DefaultLoadPlanner` subclasses that
emit one `WriteItem` / the `ReadItem`s for chunk (offset,) x (len,) per tensor are all we
need. They use only DCP's public planner types and `create_read_items_for_chunk_list` (the
resharding helper the default planner uses), work with and without a process group
(`no_dist`), and keep DCP's global-plan validation (chunks in bounds, no overlap, full cover).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from cephalo.runtime.state.flat import FlatShard


class FlatShardSavePlanner(DefaultSavePlanner):
    """Writes each non-empty `FlatShard` as chunk [offset, offset + n) of a 1-D tensor."""

    def __init__(self, shards: Sequence[FlatShard]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._shards = [s for s in shards if s.local.numel() > 0]
        self._locals = _by_chunk(self._shards)

    def create_local_plan(self) -> SavePlan:
        items = []
        for s in self._shards:
            offsets = torch.Size([s.offset])
            items.append(
                WriteItem(
                    index=MetadataIndex(s.name, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(
                            offsets=offsets, sizes=torch.Size([s.local.numel()])
                        ),
                        properties=TensorProperties.create_from_tensor(s.local),
                        size=torch.Size([tensor_numel(s.global_shape)]),
                    ),
                )
            )
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self._locals[index.fqn, tuple(index.offset)]


class FlatShardLoadPlanner(DefaultLoadPlanner):
    """Reads, for each non-empty `FlatShard`, the saved chunks overlapping its range, straight
    into the live `local` view."""

    def __init__(self, shards: Sequence[FlatShard]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._shards = [s for s in shards if s.local.numel() > 0]
        self._locals = _by_chunk(self._shards)

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items = []
        for s in self._shards:
            md = self.metadata.state_dict_metadata.get(s.name)
            numel = tensor_numel(s.global_shape)
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != (numel,):
                found = tuple(md.size) if isinstance(md, TensorStorageMetadata) else md
                raise ValueError(
                    f"{s.name}: DCP metadata holds {found}, expected a 1-D tensor of {numel}"
                )
            chunk = ChunkStorageMetadata(
                offsets=torch.Size([s.offset]), sizes=torch.Size([s.local.numel()])
            )
            items += create_read_items_for_chunk_list(s.name, md, [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self._locals[index.fqn, tuple(index.offset)]


def _by_chunk(shards: Sequence[FlatShard]) -> dict[tuple[str, tuple[int, ...]], torch.Tensor]:
    """Each piece's live tensor by (name, chunk offset): DCP names a chunk by both."""
    return {(s.name, (int(s.offset),)): s.local for s in shards}


def state_dict(shards: Sequence[FlatShard]) -> dict[str, torch.Tensor]:
    """What DCP is handed as the state dict: one tensor per name (the planners above resolve
    every chunk themselves, by name and offset)."""
    return {s.name: s.local for s in shards if s.local.numel() > 0}


def tensor_numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
