"""Real CPU memory, counted tensor by tensor: the live bytes of every storage ops create while
the mode is active, and their peak. What the ledger's figures are checked against on the CPU
(where there is no `torch.cuda.max_memory_allocated`), and how the benchmarks measure other
systems (FSDP2) by the same rule.

Every op's outputs are looked at; a storage seen for the first time is counted with its size
until it is freed (a weak reference's callback: torch keeps one Python object per storage).
Outputs of ops whose schema says they alias an input (views, in-place and out= results) and of
c10d's collectives (they fill tensors passed in) are not new allocations; the decision is made
once per op, so the mode costs about one Python call per op on top of the dispatch. Storages that exist before are counted
only if registered with `add_existing`. `UntypedStorage.resize_`, which FSDP2 uses to free
and re-allocate its unsharded parameters and which no dispatch mode sees, is patched while
active. DTensor ops are passed down so that their local ops are the ones counted.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


class LiveTensorBytes(TorchDispatchMode):
    """`current`: live bytes of the counted CPU storages now; `peak`: their largest total."""

    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._sizes: dict[int, tuple[weakref.ref, int]] = {}
        self._original_resize = None

    def _track(self, t: torch.Tensor) -> None:
        if type(t) is not torch.Tensor and hasattr(t, "to_local"):  # DTensor
            t = t.to_local()
        if t.device.type != "cpu" or t.is_sparse or not t.numel():
            return
        st = t.untyped_storage()
        key = id(st)
        if key in self._sizes:
            return
        nbytes = st.nbytes()

        def freed(_ref, key=key) -> None:
            entry = self._sizes.pop(key, None)
            if entry is not None:
                self.current -= entry[1]

        self._sizes[key] = (weakref.ref(st, freed), nbytes)
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def add_existing(self, *objs: Any) -> None:
        """Count tensors, a module's parameters or an optimizer's state that exist already."""
        for obj in objs:
            if isinstance(obj, torch.Tensor):
                self._track(obj)
            elif isinstance(obj, nn.Module):
                for p in obj.parameters():
                    self._track(p.detach() if type(p) is torch.Tensor else p)
            elif isinstance(obj, torch.optim.Optimizer):
                for state in obj.state.values():
                    for v in state.values():
                        if isinstance(v, torch.Tensor):
                            self._track(v)

    def _resize(self, st: torch.UntypedStorage, size: int) -> None:
        self._original_resize(st, size)
        entry = self._sizes.get(id(st))
        if entry is None:
            self._sizes[id(st)] = (weakref.ref(st), 0)
            entry = self._sizes[id(st)]
        self.current += size - entry[1]
        self._sizes[id(st)] = (entry[0], size)
        self.peak = max(self.peak, self.current)

    def __enter__(self):
        self._original_resize = torch.UntypedStorage.resize_
        mode = self

        def resize_(st, size):
            mode._resize(st, size)

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._original_resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (len(types) == 1 and types[0] is torch.Tensor) and any(
            t is not torch.Tensor and hasattr(t, "to_local") for t in types
        ):
            return NotImplemented  # let DTensor unwrap; its local ops come back here
        out = func(*args, **(kwargs or {}))
        if _returns_inputs(func):
            return out  # a view, an in-place or out= result, a collective: no new storage
        for t in _tensors(out):
            self._track(t)
        return out


_ALIASING: dict[Any, bool] = {}
"""Per op (an OpOverload): whether its results may be its inputs' storages (decided once)."""


def _returns_inputs(func: Any) -> bool:
    """Whether `func`'s results alias its inputs (views, in-place and out= ops, by their schema's
    alias annotations) or are tensors passed in (c10d's collectives fill their arguments)."""
    known = _ALIASING.get(func)
    if known is None:
        schema = func._schema
        known = func.namespace == "c10d" or any(r.alias_info is not None for r in schema.returns)
        _ALIASING[func] = known
    return known


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of an op's result (a tensor, or tuples / lists of them, maybe nested)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def tracked_peak_bytes(step: Callable[[], Any], persistent: list[Any]) -> int:
    """Peak live CPU tensor bytes during `step()`; `persistent`: modules, optimizers or
    tensors that exist before the step and count from its start."""
    gc.collect()
    mode = LiveTensorBytes()
    mode.add_existing(*persistent)
    with mode:
        step()
    return mode.peak
