"""`cephalo run` (the local launcher) and how failures surface: one clear line, no hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from cephalo import envvars
from cephalo.cli import main as cli_main
from cephalo.errors import CephaloError
from cephalo.launch.elastic import first_failure, free_port, nproc_for
from cephalo.launch.pool import threads_per_rank
from cephalo.planner.makers import manual_plan, simple_plan
from cephalo.specs.cluster import Cluster
from dist_harness import dist_pool_fixture
from procs import processes, run_tagged

__all__ = ["processes"]
TIMEOUT_S = 20


def job_args(run_dir, *extra: str) -> list[str]:
    return [
        f"--logging.dir={run_dir}",
        "--logging.progress=false",
        "--model.name=gpt-tiny",
        "--data.seq_len=16",
        "--train.global_batch_size=6",
        "--train.steps=6",
        "--train.warmup_steps=1",
        "--train.eval_every=0",
        "--parallel.plan=even",
        f"--parallel.timeout_s={TIMEOUT_S}",
        *extra,
    ]


# ----------------------------------------------------------------------------- pieces
def test_nproc_comes_from_the_devices():
    assert nproc_for("cpu,cpu:slowdown=2,cpu:slowdown=4,mem=2GiB", None) == 3
    assert nproc_for(None, None) == 1
    assert nproc_for(None, 4) == 4
    with pytest.raises(CephaloError, match="--nproc 3 but --devices lists 2"):
        nproc_for("cpu,cpu", 3)
    with pytest.raises(CephaloError):
        nproc_for("cpu,gpu-that-does-not-exist", None)


def test_threads_and_port():
    assert threads_per_rank(1) == max(1, os.cpu_count() or 1)
    assert threads_per_rank(10_000) == 1
    assert 0 < free_port() < 65536


class _Failure:
    def __init__(self, exitcode: int, name: str = ""):
        self.exitcode, self._name = exitcode, name

    def signal_name(self) -> str:
        return self._name


def test_first_failure_picks_the_cause(tmp_path):
    (tmp_path / "attempt000-rank00002.txt").write_text(
        "20.0\nrank 2: step 4 failed in a collective\n"
    )
    (tmp_path / "attempt000-rank00000.txt").write_text("10.0\nthe plan is for 3 ranks\n")
    assert (
        first_failure(tmp_path)
        == "rank 0: the plan is for 3 ranks (1 other rank(s) failed after it)"
    )
    # after a restart only the last attempt's reports count, however early the old ones were
    retried = tmp_path / "retried"
    retried.mkdir()
    (retried / "attempt000-rank00001.txt").write_text("5.0\nrank 1: killed in the first try\n")
    (retried / "attempt001-rank00000.txt").write_text("30.0\ncheckpoint directory is full\n")
    assert first_failure(retried) == "rank 0: checkpoint directory is full"
    # a rank killed by a signal is the cause; the agent's SIGTERMs to the others are not
    failures = {
        0: _Failure(-15, "SIGTERM"),
        1: _Failure(-9, "SIGKILL"),
        2: _Failure(-15, "SIGTERM"),
    }
    assert first_failure(tmp_path, failures).startswith("rank 1 was killed by signal SIGKILL")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "rank 1 exited with code 3" in first_failure(empty, {1: _Failure(3)})


def test_run_rejects_mismatched_devices_before_launching(capsys):
    assert cli_main(["run", "--devices", "cpu,cpu", "--nproc", "3"]) == 2
    assert "--nproc 3 but --devices lists 2" in capsys.readouterr().err


def test_missing_data_and_packages_fail_before_any_worker_starts(tmp_path, capsys, monkeypatch):
    """Issue 41, point 3: data that is missing, empty or needs a package that does not import,
    and an optional package the config needs, are one line and exit 2 before the launch (no
    worker starts: the launcher would log "launching")."""
    empty_dir = tmp_path / "empty_dir"
    empty_dir.mkdir()
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    cases = [
        ("--data.path={}/missing.txt", "data.path {}/missing.txt does not exist"),
        ("--data.path={}/empty.txt", "data.path {}/empty.txt is empty"),
        ("--data.path={}/empty_dir", "is an empty directory"),
        ("--data.path={}/t.parquet", "needs the `pyarrow` package"),
        ("--model.adapter=lora", "needs peft: pip install 'cephalo[lora]'"),
        ("--model.name=hf-llama-tiny", "need the `transformers` package"),
    ]
    # an optional package that is not installed: its import raises ImportError
    for name in ("peft", "pyarrow", "transformers"):
        monkeypatch.setitem(sys.modules, name, None)
    for arg, message in cases:
        argv = ["run", "--devices", "cpu,cpu", *job_args(tmp_path / "run"), arg.format(tmp_path)]
        assert cli_main(argv) == 2, arg
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message.format(tmp_path) in err, err
        assert "launching" not in err


def test_missing_package_is_one_line_in_seconds_without_native_frames(tmp_path):
    """The same through a real process, the package shadowed on PYTHONPATH by one whose import
    fails: one line, exit 2, no C++ stack frames, in seconds (the process group never starts).
    QLoRA imports torchao first (really): that one line also shows that its import warnings
    ("Failed to load ..._C_mxfp8...so", pytree notes; issue 41, point 7) stay quiet."""
    import importlib.util

    adapter = "qlora" if importlib.util.find_spec("torchao") is not None else "lora"
    shadow = tmp_path / "shadow" / "peft"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('simulated: peft is not installed')\n")
    path = os.pathsep.join(p for p in (str(shadow.parent), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "cephalo", "run", "--devices", "cpu,cpu"]
        + job_args(tmp_path / "run", f"--model.adapter={adapter}"),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    took = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "cephalo run: error: model.adapter = lora/qlora needs peft: pip install 'cephalo[lora]'"
    ]
    assert "frame #" not in proc.stdout + proc.stderr
    assert took < 30, took  # ~3 s on an idle machine; workers would take 10+


def test_launch_files_for_a_cluster_and_a_plan(tmp_path, capsys):
    """Issue 41, point 10: the sbatch script passes `bash -n`, asks for every node's GPU count
    (one heterogeneous component per node where they differ) and starts that many ranks there,
    all at one c10d rendezvous; P2P is off only on the node of consumer cards; the SkyPilot
    YAML parses. From a plan file, the job runs that plan."""
    import yaml

    out = tmp_path / "launch"
    spec = "4xl4@node0,2xrtx3090@node1,a6000@node2"
    argv = ["launch-files", "--cluster", spec, "--config", "my job.toml", "--out", str(out)]
    assert cli_main(argv) == 0
    script = (out / "cephalo.sbatch").read_text()
    check = subprocess.run(["bash", "-n", str(out / "cephalo.sbatch")], capture_output=True)
    assert check.returncode == 0, check.stderr
    assert script.count("#SBATCH hetjob") == 2
    sruns = [line for line in script.splitlines() if line.startswith("srun ")]
    assert len(sruns) == 3
    for i, (gpus, line) in enumerate(zip((4, 2, 1), sruns, strict=True)):
        assert f"#SBATCH --gpus-per-node={gpus}   # node {i}:" in script
        assert f"--het-group={i} " in line and f"--nproc-per-node={gpus} " in line
        assert "--nnodes=3 " in line and "--rdzv-backend=c10d" in line
        assert line.endswith("--config 'my job.toml' &")
        assert ("NCCL_P2P_DISABLE=1" in line) == (i == 1)
    sky = yaml.safe_load((out / "cephalo-sky.yaml").read_text())
    assert sky["num_nodes"] == 3 and sky["resources"]["accelerators"] == "L4:4"
    assert "torchrun" in sky["run"] and sky["envs"]["CEPHALO_CONFIG"] == "my job.toml"
    # a plan file: its recorded cluster (two identical nodes: one component), and the plan run
    plan = tmp_path / "plan.json"
    argv = ["plan", "--cluster", "2xl4@node0,2xl4@node1", "--model", "gpt-1.3b"]
    assert cli_main([*argv, "--global-batch", "16", "--json", str(plan)]) == 0
    assert cli_main(["launch-files", "--plan", str(plan), "--out", str(out)]) == 0
    script = (out / "cephalo.sbatch").read_text()
    assert subprocess.run(["bash", "-n", str(out / "cephalo.sbatch")]).returncode == 0
    assert "hetjob" not in script and "#SBATCH --nodes=2" in script
    assert "#SBATCH --gpus-per-node=2" in script and "--nproc-per-node=2 " in script
    assert f"--parallel.plan={plan}" in script
    assert yaml.safe_load((out / "cephalo-sky.yaml").read_text())["num_nodes"] == 2
    capsys.readouterr()
    assert cli_main(["launch-files", "--cluster", "cpu,cpu", "--out", str(out)]) == 2
    assert "cephalo run" in capsys.readouterr().err


# ----------------------------------------------------------------------------- real launches
@pytest.mark.slow
def test_worker_errors_surface_as_one_line(tmp_path):
    plan = tmp_path / "plan3.json"
    simple_plan("even", Cluster.parse("cpu,cpu,cpu"), "gpt-tiny", 16, 6, "fp32").to_json(plan)
    proc = run_tagged(
        [
            sys.executable,
            "-m",
            "cephalo",
            "run",
            "--devices",
            "cpu,cpu",
            *job_args(tmp_path / "run"),
            f"--parallel.plan={plan}",
        ],
        timeout_s=180,
    )
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("cephalo run: error: rank "), proc.stderr[-2000:]
    assert "the plan is for 3 ranks but the job has 2" in last
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_survivors_of_a_killed_rank_exit_with_an_error(tmp_path, processes):
    """Plain processes (no elastic agent to stop them): rank 1 SIGKILLs itself before step 3;
    ranks 0 and 2 must fail with a clear error within the collective timeout, not hang."""
    env = {
        **os.environ,
        "WORLD_SIZE": "3",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        envvars.KILL_AT_STEP: "3",
    }
    procs = [
        processes.start(
            [sys.executable, "-m", "cephalo", "train", *job_args(tmp_path / "run")],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(3)
    ]
    # (the `processes` fixture kills whatever is left, whatever happens below)
    assert procs[1].wait(timeout=180) == -9
    killed_at = time.monotonic()
    for r in (0, 2):
        _, err = procs[r].communicate(timeout=TIMEOUT_S + 30)
        assert time.monotonic() - killed_at < TIMEOUT_S + 15
        assert procs[r].returncode == 2, err[-2000:]
        assert f"rank {r}: step 3 failed in a collective" in err
        assert "Traceback" not in err


def test_kill_hook_fires_in_the_first_attempt_only(monkeypatch):
    """The crash hook kills once per job: a restarted attempt resuming before step N passes it."""
    from types import SimpleNamespace

    from cephalo.train.trainer import _Trainer

    killed = []
    monkeypatch.setattr("cephalo.train.trainer.os.kill", lambda pid, sig: killed.append(sig))
    monkeypatch.setenv(envvars.KILL_AT_STEP, "3")
    rank1 = SimpleNamespace(world_size=2, rank=1)
    _Trainer._maybe_kill(rank1, 2)
    assert killed == []
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    _Trainer._maybe_kill(rank1, 3)
    assert killed == []
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    _Trainer._maybe_kill(SimpleNamespace(world_size=2, rank=0), 3)  # not the victim
    assert killed == []
    _Trainer._maybe_kill(rank1, 3)
    assert killed == [signal.SIGKILL]


# ----------------------------------------------------------------------------- a failure's key
pool3 = dist_pool_fixture(3, timeout_s=60)


def _announcements_across_rounds() -> tuple[list[str], list[str | None]]:
    """On each rank, as torchrun agents that joined in different rounds (restart counts 0, 1,
    2): two rendezvous rounds on one store; in each, one rank announces its failure and every
    rank looks for a peer's announcement. The round keys and what each rank saw."""
    import torch.distributed as dist

    from cephalo.envvars import scoped_environ
    from cephalo.runtime.collectives import dist as cdist

    rank = dist.get_rank()
    keys, seen = [], []
    with scoped_environ({"TORCHELASTIC_RESTART_COUNT": str(rank)}):
        try:
            for failing in (1, 2):  # round 1: rank 1 fails; round 2 (same store): rank 2
                cdist._FailureWatch.start(rank, watch=False)  # the key: collective
                keys.append(cdist._FailureWatch._instance.key)
                seen.append(cdist.peer_failure(wait_s=0.2))  # nothing of the last round
                dist.barrier()
                if rank == failing:
                    cdist.announce_failure(f"round {failing}: out of memory")
                dist.barrier()
                seen.append(cdist.peer_failure(wait_s=5.0))
                dist.barrier()
        finally:
            cdist._FailureWatch.stop()
    return keys, seen


@pytest.mark.slow
def test_a_failure_is_announced_under_a_key_every_rank_of_the_round_agrees_on(pool3):
    """Agents that joined torchrun's rendezvous in different rounds count restarts differently
    (here 0, 1, 2): the failing rank's announcement is still seen by every peer (the key is
    the round's, agreed at start-up, not the restart count's), and a later round on the same
    store does not see the earlier round's announcement."""
    out = pool3.run(_announcements_across_rounds)
    keys = [k for k, _ in out]
    assert keys[0] == keys[1] == keys[2] and keys[0][0] != keys[0][1], keys
    for rank, (_, seen) in enumerate(out):
        one = None if rank == 1 else "rank 1 failed: round 1: out of memory"
        two = None if rank == 2 else "rank 2 failed: round 2: out of memory"
        assert seen == [None, one, None, two], (rank, seen)


# ----------------------------------------------------------------------------- a plan meets its ranks
PLANNED = "cpu,cpu:slowdown=3,mem=2MiB"
"""The cluster the plan of the next tests is made for: the small slow device gets the small
state shard (the large one does not fit its 2 MiB: it peaks at 3 MB, the small at 1 MB)."""


def _plan_for(path):
    """A plan for `PLANNED` as `cephalo plan` writes one (its cluster in `meta`; the catalog has
    no profile of an emulated CPU, so the split is written here)."""
    cluster = Cluster.parse(PLANNED)
    keys = [d.type_key for d in cluster.devices]
    meta = {"cluster_spec": PLANNED, "cluster": cluster.to_dict()}
    manual_plan("gpt-tiny", 16, [5, 1], [5, 1], [0.889, 0.111], keys, meta=meta).to_json(path)
    return path


def _no_trace(stderr: str) -> None:
    for trace in ("Traceback", "Exception raised from", "frame #"):
        assert trace not in stderr, stderr[-3000:]


@pytest.mark.slow
def test_a_plan_runs_on_its_devices_started_in_another_order(tmp_path):
    """The ranks join in another order than the plan's devices (`parallel.emulate_join_order`:
    as c10d numbers them by arrival), one of them 1 s late (within the start-up timeout): each
    rank runs the rank-plan made for its device (one log line says so), and the losses are
    those of the one-process run."""
    from cephalo.train.config_manager import load_config
    from cephalo.train.metrics import read_metrics
    from cephalo.train.trainer import train
    from run_common import tiny_job_args

    plan = _plan_for(tmp_path / "plan.json")
    steps = ("--train.steps=6", "--checkpoint.every=0")
    run = tmp_path / "run"
    proc = run_tagged(
        [sys.executable, "-m", "cephalo", "run", "--devices", "cpu,cpu:slowdown=3,mem=2MiB"]
        + tiny_job_args(
            run,
            f"--parallel.plan={plan}",
            *steps,
            "--parallel.emulate_join_order=reverse",
            "--parallel.emulate_start_delay=1:1",
            "--parallel.startup_timeout_s=60",
        ),
        timeout_s=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plan ranks reordered to match them (rank 0 runs plan rank 1" in proc.stderr
    _no_trace(proc.stderr)
    losses = {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl")}
    alone = train(load_config(None, tiny_job_args(tmp_path / "alone", *steps))).losses
    assert sorted(losses) == sorted(alone) == list(range(1, 7))
    for step, loss in alone.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5), step


@pytest.mark.slow
def test_a_plan_for_other_devices_stops_at_once_with_one_message(tmp_path):
    from run_common import tiny_job_args

    plan = _plan_for(tmp_path / "plan.json")
    started = time.monotonic()
    proc = run_tagged(
        [sys.executable, "-m", "cephalo", "run", "--devices", "cpu:slowdown=2,cpu"]
        + tiny_job_args(tmp_path / "run", f"--parallel.plan={plan}"),
        timeout_s=120,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("cephalo run: error: rank "), proc.stderr[-3000:]
    assert f"plan {plan} was made for other devices: rank 0 is a cpu:slowdown=2" in last
    assert "the plan's rank 0 is a cpu (4 GiB)" in last
    _no_trace(proc.stderr)
    assert elapsed < 30
