"""langchain-openai, unmodified, against a running rawserve serving an embedding model
("emb") and a chat model ("chat"), among others.

Run by tests/test_compat_client_libraries.py with the clients' own virtual environment:
`python compat_langchain_client.py BASE_URL` prints, as one JSON document, what each call
answered or the error the client raised. `OpenAIEmbeddings` is built with
`check_embedding_ctx_length=False`, as its documentation says for servers other than
OpenAI's (else it sends tiktoken's token ids). Imports nothing of rawserve.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from compat_outcome import outcome_of
from langchain_openai import ChatOpenAI, OpenAIEmbeddings
from tiny_models import WEATHER

TEXT = "the movie was good"
QUESTION = "hello, what is a good movie"
PERSON = {
    "title": "person",
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}},
    "required": ["name"],
    "additionalProperties": False,
}


def shape(result: Any) -> Any:
    if hasattr(result, "model_dump"):  # a message
        return {
            "content": result.content,
            "metadata": result.response_metadata,
            "tool_calls": getattr(result, "tool_calls", None),
        }
    return result


outcome = outcome_of(shape)


def main(base_url: str) -> None:
    api = {"base_url": f"{base_url}/v1", "api_key": "unused"}
    embeddings = OpenAIEmbeddings(model="emb", check_embedding_ctx_length=False, **api)
    # its default chunk_size sends 1000 texts a request; rawserve takes 32 (as TEI)
    chunked = OpenAIEmbeddings(
        model="emb", check_embedding_ctx_length=False, chunk_size=32, max_retries=0, **api
    )
    chat = ChatOpenAI(model="chat", max_tokens=5, temperature=0, **api)
    roomy = ChatOpenAI(model="chat", max_tokens=60, temperature=0, **api)
    calls = {
        "embed_query": lambda: embeddings.embed_query(TEXT),
        "embed_documents": lambda: embeddings.embed_documents([TEXT, "i like it"]),
        "embed_many": lambda: chunked.embed_documents([TEXT] * 40),
        "embed_many_unchunked": lambda: OpenAIEmbeddings(
            model="emb", check_embedding_ctx_length=False, max_retries=0, **api
        ).embed_documents([TEXT] * 40),
        "invoke": lambda: chat.invoke(QUESTION),
        "stream": lambda: [chunk.content for chunk in chat.stream(QUESTION)],
        # tools and structured output: what agents and extraction chains ask for
        "tool_call": lambda: roomy.bind_tools([WEATHER], tool_choice="weather").invoke("hi"),
        "structured": lambda: roomy.with_structured_output(PERSON, method="json_schema").invoke(
            "hi"
        ),
        # errors: a model that is not served (of several), a blank text
        "unknown_model": lambda: ChatOpenAI(model="gpt-4o", max_retries=0, **api).invoke(QUESTION),
        "blank": lambda: embeddings.embed_query("   "),
    }
    print(json.dumps({name: outcome(call) for name, call in calls.items()}))


if __name__ == "__main__":
    main(sys.argv[1])
