"""image-classification: an image in; `[{label, score}]` out, best first.

The image comes as the raw body (InferenceClient sends the file's bytes, without a
Content-Type) or, in JSON, base64-encoded as `inputs` (what InferenceClient sends when
there are parameters), or as a data URL. Either way it is queued as base64 text, so the
messages to the worker stay plain data; the worker decodes it with Pillow (the `image`
extra).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from rawserve.tasks.checks import LABEL_SCORES, BlankInput, checker, int_range, lower_one_of
from rawserve.tasks.image_sizes import image_tokens
from rawserve.tasks.rules import Task

DATA_URL_START = "data:"
# the types a data URL of an image may name: an image's, or none known (a browser's
# FileReader names a file of a type it does not know `application/octet-stream`); the
# bytes are Pillow's to read either way
IMAGE_DATA_TYPES = ("image/",)
UNTYPED_DATA = ("", "application/octet-stream")


@checker({"type": "string", "minLength": 1, "contentEncoding": "base64"})
def image_base64(value: Any) -> str:
    """The image's base64, as transformers' `load_image` reads a string that is neither a
    URL nor a path: a data URL's payload (its scheme and type read in any case, as RFC
    2397 has them), lines joined. A URL is never fetched."""
    if isinstance(value, str):
        head, comma, payload = value.partition(",")
        head = head.lower()
        if comma and head.startswith(DATA_URL_START) and head.endswith(";base64"):
            kind = head.removeprefix(DATA_URL_START).removesuffix(";base64").split(";")[0]
            if not kind.startswith(IMAGE_DATA_TYPES) and kind not in UNTYPED_DATA:
                raise ValueError(f"a data URL of {kind} is no image: send an image's")
            value = payload
        elif value.strip().lower().startswith(("http://", "https://")):
            raise ValueError("an image URL is never fetched: send the image, base64-encoded")
        encoded = "".join(value.split())  # lines of 76, as MIME (and `base64`) wraps them
        if not encoded:
            raise BlankInput("the image is empty")
        try:
            base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            pass
        else:
            return encoded
    raise ValueError("each input must be an image, base64-encoded (or a data URL of one)")


def image_from_body(body: bytes) -> str:
    return base64.b64encode(body).decode("ascii")


TASK = Task(
    "image-classification",
    image_base64,
    {
        "top_k": int_range(1, 1000),
        "function_to_apply": lower_one_of("sigmoid", "softmax", "none"),
    },
    binary_input=True,
    output_schema=LABEL_SCORES,
    estimate=image_tokens,
)
