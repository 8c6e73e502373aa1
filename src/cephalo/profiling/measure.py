"""Measurements on one device: units vs micro-batch size, optimizer, host copies, collectives.

Every unit measurement replays what the engine does for one micro-batch (runtime/engine/engine.py),
so the cost model's numbers are the engine's numbers:

- forward: parameters are views of one gathered flat buffer in the compute dtype, the unit
  runs through its `UnitBinding` (runtime/bind.py) under `no_grad` (and under the engine's per-sample dropout
  mode), and its output is stored into a fresh ledger buffer (the boundary activation);
- recompute + backward: parameters and input become fresh leaves, the unit runs again with
  a graph under the ledger's `track_activations`, `autograd.grad` back-propagates the output
  gradient, the parameter gradients are drained together into one fp32 accumulation buffer
  after it (runtime/autograd.py `drain_together`, as the engine), and the input gradient is
  stored. The backward time is this minus the forward
  (the cost model adds the recompute itself);
- activation bytes: what the engine's ledger adds during that recompute + backward (saved
  activations and the transient gradients it charges), so a predicted peak can match the
  ledger's.

Emulated devices are measured as they appear: each timed piece of unit compute, and the
optimizer step, is stretched by the same `ComputeEmulator` rule the engine uses (the engine
stretches both: a slow device is slow at its optimizer step too).

Timing: `warmup` untimed repetitions, then `repeats` timed ones, median kept (`time_piece`).
On a CPU rank with one intra-op thread (what the local launcher gives each rank) measured
alone, compute is timed by the thread's CPU time, so other jobs sharing the cores do not
inflate it; when co-located ranks are measured together (`Timing.wall_clock`) each runs as
in training and their contention is part of the numbers; on CUDA by the synchronised wall
clock. A repetition runs the piece enough times back to back to last about `MIN_REP_S`
(tiny units at micro-batch 1 take tens of microseconds, below the timer's useful
resolution); the sleep of the emulation is applied once per repetition, as the engine
applies it once per unit pass.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cephalo.modeling.units import Unit
from cephalo.runtime import head_loss
from cephalo.runtime.autograd import (
    LeafDrain,
    compiled_grad_bytes,
    drain_together,
    held_grad_bytes,
    largest_saved_bytes,
)
from cephalo.runtime.bind import UnitBinding
from cephalo.runtime.capture.blocks import CompiledBlocks
from cephalo.runtime.collectives.comm import Comm
from cephalo.runtime.device_memory import host_memory, to_device
from cephalo.runtime.dropout import SampleDropout, module_uses_dropout
from cephalo.runtime.emulation import ComputeEmulator, thread_cpu_measures_work
from cephalo.runtime.memory import MemoryLedger
from cephalo.runtime.state.adamw import AdamWHyper, ShardedAdamW, ShardGroup
from cephalo.runtime.state.flat import FlatLayout
from cephalo.runtime.state.host_state import HostAdamW, HostGroup, HostLink

UNMEASURABLE_BYTES_PER_S = 1e15
"""Bandwidth reported when time does not grow with size (JSON has no infinity)."""
MIN_REP_S = 0.01
"""A timed repetition lasts at least this long (several calls back to back if needed)."""


@dataclass
class Timing:
    """How to time one thing."""

    warmup: int = 1
    """Untimed repetitions first (allocator, caches, lazy initialisation)."""
    repeats: int = 3
    """Timed repetitions; the median is kept."""
    wall_clock: bool = False
    """Time compute by the wall clock even on a single-threaded CPU rank: what the engine
    measures and stretches, so contention with co-located ranks is part of the number."""
    start_together: Callable[[], None] | None = None
    """Called before each timed repetition (a barrier across concurrently measuring ranks):
    each repetition then starts on all ranks at once, as unit passes do in lockstep
    training (every unit starts when its all-gather completes on all ranks)."""
    contention: list[float] | None = None
    """Where given, `[seconds measured, of which contention]` summed over the timed
    repetitions (wall-clock timing of a CPU rank: the time beyond slowdown x the CPU time,
    runtime/emulation.py "Contention"): how much of a profile the host's sharing made."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_piece(
    fn: Callable[[], object],
    device: torch.device,
    timing: Timing,
    emulator: ComputeEmulator | None = None,
) -> float:
    """Median seconds of one call of `fn`, as it appears under `emulator` (if any).

    Where this thread's CPU time is the piece's whole work (`thread_cpu_measures_work`), a
    rank measured alone counts that CPU time (other processes sharing the cores then do not
    inflate the numbers), times the slowdown, without sleeping: exactly the duration the
    engine's emulator gives the piece on an otherwise idle host. Ranks measured together
    (`Timing.wall_clock`) run the piece as in training, sleep included, so their contention
    for the cores is part of the numbers. Elsewhere (GPU kernels, several intra-op threads):
    wall time, stretched by the emulator."""
    cpu_clock = thread_cpu_measures_work(device)
    emulator = emulator or ComputeEmulator(1.0)
    emulator = ComputeEmulator(emulator.slowdown, use_cpu_time=cpu_clock)
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    once = time.perf_counter() - t0
    calls = max(1, int(MIN_REP_S / max(once, 1e-7)))
    for _ in range(max(timing.warmup - 1, 0)):
        fn()
    samples = []
    for _ in range(timing.repeats):
        if timing.start_together is not None:
            timing.start_together()
        _sync(device)
        w0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            fn()
        _sync(device)
        wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
        if cpu_clock and not timing.wall_clock:
            spent = emulator.slowdown * min(cpu, wall)
        else:
            # the emulated duration as the emulator defines it (the sleep applied once per
            # repetition, as the engine applies it once per unit pass); its overshoot is the
            # host's scheduling noise, not the emulated device
            contended = emulator.contended_s
            spent = emulator.stretch(wall, cpu if cpu_clock else None)
            if timing.contention is not None:
                timing.contention[0] += spent
                timing.contention[1] += emulator.contended_s - contended
        samples.append(spent / calls)
    return statistics.median(samples)


class UnitBench:
    """One unit of a materialised model, runnable the way the engine runs it."""

    def __init__(
        self,
        unit: Unit,
        index: int,
        seq_len: int,
        hidden: int,
        vocab: int,
        device: torch.device,
        dtype: torch.dtype,
        per_sample_dropout: bool = True,
        compiled: CompiledBlocks | None = None,
    ):
        self.unit, self.index, self.kind = unit, index, unit.kind
        self.compiled = compiled if unit.kind == "block" else None
        """A block runs compiled as the engine will run it (`parallel.compile`:
        runtime/capture/); None: eagerly."""
        self._binding = UnitBinding(unit.module)
        self.seq_len, self.hidden, self.vocab = seq_len, hidden, vocab
        self.device, self.dtype = device, dtype
        self.per_sample_dropout = per_sample_dropout
        named = list(unit.module.named_parameters())
        self.layout = FlatLayout(unit.name, named)
        self.frozen = {n for n, p in named if not p.requires_grad}
        """A LoRA base's parameters: no gradient, as in the engine (runtime/state/frozen.py)."""
        self.ledger = MemoryLedger(0, device)
        # a ledger buffer, as the engine's gathered parameters are: what autograd saves of
        # them is then not counted as activations (in the engine it is not either)
        self.flat = self.ledger.alloc("gathered", self.layout.numel, dtype, device=device)
        with host_memory():  # the units' values live in host memory (`materialize_measured`)
            host_flat = self.layout.flatten(dict(named), dtype=dtype)
        self.flat.copy_(host_flat)
        del host_flat
        self.params = self.layout.views(self.flat)
        # fp32 gradient buffers of the trained parameters only (a LoRA base has none, as in
        # the engine, whose gradient buffer covers the trained part)
        trained = [(n, p.numel()) for n, p in named if n not in self.frozen]
        self.grad_flat = torch.zeros(sum(k for _, k in trained), dtype=torch.float32, device=device)
        pieces = self.grad_flat.split([k for _, k in trained]) if trained else []
        self.grads = {n: piece for (n, _), piece in zip(trained, pieces, strict=True)}
        self._gen = torch.Generator().manual_seed(1234 + index)

    # ------------------------------------------------------------------ inputs
    def inputs(self, m: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(unit input, labels for the head, output gradient) for a micro-batch of m samples."""
        shape = (m, self.seq_len)
        labels = None
        if self.kind == "embedding":
            x = torch.randint(0, self.vocab, shape, generator=self._gen).to(self.device)
        else:
            x = (torch.randn((*shape, self.hidden), generator=self._gen) * 0.5).to(
                self.device, self.dtype
            )
        if self.kind == "head":
            labels = torch.randint(0, self.vocab, shape, generator=self._gen).to(self.device)
            gout = torch.full((), 1.0 / (m * self.seq_len), dtype=torch.float32, device=self.device)
        else:
            gout = (torch.randn((*shape, self.hidden), generator=self._gen) * 1e-3).to(
                self.device, self.dtype
            )
        return x, labels, gout

    def _dropout(self) -> contextlib.AbstractContextManager:
        if not (self.per_sample_dropout and module_uses_dropout(self.unit.module)):
            return contextlib.nullcontext()  # as the engine: no mode without dropout
        return SampleDropout(0, 0, self.index, 0)

    def _run(
        self, params: dict[str, torch.Tensor], x: torch.Tensor, labels: torch.Tensor | None
    ) -> torch.Tensor:
        args = (x, labels) if self.kind == "head" else (x,)
        dropout = self._dropout()
        if self.compiled is not None:
            masks = dropout if isinstance(dropout, SampleDropout) else None
            return self.compiled.run(self.index, self._binding, params, x, {}, masks)
        with dropout:
            return self._binding(params, args)

    def _store(self, t: torch.Tensor) -> None:
        buf = self.ledger.alloc("boundary", t.numel(), t.dtype, device=self.device)
        buf.copy_(t.reshape(-1))
        self.ledger.free(buf)

    # ------------------------------------------------------------------ the two passes
    def forward(self, x: torch.Tensor, labels: torch.Tensor | None) -> None:
        """The engine's forward of one micro-batch: no graph, output stored."""
        with torch.no_grad():
            torch.get_rng_state()  # the engine saves the RNG state before each unit forward
            out = self._run(self.params, x, labels)
            if self.kind != "head":
                self._store(out)

    def recompute_backward(
        self, x: torch.Tensor, labels: torch.Tensor | None, gout: torch.Tensor
    ) -> None:
        """The engine's backward of one micro-batch (`Engine._backward_micro_batch`):
        recompute with a graph, drain each parameter gradient into the fp32 buffer as it is
        produced, charge autograd's transient gradients, store the input gradient. A frozen
        parameter (a LoRA base) is passed as it is: no gradient, as in the engine."""
        leaves = {
            name: v.detach().requires_grad_()
            for name, v in self.params.items()
            if name not in self.frozen
        }
        if self.kind == "embedding" and not leaves:
            return  # a frozen embedding: the engine runs no backward for it
        if self.kind != "embedding":
            x = x.detach().requires_grad_()
        names = [n for n in self.grads if n in leaves]
        drain = LeafDrain(
            names, [leaves[n] for n in names], [[self.grads[n]] for n in names], self.grad_flat
        )
        param_grad = held_grad_bytes(drain, (), self.dtype)
        if self.kind == "head":  # the engine's one pass of loss and backward, in chunks
            self._head_backward(leaves, x, labels, gout, param_grad, drain)
            return
        with torch.enable_grad(), self.ledger.track_activations():
            out = self._run({**self.params, **leaves}, x, labels)
            saved = largest_saved_bytes(out.grad_fn, self.ledger)
            together = compiled_grad_bytes(out.grad_fn)  # a compiled block's, all at once
            transient = saved + max(saved, param_grad, together)
            self.ledger.charge("grad_transient", transient)
            inputs = ([x] if self.kind != "embedding" else []) + list(leaves.values())
            torch.autograd.backward(out, grad_tensors=gout, inputs=inputs)
            drain_together(drain, set(names))  # added (the buffers are zeroed once)
        del out
        self.ledger.release("grad_transient", transient)
        if self.kind != "embedding":
            self._store(x.grad)
            x.grad = None

    def _head_backward(self, leaves, x, labels, gout, param_grad: int, drain: LeafDrain) -> None:
        """`Engine._head_micro_batch`: the head over chunks of the sequence."""
        charged = [0]

        def on_chunk(out: torch.Tensor) -> None:
            self.ledger.release("grad_transient", charged[0])
            saved = largest_saved_bytes(out.grad_fn, self.ledger)
            charged[0] = saved + max(saved, param_grad)
            self.ledger.charge("grad_transient", charged[0])

        def run(h: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
            with self._dropout():
                return self._binding(leaves, (h, lab))

        with self.ledger.track_activations():
            _, dx = head_loss.loss_and_backward(
                run, x, labels, self.vocab, gout, list(leaves.values()), True, on_chunk
            )
        drain_together(drain, set(drain.names))
        self.ledger.release("grad_transient", charged[0])
        self._store(dx)

    def activation_bytes(self, m: int) -> int:
        """Peak bytes the engine's ledger adds during one recompute + backward: saved
        activations plus the charged transient gradients (the stored input gradient is a
        boundary buffer, which the cost model counts on its own)."""
        x, labels, gout = self.inputs(m)
        self.ledger.reset_peak()
        base = self.ledger.current_bytes
        self.recompute_backward(x, labels, gout)
        return int(self.ledger.peak_bytes - base)

    def measure(
        self, m: int, timing: Timing, emulator: ComputeEmulator
    ) -> tuple[float, float, int]:
        """(forward s, backward s without the recompute, activation bytes) at micro-batch m."""
        act = self.activation_bytes(m)
        x, labels, gout = self.inputs(m)
        fwd = time_piece(lambda: self.forward(x, labels), self.device, timing, emulator)
        both = time_piece(
            lambda: self.recompute_backward(x, labels, gout), self.device, timing, emulator
        )
        # on a noisy machine the difference can dip below zero at tiny sizes: the backward
        # of a unit never costs less than a small share of its forward
        return fwd, max(both - fwd, 0.1 * fwd), act


def measure_optimizer(
    device: torch.device, numel: int, timing: Timing, emulator: ComputeEmulator | None = None
) -> float:
    """Seconds per parameter of the engine's optimizer work on its shard: the squared-norm
    sum, the AdamW step, zeroing the gradient (fp32, one flat group), as it appears under
    `emulator` (the engine stretches its optimizer step by the same factor)."""
    gen = torch.Generator().manual_seed(7)

    def buf(scale: float) -> torch.Tensor:
        return (torch.randn(numel, generator=gen) * scale).to(device)

    group = ShardGroup(
        buf(0.02),
        buf(1e-3),
        torch.zeros(numel, device=device),
        torch.zeros(numel, device=device),
        [(0, numel)],
    )
    opt = ShardedAdamW([group], AdamWHyper())

    def step() -> None:
        opt.local_grad_sq_sum()
        opt.step(1e-4)
        opt.zero_grad()

    return time_piece(step, device, timing, emulator) / numel


NF4_DEQUANT_SHAPE = (1024, 1024)
"""The weight `measure_nf4_dequant` dequantizes: one chunk (`specs.adapter.NF4_DEQUANT_CHUNK`)."""


def measure_nf4_dequant(
    device: torch.device,
    dtype: torch.dtype,
    timing: Timing,
    emulator: ComputeEmulator | None = None,
    shape: tuple[int, int] = NF4_DEQUANT_SHAPE,
) -> float:
    """Seconds per weight of QLoRA's dequantization as the engine runs it (runtime/state/frozen.py:
    `modeling.nf4.dequantize_into`, torchao's `get_original_weight` per chunk) into `dtype`, as
    it appears under `emulator` (the engine's dequantization is part of its stretched compute).
    `shape`: the weight dequantized (`nf4_dequant_shape`: the model's largest quantized one, at
    most one chunk), so that its temporaries are no larger than the engine's."""
    from cephalo.modeling.nf4 import dequantize_into, nf4_format, quantize

    fmt = nf4_format(shape) or nf4_format(NF4_DEQUANT_SHAPE)
    gen = torch.Generator().manual_seed(7)
    with host_memory():  # quantized on the host, as the engine's frozen base is
        host = quantize(fmt, torch.randn(fmt.shape, generator=gen) * 0.02)
    raw = to_device(host, device)
    del host
    out = torch.empty(fmt.numel, dtype=dtype, device=device)
    return time_piece(lambda: dequantize_into(fmt, raw, out), device, timing, emulator) / fmt.numel


def nf4_dequant_shape(shapes: list[tuple[int, ...]]) -> tuple[int, int]:
    """The weight `measure_nf4_dequant` times: the largest of `shapes` (a model's quantized
    weights) that NF4 can store, cut to at most one chunk (`NF4_DEQUANT_SHAPE`)."""
    from cephalo.modeling.nf4 import nf4_format

    cap = NF4_DEQUANT_SHAPE[0] * NF4_DEQUANT_SHAPE[1]
    best = None
    for shape in shapes:
        if nf4_format(shape) is None:
            continue
        rows, cols = shape
        rows = max(1, min(rows, cap // max(cols, 1)))  # whole rows, at most one chunk
        if nf4_format((rows, cols)) is not None and (
            best is None or rows * cols > best[0] * best[1]
        ):
            best = (rows, cols)
    return best or NF4_DEQUANT_SHAPE


def measure_host_copy(
    device: torch.device,
    nbytes: int,
    timing: Timing,
    emulator: ComputeEmulator | None = None,
    link_bytes_per_s: float | None = None,
) -> float:
    """Bytes per second of a device -> host -> device round trip (a memcpy on the CPU), as
    it appears under `emulator`: pass one where the copies run on the compute thread (a
    CPU) inside the unit compute, since the engine then stretches them with the compute
    around them. An emulated link (`link_bytes_per_s`, `cpu:...,pcie=`) copies through the
    engine's `HostLink`, which gives every copy its own duration (not stretched)."""
    numel = nbytes // 4
    src = torch.randn(numel).to(device)
    pin = device.type == "cuda"
    with host_memory():
        host = torch.empty(numel, pin_memory=pin)
    back = torch.empty(numel, device=device)
    if link_bytes_per_s is not None:
        link = HostLink(MemoryLedger(0, device), device, link_bytes_per_s)

        def roundtrip() -> None:
            link.copy(host, src)
            link.copy(back, host)

        # the emulated link sleeps: time it by the wall clock
        return (
            2
            * numel
            * 4
            / time_piece(roundtrip, device, Timing(timing.warmup, timing.repeats, True))
        )

    def roundtrip() -> None:
        host.copy_(src, non_blocking=pin)
        back.copy_(host, non_blocking=pin)

    return 2 * numel * 4 / time_piece(roundtrip, device, timing, emulator)


def measure_host_optimizer(numel: int, timing: Timing) -> float:
    """Seconds per parameter of the host's work on host-held state: the squared-norm sum, the
    AdamW step (`HostAdamW`, fused where available) and zeroing the gradient, on CPU tensors
    and never under an emulated slowdown (the host is not the emulated device). Ranks that
    share a host measure it at once (`Timing.start_together`), as they run it in training."""
    gen = torch.Generator().manual_seed(11)
    group = HostGroup(
        torch.randn(numel, generator=gen) * 0.02,
        torch.randn(numel, generator=gen) * 1e-3,
        torch.zeros(numel),
        torch.zeros(numel),
        [(0, numel)],
    )
    opt = HostAdamW([group], AdamWHyper())
    cpu = torch.device("cpu")

    def step() -> None:
        opt.grad_sq_sum()
        opt.step_group(0, 1e-4, 1)
        opt.zero_grad()

    return time_piece(step, cpu, timing) / numel


@dataclass
class CollectiveSample:
    """Median time of one collective over `nbytes` in total (the gathered / reduced size)."""

    name: str
    nbytes: int
    seconds: float


def measure_collectives(
    comm: Comm, device: torch.device, sizes_bytes: tuple[int, ...], timing: Timing
) -> list[CollectiveSample]:
    """Time `all_gather_v` and `reduce_scatter_v` of fp32 buffers of each total size across
    all ranks (uneven shards, as the engine uses them); every rank runs this together. A
    repetition's time is the slowest rank's (all-reduced max), after a barrier."""
    n = comm.world_size
    out: list[CollectiveSample] = []
    for nbytes in sizes_bytes:
        numel = max(nbytes // 4, n)
        # uneven on purpose: rank i gets a share proportional to i + 1
        weights = [i + 1 for i in range(n)]
        sizes = [numel * w // sum(weights) for w in weights]
        sizes[-1] += numel - sum(sizes)
        full = torch.zeros(numel, device=device)
        shard = torch.ones(sizes[comm.rank], device=device)

        def gather(full=full, shard=shard, sizes=sizes) -> None:
            comm.all_gather_v(full, shard, sizes).wait()

        def scatter(full=full, shard=shard, sizes=sizes) -> None:
            comm.reduce_scatter_v(shard, full, sizes)

        for name, fn in (("all_gather_v", gather), ("reduce_scatter_v", scatter)):
            samples = []
            for rep in range(timing.warmup + timing.repeats):
                comm.barrier()
                t0 = time.perf_counter()
                fn()
                _sync(device)
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
                comm.all_reduce(t, "max")
                if rep >= timing.warmup:
                    samples.append(float(t.item()))
            out.append(CollectiveSample(name, numel * 4, statistics.median(samples)))
    return out


def fit_comm(samples: list[CollectiveSample], world_size: int) -> tuple[float, float]:
    """(bytes_per_s, latency_s) of the cost model's ring formula
    t = latency + (n-1)/n * bytes / bandwidth, fitted to the two sizes of both collectives
    (least squares over all points; latency clamped at 0)."""
    ring = (world_size - 1) / world_size
    xs = [ring * s.nbytes for s in samples]
    ys = [s.seconds for s in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var > 0 else 0.0
    if slope <= 0:  # no size dependence measurable: all latency
        return UNMEASURABLE_BYTES_PER_S, max(my, 0.0)
    return 1.0 / slope, max(my - slope * mx, 0.0)
