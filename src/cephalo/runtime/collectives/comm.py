"""Collectives with uneven shards: `all_gather_v`, `reduce_scatter_v`, `all_reduce`.

The engine shards each unit's flat buffer unevenly (rank r owns `sizes[r]` elements, possibly
zero), so it needs variable-size collectives. One small interface, several implementations:

- `LocalComm`: world size 1, no process group; collectives are copies.
- `GlooComm`: CPU. `dist.all_gather` rejects uneven sizes on gloo (torch 2.13), so the
  gather is one async broadcast per source rank into that rank's view of `out`. The list
  form of `dist.reduce_scatter` accepts uneven sizes, zero sizes and fp32/bf16/fp16 (measured).
  (An all-reduce in place on `full` and a copy of this rank's slice was 2.2-3.1x faster than
  the list form at 4 ranks, bench/gloo_gather.py, and made uneven engine steps 1.5-8 % faster;
  it is not used because it sums the ranks in another fp32 order, which moved one element of
  gpt_neox's embedding past the HF equivalence test's 1e-5 bound, tests/test_hf_dist.py.)

Both `all_gather_v` and `reduce_scatter_v` can run asynchronously (`async_op=True`: the
returned `Handle` is waited for later), so the engine overlaps them with compute.
- `NcclComm`: CUDA. `dist.all_gather` / `dist.reduce_scatter` with lists of uneven views;
  NCCL runs them as grouped broadcasts / reduces.

Equal sizes (an even split; every unit at world size 1 goes through `LocalComm`): NCCL calls
`all_gather_into_tensor` / `reduce_scatter_tensor` on the buffers themselves, gloo
`reduce_scatter_tensor` and, for the gather, its per-source broadcasts (`Comm.even_gather`:
on gloo over loopback the broadcasts, which its worker threads run at once, took 0.55-0.9x the
time of `all_gather_into_tensor` at 2 and 4 ranks and 0.6-4.8 MiB: bench/gloo_gather.py).
The list forms would copy everything through a flattened buffer (a whole unit per call that
neither the ledger nor the cost model counts) and, on NCCL, give up its ring / tree / NVLS
algorithms. `counters.even_calls` counts the calls that took the even path.
- `PaddedComm`: pads every shard to `max(sizes)` and uses the even tensor collectives. More
  traffic, different code path: a cross-check for the others. (The engine pads a near-even
  split itself, in buffers allocated padded, and calls the even path with equal sizes:
  runtime/collectives/padded.py.)

Validation. Before every collective each rank checks its own arguments (1-D contiguous
tensors, `len(sizes) == world_size`, non-negative sizes, matching numels and dtypes) and then,
when `validate` is on, all ranks exchange a small fingerprint (which collective, dtype, sizes,
"my arguments are fine") with one even all-gather of `world_size + 4` int64 per rank. A rank
with bad arguments or ranks that disagree make EVERY rank raise `CephaloError` instead of the
healthy ranks hanging in the collective until the timeout. Cost: one extra tiny blocking
collective per call, i.e. one small-message latency (measured with 3 gloo ranks on a loaded
2-core box: 0.5-2 ms per call, about as much as a small all_gather_v itself; on a real
network, one round trip), and it synchronises the ranks even for `async_op=True` (the data
transfer still overlaps). On NCCL it also costs one device-to-host sync per call. Off with
`validate=False` or the environment variable `CEPHALO_COMM_VALIDATE=0` (local checks remain;
a cross-rank mismatch then hangs until the process-group timeout), or for a stretch of calls
inside `with comm.unvalidated():`. The engine uses the latter: its sequence of collectives is
fixed by the plan, so it checks every collective of its first step and then stops paying for
(and being synchronised by) the fingerprints.

Counters. Every call adds 1 to `counters.calls[name]` and this rank's traffic to
`counters.bytes[name]`, counted as the algorithm-independent volume this rank exchanges with
the other ranks, in the dtype of the data: `all_gather_v` counts the bytes it RECEIVES (every
other rank's shard), `reduce_scatter_v` the bytes it SENDS (every other rank's slice of
`full`), `all_reduce` the size of the tensor. World size 1 therefore counts 0 bytes for the
first two. Validation fingerprints are not counted.
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from cephalo import envvars
from cephalo.errors import CephaloError

COLLECTIVES = ("all_gather_v", "reduce_scatter_v", "all_reduce")
_REDUCE_OPS = ("sum", "max")
# Stable small integer codes for the cross-rank fingerprint.
_OP_CODE = {name: i + 1 for i, name in enumerate(COLLECTIVES)}
_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.int8,
    torch.bool,
)
_DTYPE_CODE = {dt: i + 1 for i, dt in enumerate(_DTYPES)}


def validate_by_default() -> bool:
    """Whether cross-rank validation is on unless a caller says otherwise
    (`CEPHALO_COMM_VALIDATE=0` turns it off)."""
    return os.environ.get(envvars.COMM_VALIDATE, "1").strip().lower() not in (
        "0",
        "false",
        "no",
        "off",
    )


class Handle:
    """An in-flight collective. `wait()` blocks until the result is in place (idempotent)."""

    def __init__(self, works: Sequence[object] = (), finish: Callable[[], None] | None = None):
        self._works = list(works)
        # Runs once after the works complete, e.g. to copy a padded result into `out`.
        self._finish = finish
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        for work in self._works:
            work.wait()
        if self._finish is not None:
            self._finish()
        self._done = True
        self._works.clear()
        self._finish = None

    @property
    def done(self) -> bool:
        """True once `wait()` has returned."""
        return self._done

    @property
    def idle(self) -> bool:
        """Nothing in flight and nothing to finish (a one-rank collective, or waited already):
        `wait()` returns at once (the step clock opens no span for it)."""
        return not self._works and self._finish is None


@dataclass
class CommCounters:
    """Per-collective call and byte counts of this rank (see the module docstring for what
    the bytes count)."""

    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COLLECTIVES, 0))
    """Number of calls per collective name."""
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COLLECTIVES, 0))
    """Bytes this rank exchanges with the others, per collective name."""
    even_calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COLLECTIVES, 0))
    """Calls of `all_gather_v` / `reduce_scatter_v` with equal sizes, run as the even tensor
    collectives (no copy through a flattened buffer)."""

    def add(self, name: str, nbytes: int) -> None:
        self.calls[name] += 1
        self.bytes[name] += int(nbytes)

    def reset(self) -> None:
        for name in COLLECTIVES:
            self.calls[name] = 0
            self.bytes[name] = 0
            self.even_calls[name] = 0


def _check_1d(name: str, what: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise CephaloError(f"{name}: `{what}` must be a torch.Tensor, got {type(t).__name__}")
    if name == "all_reduce" and t.is_contiguous():
        return  # any shape, scalars included: no sizes to interpret
    if t.dim() != 1 or not t.is_contiguous():
        raise CephaloError(
            f"{name}: `{what}` must be a 1-D contiguous tensor, got shape {tuple(t.shape)} "
            f"(contiguous={t.is_contiguous()}); flatten it with .reshape(-1) / .contiguous()"
        )


def shard_offsets(sizes: Sequence[int]) -> list[int]:
    """Start element of each rank's slice for the given per-rank sizes."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += n
    return offsets


class Comm(ABC):
    """Collectives over a fixed set of ranks (see the module docstring)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        backend: str,
        group: object | None = None,
        validate: bool | None = None,
    ):
        self.rank = rank
        """This process's rank within the group."""
        self.world_size = world_size
        """Number of ranks in the group."""
        self.backend = backend
        """`local`, `gloo` or `nccl`."""
        self.group = group
        """The torch process group (None: the default group)."""
        self.validate = validate_by_default() if validate is None else bool(validate)
        """Whether ranks cross-check sizes/dtypes before each collective."""
        self.counters = CommCounters()
        """Calls and bytes per collective (tests assert on these)."""
        self.even_gather = backend != "gloo"
        """Equal sizes: gather with `all_gather_into_tensor` (NCCL: its ring / tree / NVLS
        algorithms). False on gloo: per-source broadcasts, faster there (module docstring);
        the engine pads near-even splits only where this is on (runtime/collectives/padded.py)."""

    # ---------------------------------------------------------------- public API
    def all_gather_v(
        self, out: torch.Tensor, shard: torch.Tensor, sizes: Sequence[int], async_op: bool = False
    ) -> Handle:
        """Gather every rank's `shard` (rank r: `sizes[r]` elements) into `out` in rank order.
        `shard` may be dropped as soon as this returns (the collective keeps it alive) but not
        written to before `wait()`; `out` is valid after `wait()`. `shard` may be this rank's
        own piece of `out` (an in-place gather: nothing copied into `out` on this rank)."""
        name = "all_gather_v"
        sizes = self._agreed_sizes(name, sizes, [("out", out), ("shard", shard)], out, None)
        own = sizes[self.rank]
        self.counters.add(name, (sum(sizes) - own) * out.element_size())
        if self.world_size == 1:  # any backend: a process-group call would only copy
            return _copy_unless_same(out, shard)
        return self._all_gather_v(out, shard, sizes, async_op)

    def reduce_scatter_v(
        self, out: torch.Tensor, full: torch.Tensor, sizes: Sequence[int], async_op: bool = False
    ) -> Handle:
        """Sum `full` over ranks; rank r receives elements [off_r, off_r + sizes[r]) into
        `out`, valid after `wait()`. `full` may be clobbered, and must stay untouched (and
        alive) until then."""
        name = "reduce_scatter_v"
        sizes = self._agreed_sizes(name, sizes, [("out", out), ("full", full)], full, None)
        own = sizes[self.rank]
        self.counters.add(name, (sum(sizes) - own) * full.element_size())
        if self.world_size == 1:
            return _copy_unless_same(out, full)
        return self._reduce_scatter_v(out, full, sizes, async_op)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        """Reduce `t` (any shape, contiguous) in place over ranks with `op` ("sum" or "max")."""
        name = "all_reduce"
        self._agreed_sizes(name, None, [("t", t)], t, op)
        self.counters.add(name, t.numel() * t.element_size())
        if self.world_size > 1:
            self._all_reduce(t, op)

    def all_gather_object(self, obj: object) -> list:
        """Every rank's picklable `obj`, in rank order (small values: descriptions, profiles)."""
        if self.world_size == 1:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    @abstractmethod
    def barrier(self) -> None:
        """Block until every rank reaches this point."""

    @contextlib.contextmanager
    def unvalidated(self) -> Iterator[None]:
        """No cross-rank fingerprint exchange inside (local checks remain). For a sequence of
        calls already validated once, e.g. the engine's steps after the first: every rank
        must enter and leave it at the same point of the call sequence."""
        saved = self.validate
        self.validate = False
        try:
            yield
        finally:
            self.validate = saved

    # ---------------------------------------------------------- implementations
    @abstractmethod
    def _all_gather_v(self, out, shard, sizes: list[int], async_op: bool) -> Handle: ...

    @abstractmethod
    def _reduce_scatter_v(self, out, full, sizes: list[int], async_op: bool) -> Handle: ...

    @abstractmethod
    def _all_reduce(self, t, op: str) -> None: ...

    def _exchange_fingerprints(self, fingerprint: torch.Tensor) -> torch.Tensor:
        """All-gather one equal-size int64 vector per rank -> [world_size, len]."""
        raise NotImplementedError

    def _fingerprint_device(self) -> torch.device:
        return torch.device("cpu")

    # ---------------------------------------------------------------- validation
    def _local_problem(
        self,
        name: str,
        sizes: Sequence[int] | None,
        tensors: list[tuple[str, torch.Tensor]],
        op: str | None,
    ) -> tuple[str | None, list[int]]:
        """This rank's argument errors (message or None) and the sizes as a list of ints."""
        try:
            for what, t in tensors:
                _check_1d(name, what, t)
            first = tensors[0][1]
            for what, t in tensors[1:]:
                if t.dtype != first.dtype:
                    raise CephaloError(
                        f"{name}: `{tensors[0][0]}` is {first.dtype} but `{what}` is {t.dtype}; "
                        "both must have the same dtype"
                    )
                if t.device != first.device:
                    raise CephaloError(
                        f"{name}: `{tensors[0][0]}` is on {first.device} but `{what}` on {t.device}"
                    )
            if op is not None and op not in _REDUCE_OPS:
                raise CephaloError(f"{name}: unknown op {op!r}; use one of {_REDUCE_OPS}")
            if sizes is None:
                return None, []
            size_list = [int(n) for n in sizes]
            if len(size_list) != self.world_size:
                raise CephaloError(
                    f"{name}: got {len(size_list)} sizes {size_list} for world size "
                    f"{self.world_size}; pass one size per rank"
                )
            if any(n < 0 for n in size_list):
                raise CephaloError(f"{name}: sizes must be non-negative, got {size_list}")
            total, own = sum(size_list), size_list[self.rank]
            whole, part = ("out", "shard") if name == "all_gather_v" else ("full", "out")
            tensor = dict(tensors)
            if tensor[whole].numel() != total:
                raise CephaloError(
                    f"{name}: `{whole}` has {tensor[whole].numel()} elements but sum(sizes) = "
                    f"{total} (sizes {size_list})"
                )
            if tensor[part].numel() != own:
                raise CephaloError(
                    f"{name}: rank {self.rank}'s `{part}` has {tensor[part].numel()} elements "
                    f"but sizes[{self.rank}] = {own} (sizes {size_list})"
                )
            return None, size_list
        except CephaloError as err:
            return str(err), []
        except (TypeError, ValueError) as err:
            return f"{name}: bad arguments: {err}", []

    def _agreed_sizes(
        self,
        name: str,
        sizes: Sequence[int] | None,
        tensors: list[tuple[str, torch.Tensor]],
        data: torch.Tensor,
        op: str | None,
    ) -> list[int]:
        """Check the arguments locally and (if `validate`) across ranks; raise on every rank
        if anything is wrong anywhere."""
        problem, size_list = self._local_problem(name, sizes, tensors, op)
        if not self.validate or self.world_size == 1:
            if problem is not None:
                raise CephaloError(problem)
            return size_list
        fingerprint = self._fingerprint(name, problem, size_list, data, op)
        table = self._exchange_fingerprints(fingerprint).tolist()
        if problem is not None:
            raise CephaloError(problem)
        bad_ranks = [r for r, row in enumerate(table) if row[0] != 0]
        if bad_ranks:
            raise CephaloError(
                f"{name}: rank(s) {bad_ranks} rejected their arguments (see the error on those "
                f"ranks); rank {self.rank} stops too instead of waiting for them"
            )
        mine = table[self.rank]
        if all(row == mine for row in table):
            return size_list
        raise CephaloError(self._describe_mismatch(name, table))

    def _fingerprint(
        self,
        name: str,
        problem: str | None,
        size_list: list[int],
        data: torch.Tensor,
        op: str | None,
    ) -> torch.Tensor:
        """[problem flag, collective code, dtype code, numel or reduce op, sizes...]."""
        row = [0] * (self.world_size + 4)
        row[0] = 1 if problem is not None else 0
        row[1] = _OP_CODE[name]
        if problem is None:
            row[2] = _DTYPE_CODE.get(data.dtype, 99)
            row[3] = data.numel() if op is None else data.numel() * 4 + _REDUCE_OPS.index(op)
            row[4:] = size_list or [0] * self.world_size
        return torch.tensor(row, dtype=torch.int64, device=self._fingerprint_device())

    def _describe_mismatch(self, name: str, table: list[list[int]]) -> str:
        code_to_op = {v: k for k, v in _OP_CODE.items()}
        code_to_dtype = {v: k for k, v in _DTYPE_CODE.items()}
        ops = {code_to_op.get(row[1], "?") for row in table}
        if len(ops) > 1:
            per_rank = ", ".join(
                f"rank {r}: {code_to_op.get(row[1], '?')}" for r, row in enumerate(table)
            )
            return f"{name}: ranks are in different collectives ({per_rank}); the call order must match"
        dtypes = {row[2] for row in table}
        if len(dtypes) > 1:
            per_rank = ", ".join(
                f"rank {r}: {code_to_dtype.get(row[2])}" for r, row in enumerate(table)
            )
            return f"{name}: ranks disagree on the dtype ({per_rank})"
        if name == "all_reduce":
            per_rank = ", ".join(
                f"rank {r}: numel {row[3] // 4} op {_REDUCE_OPS[row[3] % 4]}"
                for r, row in enumerate(table)
            )
            return f"{name}: ranks disagree on the tensor size or op ({per_rank})"
        per_rank = ", ".join(f"rank {r}: {row[4:]}" for r, row in enumerate(table))
        return f"{name}: ranks disagree on sizes ({per_rank}); every rank must pass the same sizes"


def _copy_unless_same(out: torch.Tensor, src: torch.Tensor) -> Handle:
    """A one-rank collective: the result is `src` itself (no copy where `out` is `src`)."""
    if out.data_ptr() != src.data_ptr():
        out.copy_(src)
    return Handle()


class LocalComm(Comm):
    """World size 1 without a process group: every collective is a copy."""

    def __init__(self, validate: bool | None = None):
        super().__init__(rank=0, world_size=1, backend="local", group=None, validate=validate)

    def _all_gather_v(self, out, shard, sizes, async_op):
        return _copy_unless_same(out, shard)

    def _reduce_scatter_v(self, out, full, sizes, async_op):
        return _copy_unless_same(out, full)

    def _all_reduce(self, t, op):
        return None

    def barrier(self) -> None:
        return None


class _ProcessGroupComm(Comm):
    """Shared plumbing for implementations on a torch.distributed process group."""

    def __init__(self, group: object | None = None, validate: bool | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise CephaloError(
                f"{type(self).__name__} needs an initialised process group; call "
                "cephalo.runtime.collectives.dist.init_distributed() first (or use LocalComm for one process)"
            )
        super().__init__(
            rank=dist.get_rank(group),
            world_size=dist.get_world_size(group),
            backend=str(dist.get_backend(group)),
            group=group,
            validate=validate,
        )

    def _global_rank(self, group_rank: int) -> int:
        """torch's src/dst arguments are global ranks; translate from the group's."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def _exchange_fingerprints(self, fingerprint: torch.Tensor) -> torch.Tensor:
        table = torch.empty(
            self.world_size * fingerprint.numel(), dtype=torch.int64, device=fingerprint.device
        )
        _all_gather_even(table, fingerprint, self.group).wait()
        return table.view(self.world_size, -1).cpu()

    def _all_reduce(self, t, op):
        reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        dist.all_reduce(t, op=reduce_op, group=self.group)

    def barrier(self) -> None:
        dist.barrier(group=self.group)


def _all_gather_even(out: torch.Tensor, inp: torch.Tensor, group) -> object:
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=True)


def _reduce_scatter_even(out: torch.Tensor, inp: torch.Tensor, group) -> object:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=True)


def _equal(sizes: list[int]) -> bool:
    """Every rank holds the same non-zero number of elements: the even collectives apply."""
    return sizes[0] > 0 and all(n == sizes[0] for n in sizes)


def _even_handle(work: object, async_op: bool) -> Handle:
    handle = Handle([work])
    if not async_op:
        handle.wait()
    return handle


def _list_reduce_scatter(out, full, sizes, group, async_op: bool) -> Handle:
    """`dist.reduce_scatter` over uneven views of `full` (kept referenced until done)."""
    views = list(full.split(sizes))
    work = dist.reduce_scatter(out, views, op=dist.ReduceOp.SUM, group=group, async_op=True)
    handle = Handle([work], finish=lambda: views.clear())
    if not async_op:
        handle.wait()
    return handle


class GlooComm(_ProcessGroupComm):
    """gloo: gather as per-source async broadcasts, reduce-scatter as a list reduce_scatter."""

    def _all_gather_v(self, out, shard, sizes, async_op):
        if _equal(sizes) and self.even_gather:
            self.counters.even_calls["all_gather_v"] += 1
            return _even_handle(_all_gather_even(out, shard, self.group), async_op)
        views = list(out.split(sizes))
        # Our own piece goes into `out` first, so the caller may reuse `shard` right away
        # and the broadcast from this rank reads from `out` (in place: it is there already).
        if views[self.rank].data_ptr() != shard.data_ptr():
            views[self.rank].copy_(shard)
        works = [
            dist.broadcast(views[r], src=self._global_rank(r), group=self.group, async_op=True)
            for r in range(self.world_size)
            if sizes[r] > 0  # every rank skips the same sources: sizes are agreed
        ]
        handle = Handle(works)
        if not async_op:
            handle.wait()
        return handle

    def _reduce_scatter_v(self, out, full, sizes, async_op):
        if _equal(sizes):
            self.counters.even_calls["reduce_scatter_v"] += 1
            return _even_handle(_reduce_scatter_even(out, full, self.group), async_op)
        return _list_reduce_scatter(out, full, sizes, self.group, async_op)


class NcclComm(_ProcessGroupComm):
    """NCCL: list all_gather / reduce_scatter over uneven views (run as grouped
    broadcasts / reduces by NCCL); the even collectives where sizes are equal.
    scripts/gpu_check.py runs it on real GPUs."""

    def _fingerprint_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def _all_gather_v(self, out, shard, sizes, async_op):
        if _equal(sizes):
            self.counters.even_calls["all_gather_v"] += 1
            return _even_handle(_all_gather_even(out, shard, self.group), async_op)
        views = list(out.split(sizes))
        work = dist.all_gather(views, shard, group=self.group, async_op=True)
        handle = Handle([work])
        if not async_op:
            handle.wait()
        return handle

    def _reduce_scatter_v(self, out, full, sizes, async_op):
        if _equal(sizes):
            self.counters.even_calls["reduce_scatter_v"] += 1
            return _even_handle(_reduce_scatter_even(out, full, self.group), async_op)
        # NCCL may overwrite the input list's tensors: allowed by the contract.
        return _list_reduce_scatter(out, full, sizes, self.group, async_op)


class PaddedComm(_ProcessGroupComm):
    """Even collectives on shards padded to max(sizes): a cross-check implementation
    (more traffic and a copy each way)."""

    def _fingerprint_device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )

    def _all_gather_v(self, out, shard, sizes, async_op):
        pad = max(sizes)
        if pad == 0:
            return Handle()
        padded_shard = torch.zeros(pad, dtype=shard.dtype, device=shard.device)
        padded_shard[: shard.numel()].copy_(shard)
        padded_out = torch.empty(pad * self.world_size, dtype=out.dtype, device=out.device)
        work = _all_gather_even(padded_out, padded_shard, self.group)

        def unpad() -> None:
            rows = padded_out.view(self.world_size, pad)
            for r, (view, n) in enumerate(zip(out.split(sizes), sizes, strict=True)):
                view.copy_(rows[r, :n])

        handle = Handle([work], finish=unpad)
        if not async_op:
            handle.wait()
        return handle

    def _reduce_scatter_v(self, out, full, sizes, async_op):
        pad = max(sizes)
        if pad == 0:
            return Handle()
        padded_full = torch.zeros(self.world_size, pad, dtype=full.dtype, device=full.device)
        for r, (piece, n) in enumerate(zip(full.split(sizes), sizes, strict=True)):
            padded_full[r, :n].copy_(piece)
        padded_out = torch.empty(pad, dtype=out.dtype, device=out.device)
        work = _reduce_scatter_even(padded_out, padded_full.view(-1), self.group)

        def unpad() -> None:
            out.copy_(padded_out[: out.numel()])

        handle = Handle([work], finish=unpad)
        if not async_op:
            handle.wait()
        return handle


_IMPLS = {"local": LocalComm, "gloo": GlooComm, "nccl": NcclComm, "padded": PaddedComm}


def make_comm(
    impl: str = "auto", group: object | None = None, validate: bool | None = None
) -> Comm:
    """The `Comm` for the current process group.

    impl: `auto` (LocalComm without a process group or with world size 1, else by backend),
    `local`, `gloo`, `nccl` or `padded`.
    """
    if impl not in ("auto", *_IMPLS):
        raise CephaloError(f"unknown comm implementation {impl!r}; use auto, {', '.join(_IMPLS)}")
    initialized = dist.is_available() and dist.is_initialized()
    if impl == "local":
        return LocalComm(validate=validate)
    if impl == "auto":
        if not initialized or dist.get_world_size(group) == 1:
            return LocalComm(validate=validate)
        backend = str(dist.get_backend(group))
        if backend not in ("gloo", "nccl"):
            raise CephaloError(f"no comm implementation for backend {backend!r}; use gloo or nccl")
        impl = backend
    if not initialized:
        raise CephaloError(
            f"comm implementation {impl!r} needs an initialised process group; call "
            "cephalo.runtime.collectives.dist.init_distributed() first"
        )
    return _IMPLS[impl](group=group, validate=validate)
