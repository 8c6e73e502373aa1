"""Stopping on a signal with a checkpoint: spot / preemptible instances and SLURM.

A preempted job gets SIGTERM (or SLURM's SIGUSR1) and a grace period; Ctrl-C sends SIGINT.
On the first of `checkpoint.save_on_signals`, `StopSignals` only records it. Ranks agree to
stop at a step boundary: each rank's flag travels in the step's existing all-gather of rank
statistics (`_Trainer._gather_rank_stats`: two more floats per rank, no collective of its
own), so every rank sees every rank's flag after the same step, saves a checkpoint at that
step and returns; `cephalo train` / `cephalo run` then exit 0 with one line (`stop_line`):
where it saved and the command that resumes. A signal that reaches one rank, or only the
launcher (which forwards it: launch/elastic.py), stops them all. A second signal exits at
once, without saving (exit code 128 + the signal's number).

`checkpoint.every_minutes` is decided the same way: rank 0's clock, in the same gather.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

SIGNAL_NAMES = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")
"""The signals `checkpoint.save_on_signals` may name."""


def signal_number(name: str) -> int:
    return int(getattr(signal, name))


class StopSignals:
    """The configured signals' handlers while a job runs (a context manager; main thread only,
    elsewhere it handles nothing). `received`: the first signal's name, or None."""

    def __init__(self, names: list[str] | tuple[str, ...]):
        self.names = [n for n in names if hasattr(signal, n)]
        self.received: str | None = None
        self.received_at: float | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            # the second signal: no save, now
            sys.stderr.write(f"cephalo: second {name}: exiting at once without saving\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        self.received, self.received_at = name, time.monotonic()

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for name in self.names:
            number = signal_number(name)
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)  # type: ignore[arg-type]
        self._previous.clear()


class TimedSaves:
    """`checkpoint.every_minutes` on rank 0's clock: due once that long has passed since the
    run started or last saved."""

    def __init__(self, minutes: float):
        self.period_s = minutes * 60.0
        self.since = time.monotonic()

    def due(self) -> bool:
        return self.period_s > 0 and time.monotonic() - self.since >= self.period_s

    def saved(self) -> None:
        self.since = time.monotonic()


def stop_note(signal_name: str, step: int, checkpoint: Path | None) -> str:
    """What a stopped job says (rank 0), without the resume command."""
    if checkpoint is None:
        return f"stopped by {signal_name} before the first step: nothing to save"
    return f"stopped by {signal_name} after step {step}: saved {checkpoint}"


def resume_command(argv: list[str] | None = None, resume: str = "auto") -> str:
    """The command that resumes: this one again (`checkpoint.resume = auto`, the default, loads
    the newest checkpoint), with `--checkpoint.resume=auto` added where it was set otherwise."""
    args = list(sys.argv[1:] if argv is None else argv)
    if resume != "auto":
        args = [a for a in args if not a.startswith("--checkpoint.resume")]
        args.append("--checkpoint.resume=auto")
    return "cephalo " + shlex.join(args)


def stop_line(note: str, resume: str = "auto", argv: list[str] | None = None) -> str:
    """The one line a stopped job prints: the note and the command that resumes."""
    if note.endswith("nothing to save"):
        return f"cephalo: {note}; run the same command to start"
    return f"cephalo: {note}; resume with: {resume_command(argv, resume)}"
