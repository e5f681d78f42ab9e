"""The warm-up: one batch at the configured maximum batch size, run before a worker says
it is ready, so that the first client's request does not pay for what a model's first
call sets up lazily (kernels chosen, memory pools grown, caches filled).

The batch is made of a task's example input, checked by the same rules as a client's
(rawserve.tasks), its text cut to what the model reads; a text-generation or text-to-text
model generates a few tokens. A task with no example (a custom handler: its inputs are its
own) is not warmed. A warm-up that fails is logged and the worker serves anyway (it is a
courtesy, not a test), except where the model itself fails on its task's example (a
wav2vec2 served for text: its forward takes no text): then every request would be a 500,
and the start stops saying why.

Worker process only (it runs the loaded model).
"""

from __future__ import annotations

import base64
import io
import logging
import time
from typing import Any

from rawserve.shared.logs import first_line
from rawserve.shared.messages import FailureKind
from rawserve.tasks import InvalidRequest, check_input, check_params, task_rules
from rawserve.worker.runner import Runner

log = logging.getLogger("rawserve.worker")

EXAMPLE_TEXT = "The quick brown fox jumps over the lazy dog near the river bank."
MASKED_WORD = "lazy"  # the word fill-mask's example masks
GENERATED_TOKENS = 4  # a short generation: enough to run the decoding loop


def example(runner: Runner, text: str = EXAMPLE_TEXT) -> tuple[Any, dict[str, Any]] | None:
    """A typical input of the runner's task, made of `text`, with the parameters it
    needs; None if the task has no example."""
    task = runner.task
    if task in ("feature-extraction", "text-classification", "token-classification"):
        return text, {}
    if task == "fill-mask":
        mask = getattr(runner.tokenizer, "mask_token", None) or "[MASK]"
        return masked(text, mask), {}
    if task == "zero-shot-classification":
        return text, {"candidate_labels": ["animals", "weather"]}
    if task == "question-answering":
        return {"question": "Who jumps?", "context": text}, {}
    if task in ("text-generation", "summarization", "translation", "text2text-generation"):
        return text, {"max_new_tokens": GENERATED_TOKENS}
    if task == "image-classification":
        return example_image(), {}
    return None


def masked(text: str, mask: str) -> str:
    """`text` with `MASKED_WORD` masked, or its last word where it was cut before that."""
    if MASKED_WORD in text.split(" "):
        return text.replace(MASKED_WORD, mask)
    return " ".join([*text.split(" ")[:-1], mask])


def example_text(runner: Runner) -> str:
    """`EXAMPLE_TEXT`, cut a word at a time to what the model reads (a generation's prompt
    leaves room for its new tokens). Whole, it is 48 tokens of a byte-level BPE: a model
    of 32 positions refused it, and served without its warm-up."""
    limit = runner.limits.longest_input
    if limit is None or runner.tokenizer is None:
        return EXAMPLE_TEXT
    room = GENERATED_TOKENS if runner.task == "text-generation" else 0
    most = max(limit - room, 1)
    words = EXAMPLE_TEXT.split(" ")
    while len(words) > 1 and len(runner.tokenizer(" ".join(words))["input_ids"]) > most:
        words.pop()
    return " ".join(words)


def example_image() -> str:
    """A small gray picture, base64 PNG, as image inputs are queued."""
    from PIL import Image  # the image extra: only image-classification models get here

    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (128, 128, 128)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def example_batch(runner: Runner, size: int) -> tuple[list[Any], dict[str, Any]] | None:
    """`size` checked example inputs of the runner's task and their checked parameters
    (the warm-up's batch, and the engine trial's); None when the task has none."""
    rules = task_rules(runner.task)
    if rules is None or size < 1:
        return None
    found = example(runner, example_text(runner))
    if found is None:
        return None
    value, params = found
    try:
        return [check_input(rules, value)] * size, check_params(rules, params)
    except InvalidRequest as exc:  # the example does not suit this model: serve anyway
        log.warning("no warm-up: %s", exc)
        return None


class ModelFails(RuntimeError):
    """The model failed on its task's example input: the start stops with this line."""


def warm_up(runner: Runner, size: int) -> float | None:
    """Run one batch of `size` example inputs; its seconds, or None when nothing ran."""
    batch = example_batch(runner, size)
    if batch is None:
        return None
    inputs, checked = batch
    started = time.perf_counter()
    try:
        runner.run(inputs, checked)
    except Exception as exc:  # noqa: BLE001 - a failed warm-up is logged; the model still serves
        if fails_alone(runner, inputs[0], checked, exc):
            said = first_line(exc) if str(exc).strip() else "no message"
            raise ModelFails(
                f"the model fails on its task's example input ({type(exc).__name__}: {said}),"
                f" as it would on every request: is it a {runner.task} model?"
            ) from exc
        log.warning("the warm-up batch failed; serving without it", exc_info=True)
        return None
    seconds = time.perf_counter() - started
    log.info("warm-up: a batch of %d took %.2f s", size, seconds)
    if runner.graphed is not None:
        from rawserve.worker.cuda_graphs import said_after_warm_up

        warm_graphs(runner, inputs, checked)
        runner.cuda_graphs = said_after_warm_up(runner.cuda_graphs, [runner.graphed.shelf])
    return seconds


# What a model raises where its forward cannot take its task's input at all (a wav2vec2's
# forward has no input_ids). Not RuntimeError: a device's, a kernel's or a precision's
# failure (cuBLAS out of workspace, no kernel for this GPU, half precision on a CPU) is
# no sign that every request fails.
UNFIT_MODEL_ERRORS = (TypeError, AttributeError, KeyError)


def fails_alone(runner: Runner, item: Any, checked: dict[str, Any], exc: Exception) -> bool:
    """Whether the model failed the warm-up batch (`exc`) as it fails any input: unfit
    for the task's input (`UNFIT_MODEL_ERRORS`), not for the input's fault, and again on
    one input alone (a batch of the maximum size may fail where smaller ones run)."""
    if not isinstance(exc, UNFIT_MODEL_ERRORS) or runner.describe_failure(exc).kind != (
        FailureKind.INTERNAL
    ):
        return False
    try:
        runner.run([item], checked)
    except Exception as alone:  # noqa: BLE001 - what it says is the question
        return isinstance(alone, UNFIT_MODEL_ERRORS)
    return False


def warm_graphs(runner: Runner, inputs: list[Any], checked: dict[str, Any]) -> None:
    """With CUDA graphs: the example at every smaller bucket of rows too, so that the
    first clients' batches of a few short texts replay a graph instead of recording one
    (rawserve.worker.cuda_graphs)."""
    from rawserve.worker.cuda_graphs import ROW_BUCKETS

    started = time.perf_counter()
    smaller = [rows for rows in ROW_BUCKETS if rows < len(inputs)]
    try:
        for rows in smaller:
            runner.run(inputs[:rows], checked)
    except Exception:  # noqa: BLE001 - a courtesy, as the warm-up is
        log.warning("warming the CUDA graphs failed; serving without them warm", exc_info=True)
        return
    seconds = time.perf_counter() - started
    log.info("warm-up: %d batch shapes recorded in %.2f s", len(smaller), seconds)
