"""The memory ledger: every engine-owned buffer by category, peaks, and a per-rank budget.

The engine allocates its buffers (flat parameter shards, gathered units, gradients, optimizer
state, boundary activations) through `MemoryLedger.alloc(category, ...)` and releases them
with `free`. Memory it cannot allocate itself (logits inside the loss, a unit's activations
during recompute) is counted with `charge`/`release` or with `track_activations()`, which
watches what autograd saves. The ledger keeps the current and peak bytes per category, the
overall device peak and the per-category breakdown at that peak.

Device emulation: on a CPU rank that stands in for a GPU, `budget_bytes` is that GPU's
memory; going over it raises `MemoryBudgetExceeded` naming the rank and the category, the
same failure a real GPU would have, but with a useful message.

Host memory (offloaded activations, host-held training state, pinned or not) goes to
categories prefixed `host/`; it is tracked the same way but does not count against the device
budget or the device peak: it has its own peak and its own budget (`host_budget_bytes`, this
rank's share of its node's host memory), past which `MemoryBudgetExceeded` names the host.

On CUDA, the ledger's device peak can be compared with `torch.cuda.max_memory_allocated()`:
the ledger counts logical bytes (no allocator rounding, no cuBLAS workspaces, no temporaries
of an op that die inside it), so it is a lower bound that should be close for this engine,
where large buffers dominate.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from cephalo.errors import CephaloError, MemoryBudgetExceeded
from cephalo.runtime.device_memory import host_memory
from cephalo.runtime.state.pinned import PinnedArena, pinned_empty

HOST_PREFIX = "host/"
ACTIVATIONS = "activations"
_MIB = float(1 << 20)


def is_host_category(category: str) -> bool:
    """Host categories live in CPU memory and do not count against the device budget."""
    return category.startswith(HOST_PREFIX)


def _mib(nbytes: int) -> str:
    return f"{nbytes / _MIB:.1f} MiB"


@dataclass
class _Allocation:
    """One live `alloc` result."""

    category: str
    """Category it is charged to."""
    nbytes: int
    """Bytes charged (numel * element size)."""
    tensor_ref: weakref.ref
    """The tensor handed out (to recognise it in `free` without keeping it alive)."""
    freed: bool = False
    """Set by `free`; kept until the tensor dies so a second `free` is a no-op."""


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


class _SavedActivation:
    """What autograd keeps for a counted saved tensor; its death releases the count."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class MemoryLedger:
    """Counts one rank's memory by category and enforces its device budget."""

    def __init__(
        self,
        rank: int,
        device: torch.device | str,
        budget_bytes: int | None = None,
        host_budget_bytes: int | None = None,
    ):
        self.rank = rank
        """The rank whose memory this is (named in errors)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())  # tensors carry an index
        self.device = device
        """The device whose memory the budget limits."""
        if budget_bytes is not None and budget_bytes < 0:
            raise CephaloError(f"memory budget must be non-negative, got {budget_bytes} bytes")
        self.budget_bytes = budget_bytes
        """Device memory budget in bytes (None: unlimited)."""
        if host_budget_bytes is not None and host_budget_bytes < 0:
            raise CephaloError(
                f"host memory budget must be non-negative, got {host_budget_bytes} bytes"
            )
        self.host_budget_bytes = host_budget_bytes
        """Host memory budget of this rank in bytes (None: unlimited)."""
        self._lock = threading.Lock()  # storage finalizers may run on autograd threads
        self._current: dict[str, int] = {}
        self._peak: dict[str, int] = {}
        self._device_current = 0
        self._device_peak = 0
        self._host_current = 0
        self._host_peak = 0
        self._at_peak: dict[str, int] = {}
        self._allocations: dict[int, _Allocation] = {}  # id(tensor) -> allocation
        self._owned_storages: set[int] = set()  # data_ptrs of live ledger buffers
        # storage data_ptr -> (saved references autograd holds, bytes charged)
        self._activation_storages: dict[int, tuple[int, int]] = {}
        self.arena: PinnedArena | None = None
        """This rank's page-locked block for the host buffers of a step (the engine sizes it)."""
        self.arena_category = "host/boundary"
        """The category whose pinned buffers come from `arena`."""

    # ------------------------------------------------------------- accounting core
    def charge(self, category: str, nbytes: int) -> None:
        """Count `nbytes` under `category` (raises `MemoryBudgetExceeded` past the budget)."""
        nbytes = int(nbytes)
        if nbytes < 0:
            raise CephaloError(
                f"cannot charge a negative number of bytes ({nbytes}) to {category!r}"
            )
        with self._lock:
            host = is_host_category(category)
            if (
                not host
                and self.budget_bytes is not None
                and self._device_current + nbytes > self.budget_bytes
            ):
                raise MemoryBudgetExceeded(
                    self._budget_message(category, nbytes), self.rank, category
                )
            if (
                host
                and self.host_budget_bytes is not None
                and self._host_current + nbytes > self.host_budget_bytes
            ):
                raise MemoryBudgetExceeded(
                    self._host_budget_message(category, nbytes), self.rank, category
                )
            self._current[category] = self._current.get(category, 0) + nbytes
            self._peak[category] = max(self._peak.get(category, 0), self._current[category])
            if host:
                self._host_current += nbytes
                self._host_peak = max(self._host_peak, self._host_current)
            else:
                self._device_current += nbytes
                if self._device_current > self._device_peak:
                    self._device_peak = self._device_current
                    self._at_peak = {
                        c: b for c, b in self._current.items() if not is_host_category(c)
                    }

    def release(self, category: str, nbytes: int) -> None:
        """Give back `nbytes` charged to `category` earlier."""
        nbytes = int(nbytes)
        with self._lock:
            have = self._current.get(category, 0)
            if nbytes < 0 or nbytes > have:
                raise CephaloError(
                    f"rank {self.rank}: releasing {nbytes} bytes from {category!r}, which holds "
                    f"only {have}; every release must match an earlier charge"
                )
            self._current[category] = have - nbytes
            if is_host_category(category):
                self._host_current -= nbytes
            else:
                self._device_current -= nbytes

    def _budget_message(self, category: str, nbytes: int) -> str:
        biggest = sorted(
            ((c, b) for c, b in self._current.items() if b and not is_host_category(c)),
            key=lambda cb: -cb[1],
        )[:4]
        holders = ", ".join(f"{c} {_mib(b)}" for c, b in biggest) or "nothing"
        return (
            f"rank {self.rank} ran out of its memory budget on {self.device}: {category!r} "
            f"requested {_mib(nbytes)} with {_mib(self._device_current)} in use of a "
            f"{_mib(self.budget_bytes or 0)} budget (largest: {holders}). Use a plan that "
            "gives this rank a smaller batch or state fraction, more micro-batches, or host "
            "offload of activations"
        )

    def _host_budget_message(self, category: str, nbytes: int) -> str:
        return (
            f"rank {self.rank} ran out of its host memory: {category!r} requested {_mib(nbytes)} "
            f"with {_mib(self._host_current)} in use of its {_mib(self.host_budget_bytes or 0)} "
            "share of the node's host memory. Give the node more host memory (`host_memory` in "
            "the cluster file) or use a plan with a smaller host_state_fraction on this rank"
        )

    # ----------------------------------------------------------------- buffers
    def alloc(
        self,
        category: str,
        numel: int,
        dtype: torch.dtype,
        *,
        device: torch.device | str | None = None,
        pin: bool = False,
        zero: bool = False,
    ) -> torch.Tensor:
        """A new 1-D buffer of `numel` elements charged to `category`.

        `host/...` categories are allocated on the CPU; with `pin`, page-locked where CUDA is
        available, at exactly their size (runtime/state/pinned.py: from `arena` for its category,
        else registered alone); other categories on `device` (default: the ledger's).
        """
        if numel < 0:
            raise CephaloError(f"cannot allocate {numel} elements for {category!r}")
        host = is_host_category(category)
        if host:
            target = torch.device("cpu")
        else:
            target = self.device if device is None else torch.device(device)
            if target.type != self.device.type:
                raise CephaloError(
                    f"category {category!r} is device memory but the buffer was requested on "
                    f"{target}; name host buffers '{HOST_PREFIX}...'"
                )
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self.charge(category, nbytes)  # raises before allocating anything
        try:
            if host:
                with host_memory():  # not the device's (runtime/device_memory.py)
                    tensor = self._host_buffer(category, numel, dtype, pin, zero)
            else:
                make = torch.zeros if zero else torch.empty
                tensor = make(numel, dtype=dtype, device=target)
        except BaseException:
            self.release(category, nbytes)
            raise
        key = id(tensor)

        def forget(ref: weakref.ref, key: int = key) -> None:
            # the tensor died: drop the entry (its id may be reused by another tensor)
            with self._lock:
                entry = self._allocations.get(key)
                if entry is not None and entry.tensor_ref is ref:
                    del self._allocations[key]

        with self._lock:
            self._allocations[key] = _Allocation(category, nbytes, weakref.ref(tensor, forget))
            if numel and not host:  # (arena pieces share one storage)
                self._owned_storages.add(tensor.untyped_storage().data_ptr())
        return tensor

    def adopt(self, category: str, tensor: torch.Tensor) -> bool:
        """Take `tensor` as a buffer of `category` without copying it (charged like `alloc`,
        released by `free`): a result the engine keeps as it is, such as a unit's output
        kept as the next unit's boundary (runtime/boundary.py), where a copy into a new
        buffer would cost a kernel and change nothing. Only a device tensor that is its whole
        storage (contiguous, from offset 0, nothing beside it: what is charged is what it
        keeps alive) and that no ledger buffer holds is taken; returns False for any other
        (the caller copies it into an `alloc`). The caller hands it over: nothing may write
        to it afterwards."""
        device = tensor.device
        if (
            category.startswith(HOST_PREFIX)  # (inline: called per boundary and micro-batch)
            or tensor.numel() == 0
            or (device != self.device and not _same_device(device, self.device))
            or not tensor.is_contiguous()
            or tensor.storage_offset() != 0
        ):
            return False
        storage = tensor.untyped_storage()
        nbytes = tensor.numel() * tensor.element_size()
        if storage.nbytes() != nbytes or storage.data_ptr() in self._owned_storages:
            return False
        self.charge(category, nbytes)
        key = id(tensor)

        def forget(ref: weakref.ref, key: int = key) -> None:
            with self._lock:
                entry = self._allocations.get(key)
                if entry is not None and entry.tensor_ref is ref:
                    del self._allocations[key]

        with self._lock:
            self._allocations[key] = _Allocation(category, nbytes, weakref.ref(tensor, forget))
            self._owned_storages.add(storage.data_ptr())
        return True

    def _host_buffer(
        self, category: str, numel: int, dtype: torch.dtype, pin: bool, zero: bool
    ) -> torch.Tensor:
        """A host buffer: with `pin`, page-locked where CUDA is available, at exactly its size
        (runtime/state/pinned.py: the buffers of a step from this rank's arena, the rest
        registered one by one)."""
        if not pin:
            return (torch.zeros if zero else torch.empty)(numel, dtype=dtype)
        tensor = None
        if self.arena is not None and category == self.arena_category:
            tensor = self.arena.alloc(numel, dtype)
        if tensor is None:
            tensor = pinned_empty(numel, dtype)
        if zero:
            tensor.zero_()
        return tensor

    def free(self, tensor: torch.Tensor) -> None:
        """Release a buffer from `alloc` (freeing it twice is a no-op). The caller drops its
        references; the ledger never keeps buffers alive."""
        with self._lock:
            entry = self._allocations.get(id(tensor))
            if entry is None or entry.tensor_ref() is not tensor:
                raise CephaloError(
                    f"rank {self.rank}: free() got a tensor of shape {tuple(tensor.shape)} that "
                    "this ledger did not allocate (pass the tensor alloc() returned, not a view)"
                )
            if entry.freed:
                return
            entry.freed = True
            if tensor.numel() and not is_host_category(entry.category):
                self._owned_storages.discard(tensor.untyped_storage().data_ptr())
        if self.arena is not None and self.arena.owns(tensor):
            self.arena.free(tensor)
        self.release(entry.category, entry.nbytes)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` (or a view of it) lives in a buffer of this ledger."""
        return tensor.numel() > 0 and tensor.untyped_storage().data_ptr() in self._owned_storages

    # ----------------------------------------------------------------- activations
    @contextmanager
    def track_activations(self, exclude: Iterable[torch.Tensor] = ()) -> Iterator[None]:
        """Count what autograd saves for backward under `activations`.

        Inside the block, every tensor autograd saves is looked at: a storage on the ledger's
        device that is not a ledger buffer, not a parameter (or a view of one), not a leaf
        that requires grad (a unit input the caller owns), not in `exclude` and not already
        counted is charged with its full size, once however many ops save it. It is released
        when autograd lets go of the last saved reference to it (after backward, or when the
        graph dies), so a unit's recompute activations show up in the peak and go away after
        its backward, whoever else still holds the tensor."""
        excluded = {t.untyped_storage().data_ptr() for t in exclude if t.numel()}

        def pack(saved: torch.Tensor) -> object:
            ptr = self._maybe_count_activation(saved, excluded)
            if ptr is None:
                return saved
            # a detached alias: holding `saved` itself would make a reference cycle
            # (output -> grad_fn -> packed -> output) when an op saves its own output
            packed = _SavedActivation(saved.detach())
            weakref.finalize(packed, self._activation_unsaved, ptr)
            return packed

        def unpack(packed: object) -> torch.Tensor:
            return packed.tensor if isinstance(packed, _SavedActivation) else packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def _maybe_count_activation(self, saved: torch.Tensor, excluded: set[int]) -> int | None:
        """The storage pointer if `saved` is an activation to count (charging it on first
        sight), else None."""
        if not _same_device(saved.device, self.device) or saved.numel() == 0:
            return None
        base = saved._base if saved._base is not None else saved
        if isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad):
            return None
        storage = saved.untyped_storage()
        ptr = storage.data_ptr()
        with self._lock:
            if ptr in excluded or ptr in self._owned_storages:
                return None
            held = self._activation_storages.get(ptr)
            if held is not None:
                self._activation_storages[ptr] = (held[0] + 1, held[1])
                return ptr
        nbytes = storage.nbytes()
        self.charge(ACTIVATIONS, nbytes)  # may raise MemoryBudgetExceeded
        with self._lock:
            self._activation_storages[ptr] = (1, nbytes)
        return ptr

    def _activation_unsaved(self, ptr: int) -> None:
        with self._lock:
            count, nbytes = self._activation_storages[ptr]
            if count > 1:
                self._activation_storages[ptr] = (count - 1, nbytes)
                return
            del self._activation_storages[ptr]
        self.release(ACTIVATIONS, nbytes)

    # ------------------------------------------------------------------ queries
    @property
    def current_bytes(self) -> int:
        """Device bytes in use now (host categories excluded)."""
        return self._device_current

    @property
    def peak_bytes(self) -> int:
        """Highest device bytes in use since construction or `reset_peak`."""
        return self._device_peak

    @property
    def host_current_bytes(self) -> int:
        """Host bytes (`host/` categories) in use now."""
        return self._host_current

    @property
    def host_peak_bytes(self) -> int:
        """Highest host bytes in use."""
        return self._host_peak

    @property
    def current_by_category(self) -> dict[str, int]:
        """Bytes in use now per category (host categories included)."""
        with self._lock:
            return dict(self._current)

    @property
    def peak_by_category(self) -> dict[str, int]:
        """Each category's own peak (they need not happen at the same time)."""
        with self._lock:
            return dict(self._peak)

    @property
    def at_peak_by_category(self) -> dict[str, int]:
        """Device bytes per category at the moment of the overall device peak."""
        with self._lock:
            return dict(self._at_peak)

    def reset_peak(self) -> None:
        """Start peak tracking afresh from what is in use now."""
        with self._lock:
            self._peak = dict(self._current)
            self._device_peak = self._device_current
            self._host_peak = self._host_current
            self._at_peak = {c: b for c, b in self._current.items() if not is_host_category(c)}

    def report(self) -> dict:
        """Everything above as plain values (for logs and stats)."""
        return {
            "rank": self.rank,
            "device": str(self.device),
            "budget_bytes": self.budget_bytes,
            "host_budget_bytes": self.host_budget_bytes,
            "current_bytes": self.current_bytes,
            "peak_bytes": self.peak_bytes,
            "host_current_bytes": self.host_current_bytes,
            "host_peak_bytes": self.host_peak_bytes,
            "current_by_category": self.current_by_category,
            "peak_by_category": self.peak_by_category,
            "at_peak_by_category": self.at_peak_by_category,
        }
