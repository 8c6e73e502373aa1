"""Docs that run: every `cephalo ...` command in README.md, docs/*.md and the comments of
configs/*.toml is checked against the CLI itself (issue 41, point 9).

- Whole commands (code blocks, `torchrun ... -m cephalo ...`, config comments) must parse: the
  CLI's own argparse accepts them (the parser runs, not the job).
- Inline mentions (`cephalo plan ... --json plan.json`) must name a real subcommand and only
  options that subcommand has (a renamed flag such as `--out` for `--json` fails here).
- The cheap ones run for real, in the order the page gives them (`plan`, `catalog`,
  `simulate` whose inputs exist: a plan file an earlier command wrote, the repository's
  configs); the rest (`run`, `train`, `profile`, `advise`, ...: GPUs, minutes) are parsed
  and their subcommand's `--help` must work.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from cephalo.cli import build_parser, main
from cephalo.errors import CephaloError
from cephalo.train.config_manager import parse_overrides

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))
RUN_FOR_REAL = ("plan", "catalog", "simulate")
SHELL_BLOCKS = ("bash", "sh", "shell", "console")
_CONTINUATION = re.compile(r"\\\n[#\s]*")


def _argv(line: str) -> list[str] | None:
    """The CLI arguments of one shell line (`cephalo ...`, `$ cephalo ...`, `torchrun ... -m
    cephalo ...`), None when the line is no cephalo command."""
    try:
        words = shlex.split(line.strip().removeprefix("$ "), comments=True)
    except ValueError:
        return None
    if words[:1] == ["cephalo"]:
        return words[1:]
    if "-m" in words and words[words.index("-m") + 1 : words.index("-m") + 2] == ["cephalo"]:
        return words[words.index("-m") + 2 :]
    return None


def _block_commands(text: str, shell: bool) -> list[list[str]]:
    """Whole commands in a code block: every line in a shell block, and in an unlabelled one
    those with arguments (an output table's title `cephalo plan` is not a command)."""
    out = []
    for line in _CONTINUATION.sub(" ", text).splitlines():
        argv = _argv(line)
        if argv and re.fullmatch(r"[a-z][a-z-]*", argv[0]) and (shell or len(argv) > 1):
            out.append(argv)
    return out


def documented_commands() -> tuple[list[tuple[str, list[str]]], list[tuple[str, list[str]]]]:
    """(whole commands, inline mentions), each with where it was found."""
    whole, inline = [], []
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"```([a-z]*)\n(.*?)```", text, re.S):
            for argv in _block_commands(m.group(2), m.group(1) in SHELL_BLOCKS):
                whole.append((page.name, argv))
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for m in re.finditer(r"`(cephalo [a-z][^`]*)`", prose):
            argv = _argv(m.group(1))
            if argv:
                inline.append((page.name, argv))
    for config in CONFIGS:
        comments = "\n".join(
            line.lstrip()[1:]
            for line in config.read_text().splitlines()
            if line.lstrip()[:1] == "#"
        )
        for line in _CONTINUATION.sub(" ", comments).splitlines():
            for m in re.finditer(r"`([^`]*cephalo [a-z][^`]*)`", line):  # a mention
                argv = _argv(m.group(1))
                if argv:
                    inline.append((config.name, argv))
            if "`" not in line and (argv := _argv(line)):  # `#   cephalo run ...`
                whole.append((config.name, argv))
    return whole, inline


WHOLE, INLINE = documented_commands()


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The CLI's complaint about `argv` as `cephalo.cli.main` parses it (argparse, then the
    `--section.key value` config overrides of commands that take a config), or None when it
    accepts it (or prints help)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args, extra = parser.parse_known_args(argv)
        if extra and not hasattr(args, "config"):
            return f"unrecognized arguments: {' '.join(extra)}"
        if extra:
            parse_overrides(extra)
    except SystemExit as e:
        if e.code:
            return err.getvalue().strip().splitlines()[-1]
    except CephaloError as e:
        return str(e)
    return None


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_the_docs_have_commands_to_check():
    """The extraction finds the pages' commands (an extraction that finds none checks nothing)."""
    subcommands = {argv[0] for _, argv in WHOLE}
    assert len(WHOLE) >= 40 and len(INLINE) >= 100
    assert {"plan", "run", "train", "advise", "prepare-data", "export"} <= subcommands
    assert any(where.endswith(".toml") for where, _ in WHOLE)


def test_every_documented_command_parses():
    parser = build_parser()
    bad = [
        f"{where}: cephalo {shlex.join(argv)}: {problem}"
        for where, argv in WHOLE
        if (problem := _parse(parser, argv))
    ]
    assert not bad, "\n".join(bad)


def test_inline_mentions_name_real_subcommands_and_options():
    subs = _subparsers(build_parser())
    bad = []
    for where, argv in INLINE:
        sub = argv[0]
        if sub.endswith(":"):  # a quoted message (`cephalo run: error ...`), not a command
            continue
        if sub not in subs:
            bad.append(f"{where}: `cephalo {shlex.join(argv)}`: no subcommand {sub!r}")
            continue
        options = set(subs[sub]._option_string_actions)
        for word in argv[1:]:
            flag = word.strip("[]").split("=", 1)[0]
            if flag.startswith("--") and flag not in options and not flag.startswith("--model."):
                if re.fullmatch(r"--[a-z_]+\.[a-z_]+", flag) and "--config" in options:
                    continue  # a config override (`--train.steps`): checked by the parse test
                bad.append(f"{where}: `cephalo {shlex.join(argv)}`: {sub} has no {flag}")
    assert not bad, "\n".join(bad)


def _inputs_exist(argv: list[str], cwd: Path) -> bool:
    """Whether the files a command reads are here (a model directory the page tells the user
    to download or write first is not)."""
    from cephalo.modeling.registry import list_runnable_models
    from cephalo.specs.catalog.models import list_models

    known = {*(m.name for m in list_models()), *list_runnable_models()}
    for flag in ("--model", "--profiles", "--profile", "--cluster", "--have"):
        if flag in argv:
            value = argv[argv.index(flag) + 1]
            is_file = value.endswith((".json", ".toml", ".yaml"))
            if flag == "--model" and value not in known and not (cwd / value).exists():
                return False  # a directory the page writes or downloads first
            if (is_file or flag.startswith("--profile")) and not (cwd / value).exists():
                return False
    if argv[0] == "simulate":
        return (cwd / argv[1]).exists()
    return True


def _planned_gpus(argv: list[str]) -> int:
    from cephalo.specs.cluster import Cluster

    return len(Cluster.from_any(argv[argv.index("--cluster") + 1]).devices)


def _run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    return int(rc or 0), out.getvalue()


def test_cheap_documented_commands_run(tmp_path, monkeypatch):
    """`plan`, `catalog` and `simulate` as the pages give them, each distinct command once, in
    a scratch directory that sees the repository's configs: a `simulate PLAN.json` the pages
    mention reads the plan their first runnable `cephalo plan` writes. Plans of more than 8
    GPUs (the shard-group examples: seconds each) are parsed only, as is every other
    subcommand (GPUs, minutes), whose `--help` must work."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "120")
    parser = build_parser()
    candidates = [(w, a) for w, a in WHOLE + INLINE if a[0] in RUN_FOR_REAL]
    runnable = {}
    for where, argv in candidates:
        if "--help" in argv or _parse(parser, argv) or any("..." in w for w in argv):
            continue  # a mention with placeholders (parsed above)
        if argv[0] == "plan" and _planned_gpus(argv) > 8:
            continue
        runnable.setdefault(shlex.join(argv), (where, argv))
    first_plan = next(
        a for _, a in runnable.values() if a[0] == "plan" and _inputs_exist(a, tmp_path)
    )
    ran, failed = [], []
    for where, argv in runnable.values():
        if argv[0] == "simulate" and not (tmp_path / argv[1]).exists():
            rc, out = _run([*first_plan, "--json", argv[1]])
            assert rc == 0, out
        if not _inputs_exist(argv, tmp_path):
            continue
        rc, out = _run(argv)
        ran.append(argv[0])
        if rc:
            failed.append(f"{where}: cephalo {shlex.join(argv)} -> {rc}: {out[-300:]}")
    assert not failed, "\n".join(failed)
    assert set(ran) == set(RUN_FOR_REAL), ran
    for sub in sorted({a[0] for _, a in WHOLE} - set(RUN_FOR_REAL)):
        with pytest.raises(SystemExit) as e, contextlib.redirect_stdout(io.StringIO()):
            main([sub, "--help"])
        assert e.value.code == 0, sub
