"""Tiny random transformers models, built locally for tests (nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = (
    "the a an test hello world is was good bad great movie film i you we like love hate it "
    "this that not very and or of to in on for with paris france city capital name my what "
    "who where berlin london john mary lives works"
).split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = SPECIAL + WORDS + [chr(c) for c in range(ord("a"), ord("z") + 1)] + list(".,?!")

KINDS = (
    "fill-mask",
    "text-classification",
    "token-classification",
    "feature-extraction",
    "sentence-embedding",
)


def build(kind: str, folder: Path) -> Path:
    """Save a tiny random BERT for `kind` into `folder`."""
    import torch
    import transformers

    torch.manual_seed(0)
    tokenizer = transformers.BertTokenizer(vocab={word: i for i, word in enumerate(VOCAB)})
    config = transformers.BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=128,
    )
    if kind == "fill-mask":
        model = transformers.BertForMaskedLM(config)
    elif kind == "text-classification":
        config.id2label = {0: "NEGATIVE", 1: "POSITIVE"}
        config.label2id = {"NEGATIVE": 0, "POSITIVE": 1}
        model = transformers.BertForSequenceClassification(config)
    elif kind == "token-classification":
        labels = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
        config.id2label = dict(enumerate(labels))
        config.label2id = {label: i for i, label in enumerate(labels)}
        model = transformers.BertForTokenClassification(config)
    elif kind in ("feature-extraction", "sentence-embedding"):
        model = transformers.BertModel(config)
    else:
        raise ValueError(kind)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if kind == "sentence-embedding":  # the files sentence-transformers writes
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {
                "idx": 1,
                "name": "1",
                "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling",
            },
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            },
        ]
        (folder / "modules.json").write_text(json.dumps(modules))
        (folder / "1_Pooling").mkdir(exist_ok=True)
        (folder / "1_Pooling" / "config.json").write_text(
            json.dumps({"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True})
        )
    return folder
