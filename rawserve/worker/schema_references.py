"""Where a JSON schema's references lead: JSON pointers, anchors (`$anchor`, an older
draft's `"$id": "#name"`) and URIs resolved against the `$id`s of the resources they are
in, each part named by its path in the whole schema. URIs are resolved and compared as
llguidance does (RFC 3986): against `json-schema:///` where the schema names no base,
normalised (scheme and host in lower case, dot segments removed, percent-escapes of
unreserved characters decoded), a root `$id` without its fragment ("...root.json#"),
draft 4's `id` for `$id` where the schema's `$schema` is draft 4's.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

Path = tuple[str | int, ...]  # where a part lies in the whole schema
ANCHOR = re.compile(r"[A-Za-z_][-A-Za-z0-9._]*")  # an anchor's name (JSON Schema's)
# llguidance's base URI for a schema that names none: "/#/$defs/x" and
# "json-schema:///#/$defs/x" lead into the schema as "#/$defs/x" does
DEFAULT_BASE = "json-schema:///"
# a URI reference's parts (RFC 3986, appendix B): scheme, authority, path, query, fragment
PARTS = re.compile(
    r"(?:([A-Za-z][A-Za-z0-9+.-]*):)?(?://([^/?#]*))?([^?#]*)(?:\?([^#]*))?(?:#(.*))?", re.S
)
ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})")
UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")


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
    """`reference` resolved against the absolute URI `base` (RFC 3986, 5.2), normalised."""
    scheme, authority, path, query, fragment = split(reference)
    if scheme is None:
        base_scheme, base_authority, base_path, base_query, _ = split(base)
        scheme = base_scheme
        if authority is None:
            if not path:
                path, authority = base_path, base_authority
                query = base_query if query is None else query
            else:
                if not path.startswith("/"):
                    if base_authority is not None and not base_path:
                        path = "/" + path
                    else:
                        path = base_path[: base_path.rfind("/") + 1] + path
                authority = base_authority
    return normalised(scheme, authority, without_dots(path), query, fragment)


def split(uri: str) -> tuple[str | None, str | None, str, str | None, str | None]:
    found = PARTS.fullmatch(uri)
    assert found is not None  # (every part is optional: any text matches)
    scheme, authority, path, query, fragment = found.groups()
    return scheme, authority, path, query, fragment


def normalised(
    scheme: str | None, authority: str | None, path: str, query: str | None, fragment: str | None
) -> str:
    """A URI from its parts, as llguidance compares them: scheme and host in lower case,
    percent-escapes of unreserved characters decoded (the others' digits in upper case)."""
    text = f"{scheme.lower()}:" if scheme is not None else ""
    if authority is not None:
        user, at, host = authority.rpartition("@")
        text += "//" + unescaped(user + at + host.lower())
    text += unescaped(path)
    if query is not None:
        text += "?" + unescaped(query)
    if fragment is not None:
        text += "#" + unescaped(fragment)
    return text


def unescaped(text: str) -> str:
    def one(found: re.Match[str]) -> str:
        character = chr(int(found[1], 16))
        return character if character in UNRESERVED else found[0].upper()

    return ESCAPE.sub(one, text)


def without_dots(path: str) -> str:
    """`path` without its "." and ".." segments (RFC 3986, 5.2.4)."""
    out: list[str] = []
    while path:
        if path.startswith("../"):
            path = path[3:]
        elif path.startswith(("./", "/./")):
            path = path[2:]
        elif path == "/.":
            path = "/"
        elif path.startswith("/../") or path == "/..":
            path = "/" + path[4:]
            if out:
                out.pop()
        elif path in (".", ".."):
            path = ""
        else:
            cut = path.find("/", 1)
            cut = len(path) if cut < 0 else cut
            out.append(path[:cut])
            path = path[cut:]
    return "".join(out)


def without_fragment(uri: str) -> str:
    return uri.partition("#")[0]


def identifying(schema: Any) -> str:
    """The keyword that gives a resource its URI: `$id`, or draft 4's `id` where the
    schema's `$schema` names draft 4 (as llguidance reads them)."""
    declared = schema.get("$schema") if isinstance(schema, dict) else None
    return "id" if isinstance(declared, str) and "draft-04" in declared else "$id"


def begins_resource(part: dict[str, Any], keyword: str = "$id") -> bool:
    """Whether `part` begins a resource of its own: an `$id` (`keyword`) other than a
    fragment (an older draft's `"$id": "#name"` names a part, its base unchanged)."""
    identifier = part.get(keyword)
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


def resource_of(schema: Any, path: Path, keyword: str = "$id") -> tuple[Path, Any]:
    """Where the resource holding the part at `path` begins (its nearest `$id`), and that
    `$id` (None: the whole schema's, which has none)."""
    begins: Path = ()
    identifier = None
    part = schema
    if isinstance(part, dict) and begins_resource(part, keyword):
        identifier = part[keyword]
    for depth, step in enumerate(path):
        part = part[step]
        if isinstance(part, dict) and begins_resource(part, keyword):
            begins, identifier = path[: depth + 1], part[keyword]
    return begins, identifier


def part_at(schema: Any, path: Path) -> Any:
    """The part of `schema` at `path`."""
    for step in path:
        schema = schema[step]
    return schema
