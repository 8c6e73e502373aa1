"""The engine's blocks run compiled (`CompiledBlocks`): one compiled callable per block TYPE,
shared by every block of that type, called on each block's gathered parameters.

Why per type: the engine keeps its units on the meta device and binds gathered parameter
views into them for each call (runtime/bind.py); a compiled callable that closes over one
block module of a type (its `template`) and takes the parameters as inputs
(`torch.func.functional_call`) runs every block of that type. Compiling each block module
instead would trace, guard and compile the same code num_layers times (dynamo guards on the
module object) and hit dynamo's recompile limit. Blocks are of one type when their modules
have the same classes, parameter names, shapes and dtypes, constant buffers and plain
attributes (`block_type`), except attributes that only number the layer (`layer_idx`: a
KV-cache slot, which training does not use).

Shapes: `dynamic=False`: one graph per (block type, micro-batch shape, grad mode, train or
eval), each specialised; the plan fixes a rank's micro-batch sizes, so a step after the first
compiles nothing. Dropout: masks drawn outside, passed in (runtime/capture/masks.py); the
first call of a (type, shape) runs eagerly to record its masks' shapes. On an emulated device
whose memory is counted (runtime/device_memory.py), the first call of each (type, shape, grad
mode) runs eagerly to measure what the compiled ones are charged (runtime/capture/counted.py).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from cephalo.runtime.bind import UnitBinding
from cephalo.runtime.capture.counted import CountedCalls
from cephalo.runtime.capture.masks import GivenMasks, MaskRecorder, MaskSpec, draw_masks
from cephalo.runtime.device_memory import active_device_memory
from cephalo.runtime.dropout import SampleDropout

LAYER_INDEX_ATTRS = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number"})
"""Attributes that only number a layer: ignored when telling block types apart."""

RECOMPILE_LIMIT = 64
"""Dynamo's per-code-object recompile limit while blocks are compiled: every block type,
micro-batch size, grad mode and train / eval mode is one entry of the same code object (the
default, 8, would silently fall back to eager on an uneven plan with several sizes)."""

BlockFn = Callable[[Mapping[str, torch.Tensor], torch.Tensor, dict, list], torch.Tensor]


def _plain(v: Any) -> bool:
    if isinstance(v, bool | int | float | str | type(None)):
        return True
    return isinstance(v, tuple | list) and all(_plain(x) for x in v)


def _digest(t: torch.Tensor) -> str:
    if t.is_meta:
        return "meta"
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha1(data).hexdigest()


def block_type(module: nn.Module) -> tuple:
    """What makes two block modules run the same code on parameters of the same shapes (see
    the module docstring): blocks with equal `block_type` share one compiled callable."""
    parts = []
    for name, sub in module.named_modules(remove_duplicate=False):
        attrs = tuple(
            (k, repr(v))
            for k, v in sorted(vars(sub).items())
            if not k.startswith("_") and k not in LAYER_INDEX_ATTRS and _plain(v)
        )
        params = tuple(
            (n, tuple(p.shape), p.dtype) for n, p in sub._parameters.items() if p is not None
        )
        buffers = tuple(
            (n, tuple(b.shape), b.dtype, _digest(b))
            for n, b in sub._buffers.items()
            if b is not None
        )
        parts.append((name, type(sub).__module__, type(sub).__qualname__, attrs, params, buffers))
    return tuple(parts)


def eager_block(template: nn.Module) -> BlockFn:
    """`template` run on given parameters, its dropout masks given: what is compiled."""

    def block(
        params: Mapping[str, torch.Tensor], x: torch.Tensor, kwargs: dict, masks: list
    ) -> torch.Tensor:
        if masks:
            with GivenMasks(masks):
                return torch.func.functional_call(template, dict(params), (x,), kwargs)
        return torch.func.functional_call(template, dict(params), (x,), kwargs)

    block.template = template  # type: ignore[attr-defined]  # train / eval: graphs.py's key
    return block


class CompiledBlocks:
    """The engine's blocks run through one compiled callable per block type (`inductor`) or
    CUDA graphs per shape (`graphs`, runtime/capture/graphs.py). `run` is the hook the unit
    runner calls for a block in place of its eager binding. Owns the callables, the block
    types of the units (found once) and the recorded mask specs."""

    def __init__(self, mode: str, device: torch.device, compile_fn: Callable[[BlockFn], Any]):
        self.mode = mode
        self.device = device
        self._compile = compile_fn
        self._type_of_unit: dict[int, tuple] = {}
        self._callables: dict[tuple, Any] = {}
        """block type -> its compiled callable."""
        self._mask_specs: dict[tuple, tuple[MaskSpec, ...]] = {}
        """(block type, input shape, dtype, training) -> the masks of one call, in order."""
        self.calls = 0
        """Compiled calls made (tests, benchmarks: the blocks did run compiled)."""
        self.eager_calls = 0
        """Calls run eagerly to record their dropout masks (one per type and shape), or, on
        an emulated device whose memory is counted, to measure it (per grad mode too)."""
        self.counted = CountedCalls()
        """The eager calls' memory, charged to the compiled ones on an emulated device."""

    @property
    def block_types(self) -> int:
        """Distinct block types seen so far (one compiled callable each)."""
        return len(self._callables)

    def type_of(self, index: int, module: nn.Module) -> tuple:
        key = self._type_of_unit.get(index)
        if key is None:
            key = self._type_of_unit[index] = block_type(module)
        return key

    def callable_of(self, key: tuple, module: nn.Module) -> Any:
        fn = self._callables.get(key)
        if fn is None:
            fn = self._callables[key] = self._compile(eager_block(module))
        return fn

    def run(
        self,
        index: int,
        binding: UnitBinding,
        params: Mapping[str, torch.Tensor],
        x: torch.Tensor,
        kwargs: dict,
        dropout: SampleDropout | None,
    ) -> torch.Tensor:
        """Block `index` (module bound by `binding`) on `params` and input `x`, under
        `dropout`'s masks (None: it drops nothing)."""
        module = binding.module
        key = self.type_of(index, module)
        memory = active_device_memory() if self.device.type == "cpu" else None
        call_key = (key, tuple(x.shape), x.dtype, module.training, torch.is_grad_enabled())
        shape_key = call_key[:4]
        specs = self._mask_specs.get(shape_key) if dropout is not None else ()
        if specs is None or (memory is not None and not self.counted.measured(call_key)):
            # first call at this key: eager, recording its masks and measuring its memory
            recorder = MaskRecorder(dropout) if specs is None else None
            with recorder or dropout or contextlib.nullcontext():
                if memory is None:
                    out = binding(params, (x,), kwargs)
                else:
                    inputs = [x, *params.values()]
                    eager = lambda: binding(params, (x,), kwargs)  # noqa: E731
                    out = self.counted.eager(memory, call_key, eager, inputs)
            if recorder is not None:
                self._mask_specs[shape_key] = tuple(recorder.specs)
            self.eager_calls += 1
            return out
        masks = draw_masks(dropout, specs, x.device) if dropout is not None else []
        self.calls += 1
        fn = self.callable_of(key, module)
        if memory is None:
            return fn(params, x, kwargs, masks)
        what = f"block {index} compiled, input {tuple(x.shape)}"
        return self.counted.compiled(memory, call_key, lambda: fn(params, x, kwargs, masks), what)
