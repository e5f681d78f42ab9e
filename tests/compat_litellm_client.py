"""litellm, unmodified, against a running rawserve serving an embedding model ("emb"), a
cross-encoder ("rank") and a chat model ("chat").

Run by tests/test_compat_client_libraries.py with the clients' own virtual environment:
`python compat_litellm_client.py BASE_URL` prints, as one JSON document, what each call
answered or the error the client raised. The OpenAI routes are reached through litellm's
openai-compatible provider (`openai/<model>` with `api_base=.../v1`), `/rerank` through
its Hugging Face (TEI) rerank provider, as litellm's documentation shows for each.
Imports nothing of rawserve.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import litellm
from compat_outcome import outcome_of

PROMPT = "the movie was"
MESSAGES = [{"role": "user", "content": "hello, what is a good movie"}]
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "berlin is a city", "i like it"]


def shape(result: Any) -> Any:
    if isinstance(result, list):  # a stream's chunks
        return [chunk.model_dump(mode="json") for chunk in result]
    return result.model_dump(mode="json")


outcome = outcome_of(shape)


def main(base_url: str) -> None:
    openai_routes = {"api_base": f"{base_url}/v1", "api_key": "unused"}
    calls = {
        "embedding": lambda: litellm.embedding(model="openai/emb", input=[PROMPT], **openai_routes),
        "completion": lambda: litellm.completion(
            model="openai/chat", messages=MESSAGES, max_tokens=5, temperature=0, **openai_routes
        ),
        "completion_stream": lambda: list(
            litellm.completion(
                model="openai/chat",
                messages=MESSAGES,
                max_tokens=5,
                temperature=0,
                stream=True,
                **openai_routes,
            )
        ),
        "text_completion": lambda: litellm.text_completion(
            model="openai/chat", prompt=PROMPT, max_tokens=5, temperature=0, **openai_routes
        ),
        "rerank": lambda: litellm.rerank(
            model="huggingface/rank", query=QUERY, documents=DOCUMENTS, top_n=2, api_base=base_url
        ),
        # errors: a model that is not served (of several), a blank text on each route
        "unknown_model": lambda: litellm.embedding(
            model="openai/text-embedding-3-small", input=[PROMPT], **openai_routes
        ),
        "blank": lambda: litellm.embedding(model="openai/emb", input=["   "], **openai_routes),
        "blank_query": lambda: litellm.rerank(
            model="huggingface/rank", query=" ", documents=DOCUMENTS, top_n=2, api_base=base_url
        ),
    }
    print(json.dumps({name: outcome(call) for name, call in calls.items()}))


if __name__ == "__main__":
    main(sys.argv[1])
