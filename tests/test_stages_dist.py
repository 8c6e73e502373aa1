"""Pipeline stages at run time (issue 40): staged plans on emulated nodes with different rank
counts per stage (3 + 2, 2 + 1 + 2), uneven micro-batch splits re-partitioned at every boundary,
GPipe and 1F1B, weights kept gathered or gathered per micro-batch, a tied embedding split
between the first and the last stage: every step's loss and gradient norm and the final
parameters within the fp32 noise of one process (runtime/pipeline/)."""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch

from cephalo.modeling.registry import build_model
from cephalo.planner.plan import Plan, RankPlan, Stage
from cephalo.runtime.collectives.comm import make_comm
from cephalo.runtime.engine.engine import Engine, EngineConfig
from cephalo.runtime.pipeline.schedule import peak_in_flight, stage_ops
from cephalo.runtime.pipeline.stage_step import sample_ranges
from cephalo.runtime.state.adamw import AdamWHyper
from cephalo.specs.catalog.formulas import boundary_activation_bytes
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


def two_one_two_plan(schedule: str = "gpipe", last_keep: bool = True) -> Plan:
    """2 + 1 + 2 ranks: the embedding on ranks 0-1 (rank 1 holds state, no rows), block 0 on
    rank 2 gathered per micro-batch, block 1 and the head on ranks 3-4 (`last_keep` False:
    gathered per micro-batch too, the tied head's gradient accumulated across them)."""
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
        stages=[Stage([0, 1], [0, 0]), Stage([2], [1, 1], False), Stage([3, 4], [2, 3], last_keep)],
        schedule=schedule,
        num_micro_batches=4,
    )


def staged_slice(plan: Plan, rank: int, x: torch.Tensor) -> torch.Tensor:
    """Rank `rank`'s rows of a global batch: its runs, in micro-batch order."""
    return torch.cat([x[a : a + n] for a, n in sample_ranges(plan, rank)])


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
    ("make", "schedule", "dropout", "steps"),
    [
        (three_two_plan, "1f1b", 0.1, STEPS),
        (three_two_plan, "gpipe", 0.1, STEPS),
        (two_one_two_plan, "gpipe", 0.0, STEPS),
        (functools.partial(two_one_two_plan, last_keep=False), "1f1b", 0.0, STEPS),
        (three_two_plan, "1f1b", 0.1, 20),  # the 20 steps
    ],
    ids=["3+2-1f1b", "3+2-gpipe", "2+1+2-gpipe", "2+1+2-1f1b", "3+2-1f1b-20-steps"],
)
def test_staged_plan_matches_one_process(pool5, make, schedule, dropout, steps):
    plan = make(schedule)
    cfg = _config()
    data = make_data(steps, plan.global_batch_size)
    results = pool5.run(_run, plan, cfg, data, {"dropout": dropout})
    floor = reference_floor("gpt-tiny", {"dropout": dropout}, data, cfg)
    floor.check("stages", params=results[0]["params"])
    for r in results:  # every rank reads the same step values, the last stage's loss
        floor.check("stages", losses=r["losses"], norms=r["norms"])
        assert r["losses"] == results[0]["losses"]
        assert r["val"] == results[0]["val"]
    # every boundary crosses once per step each way (and once in the evaluation), the bytes
    # the cost model charges a crossing: B x the catalog's boundary bytes per sample
    per_sample = boundary_activation_bytes(build_model("gpt-tiny").spec, plan.seq_len, "fp32")
    crossings = len(plan.stages) - 1
    expect = crossings * (2 * steps + 1) * plan.global_batch_size * per_sample
    assert sum(r["sent"] for r in results) == expect


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


# ------------------------------------------------------------------ the trainer
def _job(run_dir, plan: str, steps: int, resume: str = "never"):
    from cephalo.train.config_manager import load_config

    return load_config(
        None,
        [
            f"--logging.dir={run_dir}",
            "--logging.progress=false",
            "--model.name=gpt-tiny",
            "--model.overrides",
            "dropout=0.1",
            "--model.dtype=fp32",
            "--data.seq_len=16",
            "--train.global_batch_size=12",
            f"--train.steps={steps}",
            "--train.warmup_steps=0",
            "--train.lr_schedule=constant",  # the same rate at a step whatever the run's length
            "--train.lr=1e-3",
            "--train.eps=1e-6",
            "--train.eval_every=2",
            "--train.eval_batches=1",
            f"--parallel.plan={plan}",
            "--checkpoint.every=2",
            f"--checkpoint.resume={resume}",
        ],
    )


def _train_on_rank(cfg, replan: str = ""):
    """The trainer on this rank (`replan`: the re-plan test hook, STEP:PLAN.json)."""
    import os

    from cephalo import envvars
    from cephalo.train.trainer import train

    os.environ[envvars.TEST_REPLAN] = replan
    try:
        result = train(cfg)
    finally:
        os.environ.pop(envvars.TEST_REPLAN, None)
    switched = [s["step"] for s in result.replans]
    return result.losses, result.val_losses, str(result.last_checkpoint), switched


@pytest.mark.slow
def test_staged_and_flat_runs_resume_and_switch_into_each_other(pool5, tmp_path):
    """The trainer, 6 steps in 3 jobs, each resuming the last one's checkpoint and switching
    plans once on the way (the re-plan's in-memory re-layout, train/replan.py): a staged plan
    (3 + 2, 1F1B) switching to a flat one, a checkpoint of the flat plan loaded by another
    staged plan (2 + 1 + 2, GPipe) switching to the first, its checkpoint loaded by the flat even
    plan switching to the second. Every checkpoint load and re-layout between staged and flat
    states, both ways: one trajectory, the one-process run's (losses, validation losses, final
    parameters)."""
    from safetensors.torch import load_file

    from cephalo.planner.makers import manual_plan
    from cephalo.train.export import export_checkpoint
    from trainer_reference import job_floor

    job = job_floor(_job(tmp_path / "one", "even", 6))
    first, second, flat = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "flat.json"
    three_two_plan("1f1b").to_json(first)
    plan = two_one_two_plan("gpipe")
    plan.global_batch_size = 12  # 3 rows per micro-batch: rank 2 takes 3, ranks 3 + 4 take 2 + 1
    plan.ranks[0] = RankPlan(0, "cpu", 12, 3, 4, 0.6)
    plan.ranks[2] = RankPlan(2, "cpu", 12, 3, 4, 1.0)
    plan.ranks[3] = RankPlan(3, "cpu", 8, 2, 4, 0.45)
    plan.to_json(second)
    manual_plan(
        "gpt-tiny", 16, [4, 1, 2, 3, 2], [2, 1, 2, 3, 1], [0.3, 0.1, 0.2, 0.2, 0.2]
    ).to_json(flat)
    legs = [(first, 2, f"1:{flat}"), (second, 4, f"3:{first}"), ("even", 6, f"5:{second}")]
    losses: dict[int, float] = {}
    val: dict[int, float] = {}
    ckpt = "never"
    for k, (which, steps, replan) in enumerate(legs):
        cfg = _job(tmp_path / f"leg{k}", str(which), steps, ckpt)
        per_rank = pool5.run(_train_on_rank, cfg, replan)
        assert all(r[0] == per_rank[0][0] for r in per_rank), "ranks disagree on the losses"
        leg_losses, leg_val, ckpt, switched = per_rank[0]
        assert sorted(leg_losses) == [steps - 1, steps]
        assert switched == [steps - 1], f"leg {k}: switched after steps {switched}"
        losses.update(leg_losses)
        val.update(leg_val)
    export_checkpoint(ckpt, out=tmp_path / "final.safetensors")
    final = load_file(str(tmp_path / "final.safetensors"))
    job.check("staged <-> flat, resumed and switched", losses, val, final)


# ------------------------------------------------------------------ bad input
def _engine_of(plans):
    torch.set_num_threads(1)
    comm = make_comm("gloo")
    Engine(build_model("gpt-tiny"), plans[comm.rank], comm, _config())


@pytest.mark.slow
def test_ranks_given_different_pipelines_stop_with_one_message(pool5):
    from dist_harness import RemoteError

    other = three_two_plan("gpipe")  # rank 4 was given another schedule
    plans = [three_two_plan("1f1b")] * 4 + [other]
    with pytest.raises(RemoteError, match="the ranks were given different pipelines") as err:
        pool5.run(_engine_of, plans)
    assert "Traceback" not in str(err.value).split("CephaloError")[-1]


def test_a_staged_plan_the_runtime_cannot_run_is_refused_before_the_job(tmp_path):
    """`cephalo run` / `train`'s preflight: a stage without units, too few micro-batches for
    the stages, and what a stage cannot run yet (host state; DPO), one message each."""
    from cephalo.errors import CephaloError
    from cephalo.train.config import preflight

    cases = []
    plan = three_two_plan()
    plan.stages[1].units = [2, 1]
    cases.append((plan.to_dict(), "is empty: a stage runs at least one unit"))
    plan = three_two_plan()
    plan.num_micro_batches = 1
    cases.append((plan.to_dict(), "1 micro-batches cannot fill a pipeline of 2"))
    plan = three_two_plan()
    plan.ranks[3].host_state_fraction = 0.5
    cases.append((plan.to_dict(), "cannot run with host state .* inside a stage yet.*--stages off"))
    for k, (d, message) in enumerate(cases):
        (tmp_path / f"{k}.json").write_text(json.dumps(d))
        cfg = _job(tmp_path / "run", str(tmp_path / f"{k}.json"), 2)
        with pytest.raises(CephaloError, match=message):
            preflight(cfg)
    three_two_plan().to_json(tmp_path / "ok.json")
    cfg = _job(tmp_path / "run", str(tmp_path / "ok.json"), 2)
    preflight(cfg)  # runs
    cfg.train.objective = "dpo"
    with pytest.raises(CephaloError, match="cannot run with the DPO objective inside a stage"):
        preflight(cfg)
    # stages made for another model (the plan knows no model's depth: the engine checks it
    # on every rank before any collective)
    from cephalo.runtime.pipeline.stage_step import check_runnable

    plan = three_two_plan()
    plan.stages[1].units = [2, 5]
    with pytest.raises(
        CephaloError, match="last stage ends at unit 5 but gpt-tiny's head is unit 3"
    ):
        check_runnable(plan, _config(), build_model("gpt-tiny"))


# ------------------------------------------------------------------ calibration and re-planning
def _drifting_staged_job(run_dir, steps: int):
    """The trainer job above, planned by cephalo (`parallel.plan = auto`, stages allowed) on 2
    emulated nodes over a 1 MB/s link (5 ranks: 2 + 3, node 1's a 2x slower type, so a
    stage of its own: the slow link's all-reduce makes the plan staged), calibrated every 2
    steps; node 1's ranks compute at 64x from step 2 on (`parallel.emulate_drift`: far past
    the slow link's all-reduce that a flat plan pays, so the gain is no near call on a loaded
    machine), so the change is seen on step 2, confirmed on 3-4, and the new plan runs steps
    5-6."""
    cfg = _job(run_dir, "auto", steps)
    p = cfg.parallel
    p.devices = "2xcpu@node0,3xcpu@node1:slowdown=2;inter=1MB/s"
    p.stages = "2"
    p.replan = "auto"
    p.calibrate_after = p.calibrate_every = 2
    p.emulate_drift = "2:2:64,2:3:64,2:4:64"
    pr = cfg.profile
    pr.repeats, pr.warmup, pr.time_cap_s, pr.max_micro_batch = 1, 0, 3.0, 4
    cfg.checkpoint.every = 0
    return cfg


def _staged_replan_on_rank(cfg):
    from pathlib import Path

    from cephalo.train.metrics import read_metrics
    from cephalo.train.trainer import train

    result = train(cfg)
    calibrations = read_metrics(Path(cfg.logging.dir) / "metrics.jsonl", kind="calibration")
    return result.losses, result.val_losses, result.replans, calibrations, result.plan.to_dict()


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("CEPHALO_TEST_TIMING") != "1",
    reason="timing-dependent (whether the measured throttle makes the re-plan clearly faster on a "
    "shared 2-core host: it failed once in four runs); run with CEPHALO_TEST_TIMING=1. The "
    "logic is covered deterministically by test_calibration's staged re-plan tests",
)
def test_a_staged_run_whose_stage_slows_replans_and_keeps_the_losses(pool5, tmp_path):
    """Issue 40: calibration and re-planning of a staged run. The automatic plan's stages, one
    of which is throttled mid-run: the staged steps are calibrated (that stage's device type
    seen slower, relative to the others), the re-plan is confirmed and switched to through
    the staged re-layout, and the run's losses are the one-process run's."""
    from trainer_reference import job_floor

    steps = 6
    cfg = _drifting_staged_job(tmp_path / "run", steps)
    per_rank = pool5.run(_staged_replan_on_rank, cfg)
    losses, val, replans, calibrations, final = per_rank[0]
    first, slow = calibrations[0], "cpu:slowdown=2"
    assert first["stages"] is not None, "the automatic plan has no stages: the test needs them"
    # the stage on node 1 seen throttled (a device type's scale: relative to the model before)
    assert any(c["compute_scale"][slow] > 2 * c["compute_scale"]["cpu"] for c in calibrations)
    assert len(replans) == 1 and replans[0]["step"] < steps, replans
    switched = next(c for c in calibrations if c["replanned"])
    assert switched["stages"] is not None and switched["predicted_gain"] >= 0.03
    new_stages = [[st["ranks"], list(st["units"])] for st in final.get("stages") or []] or None
    assert (new_stages, [r["batch_size"] for r in final["ranks"]]) != (
        first["stages"],
        first["batches"],
    ), "the re-plan switched to the plan it ran"
    assert all(r[0] == losses for r in per_rank), "ranks disagree on the losses"
    job = job_floor(_job(tmp_path / "one", "even", steps))
    job.check("a staged run re-planned", losses, val)


def test_an_emulated_crossing_takes_the_links_time():
    """On an emulated cluster a boundary reaches the next stage when the whole micro-batch's
    rows from the sender's node have crossed the `inter=` link, the next micro-batch's behind
    it (a FIFO per node pair): the receivers' streams wait until then."""
    import sys
    import time
    from pathlib import Path

    from cephalo.runtime.collectives.emulated import EmulatedLinks, EmulatedStream
    from cephalo.runtime.pipeline import exchange as ex

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from gpu_check_pipeline import _Loopback, _plan

    plan, rate, shape = _plan(3), 2e5, (16, 8)  # rank 0 -> ranks 1 (2 rows) and 2 (1 row)
    links = EmulatedLinks(rate, None, (0, 1, 1))
    streams = {r: EmulatedStream() for r in range(3)}
    sides = {
        r: ex.BoundaryExchange(
            plan, min(r, 1), r, shape, torch.float32, torch.device("cpu"), links, streams[r]
        )
        for r in range(3)
    }
    crossing = 3 * 16 * 8 * 4 / rate  # a micro-batch's 3 rows, fp32, over the link
    loop, real = _Loopback(torch.device("cpu")), ex.dist
    try:
        ex.dist = loop.namespace(0)
        t0 = time.perf_counter()
        for j in range(2):
            sides[0].send_activation(j, torch.ones(3, *shape))
        for j in range(2):
            for r, rows in ((1, 2), (2, 1)):
                ex.dist = loop.namespace(r)
                got = sides[r].recv_activation(j, rows)
                assert torch.equal(got, torch.ones(rows, *shape))
                waited = streams[r].ready_at - t0
                assert (j + 1) * crossing <= waited < (j + 1) * crossing + 0.5, (j, r, waited)
    finally:
        ex.dist = real
