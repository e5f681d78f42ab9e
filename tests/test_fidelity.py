"""rawserve answers over HTTP what transformers 4's pipelines answered.

tests/fidelity_reference.json holds transformers 4.57's answers for question-answering,
summarization, translation and text2text-generation on the tiny models of
tests/fidelity_models.py (made by scripts/transformers4_reference.py, `make reference-answers`).
Each case is sent to a real server, alone and inside a list, and its answer must equal the
pipeline's: spans and text exactly, scores to 1e-4. Where rawserve deliberately answers
otherwise, the case says why (the README's task table says the same) and holds what
transformers 4 answers for the behaviour rawserve chose, or the status rawserve answers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests import fidelity_models
from tests.server import RunningServer, module_tests, running_together

pytestmark = pytest.mark.slow

FIXTURE = json.loads((Path(__file__).parent / "fidelity_reference.json").read_text())
CASES = FIXTURE["cases"]
SCORE_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def fidelity_model(tmp_path_factory):
    """`fidelity_model(name)` -> the folder of that model, checked against the fixture's."""
    root = tmp_path_factory.mktemp("fidelity-models")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            folder = fidelity_models.build(name, root / name)
            if fidelity_models.saved_fingerprint(folder) != FIXTURE["models"][name]:
                pytest.fail(
                    f"the tiny model {name!r} is not the one the reference answers were made "
                    "with: run `make reference-answers` and review the new answers"
                )
            built[name] = folder
        return built[name]

    return get


@pytest.fixture(scope="module")
def server(request, fidelity_model):
    """`server(model, task)` -> a running rawserve, one per model and task for the module:
    those of the cases this run selected, started together (their models load side by
    side, not one after the other)."""
    selected = (getattr(item, "callspec", None) for item in module_tests(request))
    cases = (callspec.params["case"] for callspec in selected if callspec is not None)
    together = {}
    for model, task in sorted({(case["model"], case["task"]) for case in cases}):
        # one thread: the answers do not depend on how busy the machine is, nor does
        # beam search crawl when other processes hold the cores; a deadline far off
        args = ["--model", str(fidelity_model(model)), "--task", task, "--threads", "1"]
        args += ["--timeout", "300", "--max-timeout", "300"]
        together[f"{model} {task}"] = RunningServer(args)
    with running_together(together):
        yield lambda model, task: together[f"{model} {task}"]


def test_the_fixture_covers_what_the_issue_names():
    ids = {case["id"] for case in CASES}
    assert len(CASES) >= 40
    for named in [
        "qa-impossible-answer",
        "qa-align-to-words-default",
        "qa-align-to-words-false",
        "qa-same-text-summed",
        "qa-long-context-max-seq-len-512",
        "qa-long-context-doc-stride-32",
        "qa-max-question-len",
        "qa-top-k-one-candidate",
        "sum-default",
        "sum-min-and-max-length",
        "sum-num-return-sequences",
        "tr-default",
        "t2t-empty",
    ]:
        assert named in ids
    assert {case["task"] for case in CASES} == {
        "question-answering",
        "summarization",
        "translation",
        "text2text-generation",
    }


@pytest.mark.parametrize("in_list", [False, True], ids=["alone", "in-list"])
@pytest.mark.parametrize("case", CASES, ids=[case["id"] for case in CASES])
def test_answers_what_transformers_4_answered(server, case, in_list):
    inputs = [case["input"], FIXTURE["companions"][case["task"]]] if in_list else case["input"]
    body = {"inputs": inputs, "parameters": case["parameters"]}
    status, answer = server(case["model"], case["task"]).post_json(body, timeout=120)
    differs = case.get("differs", {})
    key = "in_list" if in_list else "alone"
    if "status" in differs:
        assert status == differs["status"], (answer, differs["why"])
        assert answer["error"]
        return
    expected = differs[key] if key in differs else case[key]
    if "error" in expected:  # transformers 4 refused the call: a bad request here
        assert status in (400, 422), answer
        assert answer["error"]
        return
    assert status == 200, answer
    mismatch = difference(answer, expected["answer"])
    assert mismatch is None, f"{mismatch}\nrawserve: {answer}\ntransformers 4: {expected}"


def difference(got: Any, want: Any, where: str = "answer") -> str | None:
    """Where `got` differs from `want` (floats to SCORE_TOLERANCE), or None."""
    if isinstance(want, float) and not isinstance(got, bool) and isinstance(got, (int, float)):
        return None if math.isclose(got, want, abs_tol=SCORE_TOLERANCE) else f"{where}: {got}"
    if isinstance(want, dict) and isinstance(got, dict):
        if set(got) != set(want):
            return f"{where}: keys {sorted(got)} != {sorted(want)}"
        for name in want:
            if found := difference(got[name], want[name], f"{where}.{name}"):
                return found
        return None
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            return f"{where}: {len(got)} items != {len(want)}"
        for index, (item, wanted) in enumerate(zip(got, want, strict=True)):
            if found := difference(item, wanted, f"{where}[{index}]"):
                return found
        return None
    return None if type(got) is type(want) and got == want else f"{where}: {got!r} != {want!r}"
