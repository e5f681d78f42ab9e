"""fill-mask: text with the mask token in; the likeliest fillings out.

`pipe([x])` answers x's predictions without the outer list: the one task of the
installed transformers that does.
"""

from __future__ import annotations

from rawserve.tasks.checks import NUMBER, int_range, one_or_list, text, text_list
from rawserve.tasks.rules import Task

TASK = Task(
    "fill-mask",
    text,
    {"top_k": int_range(1, 100), "targets": text_list(100)},
    unwraps_single=True,
    output_schema=one_or_list(
        {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["score", "token", "token_str", "sequence"],
                "properties": {
                    "score": NUMBER,
                    "token": {"type": "integer"},
                    "token_str": {"type": "string"},
                    "sequence": {"type": "string"},
                },
            },
        }
    ),
)
