"""Why a model does not fit a cluster: the `PlanDoesNotFit` the planner raises, with what would fit.

Per rank the memory short at micro-batch 1 and equal shards, what offloading or host state
would change, the largest global batch that fits (memory only) and, where none does, how many
more devices it would take.
"""

from __future__ import annotations

import math
from dataclasses import replace

from cephalo.costmodel.model import CostModel
from cephalo.errors import PlanDoesNotFit
from cephalo.planner.search.batch_split import fits_at_all
from cephalo.planner.search.rank_tables import MEMORY_SLACK_BYTES, SearchRegime, rank_groups

GIB = 1024**3


def bytes_text(n: float) -> str:
    """Bytes as GiB for people (MiB / bytes when tiny, as in emulated or synthetic clusters)."""
    if abs(n) >= 0.01 * GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= 1024**2:
        return f"{n / 1024**2:.1f} MiB"
    return f"{n:.0f} B"


def _memory_only_fits(cm: CostModel, B: int, allowed: SearchRegime) -> bool:
    return fits_at_all(cm, rank_groups(cm, allowed), B, allowed) is not None


def does_not_fit(cm: CostModel, B: int, allowed: SearchRegime) -> PlanDoesNotFit:
    allow_offload = allowed.offload
    n = len(cm.devices)
    P = cm.total_params
    state_total = cm.layout.state_bytes
    # what the shards need in all: the state and the reduce-scatter output that grows with it
    sharded_total = cm.bytes_per_fraction
    even_state = sharded_total / n
    lines, short = [], {}
    leftover_total = 0.0
    for i, d in enumerate(cm.devices):
        cap = cm.capacity_bytes(i)
        b = 1 if B >= 1 else 0
        least = float(cm.memory_without_state(d.type_key, cap, b, 1, allow_offload))
        idle = float(cm.memory_without_state(d.type_key, cap, 0, 1, False))
        leftover_total += max(0.0, cap - idle)
        need = least + even_state
        if need > cap:
            short[i] = int(need - cap)
            lines.append(
                f"rank {i} ({d.type_key}) needs {bytes_text(need)} of {bytes_text(cap)} (short {bytes_text(need - cap)})"
            )
    msg = [
        f"{cm.model.name} does not fit on this cluster: its training state alone is "
        + (
            f"{bytes_text(state_total)} (16 bytes x {P:,} parameters)"
            if not cm.adapter.frozen_base
            else f"{bytes_text(state_total)} ({cm.adapter.describe()}: the {P:,}-parameter base "
            f"{bytes_text(cm.layout.frozen_bytes)}, 16 bytes x {cm.optimizer_params:,} adapter parameters)"
        )
    ]
    if lines:
        msg.append(
            "with micro-batch 1"
            + (", offloaded activations" if allow_offload else "")
            + " and equal shards: "
            + "; ".join(lines)
        )
    missing = sharded_total - leftover_total
    if missing > 0:
        msg.append(
            f"after buffers the devices have {bytes_text(leftover_total)} left for it, {bytes_text(missing)} too little"
        )
    if not allow_offload and _memory_only_fits(cm, B, replace(allowed, offload=True)):
        msg.append("offloading activations to the host would fit (allow offload)")
    if cm.host is not None:
        if allowed.host:
            hosts = ", ".join(
                f"node {n}: {bytes_text(m)}" for n, m in sorted(cm.host.memory_bytes.items())
            )
            msg.append(
                f"even with training state in host memory ({hosts}, shared by each node's ranks; "
                f"{cm.host_bytes_per_param} bytes per host-held parameter)"
            )
        elif _memory_only_fits(cm, B, replace(allowed, host=True)):
            msg.append("keeping part of the training state in host memory would fit")
    # the largest global batch that fits (memory only)
    lo, hi = 0, B - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _memory_only_fits(cm, mid, allowed):
            lo = mid
        else:
            hi = mid - 1
    if lo >= 1:
        msg.append(f"the largest global batch that fits is {lo}")
    else:
        smallest = min(range(n), key=lambda i: cm.capacity_bytes(i))
        d = cm.devices[smallest]
        cap = cm.capacity_bytes(smallest)
        per_device = (
            cap - float(cm.memory_without_state(d.type_key, cap, 0, 1, False)) - MEMORY_SLACK_BYTES
        )
        if missing > 0 and per_device > 0:
            more = math.ceil(missing / per_device)
            msg.append(
                f"no smaller batch helps: add about {more} more {d.type_key} "
                f"({bytes_text(cap)} each), or {bytes_text(missing)} more device memory in total, "
                "or train a smaller model"
            )
        else:
            msg.append(
                "no smaller batch helps: add devices with more memory, shorten the sequence, "
                "or train a smaller model"
            )
    return PlanDoesNotFit("; ".join(msg), short)
