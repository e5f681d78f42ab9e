"""Reference answers from the real transformers 4 pipelines, for tests/test_fidelity.py.

    make reference-answers          # or: .venv/bin/python scripts/transformers4_reference.py

transformers 5 removed the question-answering, summarization, translation and
text2text-generation pipelines, and rawserve serves those tasks with its own adapters. This
script records what transformers 4's pipelines answered, so the test suite can hold rawserve's
HTTP answers to them:

1. builds the tiny models of tests/fidelity_models.py with the project's transformers 5;
2. makes (once) a virtual environment `.venv-transformers4` with transformers 4.57.6, the last
   release of 4.x, and the project's CPU torch; nothing else in the repo uses it;
3. runs, inside it, the pipelines on every case of `cases()`, each alone and inside a list;
4. writes tests/fidelity_reference.json: the cases, the answers (or the error raised), the
   versions used and the models' fingerprints.

transformers 5 saves fast tokenizers as its `TokenizersBackend`/`BertTokenizer` classes,
which transformers 4 reads differently or not at all; the copy transformers 4 reads says
`PreTrainedTokenizerFast`, which loads tokenizer.json exactly as saved.

The same file runs in both environments: the parent part with the project's interpreter, the
`--answer` part with transformers 4's. It imports nothing outside the standard library at the
top for that reason.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURE = REPO_ROOT / "tests" / "fidelity_reference.json"
VENV = REPO_ROOT / ".venv-transformers4"
TRANSFORMERS_SPEC = "transformers==4.57.6"
DEFAULT_TORCH_SPEC = "torch==2.13.0"

# The second input of every "inside a list" call, per task.
COMPANIONS: dict[str, Any] = {
    "question-answering": {"question": "who lives in london?", "context": "mary lives in london."},
    "summarization": "john works in paris with mary.",
    "translation": "john works in paris with mary.",
    "text2text-generation": "john works in paris with mary.",
}

BASIC = {
    "question": "where does john live?",
    "context": "john lives in berlin and mary works in london.",
}
# The issue's own cases: pieces of words, and a context with nothing to answer.
PIECES = {
    "question": "where does johnathan live?",
    "context": "johnathan lives in parisian berlin, marylike works in londoner films.",
}
NOTHING = {"question": "john works city that great", "context": "you"}


def long_context(sentences: int) -> str:
    """A context of many windows: words of the vocabulary and words split into pieces."""
    names = ["john", "mary", "johnathan", "marylike", "zed", "quincy"]
    cities = ["berlin", "london", "paris", "parisian town", "kyoto", "oslo"]
    things = ["films", "movies", "the capital", "a city name", "great works"]
    return " ".join(
        f"{names[i % 6]} lives in {cities[(i * 5) % 6]} and works on {things[(i * 3) % 5]}."
        for i in range(sentences)
    )


SUMMARY_TEXT = (
    "john lives in berlin and works in a great city. mary lives in london and works on "
    "films. the capital of france is paris, and this is not a very good movie."
)
TRANSLATION_TEXT = "john lives in berlin and mary works in london."
T2T_TEXT = "what is the capital of france? paris is the capital of france."


# Where rawserve deliberately answers otherwise (the README's task table says the same), the
# case says why and what transformers 4 answers for the behaviour rawserve chose: either the
# same pipeline with adjusted parameters (or task), or a status code.
MAX_LENGTH_WINS = (
    "a max_length from the caller or the model's task_specific_params wins over the pipeline's "
    "default max_new_tokens=256 (transformers 4.57 kept 256; generate warned that both were set)"
)
MODEL_CONFIG_WINS = (
    "the model's generation config wins over the pipeline's defaults num_beams=4 and "
    "max_new_tokens=256 (transformers 4.57 kept its defaults, against its own documentation)"
)
DIRECTION_FROM_LANGUAGES = (
    "src_lang/tgt_lang choose the model's translation_<src>_to_<tgt> prefix and settings "
    "(transformers 4.57 kept the first direction's for models without language codes)"
)
EMPTY_INPUT = (
    "empty or whitespace-only text is a 422 (transformers 4.57 raised or generated from it)"
)


def cases() -> list[dict[str, Any]]:
    """Every case: id, model, task, input, parameters (what the pipeline call was given)."""

    def qa(case_id: str, item: dict[str, str], **params: Any) -> dict[str, Any]:
        return {
            "id": case_id,
            "model": "qa-bert",
            "task": "question-answering",
            "input": item,
            "parameters": params,
        }

    def gen(model: str, task: str, case_id: str, text: str, **params: Any) -> dict[str, Any]:
        return {"id": case_id, "model": model, "task": task, "input": text, "parameters": params}

    def summarize(case_id: str, text: str, **params: Any) -> dict[str, Any]:
        return gen("t5", "summarization", case_id, text, **params)

    def translate(case_id: str, text: str, **params: Any) -> dict[str, Any]:
        return gen("t5", "translation", case_id, text, **params)

    def text2text(case_id: str, text: str, **params: Any) -> dict[str, Any]:
        return gen("t5", "text2text-generation", case_id, text, **params)

    def differs(case: dict[str, Any], why: str, **how: Any) -> dict[str, Any]:
        return {**case, "differs": {"why": why, **how}}

    def max_length_wins(case: dict[str, Any], **extra: Any) -> dict[str, Any]:
        params = {**case["parameters"], "max_new_tokens": None, **extra}
        return differs(case, MAX_LENGTH_WINS, parameters=params)

    def empty(case: dict[str, Any]) -> dict[str, Any]:
        return differs(case, EMPTY_INPUT, status=422)

    long = {"question": "where does quincy live?", "context": long_context(60)}
    medium = {"question": "who works on films?", "context": long_context(6)}
    return [
        qa("qa-basic", BASIC),
        qa("qa-align-to-words-default", PIECES),
        qa("qa-align-to-words-false", PIECES, align_to_words=False),
        qa("qa-align-to-words-true-top-k", PIECES, align_to_words=True, top_k=3),
        qa("qa-align-to-words-false-top-k", PIECES, align_to_words=False, top_k=3),
        qa("qa-impossible-answer", NOTHING, handle_impossible_answer=True),
        qa("qa-impossible-answer-off", NOTHING),
        qa("qa-impossible-answer-basic", BASIC, handle_impossible_answer=True),
        qa("qa-impossible-answer-top-k", BASIC, handle_impossible_answer=True, top_k=3),
        qa("qa-top-k-3", BASIC, top_k=3),
        qa("qa-top-k-one-candidate", NOTHING, top_k=3),
        qa("qa-top-k-one-candidate-unaligned", NOTHING, top_k=2, align_to_words=False),
        qa("qa-top-k-old-name", BASIC, topk=2),
        qa(
            "qa-same-text-summed",
            {"question": "what city?", "context": "paris, paris and paris. berlin or paris."},
            top_k=5,
        ),
        qa(
            "qa-same-text-any-case",
            {"question": "what city?", "context": "Paris or paris or PARIS, then Berlin."},
            top_k=4,
        ),
        qa("qa-max-answer-len-1", BASIC, max_answer_len=1),
        qa("qa-max-answer-len-3-top-k", BASIC, max_answer_len=3, top_k=2),
        qa("qa-long-context", long),
        qa("qa-long-context-max-seq-len-512", long, max_seq_len=512),
        qa("qa-long-context-doc-stride-32", long, doc_stride=32),
        qa("qa-small-windows", medium, max_seq_len=48, doc_stride=16),
        qa(
            "qa-small-windows-impossible-top-k",
            medium,
            max_seq_len=48,
            doc_stride=16,
            handle_impossible_answer=True,
            top_k=2,
        ),
        qa("qa-max-question-len", BASIC, max_question_len=4),
        qa(
            "qa-question-over-max-seq-len",
            {"question": long_context(3), "context": "you"},
            max_seq_len=24,
        ),
        qa(
            "qa-capitals-and-accents",
            {
                "question": "Where does Zoë live?",
                "context": "Zoë lives in Zürich; JOHN lives in Berlin.",
            },
        ),
        qa(
            "qa-odd-whitespace",
            {"question": "where does john live?", "context": "  john   lives\n\tin  berlin .  "},
            top_k=2,
        ),
        qa(
            "qa-punctuation",
            {"question": "what is the city?", "context": "john-paul's city: berlin! (or london?)"},
            top_k=3,
        ),
        qa("qa-doc-stride-over-max-seq-len", BASIC, max_seq_len=32, doc_stride=64),
        empty(qa("qa-empty-question", {"question": "", "context": "john lives in berlin."})),
        empty(qa("qa-empty-context", {"question": "where does john live?", "context": ""})),
        empty(
            qa("qa-whitespace-question", {"question": " \t", "context": "john lives in berlin."})
        ),
        empty(qa("qa-whitespace-context", {"question": "where does john live?", "context": "   "})),
        max_length_wins(summarize("sum-default", SUMMARY_TEXT)),
        max_length_wins(summarize("sum-max-length", SUMMARY_TEXT, max_length=20)),
        max_length_wins(
            summarize("sum-min-and-max-length", SUMMARY_TEXT, min_length=5, max_length=15)
        ),
        max_length_wins(summarize("sum-num-beams-1", SUMMARY_TEXT, num_beams=1)),
        max_length_wins(
            summarize("sum-num-return-sequences", SUMMARY_TEXT, num_return_sequences=2)
        ),
        summarize("sum-max-new-tokens", SUMMARY_TEXT, max_new_tokens=8),
        max_length_wins(
            summarize("sum-no-repeat-ngram-off", SUMMARY_TEXT, no_repeat_ngram_size=0, num_beams=2)
        ),
        max_length_wins(
            summarize("sum-clean-up-spaces", SUMMARY_TEXT, clean_up_tokenization_spaces=True)
        ),
        max_length_wins(summarize("sum-long-input", long_context(8))),
        empty(summarize("sum-empty", "")),
        empty(summarize("sum-whitespace", "  \n ")),
        max_length_wins(translate("tr-default", TRANSLATION_TEXT)),
        differs(
            translate("tr-src-tgt-lang", TRANSLATION_TEXT, src_lang="en", tgt_lang="fr"),
            DIRECTION_FROM_LANGUAGES + "; " + MAX_LENGTH_WINS,
            task="translation_en_to_fr",
            parameters={"max_new_tokens": None},
        ),
        max_length_wins(translate("tr-max-length", TRANSLATION_TEXT, max_length=10)),
        max_length_wins(translate("tr-min-length", TRANSLATION_TEXT, min_length=12)),
        max_length_wins(translate("tr-num-beams-1", TRANSLATION_TEXT, num_beams=1)),
        max_length_wins(
            translate("tr-num-return-sequences", TRANSLATION_TEXT, num_return_sequences=3)
        ),
        empty(translate("tr-empty", "")),
        text2text("t2t-default", T2T_TEXT),
        max_length_wins(text2text("t2t-max-length", T2T_TEXT, max_length=30)),
        max_length_wins(
            text2text("t2t-min-and-max-length", T2T_TEXT, min_length=25, max_length=30)
        ),
        text2text("t2t-beams-and-sequences", T2T_TEXT, num_beams=3, num_return_sequences=2),
        text2text("t2t-max-new-tokens", T2T_TEXT, max_new_tokens=5),
        text2text("t2t-penalties", T2T_TEXT, repetition_penalty=1.5, no_repeat_ngram_size=2),
        text2text("t2t-greedy", T2T_TEXT, num_beams=1, do_sample=False),
        empty(text2text("t2t-empty", "")),
        differs(
            gen("t5-tuned", "text2text-generation", "t2t-model-config", T2T_TEXT),
            MODEL_CONFIG_WINS,
            parameters={"num_beams": 2},
        ),
        gen(
            "t5-tuned",
            "text2text-generation",
            "t2t-model-config-caller-beams",
            T2T_TEXT,
            num_beams=1,
        ),
        differs(
            gen(
                "t5-tuned",
                "text2text-generation",
                "t2t-model-config-caller-length",
                T2T_TEXT,
                max_length=10,
            ),
            MODEL_CONFIG_WINS,
            parameters={"max_length": 10, "num_beams": 2},
        ),
    ]


# --- the parent: project interpreter -------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--answer", nargs=3, metavar=("MODELS", "CASES", "OUT"), help=argparse.SUPPRESS
    )  # the part that runs inside transformers 4
    args = parser.parse_args()
    if args.answer:
        answer(*(Path(p) for p in args.answer))
        return
    began = time.monotonic()
    python = transformers4_python()
    sys.path.insert(0, str(REPO_ROOT))
    from tests import fidelity_models  # the project's transformers 5

    all_cases = cases()
    with tempfile.TemporaryDirectory() as scratch:
        models = Path(scratch) / "models"
        fingerprints = {}
        for name in fidelity_models.MODELS:
            folder = fidelity_models.build(name, models / name)
            fingerprints[name] = fidelity_models.saved_fingerprint(folder)
            declare_fast_tokenizer(folder)
        (Path(scratch) / "cases.json").write_text(json.dumps(all_cases))
        out = Path(scratch) / "answers.json"
        subprocess.run(
            [
                str(python),
                __file__,
                "--answer",
                str(models),
                str(Path(scratch) / "cases.json"),
                str(out),
            ],
            check=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
        )
        produced = json.loads(out.read_text())
    for name, seen in produced["fingerprints"].items():
        if seen != fingerprints[name]:
            sys.exit(
                f"transformers 4 loaded other weights for {name}: {seen} != {fingerprints[name]}"
            )
    fixture = {
        "about": "answers of transformers 4's pipelines on tests/fidelity_models.py's models; "
        "regenerate with `make reference-answers` (scripts/transformers4_reference.py)",
        "versions": produced["versions"],
        "models": fingerprints,
        "companions": COMPANIONS,
        "cases": produced["cases"],
    }
    FIXTURE.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
    print(
        f"wrote {len(produced['cases'])} cases to {FIXTURE.relative_to(REPO_ROOT)} "
        f"in {time.monotonic() - began:.0f} s"
    )


def transformers4_python() -> Path:
    """The interpreter of `.venv-transformers4`, made on first use (a few minutes)."""
    torch_spec = os.environ.get("TORCH_SPEC") or DEFAULT_TORCH_SPEC
    wanted = f"{torch_spec} {TRANSFORMERS_SPEC}\n"
    python = VENV / "bin" / "python"
    stamp = VENV / ".installed"
    if stamp.exists() and stamp.read_text() == wanted:
        return python
    print(f"making {VENV.name} with {TRANSFORMERS_SPEC} and {torch_spec}", flush=True)
    shutil.rmtree(VENV, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, *os.environ.get("PIP_TORCH_ARGS", "").split(), torch_spec], check=True)
    subprocess.run([*pip, TRANSFORMERS_SPEC], check=True)
    stamp.write_text(wanted)
    return python


def declare_fast_tokenizer(folder: Path) -> None:
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2))


# --- the child: transformers 4 -------------------------------------------------------------


def answer(models: Path, cases_file: Path, out: Path) -> None:
    import numpy
    import torch
    import transformers

    sys.path.insert(0, str(REPO_ROOT))
    from tests.fidelity_models import fingerprint

    assert transformers.__version__.startswith("4."), transformers.__version__
    warnings.simplefilter("ignore")  # deprecation notes of transformers 4 (e.g. `topk`)
    transformers.logging.set_verbosity_error()
    pipelines: dict[tuple[str, str], Any] = {}

    def run(case: dict[str, Any], task: str, params: dict[str, Any]) -> dict[str, Any]:
        key = (case["model"], task)
        if key not in pipelines:
            pipelines[key] = transformers.pipeline(
                task, model=str(models / case["model"]), device="cpu"
            )
        companion = COMPANIONS[case["task"]]
        return {
            "alone": call(pipelines[key], case["input"], params),
            "in_list": call(pipelines[key], [case["input"], companion], params),
        }

    answered = []
    for case in json.loads(cases_file.read_text()):
        case.update(run(case, case["task"], case["parameters"]))
        differs = case.get("differs", {})
        if "parameters" in differs or "task" in differs:
            differs.update(
                run(
                    case,
                    differs.get("task", case["task"]),
                    differs.get("parameters", case["parameters"]),
                )
            )
        answered.append(case)
        print(f"  {case['id']}: {json.dumps(case['alone'])[:100]}", flush=True)
    fingerprints = {
        model: fingerprint(pipe.model, pipe.tokenizer) for (model, _), pipe in pipelines.items()
    }
    out.write_text(
        json.dumps(
            {
                "versions": {
                    "transformers": transformers.__version__,
                    "torch": torch.__version__,
                    "numpy": numpy.__version__,
                },
                "fingerprints": fingerprints,
                "cases": answered,
            }
        )
    )


def call(pipe: Any, inputs: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The pipeline's answer as plain JSON, or the error it raised."""
    try:
        return {"answer": plain(pipe(inputs, **params))}
    except Exception as exc:  # the case's answer is that it failed
        return {"error": f"{type(exc).__name__}: {exc}"}


def plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return value


if __name__ == "__main__":
    main()
