"""Layer-boundary tensors of one LGA step, on the device or on the host.

Keyed by (unit index, micro-batch index): after the forward, the entry (u, j) holds unit u's
input for micro-batch j; during the backward, unit u replaces it by the gradient w.r.t.
that input, which is unit u-1's output gradient. With `offload`, entries live in host
memory (pinned on CUDA, copied on a side stream so the copies overlap compute) and are
staged back to the device one at a time, so the device holds O(1) of them whatever the
number of micro-batches. Every buffer goes through the ledger: `boundary` (device),
`host/boundary` (host), `staging` (device copies of host entries while in use). On an
emulated CPU device with a link bandwidth (`pcie=`), the host copies go through that link
(`runtime.state.host_state.HostLink.copy`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

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
        self._stream = torch.cuda.Stream(device) if offload and device.type == "cuda" else None

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: Key, t: torch.Tensor) -> None:
        """Keep a copy of `t` under `key` (replacing what was there)."""
        self.drop(key)
        t = t.detach()
        if not self.offload:
            buf = self.ledger.alloc("boundary", t.numel(), t.dtype, device=self.device)
            buf.copy_(t.reshape(-1))
        else:
            buf = self.ledger.alloc(
                "host/boundary",
                t.numel(),
                t.dtype,
                pin=True,  # page-locked on CUDA
            )
            if self.link is not None:
                self.link.copy(buf, t.reshape(-1))
            elif self._stream is None:
                buf.copy_(t.reshape(-1))
            else:
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._stream):
                    buf.copy_(t.reshape(-1), non_blocking=True)
                t.record_stream(self._stream)  # `t` may be freed before the copy ran
        self._entries[key] = (buf, t.shape)

    @contextmanager
    def loaded(self, key: Key) -> Iterator[torch.Tensor]:
        """The entry as a device tensor for the duration of the block (a view of the
        device buffer, or a staging copy of the host buffer)."""
        buf, shape = self._entries[key]
        if not self.offload:
            yield buf.view(shape)
            return
        staging = self.ledger.alloc("staging", buf.numel(), buf.dtype, device=self.device)
        try:
            if self.link is not None:
                self.link.copy(staging, buf)
            elif self._stream is None:
                staging.copy_(buf)
            else:
                # `staging` was allocated on the compute stream: the caching allocator may
                # hand back a block that kernels queued there still read (the head's forward
                # of the previous micro-batch, a unit's backward). The side stream must wait
                # for them before it overwrites the block; it is the offload copy's stream
                # too, so the copy is also ordered after the entry was written.
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._stream):
                    staging.copy_(buf, non_blocking=True)
                torch.cuda.current_stream(self.device).wait_stream(self._stream)
            yield staging.view(shape)
        finally:
            self.ledger.free(staging)

    def drop(self, key: Key) -> None:
        """Free the entry under `key`, if any."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.ledger.free(entry[0])

    def clear(self) -> None:
        """Free every entry (after a step that failed half-way)."""
        for key in list(self._entries):
            self.drop(key)
