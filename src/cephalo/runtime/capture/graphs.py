"""CUDA graphs of a block type (`parallel.compile = "graphs"`, CUDA only).

A block's forward, and its recompute + backward, captured once per input signature (the
micro-batch shape, grad mode, which inputs need a gradient, train / eval) and replayed for
every block of that type and signature: the host launches one graph instead of a few hundred
kernels per block. Collectives stay outside (the engine's all-gathers and reduce-scatters run
between blocks, on the engine's streams), and so do the drains into the fp32 gradient buffer
(the leaves' post-accumulate hooks run on what the backward graph returns).

Static buffers: each captured graph reads its inputs from static tensors and writes its
outputs to static tensors. A call copies the block's gathered parameters, its input boundary
and its dropout masks (drawn outside: runtime/capture/masks.py) into the static inputs, then
replays (torch's `make_graphed_callables` for the recompute + backward, a `torch.cuda.CUDAGraph`
for the grad-free forward); outputs and the input gradient are cloned out of the static
buffers, because the next replay of the same graph (the next block) overwrites them while the
engine still holds them (its boundary store). Each graph keeps its own memory pool: about one
block's activations and parameters per signature, outside the engine's ledger.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from cephalo.runtime.capture.blocks import BlockFn

WARMUP = 3
"""Eager runs on a side stream before a capture (cuBLAS / cuDNN workspaces, lazy inits), as
`make_graphed_callables` does by default."""


class _CloneGrad(torch.autograd.Function):
    """Identity whose backward clones the gradient: an input gradient leaves the backward
    graph's static buffer before the next replay overwrites it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.clone()


class _ForwardGraph:
    """A grad-free forward captured once: static inputs, one graph, static output."""

    def __init__(self, fn, args: tuple[torch.Tensor, ...]):
        self.static_in = tuple(a.clone() for a in args)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(WARMUP):
                fn(*self.static_in)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph):
            self.static_out = fn(*self.static_in)

    def __call__(self, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        for static, a in zip(self.static_in, args, strict=True):
            if static.data_ptr() != a.data_ptr():
                static.copy_(a)
        self.graph.replay()
        return self.static_out.clone()


class GraphedBlock:
    """One block type's graphs, one per input signature (see the module docstring); called as
    `CompiledBlocks` calls a compiled callable: (params, x, kwargs, masks)."""

    def __init__(self, fn: BlockFn):
        self.fn = fn
        self._graphs: dict[tuple, object] = {}
        self._names: tuple[str, ...] = ()
        self._kw_names: tuple[str, ...] = ()
        self.captures = 0
        """Graphs captured (tests and the GPU check: one per signature, not per call)."""

    def _flat(self, *args: torch.Tensor) -> torch.Tensor:
        """`fn` on flat tensor arguments (what the graph APIs take):
        x, the parameters in `_names` order, the kwargs in `_kw_names` order, the masks."""
        n, k = len(self._names), len(self._kw_names)
        x, params, kw, masks = args[0], args[1 : 1 + n], args[1 + n : 1 + n + k], args[1 + n + k :]
        return self.fn(
            dict(zip(self._names, params, strict=True)),
            x,
            dict(zip(self._kw_names, kw, strict=True)),
            list(masks),
        )

    def __call__(
        self, params: Mapping[str, torch.Tensor], x: torch.Tensor, kwargs: dict, masks: list
    ) -> torch.Tensor:
        names, kw_names = tuple(params), tuple(kwargs)
        args = (x, *params.values(), *kwargs.values(), *masks)
        grad = torch.is_grad_enabled() and any(a.requires_grad for a in args)
        key = (
            names,
            kw_names,
            tuple((tuple(a.shape), a.dtype, a.requires_grad) for a in args),
            grad,
            self.fn.template.training,  # type: ignore[attr-defined]
        )
        graph = self._graphs.get(key)
        if graph is None:
            self._names, self._kw_names = names, kw_names
            if grad:
                # the sample arguments become the graph's static inputs: copies, never the
                # engine's own tensors (a replay copies every later block's inputs into them)
                sample = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
                graph = torch.cuda.make_graphed_callables(
                    self._flat, sample, num_warmup_iters=WARMUP, allow_unused_input=True
                )
            else:
                graph = _ForwardGraph(self._flat, args)
            self._graphs[key] = graph
            self.captures += 1
        self._names, self._kw_names = names, kw_names
        if not grad:
            return graph(args)
        if x.requires_grad:
            args = (_CloneGrad.apply(x), *args[1:])
        return graph(*args).clone()
