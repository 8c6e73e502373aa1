"""Training state in host memory (`host_state_fraction`): the plan field, the engine against the
same plan with all state on the device, checkpoints across host fractions, the ledger against
the cost model, the link emulation, and bad input."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import pytest
import torch

from cephalo.costmodel.host import check_host_memory
from cephalo.errors import CephaloError, MemoryBudgetExceeded
from cephalo.modeling.registry import build_model
from cephalo.planner.makers import manual_plan
from cephalo.planner.plan import Plan
from cephalo.runtime.collectives.comm import LocalComm, make_comm
from cephalo.runtime.emulation import ComputeEmulator
from cephalo.runtime.engine.engine import Engine, EngineConfig
from cephalo.runtime.memory import MemoryLedger
from cephalo.runtime.state.adamw import AdamWHyper
from cephalo.runtime.state.host_state import HostLink, host_adamw_kernel
from cephalo.specs.cluster import Cluster
from dist_harness import dist_pool_fixture
from engine_common import (
    LR,
    TEST_EPS,
    gradient_mutation,
    make_data,
    max_rel_diff,
    one_thread,
    rank_slice,
    reference_floor,
)

__all__ = ["one_thread"]
pool3 = dist_pool_fixture(3, timeout_s=300)

MODEL, SEQ = "gpt-tiny", 16
BATCHES, MICRO, FRACTIONS = [3, 2, 1], [2, 1, 1], [0.3, 0.45, 0.25]
HOST = [0.0, 0.5, 1.0]


@functools.cache
def _floor(steps: int):
    """The noise floor of the single-process reference on the 3-rank runs' data
    (tests/equivalence.py): host state, the fused host kernel and another split are each one
    more equivalent fp32 ordering of the same training."""
    return reference_floor(MODEL, {}, make_data(steps, sum(BATCHES), SEQ), _cfg())


def _check(label: str, run: dict, first_step: int = 1) -> None:
    """`run`'s losses from `first_step` on and its final parameters within the noise floor."""
    steps = max(run["losses"])
    cut = _floor(steps).at(range(first_step - 1, steps))
    cut.check(label, params=run["params"], losses=[run["losses"][s] for s in sorted(run["losses"])])


def _plan(host=(0.0, 0.0, 0.0), overlap=(True, True, True), dtype="fp32", fractions=FRACTIONS):
    plan = manual_plan(MODEL, SEQ, BATCHES, MICRO, fractions, dtype=dtype)
    for r, h, ov in zip(plan.ranks, host, overlap, strict=True):
        r.host_state_fraction, r.overlap_reduce = h, ov
    plan.validate()
    return plan


def _cfg(**kw) -> EngineConfig:
    """The device's AdamW is `foreach` here: the host's `foreach` is bitwise that path."""
    kw.setdefault("adamw_kernel", "foreach")
    return EngineConfig(grad_clip=0.5, adamw=AdamWHyper(eps=TEST_EPS, weight_decay=0.1), **kw)


# ====================================================================== the plan field
def test_plan_json_host_fraction_round_trip_and_old_files():
    plan = _plan(HOST, overlap=(True, False, True))
    back = Plan.from_json(plan.to_json())
    assert [r.host_state_fraction for r in back.ranks] == HOST
    assert [r.overlap_reduce for r in back.ranks] == [True, False, True]
    old = json.loads(plan.to_json())
    for r in old["ranks"]:  # a plan file written before the fields existed
        del r["host_state_fraction"], r["overlap_reduce"], r["predicted_host_bytes"]
    loaded = Plan.from_dict(old)
    assert all(r.host_state_fraction == 0.0 and r.overlap_reduce for r in loaded.ranks)


@pytest.mark.parametrize("value", [-0.1, 1.5, "half", True, float("nan")])
def test_plan_rejects_host_fraction_outside_0_1(value):
    d = json.loads(_plan().to_json())
    d["ranks"][1]["host_state_fraction"] = value
    with pytest.raises(CephaloError, match=r"ranks\[1\].*host_state_fraction.*\[0, 1\]"):
        Plan.from_dict(d)


def test_validate_rejects_host_fraction_set_in_code():
    plan = _plan()
    plan.ranks[2].host_state_fraction = 2.0
    with pytest.raises(CephaloError, match=r"host_state_fraction must be in \[0, 1\]"):
        plan.validate()


# ====================================================================== one process
def _single(host: float, dtype: str = "fp32", steps: int = 6, **cfg):
    plan = manual_plan(MODEL, SEQ, [5], [2], [1.0], dtype=dtype)
    plan.ranks[0].host_state_fraction = host
    engine = Engine(build_model(MODEL), plan, LocalComm(), _cfg(**cfg))
    stats = [engine.train_step(x, y, lr=LR) for x, y in make_data(steps, 5)]
    return engine, stats


def test_foreach_host_step_is_bitwise_the_device_step():
    ref, ref_stats = _single(0.0)
    for host in (0.5, 1.0):
        engine, stats = _single(host, host_adamw="foreach")
        assert [s.loss for s in stats] == [s.loss for s in ref_stats]
        diff, worst = max_rel_diff(engine.full_state_dict(), ref.full_state_dict())
        assert diff == 0.0, (host, worst)


@pytest.mark.parametrize(
    "mode, dtype, cfg",
    [
        ("standard", "fp32", {}),  # several reduce-scatters per unit: host pieces accumulate
        ("lga", "fp16", {"loss_scale_init": 2.0**20}),  # overflows twice: skipped steps
    ],
)
def test_modes_and_loss_scaling_with_host_state(mode, dtype, cfg):
    def run(host: float, overlap: bool):
        plan = manual_plan(MODEL, SEQ, [5], [2], [1.0], dtype=dtype)
        plan.ranks[0].host_state_fraction, plan.ranks[0].overlap_reduce = host, overlap
        engine = Engine(
            build_model(MODEL), plan, LocalComm(), _cfg(mode=mode, host_adamw="foreach", **cfg)
        )
        stats = [engine.train_step(x, y, lr=LR) for x, y in make_data(6, 5)]
        return [(s.loss, s.skipped, s.loss_scale) for s in stats], engine.full_state_dict()

    ref, ref_params = run(0.0, True)
    if "loss_scale_init" in cfg:
        assert ref[0][1] and not ref[-1][1]  # skipped while the scale came down, then trained
    for host, overlap in ((0.5, False), (1.0, True)):
        got, params = run(host, overlap)
        assert got == ref
        assert max_rel_diff(params, ref_params)[0] == 0.0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_ledger_moves_exactly_the_host_part(dtype):
    """The device state falls by (16 - d) bytes per host-held element, exactly; the host holds
    16 (+ d unless fp32) per element; the device peak falls by exactly the state's drop."""
    d = 4 if dtype == "fp32" else 2
    ref, ref_stats = _single(0.0, dtype, steps=2)
    engine, stats = _single(0.5, dtype, steps=2)
    hosted = sum(us.host_n for us in engine.shards)
    assert hosted == sum(round(0.5 * us.size) for us in engine.shards) > 0
    now, before = engine.ledger.current_by_category, ref.ledger.current_by_category
    assert before["state"] - now["state"] == (16 - d) * hosted
    assert now["host/state"] == (16 + (0 if dtype == "fp32" else d)) * hosted
    assert ref_stats[-1].peak_bytes - stats[-1].peak_bytes == (16 - d) * hosted
    assert stats[-1].host_peak_bytes == now["host/state"]
    # the cost model's x * P * (16 - d), to the rounding of h x each unit's shard
    P, units = build_model(MODEL).spec.total_params, len(engine.shards)
    assert abs((16 - d) * hosted - (16 - d) * 0.5 * P) <= (16 - d) * units / 2


def test_a_gather_casts_each_part_straight_into_the_gathered_buffer():
    """bf16 with half the state on the host: a unit's gather is one cast-copy per part of its
    shard (device master, host copy) into its own piece of the gathered buffer, then gathered
    in place (issue 39): no shard buffer cast first and copied again (one copy more per
    gather before). The gathered values are the master's, rounded to bf16."""
    from cephalo.runtime.host_syncs import OpCounter

    engine, _ = _single(0.5, "bf16", steps=0)  # (no step needed: the shards as built)
    coll = engine.collectives
    for us in engine.shards:
        with OpCounter() as ops:
            g = coll.start_gather(us, async_op=False)
        pieces = [(us, 0, us.size)] + [(b.owner, *b.local) for b in us.borrows]  # tied: head
        parts = sum(int(min(hi, o.dev_n) > lo) + int(hi > max(lo, o.dev_n)) for o, lo, hi in pieces)
        assert ops.by_op() == {"copy_": parts}, (us.index, ops.by_op())
        want = torch.cat([us.master[: us.dev_n].float(), us.host_copy[: us.host_n].float()])
        assert torch.equal(g.flat.float(), want.bfloat16().float())
        coll.release(g)


def test_host_adamw_runs_on_the_nodes_threads_only_around_its_step(monkeypatch):
    """Finding 12: a GPU rank's host AdamW runs on its share of the node's cores (torchrun's
    OMP_NUM_THREADS=1 aside), set only around the host step (the rank's thread count is back
    after it) with the same values; an emulated rank's is left alone."""
    from cephalo.launch.pool import threads_per_rank
    from cephalo.runtime.state.host_state import HostAdamW
    from cephalo.specs.cluster import Device
    from cephalo.train.config_manager import engine_config, load_config

    seen: list[int] = []
    step_group = HostAdamW.step_group

    def counting(self, *args):
        seen.append(torch.get_num_threads())
        return step_group(self, *args)

    monkeypatch.setattr(HostAdamW, "step_group", counting)
    before = torch.get_num_threads()
    ref, ref_stats = _single(1.0, steps=1, host_adamw="foreach")
    assert set(seen) == {before}
    seen.clear()
    engine, stats = _single(1.0, steps=1, host_adamw="foreach", host_threads=before + 1)
    assert set(seen) == {before + 1} and torch.get_num_threads() == before
    assert [s.loss for s in stats] == [s.loss for s in ref_stats]
    assert max_rel_diff(engine.full_state_dict(), ref.full_state_dict())[0] == 0.0
    cfg, cpu = load_config(None, []), Device("cpu", 2**30)
    assert engine_config(cfg, cpu, False, local_ranks=3).host_threads == threads_per_rank(3)
    assert engine_config(cfg, cpu, True, local_ranks=3).host_threads is None
    with pytest.raises(CephaloError, match="threads must be >= 1"):
        HostAdamW([], AdamWHyper(), num_threads=0)


def test_default_kernel_is_fused_where_the_build_has_it():
    assert host_adamw_kernel() in ("fused", "foreach")
    engine, _ = _single(1.0, steps=1)
    assert engine.host_optimizer is not None and engine.host_optimizer.kernel == host_adamw_kernel()


def test_host_budget_is_its_own_and_names_the_host():
    plan = manual_plan(MODEL, SEQ, [2], [2], [1.0])
    plan.ranks[0].host_state_fraction = 1.0
    ledger = MemoryLedger(0, "cpu", budget_bytes=1 << 30, host_budget_bytes=1 << 20)
    with pytest.raises(MemoryBudgetExceeded, match="host memory.*host_state_fraction"):
        Engine(build_model(MODEL), plan, LocalComm(), _cfg(), ledger=ledger)
    # the device budget does not count the host state
    ledger = MemoryLedger(0, "cpu", budget_bytes=1 << 20, host_budget_bytes=None)
    engine = Engine(build_model(MODEL), plan, LocalComm(), _cfg(), ledger=ledger)
    assert ledger.current_bytes < 1 << 20 < ledger.host_current_bytes
    assert engine.state_bytes() == ledger.host_current_bytes


def test_emulated_link_stretches_copies_not_compute():
    """A copy through an emulated link lasts nbytes / bandwidth, and a compute piece around it
    is stretched by the slowdown without the copy."""
    emulator = ComputeEmulator(3.0)
    link = HostLink(MemoryLedger(0, "cpu"), torch.device("cpu"), 1e8, emulator)
    src, dst = torch.ones(1 << 20), torch.empty(1 << 20)  # 4 MB: 40 ms at 100 MB/s
    t0 = time.perf_counter()
    link.copy(dst, src)
    assert time.perf_counter() - t0 >= 0.04 and torch.equal(dst, src)
    mark = emulator.start()
    with emulator.unstretched():
        time.sleep(0.05)
    busy_until = time.perf_counter() + 0.02
    while time.perf_counter() < busy_until:
        pass
    duration = emulator.finish(mark)
    # 3 x 20 ms of work + the 50 ms copy once (not 3 x 70 ms)
    assert 0.10 <= duration <= 0.16, duration


def test_step_inputs_cross_the_emulated_link_outside_the_stretch():
    """A step's inputs reach the device through the link (`HostLink.inputs`): on an emulated
    link their bytes are charged (nbytes / bandwidth, not stretched by the slowdown), and an
    engine's step moves exactly its ids and labels there (no offload, no host state)."""
    emulator = ComputeEmulator(3.0)
    link = HostLink(MemoryLedger(0, "cpu"), torch.device("cpu"), 1e7, emulator)
    ids = torch.ones(64, 512, dtype=torch.long)  # ids + labels: 512 KiB, 52 ms at 10 MB/s
    mark = emulator.start()
    out = link.inputs([ids, ids, None])
    duration = emulator.finish(mark)
    assert out[0] is ids and out[2] is None and link.copied_bytes == 2 * ids.numel() * 8
    assert 0.05 <= duration <= 0.1, duration  # once, not 3 x
    plan = manual_plan(MODEL, SEQ, [4], [2], [1.0])
    engine = Engine(build_model(MODEL), plan, LocalComm(), _cfg(host_copy_bytes_per_s=1e9))
    x, y = make_data(1, 4, SEQ)[0]
    engine.train_step(x, y, LR)
    assert engine.link.copied_bytes == x.numel() * 8 + y.numel() * 8


def test_check_host_memory_names_the_node():
    cluster = Cluster.from_dict(
        {"devices": "cpu,cpu@node1,cpu@node1", "nodes": [{"node": 1, "host_memory": "512KiB"}]}
    )
    plan = _plan(HOST)
    spec = build_model(MODEL).spec
    nodes = [d.node for d in cluster.devices]
    memory = {n: cluster.host_memory_of(n) for n in cluster.nodes()}
    with pytest.raises(CephaloError, match=r"node 1 has 0.5 MiB of host memory .*rank 1.*rank 2"):
        check_host_memory(plan, spec, nodes, memory)
    check_host_memory(_plan(), spec, nodes, memory)  # nothing on the host: fits


# ====================================================================== three ranks
def _run(
    plan: Plan,
    steps: int,
    cfg: EngineConfig,
    ckpt_in=None,
    ckpt_out=None,
    save_at=None,
    mutate=False,
):
    """On every rank: (optionally load a checkpoint,) train, (optionally save at `save_at`);
    `mutate`: under `gradient_mutation` (the bug the comparisons must catch)."""
    from cephalo.train.checkpoint import load_checkpoint, save_checkpoint

    torch.set_num_threads(1)
    comm = make_comm("gloo")
    engine = Engine(build_model(MODEL), plan, comm, cfg)
    data = make_data(steps, sum(BATCHES), SEQ)
    start = 0
    if ckpt_in is not None:
        start, extra, _ = load_checkpoint(ckpt_in, engine.sharded_state(), comm)
        engine.state_written()
        engine.load_extra_state(extra)
    losses = {}
    for step in range(start, steps):
        x, y = data[step]
        with gradient_mutation(mutate):
            out = engine.train_step(
                rank_slice(plan, comm.rank, x), rank_slice(plan, comm.rank, y), LR
            )
        losses[step + 1] = out.loss
        if save_at == step + 1:
            save_checkpoint(
                ckpt_out, step + 1, engine.sharded_state(), engine.extra_state(), {}, comm
            )
    full = engine.full_state_dict()
    return {
        "losses": losses,
        "params": full if comm.rank == 0 else None,
        "host": engine.host_fraction,
    }


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["fused", "foreach"])
def test_three_ranks_host_fractions_match_all_on_device(pool3, kernel):
    steps = 20
    device = pool3.run(_run, _plan(), steps, _cfg())
    hosted = pool3.run(
        _run, _plan(HOST, overlap=(True, False, True)), steps, _cfg(host_adamw=kernel)
    )
    assert [r["host"] for r in hosted] == HOST
    ref, ours = device[0], hosted[0]
    _check("all on the device", ref)
    _check(f"host state, {kernel} host kernel", ours)
    if kernel == "foreach":  # the device path's arithmetic, op for op
        assert ours["losses"] == ref["losses"]
        assert max_rel_diff(ours["params"], ref["params"])[0] == 0.0
    else:  # the same comparison catches one wrong gradient element on the host
        plan = _plan(HOST, overlap=(True, False, True))
        mutated = pool3.run(_run, plan, steps, _cfg(host_adamw=kernel), mutate=True)[0]
        with pytest.raises(AssertionError, match="beyond"):
            _check("mutated", mutated)


def _assert_same_run_from(step: int, run: dict, whole: dict) -> None:
    """`run`, resumed at `step`, is `whole` bit for bit: every later loss and every parameter."""
    assert run["losses"] == {s: v for s, v in whole["losses"].items() if s > step}
    assert max_rel_diff(run["params"], whole["params"])[0] == 0.0


@pytest.mark.slow
def test_checkpoints_load_across_host_fractions_and_resume_bitwise(pool3, tmp_path: Path):
    steps, hosted, device = 10, _plan(HOST), _plan()
    # written with host state at step 5 (the default fused host kernel), resumed with the same
    # plan: bitwise the same run
    whole = pool3.run(_run, hosted, steps, _cfg(), ckpt_out=str(tmp_path / "h"), save_at=5)[0]
    again = pool3.run(_run, hosted, steps, _cfg(), ckpt_in=str(tmp_path / "h" / "step_000005"))[0]
    _assert_same_run_from(5, again, whole)
    # between host and device at the same split, with the host kernel that does the device's
    # arithmetic op for op: bitwise too, so the checkpoint loses nothing on the way (the fused
    # kernel's rounding alone would differ by ~1e-6, see the test above)
    cfg = _cfg(host_adamw="foreach")
    whole = pool3.run(_run, hosted, steps, cfg, ckpt_out=str(tmp_path / "h2"), save_at=5)[0]
    pool3.run(_run, device, 5, cfg, ckpt_out=str(tmp_path / "d"), save_at=5)
    back = pool3.run(_run, hosted, steps, cfg, ckpt_in=str(tmp_path / "d" / "step_000005"))[0]
    _assert_same_run_from(5, back, whole)
    # written with host state, loaded all on the device at another split: equal up to the
    # rounding of reducing the gradients in another order
    other = _plan(fractions=[0.5, 0.2, 0.3])
    moved = pool3.run(_run, other, steps, cfg, ckpt_in=str(tmp_path / "h2" / "step_000005"))[0]
    _check("loaded at another split", moved, first_step=6)


@pytest.mark.slow
def test_trainer_kill_and_resume_with_host_state_is_bitwise(tmp_path: Path):
    """`cephalo run` on a plan with host fractions 0, 0.5, 1: rank 1 SIGKILLed before step
    12, resumed from step 10: step 11 again bit for bit, every step once."""
    import os
    import subprocess
    import sys

    from cephalo import envvars
    from cephalo.train.metrics import read_metrics
    from run_common import STEPS, tiny_job_args

    plan = manual_plan("gpt-tiny", 16, [3, 2, 1], [2, 1, 1], FRACTIONS)
    for r, h in zip(plan.ranks, HOST, strict=True):
        r.host_state_fraction = h
    plan_path = tmp_path / "plan.json"
    plan.to_json(plan_path)
    run = tmp_path / "run"
    args = tiny_job_args(run, f"--parallel.plan={plan_path}", timeout_s=30, keep_last=5)

    def cephalo_run(env=None):
        return subprocess.run(
            [sys.executable, "-m", "cephalo", "run", "--devices", "cpu,cpu,cpu", *args],
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=300,
        )

    killed = cephalo_run({envvars.KILL_AT_STEP: "12"})
    assert killed.returncode == 2, killed.stderr[-3000:]
    before = {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl")}
    assert sorted(before) == list(range(1, 12))
    resumed = cephalo_run()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in after] == list(range(1, STEPS + 1))
    assert {r["step"]: r["loss"] for r in after}[11] == before[11]


@pytest.mark.slow
def test_trainer_refuses_a_plan_too_big_for_the_host(tmp_path: Path):
    from cephalo.train.config_manager import load_config
    from cephalo.train.trainer import train
    from run_common import tiny_job_args

    plan = manual_plan("gpt-tiny", 16, [6], [3], [1.0])
    plan.ranks[0].host_state_fraction = 1.0
    plan_path = tmp_path / "plan.json"
    plan.to_json(plan_path)
    cfg = load_config(
        None,
        tiny_job_args(
            tmp_path / "run",
            f"--parallel.plan={plan_path}",
            "--train.steps=5",
            "--parallel.host_memory=256KiB",
        ),
    )
    with pytest.raises(CephaloError, match=r"node 0 has 0.2 MiB of host memory .*rank 0"):
        train(cfg)
    with pytest.raises(CephaloError, match="parallel.host_memory"):
        load_config(None, ["--parallel.host_memory=lots"])


# per rank: batch, micro-batch, offload, state fraction, host fraction, overlap
MEMORY_PLANS = {
    "host": [
        (8, 8, False, 0.2, 0.0, True),
        (4, 2, False, 0.5, 0.5, True),
        (2, 2, False, 0.3, 1.0, True),
    ],
    "host+offload+wait": [
        (8, 4, True, 0.3, 0.7, False),
        (4, 4, False, 0.4, 0.0, False),
        (2, 1, True, 0.3, 1.0, True),
    ],
}


def _memory_plan(spec) -> Plan:
    b, m, o, s, h, ov = zip(*spec, strict=True)
    plan = manual_plan("gpt-tiny", 32, b, m, s, offload=list(o))
    for r, hh, oo in zip(plan.ranks, h, ov, strict=True):
        r.host_state_fraction, r.overlap_reduce = hh, oo
    return plan


def _ledger_run(spec):
    torch.set_num_threads(1)
    comm = make_comm("auto")
    plan = _memory_plan(spec)
    engine = Engine(build_model("gpt-tiny"), plan, comm, EngineConfig(seed=0))
    x = torch.randint(
        0, 256, (plan.global_batch_size, 32), generator=torch.Generator().manual_seed(0)
    )
    mine = rank_slice(plan, comm.rank, x)
    for _ in range(2):
        stats = engine.train_step(mine, torch.roll(mine, -1, dims=1), 1e-4)
    return stats.peak_bytes, stats.host_peak_bytes


@pytest.fixture(scope="module")
def measured_cm(one_thread):
    from cephalo.costmodel.sources import measured_cost_model
    from cephalo.profiling.profiler import profile_devices
    from cephalo.profiling.settings import ProfileSettings

    settings = ProfileSettings(repeats=1, warmup=0, max_micro_batch=8)
    measured = profile_devices(
        MODEL, 32, "fp32", Cluster.parse("cpu"), settings=settings, use_cache=False
    )
    spec = build_model(MODEL).spec
    return measured_cost_model(Cluster.parse("cpu,cpu,cpu"), spec, 32, "fp32", measured)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MEMORY_PLANS))
def test_ledger_matches_the_cost_model_with_host_state(pool3, measured_cm, name):
    spec = MEMORY_PLANS[name]
    results = pool3.run(_ledger_run, spec)
    evaluation = measured_cm.evaluate(_memory_plan(spec))
    for rank, (peak, host_peak) in enumerate(results):
        cost = evaluation.ranks[rank]
        predicted = cost.memory.total - cost.memory.reserve
        print(
            f"{name} rank {rank}: device {peak} / {predicted}, host {host_peak} / {cost.host_bytes}"
        )
        bound = spec[rank][3] * measured_cm.reduce_out_bytes_per_fraction
        assert 0 <= predicted - peak <= bound + 64, (rank, peak, predicted)
        assert abs(host_peak - cost.host_bytes) <= 0.05 * max(cost.host_bytes, 1) + 64, rank
