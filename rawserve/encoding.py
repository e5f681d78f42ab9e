"""JSON encoding of outputs, numpy arrays included."""

from __future__ import annotations

import json
from typing import Any

import numpy as np


def _default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def dumps(value: Any) -> bytes:
    return json.dumps(value, default=_default, separators=(",", ":")).encode()
