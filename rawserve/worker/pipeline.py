"""Any task through `transformers.pipeline`, and plain text classification without it.

Worker process only (imports torch and transformers).
"""

from __future__ import annotations

import base64
import io
import logging
from typing import Any

import numpy as np
import torch
import transformers

from rawserve.tasks import split_outputs
from rawserve.worker.onnx_engine import OnnxNetwork
from rawserve.worker.runner import Runner, dtype_name, resolve_dtype


class PipelineRunner(Runner):
    """Any task through `transformers.pipeline`."""

    def __init__(
        self, model: str, task: str, device: str, dtype: str, onnx: OnnxNetwork | None = None
    ):
        if onnx is None:
            self.pipe = transformers.pipeline(
                task, model=model, device=device, dtype=resolve_dtype(dtype)
            )
        else:  # the pipeline's own steps around ONNX Runtime's forward pass
            tokenizer = transformers.AutoTokenizer.from_pretrained(model)
            # The pipeline checks the model's class name against transformers' own classes
            # and logs an error for any other; the check is all it does with the name.
            check = logging.getLogger("transformers.pipelines.base")
            level = check.level
            check.setLevel(logging.CRITICAL)
            try:
                self.pipe = transformers.pipeline(task, model=onnx, tokenizer=tokenizer)
            finally:
                check.setLevel(level)
        super().__init__(task, device, dtype_name(self.pipe.model), self.pipe.tokenizer)
        self.onnx = onnx

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
    from PIL import Image, UnidentifiedImageError  # the optional `image` extra

    try:
        image = Image.open(io.BytesIO(base64.b64decode(encoded)))
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ValueError("the input is not an image Pillow can read") from exc
