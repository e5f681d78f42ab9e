"""The registry of tasks, and the one place that applies their rules: check an input and
its parameters, key a batch, estimate an input's tokens, split a model call's answer into
one output per input, and shape the JSON answer.

`TASKS` gathers the per-task modules. A failed check raises `InvalidRequest` (the api
answers it 400; its `UnservedParameter`, a parameter taken only unset, 422), or
`BlankInput` for text with nothing in it (422). Plain Python: both
processes import it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rawserve.tasks import (
    feature_extraction,
    fill_mask,
    image_classification,
    question_answering,
    seq2seq,
    text_classification,
    text_generation,
    token_classification,
    zero_shot_classification,
)
from rawserve.tasks.checks import IGNORED, BlankInput, Unserved
from rawserve.tasks.estimate import estimate_tokens
from rawserve.tasks.rules import (
    UNKNOWN_POSITIONS_NEW_TOKENS,
    InvalidRequest,
    SingleAnswer,
    Task,
    UnknownParameters,
    UnservedParameter,
)

TASKS: dict[str, Task] = {
    task.name: task
    for task in [
        feature_extraction.TASK,
        fill_mask.TASK,
        text_classification.TASK,
        token_classification.TASK,
        zero_shot_classification.TASK,
        text_generation.TASK,
        question_answering.TASK,
        *seq2seq.TASKS,
        image_classification.TASK,
    ]
}

# Tasks served by a custom handler take any JSON input and any parameters.
CUSTOM_TASK = "custom"
# The encoder tasks: a batch is one forward pass. ONNX Runtime serves these (--engine
# onnx), and the CPU layout trial times them; a generation's batch lasts as long as its
# longest answer.
ENCODER_TASKS = frozenset(
    {
        "feature-extraction",
        "text-classification",
        "zero-shot-classification",
        "token-classification",
        "fill-mask",
        "question-answering",
    }
)


def onnx_unfit(
    task: str | None,
    device: str = "cpu",
    dtype: str = "auto",
    installed: bool = True,
    pooling: str = "none",
) -> str | None:
    """Why ONNX Runtime cannot serve `task` (None: not known yet) on `device` in `dtype`
    (`installed`: whether onnxruntime is; `pooling`: a feature-extraction model's); None
    where it can. Said alike by the server before any worker starts, of what it knows
    then, and by a worker choosing its engine."""
    if task is not None and task not in ENCODER_TASKS:
        return f"ONNX Runtime serves the encoder tasks, not {task}"
    if pooling == "splade":  # its graph would answer every token's logits, 30,000 a token
        return "a SPLADE model's pooling runs on torch only"
    if device != "cpu":
        return f"ONNX Runtime runs here on the CPU only, not on {device}"
    if dtype not in ("auto", "float32"):
        return f"ONNX Runtime runs float32 here, not {dtype}"
    if not installed:
        return "onnxruntime is not installed (pip install 'rawserve[onnx]')"
    return None


def task_rules(name: str) -> Task | None:
    return TASKS.get(name)


def input_estimate(task_name: str | None) -> Callable[[Any], int]:
    """How the scheduler weighs an input of `task_name` before a worker reads it (a
    handler's, or a task not known: as text)."""
    rules = TASKS.get(task_name) if task_name else None
    return rules.estimate if rules is not None else estimate_tokens


def check_input(task: Task, item: Any) -> Any:
    try:
        return task.check_input(item)
    except BlankInput as exc:
        raise BlankInput(f"invalid input for {task.name}: {exc}") from None
    except ValueError as exc:
        raise InvalidRequest(f"invalid input for {task.name}: {exc}") from None


def check_generation_length(params: Mapping[str, Any], longest: int | None) -> None:
    """Refuse a generation the loaded model cannot make: more new tokens than its
    positions allow (`longest`; None where they are unknown: `check_new_tokens`'s
    ceiling). `max_length` and `min_length` (transformers 4's names) count the decoder's
    start token too, and are not read beside `max_new_tokens` and `min_new_tokens`, which
    transformers' `generate` takes over them."""
    longest = UNKNOWN_POSITIONS_NEW_TOKENS if longest is None else longest
    nested = params.get("generate_parameters")
    # seq2seq's worker reads `generate_parameters` over the parameters beside it
    read = {**params, **(nested if isinstance(nested, Mapping) else {})}
    for name in ("max_new_tokens", "min_new_tokens"):
        if isinstance(read.get(name), int):
            check_new_tokens(name, read[name], longest)
    for name, over in (("max_length", "max_new_tokens"), ("min_length", "min_new_tokens")):
        asked = read.get(name)
        if isinstance(asked, int) and not isinstance(read.get(over), int) and asked > longest + 1:
            raise InvalidRequest(
                f"{name} is {asked}, and this model's decoder holds at most {longest + 1} "
                f"tokens: its start token and {longest} new ones"
            )


def check_new_tokens(name: str, asked: int, most: int | None) -> None:
    """The one rule of every generation route: asking for more new tokens than the
    model's positions allow is refused (400), never cut to fit. `name` is the field
    the client sent (`max_new_tokens`, OpenAI's `max_tokens`...); `most` None: the
    model's positions are unknown (a handler; T5's relative positions), and
    `UNKNOWN_POSITIONS_NEW_TOKENS` bounds it."""
    most = UNKNOWN_POSITIONS_NEW_TOKENS if most is None else most
    if asked > most:
        raise InvalidRequest(f"{name} is {asked}, and this model generates at most {most} tokens")


def check_params(task: Task, params: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(params) - set(task.params))
    if unknown:
        allowed = ", ".join(sorted(task.params)) or "none"
        # said whole (a task's allowed list is long, and what a client needs), so the
        # client's names in it are bounded
        shown = [name[:NAME_CHARS_SHOWN] for name in unknown[:NAMES_SHOWN]]
        more = f" and {len(unknown) - NAMES_SHOWN} more" if len(unknown) > NAMES_SHOWN else ""
        raise UnknownParameters(
            f"unknown parameter(s) for {task.name}: {', '.join(shown)}{more}"
            + tasks_taking(unknown[:NAMES_SHOWN])
            + f"; allowed: {allowed}"
        )
    given = {name for name, value in params.items() if value is not None}
    missing = sorted(task.required_params - given)
    if missing:
        raise InvalidRequest(f"missing required parameter(s) for {task.name}: {', '.join(missing)}")
    checked = {}
    for name, value in params.items():
        if value is None:  # clients such as InferenceClient send explicit nulls
            continue
        try:
            value = task.params[name](value)
        except Unserved as exc:
            raise UnservedParameter(f"parameter {name!r} {exc}") from None
        except ValueError as exc:
            raise InvalidRequest(f"parameter {name!r} {exc}") from None
        if value is not IGNORED:
            checked[task.worker_names.get(name, name)] = value
    return checked


TASKS_NAMED = 3  # of the other tasks that take a parameter, the most a message names
NAMES_SHOWN = 5  # of a request's unknown parameters, the most a refusal names
NAME_CHARS_SHOWN = 40  # of each, the most it quotes


def tasks_taking(names: Sequence[str], *, as_fields: bool = False) -> str:
    """Where parameters (`as_fields`: fields of `POST /`'s body) unknown to a model's task
    are another task's, which, each (a model that can do both is served for one: an NLI
    model as text-classification was sent zero-shot's candidate_labels; TGI's client
    asking an embedding model to generate read that its field `stream` was unknown)."""
    said = []
    for name in names:
        others = sorted(task.name for task in TASKS.values() if _takes(task, name, as_fields))
        if others:
            listed = ", ".join(others[:TASKS_NAMED])
            if len(others) > TASKS_NAMED:  # top_k is ten tasks'
                more = len(others) - TASKS_NAMED
                listed += f" and {more} other task{'s' if more > 1 else ''}"
            said.append(f"{name} is a {'field' if as_fields else 'parameter'} of {listed}")
    if not said:
        return ""
    return f"; {'; '.join(said)} (a model is served for one task: MODEL:TASK)"


def other_tasks_fields(task_name: str, unknown: Sequence[str], allowed: str) -> str | None:
    """The refusal of fields of `POST /`'s body unknown to the model's task where other
    tasks take them, naming those (a handler's takes what it likes: none); None where
    no task does."""
    others = [name for name in unknown if any(_takes(t, name, True) for t in TASKS.values())]
    if task_rules(task_name) is None or not others:
        return None
    shown = ", ".join(repr(name[:NAME_CHARS_SHOWN]) for name in unknown[:NAMES_SHOWN])
    more = f" and {len(unknown) - NAMES_SHOWN} more" if len(unknown) > NAMES_SHOWN else ""
    elsewhere = tasks_taking(others[:NAMES_SHOWN], as_fields=True)
    return f"unknown field(s) for {task_name}: {shown}{more}{elsewhere}; allowed: {allowed}"


def _takes(task: Task, name: str, as_field: bool) -> bool:
    if not as_field:
        return name in task.params
    return name in task.extra_fields or (task.params_at_root and name in task.params)


def batch_key(params: Mapping[str, Any]) -> str:
    """Items share a model call only when their parameters are equal."""
    if not params:
        return "{}"  # most requests give none: their key without encoding
    return json.dumps(params, sort_keys=True, separators=(",", ":"))


def model_tokens(item: Any, params: Mapping[str, Any], tokens: int, limit: int | None) -> int:
    """The tokens the model reads for one input of `tokens` tokens (estimated), of which
    it reads at most `limit` at once (None: no limit known): what it cuts of a longer one,
    and again where its task reads it more than once: a zero-shot text once per candidate
    label (a (text, hypothesis) pair each), a question-answering context once per window,
    a token-classification text with a `stride` once per window of the whole text.
    Counted as the input's own tokens, a request with 100 labels or a stride just under
    the window took one turn and one item's share of the deadline for a hundred or a
    thousand times the work, and held the worker long past its 504."""
    stride = params.get("stride")
    if isinstance(stride, int) and limit is not None:
        return token_classification.window_tokens(tokens, limit, stride)
    if limit is not None:  # the rest truncate
        tokens = min(tokens, limit)
    cut = params.get("truncate")  # TGI's: a prompt's last that many (TEI's is a flag)
    if type(cut) is int:
        tokens = min(tokens, cut)
    labels = params.get("candidate_labels")
    if isinstance(labels, list):
        return zero_shot_classification.pairs_tokens(labels, params, tokens, limit)
    if isinstance(item, dict) and isinstance(item.get("question"), str) and "context" in item:
        return question_answering.window_tokens(item, params, tokens)
    return tokens


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


def shape_answer(
    task_name: str | None, outputs: list[Any], is_list: bool, *, raw_text: bool = False
) -> Any:
    """The JSON answer to a request, from its items' outputs (in the Inference API's shape).

    A list of inputs is answered by the list of outputs. One input is answered by its
    output, except where the Inference API (and so InferenceClient) expects a list. A
    raw-text body (`curl -d "text"`, the seed's way) is answered as the pipeline answers
    that string: `pipe(text)` gives text-classification's labels as one list, where the
    Inference API's `{"inputs": text}` wraps them in another.
    """
    if is_list:
        return outputs
    [output] = outputs
    task = task_rules(task_name) if task_name else None
    if task is None or task.single_answer == SingleAnswer.ITEM:
        return output
    labels = output if isinstance(output, list) else [output]
    if task.single_answer == SingleAnswer.LIST_OF_LISTS:
        return labels if raw_text else [labels]
    return labels
