"""`cephalo plan` / `cephalo simulate` end to end on the catalog, and the paper's acceptance numbers."""

import json
import math
from pathlib import Path

import pytest

from cephalo import Plan
from cephalo.cli import main
from cephalo.costmodel.sources import catalog_cost_model
from cephalo.planner.makers import make_plan
from cephalo.specs.catalog.models import get_model_spec
from cephalo.specs.cluster import Cluster

REPO = Path(__file__).resolve().parents[1]

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


# ----------------------------------------------------------- issue 41: portable plans, inputs
def test_plan_file_follows_the_model_shape_not_its_path(tmp_path, monkeypatch, capsys):
    """Point 4: a plan made for `./data/x` runs a job that names `data/x` or the absolute
    path (another machine's spelling), any directory of the same shape; another shape is
    refused with one message. A plan file without the fingerprint (older) still loads when
    the name names the same directory."""
    from cephalo.errors import CephaloError
    from cephalo.modeling.registry import build_model
    from cephalo.train.config_manager import load_config
    from cephalo.train.trainer import resolve_plan
    from hf_configs import tiny_config

    monkeypatch.chdir(tmp_path)
    tiny_config("llama").save_pretrained("data/x")
    tiny_config("llama").save_pretrained("elsewhere/y")  # same shape, another place
    tiny_config("llama", hidden_size=64).save_pretrained("data/wide")
    args = ["plan", "--cluster", "2xl4", "--model", "./data/x", "--global-batch", "8"]
    assert main([*args, "--seq-len", "32", "--json", "plan.json"]) == 0
    plan = Plan.from_json("plan.json")
    assert plan.model == "./data/x" and len(plan.meta["model_shape"]) == 16
    cluster = Cluster.parse("2xl4")

    def resolve(name: str, path: str = "plan.json") -> Plan:
        cfg = load_config(
            None,
            [f"--parallel.plan={path}", f"--model.name={name}", "--train.global_batch_size=8"],
        )
        return resolve_plan(cfg, cluster, 2, 0, build_model(name).spec.shape_fingerprint())

    for name in ("data/x", str(tmp_path / "data" / "x"), "elsewhere/y"):
        assert resolve(name).batch_sizes == plan.batch_sizes
    with pytest.raises(CephaloError, match="whose shape differs from the job's model 'data/wide'"):
        resolve("data/wide")
    # a plan file from before the fingerprint: matched by the directory its name names
    old = json.loads((tmp_path / "plan.json").read_text())
    del old["meta"]["model_shape"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert resolve("data/x", "old.json").batch_sizes == plan.batch_sizes
    with pytest.raises(CephaloError, match="the plan is for model './data/x' but the job trains"):
        resolve("elsewhere/y", "old.json")


def test_plan_refuses_a_sequence_past_the_context_as_run_does(tmp_path, capsys):
    """Point 6: one check (`ModelSpec.check_seq_len`) for `plan --seq-len` and a job's
    `data.seq_len`."""
    from cephalo.errors import CephaloError
    from cephalo.modeling.registry import model_spec_for
    from hf_configs import tiny_config

    directory = tmp_path / "m"
    tiny_config("llama", max_position_embeddings=64).save_pretrained(directory)
    args = ["plan", "--cluster", "l4", "--model", str(directory), "--global-batch", "4"]
    assert main([*args, "--seq-len", "100"]) == 2
    assert "--seq-len = 100 is longer than model" in capsys.readouterr().err
    assert main([*args, "--seq-len", "64"]) == 0
    with pytest.raises(CephaloError, match="data.seq_len = 100 is longer than model .* 64 tokens"):
        model_spec_for(str(directory)).check_seq_len(100, "data.seq_len")


def test_host_memory_is_an_input_and_always_said(tmp_path, monkeypatch, capsys):
    """Point 6: `--host-memory` on plan / simulate / advise; unsaid, a plan for this machine
    counts on its available memory and any other says the 256 GiB it assumed."""
    import argparse

    from cephalo.cli import build_parser
    from cephalo.commands import plan as plan_command

    monkeypatch.chdir(tmp_path)
    args = ["plan", "--cluster", "l4", "--model", "llama-7b", "--global-batch", "8"]
    assert main(args) == 0  # 7B fits one 24 GiB L4 with ~110 GiB of host state...
    assert "host memory: assumed 256 GiB per node" in capsys.readouterr().out
    assert main([*args, "--host-memory", "64GiB"]) == 2  # ...not on a 64 GiB box
    assert "does not fit" in capsys.readouterr().err
    assert main(["plan", "--cluster", "2xl4", "--global-batch", "8", "--json", "p.json"]) == 0
    capsys.readouterr()
    assert main(["simulate", "p.json", "--host-memory", "48GiB"]) == 0
    out = capsys.readouterr().out
    assert "of 48.0 GiB" in out and "assumed" not in out
    parsed = build_parser().parse_args(
        ["advise", "--offers", "o.toml", "--global-batch", "8", "--host-memory", "64GiB"]
    )
    assert parsed.host_memory == "64GiB"
    # advise's nodes are rented, not this machine: `local` is refused in one line
    offers = ["advise", "--offers", "configs/offers-example.toml", "--global-batch", "8"]
    monkeypatch.chdir(REPO)
    assert main([*offers, "--host-memory", "local"]) == 2
    assert "advise plans rented nodes" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(plan_command, "local_host_memory", lambda ranks=1: 3 * 1024**3)
    local = argparse.Namespace(host_memory=None)
    memory, note = plan_command.host_memory_of(local, "cpu,cpu:slowdown=2")
    assert memory == 3 * 1024**3 and "this machine's available memory" in note
    memory, note = plan_command.host_memory_of(local, "2xl4@node0,a6000@node1")
    assert memory is None and "assumed 256 GiB" in note


@pytest.mark.parametrize(
    "batch, micro, text",
    [(24, 15, "15+9"), (50, 15, "15x3+5"), (24, 8, "8x3"), (5, 5, "5x1"), (0, 1, "-")],
)
def test_micro_batch_column_shows_the_real_sizes(batch, micro, text):
    """Point 6: 24 samples in micro-batches of 15 are 15 + 9, not `15x2`; the engine runs the
    same sizes (`RankPlan.micro_batch_sizes`)."""
    from cephalo.planner.plan import RankPlan

    r = RankPlan(0, "l4", batch, micro, math.ceil(batch / micro), 1.0)
    assert r.micro_batches_text() == text
    assert sum(r.micro_batch_sizes()) == batch


SMALL_OFFERS = """
[[offer]]
name = "aws g6.12xlarge"
type = "l4"
max_count = 8
per_node = 4
price_per_hour = 1.1504
inter_node_bandwidth = "4GB/s"

[[offer]]
name = "runpod rtx 3090"
type = "rtx3090"
max_count = 4
per_node = 4
price_per_hour = 0.43
"""


def test_tables_fit_80_columns_without_cutting_device_names(tmp_path, capsys, monkeypatch):
    """Issue 41, point 5: at COLUMNS=80 no line of `plan`, `catalog` (devices and models) or
    `advise` is wider than 80 characters, no cell is cut with an ellipsis, and every device
    type one must type appears whole in the catalog."""
    from cephalo.specs.catalog.devices import DEVICES

    monkeypatch.setenv("COLUMNS", "80")
    offers = tmp_path / "offers.toml"
    offers.write_text(SMALL_OFFERS)
    runs = {
        "plan": ["plan", *PAPER],
        "catalog": ["catalog"],
        "models": ["catalog", "--models"],
        "model": ["catalog", "--model", "gpt-2.7b"],
        "advise": [
            "advise",
            "--offers",
            str(offers),
            "--model",
            "gpt-2.7b",
            "--global-batch",
            "64",
            "--launch-files",
            str(tmp_path / "launch"),
        ],
    }
    out = {}
    for name, argv in runs.items():
        assert main(argv) == 0
        out[name] = capsys.readouterr().out
        lines = out[name].splitlines()
        assert max(len(line) for line in lines) <= 80, (name, max(lines, key=len))
        assert "…" not in out[name], name
    from cephalo.specs.catalog.published import available_profiles

    assert set(DEVICES) <= set(out["catalog"].split())
    profiled = {e[1] for e in available_profiles() if e[0] == "gpt-2.7b"}
    assert profiled and profiled <= set(out["model"].replace("│", " ").split())
    assert "left out at 80 columns" in out["plan"]  # what it dropped is said
    # advise --launch-files: the chosen cluster's (4x rtx3090, one node) launch files
    script = (tmp_path / "launch" / "cephalo.sbatch").read_text()
    assert "#SBATCH --gpus-per-node=4" in script and "NCCL_P2P_DISABLE=1" in script
    # piped without COLUMNS: nothing dropped, nothing hard-wrapped
    monkeypatch.delenv("COLUMNS")
    assert main(["plan", *PAPER]) == 0
    piped = capsys.readouterr().out
    assert "busy s" in piped and "left out" not in piped
    assert any(len(line) > 100 for line in piped.splitlines())


def test_plan_prints_no_third_party_warnings(capsys, caplog):
    """Issue 41, point 7: `cephalo plan` prints no warning line (torchao's import-time
    warnings are checked through a real process that imports it, in
    test_launch.py::test_missing_package_is_one_line_in_seconds_without_native_frames)."""
    import logging

    with caplog.at_level(logging.WARNING):
        assert main(["plan", *PAPER]) == 0
    out = capsys.readouterr()
    assert out.err == "" and not caplog.records, (out.err, caplog.records)
    assert "warn" not in out.out.lower() and "Failed to load" not in out.out


def test_quiet_imports_capture_and_verbose_shows_once(monkeypatch):
    import logging
    import warnings

    from cephalo import envvars
    from cephalo.log import logger, quiet_imports

    shown: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: shown.append(record.getMessage())
    logger.addHandler(handler)
    try:
        for verbose in ("", "1"):
            monkeypatch.setenv(envvars.VERBOSE, verbose)
            shown.clear()
            for _ in range(2):
                with quiet_imports():
                    logging.getLogger("torchao").warning("Failed to load _C_mxfp8.so")
                    logging.getLogger("torch.utils._pytree").warning("an Enum subclass")
                    warnings.warn("deprecated on import", FutureWarning, stacklevel=1)
            texts = ("Failed to load _C_mxfp8.so", "an Enum subclass", "deprecated on import")
            for text in texts:
                assert sum(text in m for m in shown) == (1 if verbose else 0), shown
    finally:
        logger.removeHandler(handler)


def test_plan_for_the_local_node_uses_its_available_memory(capsys, monkeypatch):
    """Finding 4: `--host-memory local` plans this machine's node with its available memory
    less the reserves (`usable_host_bytes`, for as many ranks as the node has GPUs), not 256
    GiB nor its physical RAM; a size sets it; a bad one is one message."""
    from cephalo.train import discovery

    asked: list[int] = []

    def usable(ranks):
        asked.append(ranks)
        return 8 * 2**30

    monkeypatch.setattr(discovery, "usable_host_bytes", usable)
    base = ["plan", "--cluster", "2xl4", "--global-batch", "8"]
    assert main([*base, "--host-memory", "local"]) == 0
    assert "host memory of node 0 (ranks 0, 1): 3.8 of 8.0 GiB used" in capsys.readouterr().out
    assert asked == [2]
    assert main([*base, "--host-memory", "3GiB"]) == 0
    assert "of 3.0 GiB used" in capsys.readouterr().out
    assert main([*base, "--host-memory", "lots"]) == 2
    assert "bad --host-memory 'lots'" in capsys.readouterr().err
