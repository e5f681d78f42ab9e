"""feature-extraction: text in; a sentence vector or token vectors out.

InferenceClient sends this task's parameters at the top level of the body
(`{"inputs": ..., "normalize": true}`), so they are read from there too.
"""

from __future__ import annotations

from rawserve.tasks.checks import (
    NUMBER,
    boolean,
    ignored,
    int_range,
    lower_one_of,
    one_of,
    short_text,
    text,
)
from rawserve.tasks.rules import Task

TASK = Task(
    "feature-extraction",
    text,
    {
        "pooling": one_of("mean", "cls", "none"),
        "normalize": boolean,
        "truncate": boolean,
        "truncation_direction": lower_one_of("right", "left"),
        "dimensions": int_range(1, 65536),  # keep the first N (Matryoshka models)
        # a prompt of the model's own before each text (the server puts it there)
        "prompt_name": short_text,
        # InferenceClient's feature_extraction sends it as given; floats are its answer
        # (base64 is /v1/embeddings')
        "encoding_format": ignored("float"),
    },
    params_at_root=True,
    # a sentence vector [hidden], or token vectors [1, tokens, hidden] (pooling "none")
    output_schema={
        "type": "array",
        "items": {
            "anyOf": [
                NUMBER,
                {"type": "array", "items": {"anyOf": [NUMBER, {"type": "array", "items": NUMBER}]}},
            ]
        },
    },
)
