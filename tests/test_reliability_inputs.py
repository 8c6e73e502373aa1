"""Bad input through the front door: `cephalo train ...` exits with code 2 and ONE line
`cephalo train: error: <what is wrong and what to do>`, never a traceback.

The units behind each message have their own tests (test_cluster, test_plan_json, test_planner,
test_checkpoint, test_data, test_memory, test_comm, ...); these check that the message is what
the user actually sees when the whole job starts from the command line (one process, gpt-tiny,
so each case takes about a second). docs/reliability.md maps every row to its tests.

Also here: a damaged newest checkpoint (truncated data, or a missing COMPLETE marker plus a
half-written staging directory) is skipped with a warning and the job resumes from the
previous one, continuing the uninterrupted run's losses exactly.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from cephalo.cli import main as cli_main
from cephalo.log import logger
from cephalo.planner.makers import simple_plan
from cephalo.specs.cluster import Cluster
from cephalo.train.checkpoint import MARKER
from cephalo.train.config_manager import load_config
from cephalo.train.trainer import train
from data_helpers import save_tokenizer, write_jsonl


def job_args(run_dir, *extra: str) -> list[str]:
    return [
        f"--logging.dir={run_dir}",
        "--logging.progress=false",
        "--model.name=gpt-tiny",
        "--data.seq_len=16",
        "--train.global_batch_size=4",
        "--train.steps=10",
        "--train.warmup_steps=2",
        "--train.eval_every=0",
        "--parallel.plan=even",
        "--parallel.timeout_s=20",
        "--checkpoint.every=5",
        *extra,
    ]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Files the bad-input cases point at."""
    root = tmp_path_factory.mktemp("inputs")
    simple_plan("even", Cluster.parse("cpu,cpu"), "gpt-tiny", 16, 4, "fp32").to_json(
        root / "plan-2-ranks.json"
    )
    simple_plan("even", Cluster.parse("cpu"), "hf-gpt2-tiny", 16, 4, "fp32").to_json(
        root / "plan-other-model.json"
    )
    simple_plan("even", Cluster.parse("cpu"), "gpt-tiny", 16, 6, "fp32").to_json(
        root / "plan-batch-6.json"
    )
    (root / "plan-broken.json").write_text('{"version": 1, "ranks": [')
    (root / "tiny-corpus").mkdir()
    (root / "tiny-corpus" / "a.txt").write_text("a corpus far smaller than one global batch\n")
    write_jsonl(root / "no-field.jsonl", [{"text": "fine"}, {"body": "the text is elsewhere"}])
    write_jsonl(root / "empty.jsonl", [{"text": ""}, {"text": None}])
    save_tokenizer(root / "tokenizer-400", vocab_size=400)  # gpt-tiny embeds 256 ids
    return root


CASES = {
    # cluster spec
    "unknown device type": (
        ["--parallel.devices=h200x"],
        "unknown device type 'h200x'. A GPU the catalog does not list: write it as "
        "gpu-h200x:mem=SIZE",
    ),
    "malformed device spec": (["--parallel.devices=cpu:slowdown=0"], "bad slowdown '0'"),
    "devices vs processes": (["--parallel.devices=cpu,cpu"], "parallel.devices lists 2 device(s)"),
    # plan
    "plan for another world size": (
        ["--parallel.plan={root}/plan-2-ranks.json"],
        "the plan is for 2 ranks but the job has 1",
    ),
    "plan for another model": (
        ["--parallel.plan={root}/plan-other-model.json"],
        "the plan is for model 'hf-gpt2-tiny' but the job trains 'gpt-tiny'",
    ),
    "plan for another global batch": (
        ["--parallel.plan={root}/plan-batch-6.json"],
        "splits a global batch of 6 but train.global_batch_size is 4",
    ),
    "plan not JSON": (["--parallel.plan={root}/plan-broken.json"], "not valid JSON"),
    "plan path is a directory": (
        ["--parallel.plan={root}"],
        "is neither `auto`, `even`, `proportional` nor",
    ),
    # data
    "dataset smaller than a global batch": (
        ["--data.path={root}/tiny-corpus"],
        "but one global batch needs 4: use a smaller seq_len",
    ),
    "missing data": (["--data.path={root}/nothing-here"], "does not exist"),
    "JSONL line without the text field": (
        ["--data.path={root}/no-field.jsonl"],
        "no-field.jsonl, line 2: the record has no 'text' field (its fields: body)",
    ),
    "empty dataset": (
        ["--data.path={root}/empty.jsonl"],
        "the dataset is empty: {root}/empty.jsonl holds no text in field 'text'",
    ),
    "tokenizer larger than the vocabulary": (
        ["--data.path={root}/tiny-corpus", "--data.tokenizer={root}/tokenizer-400"],
        "has 400 ids but model gpt-tiny has only 256 embedding rows",
    ),
    # memory
    "rank over its memory budget": (
        ["--parallel.devices=cpu:mem=600KiB"],
        "rank 0 ran out of its memory budget on cpu: 'state' requested",
    ),
    # runtime
    "backend without its hardware": (["--parallel.backend=nccl"], "backend 'nccl' needs CUDA GPUs"),
    "checkpoint that does not exist": (
        ["--checkpoint.resume={root}/step_000005"],
        "no such checkpoint",
    ),
    # config and model
    "config value out of range": (["--train.lr=-1"], "train.lr must be a positive number"),
    "config key misspelt": (
        ["--train.setps=3"],
        "unknown config key in [train] 'setps'. Did you mean 'steps'?",
    ),
    "unknown model": (["--model.name=gpt-huge"], "unknown model 'gpt-huge'"),
    "bad model override": (["--model.overrides=n_layer=-1"], "n_layer must be >= 1"),
}


@pytest.fixture(autouse=True)
def fresh_log_handler(monkeypatch):
    """`init_logging` binds its handler to the sys.stderr of the moment; give each test its own
    (pytest swaps sys.stderr per test, and a handler on a closed stream prints a traceback)."""
    monkeypatch.setattr(logger, "handlers", [])


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    rc = cli_main(argv)
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_one_clear_error(case, inputs, tmp_path, capsys):
    extra, message = CASES[case]
    rc, err = run_cli(
        ["train", *job_args(tmp_path / "run", *(e.format(root=inputs) for e in extra))], capsys
    )
    assert rc == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("cephalo train: error: ")]
    assert len(errors) == 1, err
    assert message.format(root=inputs) in err, err


def test_plan_that_does_not_fit_names_each_ranks_shortfall(capsys):
    rc, err = run_cli(
        [
            "plan",
            "--cluster",
            "t4:mem=5GiB,t4:mem=5GiB",
            "--model",
            "gpt-2.7b",
            "--global-batch",
            "64",
            "--no-host-state",  # with host state it fits (tests/test_host_state.py)
        ],
        capsys,
    )
    assert rc == 2 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("cephalo plan: error: ")]
    assert "gpt-2.7b does not fit on this cluster" in line
    assert "keeping part of the training state in host memory would fit" in line
    assert "rank 0 (t4) needs" in line and "rank 1 (t4) needs" in line and "short" in line
    assert "add about" in line  # and what to do about it


def test_unsupported_torch_version(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.3.1")
    rc, err = run_cli(["train", *job_args(tmp_path / "run")], capsys)
    assert rc == 2 and "Traceback" not in err
    assert "cephalo train: error: torch 2.3.1 is too old: cephalo needs torch >= 2.4" in err


# ----------------------------------------------------------------------------- damaged checkpoints
def _truncate_data(step_dir):
    data = next(p for p in step_dir.iterdir() if p.suffix == ".distcp")
    os.truncate(data, data.stat().st_size // 2)


def _unpublished(step_dir):
    """A crash mid-save: the marker never written, and a staging directory left behind."""
    (step_dir / MARKER).unlink()
    shutil.copytree(step_dir, step_dir.with_name("step_000015.tmp"))


@pytest.mark.parametrize(
    "damage", [_truncate_data, _unpublished], ids=["truncated-data", "no-marker"]
)
def test_damaged_newest_checkpoint_resumes_from_the_previous(damage, tmp_path, caplog):
    run = tmp_path / "run"
    full = train(load_config(None, job_args(run)))
    damage(run / "checkpoints" / "step_000010")
    logger.addHandler(caplog.handler)  # the cephalo logger does not propagate
    with caplog.at_level(logging.WARNING, logger="cephalo"):
        resumed = train(load_config(None, job_args(run)))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(w.startswith("skipping checkpoint step_000010: ") for w in warnings), warnings
    assert resumed.start_step == 5 and sorted(resumed.losses) == list(range(6, 11))
    for step in range(6, 11):
        assert resumed.losses[step] == full.losses[step], step  # same plan, same state: bit for bit
    assert (run / "checkpoints" / "step_000010" / MARKER).is_file()  # written again, complete


def test_restart_on_torchruns_shared_store_names_the_fix(monkeypatch):
    """A torchrun restart on the shared rendezvous store cannot start its process group
    (pytorch#135712); the error says which variable fixes it (tests/test_elastic.py runs
    real restarts with it set)."""
    from cephalo.errors import CephaloError
    from cephalo.launch.elastic import free_port
    from cephalo.runtime.collectives.dist import SHARED_STORE_ENV, init_distributed

    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "1",
        "TORCHELASTIC_MAX_RESTARTS": "3",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(
        CephaloError,
        match=f"could not start the gloo process group.*restart 1.*{SHARED_STORE_ENV}=1",
    ):
        init_distributed("gloo", timeout_s=1)
