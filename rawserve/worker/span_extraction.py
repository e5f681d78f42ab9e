"""question-answering by span extraction, on an `AutoModelForQuestionAnswering`
(transformers 5 no longer has the pipeline).

Worker process only (imports torch and transformers). transformers 4's pipeline, step for
step, but batched: every window of every (question, context) pair goes through the model in
one call; each window is then read as the pipeline read it alone, so the answers are the
pipeline's (tests/test_fidelity.py holds them to transformers 4.57's):

- the context is cut into windows of `max_seq_len` tokens overlapping by `doc_stride`;
- in each window, start and end probabilities are a softmax over the context tokens and
  the CLS token; CLS x CLS is the "no answer" score, whose lowest value over the windows is
  offered when `handle_impossible_answer` is set; CLS then leaves the candidates;
- candidate spans are ranked by P(start) x P(end) (at most `max_answer_len` tokens), widened
  to whole words when `align_to_words`, and answers with the same text (in any case) add up
  their scores ("no answer" with the empty span CLS lets through, listed once);
- the `top_k` best are the answer: one dict when only one is left, else a list.

The numpy calls are the pipeline's own choices (argpartition, float32): they decide which
zero-score spans fill a short list, so they are kept as they were.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import transformers

from rawserve.shared.messages import NO_CONTROL, Control
from rawserve.tasks.question_answering import DOC_STRIDE, MAX_SEQ_LEN
from rawserve.tasks.windows import context_rooms
from rawserve.worker.library_panics import LibraryPanic, panics_as_errors
from rawserve.worker.model_classes import load_model
from rawserve.worker.onnx_engine import OnnxNetwork
from rawserve.worker.runner import (
    Runner,
    dtype_name,
    embedding_rows,
    refuse_not_numbers,
    token_positions,
)
from rawserve.worker.window_counts import refuse_dense_windows, token_counter

log = logging.getLogger("rawserve.worker")

DEFAULT_MAX_ANSWER_LEN = 15
WINDOWS_PER_PASS = 64  # windows in one forward pass: a bound on its memory
# windows read for their answers between two looks whether anybody still waits
WINDOWS_READ_BETWEEN_LOOKS = 64
NO_NULL_SCORE = 1_000_000.0  # the pipeline's start value for the lowest "no answer" score
MASKED_LOGIT = -10000.0


@dataclass(frozen=True)
class SpanOptions:
    """A request's options, with the pipeline's defaults filled in."""

    top_k: int
    max_answer_len: int
    max_seq_len: int
    doc_stride: int
    handle_impossible_answer: bool
    align_to_words: bool


class SpanExtractionRunner(Runner):
    """question-answering on an `AutoModelForQuestionAnswering` (start/end logits)."""

    def __init__(self, model: str, device: str, torch_dtype: Any, onnx: OnnxNetwork | None = None):
        tokenizer = transformers.AutoTokenizer.from_pretrained(model)
        untrained = None
        if onnx is None:
            self.model: Any
            self.model, untrained = load_model(
                "AutoModelForQuestionAnswering", model, dtype=torch_dtype
            )
            self.model.to(device).eval()
        else:
            self.model = onnx
        rows = embedding_rows(self.model)
        super().__init__("question-answering", device, dtype_name(self.model), tokenizer, rows)
        self.untrained = untrained
        self.onnx = onnx
        # the longest window the model can read (absolute position embeddings), if it says
        self.position_limit = token_positions(self.model.config)
        # the pipeline's default, kept within what the model can read (a tokenizer that
        # names no length would otherwise ask for windows the model fails on)
        self.default_max_seq_len = min(
            self.tokenizer.model_max_length,
            MAX_SEQ_LEN,
            self.position_limit or MAX_SEQ_LEN,
        )
        self.question_first = self.tokenizer.padding_side == "right"

    @property
    def details(self) -> dict[str, Any]:
        # the longest window it reads (a context of any length is read in windows): the
        # most `max_seq_len` may ask (/info said 0)
        return {"max_input_length": self.position_limit or self.default_max_seq_len}

    def options(self, params: dict[str, Any]) -> SpanOptions:
        max_seq_len = params.get("max_seq_len") or self.default_max_seq_len
        if self.position_limit is not None and max_seq_len > self.position_limit:
            raise ValueError(
                f"max_seq_len {max_seq_len} is over this model's limit of {self.position_limit}"
            )
        doc_stride = params.get("doc_stride")
        if doc_stride is None:
            doc_stride = min(max_seq_len // 2, DOC_STRIDE)
        if doc_stride > max_seq_len:
            raise ValueError(
                f"doc_stride ({doc_stride}) is larger than max_seq_len ({max_seq_len})"
            )
        return SpanOptions(
            top_k=params.get("top_k", params.get("topk", 1)),
            max_answer_len=params.get("max_answer_len", DEFAULT_MAX_ANSWER_LEN),
            max_seq_len=max_seq_len,
            doc_stride=doc_stride,
            handle_impossible_answer=params.get("handle_impossible_answer", False),
            align_to_words=params.get("align_to_words", True),
        )

    def run(
        self, inputs: list[Any], params: dict[str, Any], control: Control = NO_CONTROL
    ) -> list[Any]:
        options = self.options(params)
        self.refuse_dense_windows(inputs, options)
        contexts = [item["context"] for item in inputs]
        encoded = self.windows(inputs, options)
        self.refuse_unread_parts(encoded, len(inputs))
        self.refuse_unreadable(encoded["input_ids"])
        starts, ends = self.logits(encoded)
        if self.batch_cancelled():  # nobody reads the answers: none is read from the windows
            return _unread(inputs)
        # each item's answers by their text in lower case (the same answer in any case
        # adds up): looked for in a list, 900 KB of context took 70 s, most of it here
        answers: list[dict[str, dict[str, Any]]] = [{} for _ in inputs]
        null_scores = [NO_NULL_SCORE] * len(inputs)
        for window, item in enumerate(encoded["overflow_to_sample_mapping"]):
            if window and not window % WINDOWS_READ_BETWEEN_LOOKS and self.batch_cancelled():
                log.info("question answering stopped: nobody waits for it")
                return _unread(inputs)
            encoding = encoded.encodings[window]
            length = len(encoding.ids)
            # the window's own tokens, as if it had been run alone (padding after them)
            real = slice(0, length)
            null_scores[item] = self.read_window(
                encoding,
                starts[window : window + 1, real],
                ends[window : window + 1, real],
                contexts[item],
                options,
                answers[item],
                null_scores[item],
            )
        return [_best(found, null_scores[item], options) for item, found in enumerate(answers)]

    def windows(self, inputs: list[dict[str, str]], options: SpanOptions) -> Any:
        questions = [item["question"] for item in inputs]
        contexts = [item["context"] for item in inputs]
        try:
            with panics_as_errors():
                return self.tokenizer(
                    questions if self.question_first else contexts,
                    contexts if self.question_first else questions,
                    padding=False,
                    truncation="only_second" if self.question_first else "only_first",
                    max_length=options.max_seq_len,
                    stride=options.doc_stride,
                    return_token_type_ids=True,
                    return_overflowing_tokens=True,
                    return_offsets_mapping=True,
                )
        except LibraryPanic:
            self.refuse_stride(questions, options)
            raise
        except Exception as exc:  # the tokenizers library raises plain Exceptions
            if "truncat" in str(exc).lower():
                raise ValueError(
                    f"the question leaves no room for the context in max_seq_len "
                    f"{options.max_seq_len} with doc_stride {options.doc_stride}"
                ) from None
            if "stride" in str(exc).lower():  # transformers' words name its tokenizer's
                raise ValueError(
                    f"doc_stride {options.doc_stride} leaves no new tokens in each window of "
                    f"max_seq_len {options.max_seq_len} (less the special tokens): send a "
                    "smaller doc_stride or a larger max_seq_len"
                ) from None
            raise

    def refuse_dense_windows(self, inputs: list[dict[str, str]], options: SpanOptions) -> None:
        """ValueError (a 422) when the batch's contexts would make windows of more tokens
        than `WINDOW_TOKEN_BUDGET` together: the tokenizer makes every window of the
        batch in one call (a 1 MB context at doc_stride 120: 4.4 GB). A question that
        leaves a window no room past the stride is the tokenizer's to refuse."""
        window, stride = options.max_seq_len, options.doc_stride
        special = self.tokenizer.num_special_tokens_to_add(pair=True)
        rooms = context_rooms(token_counter(self.tokenizer), inputs, window, special, stride)
        refuse_dense_windows(self.tokenizer, rooms, window, ("doc_stride", stride), "context")

    def refuse_stride(self, questions: list[str], options: SpanOptions) -> None:
        """After the tokenizer panicked: raise ValueError when a question leaves its
        context less room in a window than the overlap (`doc_stride`), which the tokenizers
        library panics on where transformers' own check (the length less the special
        tokens, not less the question) lets it through."""
        tokenizer = self.tokenizer
        special = tokenizer.num_special_tokens_to_add(pair=True)
        asked = tokenizer(questions, add_special_tokens=False)["input_ids"]
        room = options.max_seq_len - special - max(len(ids) for ids in asked)
        if 0 < room <= options.doc_stride:
            raise ValueError(
                f"the question leaves {room} tokens of each window (max_seq_len "
                f"{options.max_seq_len}) to the context, and doc_stride {options.doc_stride} "
                f"must be less than that: send a smaller doc_stride or a larger max_seq_len"
            ) from None

    def refuse_unread_parts(self, encoded: Any, inputs: int) -> None:
        """A question or context the tokenizer reads as no token at all (zero-width
        spaces, control characters, a lone combining mark) is refused, as a blank one is:
        without a context the only answer is the empty span at [CLS] (200 with score 0),
        without a question a span the model picks for no question asked."""
        for part, sequence in (("question", 0), ("context", 1)):
            sequence = sequence if self.question_first else 1 - sequence
            read = [False] * inputs
            for window, item in enumerate(encoded["overflow_to_sample_mapping"]):
                read[item] = read[item] or sequence in encoded.encodings[window].sequence_ids
            if not all(read):
                raise ValueError(f"the {part} reads as no tokens (only characters the model skips)")

    def logits(self, encoded: Any) -> tuple[np.ndarray, np.ndarray]:
        """Start and end logits of every window, padded to the longest, in passes of at
        most WINDOWS_PER_PASS windows (a few kilobytes of context with a `doc_stride` just
        under `max_seq_len` make thousands: in one pass, a base-sized model's attention
        over them needs gigabytes). Once nobody waits for the batch (its clients gone,
        its deadlines passed), the windows left are not run: their logits are zeros,
        and the answers nobody reads (a 34 KB context went on for 4 s past its 504,
        the next request waiting behind it)."""
        names = self.tokenizer.model_input_names
        features = {name: encoded[name] for name in names if name in encoded}
        windows = len(encoded["input_ids"])
        longest = max(len(ids) for ids in encoded["input_ids"])
        starts, ends = [], []
        for first in range(0, windows, WINDOWS_PER_PASS):
            if first and self.batch_cancelled():
                log.info("question answering stopped: nobody waits for it")
                skipped = np.zeros((windows - first, longest), dtype=np.float32)
                starts.append(skipped)
                ends.append(skipped)
                break
            batch = self.tokenizer.pad(
                {
                    name: values[first : first + WINDOWS_PER_PASS]
                    for name, values in features.items()
                },
                padding="max_length",
                max_length=longest,
                # after each window, whichever side the tokenizer pads: a window padded
                # before its tokens is read at other positions than alone by a model of
                # absolute positions (a BERT whose tokenizer pads on the left answered
                # otherwise in a batch)
                padding_side="right",
                return_tensors="pt",
            )
            with torch.inference_mode():
                out = self.model(**{name: t.to(self.device) for name, t in batch.items()})
            for scores in (out.start_logits, out.end_logits):  # one score a token
                refuse_not_numbers(scores.unsqueeze(-1), "scores", batch.get("attention_mask"))
            starts.append(out.start_logits.float().cpu().numpy())
            ends.append(out.end_logits.float().cpu().numpy())
        return np.concatenate(starts), np.concatenate(ends)

    def read_window(
        self,
        encoding: Any,
        start_logits: np.ndarray,
        end_logits: np.ndarray,
        context: str,
        options: SpanOptions,
        answers: dict[str, dict[str, Any]],
        null_score: float,
    ) -> float:
        """Add this window's candidates to `answers` (by their text in lower case); the
        lowest "no answer" score so far."""
        # 1 where a token may be part of the answer: the context, and CLS (left in the
        # softmax). A tokenizer that reads the context first marks every token, as the
        # pipeline did.
        wanted = np.array(
            [[int(s == 1) if self.question_first else 1 for s in encoding.sequence_ids]]
        )
        if self.tokenizer.cls_token_id is not None:
            wanted[0, np.array(encoding.ids) == self.tokenizer.cls_token_id] = 1
        unwanted = wanted == 0
        start = _softmax(np.where(unwanted, MASKED_LOGIT, start_logits))
        end = _softmax(np.where(unwanted, MASKED_LOGIT, end_logits))
        if options.handle_impossible_answer:
            null_score = min(null_score, (start[0, 0] * end[0, 0]).item())
        start[0, 0] = end[0, 0] = 0.0
        # more candidates than asked when widening to words: some become the same answer
        wanted_count = options.top_k * 2 + 10 if options.align_to_words else options.top_k
        spans = _best_spans(start, end, wanted_count, options.max_answer_len, wanted)
        for first, last, score in spans:
            char_start, char_end = self.characters(encoding, first, last, options.align_to_words)
            text = context[char_start:char_end]
            same = answers.get(key := text.lower())
            if same is not None:
                same["score"] += score
            else:
                answers[key] = {
                    "score": score,
                    "start": char_start,
                    "end": char_end,
                    "answer": text,
                }
        return null_score

    def characters(
        self, encoding: Any, first: int, last: int, whole_words: bool
    ) -> tuple[int, int]:
        """The context's characters from token `first` to token `last`."""
        if whole_words:
            sequence = 1 if self.question_first else 0
            try:
                start_word = encoding.word_to_chars(encoding.token_to_word(first), sequence)
                end_word = encoding.word_to_chars(encoding.token_to_word(last), sequence)
                return start_word[0], end_word[1]
            except TypeError:  # a special token (CLS) belongs to no word: keep its offsets
                pass
        return encoding.offsets[first][0], encoding.offsets[last][1]


def _unread(inputs: list[Any]) -> list[Any]:
    """The answers of a batch nobody waits for any more (nobody reads them)."""
    return [{"score": 0.0, "start": 0, "end": 0, "answer": ""} for _ in inputs]


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum()


def _best_spans(
    start: np.ndarray, end: np.ndarray, count: int, max_answer_len: int, wanted: np.ndarray
) -> list[tuple[int, int, float]]:
    """The `count` best (first token, last token, score) spans of one window, best first."""
    outer = np.matmul(np.expand_dims(start, -1), np.expand_dims(end, 1))
    scores = np.tril(np.triu(outer), max_answer_len - 1)
    flat = scores.flatten()
    if count == 1:
        order = np.array([np.argmax(flat)])
    elif len(flat) < count:
        order = np.argsort(-flat)
    else:
        chosen = np.argpartition(-flat, count)[0:count]
        order = chosen[np.argsort(-flat[chosen])]
    firsts, lasts = np.unravel_index(order, scores.shape)[1:]
    # The pipeline tests membership in `wanted.nonzero()`, which holds the row indices
    # (all 0) beside the columns: token 0 always passes. Kept, as its answers show it.
    allowed = wanted.nonzero()
    keep = np.isin(firsts, allowed) & np.isin(lasts, allowed)
    return [
        (int(first), int(last), scores[0, first, last].item())
        for first, last in zip(firsts[keep], lasts[keep], strict=True)
    ]


def _best(found: dict[str, dict[str, Any]], null_score: float, options: SpanOptions) -> Any:
    """The `top_k` best of one item's answers, "no answer" among them when it is offered:
    an empty span (the CLS token's, which the pipeline lets through at score 0) is the same
    text, so it adds up with it as every answer does, not listed beside it a second time."""
    if options.handle_impossible_answer:
        empty = found.pop("", {"score": 0.0})
        found[""] = {"score": empty["score"] + null_score, "start": 0, "end": 0, "answer": ""}
    ranked = sorted(found.values(), key=lambda answer: answer["score"], reverse=True)
    best = ranked[: options.top_k]
    return best[0] if len(best) == 1 else best
