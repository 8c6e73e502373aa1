"""Device emulation on CPU: a CPU rank stands in for a slower device.

A slowdown factor f stretches compute: a piece of unit compute (or of the optimizer step)
is made to last f times its own work, by sleeping after it, so the rank looks f times
slower to the rest of the job (collectives and waits are not stretched: links are emulated
by the real transport). The profiler times the same pieces under the same emulator. The
memory side of emulation is the ledger's budget (`MemoryLedger(budget_bytes=...)`).

What "its own work" is. Where this thread's CPU time covers the whole piece (a CPU device
computing on one intra-op thread, which is what the local launcher gives each rank), the
target is f x that CPU time: co-located ranks share the host's cores, and a piece slowed by
them is not slowed again f times over; an emulated device is f times slower than the host
running the piece alone. The sleep fills the gap between the wall time the piece took and
that target (none if contention already made it longer). Elsewhere (CUDA, several intra-op
threads) the target is f x the wall time.

Copies are not compute. Inside a piece, a block under `unstretched()` (a host <-> device copy of
a device with an emulated link, `cpu:...,pcie=12GB/s`, `runtime.state.host_state.HostLink`) is left
out of the work that is stretched and counts once, as it took: the link emulation gives it its
own duration.

Contention. Where the CPU time is known, a piece that took longer in wall time than slowdown x
its CPU time lost the difference to other threads on the host's cores (co-located ranks, other
jobs): the emulator cannot give it back, so the emulated device was slower than its slowdown
says. That excess is counted (`contended_s`, the engine's `StepStats.contention_s`, the
profiler's `contention_share`) so a prediction error can be split into the device's work and
the host's sharing (docs/profiling.md, "Contention").
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from cephalo import envvars
from cephalo.errors import CephaloError
from cephalo.specs.drift import parse_drift, slowdown_at


def thread_cpu_measures_work(device: torch.device) -> bool:
    """Whether this thread's CPU time is the whole work of a compute piece on `device`: a
    CPU device computing on one intra-op thread."""
    return device.type == "cpu" and torch.get_num_threads() == 1


@dataclass
class ComputeEmulator:
    """Stretches compute pieces to `slowdown` times their own work."""

    slowdown: float = 1.0
    """1.0 = run at native speed; 3.0 = look three times slower."""
    use_cpu_time: bool = False
    """Measure a piece's own work by this thread's CPU time (see the module docstring);
    only where `thread_cpu_measures_work` holds."""
    stretched_s: float = 0.0
    """Total sleep added so far."""
    contended_s: float = 0.0
    """Total time so far by which pieces outlasted slowdown x their CPU time (plus their
    unstretched copies): the host's other threads held the core (module docstring); only
    where the CPU time is known (`use_cpu_time`, or `stretch` given `cpu_s`)."""
    _excluded: list[float] = field(default_factory=lambda: [0.0, 0.0], repr=False)
    """Wall and thread-CPU seconds of `unstretched()` blocks since the last `start`."""

    def __post_init__(self) -> None:
        if not self.slowdown >= 1.0:
            raise CephaloError(
                f"slowdown must be >= 1 (a CPU rank can only emulate a slower device), got {self.slowdown}"
            )

    def start(self) -> tuple[float, float]:
        """Mark the start of a piece (pass the mark to `finish`; pieces do not nest)."""
        self._excluded = [0.0, 0.0]
        return time.perf_counter(), time.thread_time() if self.use_cpu_time else 0.0

    def finish(self, mark: tuple[float, float]) -> float:
        """Stretch the piece started at `mark`; returns its emulated duration."""
        wall = time.perf_counter() - mark[0]
        cpu = time.thread_time() - mark[1] if self.use_cpu_time else None
        ex_wall, ex_cpu = self._excluded
        self._excluded = [0.0, 0.0]
        if ex_wall == 0.0:
            return self.stretch(wall, cpu)
        # the piece's own work without the excluded copies, stretched; the copies as they took
        work_wall = max(wall - ex_wall, 0.0)
        work_cpu = None if cpu is None else max(cpu - ex_cpu, 0.0)
        duration = max(wall, self.target(work_wall, work_cpu) + ex_wall)
        if work_cpu is not None:
            self._count_contention(duration, min(work_cpu, work_wall), ex_wall)
        extra = duration - wall
        if extra > 0:
            time.sleep(extra)
            self.stretched_s += extra
        return duration

    @contextlib.contextmanager
    def unstretched(self) -> Iterator[None]:
        """Leave this block out of the stretch of the piece it runs in (see the module docstring)."""
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self._excluded[0] += time.perf_counter() - w0
            self._excluded[1] += time.thread_time() - c0

    def target(self, wall_s: float, cpu_s: float | None = None) -> float:
        """The emulated duration of a piece that took `wall_s` (and `cpu_s` of this thread's
        CPU time, when that is its whole work), without sleeping."""
        work = wall_s if cpu_s is None else min(cpu_s, wall_s)
        return max(wall_s, self.slowdown * work)

    def stretch(self, wall_s: float, cpu_s: float | None = None) -> float:
        """Sleep so that a piece that took `wall_s` lasts `target(wall_s, cpu_s)`; returns
        that emulated duration."""
        duration = self.target(wall_s, cpu_s)
        if cpu_s is not None:
            self._count_contention(duration, min(cpu_s, wall_s))
        extra = duration - wall_s
        if extra > 0:
            time.sleep(extra)
            self.stretched_s += extra
        return duration

    def _count_contention(self, duration: float, work_cpu: float, copies_s: float = 0.0) -> None:
        """Add what a piece of `duration` took beyond slowdown x its CPU work (and its unstretched
        copies): time the emulated device lost to the host's other threads."""
        self.contended_s += max(0.0, duration - self.slowdown * work_cpu - copies_s)


def drifted_slowdown(step: int, rank: int, spec: str | None = None) -> float | None:
    """An emulated device whose speed changes during the run (specs/drift.py): the slowdown
    rank `rank` computes at in `step` under `spec` (the job's `parallel.emulate_drift`), else
    under `CEPHALO_EMULATE_DRIFT`; None: no drift for it (yet)."""
    if spec:
        return slowdown_at(parse_drift(spec), step, rank)
    env = os.environ.get(envvars.EMULATE_DRIFT)
    return slowdown_at(parse_drift(env, envvars.EMULATE_DRIFT), step, rank) if env else None


# ----------------------------------------------------------------------------- start-up
# A real cluster's ranks neither start together nor join in the spec's order: a node boots,
# imports and loads later than another, and c10d's rendezvous numbers the ranks as they
# arrive. Two emulator options make the local cluster do the same (docs/training.md,
# "Emulated clusters").


def parse_start_delay(spec: str | None, what: str = "parallel.emulate_start_delay") -> dict:
    """`RANK:SECONDS[,RANK:SECONDS...]` -> {rank: seconds}; None or empty: {}."""
    if not spec or not spec.strip():
        return {}
    out: dict[int, float] = {}
    for part in spec.split(","):
        rank, sep, seconds = part.strip().partition(":")
        try:
            r, s = int(rank), float(seconds)
        except ValueError:
            r, s = -1, -1.0
        if not sep or r < 0 or not s >= 0:
            raise CephaloError(
                f"{what}: {part.strip()!r} is not RANK:SECONDS (a rank >= 0 and seconds >= 0), "
                "e.g. `1:30` delays rank 1's start by 30 s"
            )
        out[r] = s
    return out


def start_delay_s(spec: str | None, rank: int) -> float:
    """How long emulated rank `rank` waits before it starts its job (`parallel.
    emulate_start_delay`): a node that comes up late."""
    return parse_start_delay(spec).get(rank, 0.0)


def parse_join_order(spec: str | None, what: str = "parallel.emulate_join_order") -> list | str:
    """`reverse`, or a permutation `P0,P1,...` (rank i takes the spec's device P_i); None: []."""
    if not spec or not spec.strip():
        return []
    if spec.strip() == "reverse":
        return "reverse"
    try:
        order = [int(x) for x in spec.split(",")]
    except ValueError:
        order = []
    if not order or sorted(order) != list(range(len(order))):
        raise CephaloError(
            f"{what} = {spec!r}: give `reverse` or a permutation of 0..N-1 (rank i takes the "
            "spec's device at position P_i, e.g. `1,0,2`)"
        )
    return order


def spec_position(spec: str | None, rank: int, world_size: int) -> int:
    """The position in the cluster spec of the device that rank `rank` emulates when the ranks
    join in the order `parallel.emulate_join_order` says (as c10d numbers them as they arrive);
    the identity without it."""
    order = parse_join_order(spec)
    if order == "reverse":
        return world_size - 1 - rank
    if not order:
        return rank
    if len(order) != world_size:
        raise CephaloError(
            f"parallel.emulate_join_order = {spec!r} orders {len(order)} ranks but the job has "
            f"{world_size}: give a permutation of 0..{world_size - 1}, or `reverse`"
        )
    return int(order[rank])
