"""Pipeline stages, the planning half (issue 40): plan format 3, the cost model's stages
(costmodel/stages.py), the exact cut DP and the search (planner/stages/), the CLI, and the
runtime's refusal. Pure Python, a 6-block model where the search is exhaustive."""

import dataclasses
import itertools
import json
import re

import pytest

from cephalo import CephaloError, Plan, RankPlan
from cephalo.cli import main
from cephalo.costmodel.sources import catalog_cost_model
from cephalo.costmodel.stages import in_flight, pipeline_step_s
from cephalo.planner.plan import Stage
from cephalo.planner.stages.search import (
    best_staged_plan,
    formations,
    make_staged_plan,
    micro_split,
    parse_stages,
    plan_formation,
)
from cephalo.specs.catalog.models import get_model_spec
from cephalo.specs.cluster import Cluster
from cephalo.train.config import JobConfig, ParallelConfig, preflight

SMALL = "2xl4@node0,a6000@node1,2xt4@node2;inter=1GB/s"


@pytest.fixture(scope="module")
def small_cm():
    """gpt-2.7b's units (published profiles), 6 blocks: 8 units, every cut enumerable."""
    spec = dataclasses.replace(get_model_spec("gpt-2.7b"), num_layers=6)
    return catalog_cost_model(Cluster.parse(SMALL), spec, 512, "fp16")


def _staged_plan() -> Plan:
    ranks = [
        RankPlan(0, "cpu", 4, 1, 4, 0.5),
        RankPlan(1, "cpu", 4, 1, 4, 0.5),
        RankPlan(2, "cpu", 8, 2, 4, 1.0),
    ]
    return Plan(
        "manual",
        "gpt-tiny",
        16,
        8,
        "fp32",
        ranks,
        stages=[Stage([0, 1], [0, 2]), Stage([2], [3, 5], keep_gathered=False)],
        schedule="1f1b",
        num_micro_batches=4,
    )


# ------------------------------------------------------------------ plan format
def test_staged_plan_round_trips_and_old_plans_load_as_one_stage():
    p = _staged_plan()
    q = Plan.from_json(p.to_json())
    assert q == p and q.version == 3 and q.staged and not q.hierarchical
    assert q.replica_groups() == [[0, 1], [2]]
    assert q.micro_batch_slices(0) == [(0, 0, 1), (1, 1, 1)]
    assert q.micro_batch_slices(1) == [(2, 0, 2)]
    old = json.loads(p.to_json())
    for key in ("stages", "schedule", "num_micro_batches"):
        old.pop(key)
    old.update(version=2)
    for r, (b, f) in zip(old["ranks"], [(2, 0.25), (2, 0.25), (4, 0.5)], strict=True):
        r.update(batch_size=b, micro_batch_size=b, num_micro_batches=1, state_fraction=f)
    flat = Plan.from_dict(old)
    assert flat.stages is None and not flat.staged and flat.replica_groups() == [[0, 1, 2]]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["stages"][1].update(units=[3, 2]), "is empty: a stage runs at least one unit"),
        (lambda d: d["stages"][1].update(units=[4, 5]), "starts at unit 4 but the previous"),
        (lambda d: d.update(schedule="zb"), "needs 'schedule', one of gpipe, 1f1b"),
        (lambda d: d.update(schedule=None), "needs 'schedule'"),
        (lambda d: d.update(num_micro_batches=3), "does not divide global_batch_size 8"),
        (lambda d: d.update(num_micro_batches=1), "1 micro-batches cannot fill a pipeline of 2"),
        (lambda d: d["ranks"][2].update(micro_batch_size=1, batch_size=4), "must sum to"),
        (lambda d: d["stages"][0].update(ranks=[0]), "exactly once"),
        (lambda d: d["ranks"][0].update(state_fraction=0.4), "of stage 0 (ranks [0, 1])"),
        (lambda d: d["stages"][0].update(units=[0]), "'units' must be [first, last]"),
        (
            lambda d: d.update(shard_groups=[{"ranks": [0, 1]}, {"ranks": [2]}]),
            "either 'stages' or several 'shard_groups'",
        ),
        (lambda d: d.update(version=4), "reads versions 1, 2, 3"),
    ],
)
def test_bad_stages_are_named(mutate, message):
    d = json.loads(_staged_plan().to_json())
    mutate(d)
    with pytest.raises(CephaloError, match=re.escape(message)):
        Plan.from_dict(d)


# ------------------------------------------------------------------ the cost model
def test_the_bubble_is_the_textbook_one():
    """Equal stages, free links and no per-step work: GPipe's (M + S - 1) t, a bubble of
    (S - 1) / M of the steady state; a link slower than every stage sets the pace instead."""
    for S, M, t in [(2, 4, 1.0), (3, 16, 0.25), (4, 4, 2.0)]:
        step = pipeline_step_s([t] * S, [0.0] * S, [0.0] * (S - 1), M)
        assert step == pytest.approx((M + S - 1) * t)
        assert step / (M * t) - 1 == pytest.approx((S - 1) / M)
    assert pipeline_step_s([1.0, 1.0], [0.0, 0.5], [3.0], 4) == pytest.approx(2 + 6 + 9 + 0.5)
    assert [in_flight("1f1b", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", s, 4, 2) for s in range(4)] == [2, 2, 2, 1]
    assert in_flight("gpipe", 3, 4, 8) == 8


def test_tied_embeddings_across_stages_cost_one_exchange(small_cm):
    """The head's fp32 gradient of a tied matrix to stage 0 and its weights back: vocab x
    hidden x (4 + 2) bytes over the link between them, once per step; nothing untied."""
    assert small_cm.tied_exchange_s([0, 1], [3, 4]) == 0.0
    spec = dataclasses.replace(small_cm.model, tied_embeddings=True)
    tied = catalog_cost_model(Cluster.parse(SMALL), spec, 512, "fp16")
    nbytes = spec.vocab_size * spec.hidden_size * 6
    assert tied.tied_exchange_s([0, 1], [3, 4]) == pytest.approx(nbytes / 1e9, rel=1e-3)
    plan = plan_formation(tied, 8, [[0, 1], [2], [3, 4]], 4, "1f1b")
    assert plan is not None and tied.evaluate(plan).step_s == pytest.approx(plan.predicted.step_s)


def test_a_stage_computes_what_the_flat_model_computes(small_cm):
    """A one-rank stage keeping its weights gathered runs each micro-batch's forward, recompute
    and backward of its units: its compute is the flat cost model's for that rank at that
    batch (no collectives on one rank), M times."""
    cm = small_cm
    plan = plan_formation(cm, 8, [[0, 1], [2], [3, 4]], 4, "1f1b")
    assert plan is not None and plan.stages is not None
    ev = cm.evaluate(plan)
    solo = plan.stages[1]  # the a6000 alone, in the middle: some blocks only
    assert solo.ranks == [2] and 0 < solo.units[0] <= solo.units[1] < cm.num_units - 1
    r = plan.ranks[2]
    flat = cm.rank_cost(2, r.micro_batch_size, r.micro_batch_size, 1.0, fuse_tail=False)
    kinds = cm.unit_kinds()[solo.units[0] : solo.units[1] + 1]
    passes = cm._pass_times("a6000", r.micro_batch_size, r.micro_batch_size)
    mine = sum(float(passes[k][0] + passes[k][1]) for k in kinds)
    assert ev.ranks[2].compute_s == pytest.approx(4 * mine, rel=1e-9)
    every = sum(float(passes[k][0] + passes[k][1]) * cm.unit_counts[k] for k in passes)
    assert flat.compute_s == pytest.approx(every, rel=1e-9)  # the flat model's, same passes


def test_gpipe_holds_all_micro_batches_1f1b_only_what_is_in_flight(small_cm):
    cm = small_cm
    plan = plan_formation(cm, 16, [[0, 1], [2], [3, 4]], 8, "1f1b")
    assert plan is not None and plan.stages is not None
    one = cm.evaluate(plan)
    gp = dataclasses.replace(plan, schedule="gpipe")
    two = cm.evaluate(gp)
    assert two.step_s == pytest.approx(one.step_s)  # the same time, the memory differs
    first = plan.stages[0]
    a, b = first.units
    r = first.ranks[0]
    m = plan.ranks[r].micro_batch_size
    extra = (8 - 3) * (b - a + 1) * m * cm.sample_boundary_bytes
    assert two.ranks[r].memory.boundary - one.ranks[r].memory.boundary == pytest.approx(
        extra, abs=2
    )


def test_cut_dp_is_exact_against_every_cut(small_cm):
    """The DP's step equals the least over every cut of the plan evaluated by the cost model
    (each cut with the rule's fractions and gathering for that range)."""
    cm = small_cm
    U = cm.num_units
    for groups, M, B in [
        ([[0, 1], [2], [3, 4]], 4, 8),
        ([[2], [0, 1, 3, 4]], 2, 8),
        ([[3, 4], [0, 1], [2]], 3, 6),
    ]:
        S = len(groups)
        best = plan_formation(cm, B, groups, M, "1f1b")
        assert best is not None
        steps = []
        for cut in itertools.combinations(range(1, U), S - 1):
            edges = (0, *cut, U)
            stages, ranks = [], [None] * len(cm.devices)
            for pos, g in enumerate(groups):
                a, b = edges[pos], edges[pos + 1] - 1
                split = micro_split(cm, g, B // M)
                tab = cm.stage_tables(g, split, pos, S, M, "1f1b")
                if not tab.fits[a, b]:
                    continue
                stages.append(Stage(g, [a, b], bool(tab.keep[a, b])))
                for i, r in enumerate(g):
                    ranks[r] = RankPlan(
                        r,
                        cm.devices[r].type_key,
                        split[i] * M,
                        max(split[i], 1),
                        M if split[i] else 0,
                        float(tab.fractions[tab.index[i], a, b]),
                    )
            if len(stages) < S:
                continue  # a stage does not fit
            p = dataclasses.replace(best, ranks=ranks, stages=stages, predicted=None)
            ev = cm.evaluate(p)
            assert ev.fits
            steps.append(ev.step_s)
        assert best.predicted.step_s == pytest.approx(min(steps), rel=1e-9)
        assert cm.evaluate(best).step_s == pytest.approx(best.predicted.step_s, rel=1e-12)


def test_the_search_never_predicts_slower_than_flat(small_cm):
    plan = make_staged_plan(small_cm, 8, reduce_dtype="bf16")
    tried = {t["grouping"]: t["step_s"] for t in plan.meta["groupings"]}
    assert plan.predicted.step_s <= min(tried.values()) * (1 + 1e-12)  # flat and per node
    assert plan.staged  # 1 GB/s between nodes: stages win here
    assert small_cm.evaluate(plan).fits
    staged, summary = best_staged_plan(small_cm, 8, stages=3)
    assert staged is not None and len(staged.stages) == 3
    assert [s["stages"] for s in summary] == [3]


def test_formations_are_whole_nodes_and_distinct(small_cm):
    out = formations(small_cm, 3)
    assert len(out) == 6  # three nodes of three kinds: every order
    for groups in out:
        assert sorted(r for g in groups for r in g) == [0, 1, 2, 3, 4]
        assert all({0, 1} <= set(g) or not {0, 1} & set(g) for g in groups)
    assert formations(small_cm, 4) == []


def test_stages_that_disagree_with_the_cluster_are_named(small_cm):
    plan = plan_formation(small_cm, 8, [[0, 1], [2], [3, 4]], 4, "1f1b")
    d = json.loads(plan.to_json())
    d["stages"][-1]["units"][1] -= 1  # the head left out
    short = Plan.from_dict(d)
    with pytest.raises(CephaloError, match=r"ends at unit 6 but .* units 0\.\.7"):
        small_cm.evaluate(short)
    # a node split between two stages
    d = json.loads(plan.to_json())
    d["stages"][0]["ranks"], d["stages"][1]["ranks"] = [0], [1, 2]
    d["ranks"][0].update(batch_size=8, micro_batch_size=2, num_micro_batches=4, state_fraction=1)
    d["ranks"][1].update(batch_size=0, micro_batch_size=1, num_micro_batches=0, state_fraction=0.5)
    d["ranks"][2].update(batch_size=8, micro_batch_size=2, num_micro_batches=4, state_fraction=0.5)
    with pytest.raises(CephaloError, match="node 0 has ranks in stage 0 and in stage 1"):
        small_cm.evaluate(Plan.from_dict(d))


def test_parse_stages_and_the_config_field():
    assert parse_stages("auto") == "auto" and parse_stages("OFF") == "off"
    assert parse_stages("3") == 3 and parse_stages(1) == "off"
    for bad in ("two", "0", "-1"):
        with pytest.raises(CephaloError, match="stages"):
            parse_stages(bad)
    JobConfig(parallel=ParallelConfig(stages="auto")).validate()
    with pytest.raises(CephaloError, match="parallel.stages must be off, auto or a number"):
        JobConfig(parallel=ParallelConfig(stages="two")).validate()


# ------------------------------------------------------------------ CLI and runtime
def test_plan_simulate_and_the_runtime_refusal(tmp_path, capsys):
    out = tmp_path / "staged.json"
    cluster = "2xl4@node0,a6000@node1,2xt4@node2;inter=0.2GB/s"
    args = ["plan", "--cluster", cluster, "--model", "gpt-2.7b", "--seq-len", "512"]
    args += ["--no-hierarchy"]  # the flat plan and 3 stages only: cheaper
    assert main([*args, "--global-batch", "8", "--stages", "3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pipeline stages (1f1b" in text
    assert "stage" in text.splitlines()[2] or " stage " in text
    plan = Plan.from_json(out)
    assert plan.staged and len(plan.stages) == 3
    assert main(["simulate", str(out)]) == 0
    assert "pipeline stages" in capsys.readouterr().out
    preflight(JobConfig(parallel=ParallelConfig(plan=str(out))))  # the runtime runs it
    with pytest.raises(CephaloError, match="pipeline stages .* cannot run with an adapter"):
        cfg = JobConfig(parallel=ParallelConfig(plan=str(out)))
        cfg.model.adapter = "lora"
        preflight(cfg)
    assert main([*args, "--global-batch", "8", "--stages", "4"]) == 2
    assert "4 stages need at least 4 nodes but the cluster has 3" in capsys.readouterr().err
    # a cut that leaves a stage out of memory: simulate says which ranks, how short
    d = json.loads(out.read_text())
    d["stages"][0]["units"], d["stages"][1]["units"] = [0, 30], [31, 31]
    d["stages"][2]["units"] = [32, 33]
    d["model"] = "llama-7b"
    d["meta"].pop("model_shape", None)
    (tmp_path / "oom.json").write_text(json.dumps(d))
    assert main(["simulate", str(tmp_path / "oom.json"), "--model", "llama-7b"]) == 1
    assert re.search(r"does not fit: rank \d \(\w+, stage 0: units 0-30\)", capsys.readouterr().out)


def test_the_documented_staged_plan_simulates_as_documented(tmp_path, capsys):
    """docs/plan-format.md's hand-written staged plan loads, and `simulate` predicts what the
    page says."""
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "plan-format.md").read_text()
    block = page.split("## Pipeline stages (version 3")[1].split("```json")[1].split("```")[0]
    (tmp_path / "staged.json").write_text(block)
    assert main(["simulate", str(tmp_path / "staged.json")]) == 0
    out = capsys.readouterr().out
    assert "simulated: 3.312 samples/s" in out and "step 2.416 s" in out
