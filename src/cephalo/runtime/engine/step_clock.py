"""Where a step's time goes, as the engine's parts measure it (`StepClock`): compute of the
units (stretched by the emulated slowdown), time the compute stream waits for collectives,
host-state work. `StepStats` reports the three sums; runtime/step_timing.py splits a step by them.

The communication wait is what the stream waits, not what the host blocks: on NCCL
`work.wait()` returns at once on the host and makes the stream wait, so a host clock around it
reads about 0 and the stall lands in whatever synchronises next (the optimizer's reads; issue
38, finding 10). On CUDA a pair of events around each wait times the stall on the stream; on
an emulated cluster (runtime/collectives/emulated.py) the emulated stream's stalls are counted
where they land (the start of the next compute, `settle` before the optimizer step)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from cephalo.runtime.collectives.comm import Handle
from cephalo.runtime.collectives.emulated import EmulatedStream
from cephalo.runtime.emulation import ComputeEmulator


class StepClock:
    """The step's time sums, shared by the parts that add to them (the unit collectives: waits;
    the passes: compute; the update: host work). Owns the CUDA events of the step's compute,
    read once at its end (`collect_busy`) so timing never stalls the stream meanwhile. Given
    the compute device and the `ComputeEmulator` that stretches compute on a slow emulated
    device."""

    def __init__(
        self,
        device: torch.device,
        emulator: ComputeEmulator,
        stream: EmulatedStream | None = None,
    ):
        self.device = device
        self.emulator = emulator
        self.stream = stream
        """An emulated cluster's compute stream (None: the host is the stream, or CUDA)."""
        self.comm_wait_s = 0.0
        """Seconds the step waited for collectives: host time blocked in their calls and, on
        CUDA, the stream's stalls at their waits (events, read by `collect_busy`); on an
        emulated cluster the emulated stream's stalls."""
        self.busy_s = 0.0
        """Seconds of unit compute this step (CUDA: summed from events by `collect_busy`)."""
        self.host_s = 0.0
        """Host seconds of host-state work this step (its AdamW, norms and copies)."""
        self._cuda_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._wait_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        """CUDA: (before, after) each collective's wait on the compute stream."""

    def reset(self) -> None:
        """A new step: the sums start at zero."""
        self.comm_wait_s = self.busy_s = self.host_s = 0.0

    def wait(self, handle: Handle) -> None:
        """Wait for a collective. The host's blocked time counts as communication and, on
        CUDA, the stream's stall (NCCL: the host does not block, the stream waits; events
        before and after the wait time it without a sync, read at the step's end)."""
        cuda = self.device.type == "cuda" and not handle.done
        if cuda:
            stream = torch.cuda.current_stream(self.device)
            before = torch.cuda.Event(enable_timing=True)
            before.record(stream)
        t0 = time.perf_counter()
        handle.wait()
        self.comm_wait_s += time.perf_counter() - t0
        if cuda:
            after = torch.cuda.Event(enable_timing=True)
            after.record(stream)
            self._wait_events.append((before, after))

    def settle(self) -> None:
        """The stream runs up to now (an emulated cluster's: its pending waits are slept,
        counted as communication): before the optimizer step, whose kernels wait on the stream
        and whose reads synchronise the host with it."""
        if self.stream is not None:
            self.comm_wait_s += self.stream.sync()

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Time a piece of compute (stretched by the emulated slowdown). On CUDA, events
        time the stream without stalling the host (summed at the end of the step), unless a
        slowdown must be emulated, which needs the host to know the time now."""
        if self.device.type == "cuda" and self.emulator.slowdown == 1.0:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream = torch.cuda.current_stream(self.device)  # once: it builds a Stream object
            start.record(stream)
            yield
            end.record(stream)
            self._cuda_events.append((start, end))
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.settle()  # the kernels start once the stream's waits are over
        mark = self.emulator.start()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.busy_s += self.emulator.finish(mark)

    @contextlib.contextmanager
    def optimizer_work(self) -> Iterator[None]:
        """Optimizer work on this rank's shard, stretched by the emulated slowdown: a slow
        device is slow at its optimizer step too, and the profiler measures that step under
        the same emulator (profiling/measure.py `measure_optimizer`). Not part of `busy_s`
        (unit compute only); without emulation nothing is timed, so CUDA never stalls here."""
        if self.emulator.slowdown == 1.0:
            yield
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        mark = self.emulator.start()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.emulator.finish(mark)

    def collect_busy(self) -> float:
        """The step's compute seconds, the CUDA events read now (one sync, at the step's end)."""
        if self._cuda_events or self._wait_events:
            torch.cuda.synchronize(self.device)
            self.busy_s += sum(a.elapsed_time(b) for a, b in self._cuda_events) / 1000.0
            self.comm_wait_s += sum(a.elapsed_time(b) for a, b in self._wait_events) / 1000.0
            self._cuda_events.clear()
            self._wait_events.clear()
        return self.busy_s
