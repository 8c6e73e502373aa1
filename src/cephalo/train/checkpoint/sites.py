"""Node-local checkpoints (`checkpoint.node_local`): a checkpoint directory each node sees on
its own disk, not one every rank shares (two rented boxes without a shared filesystem).

A *site* is a set of ranks that see one directory (the start-up probe finds them: every rank
writes a token file, every rank looks for every other's; train/doctor.py). Each site's
*leader*, its lowest rank, does there what rank 0 does in a shared directory: creates the
staging directory, writes the trainer state and a copy of DCP's metadata (rank 0's, sent to
every leader), seals the directory with the COMPLETE marker and publishes it. Every rank
writes its own DCP data file and extra state into its own site's directory, as it would in a
shared one, so each node's directory holds its own ranks' shards.

The marker is the same in every site's copy: it lists every file of every site, and
`parts`: each site's ranks and the files only it holds (its data and extra files; the DCP
metadata and the trainer state are in every copy). Copying the sites' directories of one step
together therefore gives an ordinary complete checkpoint (every part present) that loads
under any plan, world size or process count. A directory holding only some parts is one
site's copy: it verifies (`held_files`) and it loads where every rank finds the data files
its own shards are read from in its own directory (`missing_files`: the same ranks on the
same nodes, the same plan); elsewhere one message says what differs from the saving job and
what to do (`layout_message`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from cephalo.errors import CephaloError

Pieces = list[tuple[str, tuple[int, ...], int, int]]
"""A rank's pieces as the save gathers them: (name, shape, offset, numel)."""


@dataclass(frozen=True)
class Sites:
    """Which ranks see which checkpoint directory: `of_rank[r]` is the lowest rank that sees
    rank r's (its site's leader). None, or one site: the directory every rank shares."""

    of_rank: tuple[int, ...] | None = None

    @classmethod
    def of(cls, sites: Sequence[int] | Sites | None) -> Sites:
        if isinstance(sites, Sites):
            return sites
        if sites is None or len(set(sites)) <= 1:
            return cls(None)
        return cls(tuple(int(s) for s in sites))

    @property
    def shared(self) -> bool:
        return self.of_rank is None

    def leads(self, rank: int) -> bool:
        """Whether `rank` writes its site's common files (rank 0 in a shared directory)."""
        return rank == 0 if self.of_rank is None else self.of_rank[rank] == rank

    def groups(self, world_size: int) -> list[list[int]]:
        """The ranks of each site, by leader."""
        if self.of_rank is None:
            return [list(range(world_size))]
        out: dict[int, list[int]] = {}
        for rank, leader in enumerate(self.of_rank):
            out.setdefault(leader, []).append(rank)
        return [out[k] for k in sorted(out)]


def sites_from_probe(seen: Sequence[Sequence[int]]) -> tuple[tuple[int, ...] | None, str | None]:
    """The sites from the start-up probe's answer (`seen[r]`: the ranks whose token file rank r
    found, itself included): each rank's leader, or why the answer is no partition (rank a
    sees b but not every rank b sees: one directory seen differently, not a disk per node)."""
    sets = [frozenset(s) | {r} for r, s in enumerate(seen)]
    for a, mine in enumerate(sets):
        for b in mine:
            if sets[b] != mine:
                odd = sorted(mine ^ sets[b])
                return None, (
                    f"ranks {a} and {b} see each other's files but not the same others "
                    f"(ranks {', '.join(map(str, odd))}): not one directory per node"
                )
    return tuple(min(s) for s in sets), None


def pieces_digest(pieces: Pieces) -> str:
    """A rank's share of the state (which ranges of which tensors): what a plan decides."""
    text = json.dumps(sorted([n, list(s), o, c] for n, s, o, c in pieces if c))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def node_local_marker(
    marker: dict[str, Any],
    groups: list[list[int]],
    listings: Sequence[tuple[dict[str, int], dict[str, str]] | None],
    common: Sequence[str],
    all_pieces: Sequence[Pieces],
) -> dict[str, Any]:
    """`marker` (of the shared format) for a node-local save: every site's files, their
    checksums, `parts` (each site's ranks and the files only it holds) and each rank's
    `pieces` digest. `listings[r]`: leader r's files and checksums, None on other ranks."""
    files: dict[str, int] = {}
    sums: dict[str, str] = {}
    parts = []
    for group in groups:
        own, own_sums = listings[group[0]] or ({}, {})
        files.update(own)
        sums.update(own_sums)
        parts.append({"ranks": group, "files": sorted(n for n in own if n not in common)})
    return {
        **marker,
        "files": dict(sorted(files.items())),
        "sha256": dict(sorted(sums.items())),
        "parts": parts,
        "pieces": [pieces_digest(p) for p in all_pieces],
    }


def held_files(path: Path, marker: dict[str, Any]) -> set[str]:
    """The files a copy of checkpoint `path` must hold: every file, or for a node-local one
    the common files and those of each part it holds any file of (one site's copy, several
    copied together, or all: a complete checkpoint)."""
    files = set(marker["files"])
    parts = marker.get("parts")
    if not parts:
        return files
    in_parts = {f for p in parts for f in p["files"]}
    held = [p for p in parts if any((path / f).is_file() for f in p["files"])]
    if not held:
        raise CephaloError(f"{path}: holds none of the node-local checkpoint's parts")
    return (files - in_parts) | {f for p in held for f in p["files"]}


def needed_files(
    path: Path, metadata: Any, pieces: Pieces, rank: int, saved_world: int
) -> set[str]:
    """The files rank `rank` reads its pieces (and its extra state) from: the DCP data files
    of every saved chunk its ranges overlap (`metadata`: the checkpoint's DCP metadata)."""
    need = {f"extra_rank{(rank if rank < saved_world else 0):05d}.pt"}
    for name, _, offset, count in pieces:
        md = metadata.state_dict_metadata.get(name)
        if not count or not isinstance(md, TensorStorageMetadata):
            continue
        for chunk in md.chunks:
            lo, n = int(chunk.offsets[0]), int(chunk.sizes[0])
            if lo < offset + count and offset < lo + n:
                info = metadata.storage_data[MetadataIndex(name, chunk.offsets)]
                need.add(str(info.relative_path))
    return need


def missing_files(
    path: Path, metadata: Any, pieces: Pieces, rank: int, saved_world: int
) -> list[str]:
    """Of `needed_files`, those not in this rank's copy of `path`."""
    return sorted(
        f
        for f in needed_files(path, metadata, pieces, rank, saved_world)
        if not (path / f).is_file()
    )


def layout_message(
    path: Path,
    marker: dict[str, Any],
    missing: Sequence[list[str]],
    groups_now: list[list[int]],
    digests_now: Sequence[str],
) -> str:
    """Why a node-local checkpoint cannot be read by this job's ranks, what differs from the
    job that saved it, and what to do."""
    saved_groups = [p["ranks"] for p in marker["parts"]]
    owner = {f: p["ranks"] for p in marker["parts"] for f in p["files"]}
    rank, files = next((r, f) for r, f in enumerate(missing) if f)
    lacks = ", ".join(f"{f} (written by ranks {_list(owner.get(f, []))})" for f in files[:3])
    saved_world = int(marker["world_size"])
    differs = []
    if saved_world != len(missing):
        differs.append(f"the world size ({saved_world} saved, {len(missing)} now)")
    if saved_groups != groups_now:
        differs.append(
            f"the ranks of each directory ({_groups(saved_groups)} saved, {_groups(groups_now)} now)"
        )
    saved_digests = marker.get("pieces", [])
    other = [
        r for r, d in enumerate(digests_now) if r < len(saved_digests) and saved_digests[r] != d
    ]
    if other:
        differs.append(f"the plan (ranks {_list(other)} hold other shards)")
    what = "; it differs from the saving job in " + ", ".join(differs) if differs else ""
    return (
        f"checkpoint {path} is node-local (each node's ranks wrote their shards into their own "
        f"directory: {_groups(saved_groups)}) and rank {rank} does not find its shards there: "
        f"it lacks {lacks}{what}. Resume it with the same ranks on the same nodes and the same "
        f"plan (checkpoint.node_local = true), or copy every node's {path.name} directory into "
        "one directory every rank sees and resume from it (checkpoint.resume = that path): it "
        "then loads under any plan"
    )


def _list(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def _groups(groups: Sequence[Sequence[int]]) -> str:
    return " | ".join(f"[{_list(g)}]" for g in groups)
