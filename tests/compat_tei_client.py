"""tei-client (TEI's Python client), unmodified, against running rawserve servers.

Run by tests/test_compat_client_libraries.py with the clients' own virtual environment:
`python compat_tei_client.py EMBEDDER_URL CLASSIFIER_URL RERANKER_URL` prints, as one
JSON document, what each call answered or the error the client raised. The client asks
`/info` which kind of model a server holds before each route (one model per server, as
TEI serves), hence a server per kind. Imports nothing of rawserve.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from compat_outcome import outcome_of
from tei_client import HttpClient

TEXT = "the movie was good"


def plain(result: Any) -> Any:
    """The client's pydantic answers as JSON; its plain lists and dicts as they are."""
    if isinstance(result, list):
        return [plain(item) for item in result]
    return result.model_dump(mode="json") if hasattr(result, "model_dump") else result


outcome = outcome_of(plain)


def main(embedder_url: str, classifier_url: str, reranker_url: str) -> None:
    embedder = HttpClient(embedder_url, timeout=60)
    classifier = HttpClient(classifier_url, timeout=60)
    reranker = HttpClient(reranker_url, timeout=60)
    tokens = embedder.tokenize("hello world")[0].get_ids()
    calls = {
        "embed": lambda: embedder.embed(TEXT),
        "embed_all": lambda: embedder.embed_all(TEXT),
        "tokenize": lambda: embedder.tokenize("hello world"),
        # past the model's 128 positions: counted whole, as TEI's /tokenize does
        "tokenize_long": lambda: len(embedder.tokenize("hello " * 300)[0].get_ids()),
        "prompt_names": lambda: embedder.prompt_names(),
        "decode": lambda: embedder.decode(tokens),
        "classify": lambda: classifier.classify(TEXT),
        "classify_pair": lambda: classifier.classify(("the movie was good", "i like it")),
        "rerank": lambda: reranker.rerank(
            query="what is the capital of france",
            texts=["paris is the capital of france", "berlin is a city"],
            return_text=True,
        ),
        "blank": lambda: embedder.embed(""),  # the client hands back what the server said
        # these read the body as their answer, refusal or not (as against TEI)
        "blank_classify": lambda: classifier.classify(" "),
        "blank_rerank": lambda: reranker.rerank(query=" ", texts=["a"]),
    }
    print(json.dumps({name: outcome(call) for name, call in calls.items()}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
