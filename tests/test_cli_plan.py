"""`cephalo plan` / `cephalo simulate` end to end on the catalog, and the paper's acceptance numbers."""

import json
import math

import pytest

from cephalo import Plan
from cephalo.cli import main
from cephalo.costmodel.sources import catalog_cost_model
from cephalo.planner.makers import make_plan
from cephalo.specs.catalog.models import get_model_spec
from cephalo.specs.cluster import Cluster

PAPER = [
    "--cluster",
    "2xl4,a6000,p40",
    "--model",
    "gpt-2.7b",
    "--global-batch",
    "64",
    "--seq-len",
    "512",
    "--dtype",
    "fp16",
]


def _reference_plan_json(path, with_meta=False):
    """The authors' plan (data README): batches [13, 12, 34, 5], micro-batches per GPU [1, 2, 1, 1]
    (a count: the second L4 runs 2 micro-batches of 6), equal shards."""
    types, batches, counts = ["l4", "l4", "a6000", "p40"], [13, 12, 34, 5], [1, 2, 1, 1]
    ranks = [
        {
            "rank": i,
            "device": t,
            "batch_size": b,
            "micro_batch_size": math.ceil(b / k),
            "num_micro_batches": k,
            "state_fraction": 0.25,
        }
        for i, (t, b, k) in enumerate(zip(types, batches, counts, strict=True))
    ]
    d = {
        "version": 1,
        "strategy": "manual",
        "model": "gpt-2.7b",
        "seq_len": 512,
        "global_batch_size": 64,
        "dtype": "fp16",
        "ranks": ranks,
    }
    if with_meta:
        d["meta"] = {"cluster_spec": "2xl4,a6000,p40"}
    path.write_text(json.dumps(d))
    return path


@pytest.fixture(scope="module")
def paper_cm():
    return catalog_cost_model(
        Cluster.parse("2xl4,a6000,p40"), get_model_spec("gpt-2.7b"), 512, "fp16"
    )


def test_paper_cluster_beats_reference_and_even(paper_cm, tmp_path):
    ceph = make_plan(paper_cm, 64, "cephalo")
    even = make_plan(paper_cm, 64, "even")
    ref = paper_cm.evaluate(Plan.from_json(_reference_plan_json(tmp_path / "ref.json")))
    assert ref.fits
    assert ceph.predicted.samples_per_s >= ref.samples_per_s
    assert ceph.predicted.samples_per_s >= 1.2 * even.predicted.samples_per_s
    assert paper_cm.evaluate(ceph).fits


def test_plan_command_writes_reloadable_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    assert main(["plan", *PAPER, "--strategy", "all", "--json", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    for word in ("cephalo:", "even:", "proportional:", "x even", "samples/s", "tokens/s"):
        assert word in text
    plan = Plan.from_json(out)
    assert plan.strategy == "cephalo" and plan.global_batch_size == 64 and plan.world_size == 4
    assert plan.meta["cluster_spec"] == "2xl4,a6000,p40"
    assert plan.meta["profile_source"] == "catalog"
    assert plan.meta["planner_wall_s"] > 0
    assert png.stat().st_size > 10_000
    # simulate reads the cluster from the plan's meta and reproduces the prediction
    assert main(["simulate", str(out)]) == 0
    sim = capsys.readouterr().out
    assert f"{plan.predicted.samples_per_s:.4g} samples/s" in sim


def test_simulate_hand_plan(tmp_path, capsys):
    path = _reference_plan_json(tmp_path / "ref.json")
    assert main(["simulate", str(path), "--cluster", "2xl4,a6000,p40"]) == 0
    assert "simulated:" in capsys.readouterr().out
    # without --cluster and without meta it says what to do
    assert main(["simulate", str(path)]) == 2
    assert "pass --cluster" in capsys.readouterr().err
    assert main(["simulate", str(_reference_plan_json(tmp_path / "m.json", with_meta=True))]) == 0


def test_simulate_flags_ranks_that_do_not_fit(tmp_path, capsys):
    d = json.loads(_reference_plan_json(tmp_path / "r.json").read_text())
    # everything on the P40: 64 samples on one 24 GiB device, the whole state too
    for r in d["ranks"]:
        r.update(batch_size=0, micro_batch_size=1, num_micro_batches=0, state_fraction=0.0)
    d["ranks"][3].update(
        batch_size=64, micro_batch_size=64, num_micro_batches=1, state_fraction=1.0
    )
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    assert main(["simulate", str(path), "--cluster", "2xl4,a6000,p40"]) == 1
    out = capsys.readouterr().out
    assert "does not fit" in out and "rank 3 (p40)" in out


def test_plan_command_errors(tmp_path, capsys):
    assert main(["plan", "--cluster", "2xl4,warp9", "--global-batch", "8"]) == 2
    assert "warp9" in capsys.readouterr().err
    assert main(["plan", "--cluster", "l4", "--global-batch", "0"]) == 2
    assert "--global-batch must be >= 1" in capsys.readouterr().err
    assert (
        main(["plan", "--cluster", "l4", "--global-batch", "8", "--plot", str(tmp_path / "x.txt")])
        == 2
    )
    # a 7B model on one 24 GiB GPU, state on the GPU: the message gives the shortfall and
    # what would fit (with host state it fits: tests/test_host_state.py)
    args = ["plan", "--cluster", "l4", "--model", "llama-7b", "--global-batch", "8"]
    assert main([*args, "--no-host-state"]) == 2
    err = capsys.readouterr().err
    assert "does not fit" in err and "short" in err and "more l4" in err
    assert main(["simulate", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_baseline_that_does_not_fit_is_reported_not_raised(capsys):
    # gpt-6.7b's state is 102 GiB: a fifth of it does not fit a 16 GiB T4, uneven shards do
    args = [
        "plan",
        "--cluster",
        "2xt4,2xa6000",
        "--model",
        "gpt-6.7b",
        "--global-batch",
        "32",
        "--strategy",
        "all",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "cephalo:" in out and "even does not fit" in out
    assert "even: does not fit" in out and "proportional: does not fit" in out
    assert "rank 0 (t4, batch 8) short" in out


def test_help_teaches(capsys):
    for cmd in ("plan", "simulate"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        text = capsys.readouterr().out
        assert "examples:" in text


def test_plan_and_simulate_from_measured_profiles(tmp_path, capsys):
    """--profiles: a `cephalo profile --out` file feeds the same cost model (here written by hand)."""
    from cephalo.specs.profile import CommProfile, MeasuredProfiles
    from planner_helpers import linear_profile

    profiles = {
        "cpu": linear_profile("cpu", 1e-3, 2e-3, 1e5, 1e-9, memory_bytes=2**30),
        "cpu:slowdown=3": linear_profile(
            "cpu:slowdown=3", 3e-3, 6e-3, 1e5, 1e-9, memory_bytes=2**30
        ),
    }
    path = tmp_path / "prof.json"
    MeasuredProfiles(
        profiles=profiles, comm=CommProfile(1e9, 1e-4), model="gpt-tiny", seq_len=32, dtype="fp32"
    ).save(path)
    out = tmp_path / "plan.json"
    spec = "cpu,cpu:slowdown=3,mem=1GiB"
    assert (
        main(
            [
                "plan",
                "--cluster",
                spec,
                "--global-batch",
                "16",
                "--profiles",
                str(path),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    plan = Plan.from_json(out)
    assert (plan.model, plan.seq_len, plan.dtype) == (
        "gpt-tiny",
        32,
        "fp32",
    )  # defaults from the profiles
    assert plan.meta["profile_source"] == f"measured:{path}"
    # three times slower: about a quarter of the batch
    assert plan.batch_sizes[0] > plan.batch_sizes[1] >= 1
    capsys.readouterr()
    assert main(["simulate", str(out), "--profiles", str(path)]) == 0
    assert f"{plan.predicted.samples_per_s:.4g} samples/s" in capsys.readouterr().out
    # without profiles a cpu cluster cannot be planned, and the error says how to get them
    assert main(["plan", "--cluster", spec, "--global-batch", "16"]) == 2
    assert "cephalo profile --devices" in capsys.readouterr().err


def test_plan_for_the_local_node_uses_its_available_memory(capsys, monkeypatch):
    """Finding 4: `--host-memory local` plans this machine's node with its available memory
    less the reserves (`usable_host_bytes`, for as many ranks as the node has GPUs), not 256
    GiB nor its physical RAM; a size sets it; a bad one is one message."""
    from cephalo.train import discovery

    asked: list[int] = []

    def usable(ranks):
        asked.append(ranks)
        return 5 * 2**30

    monkeypatch.setattr(discovery, "usable_host_bytes", usable)
    base = ["plan", "--cluster", "2xl4", "--global-batch", "8"]
    assert main([*base, "--host-memory", "local"]) == 0
    assert "host memory of node 0 (ranks 0, 1): 0.6 of 5.0 GiB used" in capsys.readouterr().out
    assert asked == [2]
    assert main([*base, "--host-memory", "3GiB"]) == 0
    assert "of 3.0 GiB used" in capsys.readouterr().out
    assert main([*base, "--host-memory", "lots"]) == 2
    assert "bad --host-memory 'lots'" in capsys.readouterr().err
