"""The house as docs/architecture.md draws it: every module the page names exists, every
module of the package is on the page, no folder holds more than 12 modules and no file more
than 900 lines (the layout's rules; the import rules are
`python3 ../shared/tools/import_graph.py src/cephalo`'s)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import cephalo

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(cephalo.__file__).resolve().parent
DOC = ROOT / "docs" / "architecture.md"
MAX_MODULES_PER_FOLDER = 12
MAX_LINES_PER_FILE = 900


def _named_modules() -> set[str]:
    """Modules the module table names: `cephalo.a.b`, and `.c` continuations of a row's first
    name (`cephalo.data.text`, `.tokenizer` -> `cephalo.data.tokenizer`), and a package with
    its modules in parentheses (`cephalo.modeling.hf` (`model`, `families`))."""
    names = set()
    for line in DOC.read_text().splitlines():
        if not line.startswith("| `cephalo"):
            continue
        cell = line.split("|")[1]
        first = re.match(r"\s*`(cephalo(?:\.\w+)*)`", cell).group(1)
        names.add(first)
        parent = first.rsplit(".", 1)[0]
        names |= {f"{parent}.{m}" for m in re.findall(r"`\.(\w+)`", cell)}
        names |= set(re.findall(r"`(cephalo(?:\.\w+)+)`", cell))
        inside = re.search(r"\(([^)]*)\)", cell)
        if inside:  # `cephalo.commands.*` (`demo`, ...): the subcommands' modules
            package = "cephalo.commands" if "commands.*" in cell else first
            names |= {f"{package}.{m}" for m in re.findall(r"`(\w+)`", inside.group(1))}
        names.discard("cephalo.commands.*")
    return names


def _package_modules() -> set[str]:
    out = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        if parts[-1] in ("__main__",) or "commands" in parts:
            continue  # the subcommands are one row (`cephalo.commands.*`)
        out.add(".".join(parts))
    return out


def test_every_module_the_page_names_exists():
    missing = sorted(m for m in _named_modules() if importlib.util.find_spec(m) is None)
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_every_module_is_on_the_page():
    named = _named_modules()
    packages = {m for m in _package_modules() if (PACKAGE.parent / m.replace(".", "/")).is_dir()}
    absent = sorted(m for m in _package_modules() - packages if m not in named)
    assert not absent, f"modules missing from docs/architecture.md's table: {absent}"


def test_folders_and_files_stay_small():
    crowded = {
        str(d.relative_to(PACKAGE.parent)): n
        for d in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir())]
        if (n := len([f for f in d.glob("*.py") if f.name != "__init__.py"]))
        > MAX_MODULES_PER_FOLDER
    }
    assert not crowded, f"folders over {MAX_MODULES_PER_FOLDER} modules: {crowded}"
    long = {
        str(f.relative_to(PACKAGE.parent)): n
        for f in PACKAGE.rglob("*.py")
        if (n := len(f.read_text().splitlines())) > MAX_LINES_PER_FILE
    }
    assert not long, f"files over {MAX_LINES_PER_FILE} lines: {long}"
