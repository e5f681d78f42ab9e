"""SPLADE: a sparse encoder's vocabulary-wide vectors from its masked language model's
logits, as sentence-transformers' SpladePooling computes them.

Worker process only (imports torch).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rawserve.models.sentence_folder import SpladePooling

# The logits computed at once, in numbers: a batch's are (rows, tokens, vocabulary), 30,522
# words a token for BERT's, 500 MB at 32 texts of 128 tokens; rows are run in groups that
# keep under this (64 M numbers: 256 MB in float32, pooled in place), so a batch costs
# about what its pooled vectors keep. (One row is its own group, however long.)
LOGITS_AT_ONCE = 64 * 1024 * 1024


def splade_vectors(model: Any, encoded: Any, pooling: SpladePooling) -> torch.Tensor:
    """(rows, vocabulary) float32: each word's weight for each text, the pooling's
    `strategy` over the text's tokens of log(1 + relu(logit)); padding weighs nothing."""
    mask = encoded["attention_mask"]
    rows, tokens = mask.shape
    vocabulary = int(model.config.vocab_size)
    step = max(1, LOGITS_AT_ONCE // max(1, tokens * vocabulary))
    pooled = []
    for start in range(0, rows, step):
        part = {name: tensor[start : start + step] for name, tensor in encoded.items()}
        # in place: each step on a copy held the logits three times over
        weights = model(**part).logits.float().relu_().log1p_()
        if pooling.activation == "log1p_relu":
            weights.log1p_()
        weights.mul_(part["attention_mask"].unsqueeze(-1).to(weights.dtype))
        pooled.append(weights.amax(1) if pooling.strategy == "max" else weights.sum(1))
        del weights
    return torch.cat(pooled)


def sparse_rows(vectors: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each row's words of nonzero weight, in the order of their ids, and their weights
    (float32, as a vector's numbers are answered)."""
    rows = []
    for row in vectors:
        indices = np.flatnonzero(row)
        rows.append((indices, row[indices]))
    return rows
