"""question-answering by span extraction, on an `AutoModelForQuestionAnswering`
(transformers 5 no longer has the pipeline).

Worker process only (imports torch and transformers). The removed pipeline's method, batched:
tokenize each (question, context) pair into one or more windows of the context
(`doc_stride` overlap), score every span that lies in the context and is at most
`max_answer_len` tokens long by P(start) x P(end), and map the best spans back to
characters of the context. Answers `{score, start, end, answer}` (a list when top_k > 1).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import transformers

from rawserve.worker.onnx_engine import OnnxNetwork
from rawserve.worker.runner import Runner, dtype_name

DEFAULT_MAX_SEQ_LEN = 384
DEFAULT_DOC_STRIDE = 128
DEFAULT_MAX_ANSWER_LEN = 15


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max())
    return shifted / shifted.sum()


class SpanExtractionRunner(Runner):
    """question-answering on an `AutoModelForQuestionAnswering` (start/end logits)."""

    def __init__(self, model: str, device: str, torch_dtype: Any, onnx: OnnxNetwork | None = None):
        tokenizer = transformers.AutoTokenizer.from_pretrained(model)
        if onnx is None:
            self.model: Any = transformers.AutoModelForQuestionAnswering.from_pretrained(
                model, dtype=torch_dtype
            )
            self.model.to(device).eval()
        else:
            self.model = onnx
        super().__init__("question-answering", device, dtype_name(self.model), tokenizer)
        self.onnx = onnx
        self.max_seq_len = min(DEFAULT_MAX_SEQ_LEN, self.tokenizer.model_max_length)

    def run(self, inputs: list[Any], params: dict[str, Any]) -> list[Any]:
        max_seq_len = min(params.get("max_seq_len", self.max_seq_len), self.max_seq_len)
        question_first = self.tokenizer.padding_side == "right"
        questions = [item["question"] for item in inputs]
        contexts = [item["context"] for item in inputs]
        encoded = self.tokenizer(
            questions if question_first else contexts,
            contexts if question_first else questions,
            padding=True,
            truncation="only_second" if question_first else "only_first",
            max_length=max_seq_len,
            stride=min(DEFAULT_DOC_STRIDE, max_seq_len // 2),
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
            return_tensors="pt",
        )
        windows_of = encoded.pop("overflow_to_sample_mapping").tolist()
        offsets = encoded.pop("offset_mapping").numpy()
        context_side = 1 if question_first else 0
        in_context = np.array(
            [[s == context_side for s in encoded.sequence_ids(w)] for w in range(len(windows_of))]
        )
        model_inputs = {k: v.to(self.device) for k, v in encoded.items()}
        with torch.inference_mode():
            out = self.model(**model_inputs)
        starts = out.start_logits.float().cpu().numpy()
        ends = out.end_logits.float().cpu().numpy()
        top_k = params.get("top_k", 1)
        max_answer_len = params.get("max_answer_len", DEFAULT_MAX_ANSWER_LEN)
        impossible = params.get("handle_impossible_answer", False)
        candidates: list[list[dict[str, Any]]] = [[] for _ in inputs]
        null_scores = [0.0] * len(inputs)
        for window, item in enumerate(windows_of):
            mask = in_context[window]
            start_p = _softmax(np.where(mask, starts[window], -10000.0))
            end_p = _softmax(np.where(mask, ends[window], -10000.0))
            null_scores[item] = max(null_scores[item], float(start_p[0] * end_p[0]))
            scores = np.triu(np.outer(start_p, end_p))
            scores = np.tril(scores, max_answer_len - 1)
            scores[~mask, :] = 0.0
            scores[:, ~mask] = 0.0
            best = np.argsort(-scores, axis=None)[: top_k * 4]
            for start, end in zip(*np.unravel_index(best, scores.shape), strict=True):
                if scores[start, end] <= 0.0:
                    continue
                char_start = int(offsets[window][start][0])
                char_end = int(offsets[window][end][1])
                candidates[item].append(
                    {
                        "score": float(scores[start, end]),
                        "start": char_start,
                        "end": char_end,
                        "answer": contexts[item][char_start:char_end],
                    }
                )
        outputs: list[Any] = []
        for item, found in enumerate(candidates):
            if impossible:
                found.append({"score": null_scores[item], "start": 0, "end": 0, "answer": ""})
            best_answers = _best_distinct(found, top_k)
            outputs.append(best_answers[0] if top_k == 1 and best_answers else best_answers)
        return outputs


def _best_distinct(candidates: list[dict[str, Any]], top_k: int) -> list[dict[str, Any]]:
    """The top_k answers by score, one per character span (windows overlap)."""
    seen: set[tuple[int, int]] = set()
    best = []
    for candidate in sorted(candidates, key=lambda c: -c["score"]):
        span = (candidate["start"], candidate["end"])
        if span not in seen:
            seen.add(span)
            best.append(candidate)
        if len(best) == top_k:
            break
    return best
