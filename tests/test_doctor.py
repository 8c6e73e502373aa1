"""`cephalo doctor`: the pre-flight's checks one by one, and on emulated clusters (a good one
passes; a wrong plan, a private checkpoint directory, too little memory each fail their row)."""

from __future__ import annotations

import os
import sys

import pytest
from rich.console import Console

from cephalo.cli import main as cli_main
from cephalo.planner.makers import simple_plan
from cephalo.runtime.collectives.comm import LocalComm
from cephalo.specs.cluster import Cluster
from cephalo.train.config_manager import load_config
from cephalo.train.discovery import available_host_bytes
from cephalo.train.doctor import (
    FAIL,
    OK,
    WARN,
    Check,
    DoctorOptions,
    device_memory_check,
    host_memory_check,
    nccl_check,
    passed,
    plan_check,
    run_doctor,
    uneven_sizes,
)
from cephalo.views.tables import doctor_table
from procs import run_tagged

GOOD = "cpu,cpu:slowdown=2,mem=64MiB"
ROWS = ("ranks", "plan", "device memory", "host memory", "checkpoints", "NCCL", "collectives")


def _cfg(tmp_path, *extra: str):
    return load_config(None, [f"--logging.dir={tmp_path / 'run'}", "--model.name=gpt-tiny", *extra])


def _rows(stdout: str) -> dict[str, str]:
    """Each check's status as the table shows it."""
    out = {}
    for line in stdout.splitlines():
        for name in ROWS:
            if line.startswith(f" {name} "):
                out[name] = line[len(name) + 1 :].split()[0]
    return out


# ----------------------------------------------------------------------------- pieces
def test_one_rank_passes_every_check(tmp_path):
    checks = run_doctor(_cfg(tmp_path), LocalComm())
    assert [c.name for c in checks] == list(ROWS)
    assert all(c.status == OK for c in checks), checks
    assert passed(checks)
    assert not list((tmp_path / "run" / "checkpoints").iterdir())  # the probe is gone


def test_a_plan_for_other_devices_fails_its_row(tmp_path):
    plan = tmp_path / "plan.json"
    simple_plan("even", Cluster.parse("cpu:slowdown=4,cpu"), "gpt-tiny", 16, 6, "fp32").to_json(
        plan
    )
    cluster = Cluster.parse(GOOD)
    row, matched = plan_check(_cfg(tmp_path), DoctorOptions(plan=str(plan)), cluster)
    assert row.status == FAIL and matched is None
    assert "was made for other devices" in row.found and "cephalo plan" in row.fix
    # the same devices in another order: reordered, ok
    simple_plan("even", Cluster.parse("cpu:slowdown=2,cpu"), "gpt-tiny", 16, 6, "fp32").to_json(
        plan
    )
    row, matched = plan_check(_cfg(tmp_path), DoctorOptions(plan=str(plan)), cluster)
    assert row.status == OK and "reordered" in row.found
    assert [r.device for r in matched.ranks] == ["cpu", "cpu:slowdown=2"]


def test_memory_rows(tmp_path):
    plan = simple_plan("even", Cluster.parse("cpu,cpu"), "gpt-tiny", 16, 6, "fp32")
    plan.ranks[1].predicted_peak_memory_bytes = 2**30
    row = device_memory_check([(2**32, "budget"), (2**20, "budget")], plan)
    assert row.status == FAIL and "rank(s) 1 cannot hold" in row.fix
    assert device_memory_check([(2**32, "budget")] * 2, plan).status == OK
    plan.ranks[0].predicted_host_bytes = 3 * 2**30
    cluster = Cluster.parse("cpu,cpu@node1")
    row = host_memory_check([2**30, 2**34], cluster, plan)
    assert row.status == FAIL and "node0: 1 GiB available, plan 3 GiB" in row.found
    assert host_memory_check([2**34, 2**34], cluster, plan).status == OK
    assert available_host_bytes(str(tmp_path / "none")) is None


def test_nccl_warns_on_several_interfaces_without_ifname():
    facts = {
        "env": dict.fromkeys(
            ("NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE", "NCCL_DEBUG")
        ),
        "interfaces": ["eth0", "ib0"],
    }
    two_nodes = Cluster.parse("cpu,cpu@node1")
    assert nccl_check([facts, facts], "nccl", two_nodes).status == WARN
    assert nccl_check([facts, facts], "gloo", two_nodes).status == OK
    assert nccl_check([facts, facts], "nccl", Cluster.parse("cpu,cpu")).status == OK
    named = {**facts, "env": {**facts["env"], "NCCL_SOCKET_IFNAME": "eth0"}}
    row = nccl_check([named, named], "nccl", two_nodes)
    assert row.status == OK and "SOCKET_IFNAME=eth0" in row.found


def test_uneven_sizes_hold_a_zero_shard():
    assert uneven_sizes(1) == [5]
    sizes = uneven_sizes(3)
    assert 0 in sizes and len(set(sizes)) == 3


def test_the_table_fits_80_columns():
    checks = [
        Check("ranks", OK, "2 rank(s) on 1 node(s):\n0 -> node0 cpu (4 GiB)"),
        Check("plan", FAIL, "plan x.json was made for other devices " * 5, "make the plan [here]"),
    ]
    console = Console(width=80, record=True)
    console.print(doctor_table(checks, "cephalo doctor"))
    text = console.export_text()
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80
    assert "fix: make the plan [here]" in text


def test_help_teaches(capsys):
    with pytest.raises(SystemExit):
        cli_main(["doctor", "--help"])
    out = capsys.readouterr().out
    assert "torchrun --nproc-per-node 4 -m cephalo doctor" in out
    assert "checkpoints" in out and "Exit code 0" in out


# ----------------------------------------------------------------------------- emulated clusters
def _doctor(tmp_path, *extra: str, env: dict[str, str] | None = None, devices: str = GOOD):
    cmd = [sys.executable, "-m", "cephalo", "doctor", "--devices", devices]
    cmd += [f"--logging.dir={tmp_path / 'run'}", "--timeout", "20", *extra]
    proc = run_tagged(cmd, timeout_s=90, env={**os.environ, **(env or {})})
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc, _rows(proc.stdout)


@pytest.mark.slow
def test_a_good_emulated_cluster_passes(tmp_path):
    plan = tmp_path / "plan.json"
    simple_plan("even", Cluster.parse(GOOD), "gpt-tiny", 16, 6, "fp32").to_json(plan)
    proc, rows = _doctor(tmp_path, "--plan", str(plan))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert rows == dict.fromkeys(ROWS, OK), proc.stdout
    assert "1 -> node0 cpu:slowdown=2 (64 MiB)" in proc.stdout


@pytest.mark.slow
def test_a_wrong_plan_fails_its_row(tmp_path):
    plan = tmp_path / "plan.json"
    simple_plan("even", Cluster.parse("cpu:slowdown=4,cpu"), "gpt-tiny", 16, 6, "fp32").to_json(
        plan
    )
    proc, rows = _doctor(tmp_path, "--plan", str(plan))
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert rows["plan"] == FAIL and rows["ranks"] == OK, proc.stdout
    assert "made for other devices" in proc.stdout


@pytest.mark.slow
def test_a_rank_without_the_shared_checkpoint_directory_fails(tmp_path):
    """Two emulated nodes with filesystems of their own (`parallel.emulate_node_fs`)."""
    private = "--parallel.emulate_node_fs=private"
    proc, rows = _doctor(tmp_path, private, devices="cpu@node0,cpu@node1")
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert rows["checkpoints"] == FAIL, proc.stdout
    assert [k for k, v in rows.items() if v != OK] == ["checkpoints"]
    assert "0<->1" in proc.stdout and "shared storage" in proc.stdout


@pytest.mark.slow
def test_too_little_memory_fails_its_row(tmp_path):
    plan_path = tmp_path / "plan.json"
    plan = simple_plan("even", Cluster.parse(GOOD), "gpt-tiny", 16, 6, "fp32")
    plan.ranks[1].predicted_peak_memory_bytes = 100 * 2**20  # the device has 64 MiB
    plan.to_json(plan_path)
    proc, rows = _doctor(tmp_path, "--plan", str(plan_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert rows["device memory"] == FAIL and rows["plan"] == OK, proc.stdout
    assert "plan peak 100 MiB (too little)" in proc.stdout
