"""Host memory under a plan: the state a rank keeps on its node's host and its offloaded
boundary activations (the formula, `host_bytes`), the hosts as the cost model knows them
(`HostResources`) and the message naming the nodes whose memory is too small. The host time
formulas (copies, host AdamW) stay with the step time in `costmodel.py`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cephalo.errors import CephaloError
from cephalo.planner.plan import Plan
from cephalo.specs.catalog.devices import DTYPE_BYTES
from cephalo.specs.model import ModelSpec

HOST_STATE_BYTES_PER_PARAM = 16
"""A host-held parameter in host memory: fp32 master, gradient, two Adam moments (pinned on CUDA)."""


GiB = 1024**3
HOST_OS_RESERVE_BYTES = 2 * GiB
"""Host memory left to the OS beyond what it uses now (its page cache for the checkpoint's
writes and the data's reads, other daemons that grow): at least this, ..."""
HOST_OS_RESERVE_FRACTION = 0.05
"""... or this fraction of the node's physical memory, whichever is larger."""
HOST_RANK_RESERVE_BYTES = 2 * GiB
"""Host memory each rank of the node takes beyond its planned host state and offloaded
activations, as it grows after start-up: the CUDA context's host side and pinned staging
buffers, the allocator's caches, the data loader, the copy of its shard pieces a checkpoint
save stages, the tensors a re-plan's re-layout moves through."""


def host_budget(available: int, physical: int, local_ranks: int) -> int:
    """A node's host memory budget for what the planner puts there (host state, offloaded
    activations): what the kernel says is available now (`MemAvailable`, which excludes what the
    OS and the started ranks already use), less the OS's reserve and each local rank's
    (`HOST_OS_RESERVE_*`, `HOST_RANK_RESERVE_BYTES`); never below 0. Not its physical memory:
    a plan that fills that takes the OS's and the ranks' own memory too."""
    reserve = max(HOST_OS_RESERVE_BYTES, int(HOST_OS_RESERVE_FRACTION * physical))
    return max(0, int(available) - reserve - max(1, local_ranks) * HOST_RANK_RESERVE_BYTES)


def host_bytes(model: ModelSpec, seq_len: int, dtype: str, b, offload, host_part) -> np.ndarray:
    """Host memory of a rank taking b samples, with boundaries offloaded or not, and the part
    `host_part` x (= h * s) of the model's state on the host; broadcasts (see the module
    docstring)."""
    d = DTYPE_BYTES[dtype]
    per_param = HOST_STATE_BYTES_PER_PARAM + (0 if dtype == "fp32" else d)
    b = np.asarray(b, dtype=np.int64)
    held = np.where(
        np.asarray(offload, dtype=bool),
        (model.num_layers + 1) * b * seq_len * model.hidden_size * d,
        0,
    )
    return np.asarray(host_part) * model.total_params * per_param + held


def check_host_memory(
    plan: Plan, model: ModelSpec, node_of: list[int], memory_bytes: dict[int, int]
) -> None:
    """Raise `CephaloError` naming every node whose host memory is too small for what the
    plan's ranks put there (host state and offloaded activations)."""
    by_node: dict[int, tuple[int | None, list[tuple[int, int]]]] = {}
    for r, node in zip(plan.ranks, node_of, strict=True):
        x = r.state_fraction * r.host_state_fraction
        nbytes = host_bytes(model, plan.seq_len, plan.dtype, r.batch_size, r.offload_activations, x)
        by_node.setdefault(node, (memory_bytes[node], []))[1].append(
            (r.rank, int(math.ceil(float(nbytes))))
        )
    message = host_shortfall_message(by_node)
    if message:
        raise CephaloError(message)


@dataclass(frozen=True)
class HostResources:
    """What the cost model knows about the hosts of a cluster (`costmodel.sources` builds it from
    the cluster, the profiles and the catalog's defaults)."""

    node_of: tuple[int, ...]
    """Per rank: its node."""
    memory_bytes: dict[int, int]
    """Per node: host memory, shared by the node's ranks (host state + offloaded activations)."""
    optimizer_s_per_param: tuple[float, ...]
    """Per rank: host AdamW seconds per host-held parameter (the node's host shared by its ranks)."""

    def ranks_on(self, node: int) -> list[int]:
        return [i for i, n in enumerate(self.node_of) if n == node]


def host_shortfall_message(
    by_node: dict[int, tuple[int | None, list[tuple[int, int]]]],
) -> str | None:
    """The per-node message for nodes whose host memory (cap) is smaller than what their ranks
    (rank, bytes) put there, or None when every node holds it."""
    lines = []
    for node, (cap, ranks) in by_node.items():
        total = sum(n for _, n in ranks)
        if cap is None or total <= cap:
            continue
        parts = ", ".join(f"rank {r} {_gib(n)}" for r, n in ranks if n)
        lines.append(
            f"node {node} has {_gib(cap)} of host memory but the plan puts {_gib(total)} there "
            f"({parts}; short {_gib(total - cap)})"
        )
    if not lines:
        return None
    return (
        "; ".join(lines)
        + ": lower host_state_fraction (or offload fewer activations) on those ranks, give the "
        "node more host memory (`host_memory` in the cluster file), or plan again (`cephalo plan`)"
    )


def _gib(n: float) -> str:
    if abs(n) >= 0.01 * 1024**3:
        return f"{n / 1024**3:.2f} GiB"
    return f"{n / 1024**2:.1f} MiB"
