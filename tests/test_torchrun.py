"""The job launched with torchrun (not `cephalo run`), each rank discovering its own device.

torchrun starts 3 identical workers; tests/torchrun_worker.py gives each, through
`CEPHALO_DEVICE`, only its own emulated device (as a GPU rank finds its own GPU). The ranks
all-gather their descriptions, profile each device type on a rank that has it, and must make
one uneven automatic plan, the same on every rank, whose training equals one process's
(the plan-invariance contract, tests/test_plan_invariance.py). Ranks started with different
configs, or disagreeing about their node, stop at once with one message on every rank.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cephalo.launch.elastic import free_port
from cephalo.planner.makers import manual_plan
from cephalo.planner.plan import Plan
from cephalo.specs.cluster import Cluster
from cephalo.train.config_manager import load_config
from procs import processes, run_tagged
from trainer_reference import job_floor

__all__ = ["processes"]

pytestmark = pytest.mark.slow

WORKER = Path(__file__).parent / "torchrun_worker.py"
DEVICES = "cpu:mem=1GiB;cpu:slowdown=4,mem=1GiB;cpu:slowdown=2,mem=1GiB"
STEPS = 6


def job_args(run_dir: Path, *extra: str) -> list[str]:
    return [
        f"--logging.dir={run_dir}",
        "--logging.progress=false",
        "--model.name=gpt-tiny",
        "--model.overrides=dropout=0.1",
        "--data.seq_len=16",
        "--train.global_batch_size=12",
        f"--train.steps={STEPS}",
        "--train.warmup_steps=2",
        "--train.lr=1e-3",
        "--train.eps=1e-6",
        "--train.eval_every=0",
        "--checkpoint.every=0",
        "--parallel.timeout_s=60",
        "--profile.repeats=1",
        "--profile.warmup=0",
        "--profile.time_cap_s=1",
        *extra,
    ]


def torchrun(tmp_path: Path, args: list[str], rank_extra: str = "", devices: str = DEVICES):
    env = {
        **__import__("os").environ,
        "TEST_DEVICES": devices,
        "TEST_OUT": str(tmp_path),
        "TEST_RANK_EXTRA": rank_extra,
        "CEPHALO_PROFILE_DB": str(tmp_path / "profiles.json"),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=3",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        str(WORKER),
        *args,
    ]
    return run_tagged(cmd, timeout_s=240, env=env)


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r.get("kind") == "step"}


def test_ranks_discover_their_devices_and_agree_on_an_uneven_plan(tmp_path):
    proc = torchrun(tmp_path, job_args(tmp_path / "run", "--parallel.plan=auto"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    plans = [Plan.from_json(tmp_path / f"plan_rank{r}.json") for r in range(3)]
    # the same plan on every rank (its meta holds each rank's own planner wall time)
    assert all(p.to_dict()["ranks"] == plans[0].to_dict()["ranks"] for p in plans)
    plan = plans[0]
    # the profiler measured each rank's own device: the slowest (rank 1) gets the least work
    assert [r.device for r in plan.ranks] == ["cpu", "cpu:slowdown=4", "cpu:slowdown=2"]
    assert len(set(plan.batch_sizes)) > 1 and plan.batch_sizes[1] < plan.batch_sizes[0]
    assert sorted(plan.meta["profiles"]["measured"]) == sorted(
        ["cpu", "cpu:slowdown=4", "cpu:slowdown=2", "comm"]
    )
    # the same run as one process on the whole batch
    alone = job_floor(load_config(None, job_args(tmp_path / "alone", "--parallel.plan=even")))
    ours = losses(tmp_path / "run")
    assert sorted(ours) == list(range(1, STEPS + 1))
    alone.check("torchrun, 3 ranks", ours)


def test_a_plan_file_meets_ranks_that_came_up_in_another_order(tmp_path):
    """A plan file made for the devices in another order than torchrun's ranks have them:
    each rank runs the rank-plan made for its device, and the losses are one process's."""
    made = Cluster.parse("cpu:mem=1GiB,cpu:slowdown=2,mem=1GiB,cpu:slowdown=4,mem=1GiB")
    plan = manual_plan(
        "gpt-tiny",
        16,
        [6, 4, 2],
        [3, 2, 1],
        [0.5, 0.3, 0.2],
        [d.type_key for d in made.devices],
        meta={"cluster": made.to_dict()},
    )
    plan.to_json(tmp_path / "plan.json")
    proc = torchrun(
        tmp_path, job_args(tmp_path / "run", f"--parallel.plan={tmp_path / 'plan.json'}")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1 runs plan rank 2 (cpu:slowdown=4), rank 2 runs plan rank 1" in proc.stderr
    ran = Plan.from_json(tmp_path / "plan_rank0.json")
    assert [r.device for r in ran.ranks] == ["cpu", "cpu:slowdown=4", "cpu:slowdown=2"]
    assert ran.batch_sizes == [6, 2, 4] and ran.meta["rank_map"] == [0, 2, 1]
    alone = job_floor(load_config(None, job_args(tmp_path / "alone", "--parallel.plan=even")))
    alone.check("torchrun, a plan file reordered", losses(tmp_path / "run"))


def test_ranks_started_with_different_jobs_stop_with_one_message(tmp_path):
    proc = torchrun(
        tmp_path,
        job_args(tmp_path / "run", "--parallel.plan=even"),
        rank_extra="1:--train.steps=9",
    )
    assert proc.returncode != 0
    for rank in range(3):
        assert (
            f"rank {rank}: cephalo: error: the ranks were started with different jobs"
            in proc.stderr
        )
    assert "train.steps: 6 on rank 0 vs 9 on rank 1" in proc.stderr


def test_ranks_that_disagree_about_their_node_stop_with_one_message(tmp_path):
    """Rank 0 names its node in its device spec (@node1), the others learn theirs from
    torchrun: every rank stops with the same message, naming who says what."""
    proc = torchrun(
        tmp_path,
        job_args(tmp_path / "run", "--parallel.plan=even"),
        devices="cpu@node1:mem=1GiB;cpu:slowdown=4,mem=1GiB;cpu:slowdown=2,mem=1GiB",
    )
    assert proc.returncode != 0
    for rank in range(3):
        assert (
            f"rank {rank}: cephalo: error: the ranks disagree about how they know their node: "
            "rank 0 from the cluster spec (@nodeK); ranks 1, 2 from torchrun (GROUP_RANK)"
        ) in proc.stderr


def test_a_rank_out_of_memory_stops_the_other_nodes_at_once(tmp_path, processes):
    """Two torchrun agents (two 'nodes', one rank each). Rank 1 runs out of memory at step 3;
    torchrun stops only its own node's workers. Rank 1 announces its failure in the store, and
    rank 0 stops within seconds with rank 1's reason, not a guess. (On gloo the peer's exit
    also resets rank 0's connection; NCCL would wait for the whole timeout, 120 s here, without
    the announcement: the watcher thread aborts the group then, docs/gpu.md.)"""
    port = free_port()
    log0, log1 = tmp_path / "node0.log", tmp_path / "node1.log"
    args = job_args(tmp_path / "run", "--parallel.plan=even", "--parallel.timeout_s=120")
    agents = []
    for node, log in enumerate((log0, log1)):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={node}",
            "--rdzv-backend=static",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "-m",
            "cephalo",
            "train",
            *args,
        ]
        env = {
            **__import__("os").environ,
            "OMP_NUM_THREADS": "1",
            "CEPHALO_TEST_OOM_AT_STEP": "3",
            "CEPHALO_TEST_KILL_RANK": "1",
        }
        agents.append(processes.start(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT))
    started = time.monotonic()
    codes = [a.wait(timeout=100) for a in agents]
    # the job's start (two interpreters, the data) is most of it; the wait would be 120 s
    assert time.monotonic() - started < 60
    assert codes[0] != 0 and codes[1] != 0
    text0, text1 = log0.read_text(), log1.read_text()
    assert "rank 1 ran out of device memory at step 3" in text1
    assert "stopped because rank 1 failed: rank 1 ran out of device memory at step 3" in text0
    assert "probably died" not in text0
