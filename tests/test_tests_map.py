"""tests/README.md maps every module of rawserve/ to its tests: a module missing from the
map, a test file it does not name, or one it names that does not exist, fails here."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "rawserve"
MAP = (TESTS / "README.md").read_text()


def named_paths() -> set[str]:
    """Module paths the map names: `rawserve/x/y.py`, or `y.py` after a `rawserve/x/` in
    the same cell, and a whole folder as `rawserve/tasks/`."""
    named = set()
    rows = [line for line in MAP.splitlines() if line.startswith("|")]
    for cell in "\n".join(rows).split("|"):
        folder = ""
        for name in re.findall(r"`([^`]+)`", cell):
            if name.startswith("rawserve/"):
                folder = name.rsplit("/", 1)[0] + "/" if name.endswith(".py") else name
                named.add(name)
            elif name.endswith(".py") and "/" in name:
                named.add("rawserve/" + name)
            elif name.endswith(".py") and folder:
                named.add(folder + name)
    return named


def test_every_module_is_on_the_map():
    named = named_paths()
    folders = {name for name in named if name.endswith("/")}
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).as_posix()
        if path.name == "__init__.py" or relative in named:
            continue
        if not any(relative.startswith(folder) for folder in folders):
            missing.append(relative)
    assert not missing, f"modules tests/README.md does not map: {missing}"


def test_every_test_file_the_map_names_exists():
    names = set(re.findall(r"\btest_\w+", MAP)) - {"test_"}
    absent = sorted(name for name in names if not (TESTS / f"{name}.py").is_file())
    assert not absent, f"tests/README.md names test files that do not exist: {absent}"


def test_every_test_file_is_on_the_map():
    """A file the map does not name is not run by whoever changes the module it tests
    and runs the files the map gives for it."""
    names = set(re.findall(r"\btest_\w+", MAP))
    unnamed = sorted(path.stem for path in TESTS.glob("test_*.py") if path.stem not in names)
    assert not unnamed, f"test files tests/README.md does not name: {unnamed}"
