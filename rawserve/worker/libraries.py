"""The libraries a worker's model runs on, set up for a server: their log lines through the
worker's handler, and a fast tokenizer's threads.

Imports none of them: it sets up those loaded by now, so that a handler's worker, whose
handler may use neither torch nor transformers, is not made to load them (importing them
was most of such a worker's start).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping


def library_logs_through_ours() -> None:
    """transformers' and torch's log lines go through the worker's own handler, in the
    server's format, not through the plain-text handlers these libraries install for their
    loggers (with --log-format json, every line is one JSON object). Those loaded by now:
    a handler's worker calls it again once its code has loaded what it uses."""
    if "transformers" in sys.modules:
        import transformers.utils.logging

        transformers.utils.logging.disable_default_handler()
        transformers.utils.logging.enable_propagation()
        models = logging.getLogger("transformers.modeling_utils")
        if not any(isinstance(f, NoPaddingFalseAlarm) for f in models.filters):
            models.addFilter(NoPaddingFalseAlarm())
    # torch gives "torch" and its registered loggers a stderr handler of its own and stops
    # their records there (its ONNX exporter's "torchvision is not installed" warnings,
    # say); a file that TORCH_LOGS_OUT asked for keeps its handler
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if not isinstance(logger, logging.Logger) or name.split(".")[0] != "torch":
            continue
        own = [handler for handler in logger.handlers if type(handler) is logging.StreamHandler]
        for handler in own:
            logger.removeHandler(handler)
        if own:
            logger.propagate = True


class NoPaddingFalseAlarm(logging.Filter):
    """Leaves out transformers' warning that input ids "may be padded" with no attention
    mask, which every generation model's worker logged at its warm-up: rawserve gives
    every batch its mask, `generate` drops a mask of all ones, and the model then warns
    as soon as a new token is the pad token's id (a random model's often)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "recommend passing in an `attention_mask`" not in record.getMessage()


def tokenize_in_the_calling_thread(environ: MutableMapping[str, str]) -> None:
    """A worker's fast tokenizer runs in the thread that calls it, not on a pool of its own,
    unless the environment says otherwise (`TOKENIZERS_PARALLELISM`, `RAYON_NUM_THREADS`).

    Its pool is as large as the machine (rayon), in every worker. On a CPU, where each
    worker is given its share of the cores, the pool's threads queued behind the other
    workers and the server while the model's thread waited for them: on two cores with
    two single-threaded workers, 7-10 % of the machine stood idle and the server
    answered 5-10 % fewer texts (bench/RESULTS.md). On a GPU the tokenizing runs on the
    preparing thread beside the GPU's work, and every GPU figure so far was measured
    without the pool (the benchmark's servers had it off), up to 12,400 texts/s."""
    if "TOKENIZERS_PARALLELISM" not in environ and "RAYON_NUM_THREADS" not in environ:
        environ["TOKENIZERS_PARALLELISM"] = "false"
