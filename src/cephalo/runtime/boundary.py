"""Layer-boundary tensors of one LGA step, on the device or on the host.

Keyed by (unit index, micro-batch index): after the forward, the entry (u, j) holds unit u's
input for micro-batch j; during the backward, unit u replaces it by the gradient w.r.t.
that input, which is unit u-1's output gradient. On the device an entry is the tensor put
itself (a unit's output, an input gradient: `MemoryLedger.adopt`), not a copy of it: a copy
per boundary and micro-batch was the engine's largest excess of ops over plain PyTorch
(issue 39). With `offload`, entries live in host
memory (pinned on CUDA) and are staged back to the device one at a time, so the device holds
O(1) of them whatever the number of micro-batches. Every buffer goes through the ledger:
`boundary` (device), `host/boundary` (host), `staging` (device copies of host entries while
in use).

Copies and compute overlap as a GPU's copy engines let them (issue 38, finding 7): the writes
to the host (`put`) run on a stream of their own, each with an event, so nothing on the
compute stream waits for them; a read back (`loaded`) runs on another, after the write of its
own entry only (not behind every queued write); and a read the caller does not need at once
(`loaded(..., deferred=True)`: a block's output gradient, read before its recompute and used
only by the backward after it) is waited for by the compute stream only where it is used
(`ready`), so its copy runs beside the recompute. On an emulated CPU device with a link
bandwidth (`pcie=`) the same holds in time: the memcpy is done at once (the data), and each
copy's link time runs on the emulated copy engine (one queue per direction,
runtime/collectives/emulated.py `LinkQueue`); a read waits for the write of its entry, and the
host sleeps (outside the compute stretch) only for what is left of a read when it is used.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from cephalo.runtime.collectives.emulated import LinkQueue
from cephalo.runtime.memory import MemoryLedger

if TYPE_CHECKING:
    from cephalo.runtime.state.host_state import HostLink

Key = tuple[int, int]


class BoundaryStore:
    """Boundary activations / gradients by (unit, micro-batch)."""

    def __init__(
        self,
        ledger: MemoryLedger,
        device: torch.device,
        offload: bool,
        link: HostLink | None = None,
    ):
        self.ledger = ledger
        self.device = device
        self.offload = offload
        self.link = link if device.type != "cuda" else None
        """CPU: the emulated link host copies go through (None: plain memcpys)."""
        self._entries: dict[Key, tuple[torch.Tensor, torch.Size]] = {}
        cuda = offload and device.type == "cuda"
        self._put_stream = torch.cuda.Stream(device) if cuda else None
        """CUDA: the writes to the host (device -> host copy engine)."""
        self._load_stream = torch.cuda.Stream(device) if cuda else None
        """CUDA: the reads back (host -> device), after their own entry's write only."""
        self._written: dict[Key, object] = {}
        """Per entry: its write's CUDA event, or (emulated link) when its link time ends."""
        self._read: dict[Key, object] = {}
        """CUDA: per entry, the event of its last read back (`drop` orders later writes after it)."""
        self._pending: dict[int, object] = {}
        """Per staging buffer (its data_ptr) of a deferred read: its CUDA event, or when its
        link time ends (`ready` waits for it)."""
        rate = getattr(self.link, "bytes_per_s", None)
        self._down, self._up = LinkQueue(rate), LinkQueue(rate)
        """The emulated link's copy engine: writes, reads (each a FIFO queue)."""

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def _emulated(self) -> bool:
        return self.link is not None and self.link.bytes_per_s is not None

    def put(self, key: Key, t: torch.Tensor) -> None:
        """Keep `t` under `key` (replacing what was there). On the device, `t` itself where
        it is a whole storage of its own (`MemoryLedger.adopt`: a unit's output, an input
        gradient), else a copy; the caller hands it over and writes to it no more. Offloaded:
        a copy in host memory (a real transfer)."""
        self.drop(key)
        t = t.detach()
        if not self.offload:
            if self.ledger.adopt("boundary", t):
                buf = t  # the caller's result itself: no copy on the device (issue 39)
            else:  # a view into a larger storage, or already a ledger buffer: one copy
                buf = self.ledger.alloc("boundary", t.numel(), t.dtype, device=self.device)
                buf.copy_(t.reshape(-1))
        else:
            buf = self.ledger.alloc(
                "host/boundary",
                t.numel(),
                t.dtype,
                pin=True,  # page-locked on CUDA
            )
            if self._emulated:
                self._memcpy(buf, t.reshape(-1))
                self._written[key] = self._down.enqueue(time.perf_counter(), _nbytes(buf))
            elif self.link is not None:
                self.link.copy(buf, t.reshape(-1))
            elif self._put_stream is None:
                buf.copy_(t.reshape(-1))
            else:
                stream = self._put_stream
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    buf.copy_(t.reshape(-1), non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(stream)
                t.record_stream(stream)  # `t` may be freed before the copy ran
                self._written[key] = done
        self._entries[key] = (buf, t.shape)

    @contextmanager
    def loaded(self, key: Key, deferred: bool = False) -> Iterator[torch.Tensor]:
        """The entry as a device tensor for the duration of the block (a view of the device
        buffer, or a staging copy of the host buffer). `deferred`: the copy may still be in
        flight when the block starts; call `ready(t)` before the tensor is used."""
        buf, shape = self._entries[key]
        if not self.offload:
            yield buf.view(shape)
            return
        staging = self.ledger.alloc("staging", buf.numel(), buf.dtype, device=self.device)
        try:
            if self._emulated:
                self._memcpy(staging, buf)
                start = max(time.perf_counter(), float(self._written.get(key, 0.0)))
                self._pending[staging.data_ptr()] = self._up.enqueue(start, _nbytes(buf))
            elif self.link is not None:
                self.link.copy(staging, buf)
            elif self._load_stream is None:
                staging.copy_(buf)
            else:
                # `staging` was allocated on the compute stream: the caching allocator may
                # hand back a block that kernels queued there still read (the head's forward
                # of the previous micro-batch, a unit's backward). The load stream must wait
                # for them before it overwrites the block, and for the write of this entry;
                # not for the other writes still queued on the put stream.
                stream = self._load_stream
                stream.wait_stream(torch.cuda.current_stream(self.device))
                written = self._written.get(key)
                if written is not None:
                    stream.wait_event(written)
                with torch.cuda.stream(stream):
                    staging.copy_(buf, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(stream)
                self._pending[staging.data_ptr()] = done
                # a later write may reuse this host buffer once the entry is dropped: the put
                # stream must not overwrite it before this read has run
                self._read[key] = done
            view = staging.view(shape)
            if not deferred:
                self.ready(view)
            yield view
        finally:
            # never free a staging buffer the compute stream has not waited for
            self.ready(staging)
            self.ledger.free(staging)

    def ready(self, t: torch.Tensor) -> None:
        """The compute stream waits for the read of `t` (from a deferred `loaded`) to land:
        on CUDA an event wait (the host goes on), on an emulated link a sleep for what is
        left of its link time (outside the compute stretch: a copy, not compute)."""
        pending = self._pending.pop(t.data_ptr(), None)
        if pending is None:
            return
        if isinstance(pending, float):
            left = pending - time.perf_counter()
            if left > 0:
                if self.link.emulator is not None:
                    with self.link.emulator.unstretched():
                        time.sleep(left)
                else:
                    time.sleep(left)
            return
        torch.cuda.current_stream(self.device).wait_event(pending)

    def _memcpy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """An emulated link copy's data, now, outside the compute stretch (its time is the
        link's, queued by the caller)."""
        link = self.link
        t0 = time.perf_counter()
        if link.emulator is not None:
            with link.emulator.unstretched():
                dst.copy_(src)
        else:
            dst.copy_(src)
        link.copied_bytes += _nbytes(src)
        link.copy_s += time.perf_counter() - t0

    def drop(self, key: Key) -> None:
        """Free the entry under `key`, if any."""
        entry = self._entries.pop(key, None)
        self._written.pop(key, None)
        read = self._read.pop(key, None)
        if read is not None:  # its host buffer may be reused by the next write
            self._put_stream.wait_event(read)
        if entry is not None:
            self.ledger.free(entry[0])

    def clear(self) -> None:
        """Free every entry (after a step that failed half-way)."""
        for key in list(self._entries):
            self.drop(key)
        self._pending.clear()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
