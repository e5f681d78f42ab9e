"""Haystack's Hugging Face API components (huggingface-api-haystack), unmodified, against
a running rawserve serving an embedding model first and a cross-encoder.

Run by tests/test_compat_client_libraries.py with the clients' own virtual environment:
`python compat_haystack_client.py BASE_URL` prints, as one JSON document, what each call
answered or the error the client raised. The embedder is the documented
`api_type="text_embeddings_inference"` one (it posts to the URL itself, which rawserve
serves with its first model), the ranker `HuggingFaceTEIRanker` (TEI's `/rerank`).
Imports nothing of rawserve.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from compat_outcome import outcome_of
from haystack import Document
from haystack_integrations.components.embedders.huggingface_api import (
    HuggingFaceAPITextEmbedder,
)
from haystack_integrations.components.rankers.huggingface_api import HuggingFaceTEIRanker

TEXT = "the movie was good"
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "berlin is a city", "i like it"]


def shape(result: Any) -> Any:
    if "documents" in result:
        return [{"content": doc.content, "score": doc.score} for doc in result["documents"]]
    return result


outcome = outcome_of(shape)


def main(base_url: str) -> None:
    embedder = HuggingFaceAPITextEmbedder(
        api_type="text_embeddings_inference", api_params={"url": base_url}
    )
    ranker = HuggingFaceTEIRanker(url=base_url, top_k=2, timeout=60)
    documents = [Document(content=text) for text in DOCUMENTS]
    calls = {
        "embed": lambda: embedder.run(TEXT),
        "rank": lambda: ranker.run(query=QUERY, documents=documents),
        "blank": lambda: embedder.run("   "),
        "blank_query": lambda: ranker.run(query=" ", documents=documents),
    }
    print(json.dumps({name: outcome(call) for name, call in calls.items()}))


if __name__ == "__main__":
    main(sys.argv[1])
