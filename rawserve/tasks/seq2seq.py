"""summarization, translation, text2text-generation: text in; `{"summary_text"}`,
`{"translation_text"}` or `{"generated_text"}` out, a list of them with
`num_return_sequences` > 1, and one input answered as a list (what the removed pipelines
did, and what InferenceClient reads). Served by rawserve's own adapter
(`rawserve.worker.seq2seq_lm`).

The parameters are transformers 4's pipelines' names: generate() options directly (or
inside the Inference API's `generate_parameters`), `truncation`,
`clean_up_tokenization_spaces`, and for translation `src_lang`/`tgt_lang`.
"""

from __future__ import annotations

from typing import Any

from rawserve.tasks.checks import (
    Checker,
    boolean,
    checker,
    float_range,
    int_range,
    one_of,
    one_or_list,
    prompt,
)
from rawserve.tasks.rules import MAX_NEW_TOKENS, SingleAnswer, Task


@checker({"anyOf": [{"type": "boolean"}, {"const": "never"}]})
def early_stopping(value: Any) -> bool | str:
    """generate()'s `early_stopping`: true, false, or "never" (beam search runs until no
    better candidate can come)."""
    if not isinstance(value, bool) and value != "never":
        raise ValueError('must be true, false or "never"')
    return value


# generate() options these tasks take, by name: inside the Inference API's
# `generate_parameters`, or directly among the parameters.
GENERATE_PARAMS: dict[str, Checker] = {
    # (the model's positions bound them further)
    "max_new_tokens": int_range(1, MAX_NEW_TOKENS),
    "min_new_tokens": int_range(0, MAX_NEW_TOKENS),
    # lengths count the decoder's start token, as generate() counts them
    "max_length": int_range(1, MAX_NEW_TOKENS + 1),
    "min_length": int_range(0, MAX_NEW_TOKENS + 1),
    "num_return_sequences": int_range(1, 8),
    "length_penalty": float_range(-100.0, 100.0),
    "do_sample": boolean,
    "temperature": float_range(0.0, 100.0),
    "top_p": float_range(0.0, 1.0),
    "top_k": int_range(1, 1000),
    "num_beams": int_range(1, 8),
    "repetition_penalty": float_range(0.0, 100.0, above_low=True),  # (it divides the scores)
    "no_repeat_ngram_size": int_range(0, 100),
    "early_stopping": early_stopping,
}


@checker(
    {
        "type": "object",
        "properties": {
            name: {"anyOf": [check.schema, {"type": "null"}]}
            for name, check in GENERATE_PARAMS.items()
        },
        "additionalProperties": False,
    }
)
def generate_parameters(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError("must be an object")
    unknown = sorted(set(value) - set(GENERATE_PARAMS))
    if unknown:
        raise ValueError(
            f"has unknown option(s) {', '.join(unknown)} (allowed: {', '.join(GENERATE_PARAMS)})"
        )
    checked = {}
    for name, item in value.items():
        if item is not None:
            try:
                checked[name] = GENERATE_PARAMS[name](item)
            except ValueError as exc:  # (named: the caller names only generate_parameters)
                raise ValueError(f"has {name}, which {exc}") from None
    return checked


TRUNCATION_STRATEGIES = ("do_not_truncate", "longest_first", "only_first", "only_second")


@checker({"anyOf": [{"type": "boolean"}, {"enum": list(TRUNCATION_STRATEGIES)}]})
def truncation(value: Any) -> bool | str:
    """A tokenizer truncation strategy, or true/false as the pipelines also took."""
    if isinstance(value, bool):
        return value
    return one_of(*TRUNCATION_STRATEGIES)(value)


@checker({"type": "string", "minLength": 1, "maxLength": 20})
def language(value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= 20:
        raise ValueError("must be a language code such as 'en' or 'fr_XX'")
    return value


# the key of each task's text in its answer
OUTPUT_KEYS = {
    "summarization": "summary_text",
    "translation": "translation_text",
    "text2text-generation": "generated_text",
}


def _task(name: str, translates: bool) -> Task:
    key = OUTPUT_KEYS[name]
    return Task(
        name,
        prompt,
        {
            "clean_up_tokenization_spaces": boolean,
            "truncation": truncation,
            "generate_parameters": generate_parameters,
            **({"src_lang": language, "tgt_lang": language} if translates else {}),
            **GENERATE_PARAMS,
        },
        single_answer=SingleAnswer.LIST,
        # a list of them for an input of a list asking num_return_sequences > 1
        output_schema=one_or_list(
            {"type": "object", "required": [key], "properties": {key: {"type": "string"}}}
        ),
    )


TASKS = [
    _task("summarization", translates=False),
    _task("translation", translates=True),
    _task("text2text-generation", translates=False),
]
SEQ2SEQ_TASKS = frozenset(task.name for task in TASKS)
