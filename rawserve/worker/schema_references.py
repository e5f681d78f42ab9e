"""Where a JSON schema's references lead: JSON pointers, anchors (`$anchor`, an older
draft's `"$id": "#name"`) and URIs resolved against the `$id`s of the resources they are
in, each part named by its path in the whole schema.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote, urljoin

Path = tuple[str | int, ...]  # where a part lies in the whole schema
ANCHOR = re.compile(r"[A-Za-z_][-A-Za-z0-9._]*")  # an anchor's name (JSON Schema's)
SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")  # a URI's, before its first ":"


def anchors_of(part: dict[str, Any]) -> list[str]:
    """The names `part` is given as an anchor: its `$anchor`, an older draft's `"$id":
    "#name"` (draft 4's `"id"`)."""
    names = [part["$anchor"]] if isinstance(part.get("$anchor"), str) else []
    for keyword in ("$id", "id"):
        given = part.get(keyword)
        if isinstance(given, str) and given.startswith("#"):
            names.append(given[1:])
    return [name for name in names if ANCHOR.fullmatch(name)]


def joined(base: str, reference: str) -> str:
    """`reference` resolved against the base URI `base` ("": the schema gives none)."""
    if not base or SCHEME.match(reference):
        return reference
    return urljoin(base, reference)


def begins_resource(part: dict[str, Any]) -> bool:
    """Whether `part` begins a resource of its own: an `$id` other than a fragment (an
    older draft's `"$id": "#name"` names a part, its base unchanged)."""
    identifier = part.get("$id")
    return isinstance(identifier, str) and not identifier.startswith("#")


def within(schema: Any, resource: Path, reference: str) -> Path | None:
    """Where the JSON pointer `reference` ("#/$defs/x") leads from `resource`; None where
    it leads nowhere (or is an anchor's name, not a pointer)."""
    pointer = unquote(reference[1:])
    if pointer and not pointer.startswith("/"):
        return None
    path: Path = resource
    part = part_at(schema, resource)
    for step in pointer.split("/")[1:]:
        key = step.replace("~1", "/").replace("~0", "~")
        if isinstance(part, dict) and key in part:
            part, path = part[key], (*path, key)
        elif isinstance(part, list) and key.isdigit() and int(key) < len(part):
            part, path = part[int(key)], (*path, int(key))
        else:
            return None
    return path


def resource_of(schema: Any, path: Path) -> tuple[Path, Any]:
    """Where the resource holding the part at `path` begins (its nearest `$id`), and that
    `$id` (None: the whole schema's, which has none)."""
    begins: Path = ()
    identifier = None
    part = schema
    if isinstance(part, dict) and begins_resource(part):
        identifier = part["$id"]
    for depth, step in enumerate(path):
        part = part[step]
        if isinstance(part, dict) and begins_resource(part):
            begins, identifier = path[: depth + 1], part["$id"]
    return begins, identifier


def part_at(schema: Any, path: Path) -> Any:
    """The part of `schema` at `path`."""
    for step in path:
        schema = schema[step]
    return schema
