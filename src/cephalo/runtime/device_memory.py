"""The emulated device's memory, counted byte by byte: what a CPU rank standing in for a GPU
(`cpu:mem=600MiB`) allocates counts against its `mem=`, whoever allocates it, and going over
raises what a CUDA out-of-memory raises (`torch.OutOfMemoryError`), so that the emulated
cluster fails where the real one would.

The ledger (runtime/memory.py) counts what the engine tells it; this mode counts every CPU
storage an op creates while the rank's job runs (`LiveTensorBytes`): engine buffers,
activations, autograd's temporaries (the CPU backward runs on the thread that calls it, and
torch hands the dispatch mode to autograd's threads anyway), the profiler's materialised
units, optimizer state, the data batches the step reads. Views and in-place results share
their input's storage and are not new allocations.

What is host memory on a real cluster is not device memory here either: code that allocates
in host memory on a GPU (the ledger's `host/` categories, the pinned arena, the host AdamW and
its temporaries, a checkpoint's staging and file I/O, a re-plan's host copy) runs under
`host_memory()`, which this mode skips. On a GPU the same code allocates in host memory by
construction, so the marker costs nothing there.

At the start the device is charged the reserve the planner keeps on a real GPU for what no
tensor holds (the CUDA context, cuBLAS's workspace, one NCCL communicator per process group:
`costmodel.memory.device_reserve_bytes`), so a plan that only fits by eating the reserve fails
here as it would there. `CEPHALO_STRICT_MEMORY=0` turns the mode off (then only the ledger's
budget holds, as before); it is on by default for emulated ranks (`train/trainer.py`).

Compiled blocks (`parallel.compile = "inductor"`, runtime/capture/): the mode tells dynamo to
ignore it while it compiles (`ignore_compile_internals`: dynamo would otherwise run every
frame eagerly under a dispatch mode), and the compiled code's own buffers (inductor allocates
them below the dispatcher) are charged by runtime/capture/counted.py: the call's outputs, what
its backward saved and its gradients as they appear (`count`), its transient peak as the
eager call of the same key measured it (`open_window` / `close_window`, `charge_transient`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from cephalo.errors import CephaloError, first_line
from cephalo.runtime.live_bytes import LiveTensorBytes

_MIB = float(1 << 20)
_host = threading.local()


@contextmanager
def host_memory() -> Iterator[None]:
    """Allocations in this block (on this thread) are host memory: an active
    `EmulatedDeviceMemory` does not count them. Nests; a no-op when no mode is active."""
    _host.depth = getattr(_host, "depth", 0) + 1
    try:
        yield
    finally:
        _host.depth -= 1


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor made in host memory (under `host_memory()`) copied to `device`: on the CPU a
    copy too, so that the emulated device counts what the GPU would hold, and the host tensor
    can die (`.to("cpu")` would hand back the host tensor itself, uncounted)."""
    return host.clone() if device.type == "cpu" else host.to(device)


def active_device_memory() -> EmulatedDeviceMemory | None:
    """The `EmulatedDeviceMemory` active on this thread, if any."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, EmulatedDeviceMemory):
            return mode
    return None


def device_memory_counted() -> bool:
    """Whether an `EmulatedDeviceMemory` is active on this thread (CPU tensors are then an
    emulated device's memory unless made under `host_memory()`)."""
    return active_device_memory() is not None


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes a new buffer can still take on `device`: an emulated device's budget less what it
    holds (the active `EmulatedDeviceMemory`), a GPU's free memory plus what PyTorch's caching
    allocator holds unused; None where nothing limits it (a plain CPU)."""
    mode = active_device_memory()
    if mode is not None:
        return max(mode.budget_bytes - mode.live_bytes, 0)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return None


def _on_host() -> bool:
    return getattr(_host, "depth", 0) > 0


def _mib(nbytes: int) -> str:
    return f"{nbytes / _MIB:.1f} MiB"


class EmulatedDeviceMemory(LiveTensorBytes):
    """Every CPU storage created under the mode counts against `budget_bytes`; `reserve_bytes`
    (context, workspaces, communicators) counts from the start. Past the budget the op that
    allocated raises `torch.OutOfMemoryError` (its output is freed as the error unwinds)."""

    def __init__(self, rank: int, budget_bytes: int, reserve_bytes: int = 0):
        super().__init__()
        self.rank = rank
        """The rank whose device this is (named in the error)."""
        self.budget_bytes = int(budget_bytes)
        """The emulated device's memory (`mem=` of its cluster spec)."""
        self.reserve_bytes = int(reserve_bytes)
        """What no tensor holds on a real GPU (the planner's reserve), charged at start."""
        self.current = self.peak = self.reserve_bytes
        self._windows: list[list[int]] = []
        """Open `measure` windows: [live bytes at the start, largest since], innermost last."""
        if self.reserve_bytes > self.budget_bytes:
            raise torch.OutOfMemoryError(self._message("the device's reserve", 0))

    def _track(self, t: torch.Tensor) -> None:
        if _on_host():
            return
        before, peak = self.current, self.peak
        super()._track(t)
        grew = self.current - before
        if grew and self.current > self.budget_bytes:
            # as on a GPU, the allocation that fails never was: uncounted at once (the
            # error's traceback may keep the tensor alive a while), the peak as before
            self._sizes.pop(id(t.untyped_storage()), None)
            self.current, self.peak = before, peak
            raise torch.OutOfMemoryError(self._message(f"{tuple(t.shape)} {t.dtype}", grew))
        if grew:
            for window in self._windows:
                window[1] = max(window[1], self.current)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Dynamo compiles under this mode (and runs the compiled code with it on): the
        compiled calls' buffers, which no dispatch mode sees, are charged by
        runtime/capture/counted.py instead."""
        return True

    def count(self, tensors: list[torch.Tensor]) -> None:
        """Charge tensors made where the mode could not see them (inside compiled code);
        storages counted already are not counted twice."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._track(t)

    def open_window(self) -> list[int]:
        """Start measuring the largest live bytes above now (`close_window`'s answer)."""
        window = [self.current, self.current]
        self._windows.append(window)
        return window

    def close_window(self, window: list[int]) -> int:
        """Bytes the live total rose to above the window's start while it was open."""
        self._windows = [w for w in self._windows if w is not window]
        return window[1] - window[0]

    def charge_transient(self, nbytes: int, what: str) -> None:
        """A moment at which `nbytes` more than now are live (a compiled call's internal
        buffers, measured on its eager twin): past the budget it raises as an allocation
        would; the peak takes it either way."""
        if self.current + nbytes > self.budget_bytes:
            raise torch.OutOfMemoryError(self._message(what, nbytes))
        self.peak = max(self.peak, self.current + nbytes)
        for window in self._windows:
            window[1] = max(window[1], self.current + nbytes)

    def _message(self, what: str, nbytes: int) -> str:
        return (
            f"emulated device of rank {self.rank} is out of memory: allocating {_mib(nbytes)} "
            f"({what}) with {_mib(self.current)} live of its {_mib(self.budget_bytes)} "
            f"(mem=; {_mib(self.reserve_bytes)} of it the reserve a GPU keeps for its context, "
            "cuBLAS workspace and NCCL communicators; peak so far "
            f"{_mib(self.peak)})"
        )

    @property
    def live_bytes(self) -> int:
        """Bytes counted now, reserve included."""
        return self.current

    @property
    def peak_bytes(self) -> int:
        """The largest `live_bytes` since the mode started."""
        return self.peak


def outside_allocator_bytes(device: torch.device) -> int | None:
    """On CUDA, the device memory in use that PyTorch's caching allocator does not hold (the
    CUDA context, NCCL's communicators and buffers, other libraries; `mem_get_info` against
    `memory_reserved`): what the planner's reserve stands for, measured. Other processes on
    the same GPU count too. None off CUDA."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free - torch.cuda.memory_reserved(device))


def reserve_note(measured: int, planned: int) -> str:
    """One line comparing the measured reserve with the planned one (logged on a GPU after the
    first step, when every NCCL communicator of the job exists)."""
    verdict = (
        "within the plan's reserve"
        if measured <= planned
        else "MORE than the plan's reserve: plan with a smaller `mem=` for this device"
    )
    return (
        f"device memory outside PyTorch's allocator (CUDA context, NCCL communicators, cuBLAS): "
        f"{_mib(measured)} measured, {_mib(planned)} planned ({verdict})"
    )


def out_of_memory_message(
    rank: int, step: int, device: torch.device, ledger_peak_bytes: int, err: BaseException
) -> str:
    """One clear line for a real device's out-of-memory error (the others stop with it too:
    `runtime.collectives.dist.announce_failure`); `ledger_peak_bytes`: the engine's own
    buffers' peak (runtime/memory.py)."""
    gib = 1024**3
    detail = ""
    if isinstance(err, torch.OutOfMemoryError) and str(err).startswith("emulated device"):
        detail = f" ({str(err).split(': ', 1)[1]})"
    elif device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        detail = (
            f" ({torch.cuda.memory_allocated(device) / gib:.2f} GiB allocated, "
            f"{torch.cuda.memory_reserved(device) / gib:.2f} GiB reserved of {total / gib:.2f} GiB)"
        )
    return (
        f"rank {rank} ran out of device memory at step {step}{detail}; the engine's own buffers "
        f"peaked at {ledger_peak_bytes / gib:.2f} GiB. Other processes on that GPU, or "
        "memory the plan did not foresee, take the rest: give that rank a smaller batch or state "
        "fraction (a plan file), offload activations (parallel.offload = always), or re-plan with a "
        "smaller memory per GPU (`cephalo plan --cluster TYPE:mem=...`)"
    )


def startup_out_of_memory(rank: int, err: torch.OutOfMemoryError) -> CephaloError:
    """One line for a device that ran out of memory before the first step (profiling, the
    engine's buffers, a resumed checkpoint)."""
    return CephaloError(
        f"rank {rank} ran out of device memory before its first step ({first_line(err)}): the job "
        "does not fit this device as planned; give that rank a smaller share (a plan file, "
        "parallel.offload = always, LoRA / QLoRA) or a device with more memory"
    )
