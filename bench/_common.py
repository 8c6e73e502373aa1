"""Shared pieces of the benchmark scripts: the gloo process pool, timing helpers, and the
writer of `bench/results/<name>.md` / `.png`.

Benchmarks measure; tests check. Every number a bench writes is taken in ONE run on the
machine it ran on, and the figures that matter are RATIOS of two things measured side by
side in that run (absolute seconds on a shared 2-core CPU box mean little). Emulated
results (CPU ranks standing in for slower GPUs) say so in their header.

The scripts run as `python bench/<name>.py` (so this module imports as `_common`); spawned
workers inherit `sys.path` and find it the same way.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cephalo.launch.pool import RankFailure
from cephalo.launch.pool import RankPool as _RankPool

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
REPO_ROOT = BENCH_DIR.parent
SUMMARY_BEGIN = "<!-- summary -->"
SUMMARY_END = "<!-- /summary -->"
"""Markers around the part of a result file that `run_all.py` copies into docs/benchmarks.md."""


BENCH_NICE = int(os.environ.get("CEPHALO_BENCH_NICE", "-10"))
"""Scheduling niceness of the bench processes: ahead of other jobs on a shared machine, so
that their load disturbs the timings less (needs the privilege to lower niceness)."""


def raise_priority(nice: int = BENCH_NICE) -> int:
    """Set this process's niceness (children inherit it); returns the niceness in effect."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    return os.getpriority(os.PRIO_PROCESS, 0)


BenchError = RankFailure
"""A benchmark could not run (a rank raised, died or hung)."""


def RankPool(world_size: int, timeout_s: float = 300.0, threads: int = 1) -> _RankPool:  # noqa: N802
    """The package's local gloo pool (`cephalo.launch.pool`), its ranks at the benches'
    priority (`BENCH_NICE`) with one intra-op thread each by default: N ranks on a 2-core
    machine would otherwise fight over the cores and every timing would measure that."""
    return _RankPool(world_size, timeout_s=timeout_s, threads=threads, nice=BENCH_NICE)


# ====================================================================== measuring
def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def alternate(runs: int, variants: Sequence[str]) -> list[str]:
    """A B A B ... order (rotated each round) so slow drifts of the machine hit every variant alike."""
    order = []
    for i in range(runs):
        shift = i % len(variants)
        order.extend(list(variants[shift:]) + list(variants[:shift]))
    return order


# ====================================================================== results
@dataclass
class Result:
    """One bench's result file: header, summary (copied into docs/benchmarks.md), details."""

    name: str
    """File stem under bench/results/ (the script's name)."""
    title: str
    emulated: str | None = None
    """None for real measurements; else what is emulated (printed in the header)."""
    predicted: str | None = None
    """For results that are predictions, not measurements: where they come from."""
    summary: list[str] = field(default_factory=list)
    """Markdown blocks: the key table and the targets met / missed."""
    details: list[str] = field(default_factory=list)
    """Markdown blocks after the summary: method, per-run tables."""
    figures: list[str] = field(default_factory=list)
    """PNG file names (in bench/results/) shown in the file."""

    def write(self, wall_s: float | None = None) -> Path:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        lines = [f"# {self.title}", "", environment_line(wall_s), ""]
        if self.emulated:
            lines += [f"> **Emulated.** {self.emulated}", ""]
        if self.predicted:
            lines += [f"> **Predicted, not measured.** {self.predicted}", ""]
        lines += [SUMMARY_BEGIN, ""]
        for block in self.summary:
            lines += [block.rstrip(), ""]
        lines += [SUMMARY_END, ""]
        for fig in self.figures:
            lines += [f"![{fig}]({fig})", ""]
        for block in self.details:
            lines += [block.rstrip(), ""]
        path = RESULTS_DIR / f"{self.name}.md"
        path.write_text("\n".join(lines).rstrip() + "\n")
        return path


def environment_line(wall_s: float | None = None) -> str:
    """Date, torch, machine, load: the provenance line every result file starts with."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    cpu = _cpu_model()
    took = f"; the bench took {wall_s:.0f} s" if wall_s is not None else ""
    load = ""
    with contextlib.suppress(OSError):
        load = f"; load average {os.getloadavg()[1]:.1f} (5 min) at the end, niceness {os.getpriority(os.PRIO_PROCESS, 0)}"
    return (
        f"_Run {now}; torch {torch.__version__}, Python {platform.python_version()}; "
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores ({cpu}), "
        f"no GPU{took}{load}. Re-run: `python bench/{Path(sys.argv[0]).name}`._"
    )


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def markdown_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None
) -> str:
    """A GitHub markdown table; `align` is one of l/r/c per column (default: first left, rest right)."""
    align = align or ("l" + "r" * (len(headers) - 1))
    rule = {"l": ":---", "r": "---:", "c": ":---:"}
    out = ["| " + " | ".join(headers) + " |", "| " + " | ".join(rule[a] for a in align) + " |"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """The same table on the console (rich)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for h in headers:
        table.add_column(str(h))
    for row in rows:
        table.add_row(*[str(c) for c in row])
    Console(width=max(120, Console().width)).print(table)


def save_figure(fig: Any, name: str, note: str | None = None) -> str:
    """Save a matplotlib figure as bench/results/<name>.png with the provenance as a footer."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    footer = f"{now} · torch {torch.__version__} · {os.cpu_count()}-core CPU" + (
        f" · {note}" if note else ""
    )
    fig.text(0.99, -0.02, footer, ha="right", va="bottom", fontsize=7, color="0.4")
    path = RESULTS_DIR / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name


def fmt_ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "—"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**missed**"
