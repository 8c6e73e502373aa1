"""The planner's host-state and reduce-overlap choices: against a linear programme over the
same cost model, on the catalog (the paper's cluster), and where host memory is short."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.optimize import linprog

from cephalo.costmodel.host import HostResources
from cephalo.costmodel.model import CostModel
from cephalo.costmodel.sources import catalog_cost_model
from cephalo.errors import PlanDoesNotFit
from cephalo.planner.makers import make_plan
from cephalo.specs.catalog.models import get_model_spec
from cephalo.specs.cluster import Cluster
from cephalo.specs.profile import CommProfile
from planner_helpers import FakeDevice, linear_profile, tiny_model

PAPER = "2xl4,a6000,p40"


def _synthetic(
    host_opt=(2e-4, 2e-4, 5e-5), host_mem=(10**6, 10**6), serial=True, async_copies=False
):
    """Three ranks on two nodes; the middle one short of memory."""
    keys = ["fast", "mid", "slow"]
    profiles = {
        k: linear_profile(
            k, 1.0 / s, 2.0 / s, 300.0, 1e-4, host_bytes_per_s=2e5, head_act_per_sample=0.0
        )
        for k, s in zip(keys, (2.0, 1.0, 0.5), strict=True)
    }
    for p in profiles.values():
        p.async_copies = async_copies
    devices = [FakeDevice("fast", 9000), FakeDevice("mid", 4000), FakeDevice("slow", 6000)]
    host = HostResources(
        node_of=(0, 0, 1),
        memory_bytes={0: host_mem[0], 1: host_mem[1]},
        optimizer_s_per_param=host_opt,
    )
    return CostModel(
        tiny_model(),
        3,
        "fp16",
        devices,
        profiles,
        CommProfile(bytes_per_s=5000.0, latency_s=0.01),
        reserve_bytes=0,
        host=host,
        serial_reduce=serial,
    )


def _best_fractions(cm: CostModel, plan) -> float:
    """min T over state fractions s_i and host parts x_i (a linear programme) for the plan's
    batches, micro-batches, offload and overlap choices: the water-filling's optimum."""
    n, P = len(cm.devices), cm.total_params
    A, Bd, hb = (
        cm.bytes_per_fraction,
        cm.host_part_device_bytes_per_fraction,
        cm.host_bytes_per_param,
    )
    # variables: y_0..y_n-1 (device part), x_0..x_n-1 (host part), T
    c = np.zeros(2 * n + 1)
    c[-1] = 1.0
    rows, rhs = [], []
    for i, r in enumerate(plan.ranks):
        key = cm.devices[i].type_key
        t, _, _ = cm.step_time_parts(
            key, r.batch_size, r.micro_batch_size, r.offload_activations, r.overlap_reduce
        )
        o = cm.optimizer_s_per_param(key)
        grad, up, opt = cm.host_rates(i)
        row = np.zeros(2 * n + 1)
        row[i], row[n + i], row[-1] = P * o, P * (grad + up + opt), -1.0  # CPU: all adds up
        rows.append(row)
        rhs.append(-float(t))
        mem = float(
            cm.memory_without_state(
                key,
                cm.capacity_bytes(i),
                r.batch_size,
                r.micro_batch_size,
                r.offload_activations,
                r.overlap_reduce,
            )
        )
        row = np.zeros(2 * n + 1)
        row[i], row[n + i] = A, Bd
        rows.append(row)
        rhs.append(cm.capacity_bytes(i) - mem - 1)
    for node in cm.host.memory_bytes:
        # the planner gives each rank an equal share of its node's host memory
        share = cm.host.memory_bytes[node] / len(cm.host.ranks_on(node))
        for i in cm.host.ranks_on(node):
            r = plan.ranks[i]
            one = np.zeros(2 * n + 1)
            one[n + i] = P * hb
            rows.append(one)
            rhs.append(share - float(cm.host_bytes(r.batch_size, r.offload_activations, 0.0)))
    eq = np.zeros((1, 2 * n + 1))
    eq[0, : 2 * n] = 1.0
    res = linprog(
        c,
        A_ub=np.array(rows),
        b_ub=rhs,
        A_eq=eq,
        b_eq=[1.0],
        bounds=[(0, None)] * (2 * n + 1),
        method="highs",
    )
    assert res.status == 0
    return float(res.fun)


@pytest.mark.parametrize(
    "host_opt, host_mem",
    [
        ((2e-4, 2e-4, 5e-5), (10**6, 10**6)),  # the host is the faster optimizer on rank 2
        ((5e-3, 5e-3, 5e-3), (10**6, 10**6)),  # the host is slow: only where memory needs it
        ((2e-4, 2e-4, 2e-4), (3000, 10**6)),  # node 0's host memory is short
    ],
)
@pytest.mark.parametrize("B", [6, 11])
def test_water_filling_with_host_state_is_the_lp_optimum(host_opt, host_mem, B):
    cm = _synthetic(host_opt, host_mem)
    plan = make_plan(cm, B, host_state_min_gain=0.0)
    ev = cm.evaluate(plan)
    assert ev.fits, [(r.memory.total, r.capacity_bytes) for r in ev.ranks]
    assert ev.host_fits
    assert ev.step_s == pytest.approx(_best_fractions(cm, plan), rel=1e-6)
    # never worse than keeping all state on the devices, or than overlapping every reduce
    for kw in ({"allow_host_state": False},):
        try:
            other = make_plan(cm, B, **kw)
        except PlanDoesNotFit:
            continue
        assert ev.step_s <= cm.evaluate(other).step_s * (1 + 1e-6)


def test_slow_host_is_used_only_where_memory_needs_it():
    cm = _synthetic(host_opt=(5e-3, 5e-3, 5e-3))
    plan = make_plan(cm, 8)
    for r, cost in zip(plan.ranks, cm.evaluate(plan).ranks, strict=True):
        if r.host_state_fraction > 0:
            # with less on the host this rank would not fit: its memory is (almost) full
            assert cost.memory.total >= 0.97 * cost.capacity_bytes, r.rank


def test_marginal_host_state_is_not_used():
    # the host is barely faster than the device optimizer: not worth 3 % of the step
    cm = _synthetic(host_opt=(9e-5, 9e-5, 9e-5), host_mem=(10**7, 10**7))
    greedy, default = make_plan(cm, 8, host_state_min_gain=0.0), make_plan(cm, 8)
    gain = 1 - cm.evaluate(greedy).step_s / cm.evaluate(default).step_s
    if any(r.host_state_fraction > 0 for r in default.ranks):
        assert gain < 1e-9  # kept only where it pays 3 % or more, here it pays all it can
    else:
        assert gain < 0.03


def test_without_host_resources_nothing_changes():
    cm = _synthetic()
    cm.host, cm.serial_reduce = None, False
    plan = make_plan(cm, 8)
    assert all(r.host_state_fraction == 0 and r.overlap_reduce for r in plan.ranks)


# ====================================================================== the catalog
@pytest.fixture(scope="module")
def paper():
    return lambda model: catalog_cost_model(
        Cluster.parse(PAPER), get_model_spec(model), 512, "fp16"
    )


def test_paper_cluster_gpt_6_7b_gains_from_host_state(paper):
    cm = paper("gpt-6.7b")
    with_host = make_plan(cm, 64).predicted.samples_per_s
    without = make_plan(cm, 64, allow_host_state=False).predicted.samples_per_s
    main = catalog_cost_model(
        Cluster.parse(PAPER), get_model_spec("gpt-6.7b"), 512, "fp16", serial_reduce=False
    )
    print(f"gpt-6.7b: {with_host:.3f} with host state, {without:.3f} without")
    # what main planned before issue #14 (2.314 samples/s, 2.317 under issue 38's queues) no
    # longer fits once each GPU keeps its CUDA context, cuBLAS workspace and NCCL communicator
    # (issue 38's device reserve): only serial reduces or host state fit the 6.7B model here
    with pytest.raises(PlanDoesNotFit):
        make_plan(main, 64, allow_host_state=False)
    assert with_host >= 1.15 * without  # the compute-only bound is 3.27


def test_paper_cluster_gpt_2_7b_keeps_its_state_on_the_gpus(paper):
    plan = make_plan(paper("gpt-2.7b"), 64)
    assert plan.predicted.samples_per_s >= 5.527
    assert all(r.host_state_fraction == 0 or r.state_fraction == 0 for r in plan.ranks)


def test_a_7b_model_on_one_l4_fits_with_host_state():
    cm = catalog_cost_model(Cluster.parse("l4"), get_model_spec("llama-7b"), 512, "fp16")
    with pytest.raises(
        PlanDoesNotFit, match="keeping part of the training state in host memory would fit"
    ):
        make_plan(cm, 8, allow_host_state=False)
    plan = make_plan(cm, 8)
    assert plan.ranks[0].host_state_fraction > 0.5 and cm.evaluate(plan).fits


def test_host_memory_too_small_says_so_per_node():
    cluster = Cluster.from_dict({"devices": "l4", "host_memory": "32GiB"})
    cm = catalog_cost_model(cluster, get_model_spec("llama-7b"), 512, "fp16")
    with pytest.raises(
        PlanDoesNotFit, match=r"even with training state in host memory \(node 0: 32.00 GiB"
    ):
        make_plan(cm, 8)


def test_simulate_flags_a_hand_plan_too_big_for_the_host(tmp_path, capsys):
    from cephalo.cli import main

    cluster = tmp_path / "cluster.toml"
    cluster.write_text('devices = "2xl4,a6000,p40"\nhost_memory = "64GiB"\n')
    plan = make_plan(
        catalog_cost_model(Cluster.parse(PAPER), get_model_spec("gpt-6.7b"), 512, "fp16"), 64
    )
    for r in plan.ranks:
        r.host_state_fraction = 1.0  # everything on the host: 6.9e9 x 18 bytes
    path = tmp_path / "plan.json"
    plan.to_json(path)
    assert main(["simulate", str(path), "--cluster", str(cluster)]) == 1
    out = capsys.readouterr().out
    assert "host memory too small" in out and "node 0 has 64.00 GiB of host memory" in out
    assert math.isfinite(plan.predicted.step_s)
