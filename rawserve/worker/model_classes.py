"""The transformers class each task's model is loaded as.

A model type that a task's class cannot load is refused before transformers fails on it
with a ~600-character error listing every config class it knows; the refusal says what
the task needs, what the model is, and which tasks it can serve.

Worker process only (imports transformers' Auto classes).
"""

from __future__ import annotations

import json
from pathlib import Path

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


def loads_as(model_type: str, class_name: str) -> bool:
    """Whether transformers' `class_name` has a model for `model_type` (True where this
    transformers does not say: its own error then stands)."""
    mapping = getattr(getattr(transformers, class_name, None), "_model_mapping", None)
    if mapping is None or model_type not in CONFIG_MAPPING:
        return True
    return CONFIG_MAPPING[model_type] in mapping


def refuse_unfit_model_type(folder: Path, task: str) -> None:
    """Raise ValueError, in one line, when `task`'s class cannot load the folder's model
    type: what the task needs, what the model is, and what it can serve instead."""
    needed = TASK_CLASSES.get(task)
    model_type = model_type_of(folder)
    if needed is None or model_type is None or loads_as(model_type, needed):
        return
    kind = KINDS.get(needed, f"a model transformers loads as {needed}")
    served = [other for other, name in TASK_CLASSES.items() if loads_as(model_type, name)]
    instead = (
        f"serve it with another --task ({', '.join(served)}), or another model"
        if served
        else f"serve a model made for {task}"
    )
    raise ValueError(f"{task} needs {kind}; this model is a {model_type}: {instead}")


def model_type_of(folder: Path) -> str | None:
    """The model type config.json names (None: it names none, or there is no such file)."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    named = config.get("model_type") if isinstance(config, dict) else None
    return named if isinstance(named, str) else None
