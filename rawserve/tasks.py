"""Per-task rules: which inputs are valid, which parameters are allowed, how outputs are shaped.

This module is the one place that knows the shape of each task's inputs and outputs.
It is imported by the server (to validate requests before they are queued) and by the
worker (to shape the pipeline's answers), so it must stay free of torch and transformers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rawserve.errors import BadRequest

Checker = Callable[[Any], Any]


# --- parameter checkers: return the value to pass on, or raise ValueError ------------


def _int_range(low: int, high: int) -> Checker:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"must be an integer from {low} to {high}")
        return value

    return check


def _float_range(low: float, high: float) -> Checker:
    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("must be a number")
        if not low <= value <= high:
            raise ValueError(f"must be between {low} and {high}")
        return float(value)

    return check


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def _one_of(*choices: str) -> Checker:
    def check(value: Any) -> str:
        if value not in choices:
            raise ValueError("must be one of " + ", ".join(repr(c) for c in choices))
        return value

    return check


def _short_text(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > 1000:
        raise ValueError("must be a non-empty string of at most 1000 characters")
    return value


def _text_list(max_items: int) -> Checker:
    def check(value: Any) -> list[str]:
        if isinstance(value, str):
            value = [value]
        if (
            not isinstance(value, list)
            or not 1 <= len(value) <= max_items
            or not all(isinstance(v, str) and v for v in value)
        ):
            raise ValueError(f"must be a string or a list of 1 to {max_items} non-empty strings")
        return value

    return check


def _lower_one_of(*choices: str) -> Checker:
    def check(value: Any) -> str:
        if not isinstance(value, str) or value.lower() not in choices:
            raise ValueError("must be one of " + ", ".join(repr(c) for c in choices))
        return value.lower()

    return check


def _stop_sequences(value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if (
        not isinstance(value, list)
        or len(value) > MAX_STOP_SEQUENCES
        or not all(isinstance(v, str) and 0 < len(v) <= 200 for v in value)
    ):
        raise ValueError(
            f"must be a list of at most {MAX_STOP_SEQUENCES} non-empty strings of 200 characters"
        )
    return value


def _language(value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= 20:
        raise ValueError("must be a language code such as 'en' or 'fr_XX'")
    return value


# generate() options a seq2seq task takes, by name (Inference API's `generate_parameters`).
GENERATE_PARAMS: dict[str, Checker] = {
    "max_new_tokens": _int_range(1, 1024),
    "min_new_tokens": _int_range(0, 1024),
    "do_sample": _boolean,
    "temperature": _float_range(0.0, 100.0),
    "top_p": _float_range(0.0, 1.0),
    "top_k": _int_range(1, 1000),
    "num_beams": _int_range(1, 8),
    "repetition_penalty": _float_range(0.0, 100.0),
    "no_repeat_ngram_size": _int_range(0, 100),
    "early_stopping": _boolean,
}


def _generate_parameters(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError("must be an object")
    unknown = sorted(set(value) - set(GENERATE_PARAMS))
    if unknown:
        raise ValueError(
            f"has unknown option(s) {', '.join(unknown)} (allowed: {', '.join(GENERATE_PARAMS)})"
        )
    return {name: GENERATE_PARAMS[name](item) for name, item in value.items() if item is not None}


MAX_STOP_SEQUENCES = 16


# --- input checkers: return the input to queue, or raise ValueError ------------------


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("each input must be a string")
    return value


def _text_or_pair(value: Any) -> str | dict[str, str]:
    if isinstance(value, str):
        return value
    if (
        isinstance(value, dict)
        and "text" in value
        and set(value) <= {"text", "text_pair"}
        and all(isinstance(v, str) for v in value.values())
    ):
        return dict(value)
    raise ValueError('each input must be a string or {"text": ..., "text_pair": ...}')


def _question_context(value: Any) -> dict[str, str]:
    if (
        isinstance(value, dict)
        and set(value) == {"question", "context"}
        and all(isinstance(v, str) and v for v in value.values())
    ):
        return dict(value)
    raise ValueError('each input must be {"question": "...", "context": "..."}')


def _zero_shot_item(output: Any) -> Any:
    """The pipeline's {sequence, labels, scores} → the Inference API's [{label, score}]."""
    if isinstance(output, dict) and "labels" in output:
        return [
            {"label": label, "score": score}
            for label, score in zip(output["labels"], output["scores"], strict=True)
        ]
    return output


class SingleAnswer:
    """How a request with one (non-list) input is answered, from its item's output."""

    ITEM = "item"  # the item's output itself
    LIST = "list"  # [output] (summarization: `pipe("x")` answered [{"summary_text"}])
    LIST_OF_LISTS = "list-of-lists"  # [[...]] (text-classification on the Inference API)


@dataclass(frozen=True)
class Task:
    name: str
    check_input: Checker
    params: Mapping[str, Checker] = field(default_factory=dict)
    required_params: frozenset[str] = frozenset()
    # pipe([x]) answers x's output itself instead of a one-item list (fill-mask does).
    unwraps_single: bool = False
    # The Inference API sends this task's parameters at the top level of the body
    # (feature-extraction: `{"inputs": ..., "normalize": true}`), not under "parameters".
    params_at_root: bool = False
    # Top-level fields besides inputs/parameters/options (text-generation: "stream").
    extra_fields: frozenset[str] = frozenset()
    single_answer: str = SingleAnswer.ITEM
    # Reshapes one item's output from the runner's to the Inference API's shape.
    shape_item: Callable[[Any], Any] | None = None


TASKS: dict[str, Task] = {
    task.name: task
    for task in [
        Task(
            "feature-extraction",
            _text,
            {
                "pooling": _one_of("mean", "cls", "none"),
                "normalize": _boolean,
                "truncate": _boolean,
                "truncation_direction": _lower_one_of("right", "left"),
                "dimensions": _int_range(1, 65536),
            },
            params_at_root=True,
        ),
        Task(
            "fill-mask",
            _text,
            {"top_k": _int_range(1, 100), "targets": _text_list(100)},
            unwraps_single=True,
        ),
        Task(
            "text-classification",
            _text_or_pair,
            {
                "top_k": _int_range(1, 1000),
                "function_to_apply": _one_of("sigmoid", "softmax", "none"),
            },
            single_answer=SingleAnswer.LIST_OF_LISTS,
        ),
        Task(
            "token-classification",
            _text,
            {
                "aggregation_strategy": _one_of("none", "simple", "first", "average", "max"),
                "ignore_labels": _text_list(100),
            },
        ),
        Task(
            "zero-shot-classification",
            _text,
            {
                "candidate_labels": _text_list(100),
                "multi_label": _boolean,
                "hypothesis_template": _short_text,
            },
            required_params=frozenset({"candidate_labels"}),
            shape_item=_zero_shot_item,
        ),
        Task(
            "text-generation",
            _text,
            {
                "max_new_tokens": _int_range(1, 4096),
                "do_sample": _boolean,
                "temperature": _float_range(0.0, 100.0),
                "top_p": _float_range(0.0, 1.0),
                "top_k": _int_range(1, 1000),
                "return_full_text": _boolean,
                "seed": _int_range(0, 2**32 - 1),
                "stop": _stop_sequences,
                "repetition_penalty": _float_range(0.0, 100.0),
                "details": _boolean,
            },
            extra_fields=frozenset({"stream"}),
        ),
        Task(
            "question-answering",
            _question_context,
            {
                "top_k": _int_range(1, 100),
                "max_answer_len": _int_range(1, 1000),
                "max_seq_len": _int_range(16, 4096),
                "handle_impossible_answer": _boolean,
            },
        ),
        *(
            Task(
                name,
                _text,
                {
                    "clean_up_tokenization_spaces": _boolean,
                    "truncation": _one_of(
                        "do_not_truncate", "longest_first", "only_first", "only_second"
                    ),
                    "generate_parameters": _generate_parameters,
                    **({"src_lang": _language, "tgt_lang": _language} if translates else {}),
                    **GENERATE_PARAMS,
                },
                single_answer=SingleAnswer.LIST,
            )
            for name, translates in [
                ("summarization", False),
                ("translation", True),
                ("text2text-generation", False),
            ]
        ),
    ]
}

# Tasks served by a custom handler take any JSON input and any parameters.
CUSTOM_TASK = "custom"
SEQ2SEQ_TASKS = frozenset({"summarization", "translation", "text2text-generation"})
# Set by the server on a streamed request's parameters (never by a client): the worker
# sends that stream a TokenChunk per new token.
STREAM_ID_PARAM = "stream_id"


@dataclass(frozen=True)
class ParsedRequest:
    inputs: list[Any]
    params: dict[str, Any]
    is_list: bool  # answer a list (the client sent a list of inputs)
    stream: bool = False  # answer text/event-stream, one event per new token


def task_rules(name: str) -> Task | None:
    return TASKS.get(name)


def parse_json_body(task_name: str, document: Any) -> ParsedRequest:
    """Check an Inference-API shaped body `{"inputs": X, "parameters": {...}}`."""
    if not isinstance(document, dict) or "inputs" not in document:
        raise BadRequest('the JSON body must be an object with an "inputs" field')
    task = task_rules(task_name)
    known_fields = {"inputs", "parameters", "options"}
    if task is not None:
        known_fields |= task.extra_fields
        if task.params_at_root:
            known_fields |= set(task.params)
    unknown_fields = set(document) - known_fields
    if unknown_fields:
        raise BadRequest(f"unknown field(s): {', '.join(sorted(unknown_fields))}")
    raw_inputs = document["inputs"]
    is_list = isinstance(raw_inputs, list)
    items = raw_inputs if is_list else [raw_inputs]
    if not items:
        raise BadRequest('"inputs" must not be an empty list')
    params = document.get("parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest('"parameters" must be an object')
    if task is None:  # custom handler: it validates what it is given
        return ParsedRequest(list(items), dict(params), is_list)
    if task.params_at_root:
        params = {**params, **{k: v for k, v in document.items() if k in task.params}}
    stream = document.get("stream")
    if stream not in (None, True, False):
        raise BadRequest('"stream" must be true or false')
    if stream and is_list:
        raise BadRequest("a streamed answer takes one input, not a list")
    return ParsedRequest(
        [check_input(task, item) for item in items],
        check_params(task, params),
        is_list,
        stream=bool(stream),
    )


def parse_text_body(task_name: str, text: str) -> ParsedRequest:
    """A raw (non-JSON) body is one input, as `curl -d` sends it."""
    task = task_rules(task_name)
    item = text if task is None else check_input(task, text)
    if task is not None:
        check_params(task, {})  # a task with required parameters needs JSON
    return ParsedRequest([item], {}, is_list=False)


def check_input(task: Task, item: Any) -> Any:
    try:
        return task.check_input(item)
    except ValueError as exc:
        raise BadRequest(f"invalid input for {task.name}: {exc}") from None


def check_params(task: Task, params: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(params) - set(task.params))
    if unknown:
        allowed = ", ".join(sorted(task.params)) or "none"
        raise BadRequest(
            f"unknown parameter(s) for {task.name}: {', '.join(unknown)} (allowed: {allowed})"
        )
    missing = sorted(task.required_params - set(params))
    if missing:
        raise BadRequest(f"missing required parameter(s) for {task.name}: {', '.join(missing)}")
    checked = {}
    for name, value in params.items():
        if value is None:  # clients such as InferenceClient send explicit nulls
            continue
        try:
            checked[name] = task.params[name](value)
        except ValueError as exc:
            raise BadRequest(f"parameter {name!r} {exc}") from None
    return checked


def batch_key(params: Mapping[str, Any]) -> str:
    """Items share a model call only when their parameters are equal."""
    return json.dumps(params, sort_keys=True, separators=(",", ":"))


def estimate_tokens(item: Any) -> int:
    """A cheap token-count estimate without a tokenizer (about 4 characters a token)."""
    if isinstance(item, str):
        return 2 + len(item) // 4
    if isinstance(item, dict):
        return 2 + sum(len(v) // 4 for v in item.values() if isinstance(v, str))
    return 1


def split_outputs(task_name: str, inputs: Sequence[Any], raw: Any) -> list[Any]:
    """Turn one pipeline call's answer into one output per input.

    A pipeline called on a one-item list may answer the item's output without the
    outer list (fill-mask does); this is the one place that knows which tasks do.
    """
    task = task_rules(task_name)
    if len(inputs) == 1 and task is not None and task.unwraps_single:
        raw = [raw]
    if not isinstance(raw, list) or len(raw) != len(inputs):
        raise RuntimeError(
            f"{task_name} answered {len(raw) if isinstance(raw, list) else 'a non-list'} "
            f"outputs for {len(inputs)} inputs"
        )
    if task is not None and task.shape_item is not None:
        return [task.shape_item(output) for output in raw]
    return list(raw)


def shape_answer(task_name: str | None, outputs: list[Any], is_list: bool) -> Any:
    """The JSON answer to a request, from its items' outputs (in the Inference API's shape).

    A list of inputs is answered by the list of outputs. One input is answered by its
    output, except where the Inference API (and so InferenceClient) expects a list.
    """
    if is_list:
        return outputs
    [output] = outputs
    task = task_rules(task_name) if task_name else None
    if task is None or task.single_answer == SingleAnswer.ITEM:
        return output
    if task.single_answer == SingleAnswer.LIST_OF_LISTS:
        return [output if isinstance(output, list) else [output]]
    return [output]
