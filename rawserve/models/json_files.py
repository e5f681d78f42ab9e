"""Reading a model folder's JSON files, with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def json_file(path: Path) -> dict[str, Any]:
    """A JSON object file's contents; {} when there is no such file."""
    return json_object(path) if path.is_file() else {}


def json_object(path: Path) -> dict[str, Any]:
    """A JSON object file's contents; ValueError naming the file where it holds another."""
    document = read_json(path)
    if not isinstance(document, dict):
        raise ValueError(f"{path} is not a JSON object")
    return document


def read_json(path: Path) -> Any:
    """A JSON file's contents, read as UTF-8 (JSON's encoding, whatever the locale);
    ValueError naming the file and the fault where it is not JSON (a config edited by
    hand), which json's own error does not name."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ValueError(f"{path} is not valid JSON ({exc})") from None
