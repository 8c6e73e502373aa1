"""Counting the operations that make the host wait for the device (`HostSyncs`), on any device.

A step that reads a device value on the host (a loss, a count, a size) stalls the host until
the GPU's queue has drained up to that value: the kernels queued ahead stop overlapping the
host's Python, and on a multi-GPU job every rank's communication backlog lands there. On CUDA
`torch.cuda.set_sync_debug_mode("error")` catches them (scripts/gpu_check.py runs the engine's
steps under it); on the CPU nothing synchronises, so the CPU suite counts the operations that
WOULD synchronise on a GPU, under a dispatch mode and a function mode:

- reading a tensor's value on the host: `aten._local_scalar_dense` (`item()`, `int()`,
  `float()`, `bool()` of a tensor, an `if` on one), `Tensor.tolist()`, `Tensor.numpy()`;
- operations whose output size depends on the data, so the host must know it before it can
  allocate: `nonzero`, `masked_select`, `unique` (and its variants), `bincount`,
  `repeat_interleave` without `output_size`, indexing with a boolean mask (`t[mask]`,
  `index_put_` with one), and `equal` (one bool for the host);
- copies from the device to the host: `copy_` / `_to_copy` into a CPU tensor from a non-CPU
  one. On the CPU every tensor is on the host, so there `Tensor.cpu()` calls are counted as the
  copy they would be if the tensor were on the device (`count_cpu_copies`). A `.to(device)`
  cannot be told from a `.to(host)` there (the engine's device IS the host): a step's copies
  that go through `.to` are checked on a GPU only (scripts/gpu_check.py).

What it does not see: a copy from pageable host memory to the device (synchronous on CUDA only
in the driver, not a torch sync) and syncs inside a third-party extension's C++.
"""

from __future__ import annotations

import collections
import traceback
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_DATA_DEPENDENT = {
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
    "bincount",
    "equal",
}
"""aten ops (by their packet name) that read device data on the host or size their output by it."""

_MASK_INDEXED = {"index", "index_put", "index_put_", "_index_put_impl_"}
"""aten ops that synchronise when an index is a boolean mask (its nonzero runs inside)."""

_HOST_READS = {"tolist", "numpy"}
"""Tensor methods (seen by the function mode) that read the whole tensor on the host."""


@dataclass
class SyncEvent:
    """One operation that would make the host wait for the device."""

    op: str
    """The aten op or Tensor method."""
    where: str
    """`file:line (function)` of the innermost cephalo frame that called it ("?" if none)."""


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/cephalo/" in frame.filename and not frame.filename.endswith("host_syncs.py"):
            return f"{frame.filename.rsplit('/cephalo/', 1)[-1]}:{frame.lineno} ({frame.name})"
    return "?"


def _is_mask(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: HostSyncs):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if name in _DATA_DEPENDENT:
            self.owner._add(name)
        elif name == "repeat_interleave" and kwargs.get("output_size") is None:
            if isinstance(args[-1] if args else None, torch.Tensor):
                self.owner._add(name)
        elif name in _MASK_INDEXED and len(args) > 1:
            indices = args[1] if isinstance(args[1], list | tuple) else []
            if any(_is_mask(i) for i in indices):
                self.owner._add(f"{name} (boolean mask)")
        elif name in ("_to_copy", "copy_") and args:
            src = args[0] if name == "_to_copy" else args[1]
            dst_device = kwargs.get("device") if name == "_to_copy" else args[0].device
            if (
                isinstance(src, torch.Tensor)
                and src.device.type != "cpu"
                and dst_device is not None
                and torch.device(dst_device).type == "cpu"
            ):
                self.owner._add(f"{name} (device to host)")
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, owner: HostSyncs):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _HOST_READS:
            self.owner._add(name)
        elif name == "cpu" and self.owner.count_cpu_copies:
            self.owner._add("cpu (to the host)")
        return func(*args, **kwargs)


@dataclass
class HostSyncs:
    """A context manager recording every operation that would make the host wait for the device
    (module docstring), in order: `events`."""

    count_cpu_copies: bool = True
    """Count `cpu()` / `.to("cpu")` of CPU tensors as device-to-host copies (see the module
    docstring): right for an engine on the CPU standing in for one on a GPU."""
    events: list[SyncEvent] = field(default_factory=list)

    def _add(self, op: str) -> None:
        self.events.append(SyncEvent(op, _caller()))

    def __enter__(self) -> HostSyncs:
        self._modes = (_Function(self), _Dispatch(self))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def summary(self) -> list[str]:
        """One line per event: `op at where`."""
        return [f"{e.op} at {e.where}" for e in self.events]


NO_WORK = frozenset(
    {
        "_unsafe_view",
        "empty",
        "empty_like",
        "empty_strided",
        "promote_types",
        "result_type",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "is_same_size",
        "_has_compatible_shallow_copy_type",
        "lift_fresh",
    }
)
"""aten ops (packet names) that are not views yet do no work: allocations without a kernel,
metadata queries. Excluded from the ops that do work (`OpCounter`), as the views are."""


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active, per op (`counts`); `work()` is the number
    that do work: on a GPU each is a kernel launch or more, a few microseconds of host time
    whatever its size, so a small model's step is as fast as its count is small
    (bench/launch_count.py, tests/test_engine_overhead.py: the engine's count against plain
    PyTorch's). Views and aliasing ops (`OpOverload.is_view`) and `NO_WORK` are excluded."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))

    def work(self) -> int:
        return sum(n for f, n in self.counts.items() if does_work(f))

    def by_op(self) -> collections.Counter:
        """Ops that do work, per packet name."""
        out: collections.Counter = collections.Counter()
        for f, n in self.counts.items():
            if does_work(f):
                out[f._overloadpacket.__name__] += n
        return out


def does_work(func) -> bool:
    """Whether an aten op counts as an op that does work (not a view, not in `NO_WORK`)."""
    return not func.is_view and func._overloadpacket.__name__ not in NO_WORK
