"""The texts every benchmark sends, and how each server wants them as request bodies.

Texts are generated from a fixed seed, so the ceiling, rawserve and the baselines see the
same items. `short`: one sentence of 8 to 12 common words (about 13 tokens with [CLS] and
[SEP]). `mixed`: lengths from a few to about 200 tokens, log-uniform, so that most items
are short and a batch taken in arrival order nearly always holds a long one.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Any

WORDS = (
    "the movie was good bad great terrible and i we you they it this that not very really "
    "quite film story actors music plot ending people time day night city home work food "
    "service staff room price place friend family love hate like enjoy watch see read "
    "book song show game team player season world life year week hour long short old new "
    "happy sad funny boring slow fast best worst first last more less much many some every "
    "would could should will can never always often again still just only also even"
).split()

TEXT_SETS = ("short", "mixed")
CORPUS_SIZE = 1024
SEED = 8


def texts(kind: str, count: int = CORPUS_SIZE, seed: int = SEED) -> list[str]:
    """`count` texts of the given kind ("short" or "mixed"), the same on every call."""
    rng = random.Random(f"{kind}-{seed}")
    if kind == "short":
        lengths = [rng.randint(8, 12) for _ in range(count)]
    elif kind == "mixed":
        # log-uniform from 2 to 190 words: a few tokens to about 200 with [CLS]/[SEP]
        lengths = [round(math.exp(rng.uniform(math.log(2), math.log(190)))) for _ in range(count)]
    else:
        raise ValueError(f"unknown text set {kind!r} (known: {', '.join(TEXT_SETS)})")
    return [_sentence(rng, n) for n in lengths]


def _sentence(rng: random.Random, words: int) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return text[0].upper() + text[1:] + "."


@dataclass(frozen=True)
class BodyFormat:
    """How one server wants an input: a raw text body, an Inference-API JSON document, or
    an OpenAI embeddings request (`openai_model` set) on `path`."""

    json_params: dict[str, Any] | None = None  # None: raw text body
    path: str = "/"
    openai_model: str | None = None
    texts_per_request: int = 1  # more: a JSON list of that many copies of the text

    @property
    def listed(self) -> bool:
        return self.texts_per_request > 1

    @property
    def content_type(self) -> str:
        raw = self.json_params is None and self.openai_model is None and not self.listed
        return "text/plain; charset=utf-8" if raw else "application/json"

    def body(self, text: str) -> bytes:
        inputs: str | list[str] = [text] * self.texts_per_request if self.listed else text
        if self.openai_model is not None:
            return json.dumps({"input": inputs, "model": self.openai_model}).encode()
        if self.json_params is None and not self.listed:
            return text.encode()
        document: dict[str, Any] = {"inputs": inputs}
        if self.json_params:
            document["parameters"] = self.json_params
        return json.dumps(document).encode()


RAW_TEXT = BodyFormat()
