"""README.md and docs/ against the code: the options, metrics, links, commands and files
they name exist, so that a reader who follows them literally is not sent to something
gone or renamed. Plain reading of files; nothing is started."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rawserve.api.openai_generation import MAX_NEW_TOKENS
from rawserve.http.cors import EXPOSED_HEADERS
from rawserve.ops.metrics import Metrics
from rawserve.options import (
    CPU_MAX_BATCH_SIZE,
    CPU_MAX_QUEUE,
    DEFAULT_MAX_TIMEOUT,
    GPU_MAX_BATCH_SIZE,
    GPU_MAX_BATCH_TOKENS,
    GPU_MAX_QUEUE,
    OPTIONS,
)
from rawserve.serving.core import SchedulerCore
from rawserve.serving.status import WorkerState, WorkerStatus
from rawserve.tasks.rules import UNKNOWN_POSITIONS_NEW_TOKENS

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAGS = {option.flag for option in OPTIONS} | {"--help", "--version"}
# the flags the docs quote of other commands: docker, pip, mypy, vLLM, transformers,
# curl, bench.chaos, bench.gpu_round, TGI
OTHER_COMMANDS_FLAGS = {
    "--budget",
    "--build-arg",
    "--continuous-batching",
    "--cpus",
    "--cpuset-cpus",
    "--data-binary",
    "--enable-error-code",
    "--gpus",
    "--index-url",
    "--max-waiting-tokens",
    "--minutes",
    "--python-version",
    "--read-only",
    "--served-model-name",
    "--stop-timeout",
    "--tmpfs",
}


def text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_option_the_docs_name_exists(doc):
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text(doc)))
    assert not named - FLAGS - OTHER_COMMANDS_FLAGS


def test_every_option_has_a_row_in_the_readme_s_table():
    rows = re.findall(r"^\| (`--[^|]*)\|", text(ROOT / "README.md"), re.MULTILINE)
    listed = {flag for row in rows for flag in re.findall(r"`(--[a-z-]+)", row)}
    assert FLAGS - {"--help"} == listed


def readme_defaults() -> dict[str, str]:
    """The options table's default column, by flag (`--a` / `--b` rows split in two)."""
    rows = re.findall(r"^\| (`--[^|]*)\| ([^|]*) \|", text(ROOT / "README.md"), re.MULTILINE)
    cells = {}
    for flags, default in rows:
        named = re.findall(r"`(--[a-z-]+)", flags)
        given = default.replace("`", "").split(" / ")  # "none" for both, or one each
        given = given * len(named) if len(given) == 1 else given
        cells.update(zip(named, (cell.strip() for cell in given), strict=True))
    return cells


def as_written(value: object) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int) and value >= 2**20 and value % 2**20 == 0:
        return f"{value >> 20} MiB"
    return str(value)


def test_the_readme_s_defaults_are_the_parser_s():
    cells = readme_defaults()
    wrong = {
        option.flag: (cells[option.flag], option.default)
        for option in OPTIONS
        if option.default is not None and option.type is not bool
        if not cells[option.flag].startswith(as_written(option.default))
    }
    # those the device decides, named in the parser's constants
    for flag, values in {
        "--max-batch-size": (CPU_MAX_BATCH_SIZE, GPU_MAX_BATCH_SIZE),
        "--max-queue": (CPU_MAX_QUEUE, GPU_MAX_QUEUE),
        "--max-batch-tokens": (f"{GPU_MAX_BATCH_TOKENS:,}",),
        "--max-timeout": (as_written(DEFAULT_MAX_TIMEOUT),),
    }.items():
        if not all(str(value) in cells[flag] for value in values):
            wrong[flag] = (cells[flag], values)
    assert not wrong


def exported_metrics() -> set[str]:
    """The series names `/metrics` shows for a model with a worker, beside HTTP processes
    of their own, as the docs write them (a counter with `_total`; a histogram by its own
    name)."""
    metrics = Metrics()
    metrics.count_http_processes(lambda: 2)
    worker = WorkerStatus(0, "cpu", "float32", WorkerState.IDLE, 1, 0, None)
    core = SchedulerCore()
    core.items_per_second = 1.0
    metrics.watch(
        "m", SimpleNamespace(core=core, in_flight=0), SimpleNamespace(status=[worker].copy)
    )
    families = text_string_to_metric_families(metrics.render()[0].decode())
    kinds = {family.name: family.type for family in families}
    return {
        name + "_total" if kind == "counter" else name
        for name, kind in kinds.items()
        # prometheus_client's own `_created` series, beside each counter and histogram
        if not (name.endswith("_created") and name.removesuffix("_created") in kinds)
    }


def test_the_metrics_table_lists_every_metric_and_only_those():
    operations = text(ROOT / "docs" / "operations.md")
    table = set(re.findall(r"^\| `(rawserve_[a-z_]+)", operations, re.MULTILINE))
    table |= set(re.findall(r"^\| `rawserve_[a-z_]+[^|]*`, `(rawserve_[a-z_]+)", operations, re.M))
    assert table == exported_metrics()


def anchors(doc: Path) -> set[str]:
    """The anchors GitHub makes of a file's headings."""
    headings = re.findall(r"^#+ (.+)$", text(doc), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize(
    "doc", [*DOCS, ROOT / "tests" / "README.md"], ids=lambda path: str(path.relative_to(ROOT))
)
def test_every_link_inside_the_repository_resolves(doc):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text(doc)):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists() or (anchor and anchor not in anchors(linked)):
            broken.append(target)
    assert not broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_file_make_target_and_module_the_docs_name_exists(doc):
    content = text(doc)
    makefile = text(ROOT / "Makefile")
    targets = set(re.findall(r"^([\w.-]+):", makefile, re.MULTILINE))
    missing = [
        f"make {target}"
        for target in re.findall(r"`make ([a-z][\w-]*)", content)
        if target not in targets
    ]
    for module in re.findall(r"python -m\s+((?:bench|rawserve)[\w.]*)", content):
        if not (ROOT / (module.replace(".", "/") + ".py")).exists() and module != "rawserve":
            missing.append(module)
    for path in re.findall(r"`((?:bench|deploy|docs|rawserve|scripts|tests)/[\w./-]*)`", content):
        if not (ROOT / path).exists():
            missing.append(path)
    assert not missing


def test_the_limits_table_gives_the_cap_on_new_tokens():
    """The new tokens a request may ask: the model's positions, the ceiling where they
    are unknown, and the bound whatever they are, as the checks have them."""
    readme = text(ROOT / "README.md")
    [row] = re.findall(r"^\| generation length \|.*$", readme, re.MULTILINE)
    assert f"at most {MAX_NEW_TOKENS:,}" in row
    assert f"T5's relative positions: {UNKNOWN_POSITIONS_NEW_TOKENS:,})" in row


def test_every_environment_variable_rawserve_reads_is_named_in_the_docs():
    """Beside RAWSERVE_<OPTION>: a variable read where the docs do not name it (the ONNX
    cache under $XDG_CACHE_HOME, the GPUs `cuda:N` counts) changes what they describe."""
    reads = re.compile(
        r'(?:environ\.get|getenv)\(\s*"([A-Z][A-Z0-9_]*)"'  # os.environ.get("NAME")
        r'|"([A-Z][A-Z0-9_]*)" (?:not )?in \w*environ'  # "NAME" in os.environ
    )
    read = {
        name
        for source in (ROOT / "rawserve").rglob("*.py")
        for match in reads.findall(text(source))
        for name in match
        if name
    }
    docs = "".join(text(doc) for doc in DOCS)
    assert read and not {name for name in read if name not in docs}


def test_the_readme_lists_the_headers_cors_exposes():
    """A browser's script reads only the headers exposed to it: README is where its
    author looks for which (X-Should-Retry was missing)."""
    readme = " ".join(text(ROOT / "README.md").split())
    [listed] = re.findall(r"and exposes (`[^;]*);", readme)
    assert re.findall(r"`([\w-]+)`", listed) == EXPOSED_HEADERS.split(", ")


def test_the_readme_s_gpu_round_has_the_time_for_every_stage():
    """`make bench-gpu`'s default budget is sized for a lent machine's command and skips
    the last stages; the README's command for a whole pass names a budget they all fit in
    (it had named none after the default went from 1,200 s to 500)."""
    from bench.gpu_round import stages

    budget = re.search(r'`make bench-gpu ARGS="--budget (\d+)"`', text(ROOT / "README.md"))
    assert budget is not None
    assert int(budget[1]) >= sum(stage.seconds for stage in stages(Path("unused")))
