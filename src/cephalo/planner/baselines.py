"""The planner's baselines from the same cost model: `even` (plain FSDP: equal batches, equal
shards) and `proportional` (batch proportional to each device's solo speed, equal shards)."""

from __future__ import annotations

import numpy as np

from cephalo.costmodel.model import CostModel
from cephalo.errors import PlanDoesNotFit
from cephalo.planner.choice import Choice
from cephalo.planner.does_not_fit import bytes_text
from cephalo.planner.plan import largest_remainder
from cephalo.planner.search.rank_tables import solo_speed


def even_batches(n: int, B: int) -> list[int]:
    return largest_remainder(B, [1.0] * n)


def proportional_batches(cm: CostModel, B: int) -> list[int]:
    """Batches proportional to each device's solo speed (samples/s of compute at an even share)."""
    n = len(cm.devices)
    ref = max(1, round(B / n))
    by_type = {k: solo_speed(cm, k, ref) for k in dict.fromkeys(d.type_key for d in cm.devices)}
    speeds = [by_type[d.type_key] for d in cm.devices]
    return largest_remainder(B, speeds)


def equal_shards(cm: CostModel, batches: list[int], allow_offload: bool, strategy: str) -> Choice:
    """Equal state fractions; per rank the fewest micro-batches that fit, offloading only if needed."""
    n = len(cm.devices)
    fraction = 1.0 / n
    state = float(cm.fraction_bytes(fraction))
    micro, off, short = [], [], {}
    for i, (d, b) in enumerate(zip(cm.devices, batches, strict=True)):
        cap = cm.capacity_bytes(i)
        chosen = None
        for o in [False, True] if allow_offload else [False]:
            if b == 0:
                ms = np.array([1])
            else:
                ks = np.arange(1, b + 1)
                ms = np.unique(-(-b // ks))[
                    ::-1
                ]  # largest micro-batch (fewest micro-batches) first
            mem = cm.memory_without_state(d.type_key, cap, b, ms, o) + state
            ok = np.nonzero(mem <= cap)[0]
            if ok.size:
                chosen = (int(ms[ok[0]]), o)
                break
        if chosen is None:
            least = float(cm.memory_without_state(d.type_key, cap, b, 1, allow_offload)) + state
            short[i] = int(least - cap)
            micro.append(1)
            off.append(allow_offload)
        else:
            micro.append(chosen[0])
            off.append(chosen[1])
    if short:
        per_rank = "; ".join(
            f"rank {i} ({cm.devices[i].type_key}, batch {batches[i]}) short {bytes_text(s)}"
            for i, s in short.items()
        )
        raise PlanDoesNotFit(
            f"the {strategy} plan does not fit even with micro-batch 1"
            f"{' and offloaded activations' if allow_offload else ''}: {per_rank}",
            short,
        )
    return Choice(batch=list(batches), micro=micro, offload=off, fraction=[fraction] * n)
