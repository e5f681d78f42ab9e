"""The import rules of docs/architecture.md, read from its table and checked on the code.

The layout table (columns `where`, `process`, `owns`, `never imports`) is the one place the
rules are written: each row names its modules in backticks in `where` (`main.py`, `http/`)
and what they must never import in backticks in `never imports` (`api/`, `h11`, `torch`).
This test reads that table, so the document and the code cannot drift: a row whose modules
import something it forbids fails, and so does a module that no row names.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "rawserve"
ARCHITECTURE = REPO / "docs" / "architecture.md"
NAME = re.compile(r"`([^`]+)`")


ONLY = re.compile(r"of `([^`]+)` only `([^`]+)`")


@dataclass(frozen=True)
class Rule:
    where: tuple[str, ...]  # module prefixes, e.g. "rawserve.http"
    never: tuple[str, ...]  # forbidden module prefixes, e.g. "rawserve.api", "torch"
    allowed: tuple[str, ...] = ()  # exceptions: "of `rawserve.serving` only `...face`"

    def covers(self, module: str) -> bool:
        return any(_within(module, prefix) for prefix in self.where)

    def forbids(self, module: str, importer: str) -> bool:
        """Whether `importer` (a module of this row) may not import `module`; a package
        may always use its own parts."""
        if any(_within(module, allowed) for allowed in self.allowed):
            return False
        return any(_within(module, f) and not _within(importer, f) for f in self.never)


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _as_module(name: str) -> str:
    """`http/` → rawserve.http, `main.py` → rawserve.main; `h11` and `rawserve.x` as written."""
    if name.endswith("/"):
        return "rawserve." + name.rstrip("/").replace("/", ".")
    if name.endswith(".py"):
        return "rawserve." + name[: -len(".py")].replace("/", ".")
    return name


def read_rules(text: str) -> list[Rule]:
    rows = [line for line in text.splitlines() if line.startswith("|")]
    header = next(i for i, row in enumerate(rows) if "never imports" in row and "where" in row)
    columns = [cell.strip() for cell in rows[header].strip("|").split("|")]
    where, never = columns.index("where"), columns.index("never imports")
    rules = []
    for row in rows[header + 2 :]:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        if len(cells) != len(columns):
            break  # the table ended
        modules = tuple(_as_module(name) for name in NAME.findall(cells[where]))
        exceptions = ONLY.findall(cells[never])
        plain = ONLY.sub("", cells[never])
        forbidden = [_as_module(name) for name in NAME.findall(plain)]
        forbidden += [_as_module(package) for package, _ in exceptions]
        allowed = tuple(_as_module(only) for _, only in exceptions)
        rules.append(Rule(modules, tuple(forbidden), allowed))
    return rules


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path, module: str) -> set[str]:
    """Every module a file imports, anywhere in it (lazy imports count too)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


RULES = read_rules(ARCHITECTURE.read_text())
MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def test_the_table_is_read():
    assert len(RULES) >= 8
    assert all(rule.where for rule in RULES), "a row names no module in backticks"
    assert all(rule.never for rule in RULES), "a row forbids nothing in backticks"


def test_every_module_has_a_row():
    orphans = [
        name for name in MODULES if name != "rawserve" and not any(r.covers(name) for r in RULES)
    ]
    assert not orphans, f"modules no row of docs/architecture.md names: {orphans}"


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: ",".join(rule.where))
def test_no_module_imports_what_its_row_forbids(rule):
    broken = []
    for name, path in MODULES.items():
        if not rule.covers(name):
            continue
        for imported in sorted(imports_of(path, name)):
            if rule.forbids(imported, name):
                broken.append(f"{name} imports {imported}")
    assert not broken, "\n".join(broken)


def test_the_rules_catch_a_forbidden_import(tmp_path):
    """The checker itself: a file that imports what its row forbids is found."""
    rule = read_rules(
        "| where | process | owns | never imports |\n|---|---|---|---|\n"
        "| `http/` | server | values | `api/`, `torch`; of `serving/` only `serving/face.py` |\n"
    )[0]
    assert rule.where == ("rawserve.http",)
    assert rule.never == ("rawserve.api", "torch", "rawserve.serving")
    assert rule.covers("rawserve.http.cors") and not rule.covers("rawserve.httpx")
    assert rule.forbids("rawserve.serving.pool", "rawserve.http.cors")
    assert not rule.forbids("rawserve.serving.face", "rawserve.http.cors")
    assert rule.forbids("rawserve.api.app", "rawserve.http.cors")
    sample = tmp_path / "sample.py"
    sample.write_text("from . import cors\n\ndef lazy():\n    import torch.nn\n")
    found = imports_of(sample, "rawserve.http.sample")
    assert "torch.nn" in found and "rawserve.http.cors" in found
