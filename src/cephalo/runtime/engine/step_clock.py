"""Where a step's time goes, as the engine's parts measure it (`StepClock`): compute of the
units (stretched by the emulated slowdown), communication the step waits for, the optimizer's
work, host-state work. `StepStats` reports the sums; runtime/step_timing.py splits a step by them.

On CUDA (without an emulated slowdown) the device's phases are timed on its compute stream
with CUDA events, read once at the step's end, after the step's one host read
(`ShardUpdate`), when they have all completed: no sync of their own. There a collective's
`wait()` does not block the host (it makes the compute stream wait for NCCL's), so host time
around it is about 0 and the stall lands wherever the host next waits for the device (the
step's read, charged to the optimizer by host clocks): the events bracketing a wait measure the
stream's stall itself. So on CUDA `comm_wait_s` is the compute stream's time stalled in
collectives (outside unit compute), `optimizer_s` the stream's time in the optimizer's
kernels, and `device_step_s` the stream's span of the step; what the three and `busy_s` leave
of it is the time the device waited for the host. On the CPU (and under an emulated slowdown)
every part is host time, as before; calibration (train/calibration.py) reads either alike.

Events per run, not per unit (issue 39): on CUDA consecutive compute spans with no
communication or optimizer span between them are one run, timed by one event pair: a pass's
units on one rank (no wait between them) cost two events, not two per unit. A run ends where
the next communication or optimizer span starts, and that span's start event is the run's end
(one event, not two). So the stream's work between two units of a run (a gather's cast, a
gradient shard's add) and any wait for the host there count as compute, as they always did
inside a unit. A wait on a handle with nothing in flight (one rank, or waited already: `Handle.idle`)
opens no span at all, on any device.

On an emulated cluster (runtime/collectives/emulated.py) a collective's `wait()` is
asynchronous as on NCCL: the emulated stream's stalls are counted as communication where they
land (the start of the next compute, `settle` before the optimizer step).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from cephalo.runtime.collectives.comm import Handle
from cephalo.runtime.collectives.emulated import EmulatedStream
from cephalo.runtime.emulation import ComputeEmulator

_Events = list[tuple[torch.cuda.Event, torch.cuda.Event]]


@dataclass
class StepTimes:
    """A step's sums as `StepClock.collect` reads them (seconds)."""

    busy_s: float
    """Unit compute."""
    comm_wait_s: float
    """Communication the step waited for (CUDA: the compute stream stalled in collectives)."""
    optimizer_s: float | None
    """CUDA: the stream's time in the optimizer's work; None where the host times it."""
    device_step_s: float | None
    """CUDA: the compute stream's span from the step's start to its end; None elsewhere."""


class StepClock:
    """The step's time sums, shared by the parts that add to them (the unit collectives: waits;
    the passes: compute; the update: optimizer and host work). Owns the CUDA events of the
    step, read once at its end (`collect`) so timing never stalls the stream meanwhile. Given
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
        """Seconds the step waited for collectives: host time blocked in their calls and waits;
        on CUDA the compute stream's stalls at their waits (events, `collect`); on an emulated
        cluster the emulated stream's stalls (`settle`)."""
        self.busy_s = 0.0
        """Seconds of unit compute this step (CUDA: summed from events by `collect`)."""
        self.host_s = 0.0
        """Host seconds of host-state work this step (its AdamW, norms and copies)."""
        self.contention_s = 0.0
        """Of `busy_s`, the seconds the host's other threads took from this rank's compute (a
        CPU rank timed by its CPU time: runtime/emulation.py, "Contention"); 0 elsewhere."""
        self.events = device.type == "cuda" and emulator.slowdown == 1.0
        """Whether the device's phases are timed with CUDA events (module docstring)."""
        self._compute: _Events = []
        self._comm: _Events = []
        self._optimizer: _Events = []
        self._start: torch.cuda.Event | None = None
        self._run: torch.cuda.Event | None = None
        """CUDA: the start of the open run of compute spans (module docstring), else None."""
        self._in_compute = 0
        self.records = 0
        """CUDA events recorded since the clock was made (tests and the launch count)."""

    def _record(self) -> torch.cuda.Event:
        self.records += 1
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _close_run(self) -> torch.cuda.Event:
        """An event at the stream's position now; it ends the open run of compute, if any
        (one event: the end of the run and the start of what follows)."""
        event = self._record()
        if self._run is not None:
            self._compute.append((self._run, event))
            self._run = None
        return event

    def reset(self) -> None:
        """A new step: the sums start at zero (CUDA: the step's start is marked on the stream)."""
        self.comm_wait_s = self.busy_s = self.host_s = self.contention_s = 0.0
        for events in (self._compute, self._comm, self._optimizer):
            events.clear()
        self._run = None
        self._start = self._record() if self.events else None

    def wait(self, handle: Handle) -> None:
        """Wait for a collective, the time it holds the step counted as communication (a
        handle with nothing in flight: no span, module docstring)."""
        if handle.idle:
            handle.wait()
            return
        with self.communication():
            handle.wait()

    @contextlib.contextmanager
    def communication(self) -> Iterator[None]:
        """A collective's call or wait: its host time is added to `comm_wait_s`; on CUDA the
        compute stream's stall over it is timed with events (not inside unit compute, which
        its own events already cover: the parts stay disjoint)."""
        t0 = time.perf_counter()
        if self.events and not self._in_compute:
            start = self._close_run()
            yield
            self._comm.append((start, self._record()))
        else:
            yield
        self.comm_wait_s += time.perf_counter() - t0

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
        self._in_compute += 1
        try:
            if self.events:  # a run of spans: closed by what follows (module docstring)
                if self._run is None:
                    self._run = self._record()
                yield
                return
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.settle()  # the kernels start once the stream's waits are over
            mark, contended = self.emulator.start(), self.emulator.contended_s
            yield
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.busy_s += self.emulator.finish(mark)
            self.contention_s += self.emulator.contended_s - contended
        finally:
            self._in_compute -= 1

    @contextlib.contextmanager
    def optimizer_work(self) -> Iterator[None]:
        """Optimizer work on this rank's shard, stretched by the emulated slowdown: a slow
        device is slow at its optimizer step too, and the profiler measures that step under
        the same emulator (profiling/measure.py `measure_optimizer`). Not part of `busy_s`
        (unit compute only). On CUDA timed with events (`collect`); on the CPU without
        emulation the engine times the optimizer on the host."""
        if self.events:
            start = self._close_run()
            yield
            self._optimizer.append((start, self._record()))
            return
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

    def collect(self) -> StepTimes:
        """The step's sums. On CUDA the events are read now: after the step's one host read,
        everything recorded before it has completed, and the end event marked here is waited
        for as an event (not a device or stream sync: CUDA's sync debug mode allows it)."""
        if not self.events or self._start is None:
            return StepTimes(self.busy_s, self.comm_wait_s, None, None)
        end = self._close_run()
        end.synchronize()

        def total(events: _Events) -> float:
            return sum(a.elapsed_time(b) for a, b in events) / 1000.0

        self.busy_s += total(self._compute)
        times = StepTimes(
            self.busy_s,
            total(self._comm),
            total(self._optimizer),
            self._start.elapsed_time(end) / 1000.0,
        )
        for events in (self._compute, self._comm, self._optimizer):
            events.clear()
        self._start = None
        return times
