"""Where one rank's step time goes: compute, exposed communication, the optimizer, host work
(host-held state: its AdamW and copies), and the rest (the engine's own Python work and
anything else not inside those), from a `StepStats`.

Compute is `busy_s`: on CUDA the streams' kernel time of the units (events), so the rest is
the host time the GPU was not kept busy by; on a CPU the thread time of the unit passes
(their Python included), so the rest is the engine's bookkeeping between them. Communication
is, on a CPU, the host time blocked in collectives; on CUDA the compute stream's time stalled
in them and the optimizer the stream's time in its kernels (events: a NCCL wait only orders
streams, so host time would be ~0; runtime/engine/step_clock.py). On a CPU the parts are
disjoint host intervals; on CUDA disjoint parts of the stream's span of the step
(`device_step_s`), which ends in the step's one host read. The rest is never negative.
"""

from __future__ import annotations

PARTS = ("compute", "communication", "optimizer", "host", "other")
"""Names of the split, in order (`other`: the engine's Python work and the rest)."""


def split_step(stats) -> dict[str, float]:
    """Seconds per part of `PARTS` of one step (`StepStats`)."""
    parts = {
        "compute": stats.busy_s,
        "communication": stats.comm_wait_s,
        "optimizer": getattr(stats, "optimizer_s", 0.0),
        "host": stats.host_s,
    }
    parts["other"] = max(0.0, stats.step_s - sum(parts.values()))
    return parts


def format_split(parts: dict[str, float], step_s: float) -> str:
    """`compute 0.120 s (60%), communication ...` for a log line."""
    total = max(step_s, 1e-12)
    return ", ".join(f"{k} {parts[k]:.3f} s ({parts[k] / total:.0%})" for k in PARTS)
