"""Collectives on an emulated CPU cluster as NCCL runs them on GPUs (`FaithfulComm`).

Three things NCCL does that gloo on loopback does not, and that decide a step's time:

- one queue per process group: a communicator runs its collectives one after another on its
  own stream, so a unit's all-gather does not start before the previous unit's reduce-scatter
  on the same group has finished (gloo's worker threads, and the former `SlowLinkComm`, let
  them run at once, which no GPU cluster does);
- a link rate per group: a ring over the group's slowest link moves (n-1)/n of the gathered or
  reduced bytes, at the rate the cluster spec declares (`inter=` between nodes, `intra=` within
  one; none declared: as fast as gloo runs);
- `work.wait()` does not block the host: it makes the compute stream wait. The host goes on
  queueing work; the delay lands where the stream next runs something or the host next
  synchronises with it (a `.item()`, the optimizer's reads). A host clock around `wait()`
  therefore sees about 0 s of communication on NCCL (issue 38, finding 10).

`EmulatedStream` is one rank's compute stream: `wait()` of a collective moves its `ready_at`
forward; `sync()` (at the start of every piece of emulated compute and at the optimizer step:
`StepClock`) sleeps until then and returns the stall, which the clock counts as exposed
communication, as CUDA events around the wait measure it on a GPU. The data itself moves
through the inner comm (gloo) at once: only the timing is emulated. `LinkQueue` is one FIFO
queue with a rate; the boundary store's emulated copy engine (`pcie=`) is one too.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cephalo.runtime.collectives.comm import Comm, Handle


class EmulatedStream:
    """One emulated rank's compute stream: until when collectives and copies it waits for hold
    it (`ready_at`, perf_counter seconds), and the seconds it stalled for them so far."""

    def __init__(self) -> None:
        self.ready_at = 0.0
        """The stream may run again from this time on (what its waits have queued)."""
        self.stall_s = 0.0
        """Seconds slept in `sync` so far: the stream's exposed waits."""

    def wait_until(self, t: float) -> None:
        """The stream waits for something done at `t` (a collective, a copy): asynchronous,
        as `work.wait()` / `stream.wait_event` on a GPU; the host returns at once."""
        if t > self.ready_at:
            self.ready_at = t

    def sync(self) -> float:
        """Run the stream up to now: sleep until what it waits for is done (the next kernel,
        or the host reading a result). Returns the seconds slept."""
        left = self.ready_at - time.perf_counter()
        if left <= 0:
            return 0.0
        time.sleep(left)
        self.stall_s += left
        return left


class LinkQueue:
    """One FIFO queue over a link: an item starts when the previous one has finished (and not
    before `start`), and lasts its bytes / `bytes_per_s` (None: no time of its own)."""

    def __init__(self, bytes_per_s: float | None = None):
        self.bytes_per_s = float(bytes_per_s) if bytes_per_s else None
        self.free_at = 0.0
        """When the last queued item finishes."""

    def enqueue(self, start: float, nbytes: float) -> float:
        """Queue `nbytes` that may start at `start`; returns when they have crossed."""
        begin = max(start, self.free_at)
        due = begin + (nbytes / self.bytes_per_s if self.bytes_per_s else 0.0)
        self.free_at = due
        return due


class FaithfulComm:
    """A `Comm` (its inner one moves the data) with NCCL's timing: one FIFO queue for the
    group at `bytes_per_s`, collectives starting after the stream's pending waits (their
    inputs are written by the stream), `wait()` returning at once on the host (module
    docstring). Everything else is the inner comm's."""

    def __init__(self, inner: Comm, stream: EmulatedStream, bytes_per_s: float | None = None):
        self._inner = inner
        self.stream = stream
        """The rank's compute stream the waits hold (shared with `StepClock`)."""
        self.queue = LinkQueue(bytes_per_s)
        """This group's one queue: its collectives one after another."""

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _queued(self, handle: Handle, nbytes: int, async_op: bool) -> Handle:
        n = self._inner.world_size
        start = max(time.perf_counter(), self.stream.ready_at)
        due = self.queue.enqueue(start, (n - 1) / n * nbytes)
        out = Handle([handle], lambda: self.stream.wait_until(due))
        if not async_op:  # NCCL: a blocking call only orders the stream too
            out.wait()
        return out

    def all_gather_v(
        self, out: torch.Tensor, shard: torch.Tensor, sizes: Sequence[int], async_op: bool = False
    ) -> Handle:
        h = self._inner.all_gather_v(out, shard, sizes, async_op=True)
        return self._queued(h, out.numel() * out.element_size(), async_op)

    def reduce_scatter_v(
        self, out: torch.Tensor, full: torch.Tensor, sizes: Sequence[int], async_op: bool = False
    ) -> Handle:
        h = self._inner.reduce_scatter_v(out, full, sizes, async_op=True)
        return self._queued(h, full.numel() * full.element_size(), async_op)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        """In place, queued behind the group's collectives; its callers read the result on
        the host at once (token counts, norms), so the stream is synchronised here."""
        self._inner.all_reduce(t, op)
        # a ring all-reduce sends 2 (n-1)/n of the tensor
        self._queued(Handle(), 2 * t.numel() * t.element_size(), async_op=False)
        self.stream.sync()


@dataclass(frozen=True)
class EmulatedLinks:
    """The links of an emulated cluster as its spec declares them (`emulate_links`): the rate
    between nodes (None: one node) and within one (None: not declared, gloo's own speed), and
    each rank's node. A group's ring runs at its slowest link."""

    inter_bytes_per_s: float | None
    intra_bytes_per_s: float | None
    nodes: tuple[int, ...]
    """Node of each global rank."""

    def rate(self, ranks: Sequence[int]) -> float | None:
        """The link rate of a ring over these global ranks (None: no emulated delay)."""
        spans = len({self.nodes[r] for r in ranks}) > 1
        rates = [self.intra_bytes_per_s]
        if spans:
            rates.append(self.inter_bytes_per_s)
        rates = [r for r in rates if r]
        return min(rates) if rates else None


def faithful(comm: Comm, stream: EmulatedStream, bytes_per_s: float | None = None) -> Comm:
    """`comm` with NCCL's timing on an emulated multi-rank CPU run (world size 1: unchanged)."""
    if comm.world_size == 1 or isinstance(comm, FaithfulComm):
        return comm
    return FaithfulComm(comm, stream, bytes_per_s)  # type: ignore[return-value]
