"""Checkpoints in the logical layout, written atomically with `torch.distributed.checkpoint`.

A rank's state is a list of `FlatShard`s: for each logical tensor (a parameter or an AdamW
moment), contiguous ranges of its FLATTENED elements (one, or two where a rank keeps part of
its shard in host memory: the device part and the host part, adjacent). The checkpoint stores every logical
tensor whole, by name, as a 1-D tensor of numel(shape) elements (the real shapes live in the
COMPLETE marker), each rank writing each of its ranges as one chunk. Loading asks DCP for the range the
current rank holds, so a checkpoint written under one plan loads under any other plan, world
size or process count (DCP's resharding intersects the saved chunks with the requested ones).

The DCP planners that write and read a rank's pieces as 1-D chunks: chunks.py.

On disk:

    <root>/step_000010/
        .metadata             DCP: each tensor by name (1-D), its dtype and saved chunks
        __0_0.distcp ...      DCP data, one file per rank
        extra_rank00000.pt    each rank's `extra` (engine step, loss scale, RNG)
        trainer_state.pt      the trainer's state (rank 0)
        COMPLETE              JSON marker written LAST: step, world size, tensors and shapes,
                              every file's size, sha256 of the small files, versions
    <root>/step_000020.tmp/   a save in progress, or one that crashed: never loaded, removed
                              by the next save

Atomicity: everything is written into `step_N.tmp/`; after every rank has written (DCP's
final gather), rank 0 writes COMPLETE, fsyncs and renames the directory to `step_N/` (an
atomic rename on POSIX). A crash at any point leaves the previous checkpoint the newest
complete one. The root is on storage every rank sees (a shared filesystem on multi-node
jobs), or, given `sites` (`checkpoint.node_local`), a directory per node: each node's leader
does there what rank 0 does in a shared one (sites.py).

Verification before loading: the marker parses, every listed file exists with its recorded
size (a truncated file is caught here), and the small files (DCP metadata, extra and trainer
state) match their sha256. Data files are checked by size only: hashing them would read the
whole checkpoint twice.

Collectives: every decision that could differ between ranks (bad input on one rank, rank 0
failing to write) is agreed on first, so all ranks raise the same `CephaloError` instead of
some hanging in a collective until the timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import io
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from cephalo.errors import CephaloError
from cephalo.log import logger
from cephalo.runtime.state.flat import FlatShard
from cephalo.train.checkpoint.chunks import (
    FlatShardLoadPlanner,
    FlatShardSavePlanner,
    state_dict,
    tensor_numel,
)
from cephalo.train.checkpoint.sites import (
    Sites,
    held_files,
    layout_message,
    missing_files,
    node_local_marker,
    pieces_digest,
)

FORMAT_VERSION = 1
MARKER = "COMPLETE"
TRAINER_STATE_FILE = "trainer_state.pt"
DCP_METADATA_FILE = ".metadata"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")
_TMP_SUFFIX = ".tmp"
_MAX_LISTED = 5


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def _extra_file(rank: int) -> str:
    return f"extra_rank{rank:05d}.pt"


# --------------------------------------------------------------------------------------------
# Ranks: a cephalo Comm, a ProcessGroup, or nothing (default group if initialised, else local)


@dataclasses.dataclass(frozen=True)
class _Ranks:
    rank: int
    world_size: int
    group: Any
    """ProcessGroup, or None for the default group."""
    use_dist: bool
    """False: one process, no collectives (DCP `no_dist`)."""

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.use_dist:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def from_rank0(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.use_dist:
            return obj
        box = [obj]
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]


@contextlib.contextmanager
def _dcp_call(ranks: _Ranks) -> Iterator[None]:
    """DCP warns on every single-process call that it assumes one process: we chose that."""
    with warnings.catch_warnings():
        if not ranks.use_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _ranks(comm_or_group: Any) -> _Ranks:
    if comm_or_group is None:
        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
            return _Ranks(dist.get_rank(), world, None, world > 1)
        return _Ranks(0, 1, None, False)
    if dist.is_available() and isinstance(comm_or_group, dist.ProcessGroup):
        rank, world = dist.get_rank(comm_or_group), dist.get_world_size(comm_or_group)
        if rank < 0:
            raise CephaloError(
                "this process is not a member of the process group passed to the checkpoint"
            )
        return _Ranks(rank, world, comm_or_group, world > 1)
    if hasattr(comm_or_group, "world_size") and hasattr(comm_or_group, "rank"):  # cephalo Comm
        world = int(comm_or_group.world_size)
        return _Ranks(
            int(comm_or_group.rank), world, getattr(comm_or_group, "group", None), world > 1
        )
    raise CephaloError(
        f"checkpoint: expected a cephalo Comm, a torch ProcessGroup or None, got {type(comm_or_group).__name__}"
    )


def _agree(ranks: _Ranks, problem: str | None) -> None:
    """Raise the same CephaloError on every rank if any rank has a problem."""
    _raise_first(ranks, ranks.all_gather(problem))


def _raise_first(ranks: _Ranks, problems: Sequence[str | None]) -> None:
    """`problems[r]` is rank r's (already gathered): every rank raises the same error."""
    bad = [(r, p) for r, p in enumerate(problems) if p]
    if bad:
        rank, first = bad[0]
        where = f"rank {rank}: " if ranks.use_dist else ""
        more = f" (and {len(bad) - 1} other rank(s))" if len(bad) > 1 else ""
        raise CephaloError(f"{where}{first}{more}")


def _from_rank0_or_raise(ranks: _Ranks, problem: str | None) -> None:
    """Rank 0 did something alone; every rank raises its error, if any."""
    problem = ranks.from_rank0(problem if ranks.rank == 0 else None)
    if problem:
        raise CephaloError(problem)


def _dcp_failure(e: BaseException) -> str:
    """The first underlying error of a DCP failure, on one line."""
    failures = getattr(e, "failures", None)
    where = ""
    if failures:
        rank, (e, _) = min(failures.items(), key=lambda kv: kv[0])
        where = f" on rank {rank}"
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}{where}: {lines[-1] if lines else ''}"


# --------------------------------------------------------------------------------------------
# Input checks


def _local_shard_problem(shards: Sequence[FlatShard]) -> str | None:
    ranges: dict[str, list[tuple[int, int]]] = {}
    for s in shards:
        if not isinstance(s.local, torch.Tensor) or s.local.dim() != 1:
            return f"piece of {s.name!r} must be a 1-D tensor, got {getattr(s.local, 'shape', type(s.local))}"
        numel = tensor_numel(s.global_shape)
        if s.offset < 0 or s.offset + s.local.numel() > numel:
            return (
                f"piece of {s.name!r} covers [{s.offset}, {s.offset + s.local.numel()}) "
                f"outside the tensor's {numel} elements"
            )
        if s.local.numel():
            for a, b in ranges.get(s.name, []):
                if s.offset < b and a < s.end:
                    return (
                        f"two pieces of tensor {s.name!r} on one rank overlap: [{a}, {b}) and "
                        f"[{s.offset}, {s.end})"
                    )
            ranges.setdefault(s.name, []).append((s.offset, s.end))
    return None


def _tiling_problem(per_rank: list[list[tuple[str, tuple[int, ...], int, int]]]) -> str | None:
    """Every tensor's pieces, over all ranks, cover [0, numel) exactly once, with one shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    pieces: dict[str, list[tuple[int, int, int]]] = {}
    for rank, entries in enumerate(per_rank):
        for name, shape, offset, n in entries:
            if shapes.setdefault(name, shape) != shape:
                return f"ranks disagree on the shape of {name!r}: {list(shapes[name])} vs {list(shape)}"
            if n:
                pieces.setdefault(name, []).append((offset, n, rank))
    for name, shape in shapes.items():
        pos = 0
        for offset, n, rank in sorted(pieces.get(name, [])):
            if offset != pos:
                what = "overlap" if offset < pos else "gap"
                return f"the pieces of {name!r} do not tile it: {what} at element {min(pos, offset)} (rank {rank})"
            pos = offset + n
        if pos != tensor_numel(shape):
            return f"the pieces of {name!r} cover {pos} of its {tensor_numel(shape)} elements"
    return None


def _plain_bytes(obj: Any, what: str) -> tuple[bytes | None, str | None]:
    """torch.save bytes of `obj`, checked to load with `weights_only=True` (no arbitrary
    pickles in checkpoints: loading one cannot run code)."""
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure means "not plain data"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return None, (
            f"{what} must be plain data (tensors, numbers, strings, lists, tuples, dicts) "
            f"to be checkpointed: {first}"
        )
    return buf.getvalue(), None


# --------------------------------------------------------------------------------------------
# Files


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _publish(tmp: Path, final: Path) -> None:
    """Make the finished `tmp` directory the checkpoint `final` (atomic rename)."""
    replaced = None
    if final.exists():  # the same step saved again (e.g. after a resume): swap, then delete
        replaced = final.with_name(final.name + ".replaced" + _TMP_SUFFIX)
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step_N` directory (complete or not), newest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def _remove_stale_tmp(root: Path) -> None:
    for p in root.iterdir():
        if p.name.endswith(_TMP_SUFFIX) and p.is_dir():
            logger.info("removing %s (left by an interrupted save)", p)
            shutil.rmtree(p, ignore_errors=True)


def _prune(root: Path, keep_last: int) -> None:
    complete = [(step, p) for step, p in _step_dirs(root) if (p / MARKER).is_file()]
    for _, path in complete[keep_last:]:
        try:
            shutil.rmtree(path)
        except OSError as e:
            logger.warning("could not delete old checkpoint %s: %s", path, e)


def _listing(tmp: Path) -> tuple[dict[str, int], dict[str, str]]:
    """The files of a staged checkpoint with their sizes, and the small files' sha256."""
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    small = [DCP_METADATA_FILE, TRAINER_STATE_FILE] + [
        n for n in files if n.startswith("extra_rank")
    ]
    return files, {name: _sha256(tmp / name) for name in small if name in files}


def _build_marker(
    tmp: Path, step: int, world_size: int, tensors: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    from cephalo import __version__

    files, sums = _listing(tmp)
    return {
        "format": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cephalo_version": __version__,
        "torch_version": torch.__version__,
        "tensors": tensors,
        "files": files,
        "sha256": sums,
    }


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check a checkpoint directory without loading it; return its marker.

    Raises CephaloError saying what is wrong: no marker (an interrupted save), unreadable
    marker or DCP metadata, missing or truncated files, checksum mismatch."""
    path = Path(path)
    marker_path = path / MARKER
    if not path.is_dir():
        raise CephaloError(f"{path} is not a checkpoint directory")
    if not marker_path.is_file():
        raise CephaloError(f"{path} has no {MARKER} marker (an interrupted or partial save)")
    try:
        marker = json.loads(marker_path.read_text())
        step, files, tensors = int(marker["step"]), dict(marker["files"]), dict(marker["tensors"])
        sums = dict(marker["sha256"])
        int(marker["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CephaloError(f"{path}: unreadable {MARKER} marker ({e})") from None
    if marker.get("format") != FORMAT_VERSION:
        raise CephaloError(
            f"{path}: checkpoint format {marker.get('format')!r}, this cephalo reads format {FORMAT_VERSION}"
        )
    if DCP_METADATA_FILE not in files and tensors:
        raise CephaloError(f"{path}: the marker lists no DCP metadata file")
    held = held_files(path, marker)  # node-local: the parts this copy holds (sites.py)
    for name, size in files.items():
        f = path / name
        if name not in held:
            continue
        if not f.is_file():
            raise CephaloError(f"{path}: file {name} is missing")
        actual = f.stat().st_size
        if actual != size:
            raise CephaloError(
                f"{path}: file {name} has {actual} bytes, {size} were written (truncated or altered)"
            )
    for name, digest in sums.items():
        if name in held and _sha256(path / name) != digest:
            raise CephaloError(f"{path}: file {name} does not match its checksum (corrupt)")
    if DCP_METADATA_FILE in files:
        try:
            dcp.FileSystemReader(str(path)).read_metadata()
        except Exception as e:  # noqa: BLE001 - any failure = unreadable
            raise CephaloError(
                f"{path}: unreadable DCP metadata ({type(e).__name__}: {e})"
            ) from None
    marker["step"] = step
    return marker


def list_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoint directories under `root` that carry a COMPLETE marker, oldest first (not verified)."""
    return [p for _, p in reversed(_step_dirs(Path(root))) if (p / MARKER).is_file()]


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    """The newest checkpoint under `ckpt_root` that passes `verify_checkpoint`, or None.

    Partial or corrupt ones are skipped with a warning; `*.tmp` directories are ignored."""
    path, _, skipped = _newest_valid(Path(ckpt_root))
    for bad, reason in skipped:
        logger.warning("skipping checkpoint %s: %s", bad.name, reason)
    return path


def _newest_valid(root: Path) -> tuple[Path | None, dict[str, Any] | None, list[tuple[Path, str]]]:
    skipped: list[tuple[Path, str]] = []
    for _, path in _step_dirs(root):
        try:
            return path, verify_checkpoint(path), skipped
        except CephaloError as e:
            skipped.append((path, str(e).removeprefix(f"{path}: ")))
    return None, None, skipped


def resume_target(resume: str, ckpt_root: str | Path) -> Path | None:
    """What `checkpoint.resume` means: `never` -> None; `auto` -> the newest complete checkpoint
    under `ckpt_root` or None; anything else -> that path (which must exist)."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(ckpt_root)
    path = Path(resume)
    if not path.exists():
        raise CephaloError(
            f"checkpoint.resume = {resume!r}: no such checkpoint; use `auto`, `never` or an existing "
            f"step_N directory (complete ones under {ckpt_root}: {_names(list_checkpoints(ckpt_root))})"
        )
    return path


def _names(paths: Sequence[Path]) -> str:
    if not paths:
        return "none"
    shown = [p.name for p in paths[-_MAX_LISTED:]]
    return ", ".join(shown) + (
        f" (+{len(paths) - _MAX_LISTED} older)" if len(paths) > _MAX_LISTED else ""
    )


# --------------------------------------------------------------------------------------------
# Save


def save_checkpoint(
    ckpt_root: str | Path,
    step: int,
    shards: Sequence[FlatShard],
    extra: dict[str, Any],
    trainer_state: dict[str, Any],
    comm_or_group: Any = None,
    keep_last: int = 3,
    sites: Sequence[int] | Sites | None = None,
) -> Path:
    """Save this rank's pieces (collective: every rank calls it) as `<ckpt_root>/step_<step>`.

    `extra` is this rank's own small state (saved per rank); `trainer_state` is taken from
    rank 0. Both must be plain data (tensors, numbers, strings, containers). Returns the
    checkpoint directory once it is complete on every rank; keeps the newest `keep_last`.
    `sites`: each rank's site leader where the ranks see different directories (node-local
    checkpoints, sites.py; `ckpt_root` is then this rank's own view); None: one shared."""
    ranks = _ranks(comm_or_group)
    site = Sites.of(sites)
    leads = site.leads(ranks.rank)
    root = Path(ckpt_root)
    final = root / step_dir_name(step)
    tmp = final.with_name(final.name + _TMP_SUFFIX)

    # 1. Inputs, agreed by all ranks before any file is touched.
    problem = None
    if step < 0:
        problem = f"checkpoint step must be >= 0, got {step}"
    if keep_last < 1:
        problem = f"keep_last must be >= 1, got {keep_last}"
    problem = problem or _local_shard_problem(shards)
    extra_bytes, extra_problem = _plain_bytes(extra, "the engine's extra state")
    problem = problem or extra_problem
    trainer_bytes = b""
    if ranks.rank == 0:
        trainer_bytes, trainer_problem = _plain_bytes(trainer_state, "the trainer state")
        problem = problem or trainer_problem
    pieces = [
        (s.name, tuple(int(d) for d in s.global_shape), int(s.offset), s.local.numel())
        for s in shards
    ]
    gathered = ranks.all_gather(
        (problem, pieces, {s.name: str(s.local.dtype).removeprefix("torch.") for s in shards})
    )
    _raise_first(ranks, [p for p, _, _ in gathered])
    all_pieces = [p for _, p, _ in gathered]
    tiling = _tiling_problem(all_pieces)  # computed from the same data on every rank
    if tiling:
        raise CephaloError(f"cannot save checkpoint {final}: {tiling}")
    dtypes: dict[str, str] = {}
    for _, _, d in gathered:
        for name, dt in d.items():
            dtypes.setdefault(name, dt)
    tensors = {
        name: {"shape": list(shape), "dtype": dtypes[name]}
        for entries in all_pieces
        for name, shape, _, _ in entries
    }

    # 2. Rank 0 (each site's leader) prepares an empty staging directory (and clears crashed
    #    saves).
    problem = None
    if leads:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _remove_stale_tmp(root)
            tmp.mkdir()
        except OSError as e:
            problem = f"cannot create checkpoint directory {tmp}: {e}"
    if site.shared:
        _from_rank0_or_raise(ranks, problem)
    else:
        _agree(ranks, problem)
        trainer_bytes = ranks.from_rank0(trainer_bytes if ranks.rank == 0 else None)

    # 3. Each rank writes its extra state; DCP writes the tensors (its final gather means
    #    every rank's files are complete when it returns on rank 0).
    problem = None
    try:
        _write_synced(tmp / _extra_file(ranks.rank), extra_bytes or b"")
        if leads:
            _write_synced(tmp / TRAINER_STATE_FILE, trainer_bytes or b"")
    except OSError as e:
        problem = f"cannot write checkpoint files in {tmp}: {e}"
    _agree(ranks, problem)
    try:
        with _dcp_call(ranks):
            dcp.save(
                state_dict(shards),
                storage_writer=dcp.FileSystemWriter(
                    str(tmp), single_file_per_rank=True, sync_files=True
                ),
                planner=FlatShardSavePlanner(shards),
                process_group=ranks.group,
                no_dist=not ranks.use_dist,
            )
    except (CheckpointException, Exception) as e:  # CheckpointException is a BaseException
        raise CephaloError(
            f"writing checkpoint {tmp} failed ({_dcp_failure(e)}); the previous checkpoint is untouched"
        ) from None

    if not site.shared:
        _seal_sites(tmp, final, step, tensors, all_pieces, ranks, site)
        if leads:
            _prune(root, keep_last)
        return final

    # 4. Rank 0 seals it: marker last, then the atomic rename; then old ones go.
    problem = None
    if ranks.rank == 0:
        try:
            marker = _build_marker(tmp, step, ranks.world_size, tensors)
            _write_synced(tmp / MARKER, json.dumps(marker, indent=1).encode())
            _fsync_dir(tmp)
            _publish(tmp, final)
        except OSError as e:
            problem = f"cannot finish checkpoint {final}: {e}; the previous checkpoint is untouched"
    _from_rank0_or_raise(ranks, problem)
    if ranks.rank == 0:
        _prune(root, keep_last)
        logger.info(
            "saved checkpoint %s (%d tensors, %d ranks)", final, len(tensors), ranks.world_size
        )
    return final


def _seal_sites(
    tmp: Path,
    final: Path,
    step: int,
    tensors: dict[str, dict[str, Any]],
    all_pieces: list[Any],
    ranks: _Ranks,
    site: Sites,
) -> None:
    """A node-local save's end (sites.py): rank 0's DCP metadata copied to every site, each
    leader's files listed, one marker (every site's files, its parts) written by each leader
    into its copy, which it publishes."""
    problem, metadata = None, None
    if ranks.rank == 0:
        try:
            metadata = (tmp / DCP_METADATA_FILE).read_bytes()
        except OSError as e:
            problem = f"cannot read {tmp / DCP_METADATA_FILE}: {e}"
    problem, metadata = ranks.from_rank0((problem, metadata))
    if problem:
        raise CephaloError(problem)
    listing = None
    try:
        if site.leads(ranks.rank):
            if ranks.rank != 0:
                _write_synced(tmp / DCP_METADATA_FILE, metadata)
            listing = _listing(tmp)
    except OSError as e:
        problem = f"cannot write checkpoint files in {tmp}: {e}"
    _agree(ranks, problem)
    listings = ranks.all_gather(listing)
    marker = None
    if ranks.rank == 0:
        base = _build_marker(tmp, step, ranks.world_size, tensors)
        groups = site.groups(ranks.world_size)
        common = (DCP_METADATA_FILE, TRAINER_STATE_FILE)
        marker = node_local_marker(base, groups, listings, common, all_pieces)
    marker = ranks.from_rank0(marker)
    problem = None
    if site.leads(ranks.rank):
        try:
            _write_synced(tmp / MARKER, json.dumps(marker, indent=1).encode())
            _fsync_dir(tmp)
            _publish(tmp, final)
        except OSError as e:
            problem = f"cannot finish checkpoint {final}: {e}; the previous checkpoint is untouched"
    _agree(ranks, problem)
    if ranks.rank == 0:
        logger.info(
            "saved node-local checkpoint %s (%d tensors, %d ranks in %d directories)",
            final,
            len(tensors),
            ranks.world_size,
            len(site.groups(ranks.world_size)),
        )


# --------------------------------------------------------------------------------------------
# Load


def load_checkpoint(
    path_or_root: str | Path,
    shards: Sequence[FlatShard],
    comm_or_group: Any = None,
    sites: Sequence[int] | Sites | None = None,
) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """Fill every `FlatShard.local` in place from a checkpoint; return (step, extra, trainer_state).

    Collective: every rank calls it. `path_or_root` is a checkpoint (`.../step_000010`) or a
    root holding several: then the newest complete one is used, and if it turns out partial or
    corrupt the next older one is (with a warning saying so). Works for any layout: another
    plan, another world size, one process. `extra` is this rank's saved extra state when the
    saving job had this rank, else rank 0's (per-rank state such as RNG streams cannot be
    mapped onto a different set of ranks); the engine decides what to keep. `sites`: as
    `save_checkpoint`'s (each site's leader lists and verifies its own copy). A node-local
    checkpoint (sites.py) loads where every rank finds its shards' files in its own copy,
    else one message says what differs."""
    ranks = _ranks(comm_or_group)
    site = Sites.of(sites)
    target = Path(path_or_root)
    explicit = (
        (target / MARKER).exists()
        or (target / DCP_METADATA_FILE).exists()
        or bool(_STEP_DIR.match(target.name))
    )
    _agree(ranks, _local_shard_problem(shards))

    # Rank 0 lists the candidates; everyone walks them in the same order.
    if not site.shared:
        candidate_names = _site_candidates(target, explicit, ranks)
    elif ranks.rank == 0:
        if not target.exists():
            candidates, problem = [], f"no checkpoint at {target}"
        elif explicit:
            candidates, problem = [target], None
        else:
            candidates = [p for _, p in _step_dirs(target)]
            problem = (
                None if candidates else f"no checkpoint under {target} (no step_N directories)"
            )
        choice = (problem, [str(p) for p in candidates])
    else:
        choice = None
    if site.shared:
        problem, candidate_names = ranks.from_rank0(choice)
        if problem:
            raise CephaloError(problem)

    skipped: list[str] = []
    for name in candidate_names:
        path = Path(name)
        # verification reads files: rank 0 does it once for everyone
        verdict: tuple[str | None, dict[str, Any] | None] = (None, None)
        if site.leads(ranks.rank):
            try:
                verdict = (None, verify_checkpoint(path))
            except CephaloError as e:
                verdict = (str(e), None)
        if site.shared:
            reason, marker = ranks.from_rank0(verdict)
        else:  # each site's leader verified its own copy
            verdicts = ranks.all_gather(verdict)
            reason = next((v[0] for v in verdicts if v is not None and v[0]), None)
            marker = verdicts[site.of_rank[ranks.rank]][1]
        if reason is None:
            assert marker is not None
            _agree(ranks, _model_mismatch(path, marker, shards, ranks))
            _check_layout(path, marker, shards, ranks, site)
            reason = _read_into(path, shards, ranks)
        if reason is None:
            assert marker is not None
            if skipped and ranks.rank == 0:
                logger.warning(
                    "loaded %s instead: newer checkpoint(s) unusable: %s",
                    path.name,
                    "; ".join(skipped),
                )
            extra, trainer_state = _read_small_state(path, marker, ranks)
            if ranks.rank == 0:
                logger.info(
                    "loaded checkpoint %s (step %d, saved by %d ranks, loaded by %d)",
                    path,
                    marker["step"],
                    marker["world_size"],
                    ranks.world_size,
                )
            return int(marker["step"]), extra, trainer_state
        if explicit:
            others = [p for p in list_checkpoints(path.parent) if p != path]
            raise CephaloError(
                f"{reason}. Complete checkpoints next to it: {_names(others)}; pass one of them, or "
                f"the directory {path.parent} to use the newest complete one"
            )
        skipped.append(f"{path.name}: {reason.removeprefix(f'{path}: ')}")
    raise CephaloError(
        f"no usable checkpoint under {target}: {'; '.join(skipped)}. Start without resuming "
        '(checkpoint.resume = "never") or restore a checkpoint'
    )


def _site_candidates(target: Path, explicit: bool, ranks: _Ranks) -> list[str]:
    """Node-local: the checkpoints every rank's own copy of the root has, newest first (this
    rank's paths), or one error naming a rank whose copy lacks them."""
    if not target.exists():
        problem, names = f"no checkpoint at {target}", []
    elif explicit:
        problem, names = None, [target.name]
    else:
        names = [p.name for _, p in _step_dirs(target)]
        problem = None if names else f"no checkpoint under {target} (no step_N directories)"
    gathered = ranks.all_gather((problem, names))
    _raise_first(ranks, [p for p, _ in gathered])
    common = [n for n in gathered[0][1] if all(n in other for _, other in gathered)]
    if not common:
        raise CephaloError(
            f"no checkpoint is in every node's {target}: "
            + "; ".join(
                f"rank {r} has {', '.join(n) or 'none'}" for r, (_, n) in enumerate(gathered)
            )
        )
    return [str(target)] if explicit else [str(target / n) for n in common]


def _check_layout(
    path: Path, marker: dict[str, Any], shards: Sequence[FlatShard], ranks: _Ranks, site: Sites
) -> None:
    """A node-local checkpoint (its marker has `parts`): every rank finds the data files of
    its shards in its own copy, else every rank raises one message saying what differs."""
    if not marker.get("parts"):
        return
    pieces = [
        (s.name, tuple(int(d) for d in s.global_shape), int(s.offset), s.local.numel())
        for s in shards
    ]
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
        missing = missing_files(path, metadata, pieces, ranks.rank, int(marker["world_size"]))
    except Exception:  # noqa: BLE001 - unreadable metadata: the read says so
        missing = []
    gathered = ranks.all_gather((missing, pieces_digest(pieces)))
    if any(m for m, _ in gathered):
        groups = site.groups(ranks.world_size)
        raise CephaloError(
            layout_message(path, marker, [m for m, _ in gathered], groups, [d for _, d in gathered])
        )


def _model_mismatch(
    path: Path, marker: dict[str, Any], shards: Sequence[FlatShard], ranks: _Ranks
) -> str | None:
    """Does the checkpoint hold exactly the tensors (names, shapes) the model has?"""
    saved = {name: tuple(info["shape"]) for name, info in marker["tensors"].items()}
    # gather first and unconditionally: an early return on one rank would hang the others
    names = set().union(*ranks.all_gather({s.name for s in shards}))
    for s in shards:
        shape = tuple(int(d) for d in s.global_shape)
        if s.name in saved and saved[s.name] != shape:
            from cephalo.modeling.lora import is_adapter_parameter

            cause = (
                "model.lora_r or model.adapter_path"
                if is_adapter_parameter(s.name)
                else "model.name or model.overrides"
            )
            return (
                f"checkpoint {path} does not match the model: {s.name} has shape {list(saved[s.name])} "
                f"there and {list(shape)} in the model (was it written for another {cause}?)"
            )
    mismatch = _adapter_mismatch(path, saved.keys(), names)
    if mismatch:
        return mismatch
    missing, unused = sorted(names - saved.keys()), sorted(saved.keys() - names)
    if missing or unused:
        parts = []
        if missing:
            parts.append(f"the model has tensors the checkpoint lacks: {_few(missing)}")
        if unused:
            parts.append(f"the checkpoint has tensors the model lacks: {_few(unused)}")
        return f"checkpoint {path} does not match the model: {'; '.join(parts)} (another model or config?)"
    return None


def _adapter_mismatch(path: Path, saved: Iterable[str], model: Iterable[str]) -> str | None:
    """A LoRA checkpoint (adapters only) loaded into a full fine-tune, or the reverse."""
    from cephalo.modeling.lora import is_adapter_parameter

    was, now = any(map(is_adapter_parameter, saved)), any(map(is_adapter_parameter, model))
    if was == now:
        return None
    if was:
        return (
            f"checkpoint {path} holds LoRA adapters (and their optimizer state), not a whole "
            "model, and this run is a full fine-tune: resume it with the model.adapter (lora "
            "or qlora) it was trained with, or export it (`cephalo export RUN --hf DIR` merges "
            "the adapters) and start a full fine-tune from that directory"
        )
    return (
        f"checkpoint {path} is a full fine-tune and this run trains LoRA adapters "
        '(model.adapter): resume it with model.adapter = "none", or export it (`cephalo '
        "export RUN --hf DIR`) and train adapters on that directory"
    )


def _few(names: list[str]) -> str:
    return ", ".join(names[:_MAX_LISTED]) + (
        f" (+{len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else ""
    )


def _read_into(path: Path, shards: Sequence[FlatShard], ranks: _Ranks) -> str | None:
    """DCP read into the live views; the failure reason (same on every rank) or None."""
    try:
        with _dcp_call(ranks):
            dcp.load(
                state_dict(shards),
                storage_reader=dcp.FileSystemReader(str(path)),
                planner=FlatShardLoadPlanner(shards),
                process_group=ranks.group,
                no_dist=not ranks.use_dist,
            )
    except (CheckpointException, Exception) as e:  # CheckpointException is a BaseException
        return f"{path}: reading the tensors failed ({_dcp_failure(e)})"
    return None


def _read_small_state(
    path: Path, marker: dict[str, Any], ranks: _Ranks
) -> tuple[dict[str, Any], dict[str, Any]]:
    saved_rank = ranks.rank if ranks.rank < int(marker["world_size"]) else 0
    problem, extra, trainer_state = None, {}, {}
    try:
        extra = torch.load(path / _extra_file(saved_rank), weights_only=True)
        trainer_state = torch.load(path / TRAINER_STATE_FILE, weights_only=True)
    except Exception as e:  # noqa: BLE001 - verified files that still fail to load are corrupt
        problem = f"{path}: cannot read the saved extra/trainer state ({type(e).__name__}: {e})"
    _agree(ranks, problem)
    return extra, trainer_state
