"""SPLADE: a sparse encoder's vocabulary-wide vectors from its masked language model's
logits, as sentence-transformers' SpladePooling computes them.

Worker process only (imports torch).
"""

from __future__ import annotations

from typing import Any

import torch

from rawserve.models.sentence_folder import SpladePooling

# The logits computed at once, in numbers: a batch's are (rows, tokens, vocabulary), 30,522
# words a token for BERT's, 500 MB at 32 texts of 128 tokens; rows are run in groups that
# keep under this (64 M numbers: 256 MB in float32), so a batch costs what its pooling keeps.
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
        weights = torch.log1p(torch.relu(model(**part).logits.float()))
        if pooling.activation == "log1p_relu":
            weights = torch.log1p(weights)
        weights = weights * part["attention_mask"].unsqueeze(-1).to(weights.dtype)
        pooled.append(weights.amax(1) if pooling.strategy == "max" else weights.sum(1))
    return torch.cat(pooled)


def sparse_rows(vectors: torch.Tensor) -> list[tuple[list[int], list[float]]]:
    """Each row's words of nonzero weight, in the order of their ids, and their weights."""
    rows = []
    for row in vectors:
        indices = torch.nonzero(row).squeeze(1)
        rows.append((indices.tolist(), row[indices].tolist()))
    return rows
