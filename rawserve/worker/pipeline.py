"""Any task through `transformers.pipeline`, and plain text classification without it.

Worker process only (imports torch and transformers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import transformers

from rawserve.shared.messages import NO_CONTROL, Control, FailureKind, ItemFailure, ModelLimits
from rawserve.tasks import LOGITS_PARAM, TRUNCATE_TO, split_outputs
from rawserve.worker.cuda_graphs import GraphedForward, recording
from rawserve.worker.images import blank_image, decode_image
from rawserve.worker.long_texts import cut_limit, encode_cut, narrowed, refuse_no_room
from rawserve.worker.model_classes import TASK_CLASSES, load_model
from rawserve.worker.onnx_engine import OnnxNetwork
from rawserve.worker.pairs import cut_pair, cut_text
from rawserve.worker.runner import (
    PAD_SIDE,
    Runner,
    client_message,
    dtype_name,
    embedding_rows,
    refuse_not_numbers,
    resolve_dtype,
)
from rawserve.worker.window_counts import refuse_dense_windows

# the pieces one forward pass of a pipeline that cuts its inputs in pieces reads at most:
# a zero-shot classifier's (text, label) pairs, token classification's windows of a text
# (`stride`). A bound on the padded batch's memory (a request may bring 32 texts and 100
# labels, or a text of thousands of windows).
PIECES_PER_PASS = 64
# the tasks whose pipelines run a request in many forward passes (a zero-shot text once per
# label, a strided text once per window): skipped once nobody waits for the batch
PIECED_TASKS = ("token-classification", "zero-shot-classification")
# the words a task's parameters give that the model reads as tokens: what one is called,
# and the parameter
WORDS_READ = {
    "fill-mask": ("target", "targets"),
    "zero-shot-classification": ("label", "candidate_labels"),
}


def preprocessing(task: str, model: str) -> dict[str, Any]:
    """What the pipeline of `task` reads its inputs with, loaded from the model's folder
    as the pipeline would load it when given the folder rather than the model."""
    if task == "image-classification":
        return {"image_processor": transformers.AutoImageProcessor.from_pretrained(model)}
    return {"tokenizer": transformers.AutoTokenizer.from_pretrained(model)}


class PipelineRunner(Runner):
    """Any task through `transformers.pipeline`."""

    def __init__(
        self, model: str, task: str, device: str, dtype: str, onnx: OnnxNetwork | None = None
    ):
        untrained = None
        if onnx is None and task in TASK_CLASSES:
            # the model loaded here, not by the pipeline: so as to learn what its
            # checkpoint left untrained (the class is the pipeline's own for the task)
            loaded, untrained = load_model(TASK_CLASSES[task], model, dtype=resolve_dtype(dtype))
            self.pipe = transformers.pipeline(
                task, model=loaded, device=device, **preprocessing(task, model)
            )
        elif onnx is None:
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
        tokenizer = self.pipe.tokenizer
        rows = embedding_rows(self.pipe.model) if tokenizer is not None else None
        super().__init__(task, device, dtype_name(self.pipe.model), tokenizer, rows)
        self.onnx = onnx
        self.untrained = untrained
        # A tokenizer without a pad token cannot pad inputs into one batch (nor may a
        # decoder's classifier without one read a batch): the pipeline answers such a
        # model an input at a time, and so does `run`. The pad token it is given here is
        # never placed (one input needs none); it lets the pipeline's steps run as they are.
        self.batches = self.tokenizer is None or self.tokenizer.pad_token is not None
        if self.tokenizer is not None:
            self.tokenizer.padding_side = PAD_SIDE
        if not self.batches:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        config = self.pipe.model.config
        self.max_length = self.max_input_length(config) if self.tokenizer is not None else None
        if self.max_length is not None:
            # A tokenizer saved without a limit declares ~1e30: the pipelines' own truncation
            # (token-classification's, zero-shot's) would cut nothing. Bound it by the
            # model's positions, and refuse what still runs past them (the pipelines that
            # do not truncate: text-classification, fill-mask) before the model fails on it.
            self.tokenizer.model_max_length = self.max_length
            self.pipe.model.register_forward_pre_hook(
                refuse_past(self.max_length), with_kwargs=True
            )
        if self.makes_unreadable_ids:  # every pipeline's ids, however it tokenized them
            self.pipe.model.register_forward_pre_hook(self.refuse_unreadable_ids, with_kwargs=True)
        # every pipeline's scores pass here, however it called the model
        self.pipe.model.register_forward_hook(refuse_broken_scores, with_kwargs=True)
        if task in PIECED_TASKS:
            self.pipe.model.forward = self.unless_abandoned(self.pipe.model.forward)
        if task == "token-classification":
            self.pipe.preprocess = self.windows_unless_abandoned(self.pipe.preprocess)
            self.pipe.postprocess = self.no_entities_if_abandoned(self.pipe.postprocess)
        if task == "fill-mask":
            self.pipe.postprocess = scored_in_float32(self.pipe.postprocess)

    @property
    def limits(self) -> ModelLimits:
        """No input costs more than `max_length` tokens: these pipelines cut a longer one
        or refuse it (the scheduler's estimate by characters would otherwise take a long
        word, one token to the model, for thousands and hold it queued past its deadline)."""
        return ModelLimits(max_input_tokens=self.max_length)

    @property
    def details(self) -> dict[str, Any]:
        found: dict[str, Any] = {}
        if self.max_length is not None:
            found["max_input_length"] = self.max_length
        if self.task == "text-classification":
            labels = self.pipe.model.config.id2label
            found["id2label"] = {str(i): labels[i] for i in sorted(labels)}
        if self.task == "fill-mask":  # (the server counts the masks an answer fills)
            found["mask_token"] = getattr(self.tokenizer, "mask_token", None)
        return found

    def use_cuda_graphs(self) -> str:
        if self.onnx is not None or self.task != "text-classification" or not self.max_length:
            return "off: replayed for text classification and embeddings on torch only"
        model = self.pipe.model
        self.graphed = GraphedForward(
            lambda inputs: model(**inputs).logits, self.device, False, self.max_length
        )
        return "on: text classification's scores and logits, a graph per padded batch shape"

    def run(
        self, inputs: list[Any], params: dict[str, Any], control: Control = NO_CONTROL
    ) -> list[Any]:
        if not self.batches and len(inputs) > 1:
            return [answer for item in inputs for answer in self.run([item], params, control)]
        if params.get(LOGITS_PARAM):
            return self._logits(inputs, params)
        if self._plain_classification(inputs, params):
            return self._classify(inputs)
        model_inputs: Any = inputs
        if self.task == "image-classification":  # queued as base64 text
            model_inputs = self.images(inputs)
        self.refuse_words_read_as_nothing(params)
        if self.task == "fill-mask" and "targets" in params and self.makes_unreadable_ids:
            # each target is a token scored: one past the table failed the pipeline's
            # postprocess (an IndexError, a 500)
            target_ids = self.pipe.get_target_ids(params["targets"])
            self.refuse_unreadable([[int(i) for i in target_ids]], holder="`targets` names")
        if self.task == "fill-mask" and "top_k" in params:  # all of a small vocabulary, at most
            vocabulary = self.pipe.model.config.vocab_size
            params = {**params, "top_k": min(params["top_k"], vocabulary)}
        batch_size = len(inputs)
        if self.task == "zero-shot-classification":
            # the pipeline scores each (text, label) pair, `batch_size` pairs a forward pass:
            # a request's pairs together, not one pass a label (ten times slower)
            pairs = len(inputs) * len(params.get("candidate_labels", ()))
            batch_size = max(batch_size, min(pairs, PIECES_PER_PASS))
            if self.max_length is not None:  # (cut with each label: `pairs`)
                model_inputs = [
                    cut_text(self.tokenizer, text, self.max_length)
                    if isinstance(text, str)
                    else text
                    for text in inputs
                ]
        if "stride" in params:  # windows of long texts together, not one pass a window
            self.refuse_stride(params)
            self.refuse_dense_windows(inputs, params["stride"])
            batch_size = max(batch_size, PIECES_PER_PASS)
        with torch.inference_mode():
            raw = self.pipe(model_inputs, batch_size=batch_size, **params)
            if isinstance(raw, Iterator):  # a generator's answers: computed as they are read
                raw = list(raw)
        return split_outputs(self.task, inputs, raw)

    def refuse_words_read_as_nothing(self, params: dict[str, Any]) -> None:
        """ValueError for a fill-mask target or zero-shot label that the tokenizer reads as
        no token at all (combining marks a BERT tokenizer strips, private-use characters):
        transformers dropped such a target beside others unsaid, and scored such a label
        ("This example is .") as one."""
        name, words = WORDS_READ.get(self.task, ("", None))
        words = params.get(words) if words else None
        if self.tokenizer is None or not words:
            return
        for index, word in enumerate([words] if isinstance(words, str) else words):
            if not self.tokenizer(word, add_special_tokens=False)["input_ids"]:
                raise ValueError(
                    f"the {name} at index {index} ({word!r}) is no text to this model: its "
                    "tokenizer reads no token in it"
                )

    def images(self, inputs: list[str]) -> Iterator[Any]:
        """The images of a batch, decoded as the pipeline preprocesses each (it reads a
        generator): a batch holds one full-size image at a time, not all of them at once.
        Once nobody waits for the batch (its clients gone, its deadlines passed), the rest
        are not decoded: a blank pixel each, whose answers nobody reads (31 images of
        several seconds each held a worker until `--batch-timeout` killed it)."""
        size = getattr(getattr(self.pipe, "image_processor", None), "size", None) or {}
        squashed = "height" in size and "width" in size  # resized to one shape, as ViT's
        for item in inputs:
            if self.batch_cancelled():
                yield blank_image()
            else:
                yield decode_image(item, squashed)

    def unless_abandoned(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """The model's forward pass, skipped once nobody waits for the batch (its clients
        gone, its deadlines passed): zero scores, whose answers nobody reads. A text of
        hundreds of windows (a dense `stride`) or a hundred labels ran on past its 504
        until `--batch-timeout` killed the worker."""
        labels = self.pipe.model.config.num_labels
        per_token = self.task == "token-classification"  # else a score per (text, label)
        outputs = transformers.modeling_outputs
        output = outputs.TokenClassifierOutput if per_token else outputs.SequenceClassifierOutput

        def forward_unless_abandoned(*args: Any, **kwargs: Any) -> Any:
            if not self.batch_cancelled():
                return forward(*args, **kwargs)
            ids = kwargs["input_ids"]
            shape = (*ids.shape, labels) if per_token else (ids.shape[0], labels)
            return output(logits=torch.zeros(shape, device=ids.device))

        return forward_unless_abandoned

    def windows_unless_abandoned(self, preprocess: Callable[..., Any]) -> Callable[..., Any]:
        """token-classification's windows of a text, the last one sent once nobody waits
        for the batch (each is made ready for the model, in Python, however its pass is
        then skipped)."""

        def windows(*args: Any, **kwargs: Any) -> Iterator[dict[str, Any]]:
            for window in preprocess(*args, **kwargs):
                if self.batch_cancelled() and not window["is_last"]:
                    yield {**window, "is_last": True}  # (the pipeline's end of a text)
                    return
                yield window

        return windows

    def no_entities_if_abandoned(self, postprocess: Callable[..., Any]) -> Callable[..., Any]:
        """token-classification's reading of a text's windows into entities, skipped once
        nobody waits for the batch: its forward passes skipped, a dense stride's thousands
        of windows of zero scores were still read token by token in Python (a 100 KB text
        at stride 125: 41 s past its 504, every other request refused 503 meanwhile)."""

        def postprocess_unless_abandoned(*args: Any, **kwargs: Any) -> Any:
            return [] if self.batch_cancelled() else postprocess(*args, **kwargs)

        return postprocess_unless_abandoned

    def refuse_stride(self, params: dict[str, Any]) -> None:
        """token-classification's `stride`, refused (ValueError, a 422) where the pipeline
        would answer entities twice (no aggregation merges the overlaps: it does not
        refuse that unless "none" is named), would fail in words of its own, or would
        leave the tokenizers library to panic (a window with no new tokens)."""
        if params.get("aggregation_strategy", "none") == "none":
            raise ValueError(
                "stride needs an aggregation_strategy (simple, first, average or max), "
                "which merges the entities of the windows' overlaps"
            )
        tokenizer = self.tokenizer
        if tokenizer is None or not tokenizer.is_fast:
            raise ValueError("stride needs a fast tokenizer (tokenizer.json); this model has none")
        window = tokenizer.model_max_length
        room = window - tokenizer.num_special_tokens_to_add()
        if params["stride"] >= room:
            raise ValueError(
                f"stride {params['stride']} leaves no new tokens in each window of {window} "
                f"tokens ({room} of them the text's): send a smaller stride"
            )

    def refuse_unreadable_ids(
        self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """A forward pre-hook: `refuse_unreadable` on a pass's input ids. A pass recorded
        into a CUDA graph is not read (CUDA refuses a read back while it records): its
        replays' ids are (`_forward_logits`)."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and not recording():
            self.refuse_unreadable(ids)

    def refuse_dense_windows(self, texts: list[str], stride: int) -> None:
        """ValueError (a 422) when the batch's texts would make windows of more tokens
        than `WINDOW_TOKEN_BUDGET` together: the pipeline's tokenizer makes all of a
        text's windows in one call, before anything can stop it. (A batch of several
        requests over it together is split by the bisection: each is counted alone.)"""
        window = self.tokenizer.model_max_length
        room = window - self.tokenizer.num_special_tokens_to_add()
        refuse_dense_windows(
            self.tokenizer, [(text, room) for text in texts], window, ("stride", stride)
        )

    def describe_failure(self, exc: BaseException) -> ItemFailure:
        # The pipeline's refusal of an input is the client's to fix. Asked here, not of
        # every runner: reading transformers.pipelines imports it (seconds, on the model's
        # thread) where nothing had, at the first input that failed.
        if isinstance(exc, transformers.pipelines.PipelineException):
            return ItemFailure(FailureKind.INPUT, client_message(exc))
        return super().describe_failure(exc)

    @property
    def prepares_ahead(self) -> bool:
        return self.task == "text-classification" and self.tokenizer is not None and self.batches

    def prepare(
        self, inputs: list[Any], params: dict[str, Any], control: Control = NO_CONTROL
    ) -> Any:
        if params.get(LOGITS_PARAM) or not self._plain_classification(inputs, params):
            return None
        return self.staged(self.ahead_tokenizer()(inputs, padding=True, return_tensors="pt"))

    def run_prepared(
        self, inputs: list[Any], params: dict[str, Any], control: Control, prepared: Any
    ) -> list[Any]:
        if prepared is None:
            return self.run(inputs, params, control)
        return self._classify_encoded(self.on_device(prepared))

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
        encoded = self.pipe.tokenizer(inputs, padding=True, return_tensors="pt")
        return self._classify_encoded(encoded.to(self.pipe.device))

    def _classify_encoded(self, encoded: Any) -> list[dict[str, Any]]:
        pipe = self.pipe
        with torch.inference_mode():
            logits = self._forward_logits(encoded).float().cpu().numpy()
        exp = np.exp(logits - logits.max(axis=-1, keepdims=True))
        scores = exp / exp.sum(axis=-1, keepdims=True)
        labels = pipe.model.config.id2label
        return [{"label": labels[int(row.argmax())], "score": float(row.max())} for row in scores]

    def _logits(self, inputs: list[Any], params: dict[str, Any]) -> list[Any]:
        """Each text's (or text pair's) logits, a float32 row, and its count of tokens as
        the model read them (`{"logits", "tokens"}`), for TEI's /predict and /rerank and
        vLLM's /classify and /score (the server turns them into scores and labels, and
        the counts into `usage`)."""
        tokenizer = self.pipe.tokenizer
        truncate = params.get("truncate", False)
        tokenizer.truncation_side = params.get("truncation_direction", "right")
        limit = cut_limit(params, self.max_length)
        options: dict[str, Any] = {"truncation": truncate, "max_length": limit}
        if not truncate:
            options = {}
        firsts = [item if isinstance(item, str) else item["text"] for item in inputs]
        seconds = [None if isinstance(item, str) else item.get("text_pair") for item in inputs]
        if truncate and TRUNCATE_TO in params:
            refuse_no_room(tokenizer, params[TRUNCATE_TO], seconds)
        if truncate and limit is not None:  # (without, a long pair is refused)
            for index, (first, second) in enumerate(zip(firsts, seconds, strict=True)):
                if second is not None:
                    firsts[index], seconds[index] = cut_pair(tokenizer, first, second, limit)
        cut = firsts
        if truncate and limit is not None:  # a long single text cut first
            cut = [
                narrowed(tokenizer, first, limit) if second is None else first
                for first, second in zip(firsts, seconds, strict=True)
            ]

        def encode(texts: list[str]) -> Any:
            if all(second is None for second in seconds):
                return tokenizer(texts, padding=True, return_tensors="pt", **options)
            if all(second is not None for second in seconds):
                return tokenizer(texts, seconds, padding=True, return_tensors="pt", **options)
            # singles and pairs: each alone, then padded together
            alone = [tokenizer(a, b, **options) for a, b in zip(texts, seconds, strict=True)]
            return tokenizer.pad(alone, return_tensors="pt")

        encoded = encode_cut(encode, firsts, cut, limit or 0)
        length = encoded["input_ids"].shape[1]
        if self.max_length is not None and length > self.max_length:
            raise ValueError(
                f"the input is {length} tokens and the model takes at most {self.max_length}: "
                "send truncate: true to cut it"
            )
        mask = encoded.get("attention_mask")
        counts = mask.sum(dim=1).tolist() if mask is not None else [length] * len(inputs)
        encoded = encoded.to(self.pipe.device)
        with torch.inference_mode():
            logits = self._forward_logits(encoded)
        rows = list(logits.float().cpu().numpy())
        return [{"logits": row, "tokens": int(n)} for row, n in zip(rows, counts, strict=True)]

    def _forward_logits(self, encoded: Any) -> Any:
        """The model's logits for tensors on its device: replayed where a graph fits."""
        if self.graphed is not None:  # a replay runs no hook: checked here
            self.refuse_unreadable(encoded["input_ids"])
            logits = self.graphed(encoded)
            refuse_not_numbers(logits, "scores")
            return logits
        return self.pipe.model(**encoded).logits


def refuse_broken_scores(
    module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> None:
    """A forward hook that raises `NotNumbers` where the model's scores (an input's
    logits, or each token's) hold NaN or infinity at a real token. (Question answering's
    start and end scores are checked by its own runner, `span_extraction`.) A pass
    recorded into a CUDA graph is not read: its replays' scores are (`_forward_logits`)."""
    logits = output.get("logits") if isinstance(output, dict) else None  # a ModelOutput
    if isinstance(logits, torch.Tensor) and not recording():
        refuse_not_numbers(logits, "scores", kwargs.get("attention_mask"))


def scored_in_float32(postprocess: Callable[..., Any]) -> Callable[..., Any]:
    """fill-mask's postprocess on its logits in float32. The pipeline takes its softmax,
    and ranks the tokens by it, in the model's precision, where every other task's scores
    are computed in float32: in float16 or bfloat16 each score is rounded to 3 or 2
    digits, and tokens whose logits differ share a score and are listed in any order."""

    def in_float32(model_outputs: Any, **params: Any) -> Any:
        return postprocess({**model_outputs, "logits": model_outputs["logits"].float()}, **params)

    return in_float32


def refuse_past(limit: int) -> Callable[[Any, tuple[Any, ...], dict[str, Any]], None]:
    """A forward pre-hook that refuses input ids longer than `limit` with the ValueError a
    client is answered (422, naming the limit): the one place that sees the tokens of
    every pipeline, however it tokenized them."""

    def check(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[-1] > limit:
            raise ValueError(
                f"the input is {ids.shape[-1]} tokens and this model reads at most {limit}"
            )

    return check
