"""The engine's per-unit collectives: a unit's all-gather in compute dtype (with the tied
parameters it borrows and its frozen base), its fp32 gradient buffers and their
reduce-scatters into the owners' gradient shards (the device part added in place, the host
part sent down to the host gradient). `UnitCollectives` is a part the engine
(runtime/engine/engine.py) and its passes hold; it is given what it uses."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cephalo.runtime.autograd import LeafDrain
from cephalo.runtime.collectives.comm import Comm, Handle
from cephalo.runtime.engine.step_clock import StepClock
from cephalo.runtime.memory import MemoryLedger
from cephalo.runtime.state.frozen import FrozenBase, FrozenGathered
from cephalo.runtime.state.host_state import HostLink
from cephalo.runtime.state.unit_shard import UnitShard


@dataclass
class UnitGrads:
    """A unit's fp32 gradient buffers for one backward (`UnitCollectives.grad_buffers`): its own,
    those of the tied parameters it borrows, and the slots written so far (the buffers are not
    zeroed: a slot's first gradient is copied in, `runtime/autograd.py` `drain_first`)."""

    acc: torch.Tensor
    tied: list[torch.Tensor]
    written: set[str] = field(default_factory=set)
    leaves: dict[str, torch.Tensor] | None = None
    """The unit's trained parameters as autograd leaves, made by the first micro-batch's
    backward and reused by the others (runtime/engine/unit_backward.py). They are views of
    the gathered parameters: `done_with_leaves` before those are released."""
    drain: LeafDrain | None = None
    """The leaves drained together after each backward (`UnitBackward.drain`); the others
    (borrowed tied parameters, a padded buffer's) drain by their own hooks."""
    foreign: dict[str, tuple[torch.Tensor, set[str]]] = field(default_factory=dict)
    """Tied parameters owned by a unit of another pipeline stage (runtime/pipeline/tie.py):
    per name, the fp32 buffer its gradient accumulates in over the step and the names written
    into it so far (they outlive these buffers: a stage reduces them once per step)."""

    def done_with_leaves(self) -> None:
        """The unit's last micro-batch is through: drop the leaves, so these buffers, which
        live on until their reduce-scatters finish, do not keep the gathered parameters alive
        past their release (the caller's own views of them go with its `params`)."""
        self.leaves = None
        self.drain = None


@dataclass
class Gathered:
    """A unit's parameters gathered in compute dtype (maybe still in flight)."""

    unit: UnitShard
    flat: torch.Tensor
    tied: list[torch.Tensor]
    handles: list[Handle]
    frozen: FrozenGathered | None = None
    """The unit's frozen parameters (LoRA / QLoRA base), gathered alongside."""
    owned: bool = True
    """`flat` and `tied` are ledger buffers (False: views of the fp32 shard itself, world
    size 1: nothing to gather, nothing to copy)."""
    copies: list[torch.Tensor] = field(default_factory=list)
    """Padded-even: the parameters that straddle padding, copied out of `flat` (ledger buffers)."""

    def params(self, alloc: Callable[[int], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each parameter as a view of the gathered buffers (`alloc`: a buffer for a parameter
        that straddles padding, runtime/collectives/padded.py)."""
        padded = self.unit.padded
        if padded is None:
            views = self.unit.layout.views(self.flat)
        else:
            views, self.copies = padded.views(self.unit.layout, self.flat, alloc)
        for borrow, buf in zip(self.unit.borrows, self.tied, strict=True):
            views[borrow.name] = buf.view(borrow.slot.shape)
        return views


@dataclass
class Reduce:
    """A reduce-scatter in flight: `part` receives this rank's piece of the sum of `full`,
    then is added into `grad_slice`."""

    handle: Handle
    part: torch.Tensor
    unit: UnitShard
    """Whose gradient receives it: elements [lo, hi) of its shard."""
    lo: int
    hi: int
    full: torch.Tensor
    at: int = 0
    """Where the elements [lo, hi) start in `part` (padded-even: this rank's offset)."""


class UnitCollectives:
    """All-gathers and reduce-scatters of units and the step's all-reduces, their host time
    counted into the step's `StepClock`.

    Owns nothing that outlives a call but the buffers it hands out (gathered units, gradient
    buffers, reduce-scatter outputs: ledger buffers its `release` / `finish_reduce` free).
    Given: the shard group's and every rank's comms, the ledger, the compute device and dtype,
    the frozen base (LoRA / QLoRA, or None), the host link (host-held gradient pieces go down
    through it), the clock, and `device_grad`, which gives the device part's gradient shard of
    a unit (a lean rank allocates it on first use: runtime/engine/shard_update.py `GradShards`)."""

    def __init__(
        self,
        comm: Comm,
        world: Comm,
        ledger: MemoryLedger,
        device: torch.device,
        dtype: torch.dtype,
        frozen: FrozenBase | None,
        link: HostLink,
        clock: StepClock,
        device_grad: Callable[[UnitShard], torch.Tensor],
    ):
        self.comm = comm
        """The shard group's collectives."""
        self.world = world
        """Every rank (the token count, the loss and the gradient norm)."""
        self.ledger = ledger
        self.device = device
        self.dtype = dtype
        self.frozen = frozen
        self.link = link
        self.clock = clock
        self.device_grad = device_grad

    def wait(self, handle: Handle) -> None:
        """Wait for a collective (the time blocked counted as communication)."""
        self.clock.wait(handle)

    def start_gather(self, us: UnitShard, async_op: bool) -> Gathered:
        """All-gather a unit (and the tied parameters it borrows) in compute dtype. World size
        1 in fp32: the gathered unit is its shard itself (the comm sees out == shard: no copy)."""
        owned = not (self.comm.world_size == 1 and us.param_buf is not None)
        numel = us.layout.numel if us.padded is None else us.padded.numel
        flat = (
            self.ledger.alloc("gathered", numel, self.dtype, device=self.device)
            if owned
            else us.param_buf
        )
        handles, tied = [], []
        # a blocking gather: its time counts as communication (an asynchronous one: its wait)
        timed = contextlib.nullcontext() if async_op else self.clock.communication()
        with timed:
            return self._start_gather(us, flat, owned, tied, handles, async_op)

    def _start_gather(
        self,
        us: UnitShard,
        flat: torch.Tensor,
        owned: bool,
        tied: list[torch.Tensor],
        handles: list[Handle],
        async_op: bool,
    ) -> Gathered:
        """`start_gather`'s collectives (the frozen part, the unit, its borrowed slices)."""
        frozen = self.frozen.start_gather(us.index, async_op) if self.frozen else None
        if us.layout.numel:  # (a LoRA unit may have no trained parameters)
            handles.append(self.gather_piece(flat, us, 0, us.size, us.sizes, async_op, True))
        for b in us.borrows:
            buf = (
                self.ledger.alloc("gathered", b.slot.numel, self.dtype, device=self.device)
                if owned
                else b.owner.param_buf[b.local[0] : b.local[1]]
            )
            tied.append(buf)
            handles.append(
                self.gather_piece(buf, b.owner, b.local[0], b.local[1], b.sizes, async_op)
            )
        return Gathered(us, flat, tied, handles, frozen, owned)

    def gather_piece(
        self,
        out: torch.Tensor,
        us: UnitShard,
        lo: int,
        hi: int,
        sizes: list[int],
        async_op: bool,
        whole: bool = False,
    ) -> Handle:
        """All-gather into `out` this rank's elements [lo, hi) of `us`'s shard in compute dtype
        (`whole`: the unit itself, padded-even where its split is, runtime/collectives/padded.py)."""
        padded = us.padded if whole else None
        if padded is not None:
            sizes = [padded.pad] * padded.world_size
            if us.send_buf is not None:  # fp32: the padded chunk itself
                return self.comm.all_gather_v(out, us.send_buf, sizes, async_op=async_op)
        elif us.param_buf is not None:  # fp32: master and the host part's copy in one buffer
            return self.comm.all_gather_v(out, us.param_buf[lo:hi], sizes, async_op=async_op)
        # The shard in compute dtype, cast straight into this rank's own piece of `out` (one
        # copy_ per part does the cast) and gathered in place: no shard buffer, no copy of it
        # into `out` (NCCL's and gloo's all-gathers take their input inside their output, as
        # FSDP2's does; one rank: nothing to move).
        own = self.comm.rank * padded.pad if padded is not None else sum(sizes[: self.comm.rank])
        if padded is None:
            shard = mine = out[own : own + hi - lo]
        else:  # the padded chunk: zero around this rank's elements
            shard = out[own : own + padded.pad]
            o = us.pad_offset
            mine = shard[o : o + hi - lo]
            shard[:o].zero_()
            shard[o + hi - lo :].zero_()
        d = us.dev_n
        if min(hi, d) > lo:
            mine[: min(hi, d) - lo].copy_(us.master[lo : min(hi, d)])
        if hi > max(lo, d):
            mine[max(lo, d) - lo :].copy_(us.host_copy[max(lo, d) - d : hi - d])
        return self.comm.all_gather_v(out, shard, sizes, async_op=async_op)

    def finish_gather(self, g: Gathered) -> dict[str, torch.Tensor]:
        for h in g.handles + (g.frozen.handles if g.frozen else []):
            self.wait(h)
        params = g.params(self.straddler)
        if g.frozen is None:
            return params
        return {**self.frozen.params(g.frozen), **params}

    def straddler(self, numel: int) -> torch.Tensor:
        """A buffer for a gathered parameter that straddles padding (runtime/collectives/padded.py)."""
        return self.ledger.alloc("gathered", numel, self.dtype, device=self.device)

    def release(self, g: Gathered) -> None:
        if g.owned:
            self.ledger.free(g.flat)
            for buf in g.tied + g.copies:
                self.ledger.free(buf)
        if g.frozen is not None:
            self.frozen.release(g.frozen)

    def start_reduce(
        self,
        us: UnitShard,
        lo: int,
        hi: int,
        full: torch.Tensor,
        sizes: list[int],
        whole: bool = False,
    ) -> Reduce:
        """Start: the gradient of elements [lo, hi) of this rank's shard of `us` += this rank's
        piece of the sum over ranks of `full` (fp32, a ledger buffer `finish_reduce` frees;
        `whole`: the unit's own gradient, padded where its split is, runtime/collectives/padded.py)."""
        padded, at, n = us.padded if whole else None, 0, hi - lo
        if padded is not None:
            sizes, at, n = [padded.pad] * padded.world_size, us.pad_offset, padded.pad
        if self.comm.world_size == 1:  # the sum is `full` itself: no output buffer, no copy
            part = full
        else:
            part = self.ledger.alloc("grad_accum", n, torch.float32, device=self.device)
        if full.numel() == 0:  # a unit without trained parameters (LoRA): nothing to reduce
            return Reduce(Handle(), part, us, lo, hi, full, at)
        # the call itself (and any validation); one rank: nothing is sent, no span
        timed = self.clock.communication() if self.comm.world_size > 1 else contextlib.nullcontext()
        with timed:
            handle = self.comm.reduce_scatter_v(part, full, sizes, async_op=True)
        return Reduce(handle, part, us, lo, hi, full, at)

    def finish_reduce(self, r: Reduce) -> None:
        self.wait(r.handle)
        us, d = r.unit, r.unit.dev_n
        part = r.part[r.at : r.at + r.hi - r.lo]  # (the padding's gradient is dropped here)
        if min(r.hi, d) > r.lo:
            self.device_grad(us)[r.lo : min(r.hi, d)].add_(part[: min(r.hi, d) - r.lo])
        if r.hi > max(r.lo, d):
            # the host part goes down to the host gradient (CUDA: on the side stream, while
            # the next unit's backward runs)
            a = max(r.lo, d)
            assert us.host is not None
            self.link.down(
                us.host.grad[a - d : r.hi - d], part[a - r.lo :], accumulate=us.host_grad_written
            )
            us.host_grad_written = True
        self.ledger.free(r.part)
        self.ledger.free(r.full)
        # and let the buffers die now (a name still holding this record would keep them)
        r.part = r.full = None  # type: ignore[assignment]

    def all_reduce(self, t: torch.Tensor) -> None:
        with self.clock.communication():
            self.world.all_reduce(t, "sum")

    def grad_buffers(self, us: UnitShard) -> UnitGrads:
        """The fp32 gradient buffers of a unit and of the tied parameters it borrows, not
        zeroed: each parameter's first gradient is copied into its slot (`drain_first`), and
        `start_reduces` clears what no gradient reached, so no memset of a whole unit per
        backward. A padded buffer (runtime/collectives/padded.py) is zeroed: its padding is reduced too."""
        padded = us.padded is not None
        numel = us.layout.numel if not padded else us.padded.numel
        acc = self.ledger.alloc("grad_accum", numel, torch.float32, device=self.device, zero=padded)
        tied = [
            self.ledger.alloc("grad_accum", b.slot.numel, torch.float32, device=self.device)
            for b in us.borrows
        ]
        return UnitGrads(acc, tied)

    def start_reduces(self, us: UnitShard, grads: UnitGrads) -> list[Reduce]:
        """The unit's gradient is complete: zero the slots of the parameters that got no
        gradient (one the unit's forward did not use), so the reduce-scatters sum no stale
        memory, then start them (its own and each borrowed tied parameter's)."""
        if us.padded is None and len(grads.written) < len(us.layout.slots):
            for slot in us.layout.slots:
                if slot.name not in grads.written:
                    grads.acc[slot.offset : slot.end].zero_()
        for b, t_acc in zip(us.borrows, grads.tied, strict=True):
            if b.name not in grads.written:
                t_acc.zero_()
        reducing = [self.start_reduce(us, 0, us.size, grads.acc, us.sizes, True)]
        for b, t_acc in zip(us.borrows, grads.tied, strict=True):
            lo, hi = b.local
            reducing.append(self.start_reduce(b.owner, lo, hi, t_acc, b.sizes))
        return reducing
