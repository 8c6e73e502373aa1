"""The job config: TOML + overrides -> dataclasses, errors that name the key, generated docs."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from cephalo.errors import CephaloError
from cephalo.train.config import JobConfig, section_class, section_names
from cephalo.train.config_manager import (
    add_config_arguments,
    config_from_args,
    config_help,
    config_markdown,
    config_to_toml,
    field_docs,
    field_types,
    load_config,
    parse_overrides,
)

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.toml") if "[model]" in p.read_text())
"""The example job configs (configs/ also holds the advisor's offers file)."""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_defaults_are_valid_and_documented():
    cfg = load_config(None)
    assert cfg == JobConfig()
    for section in section_names():
        cls = section_class(section)
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"[{section}] fields without a docstring: {missing}"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_load_and_set_every_section(path: Path):
    cfg = load_config(path)
    import tomllib

    table = tomllib.loads(path.read_text())
    assert sorted(table) == sorted(section_names()), "example configs show every section"
    # the file's values made it into the dataclasses
    for section, values in table.items():
        for key, value in values.items():
            got = getattr(getattr(cfg, section), key)
            assert (list(got) if isinstance(got, tuple) else got) == value, f"{section}.{key}"


def test_expected_example_configs_exist():
    assert {p.name for p in CONFIGS} >= {
        "demo.toml",
        "gpt-small.toml",
        "llama-tiny.toml",
        "hf-gpt2.toml",
    }


def test_toml_file_and_overrides_by_type(tmp_path: Path):
    path = write(
        tmp_path,
        """
[train]
steps = 40
lr = 1          # an integer where a float is expected is fine
betas = [0.8, 0.99]
[model]
overrides = { dropout = 0.1 }
[data]
path = "tokens.bin"
""",
    )
    cfg = load_config(
        path,
        [
            "--train.steps=50",
            "--train.eps",
            "1e-6",  # space-separated form
            "--logging.progress=false",
            "--parallel.devices=cpu,cpu:slowdown=2",
            "--data.path=none",  # Optional: back to unset
            "--model.overrides.n_layer=4",  # one entry of a table merges
            "--checkpoint.keep_last=5",
            "--train.betas=[0.7, 0.9]",
        ],
    )
    assert cfg.train.steps == 50 and cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.train.eps == 1e-6
    assert cfg.train.betas == (0.7, 0.9)
    assert cfg.logging.progress is False
    assert cfg.parallel.devices == "cpu,cpu:slowdown=2"
    assert cfg.data.path is None
    assert cfg.model.overrides == {"dropout": 0.1, "n_layer": 4}
    assert cfg.checkpoint.keep_last == 5


def test_cli_table_values_are_typed():
    cfg = load_config(None, ["--model.overrides=dropout=0.25,bias=false,act=gelu,n_head=8"])
    assert cfg.model.overrides == {"dropout": 0.25, "bias": False, "act": "gelu", "n_head": 8}


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (
            ["--train.lrr=1e-3"],
            ["unknown config key in [train] 'lrr'", "Did you mean 'lr'", "min_lr"],
        ),
        (["--trian.steps=3"], ["unknown config section 'trian'", "Did you mean 'train'"]),
        (["--train.steps=ten"], ["train.steps", "'ten'", "expected int"]),
        (["--train.steps=1.5"], ["train.steps", "expected int"]),
        (
            ["--train.betas=0.9"],
            ["train.betas", "expected [float, float]", "expected 2 items, got 1"],
        ),
        (["--logging.progress=maybe"], ["logging.progress", "expected bool"]),
        (["--parallel.mode=pipeline"], ["parallel.mode", '"lga" | "standard"']),
        (
            ["--parallel.compile=fast"],
            ["parallel.compile", '"auto" | "off" | "graphs" | "inductor"'],
        ),
        (["--train.objective=ppo"], ["train.objective", '"sft" | "dpo"']),
        (["--train.dpo_loss=hinge"], ["train.dpo_loss", '"sigmoid" | "ipo"']),
        (["--train.steps"], ["has no value"]),
        (["steps=3"], ["--section.key=value"]),
    ],
)
def test_bad_overrides_name_the_key(overrides, fragments):
    with pytest.raises(CephaloError) as err:
        load_config(None, overrides)
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize(
    "text, fragments",
    [
        ('[train]\nsteps = "10"\n', ["train.steps = '10'", "expected int"]),
        ("[train]\nsteps = true\n", ["train.steps", "expected int"]),  # bool is not an int
        ("[logging]\nprogress = 1\n", ["logging.progress", "expected bool"]),
        ("[model]\noverrides = 3\n", ["model.overrides", "expected table"]),
        ("[modle]\nname = 'x'\n", ["unknown config section 'modle'", "Did you mean 'model'"]),
        ("[data]\nseqlen = 3\n", ["Did you mean 'seq_len'", "val_fraction"]),
        ("train = 3\n", ["must be a [train] table"]),
        ("[train\nsteps = 3\n", ["not valid TOML"]),
    ],
)
def test_bad_files_name_the_key(tmp_path: Path, text: str, fragments: list[str]):
    with pytest.raises(CephaloError) as err:
        load_config(write(tmp_path, text))
    for fragment in fragments:
        assert fragment in str(err.value)


def test_missing_file(tmp_path: Path):
    with pytest.raises(CephaloError, match="not found"):
        load_config(tmp_path / "nope.toml")


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["--train.steps=0"], "train.steps must be >= 1"),
        (["--train.lr=0"], "train.lr must be a positive number"),
        (["--train.lr=nan"], "train.lr must be a positive number"),
        (
            ["--train.steps=10", "--train.warmup_steps=10"],
            "warmup_steps (10) must be smaller than train.steps (10)",
        ),
        (["--train.min_lr=1"], "train.min_lr must be in [0, train.lr"),
        (["--train.betas=0.9,1.0"], "train.betas must both be in [0, 1)"),
        (["--data.val_fraction=1"], "data.val_fraction must be in [0, 1)"),
        (["--data.val_fraction=0"], "needs held-out data"),
        (["--checkpoint.keep_last=0"], "checkpoint.keep_last must be >= 1"),
        (
            ["--parallel.plan=missing.json"],
            "neither `auto`, `even`, `proportional` nor an existing plan file",
        ),
        (["--parallel.timeout_s=-1"], "parallel.timeout_s must be > 0"),
        (["--logging.log_every=0"], "logging.log_every must be >= 1"),
        (["--train.dpo_beta=0"], "train.dpo_beta must be > 0"),
        (["--train.dpo_beta=-0.1"], "train.dpo_beta must be > 0"),
    ],
)
def test_range_validation(overrides, fragment):
    with pytest.raises(CephaloError) as err:
        load_config(None, overrides)
    assert fragment in str(err.value)


def test_validation_reports_every_problem():
    with pytest.raises(CephaloError) as err:
        load_config(None, ["--train.steps=0", "--profile.repeats=0"])
    assert "train.steps" in str(err.value) and "profile.repeats" in str(err.value)


def test_eval_off_allows_no_validation_data():
    cfg = load_config(None, ["--data.val_fraction=0", "--train.eval_every=0"])
    assert cfg.data.val_fraction == 0


def test_plan_file_path_accepted(tmp_path: Path):
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    assert load_config(None, [f"--parallel.plan={plan}"]).parallel.plan == str(plan)


def test_toml_round_trip(tmp_path: Path):
    cfg = load_config(
        None,
        [
            '--model.overrides=dropout=0.1,name="x y"',
            "--parallel.devices=cpu,cpu:slowdown=2",
            "--train.eps=1e-12",
            '--logging.dir=runs/with "quotes"',
        ],
    )
    for comments in (False, True):
        path = write(tmp_path, config_to_toml(cfg, comments=comments))
        assert load_config(path) == cfg


def test_derived_paths():
    cfg = load_config(None, ["--logging.dir=runs/x"])
    assert cfg.checkpoint_dir == Path("runs/x/checkpoints")
    assert cfg.profile_cache == Path("runs/x/profile.json")
    assert cfg.metrics_path == Path("runs/x/metrics.jsonl")
    cfg = load_config(None, ["--checkpoint.dir=/ckpt"])
    assert cfg.checkpoint_dir == Path("/ckpt")


def test_parse_overrides_splits_forms():
    assert parse_overrides(
        ["--train.lr=1", "--data.seq_len", "8", "--model.overrides.dropout=0"]
    ) == [
        ("train", "lr", "1"),
        ("data", "seq_len", "8"),
        ("model", "overrides", "dropout=0"),
    ]


def test_argparse_options_come_from_the_dataclasses():
    parser = argparse.ArgumentParser(prog="cephalo train")
    add_config_arguments(parser)
    help_text = parser.format_help()
    for section in section_names():
        for name, doc in field_docs(section_class(section)).items():
            assert f"--{section}.{name}" in help_text
            assert doc.split()[0] in help_text
    args = parser.parse_args(["--train.lr", "2e-3", "--logging.tensorboard=true"])
    cfg = config_from_args(args)
    assert cfg.train.lr == 2e-3 and cfg.logging.tensorboard is True
    assert cfg.train.steps == JobConfig().train.steps  # not given: the default, not None


def test_help_lists_every_field_with_type_and_default():
    text = config_help()
    for section in section_names():
        for name in field_types(section_class(section)):
            assert f"{section}.{name}:" in text
    assert 'train.lr_schedule: "cosine" | "constant" = "cosine"' in text


def test_docs_config_md_is_generated_and_current():
    assert (ROOT / "docs" / "config.md").read_text() == config_markdown(), (
        "docs/config.md is stale: run python scripts/gen_config_docs.py"
    )
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_config_docs.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_parallel_settings_reach_the_engine():
    from cephalo.specs.cluster import Cluster
    from cephalo.train.config_manager import engine_config

    device = Cluster.parse("cpu:slowdown=2,mem=64MiB").devices[0]
    default = engine_config(load_config(None, []), device, emulated=True)
    assert default.overlap_reduce and default.validate_collectives is None
    assert not default.validate_every_step
    assert default.slowdown == 2 and default.memory_budget_bytes == 64 << 20
    assert default.compile == "auto"
    every = engine_config(
        load_config(None, ["--parallel.check_collectives=every_step"]), device, emulated=False
    )
    assert every.validate_every_step and every.memory_budget_bytes is None
    compiled = load_config(None, ["--parallel.compile=inductor"])
    assert engine_config(compiled, device, emulated=False).compile == "inductor"
    off = engine_config(
        load_config(None, ["--parallel.check_collectives=off", "--parallel.overlap_reduce=false"]),
        device,
        emulated=False,
    )
    assert off.validate_collectives is False and not off.overlap_reduce
    with pytest.raises(CephaloError, match="check_collectives"):
        load_config(None, ["--parallel.check_collectives=sometimes"])


def test_unset_warmup_fits_short_runs_and_a_set_one_is_kept():
    """Issue 41, point 8: `--train.steps 5` with an example config runs (an unset warmup is a
    tenth of a run shorter than 100 steps, said once); a warmup the user set stays as set, and
    one as long as the run is still the clear error."""
    for steps, want in ((5, 0), (20, 2), (99, 9), (100, 10), (5000, 10)):
        warmup, note = load_config(None, [f"--train.steps={steps}"]).train.warmup()
        assert warmup == want and (note is not None) == (steps < 100), steps
    assert (
        "2 warmup step(s) for a run of 20"
        in load_config(None, ["--train.steps=20"]).train.warmup()[1]
    )
    assert load_config(None, ["--train.steps=5", "--train.warmup_steps=3"]).train.warmup() == (
        3,
        None,
    )
    for name in ("chat-finetune.toml", "llama-tiny.toml", "hf-gpt2.toml"):
        assert load_config(ROOT / "configs" / name, ["--train.steps=5"]).train.warmup()[0] == 0
    with pytest.raises(
        CephaloError,
        match=r"\(8\) must be smaller than train.steps \(5\): lower it, or leave it unset",
    ):
        load_config(None, ["--train.steps=5", "--train.warmup_steps=8"])
