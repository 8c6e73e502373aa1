"""Page-locked host memory of exactly the size counted.

`tensor.pin_memory()` and `torch.empty(..., pin_memory=True)` go through PyTorch's caching
host allocator, which rounds every block up to a power of two and keeps freed blocks for
reuse: host state and offloaded activations could take up to twice what the ledger and the
planner count (`costmodel.model.host_bytes`). Here instead:

- `pinned_empty`: a plain host tensor of the exact size, page-locked with `cudaHostRegister`
  (and unregistered when it dies). The host state, allocated once, takes these.
- `PinnedArena`: ONE such block per rank for the buffers of a step (offloaded boundary
  activations, staged gradient pieces), sized by the engine from its plan
  (`Engine.step_host_bytes`) and carved first-fit: buffers of one step come and go without a
  new registration (a registration costs about as much as the copy it serves).

Without CUDA nothing is page-locked (there is no device to copy to); the arena still hands
out exact-size pieces of one block, so its bookkeeping runs under the CPU tests.

Ordering: a piece freed while a copy on a side stream still reads or writes it must not be
handed out to a copy on ANOTHER stream. The engine keeps that: boundary pieces are only
copied on the boundary store's stream, and staged gradient pieces are freed after the host
waited for their copies (`HostLink.sync`).
"""

from __future__ import annotations

import weakref

import torch

from cephalo.errors import CephaloError
from cephalo.log import logger

ALIGN = 64
"""Bytes: every piece of the arena starts on a cache line (and any dtype's alignment)."""


def _register(tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return
    cudart = torch.cuda.cudart()
    ptr = tensor.data_ptr()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise CephaloError(
            f"could not page-lock {nbytes / 2**20:.1f} MiB of host memory (cudaHostRegister "
            f"error {int(err)}): the host is short of lockable memory (ulimit -l) or of memory"
        )
    weakref.finalize(tensor.untyped_storage(), cudart.cudaHostUnregister, ptr)


def pinned_empty(numel: int, dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
    """A 1-D host tensor of exactly `numel` elements, page-locked when `pin` and CUDA is
    available (see the module docstring)."""
    tensor = torch.empty(numel, dtype=dtype)
    if pin and torch.cuda.is_available():
        _register(tensor)
    return tensor


class PinnedArena:
    """One block of `capacity` bytes, carved into buffers first-fit (see module docstring)."""

    def __init__(self, capacity: int, pin: bool = True):
        if capacity < 0:
            raise CephaloError(f"a pinned arena cannot hold {capacity} bytes")
        self.capacity = capacity
        """Bytes of the block (what the ledger counts for it)."""
        self.block = pinned_empty(capacity, torch.uint8, pin=pin)
        self.pinned = pin and torch.cuda.is_available()
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity else []
        """Free (offset, size) runs, sorted and coalesced."""
        self._used: dict[int, tuple[int, int]] = {}
        """data_ptr of a live piece -> (offset, size reserved)."""
        self.in_use = 0
        """Bytes reserved now (aligned sizes)."""
        self.peak = 0
        """Most bytes reserved at once."""
        self.misses = 0
        """Requests it could not serve (the caller allocated elsewhere)."""

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A 1-D `numel`-element piece, or None if no free run is large enough."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = numel * itemsize
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        need = -(-nbytes // ALIGN) * ALIGN
        for i, (offset, size) in enumerate(self._free):
            if size < need:
                continue
            if size == need:
                del self._free[i]
            else:
                self._free[i] = (offset + need, size - need)
            piece = self.block[offset : offset + nbytes].view(dtype)
            self._used[piece.data_ptr()] = (offset, need)
            self.in_use += need
            self.peak = max(self.peak, self.in_use)
            return piece
        self.misses += 1
        if self.misses == 1:
            logger.warning(
                "pinned arena: no free run of %d bytes (%d of %d bytes in use); allocating outside "
                "it (exact size, page-locked on its own)",
                need,
                self.in_use,
                self.capacity,
            )
        return None

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.numel() > 0 and tensor.data_ptr() in self._used

    def free(self, tensor: torch.Tensor) -> None:
        """Give a piece from `alloc` back (its run merges with free neighbours)."""
        if tensor.numel() == 0:
            return
        offset, size = self._used.pop(tensor.data_ptr())
        self.in_use -= size
        runs = self._free
        # insert in order, then merge with the neighbours
        at = next((i for i, (o, _) in enumerate(runs) if o > offset), len(runs))
        runs.insert(at, (offset, size))
        if at + 1 < len(runs) and runs[at][0] + runs[at][1] == runs[at + 1][0]:
            runs[at] = (runs[at][0], runs[at][1] + runs[at + 1][1])
            del runs[at + 1]
        if at > 0 and runs[at - 1][0] + runs[at - 1][1] == runs[at][0]:
            runs[at - 1] = (runs[at - 1][0], runs[at - 1][1] + runs[at][1])
            del runs[at]
