"""Where a step's time goes, as the engine's parts measure it (`StepClock`): compute of the
units (stretched by the emulated slowdown), host time blocked in collectives, host-state work.
`StepStats` reports the three sums; runtime/step_timing.py splits a step by them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from cephalo.runtime.collectives.comm import Handle
from cephalo.runtime.emulation import ComputeEmulator


class StepClock:
    """The step's time sums, shared by the parts that add to them (the unit collectives: waits;
    the passes: compute; the update: host work). Owns the CUDA events of the step's compute,
    read once at its end (`collect_busy`) so timing never stalls the stream meanwhile. Given
    the compute device and the `ComputeEmulator` that stretches compute on a slow emulated
    device."""

    def __init__(self, device: torch.device, emulator: ComputeEmulator):
        self.device = device
        self.emulator = emulator
        self.comm_wait_s = 0.0
        """Host seconds blocked in collectives this step (their calls and waits)."""
        self.busy_s = 0.0
        """Seconds of unit compute this step (CUDA: summed from events by `collect_busy`)."""
        self.host_s = 0.0
        """Host seconds of host-state work this step (its AdamW, norms and copies)."""
        self._cuda_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def reset(self) -> None:
        """A new step: the sums start at zero."""
        self.comm_wait_s = self.busy_s = self.host_s = 0.0

    def wait(self, handle: Handle) -> None:
        """Wait for a collective, the time blocked counted as communication."""
        t0 = time.perf_counter()
        handle.wait()
        self.comm_wait_s += time.perf_counter() - t0

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
        if self._cuda_events:
            torch.cuda.synchronize(self.device)
            self.busy_s += sum(a.elapsed_time(b) for a, b in self._cuda_events) / 1000.0
            self._cuda_events.clear()
        return self.busy_s
