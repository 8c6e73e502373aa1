"""Training state in host memory: the copies between a rank's device and its host, and the
host's AdamW.

A rank with `host_state_fraction` h keeps the last h of every unit's shard (fp32 master,
gradient, Adam moments) in host memory (ledger `host/state`, pinned on CUDA); the device keeps
only that part's compute-dtype copy, which the all-gathers read. Per step:

- the reduce-scatter output of that part goes DOWN to the host gradient as soon as it arrives
  (`HostLink.down`), while the next unit's backward runs;
- once the global gradient norm is known, the host CPU runs AdamW on it (`HostAdamW`:
  torch's own `adamw`, fused where the build has a CPU kernel, else foreach);
- each unit's updated parameters go back UP to the device copy (`HostLink.up`), the next
  unit's host step running meanwhile.

Everything device-specific is in `HostLink`, and it is thin. On a CPU device "device" and host
are the same memory: a copy is a memcpy on the calling thread (a gradient piece is added
straight into the host gradient), and an emulated link bandwidth (`cpu:...,pcie=12GB/s`,
`HostLink.bytes_per_s`) makes each copy last at least nbytes / bandwidth, outside the compute
stretch of the emulated slowdown (the host is not slowed). On CUDA the copies run on a side
stream with pinned host buffers and non_blocking copies; `sync` waits for the downward copies
(events) before the host reads them, `wait_uploads` orders the compute stream after the
upward ones. scripts/gpu_check.py exercises that path.

A step's inputs (token ids, labels, positions, DPO reference log-probabilities) cross the same
link (`HostLink.inputs`): on CUDA staged into pinned memory and copied on a stream of their
own, so the copy runs beside the previous step's queued work (its optimizer) instead of
behind it, and the host does not wait: a `non_blocking` copy from pageable memory, what the
data hands in, synchronizes the host with the compute stream first. On an emulated link the
inputs' bytes are charged like any copy.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch.optim import adamw as torch_adamw

from cephalo.errors import CephaloError
from cephalo.runtime.device_memory import host_memory
from cephalo.runtime.emulation import ComputeEmulator
from cephalo.runtime.memory import MemoryLedger
from cephalo.runtime.state.adamw import AdamWHyper, grad_sq_sum, nonempty_grads

HOST_STAGING = "host/staging"
"""Ledger category of the pinned buffers a gradient piece lands in when it must be added to
a host gradient that already holds a contribution this step (CUDA only)."""


class HostLink:
    """Copies between one rank's device and its host memory (see the module docstring)."""

    def __init__(
        self,
        ledger: MemoryLedger,
        device: torch.device,
        bytes_per_s: float | None = None,
        emulator: ComputeEmulator | None = None,
    ):
        self.ledger = ledger
        self.device = device
        self.bytes_per_s = bytes_per_s
        """Emulated link bandwidth (CPU only): each copy lasts at least nbytes / bytes_per_s."""
        self.emulator = emulator
        """The rank's compute emulator: a copy inside a stretched compute piece is excluded from
        the stretch (it is a copy, not compute)."""
        self.cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        # CUDA: (event, staging buffer or None, destination or None) of downward copies in flight
        self._downs: list[tuple[torch.cuda.Event, torch.Tensor | None, torch.Tensor | None]] = []
        # CUDA: events of upward copies in flight (their pinned sources must not be rewritten)
        self._ups: list[torch.cuda.Event] = []
        self._inputs = torch.cuda.Stream(device) if self.cuda else None
        """CUDA: the step inputs' copies (`inputs`): behind nothing but earlier inputs."""
        self.copied_bytes = 0
        """Bytes moved so far (both directions)."""
        self.copy_s = 0.0
        """Host seconds spent in copies (CPU: the copies themselves; CUDA: issuing them)."""

    # ------------------------------------------------------------------ CPU helpers
    def copy(self, dst: torch.Tensor, src: torch.Tensor, add: bool = False) -> None:
        """dst (+)= src now, on this thread, as an emulated link copy when `bytes_per_s` is set
        (used by the CPU paths and by the boundary store of a pcie-emulated device)."""
        t0 = time.perf_counter()
        if self.emulator is not None and self.bytes_per_s is not None:
            with self.emulator.unstretched():
                self._copy_now(dst, src, add, t0)
        else:
            self._copy_now(dst, src, add, t0)
        self.copy_s += time.perf_counter() - t0

    def _copy_now(self, dst: torch.Tensor, src: torch.Tensor, add: bool, t0: float) -> None:
        if add:
            dst.add_(src)
        else:
            dst.copy_(src)
        nbytes = src.numel() * src.element_size()
        self.copied_bytes += nbytes
        if self.bytes_per_s is not None:
            left = nbytes / self.bytes_per_s - (time.perf_counter() - t0)
            if left > 0:
                time.sleep(left)

    # ------------------------------------------------------------------ host state
    def down(self, dst: torch.Tensor, src: torch.Tensor, accumulate: bool) -> None:
        """dst (host) += src (device), or dst = src where `accumulate` is False (dst holds
        zeros: the first contribution of the step). On CUDA asynchronous: `sync` completes it;
        `src` may be freed by the caller at once (its memory is kept for the copy stream)."""
        if src.numel() == 0:
            return
        if not self.cuda:
            self.copy(dst, src, add=True)
            return
        t0 = time.perf_counter()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        staging = None
        if accumulate:
            staging = self.ledger.alloc(HOST_STAGING, src.numel(), src.dtype, pin=True)
        with torch.cuda.stream(stream):
            (staging if staging is not None else dst).copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        src.record_stream(stream)  # the caching allocator must not reuse it before the copy ran
        self._downs.append((event, staging, dst if staging is not None else None))
        self.copied_bytes += src.numel() * src.element_size()
        self.copy_s += time.perf_counter() - t0

    def sync(self) -> None:
        """Wait for every downward copy and add the staged ones into their destinations, and
        for every upward copy (the host may then write their sources)."""
        for event in self._ups:
            event.synchronize()
        self._ups.clear()
        for event, staging, dst in self._downs:
            event.synchronize()
            if staging is not None:
                dst.add_(staging)
                self.ledger.free(staging)
        self._downs.clear()

    def up(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst (device, compute dtype) = src (host, pinned on CUDA, same dtype). On CUDA
        asynchronous: `wait_uploads` orders the compute stream after it."""
        if src.numel() == 0:
            return
        if not self.cuda:
            self.copy(dst, src)
            return
        t0 = time.perf_counter()
        # `dst` may still be read by kernels queued on the compute stream (the last gather of
        # the previous pass reads the device copy): the side stream waits for them
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        # the host writes `src` again at the next optimizer step: `sync` waits for this copy
        self._ups.append(event)
        self.copied_bytes += src.numel() * src.element_size()
        self.copy_s += time.perf_counter() - t0

    def inputs(self, tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """A step's host tensors on the device, ahead of their use (module docstring). CUDA:
        each staged in pinned memory (unless it is pinned) and copied on the inputs' stream
        into memory of that stream's own (no kernel queued on the compute stream can still
        read it), the compute stream ordered after the copies by an event: the host does not
        wait, and the copies run beside whatever the compute stream has queued. CPU: the
        tensors as they are, an emulated link charged their bytes (outside the compute
        stretch)."""
        if not self.cuda:
            nbytes = sum(t.numel() * t.element_size() for t in tensors if t is not None)
            if self.bytes_per_s is not None and nbytes:
                t0 = time.perf_counter()
                with self.emulator.unstretched() if self.emulator else contextlib.nullcontext():
                    time.sleep(nbytes / self.bytes_per_s)
                self.copy_s += time.perf_counter() - t0
            self.copied_bytes += nbytes
            return [None if t is None else t.to(self.device) for t in tensors]
        t0 = time.perf_counter()
        compute = torch.cuda.current_stream(self.device)
        out: list[torch.Tensor | None] = []
        with torch.cuda.stream(self._inputs):
            for t in tensors:
                if t is None or t.device == self.device:
                    out.append(t)
                    continue
                host = t if t.is_pinned() else torch.empty_like(t, pin_memory=True).copy_(t)
                on_device = torch.empty(t.shape, dtype=t.dtype, device=self.device)
                on_device.copy_(host, non_blocking=True)  # the pinned block outlives the copy
                on_device.record_stream(compute)  # used there: not reused before that use
                out.append(on_device)
                self.copied_bytes += t.numel() * t.element_size()
            landed = torch.cuda.Event()
            landed.record(self._inputs)
        compute.wait_event(landed)
        self.copy_s += time.perf_counter() - t0
        return out

    def wait_uploads(self) -> None:
        """Make the compute stream wait for the uploads issued so far (no host stall)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)


def host_adamw_kernel() -> str:
    """`fused` where this torch build has a fused AdamW for CPU tensors, else `foreach`."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return "fused" if "cpu" in _get_fused_kernels_supported_devices() else "foreach"
    except ImportError:  # an older torch: no fused CPU kernel
        return "foreach"


@dataclass
class HostGroup:
    """One unit's host-held part on this rank (1-D fp32 CPU tensors of one length)."""

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    decay_segments: list[tuple[int, int]] = field(default_factory=list)
    """[a, b) runs that get weight decay, relative to the part's start."""

    def runs(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(runs with weight decay, runs without), covering the part."""
        n = self.param.numel()
        decay, plain, at = [], [], 0
        for a, b in self.decay_segments:
            if a > at:
                plain.append((at, a))
            decay.append((a, b))
            at = b
        if at < n:
            plain.append((at, n))
        return decay, plain


HOST_ADAMW_KERNELS = ("fused", "foreach")


class HostAdamW:
    """AdamW on the host-held parts, by torch's own `torch.optim.adamw.adamw`: `foreach` repeats
    `ShardedAdamW`'s (and `torch.optim.AdamW`'s) arithmetic op for op (bitwise equal on the
    CPU); `fused` (one CPU kernel, about 4x faster than either here) rounds a little
    differently (about 1e-8 per step on 0.02-sized weights)."""

    def __init__(
        self,
        groups: Sequence[HostGroup],
        hyper: AdamWHyper,
        kernel: str | None = None,
        num_threads: int | None = None,
    ):
        self.groups = list(groups)
        self.hyper = hyper
        if num_threads is not None and num_threads < 1:
            raise CephaloError(f"host AdamW threads must be >= 1, got {num_threads}")
        self.num_threads = num_threads
        """Intra-op threads of its steps (`threads()`); None: the process's."""
        self.kernel = kernel or host_adamw_kernel()
        if self.kernel not in HOST_ADAMW_KERNELS:
            raise CephaloError(
                f"host AdamW kernel {self.kernel!r} is not one of {', '.join(HOST_ADAMW_KERNELS)}"
            )
        # per group: the views of each weight-decay run and each plain run
        self._runs = [g.runs() for g in self.groups]

    @contextlib.contextmanager
    def threads(self) -> Iterator[None]:
        """Run the block on `num_threads` intra-op threads, then restore the process's count:
        torchrun starts every rank with OMP_NUM_THREADS=1, which leaves the host AdamW of a
        GPU rank on one core while the node's other cores idle (`num_threads` is the cores
        shared by the node's ranks). Only around the host step, so what else the rank runs on
        the CPU (an emulated device's compute, timed on one thread) is left as it was."""
        before = torch.get_num_threads()
        if self.num_threads is None or self.num_threads == before:
            yield
            return
        torch.set_num_threads(self.num_threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def step_group(self, i: int, lr: float, step: int) -> None:
        """Update group i for optimizer step `step` (1-based, as `ShardedAdamW.step_count`)."""
        g = self.groups[i]
        if g.param.numel() == 0:
            return
        with host_memory():  # its temporaries are host memory (runtime/device_memory.py)
            self._step_runs(i, g, lr, step)

    def _step_runs(self, i: int, g: HostGroup, lr: float, step: int) -> None:
        beta1, beta2 = self.hyper.betas
        for runs, wd in zip(self._runs[i], (self.hyper.weight_decay, 0.0), strict=True):
            if not runs:
                continue
            views = [
                (g.param[a:b], g.grad[a:b], g.exp_avg[a:b], g.exp_avg_sq[a:b]) for a, b in runs
            ]
            params, grads, m, v = (list(t) for t in zip(*views, strict=True))
            # the functional form counts the step itself (+1 before the update)
            steps = [torch.tensor(float(step - 1)) for _ in params]
            torch_adamw.adamw(
                params,
                grads,
                m,
                v,
                [],
                steps,
                foreach=self.kernel == "foreach",
                fused=self.kernel == "fused",
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=lr,
                weight_decay=wd,
                eps=self.hyper.eps,
                maximize=False,
            )

    def grad_sq_sum(self) -> torch.Tensor:
        """Sum of squared host gradient entries (fp64 0-dim, CPU: as `ShardedAdamW`'s)."""
        with host_memory():
            return grad_sq_sum(nonempty_grads(self.groups), torch.device("cpu"))

    def scale_grads(self, factor: float) -> None:
        grads = nonempty_grads(self.groups)
        if grads:
            torch._foreach_mul_(grads, factor)

    def zero_grad(self) -> None:
        grads = nonempty_grads(self.groups)
        if grads:
            torch._foreach_zero_(grads)
