"""The padded-even memory charge against the engine's ledger: 3 gloo ranks with the even
collectives forced on (`Comm.even_gather`, as on NCCL), a near-even split (3 x 0.36 = 1.08),
so every unit pads. Without the charge the cost model predicts less than the ledger's peak on
every rank; with it, at least the peak, and no more than the bound on the reduce-scatter
output that the unpadded prediction carries too (test_memory_prediction.py): u x the largest
unit x 4 bytes."""

from __future__ import annotations

import pytest

from cephalo.costmodel.sources import measured_cost_model
from cephalo.modeling.registry import build_model
from cephalo.profiling.profiler import profile_devices
from cephalo.profiling.settings import ProfileSettings
from cephalo.specs.cluster import Cluster
from dist_harness import dist_pool_fixture
from engine_common import one_thread
from test_memory_prediction import MODEL, SEQ, _plan, _second_step

__all__ = ["one_thread"]

pool3 = dist_pool_fixture(3, timeout_s=120)
# per rank: batch, micro-batch, offload, state fraction
NEAR_EVEN = [(8, 8, False, 0.36), (4, 2, False, 0.33), (2, 2, False, 0.31)]


def _ledger_peak(spec) -> tuple[int, bool]:
    from cephalo.runtime.collectives.comm import make_comm
    from cephalo.runtime.engine.engine import Engine, EngineConfig

    comm = make_comm("auto")
    comm.even_gather = True  # what NCCL does: the engine pads near-even splits
    plan = _plan(spec)
    engine = Engine(build_model(MODEL), plan, comm, EngineConfig(seed=0))
    stats = _second_step(engine, plan, comm.rank)
    return stats.peak_bytes, all(us.padded is not None for us in engine.shards)


@pytest.mark.slow
def test_padded_peak_is_predicted(pool3, one_thread):
    settings = ProfileSettings(repeats=1, warmup=0, max_micro_batch=8)
    measured = profile_devices(
        MODEL, SEQ, "fp32", Cluster.parse("cpu"), settings=settings, use_cache=False
    )
    spec, cluster = build_model(MODEL).spec, Cluster.parse("cpu,cpu,cpu")
    free = measured_cost_model(cluster, spec, SEQ, "fp32", measured)
    padded = measured_cost_model(cluster, spec, SEQ, "fp32", measured, padded_collectives=True)
    assert not free.padded_collectives  # CPUs: gloo, which pads nothing by default
    plan = _plan(NEAR_EVEN)
    u = max(plan.state_fractions)
    charged, uncharged = padded.evaluate(plan), free.evaluate(plan)
    for rank, (peak, all_padded) in enumerate(pool3.run(_ledger_peak, NEAR_EVEN)):
        assert all_padded
        with_charge = charged.ranks[rank].memory
        without = uncharged.ranks[rank].memory
        predicted = with_charge.total - with_charge.reserve
        print(f"rank {rank}: ledger {peak}, predicted {predicted}, uncharged "
              f"{without.total - without.reserve}")  # fmt: skip
        assert without.total - without.reserve < peak <= predicted
        # the slack: the reduce-scatter output's bound, and the head's straddling elements,
        # which the model bounds by its largest parameter (`straddle_params`; the engine copies
        # the one that straddles): the fused tail's head pass (costmodel/rules.py), the
        # peak here, holds the head computing
        slack = u * padded.reduce_out_bytes_per_fraction + padded.straddle_params["head"] * 4
        assert predicted - peak <= slack
