"""The transformers class each task's model is loaded as, and what loading it left
untrained.

A model type that a task's class cannot load is refused before transformers fails on it
with a ~600-character error listing every config class it knows; the refusal says what
the task needs, what the model is, and which tasks it can serve. A model that loads, but
whose checkpoint has no tensors for some of its weights (a checkpoint served with a task
head it was never trained with: a classifier as fill-mask, BART as a causal LM), has
those weights made at random by transformers, and says so only in its LOAD REPORT table:
`Untrained` says it in one line, which the worker logs (rawserve.worker.process).

Worker process only (imports transformers' Auto classes).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

# The class each of rawserve's tasks loads its model as (the pipelines' own first class
# for the tasks served through a pipeline).
TASK_CLASSES: dict[str, str] = {
    "feature-extraction": "AutoModel",
    "text-classification": "AutoModelForSequenceClassification",
    "zero-shot-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "fill-mask": "AutoModelForMaskedLM",
    "question-answering": "AutoModelForQuestionAnswering",
    "text-generation": "AutoModelForCausalLM",
    "summarization": "AutoModelForSeq2SeqLM",
    "translation": "AutoModelForSeq2SeqLM",
    "text2text-generation": "AutoModelForSeq2SeqLM",
    "image-classification": "AutoModelForImageClassification",
}
# What a user knows a class's models as (others: "a model transformers loads as <class>")
KINDS: dict[str, str] = {
    "AutoModelForSeq2SeqLM": "an encoder-decoder model (such as BART or T5)",
    "AutoModelForCausalLM": "a decoder model (such as GPT-2, Llama or Qwen)",
    "AutoModelForMaskedLM": "a masked language model (such as BERT or RoBERTa)",
    "AutoModelForSequenceClassification": "a text encoder (such as BERT or DeBERTa)",
    "AutoModelForTokenClassification": "a text encoder (such as BERT or RoBERTa)",
    "AutoModelForQuestionAnswering": "a text encoder (such as BERT or RoBERTa)",
    "AutoModelForImageClassification": "an image model (such as ViT or ConvNeXt)",
}
# Encoder-decoder models whose embeddings come from their encoder alone, as
# sentence-transformers loads them (sentence-t5, GTR): AutoModel makes the whole model,
# whose forward asks for decoder inputs (every request to such a folder failed)
ENCODER_ALONE: dict[str, str] = {
    "t5": "T5EncoderModel",
    "mt5": "MT5EncoderModel",
    "umt5": "UMT5EncoderModel",
    "longt5": "LongT5EncoderModel",
}
# Weights that rawserve never reads, so that their being random changes no answer: the
# pooler of an AutoModel (feature-extraction pools the last hidden states itself)
UNREAD_WEIGHTS: dict[str, tuple[str, ...]] = {"AutoModel": ("pooler.",)}
LAYERS_NAMED = 4  # in the warning: the first few layers, then how many more


def loads_as(model_type: str, class_name: str) -> bool:
    """Whether transformers' `class_name` has a model for `model_type` (True where this
    transformers does not say: its own error then stands)."""
    mapping = getattr(getattr(transformers, class_name, None), "_model_mapping", None)
    if mapping is None or model_type not in CONFIG_MAPPING:
        return True
    # As from_pretrained looks it up: the config class among those of the model types the
    # class has a model for (the mapping's own `in` goes through its reverse name map,
    # wrong for a model type whose config class is shared: evolla). By their names: its
    # keys() import every such config's module, 1.3-2.5 s of each worker's start.
    config_names = getattr(mapping, "_config_mapping", None)
    model_types = getattr(mapping, "_model_mapping", None)
    if config_names is None or model_types is None or getattr(mapping, "_extra_content", None):
        return CONFIG_MAPPING[model_type] in mapping.keys()  # noqa: SIM118
    wanted = config_names.get(model_type)
    return wanted is not None and any(config_names.get(other) == wanted for other in model_types)


def refuse_unfit_model_type(folder: Path, task: str) -> None:
    """Raise ValueError, in one line, when `task`'s class cannot load the folder's model
    type: what the task needs, what the model is, and what it can serve instead."""
    needed = TASK_CLASSES.get(task)
    model_type = model_type_of(folder)
    if needed is None or model_type is None or loads_as(model_type, needed):
        return
    kind = KINDS.get(needed, f"a model transformers loads as {needed}")
    # (not every task whose class loads it: most would serve a head its checkpoint lacks)
    trained = architecture_of(folder)
    instead = (
        f"serve it without --task, for what it was trained as ({trained}: rawserve reads "
        f"the task from it), or serve a model made for {task}"
        if trained
        else f"serve a model made for {task}"
    )
    raise ValueError(f"{task} needs {kind}; this model is a {model_type}: {instead}")


def model_type_of(folder: Path) -> str | None:
    """The model type config.json names (None: it names none, or there is no such file)."""
    named = _config(folder).get("model_type")
    return named if isinstance(named, str) else None


def architecture_of(folder: Path) -> str | None:
    """The class the checkpoint was saved as, which config.json names (None: none)."""
    named = _config(folder).get("architectures")
    return named[0] if isinstance(named, list) and named and isinstance(named[0], str) else None


def _config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


@dataclass(frozen=True)
class Untrained:
    """The weights of a loaded model that its checkpoint had no tensors for: transformers
    made them at random, and every answer that passes through them means nothing."""

    model_class: str  # what the model was loaded as
    tensors: tuple[str, ...]  # the weights' names, sorted
    numbers: int  # how many numbers they hold

    def warning(self, task: str) -> str:
        """The one line a worker logs (in plain words: transformers' own report is a table)."""
        layers = sorted({name.rpartition(".")[0] or name for name in self.tensors})
        named = ", ".join(layers[:LAYERS_NAMED])
        if len(layers) > LAYERS_NAMED:
            named += f" and {len(layers) - LAYERS_NAMED} more"
        count = f"{len(self.tensors)} weight tensor{'s' if len(self.tensors) != 1 else ''}"
        return (
            f"{count} of {self.model_class} ({self.numbers:,} numbers, in {named}) are not in "
            f"the checkpoint, so they are random: its {task} answers will mean nothing until "
            f"a model trained for {task} is served"
        )

    def as_dict(self) -> dict[str, Any]:
        return {"model_class": self.model_class, "tensors": self.tensors, "numbers": self.numbers}

    @classmethod
    def from_dict(cls, kept: Any) -> Untrained | None:
        """What `as_dict` kept (None: nothing, or not a record of this shape)."""
        try:
            return cls(str(kept["model_class"]), tuple(kept["tensors"]), int(kept["numbers"]))
        except (KeyError, TypeError, ValueError):
            return None


def load_model(class_name: str, folder: str, **kwargs: Any) -> tuple[Any, Untrained | None]:
    """transformers' `class_name`.from_pretrained, and what the checkpoint left untrained
    of the model it made (None: nothing). AutoModel loads an encoder-decoder's encoder
    alone (`ENCODER_ALONE`)."""
    if class_name == "AutoModel":
        class_name = ENCODER_ALONE.get(model_type_of(Path(folder)) or "", class_name)
    loader = getattr(transformers, class_name)
    with load_report_held_back(), weights_made_alike():
        model, info = loader.from_pretrained(folder, output_loading_info=True, **kwargs)
    missing = set(info.get("missing_keys", ()))
    if missing and all(name in missing for name, _ in model.named_parameters()):
        # (a few missing are a head left to train, served with a warning; all are noise)
        raise ValueError(
            f"none of the checkpoint's weights are {type(model).__name__}'s: they are "
            "another model's, or named otherwise, and every answer would be noise"
        )
    every_output_labelled(model.config)
    return model, untrained(model, missing, UNREAD_WEIGHTS.get(class_name, ()))


def every_output_labelled(config: Any) -> None:
    """A label for each of the head's outputs, as transformers names one a config leaves
    out (`LABEL_1`): an `id2label` with a gap ({0: NEG, 2: POS} for two outputs) failed
    the pipeline at the missing one (a 500 at `top_k`), while /predict named it and /info
    listed the config's keys, which the head does not have."""
    labels = getattr(config, "id2label", None)
    if not isinstance(labels, dict) or sorted(labels) == list(range(len(labels))):
        return
    config.id2label = {i: labels.get(i, f"LABEL_{i}") for i in range(config.num_labels)}
    config.label2id = {label: i for i, label in config.id2label.items()}


# the seed of the weights a checkpoint has none for: every worker, and every restart of
# one, makes the same random head, so an answer does not depend on the worker it met
UNTRAINED_SEED = 0


@contextmanager
def weights_made_alike() -> Iterator[None]:
    """Seeds torch's CPU generator, which makes the weights a checkpoint lacks, while a
    model loads, and gives it back as it was after: a client's seeded sampling is not
    changed by the load (nor a GPU's generators, which `torch.manual_seed` would seed
    and `fork_rng(devices=[])` not give back)."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(UNTRAINED_SEED)
        yield


# the logger of transformers' LOAD REPORT table, the words that title it, and those of
# its warning that tied weights both missing mean "this checkpoint seem corrupted" (a
# head the checkpoint never had: the same weights the table lists)
LOADING_LOGGER = "transformers.modeling_utils"
LOAD_REPORT = "LOAD REPORT"
HELD_BACK = (LOAD_REPORT, "This checkpoint seem corrupted")


class _HeldReports(logging.Filter):
    """Keeps the records of `HELD_BACK` it is given, and lets the others through."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not any(words in message for words in HELD_BACK):
            return True
        self.records.append(record)
        return False


@contextmanager
def load_report_held_back() -> Iterator[None]:
    """transformers' LOAD REPORT table, held back while a model loads and logged only if
    the load fails (it then lists the tensors whose shapes do not match). A load that
    succeeds is said in rawserve's own line (`Untrained`, where weights are random): the
    table, in terminal escape codes, came at every load, three times at a first start's
    engine trial, where the README promises one warning."""
    logger = logging.getLogger(LOADING_LOGGER)
    held = _HeldReports()
    logger.addFilter(held)
    try:
        yield
    except BaseException:
        logger.removeFilter(held)
        for record in held.records:
            logger.handle(record)
        raise
    logger.removeFilter(held)


def untrained(model: Any, missing: Any, unread: tuple[str, ...] = ()) -> Untrained | None:
    """What of `model` the checkpoint had no tensors for (`missing`: transformers' names
    of them), less the weights whose names start with one of `unread`; None: nothing."""
    names = sorted(name for name in missing if not name.startswith(unread))
    if not names:
        return None
    weights = model.state_dict()
    # (tied weights are one tensor under two names: counted once)
    distinct = {weights[name].data_ptr(): weights[name] for name in names if name in weights}
    numbers = sum(tensor.numel() for tensor in distinct.values())
    return Untrained(type(model).__name__, tuple(names), numbers)
