"""TGI's Python client (text-generation 0.7.0), unmodified, against a running rawserve.

Run by tests/test_compat_clients.py with the interpreter of a virtual environment of its
own (the client pins huggingface_hub < 1, rawserve needs >= 2): `python
compat_tgi_client.py BASE_URL` prints, as one JSON document, what each call answered or
the error the client raised. Imports nothing of rawserve.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from compat_outcome import outcome_of
from text_generation import Client
from text_generation.types import Message

PROMPT = "the movie was"


def shape(result: Any) -> Any:
    if isinstance(result, list):
        return [item.model_dump(mode="json") for item in result]
    return result.model_dump(mode="json")


outcome = outcome_of(shape)


def main(base_url: str) -> None:
    client = Client(base_url, timeout=60)
    messages = [Message(role="user", content="hello, what is a good movie")]
    calls = {
        "generate": lambda: client.generate(PROMPT, max_new_tokens=5),
        "generate_stop": lambda: client.generate(PROMPT, max_new_tokens=5, stop_sequences=["x"]),
        "generate_best_of": lambda: client.generate(
            PROMPT, max_new_tokens=5, best_of=2, do_sample=True
        ),
        "generate_penalized": lambda: client.generate(
            PROMPT, max_new_tokens=5, frequency_penalty=2.0
        ),
        "generate_stream": lambda: list(client.generate_stream(PROMPT, max_new_tokens=5)),
        "chat": lambda: client.chat(messages=messages, max_tokens=3, temperature=0),
        "watermark": lambda: client.generate(
            PROMPT, max_new_tokens=12, watermark=True, do_sample=True, seed=3
        ),
        "too_long": lambda: client.generate(PROMPT, max_new_tokens=100_000),
        "chat_too_long": lambda: client.chat(messages=messages, max_tokens=100_000),
        # (its stream's types do not read OpenAI's chunks: the README says so)
        "chat_stream": lambda: list(client.chat(messages=messages, max_tokens=3, stream=True)),
    }
    print(json.dumps({name: outcome(call) for name, call in calls.items()}))


if __name__ == "__main__":
    main(sys.argv[1])
