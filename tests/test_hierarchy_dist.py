"""Hierarchical sharding at run time (issue #26): an emulated 2-node plan, 3 ranks + 2 ranks with
different shard boundaries in the two groups, and a 3-group plan (2 + 2 + 1 ranks), train like
one process (runtime/collectives/shard_groups.py)."""

from __future__ import annotations

import pytest
import torch

from cephalo.modeling.registry import build_model
from cephalo.planner.plan import Plan, RankPlan, ShardGroup
from cephalo.runtime.collectives.comm import make_comm
from cephalo.runtime.engine.engine import Engine, EngineConfig
from cephalo.runtime.state.adamw import AdamWHyper
from dist_harness import dist_pool_fixture
from engine_common import (
    LR,
    TEST_EPS,
    assert_one_read_per_step,
    counted_steps,
    make_data,
    one_thread,
    rank_slice,
    reference_floor,
    run_reference,
)

__all__ = ["one_thread"]
pool5 = dist_pool_fixture(5, timeout_s=600)
STEPS = 20


def hierarchical_plan(reduce_dtype: str = "fp32") -> Plan:
    ranks = [
        RankPlan(0, "cpu", 3, 2, 2, 0.5),
        RankPlan(1, "cpu", 1, 1, 1, 0.2),
        RankPlan(2, "cpu", 2, 2, 1, 0.3),
        RankPlan(3, "cpu", 1, 1, 1, 0.35),
        RankPlan(4, "cpu", 1, 1, 1, 0.65),
    ]
    return Plan(
        "manual",
        "gpt-tiny",
        16,
        8,
        "fp32",
        ranks,
        shard_groups=[ShardGroup([0, 1, 2]), ShardGroup([3, 4])],
        cross_group_reduce_dtype=reduce_dtype,
    )


def three_group_plan() -> Plan:
    """3 shard groups (2 + 2 + 1 ranks), each group's boundaries elsewhere."""
    ranks = [
        RankPlan(0, "cpu", 2, 2, 1, 0.3),
        RankPlan(1, "cpu", 2, 1, 2, 0.7),
        RankPlan(2, "cpu", 1, 1, 1, 0.6),
        RankPlan(3, "cpu", 1, 1, 1, 0.4),
        RankPlan(4, "cpu", 2, 2, 1, 1.0),
    ]
    return Plan(
        "manual",
        "gpt-tiny",
        16,
        8,
        "fp32",
        ranks,
        shard_groups=[ShardGroup([0, 1]), ShardGroup([2, 3]), ShardGroup([4])],
    )


def _run(plan, cfg, data, overrides):
    torch.set_num_threads(1)
    comm = make_comm("gloo")
    engine = Engine(build_model("gpt-tiny", **overrides), plan, comm, cfg)
    stats = [
        engine.train_step(rank_slice(plan, comm.rank, x), rank_slice(plan, comm.rank, y), lr=LR)
        for x, y in data
    ]
    full = engine.full_state_dict()
    return {
        "params": full if comm.rank in (0, 3, 4) else None,
        "bytes_sent": engine.group_sync.bytes_sent,
        "losses": [s.loss for s in stats],
        "norms": [s.grad_norm for s in stats],
        "sizes": [us.size for us in engine.shards],
    }


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_two_node_hierarchical_plan_matches_one_process(pool5, dropout):
    plan = hierarchical_plan()
    cfg = EngineConfig(grad_clip=0.5, adamw=AdamWHyper(eps=TEST_EPS, weight_decay=0.1))
    data = make_data(STEPS, plan.global_batch_size)
    results = pool5.run(_run, plan, cfg, data, {"dropout": dropout})
    floor = reference_floor("gpt-tiny", {"dropout": dropout}, data, cfg)
    for who in (0, 3):  # both replicas
        floor.check(f"group of rank {who}", params=results[who]["params"])
    for r in results:
        floor.check("two groups", losses=r["losses"], norms=r["norms"])
    # the groups shard differently: the boundaries differ
    assert results[0]["sizes"] != results[3]["sizes"]


@pytest.mark.slow
def test_three_groups_match_one_process_and_send_what_the_cost_model_charges(pool5):
    """3 groups: every segment (an intersection of the groups' shards) is all-reduced among its
    3 owners as a ring, so each rank sends 2 (g-1)/g = 4/3 of its shard per step (the cost
    model's charge), not (g-1) = 2 of it as a send to every other owner would."""
    plan = three_group_plan()
    cfg = EngineConfig(grad_clip=0.5, adamw=AdamWHyper(eps=TEST_EPS, weight_decay=0.1))
    steps = 8
    data = make_data(steps, plan.global_batch_size)
    results = pool5.run(_run, plan, cfg, data, {"dropout": 0.0})
    floor = reference_floor("gpt-tiny", {"dropout": 0.0}, data, cfg)
    for who in (0, 3, 4):  # the three replicas
        floor.check(f"group of rank {who}", params=results[who]["params"])
    for r in results:
        floor.check("three groups", losses=r["losses"], norms=r["norms"])
    # the groups shard differently (a group of one rank too: its token count is the world's)
    assert results[0]["sizes"] != results[2]["sizes"] != results[4]["sizes"]
    for r in results:
        shard_bytes = 4 * sum(r["sizes"]) * steps
        assert r["bytes_sent"] == pytest.approx(4 / 3 * shard_bytes, rel=1e-3)


@pytest.mark.slow
def test_bf16_cross_group_reduce_stays_close(pool5):
    plan = hierarchical_plan("bf16")
    cfg = EngineConfig(grad_clip=0.5, adamw=AdamWHyper(eps=TEST_EPS, weight_decay=0.1))
    data = make_data(5, plan.global_batch_size)
    results = pool5.run(_run, plan, cfg, data, {"dropout": 0.0})
    ref = run_reference("gpt-tiny", {"dropout": 0.0}, data, cfg)
    # both replicas identical bit for bit (the same sum on every participant)
    for k, v in results[0]["params"].items():
        assert torch.equal(v, results[3]["params"][k]), k
    assert results[0]["losses"] == pytest.approx(ref.losses, rel=1e-2)


def _bf16_exchange(plan, numel: int, seed: int):
    """Every rank's gradient shard of one unit, random, all-reduced across the groups in bf16."""
    from cephalo.runtime.collectives.shard_groups import ShardGroupSync
    from cephalo.runtime.state.flat import shard_ranges

    comm = make_comm("gloo")
    full = [torch.randn(numel, generator=torch.Generator().manual_seed(seed + r)) for r in range(5)]
    rep = ShardGroupSync(plan, comm)
    rep.prepare([numel, numel])
    start, size = shard_ranges(numel, rep.fractions)[rep.local_rank]
    grads = [full[comm.rank][start : start + size].clone() for _ in range(2)]
    rep.all_reduce_grads([(0, numel, grads[0]), (1, numel, grads[1])])
    return start, grads


@pytest.mark.slow
def test_bf16_cross_group_reduce_sums_in_fp32(pool5):
    """3 groups (3 owners per segment): bf16 on the wire, the sum in fp32, rounded once, the
    same bits on every owner (a bf16 ring would round after each of its partial sums)."""
    from dataclasses import replace

    plan = replace(three_group_plan(), cross_group_reduce_dtype="bf16")
    numel, seed = 1001, 7
    results = pool5.run(_bf16_exchange, plan, numel, seed)
    full = [torch.randn(numel, generator=torch.Generator().manual_seed(seed + r)) for r in range(5)]
    groups = plan.groups
    # element i of group k's replica comes from the rank of group k that owns it
    owner_of = []
    for members in groups:
        own = torch.empty(numel, dtype=torch.long)
        for r in members:
            start, grads = results[r]
            own[start : start + grads[0].numel()] = r
        owner_of.append(own)
    contrib = torch.stack(
        [torch.stack(full)[owner_of[k], torch.arange(numel)] for k in range(len(groups))]
    )
    # the owners' group-rank order is their global order; each group holds one owner
    want = contrib.to(torch.bfloat16).float().sum(0).to(torch.bfloat16).float()
    for r, (start, grads) in enumerate(results):
        for g in grads:
            assert torch.equal(g, want[start : start + g.numel()]), f"rank {r}"


def _checkpoint_round_trip(root, data):
    """Hierarchical for 3 steps, save; load under a flat 5-rank plan and the reverse."""
    from cephalo.planner.makers import manual_plan
    from cephalo.runtime.collectives.shard_groups import saved_state
    from cephalo.train.checkpoint import load_checkpoint, save_checkpoint

    torch.set_num_threads(1)
    comm = make_comm("gloo")
    cfg = EngineConfig(adamw=AdamWHyper(eps=TEST_EPS))
    hier = hierarchical_plan()
    flat = manual_plan(
        "gpt-tiny", 16, [2, 2, 2, 1, 1], [1, 1, 1, 1, 1], [0.1, 0.3, 0.2, 0.25, 0.15]
    )
    out = {}
    for first, second, name in ((hier, flat, "h2f"), (flat, hier, "f2h")):
        a = Engine(build_model("gpt-tiny"), first, comm, cfg)
        out[f"syncs {name}"] = counted_steps(a, first, comm.rank, data, counted=3)[1]
        want = a.full_state_dict()
        save_checkpoint(f"{root}/{name}", 3, saved_state(a), a.extra_state(), {}, comm)
        b = Engine(build_model("gpt-tiny"), second, comm, cfg)
        load_checkpoint(f"{root}/{name}", b.sharded_state(), comm)
        b.state_written()
        got = b.full_state_dict()
        out[name] = max((got[k] - want[k]).abs().max().item() for k in want)
    return out


@pytest.mark.slow
def test_checkpoint_resumes_hierarchical_as_flat_and_back(pool5, tmp_path):
    """The round trip restores every parameter exactly. Its runs also count the host syncs of
    each step: after the first, flat and hierarchical, none but the update's one read
    (`assert_one_read_per_step`)."""
    data = make_data(3, 8)
    results = pool5.run(_checkpoint_round_trip, str(tmp_path), data)
    for r in results:
        assert {k: v for k, v in r.items() if not k.startswith("syncs")} == {"h2f": 0.0, "f2h": 0.0}
    assert_one_read_per_step([r["syncs h2f"] for r in results], "shard groups")
    assert_one_read_per_step([r["syncs f2h"] for r in results], "flat")


def _replans_keep_groups(data):
    """Hierarchical -> three groups -> hierarchical -> three groups by `switch_plan` (one step
    under each): the number of process groups torch.distributed holds before the first engine,
    with it, and after each switch."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from cephalo.train.replan import switch_plan

    torch.set_num_threads(1)
    comm = make_comm("gloo")
    cfg = EngineConfig(adamw=AdamWHyper(eps=TEST_EPS))
    plan = hierarchical_plan()
    trainer = SimpleNamespace(
        cfg=SimpleNamespace(
            model=SimpleNamespace(name="gpt-tiny"),
            parallel=SimpleNamespace(replan_staging="device"),
        ),
        comm=comm,
        rank=comm.rank,
        plan=plan,
        rank_plan=plan.ranks[comm.rank],
        result=SimpleNamespace(plan=plan),
        write_run_files=lambda: None,
        make_engine=lambda p: Engine(build_model("gpt-tiny"), p, comm, cfg),
    )
    before = len(dist.distributed_c10d._world.pg_map)
    trainer.engine = trainer.make_engine(plan)
    live = [before, len(dist.distributed_c10d._world.pg_map)]
    for new in (three_group_plan(), hierarchical_plan(), three_group_plan()):
        x, y = data
        trainer.engine.train_step(
            rank_slice(trainer.plan, comm.rank, x), rank_slice(trainer.plan, comm.rank, y), lr=LR
        )
        switch_plan(trainer, new)
        live.append(len(dist.distributed_c10d._world.pg_map))
    return live


@pytest.mark.slow
def test_replans_destroy_the_old_plans_sub_groups(pool5):
    """Finding 14 of issue 38: each hierarchical engine makes its shard groups' and segment
    owners' process groups (each an NCCL communicator on GPUs); a re-plan destroys the old
    engine's (`Engine.close`), so switching back and forth does not pile them up."""
    data = make_data(1, 16)[0]
    for before, first, *live in pool5.run(_replans_keep_groups, data):
        assert first > before  # the engine made its groups (the count sees them)
        assert live[1] == first, live  # hierarchical again: its groups alone
        assert live[2] == live[0], live  # three groups again: as many as the first time
