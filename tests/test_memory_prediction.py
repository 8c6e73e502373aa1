"""The cost model's peak memory against the engine's ledger, on 3 gloo ranks and uneven plans.

The cost model predicts the device peak as the largest of a step's moments (costmodel.py
`_phases`), by category; the ledger records its own peak and what each category held then.
Activation curves come from profiling gpt-tiny in this process (the engine's own pieces).

Where they differ, and why: at each moment the model counts the reduce-scatter output in
flight as s x (the largest unit) x 4 bytes (an upper bound that keeps memory linear in the
state fraction s for the planner), the engine holds this rank's real piece of the unit
being reduced (none during the head's backward and at the end of the forward); and the
model's state is s x P x 16, the engine's the shards' whole elements. With the real piece
and the real state put into the model's moments, the model gives the ledger's peak and
its breakdown to the byte; the planner's prediction exceeds the ledger's peak by exactly
what the bound adds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cephalo.costmodel.sources import measured_cost_model
from cephalo.modeling.registry import build_model
from cephalo.planner.makers import manual_plan
from cephalo.planner.plan import Plan
from cephalo.profiling.profiler import profile_devices
from cephalo.profiling.settings import ProfileSettings
from cephalo.specs.cluster import Cluster
from dist_harness import dist_pool_fixture
from engine_common import one_thread, rank_slice

__all__ = ["one_thread"]

MODEL, SEQ = "gpt-tiny", 32
pool3 = dist_pool_fixture(3, timeout_s=120)

# per rank: batch, micro-batch, offload, state fraction
PLANS = {
    "uneven": [(8, 8, False, 0.2), (4, 2, False, 0.5), (2, 2, False, 0.3)],
    "offload": [(8, 4, True, 0.3), (4, 4, False, 0.0), (2, 1, False, 0.7)],
    # 10 in micro-batches of 4: a smaller last one (2)
    "idle rank": [(10, 4, False, 0.3), (4, 4, False, 0.7), (0, 1, False, 0.0)],
}
"""Micro-batches the profile measured (1, 2, 4, 8): between them its curves interpolate, which
is exact for the blocks' activations (affine in the micro-batch) but not for the head's."""


def _plan(spec: list[tuple[int, int, bool, float]]) -> Plan:
    batches, micros, offloads, fractions = zip(*spec, strict=True)
    return manual_plan(MODEL, SEQ, batches, micros, fractions, offload=list(offloads))


def _second_step(engine, plan: Plan, rank: int):
    """The stats of the second of two steps on this rank's slice of a fixed batch (its peak:
    nothing left over from start-up)."""
    x = torch.randint(
        0, 256, (plan.global_batch_size, SEQ), generator=torch.Generator().manual_seed(0)
    )
    mine = rank_slice(plan, rank, x)
    for _ in range(2):
        stats = engine.train_step(mine, torch.roll(mine, -1, dims=1), 1e-4)
    return stats


def _ledger_peaks(spec):
    from cephalo.runtime.collectives.comm import make_comm
    from cephalo.runtime.engine.engine import Engine, EngineConfig

    comm = make_comm("auto")
    plan = _plan(spec)
    engine = Engine(build_model(MODEL), plan, comm, EngineConfig(seed=0))
    stats = _second_step(engine, plan, comm.rank)
    # per unit, the fp32 bytes this rank receives from the reduce-scatters started after the
    # unit's backward (its own shard of the gradient, and its piece of any tied parameter)
    in_flight = [
        4 * (us.grad.numel() + sum(b.local[1] - b.local[0] for b in us.borrows))
        for us in engine.shards
    ]
    return stats.peak_bytes, engine.ledger.at_peak_by_category, in_flight


def _as_model_categories(at_peak: dict[str, int]) -> dict[str, int]:
    """The ledger's categories under the cost model's names (MemoryBreakdown's docstring):
    its `grad_transient` is part of the model's `activations`, its `staging` the model's
    `boundary`; categories that held nothing are left out."""
    out = dict(at_peak)
    out["activations"] = out.get("activations", 0) + out.pop("grad_transient", 0)
    out["boundary"] = out.get("boundary", 0) + out.pop("staging", 0)
    return {c: b for c, b in out.items() if b}


def _fold_logits(by_category: dict[str, int]) -> dict[str, int]:
    """The model's `logits` (the head's pass) under `activations`, as the ledger charges them
    (it has no category of its own for them; the fused tail's head pass holds both)."""
    out = dict(by_category)
    if "logits" in out:
        out["activations"] = out.get("activations", 0) + out.pop("logits")
    return out


def _moments(cost_model, spec, in_flight: list[int] | None) -> list[dict[str, int]]:
    """The cost model's candidate peak moments of one rank by category (whole bytes), without
    the state, and without the reduce-scatter output unless `in_flight` gives it (per unit:
    the bytes received from the reduce-scatters started after its backward). Moment order: costmodel `_phases` (backward of
    the head, the last block, the block before it and the embedding; end of the forward; the
    fused tail's head pass, with no reduce-scatter started yet, and its last block backward,
    with the head's in flight: a fused rank has only these two of the head's and the last
    block's moments, an unfused rank only the others)."""
    batch, micro, offload, _ = spec
    phases = cost_model._phases("cpu", np.asarray(batch), np.asarray(micro), np.asarray(offload))
    layers = cost_model.model.num_layers
    units = sorted({layers + 1, layers, max(layers - 1, 1), 0}, reverse=True)
    tail = 2 if cost_model.fused_tail_possible else 0
    assert len(phases) == len(units) + 1 + tail, "costmodel._phases changed: update this test"
    reducing = [u + 1 if u + 1 <= layers + 1 else None for u in units] + [None]
    reducing += [None, layers + 1] if tail else []
    moments = []
    for phase, after in zip(phases, reducing, strict=True):
        moment = _fold_logits({c: int(math.ceil(float(v))) for c, v in phase.items()})
        if in_flight is not None and after is not None:
            moment["grad_accum"] = moment.get("grad_accum", 0) + in_flight[after]
        moments.append({c: b for c, b in moment.items() if b})
    return moments


@pytest.fixture(scope="module")
def cost_model(one_thread):
    settings = ProfileSettings(repeats=1, warmup=0, max_micro_batch=8)
    measured = profile_devices(
        MODEL, SEQ, "fp32", Cluster.parse("cpu"), settings=settings, use_cache=False
    )
    spec = build_model(MODEL).spec
    return measured_cost_model(Cluster.parse("cpu,cpu,cpu"), spec, SEQ, "fp32", measured)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_predicted_peak_matches_the_ledger(pool3, cost_model, name):
    results = pool3.run(_ledger_peaks, PLANS[name])
    evaluation = cost_model.evaluate(_plan(PLANS[name]))
    units = cost_model.model.num_layers + 2
    for rank, (peak, at_peak, in_flight) in enumerate(results):
        spec, predicted = PLANS[name][rank], evaluation.ranks[rank].memory
        ledger = _as_model_categories(at_peak)
        print(f"{name} rank {rank}: ledger {peak} B {ledger}; predicted {predicted.to_dict()}")
        assert sum(ledger.values()) == peak
        # the state: s x P x 16 against whole elements per unit (largest-remainder rounding,
        # under one element of 16 bytes per unit)
        assert abs(predicted.state - ledger.get("state", 0)) < 16 * units, (rank, predicted)

        # 1. the model's moments with this rank's real reduce-scatter piece and state: the
        #    largest is the ledger's peak, category by category, to the byte
        real = _moments(cost_model, spec, in_flight)
        for moment in real:
            if ledger.get("state"):
                moment["state"] = ledger["state"]
        at = max(real, key=lambda m: sum(m.values()))
        assert at == ledger, (rank, at, ledger)

        # 2. the planner's prediction is the same moments with the bound s x largest unit x 4
        #    in every one (and s x P x 16 of state): it exceeds the ledger's peak by what the
        #    bound adds over the real piece, nothing else
        bound = spec[3] * cost_model.reduce_out_bytes_per_fraction
        bounded = _moments(cost_model, spec, None)
        worst = max(range(len(bounded)), key=lambda i: sum(bounded[i].values()))
        chosen = dict(bounded[worst])
        chosen["grad_accum"] = int(math.ceil(chosen.get("grad_accum", 0) + bound))
        chosen["state"] = predicted.state
        by_category = _fold_logits(
            {c: b for c, b in predicted.to_dict().items() if b and c != "reserve"}
        )
        assert by_category == {c: b for c, b in chosen.items() if b}, (rank, predicted, chosen)
        excess = (predicted.total - predicted.reserve) - peak
        bound_adds = sum(chosen.values()) - sum(at.values())
        assert excess == bound_adds, (rank, excess, bound_adds)
        # what that is worth: at most the bound (the real piece is never negative)
        assert 0 <= excess <= bound + 16 * units, (rank, excess, bound)
