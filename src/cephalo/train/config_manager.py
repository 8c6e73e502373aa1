"""Loading the job configuration: defaults, then a TOML file (`load_config(path)`), then
command-line overrides `--section.key=value` (parsed by the field's type); the sections'
field docstrings read back from the class source with `ast` (Python drops attribute
docstrings at runtime); the TOML, `--help` and markdown renderings. Unknown sections or keys
and values of the wrong type raise `CephaloError` with one clear message."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import json
import math
import textwrap
import types
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union

from cephalo.errors import CephaloError
from cephalo.train.config import JobConfig, section_class, section_names

if TYPE_CHECKING:
    import torch

    from cephalo.runtime.engine.config import EngineConfig
    from cephalo.specs.cluster import Device

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package
    import tomli as tomllib  # type: ignore[no-redef]


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Resolved type of each field (the module uses postponed annotations)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source with `ast`.

    Attribute docstrings are a convention (PEP 257, used by Sphinx and torchtitan-style configs)
    that the interpreter discards, so the source is the only place they exist.
    """
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (frozen app): the help just has no prose
        return {}
    class_node = ast.parse(source).body[0]
    docs: dict[str, str] = {}
    body = getattr(class_node, "body", [])
    for node, next_node in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(next_node, ast.Expr)
            and isinstance(next_node.value, ast.Constant)
            and isinstance(next_node.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(next_node.value.value)
    return docs


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise AssertionError(f"config field {f.name} has no default")  # every field must have one


def type_name(tp: Any) -> str:
    """How a field's type reads in help and error messages."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if _is_optional(tp):
        return f"{type_name(_strip_optional(tp))} (optional)"
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {type_name(args[0])}"
        return f"[{', '.join(type_name(a) for a in args)}]"
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return "table"
    return getattr(tp, "__name__", str(tp))


def _is_optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType) and type(None) in typing.get_args(tp)


def _strip_optional(tp: Any) -> Any:
    rest = [a for a in typing.get_args(tp) if a is not type(None)]
    return rest[0] if len(rest) == 1 else Union[tuple(rest)]  # noqa: UP007 (runtime construction)


# --------------------------------------------------------------------------------------------
# Values: TOML values and command-line strings -> the field's type
class _BadValue(Exception):
    """Internal: a value that does not fit a type; turned into a CephaloError naming the key."""


_TRUE = {"true", "yes", "on", "1"}


_FALSE = {"false", "no", "off", "0"}


_NONE = {"none", "null", ""}


def _parse_toml_literal(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as e:
        raise _BadValue(f"not a valid TOML value ({e})") from None


def _coerce(value: Any, tp: Any, from_cli: bool) -> Any:
    """Convert `value` (a TOML value, or a string from the command line) to type `tp`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_optional(tp):
        if value is None or (
            from_cli and isinstance(value, str) and value.strip().lower() in _NONE
        ):
            return None
        return _coerce(value, _strip_optional(tp), from_cli)
    if origin is Literal:
        if value not in args:
            raise _BadValue()
        return value
    if origin in (list, tuple):
        if from_cli and isinstance(value, str):
            text = value.strip()
            # `[0.9, 0.95]` (TOML array) or the shell-friendly `0.9,0.95`
            items = (
                _parse_toml_literal(text)
                if text.startswith("[")
                else [s.strip() for s in text.split(",") if s.strip()]
            )
            if not isinstance(items, list):
                raise _BadValue()
            elem_cli = not text.startswith("[")
        elif isinstance(value, list | tuple):
            items, elem_cli = list(value), False
        elif isinstance(value, str) and origin is list:  # TOML `key = "x"`: a list of one
            items, elem_cli = [value], False
        else:
            raise _BadValue()
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(items) != len(args):
                raise _BadValue(f"expected {len(args)} items, got {len(items)}")
            return tuple(_coerce(v, a, elem_cli) for v, a in zip(items, args, strict=True))
        elem = args[0]
        out = [_coerce(v, elem, elem_cli) for v in items]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if from_cli and isinstance(value, str):
            return _parse_cli_table(value)
        if not isinstance(value, dict):
            raise _BadValue()
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise _BadValue()
    if tp is int:
        if from_cli and isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                raise _BadValue() from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise _BadValue()
        return value
    if tp is float:
        if from_cli and isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                raise _BadValue() from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _BadValue()
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _BadValue()
        return value
    # a new field type needs a case above
    raise AssertionError(f"config type {tp!r} is not supported")


def _parse_cli_table(text: str) -> dict[str, Any]:
    """`k=v,k2=v2` or an inline TOML table `{ k = v }`; values are TOML literals, else strings."""
    text = text.strip()
    if text.startswith("{"):
        table = _parse_toml_literal(text)
        if not isinstance(table, dict):
            raise _BadValue("expected a table")
        return table
    table: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise _BadValue(f"expected key=value items, got {item!r}")
        try:
            table[key.strip()] = _parse_toml_literal(raw.strip())
        except _BadValue:
            table[key.strip()] = raw.strip()  # bare words are strings: activation=gelu
    return table


# --------------------------------------------------------------------------------------------
# Loading
def _unknown(kind: str, name: str, valid: Sequence[str]) -> CephaloError:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return CephaloError(f"unknown config {kind} {name!r}.{hint} Valid: {', '.join(valid)}.")


def _set_field(
    section_obj: Any, section: str, key: str, value: Any, from_cli: bool, origin: str
) -> None:
    types_ = field_types(type(section_obj))
    if key not in types_:
        raise _unknown(f"key in [{section}]", key, list(types_))
    tp = types_[key]
    try:
        setattr(section_obj, key, _coerce(value, tp, from_cli))
    except _BadValue as e:
        detail = f" ({e})" if str(e) else ""
        raise CephaloError(
            f"{section}.{key} = {value!r} ({origin}): expected {type_name(tp)}{detail}."
        ) from None


def _apply_table(cfg: JobConfig, table: dict[str, Any], origin: str) -> None:
    for section, values in table.items():
        if section not in section_names():
            raise _unknown("section", section, section_names())
        if not isinstance(values, dict):
            raise CephaloError(
                f"{origin}: `{section}` must be a [{section}] table, got {values!r}."
            )
        for key, value in values.items():
            _set_field(getattr(cfg, section), section, key, value, from_cli=False, origin=origin)


def parse_overrides(argv: Iterable[str]) -> list[tuple[str, str, str]]:
    """Split `--section.key=value` / `--section.key value` arguments into (section, key, value).

    Raises CephaloError (with a suggestion) for anything that is not a known section.key.
    """
    args = list(argv)
    out: list[tuple[str, str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name, sep, value = arg.removeprefix("--").partition("=")
        if not sep:
            if i + 1 >= len(args):
                raise CephaloError(
                    f"config override {arg!r} has no value: use --section.key=value."
                )
            value = args[i + 1]
            i += 1
        i += 1
        section, dot, key = name.partition(".")
        if not dot:
            raise CephaloError(f"config override {arg!r} is not of the form --section.key=value.")
        if section not in section_names():
            raise _unknown("section", section, section_names())
        cls = section_class(section)
        if key not in field_types(cls):
            # `--model.overrides.dropout=0.1`: one entry of a table field
            head, dot2, sub = key.partition(".")
            if dot2 and typing.get_origin(field_types(cls).get(head)) is dict:
                out.append((section, head, f"{sub}={value}"))
                continue
            raise _unknown(f"key in [{section}]", key, list(field_types(cls)))
        out.append((section, key, value))
    return out


def load_config(path: str | Path | None, overrides: Iterable[str] = ()) -> JobConfig:
    """Defaults <- TOML file (if any) <- `--section.key=value` overrides; validated."""
    cfg = JobConfig()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise CephaloError(f"config file {str(path)!r} not found (see configs/ for examples).")
        try:
            table = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise CephaloError(f"config file {str(path)!r} is not valid TOML: {e}.") from None
        except UnicodeDecodeError as e:
            raise CephaloError(
                f"config file {str(path)!r} is not UTF-8 text (byte {e.start}): save it as UTF-8 TOML."
            ) from None
        except OSError as e:
            raise CephaloError(
                f"cannot read config file {str(path)!r}: {e.strerror or e}."
            ) from None
        _apply_table(cfg, table, origin=str(path))
    for section, key, value in parse_overrides(overrides):
        section_obj = getattr(cfg, section)
        if typing.get_origin(field_types(type(section_obj))[key]) is dict:
            # table overrides merge into the table instead of replacing it
            try:
                merged = {**getattr(section_obj, key), **_parse_cli_table(value)}
            except _BadValue as e:
                raise CephaloError(f"--{section}.{key}={value}: {e}.") from None
            setattr(section_obj, key, merged)
            continue
        _set_field(section_obj, section, key, value, from_cli=True, origin="command line")
    cfg.validate()
    return cfg


# --------------------------------------------------------------------------------------------
# Output: TOML, help text, markdown, argparse
def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        if not value:
            return "{}"
        return (
            "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
        )
    raise AssertionError(f"cannot write {value!r} as TOML")


def _toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else json.dumps(key)


def config_to_toml(cfg: JobConfig, comments: bool = False) -> str:
    """The config as TOML that `load_config` reads back to an equal config.

    Unset optional fields (None) are written as comments: TOML has no null.
    """
    lines: list[str] = []
    for section in section_names():
        obj = getattr(cfg, section)
        cls = type(obj)
        if lines:
            lines.append("")
        lines.append(f"[{section}]")
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if comments and docs.get(f.name):
                lines.extend("# " + line for line in docs[f.name].splitlines())
            value = getattr(obj, f.name)
            if value is None:
                lines.append(f"# {f.name} = (unset)")
            else:
                lines.append(f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _default_text(f: dataclasses.Field) -> str:
    value = _field_default(f)
    return "unset" if value is None else _toml_value(value)


def config_help() -> str:
    """Every field: `section.key  type = default` and its docstring (plain text)."""
    out: list[str] = []
    for section in section_names():
        cls = section_class(section)
        out.append(f"[{section}]  {inspect.cleandoc(cls.__doc__ or '')}")
        docs, tps = field_docs(cls), field_types(cls)
        for f in dataclasses.fields(cls):
            out.append(f"  {section}.{f.name}: {type_name(tps[f.name])} = {_default_text(f)}")
            for line in textwrap.wrap(" ".join(docs.get(f.name, "").split()), 88):
                out.append(f"      {line}")
        out.append("")
    return "\n".join(out)


def config_markdown() -> str:
    """docs/config.md: one table per section, generated from the dataclasses."""
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by scripts/gen_config_docs.py from src/cephalo/train/config.py: do not edit. -->",
        "",
        "A job is configured by a TOML file with the sections below (`configs/` has complete,",
        "commented examples) and command-line overrides `--section.key=value`, which win over the",
        "file. Every key is optional; unknown keys, values of the wrong type and values out of range",
        "are reported with the key's name. `cephalo train --help` shows the same text.",
        "",
        "```bash",
        "cephalo train --config configs/demo.toml --train.steps=50 --train.lr=1e-3",
        "cephalo train --config configs/demo.toml --model.overrides dropout=0.1,n_layer=4",
        "```",
        "",
    ]
    for section in section_names():
        cls = section_class(section)
        docs, tps = field_docs(cls), field_types(cls)
        out += [f"## `[{section}]`", "", inspect.cleandoc(cls.__doc__ or ""), ""]
        out += ["| key | type | default | description |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            doc = " ".join(docs.get(f.name, "").split()).replace("|", "\\|")
            tname = type_name(tps[f.name]).replace("|", "\\|")
            out.append(f"| `{f.name}` | {tname} | `{_default_text(f)}` | {doc} |")
        out.append("")
    return "\n".join(out)


_DEST_PREFIX = "cfg::"


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--config PATH` and one `--section.key VALUE` option per field (help from the docstrings).

    Read them back with `config_from_args(args)`. Values stay strings here and are parsed by
    `load_config`, so the command line and the TOML file follow the same rules and messages.
    """
    parser.add_argument(
        "--config", metavar="PATH", default=None, help="TOML job config (see configs/)"
    )
    for section in section_names():
        cls = section_class(section)
        group = parser.add_argument_group(
            f"[{section}] {inspect.cleandoc(cls.__doc__ or '').rstrip('.')}"
        )
        docs, tps = field_docs(cls), field_types(cls)
        for f in dataclasses.fields(cls):
            doc = " ".join(docs.get(f.name, "").split()).replace("%", "%%")
            group.add_argument(
                f"--{section}.{f.name}",
                dest=f"{_DEST_PREFIX}{section}.{f.name}",
                metavar=_metavar(tps[f.name]),
                default=argparse.SUPPRESS,
                help=f"{doc} (default: {_default_text(f)})",
            )


def _metavar(tp: Any) -> str:
    tp = _strip_optional(tp) if _is_optional(tp) else tp
    if typing.get_origin(tp) is Literal:
        return "{" + ",".join(typing.get_args(tp)) + "}"
    if typing.get_origin(tp) in (list, tuple):
        return "A,B"
    if typing.get_origin(tp) is dict:
        return "K=V,..."
    return tp.__name__.upper()


def overrides_from_args(args: argparse.Namespace) -> list[str]:
    """The `--section.key=value` overrides given on the command line, in `load_config` form."""
    declared = [
        f"--{dest.removeprefix(_DEST_PREFIX)}={value}"
        for dest, value in vars(args).items()
        if dest.startswith(_DEST_PREFIX)
    ]
    # options argparse did not declare (e.g. --model.overrides.dropout=0.1), kept by cli.main
    return declared + list(getattr(args, "extra_overrides", []))


def config_from_args(args: argparse.Namespace) -> JobConfig:
    """`load_config(args.config, <overrides given on the command line>)`."""
    return load_config(getattr(args, "config", None), overrides_from_args(args))


def engine_config(
    cfg: JobConfig,
    device: Device,
    emulated: bool,
    host_memory_bytes: int | None = None,
    torch_device: torch.device | None = None,
    local_ranks: int = 1,
) -> EngineConfig:
    """The engine's settings from the job config and this rank's (maybe emulated) device
    (imported here, when a job starts: loading a config does not load the engine);
    `host_memory_bytes`: this rank's share of its node's host memory (its host budget when
    emulated); `local_ranks`: the ranks of its node (which share its cores)."""
    from cephalo.launch.pool import threads_per_rank
    from cephalo.preference.objective import DpoSettings
    from cephalo.runtime.engine.config import EngineConfig
    from cephalo.runtime.state.adamw import AdamWHyper

    offload = {"auto": None, "always": True, "never": False}[cfg.parallel.offload]
    t = cfg.train
    return EngineConfig(
        mode=cfg.parallel.mode,
        compute_dtype=cfg.model.dtype,
        adamw=AdamWHyper(betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay),
        grad_clip=t.grad_clip,
        prefetch=cfg.parallel.prefetch,
        compile=cfg.parallel.compile,
        overlap_reduce=cfg.parallel.overlap_reduce,
        validate_collectives=False if cfg.parallel.check_collectives == "off" else None,
        validate_every_step=cfg.parallel.check_collectives == "every_step",
        offload=offload,
        seed=cfg.model.seed,
        slowdown=device.slowdown,
        memory_budget_bytes=int(device.memory_bytes) if emulated else None,
        host_memory_budget_bytes=host_memory_bytes if emulated else None,
        host_copy_bytes_per_s=device.pcie_bytes_per_s,
        device=None if torch_device is None else str(torch_device),
        # the node's cores for the host AdamW (torchrun gives each rank one thread); an
        # emulated rank shares the host with the others as it is
        host_threads=None if emulated else threads_per_rank(max(1, local_ranks)),
        dpo=DpoSettings(t.dpo_beta, t.dpo_loss) if t.objective == "dpo" else None,
    )
