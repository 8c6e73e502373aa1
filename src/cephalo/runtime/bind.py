"""Call a unit's module with given tensors in place of its parameters.

The engine keeps every unit's module on the meta device and runs it on gathered parameters.
`torch.func.functional_call` does that, but it re-walks the module tree on every call
(`named_modules`, the tied-weight map, one checked swap per name): on a GPT-2-sized model
that was several milliseconds of host time per step on a GPU, where the host is the
bottleneck. `UnitBinding` walks the tree once, then swaps the same dict slots
functional_call swaps (`module._parameters[name]`), and puts the originals back.

Semantics are functional_call's with `strict=False`: a name not given keeps the module's own
tensor; a parameter held under several names (tied inside the module) takes the tensor given
under any of them; a name the module does not have is an error (here: a bug).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from cephalo.errors import CephaloError


class UnitBinding:
    """The parameter slots of one module, found once (see the module docstring)."""

    def __init__(self, module: nn.Module):
        self.module = module
        slots_by_param: dict[int, list[tuple[nn.Module, str]]] = {}
        names_by_param: dict[int, list[str]] = {}
        for prefix, sub in module.named_modules(remove_duplicate=False):
            for attr, p in sub._parameters.items():
                if p is None:
                    continue
                slots = slots_by_param.setdefault(id(p), [])
                if not any(m is sub and a == attr for m, a in slots):
                    slots.append((sub, attr))
                names_by_param.setdefault(id(p), []).append(f"{prefix}.{attr}" if prefix else attr)
        self._slots: dict[str, list[tuple[nn.Module, str]]] = {
            name: slots_by_param[key] for key, names in names_by_param.items() for name in names
        }

    def __call__(
        self, params: Mapping[str, torch.Tensor], args: tuple, kwargs: dict | None = None
    ) -> Any:
        """`module(*args, **kwargs)` with `params[name]` in place of parameter `name`."""
        saved: list[tuple[dict, str, Any]] = []
        try:
            for name, tensor in params.items():
                slots = self._slots.get(name)
                if slots is None:
                    raise CephaloError(
                        f"{type(self.module).__name__} has no parameter {name!r} (internal error: "
                        "the engine's flat layout and the module disagree)"
                    )
                for sub, attr in slots:
                    table = sub._parameters
                    saved.append((table, attr, table[attr]))
                    table[attr] = tensor  # type: ignore[assignment]
            return self.module(*args, **(kwargs or {}))
        finally:
            for table, attr, original in reversed(saved):
                table[attr] = original
