"""Reading the structured files users write (cluster files, offers files): TOML, JSON, or YAML
when PyYAML is installed, chosen by the suffix; every failure is one `CephaloError`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cephalo.errors import CephaloError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package
    import tomli as tomllib  # type: ignore[no-redef]

SUFFIXES = (".toml", ".json", ".yaml", ".yml")


def read_table_file(path: str | Path, what: str) -> Any:
    """The parsed contents of `path`, a `what` file (`cluster`, `offers`) by its suffix."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise CephaloError(f"cannot read {what} file {p}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise CephaloError(f"{what} file {p} is not UTF-8 text") from None
    suffix = p.suffix.lower()
    if suffix not in SUFFIXES:
        raise CephaloError(
            f"{p}: unknown {what} file type {suffix or '(none)'}; use .toml, .json, .yaml or .yml"
        )
    if suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise CephaloError(
                f"{p}: reading YAML needs PyYAML (`pip install -e '.[yaml]'` or `pip install "
                f"pyyaml`); or write the {what} as TOML or JSON"
            ) from None
    try:
        if suffix == ".toml":
            return tomllib.loads(text)
        if suffix == ".json":
            return json.loads(text)
        return yaml.safe_load(text)
    except Exception as e:  # a parser's syntax error: say where
        raise CephaloError(f"cannot parse {what} file {p}: {e}") from None
