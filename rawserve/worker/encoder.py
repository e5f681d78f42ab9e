"""feature-extraction on an encoder (`AutoModel`): pooled sentence vectors or token vectors.

Worker process only (imports torch and transformers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers

from rawserve.models.sentence_folder import (
    SpladePooling,
    sentence_modules,
    sentence_transformers_default_prompt,
    sentence_transformers_prompts,
    sentence_transformers_reading,
)
from rawserve.shared.messages import NO_CONTROL, Control, ModelLimits
from rawserve.tasks import TRUNCATE_TO
from rawserve.worker.cuda_graphs import GraphedForward
from rawserve.worker.dense_layers import load_dense_layers
from rawserve.worker.long_texts import cut_limit, encode_cut, narrowed_texts, refuse_no_room
from rawserve.worker.model_classes import load_model
from rawserve.worker.onnx_engine import OnnxNetwork
from rawserve.worker.runner import (
    PAD_SIDE,
    Runner,
    dtype_name,
    embedding_rows,
    refuse_not_numbers,
    resolve_dtype,
)
from rawserve.worker.splade import sparse_rows, splade_vectors


class EncoderRunner(Runner):
    """feature-extraction: pooled sentence embeddings or token-level vectors.

    A sentence-transformers model is pooled, run through its Dense layers and normalized
    as its files say; other models answer token vectors, as the feature-extraction
    pipeline does.
    """

    def __init__(
        self,
        model: str,
        device: str,
        dtype: str,
        pooling: str = "none",
        normalize: bool = False,
        onnx: OnnxNetwork | None = None,
    ):
        """`pooling` and `normalize` are the defaults the server read from the folder's
        sentence-transformers files (rawserve.models.folder); `onnx`, when given, runs the
        forward pass instead of torch."""
        tokenizer = transformers.AutoTokenizer.from_pretrained(model, padding_side=PAD_SIDE)
        if tokenizer.pad_token is None:  # a GPT-2's: a batch still needs one to pad with
            # (its pads are masked out, so any token does: each input answers as alone)
            tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
        untrained = None
        modules = sentence_modules(Path(model))
        # a sparse encoder's (or a masked LM's --pooling splade): its logits pooled
        self.splade = modules.splade or (SpladePooling() if pooling == "splade" else None)
        if onnx is None:
            self.model: Any
            kind = "AutoModelForMaskedLM" if self.splade else "AutoModel"
            self.model, untrained = load_model(kind, model, dtype=resolve_dtype(dtype))
            self.model.to(device).eval()
        elif self.splade:
            raise ValueError("a SPLADE model's pooling runs on torch, not ONNX Runtime")
        else:
            self.model = onnx
        rows = embedding_rows(self.model)
        super().__init__("feature-extraction", device, dtype_name(self.model), tokenizer, rows)
        self.untrained = untrained
        self.onnx = onnx
        self.default_pooling, self.default_normalize = pooling, normalize
        self.prompts = sentence_transformers_prompts(Path(model))
        self.default_prompt = sentence_transformers_default_prompt(Path(model))
        # sentence-transformers cuts a text at max_seq_length and may lowercase it first
        max_seq_length, self.lowercase = sentence_transformers_reading(Path(model))
        self.max_length = self.max_input_length(self.model.config)
        self.vocabulary = int(self.model.config.vocab_size)  # the token ids an input may name
        if max_seq_length:
            self.max_length = min(self.max_length, max_seq_length)
        # a token vector's size, and a sentence vector's (a Dense layer may change it; a
        # SPLADE model's weighs each word of its vocabulary, and has no token vectors)
        self.width = 0 if self.splade else int(self.model.config.hidden_size)
        dense = modules.dense
        self.dense = load_dense_layers(Path(model), dense, self.width, device)
        self.dimensions = dense[-1].out_features if dense else self.width or self.vocabulary

    @property
    def limits(self) -> ModelLimits:
        return ModelLimits(max_input_tokens=self.max_length)  # truncated unless asked not to

    def tokenizer_json(self) -> str | None:
        """The tokenizer the server counts and lists tokens with, lowercasing first where
        sentence-transformers' `do_lower_case` has the worker do so (/tokenize listed a
        cased text's own ids, which were not those the model read)."""
        written = super().tokenizer_json()
        if written is None or not self.lowercase:
            return written
        tokenizer = json.loads(written)
        normalizers = [{"type": "Lowercase"}]
        if tokenizer.get("normalizer") is not None:
            normalizers.append(tokenizer["normalizer"])
        tokenizer["normalizer"] = {"type": "Sequence", "normalizers": normalizers}
        return json.dumps(tokenizer)

    @property
    def details(self) -> dict[str, Any]:
        return {
            "pooling": self.default_pooling,
            "normalize": self.default_normalize,
            "dimensions": self.dimensions,  # of a sentence vector
            "token_dimensions": self.width,
            "max_input_length": self.max_length,
            "vocabulary": self.vocabulary,
            "prompts": self.prompts,
            "default_prompt_name": self.default_prompt,
        }

    def use_cuda_graphs(self) -> str:
        if self.onnx is not None:
            return "off: ONNX Runtime runs the forward pass"
        if self.splade:
            return "off: a SPLADE model's logits are pooled a group of rows at a time"
        model = self.model
        self.graphed = GraphedForward(
            lambda inputs: model(**inputs).last_hidden_state, self.device, True, self.max_length
        )
        return "on: a graph per padded batch shape"

    def run(
        self, inputs: list[Any], params: dict[str, Any], control: Control = NO_CONTROL
    ) -> list[Any]:
        return self.run_prepared(
            inputs, params, control, self._encode(self.tokenizer, inputs, params)
        )

    @property
    def prepares_ahead(self) -> bool:
        return True

    def prepare(
        self, inputs: list[Any], params: dict[str, Any], control: Control = NO_CONTROL
    ) -> Any:
        return self.staged(self._encode(self.ahead_tokenizer(), inputs, params))

    def _encode(self, tokenizer: Any, inputs: list[Any], params: dict[str, Any]) -> Any:
        """The batch's tensors, on the CPU (`tokenizer`: the model thread's or the
        preparing thread's own)."""
        tokenizer.truncation_side = params.get("truncation_direction", "right")
        truncate = params.get("truncate", True)
        limit = cut_limit(params, self.max_length)
        reading = {"truncation": truncate, "max_length": limit if truncate else None}
        if truncate and TRUNCATE_TO in params and any(isinstance(one, str) for one in inputs):
            refuse_no_room(tokenizer, params[TRUNCATE_TO], [None])  # (ids get none added)
        texts = [
            text.lower() if self.lowercase and isinstance(text, str) else text for text in inputs
        ]
        # a long text cut first where it is truncated (`long_texts`), never where it is refused
        cut = narrowed_texts(tokenizer, texts, limit) if truncate else texts
        mixed = any(isinstance(item, list) for item in inputs)

        def encode(items: list[Any]) -> Any:
            if mixed:  # token ids among the texts: a row each, then padded together
                rows = [self._row(tokenizer, item, reading) for item in items]
                return tokenizer.pad(rows, padding=True, return_tensors="pt")
            return tokenizer(items, padding=True, return_tensors="pt", **reading)

        encoded = encode_cut(encode, texts, cut, limit)
        self.refuse_unreadable(encoded["input_ids"], tokenizer)
        length = encoded["input_ids"].shape[1]
        if length > self.max_length:
            raise ValueError(
                f"the input is {length} tokens and the model takes at most {self.max_length}: "
                "send truncate: true to cut it"
            )
        return encoded

    def _row(self, tokenizer: Any, item: Any, reading: dict[str, Any]) -> dict[str, list[int]]:
        """One input of a batch that holds token ids (OpenAI's token arrays): the ids as
        they are, as the model's own tokenizer gives them (special tokens included), cut as
        a text is; a text beside them tokenized alone."""
        if not isinstance(item, list):
            return dict(tokenizer(item, **reading))
        unknown = next((i for i in item if not 0 <= i < self.vocabulary), None)
        if unknown is not None:
            raise ValueError(
                f"the token id {unknown} is not in the model's vocabulary (ids run from 0 "
                f"to {self.vocabulary - 1})"
            )
        ids = item
        limit = reading["max_length"]
        if reading["truncation"] and len(ids) > limit:
            keep_end = tokenizer.truncation_side == "left"
            ids = ids[-limit:] if keep_end else ids[:limit]
        row = {"input_ids": ids, "attention_mask": [1] * len(ids)}
        if "token_type_ids" in tokenizer.model_input_names:
            row["token_type_ids"] = [0] * len(ids)
        return row

    def run_prepared(
        self, inputs: list[Any], params: dict[str, Any], control: Control, prepared: Any
    ) -> list[Any]:
        if prepared is None:
            return self.run(inputs, params, control)
        # The embedding routes always want a sentence vector, normalized unless the
        # request asks not to (TEI's `normalize`), and the real token count of each input.
        embedding_route = control.embedding_route
        default_pooling = self.default_pooling
        if embedding_route and default_pooling == "none":
            default_pooling = "mean"
        pooling = params.get("pooling", default_pooling)
        sentence_route = embedding_route and not control.sparse  # (sparse: weights as they are)
        # a folder's Normalize module normalizes its sentence vector, not token vectors
        # (sentence-transformers' token_embeddings and TEI's /embed_all are not)
        folder_normalizes = self.default_normalize and pooling != "none"
        normalize = params.get("normalize", folder_normalizes or sentence_route)
        dimensions = params.get("dimensions")
        most = self.width if pooling == "none" else self.dimensions
        if dimensions is not None and dimensions > most:
            raise ValueError(f"dimensions must be at most {most} for this model")
        encoded = self.on_device(prepared)
        if self.splade is not None:
            return self.run_splade(encoded, params, control, pooling, normalize)
        if control.sparse:
            raise ValueError("sparse vectors come from a model with SPLADE pooling only")
        with torch.inference_mode():
            graphed = self.graphed
            hidden = graphed(encoded) if graphed else self.model(**encoded).last_hidden_state
            hidden = hidden.float()
            mask = encoded["attention_mask"]
            refuse_not_numbers(hidden, "vectors", mask)
            if pooling == "none":
                hidden = hidden[..., :dimensions]  # (None: all)
                if normalize:
                    hidden = torch.nn.functional.normalize(hidden, dim=-1)
                # read back at once: a read a row was a round trip to a GPU a row, twice
                lengths = mask.sum(1).tolist()
                tokens = hidden.cpu().numpy()
                # the pipeline's shape: [1, tokens, hidden] per input
                return [tokens[i : i + 1, :length] for i, length in enumerate(lengths)]
            pooled = pool(hidden, mask, pooling)
            for layer in self.dense:
                pooled = layer(pooled)
            # Matryoshka-style: keep the first dimensions of the final vector
            pooled = pooled[..., :dimensions]
            if normalize:
                pooled = torch.nn.functional.normalize(pooled, dim=-1)
            vectors = list(pooled.cpu().numpy())
        return sentence_answers(vectors, mask, embedding_route)

    def run_splade(
        self,
        encoded: Any,
        params: dict[str, Any],
        control: Control,
        pooling: str,
        normalize: bool,
    ) -> list[Any]:
        """A SPLADE model's vectors, one weight a word of its vocabulary: as lists of the
        words of nonzero weight for /embed_sparse, else whole. What has no meaning for
        such a vector (token vectors, another pooling, `dimensions`) is refused, as TEI
        does, and `normalize`, unless the folder normalizes."""
        if pooling == "none":
            raise ValueError("a SPLADE model has no token vectors to answer (TEI's embed_all)")
        if pooling != "splade":
            raise ValueError(f"a SPLADE model pools its words' weights, not by {pooling} pooling")
        if normalize and not self.default_normalize:
            raise ValueError(
                "normalize is not available for a SPLADE model: send normalize: false, or "
                "ask /embed_sparse for its words' weights"
            )
        if params.get("dimensions") is not None:
            raise ValueError("dimensions is not available for a SPLADE model")
        # (normalize: only where its folder does, then on every route: sparse ones too)
        assert self.splade is not None
        with torch.inference_mode():
            weights = splade_vectors(self.model, encoded, self.splade)
            refuse_not_numbers(weights, "vectors")
            if normalize:
                weights = torch.nn.functional.normalize(weights, dim=-1)
            vectors = weights.cpu().numpy()
        mask = encoded["attention_mask"]
        if control.sparse:
            counts = mask.sum(1).tolist()
            return [
                {"indices": indices, "values": values, "tokens": count}
                for (indices, values), count in zip(sparse_rows(vectors), counts, strict=True)
            ]
        return sentence_answers(list(vectors), mask, control.embedding_route)


def sentence_answers(vectors: list[Any], mask: torch.Tensor, embedding_route: bool) -> list[Any]:
    """One answer per input: its vector, or on the embedding routes the vector and the
    input's real token count (`mask`: 1 at each)."""
    if not embedding_route:
        return vectors
    counts = mask.sum(1).tolist()
    return [{"embedding": v, "tokens": count} for v, count in zip(vectors, counts, strict=True)]


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """One vector per row of `hidden` (batch, tokens, hidden), as sentence-transformers'
    Pooling computes `mode`; `mask` is 1 at each real token, padding on either side."""
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    if mode == "cls":  # the first real token
        return hidden[rows, mask.argmax(1)]
    if mode == "lasttoken":
        return hidden[rows, mask.shape[1] - 1 - mask.flip(1).argmax(1)]
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "max":
        return hidden.masked_fill(weights == 0, float("-inf")).max(1).values
    if mode == "weightedmean":  # the n-th real token weighs n
        weights = weights * mask.cumsum(1).unsqueeze(-1).to(hidden.dtype)
    total = (hidden * weights).sum(1)
    count = weights.sum(1).clamp(min=1e-9)
    return total / (count.sqrt() if mode == "mean_sqrt_len_tokens" else count)
