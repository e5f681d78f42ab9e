"""image-classification: an image in; `[{label, score}]` out, best first.

The image comes as the raw body (InferenceClient sends the file's bytes, without a
Content-Type) or, in JSON, base64-encoded as `inputs` (what InferenceClient sends when
there are parameters). Either way it is queued as base64 text, so the messages to the
worker stay plain data; the worker decodes it with Pillow (the `image` extra).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from rawserve.tasks.checks import LABEL_SCORES, BlankInput, checker, int_range, one_of
from rawserve.tasks.rules import Task


@checker({"type": "string", "minLength": 1, "contentEncoding": "base64"})
def image_base64(value: Any) -> str:
    if value == "":
        raise BlankInput("the image is empty")
    if isinstance(value, str):
        try:
            base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            pass
        else:
            return value
    raise ValueError("each input must be an image, base64-encoded")


def image_from_body(body: bytes) -> str:
    return base64.b64encode(body).decode("ascii")


TASK = Task(
    "image-classification",
    image_base64,
    {
        "top_k": int_range(1, 1000),
        "function_to_apply": one_of("sigmoid", "softmax", "none"),
    },
    binary_input=True,
    output_schema=LABEL_SCORES,
)
