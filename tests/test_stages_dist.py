"""Pipeline stages at run time (issue 40): staged plans on emulated nodes with different rank
counts per stage (3 + 2, 2 + 1 + 2), uneven micro-batch splits re-partitioned at every boundary,
GPipe and 1F1B, weights kept gathered or gathered per micro-batch, a tied embedding split
between the first and the last stage: every step's loss and gradient norm and the final
parameters within the fp32 noise of one process (runtime/pipeline/)."""

from __future__ import annotations

import pytest
import torch

from cephalo.modeling.registry import build_model
from cephalo.planner.plan import Plan, RankPlan, Stage
from cephalo.runtime.collectives.comm import make_comm
from cephalo.runtime.engine.engine import Engine, EngineConfig
from cephalo.runtime.pipeline.schedule import peak_in_flight, stage_ops
from cephalo.runtime.pipeline.stage_step import sample_ranges
from cephalo.runtime.state.adamw import AdamWHyper
from dist_harness import dist_pool_fixture
from engine_common import LR, TEST_EPS, make_data, one_thread, reference_floor

__all__ = ["one_thread"]
pool5 = dist_pool_fixture(5, timeout_s=600)
STEPS = 6


def three_two_plan(schedule: str = "1f1b", keep: bool = True) -> Plan:
    """3 + 2 ranks: embedding and block 0 on ranks 0-2 (1 + 1 + 1 rows of each micro-batch),
    block 1 and the head on ranks 3-4 (2 + 1 rows): every boundary re-partitioned."""
    ranks = [
        RankPlan(0, "cpu", 4, 1, 4, 0.5),
        RankPlan(1, "cpu", 4, 1, 4, 0.2),
        RankPlan(2, "cpu", 4, 1, 4, 0.3),
        RankPlan(3, "cpu", 8, 2, 4, 0.35),
        RankPlan(4, "cpu", 4, 1, 4, 0.65),
    ]
    return Plan(
        "manual",
        "gpt-tiny",
        16,
        12,
        "fp32",
        ranks,
        stages=[Stage([0, 1, 2], [0, 1], keep), Stage([3, 4], [2, 3], keep)],
        schedule=schedule,
        num_micro_batches=4,
    )


def two_one_two_plan(schedule: str = "gpipe") -> Plan:
    """2 + 1 + 2 ranks: the embedding on ranks 0-1 (rank 1 holds state, no rows), block 0 on
    rank 2 gathered per micro-batch, block 1 and the head on ranks 3-4."""
    ranks = [
        RankPlan(0, "cpu", 8, 2, 4, 0.6),
        RankPlan(1, "cpu", 0, 1, 0, 0.4),
        RankPlan(2, "cpu", 8, 2, 4, 1.0),
        RankPlan(3, "cpu", 4, 1, 4, 0.45),
        RankPlan(4, "cpu", 4, 1, 4, 0.55),
    ]
    return Plan(
        "manual",
        "gpt-tiny",
        16,
        8,
        "fp32",
        ranks,
        stages=[Stage([0, 1], [0, 0]), Stage([2], [1, 1], False), Stage([3, 4], [2, 3])],
        schedule=schedule,
        num_micro_batches=4,
    )


def staged_slice(plan: Plan, rank: int, x: torch.Tensor) -> torch.Tensor:
    """Rank `rank`'s rows of a global batch: its runs, in micro-batch order."""
    runs = [x[a : a + n] for a, n in sample_ranges(plan, rank)]
    return torch.cat(runs) if runs else x[0:0]


def _run(plan, cfg, data, overrides):
    torch.set_num_threads(1)
    comm = make_comm("gloo")
    engine = Engine(build_model("gpt-tiny", **overrides), plan, comm, cfg)
    stats = [
        engine.train_step(staged_slice(plan, comm.rank, x), staged_slice(plan, comm.rank, y), lr=LR)
        for x, y in data
    ]
    x, y = data[0]
    val = engine.eval_loss(staged_slice(plan, comm.rank, x), staged_slice(plan, comm.rank, y))
    full = engine.full_state_dict()
    return {
        "params": full if comm.rank == 0 else None,
        "losses": [s.loss for s in stats],
        "norms": [s.grad_norm for s in stats],
        "val": val,
        "sent": engine.pipeline.exchange.bytes_sent,
    }


def _config() -> EngineConfig:
    return EngineConfig(grad_clip=0.5, adamw=AdamWHyper(eps=TEST_EPS, weight_decay=0.1))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("make", "schedule", "dropout"),
    [(three_two_plan, "1f1b", 0.1), (two_one_two_plan, "gpipe", 0.0)],
    ids=["3+2-1f1b", "2+1+2-gpipe"],
)
def test_staged_plan_matches_one_process(pool5, make, schedule, dropout):
    plan = make(schedule)
    cfg = _config()
    data = make_data(STEPS, plan.global_batch_size)
    results = pool5.run(_run, plan, cfg, data, {"dropout": dropout})
    floor = reference_floor("gpt-tiny", {"dropout": dropout}, data, cfg)
    floor.check("stages", params=results[0]["params"])
    for r in results:  # every rank reads the same step values, the last stage's loss
        floor.check("stages", losses=r["losses"], norms=r["norms"])
        assert r["losses"] == results[0]["losses"]
        assert r["val"] == results[0]["val"]


def test_schedules_hold_what_the_cost_model_charges():
    """1F1B: stage s of S holds min(M, S - s) micro-batches (`costmodel.stages.in_flight`),
    GPipe all M; each runs every micro-batch's forward and backward once, backwards in order."""
    from cephalo.costmodel.stages import in_flight

    for schedule in ("gpipe", "1f1b"):
        for S, M in ((2, 4), (3, 4), (3, 3), (4, 9)):
            for s in range(S):
                ops = stage_ops(schedule, s, S, M)
                assert sorted(ops) == sorted(
                    [("F", j) for j in range(M)] + [("B", j) for j in range(M)]
                )
                assert [j for k, j in ops if k == "B"] == list(range(M))
                assert peak_in_flight(ops) == in_flight(schedule, s, S, M)
