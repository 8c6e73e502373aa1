"""`apply_compile`: the one explicit step that compiles the engine's blocks (as torchtitan's
`apply_compile`), and what `parallel.compile = "auto"` means on each device.

Modes: `off` (eager), `inductor` (torch.compile of each block type, runtime/capture/blocks.py),
`graphs` (CUDA graphs of each block type per micro-batch shape, runtime/capture/graphs.py;
CUDA only), `auto` (`AUTO`: what was measured to pay on that device). Where compiling cannot
keep the engine's results, an explicit mode is refused with one message and `auto` stays eager:
MoE blocks (their router statistics are Python state the block writes), LoRA / QLoRA (peft's
layers and the NF4 base are not traced here yet), dropout drawn from the global generator
(`per_sample_dropout = False`: a compiled forward and its recompute would draw different masks).
On an emulated device whose memory is counted byte by byte (runtime/device_memory.py, a
dispatch mode) the blocks compile too: the mode lets dynamo compile under it, and the compiled
calls' buffers, which it cannot see, are charged from outside (runtime/capture/counted.py).
"""

from __future__ import annotations

import torch

from cephalo.errors import CephaloError
from cephalo.modeling.units import UnitModel
from cephalo.runtime.capture.blocks import RECOMPILE_LIMIT, CompiledBlocks
from cephalo.runtime.dropout import module_uses_dropout

COMPILE_MODES = ("auto", "off", "graphs", "inductor")

AUTO = {"cpu": "off", "cuda": "off"}
"""What `auto` runs per device type, from measurements (docs/gpu.md, "Compiled blocks"):
the CPU: off (bench/results/compile_step.md: inductor's step 0.96x eager's on a small GPT
on this machine's 2 cores, its compile 15 s warm to minutes cold: thousands of steps to pay
back); CUDA: off
until scripts/gpu_check_compile.py has measured graphs and inductor against the eager engine
on a lent GPU (it prints the step times; set this from them)."""


def check_compile_mode(mode: str) -> None:
    """One message for a value that is not a mode (config validation)."""
    if mode not in COMPILE_MODES:
        raise CephaloError(
            f"parallel.compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}: "
            '"off" runs the engine eagerly, "auto" picks what pays on the device'
        )


def _refusal(model: UnitModel, per_sample_dropout: bool) -> str | None:
    """Why blocks of `model` cannot run compiled with the engine's results (None: they can)."""
    if getattr(model, "router_aux", None) is not None:
        return "MoE blocks (the router statistics are Python state the block writes)"
    if model.adapter is not None:
        return "LoRA / QLoRA adapters (peft's layers and the NF4 base are not compiled yet)"
    if not per_sample_dropout and any(
        module_uses_dropout(u.module) for u in model.units if u.kind == "block"
    ):
        return (
            "dropout from the global generator (per_sample_dropout off): a compiled forward "
            "and its recompute would draw different masks"
        )
    return None


def resolve_compile(mode: str, device: torch.device) -> str:
    """The mode `mode` runs on `device` ("auto" resolved); "graphs" off CUDA is refused."""
    check_compile_mode(mode)
    if mode == "auto":
        return AUTO.get(device.type, "off")
    if mode == "graphs" and device.type != "cuda":
        raise CephaloError(
            f'parallel.compile = "graphs" captures CUDA graphs, and this rank computes on '
            f'{device.type}: use "inductor" (torch.compile) or "off" there'
        )
    return mode


def apply_compile(
    model: UnitModel, device: torch.device, mode: str, per_sample_dropout: bool = True
) -> CompiledBlocks | None:
    """The engine's blocks of `model` compiled as `mode` says on `device` (module docstring):
    a `CompiledBlocks` the unit runner calls for every block, or None (eager)."""
    resolved = resolve_compile(mode, device)
    if resolved == "off":
        return None
    refusal = _refusal(model, per_sample_dropout)
    if refusal is not None:
        if mode == "auto":
            return None
        raise CephaloError(
            f'parallel.compile = "{mode}" does not compose with {refusal}: '
            'set parallel.compile = "off" (or "auto") for this model'
        )
    import torch._dynamo

    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else None
    limit = limit or "cache_size_limit"
    setattr(
        torch._dynamo.config,
        limit,
        max(getattr(torch._dynamo.config, limit), RECOMPILE_LIMIT),
    )
    if resolved == "inductor":
        return CompiledBlocks(
            resolved, device, lambda fn: torch.compile(fn, dynamic=False, backend="inductor")
        )
    from cephalo.runtime.capture.graphs import GraphedBlock

    return CompiledBlocks(resolved, device, GraphedBlock)
