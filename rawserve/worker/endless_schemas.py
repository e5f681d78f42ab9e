"""JSON schemas that no answer can complete: a part whose every value must hold another
of itself (a required property, or a least number of items, that refers back to it),
so that no JSON of finite length satisfies it.

llguidance compiles such a schema and lets a model begin it; the fault shows only steps
later, when its parser runs out of room ("a step of the grammar needs more work than
allowed"), after a stream has sent its first tokens with a 200. Found here, before the
first token, it is refused with its status, as any schema the grammar cannot use.

The parts that may be endless are those a `$ref` names (only a reference makes a schema
infinite); each is judged as a context-free grammar's productive symbols are, from the
ones seen to end upwards, until nothing more changes. What is not a local reference
(`#...`, within the schema or the resource its nearest `$id` begins) is not judged.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

Path = tuple[str | int, ...]  # where a part lies in the whole schema

# the keywords whose values are data, not schemas: a "$ref" among them is no reference
DATA = frozenset({"const", "enum", "default", "examples"})
# the keywords whose values are schemas by name; of them, those reached by reference only
NAMED = frozenset({"properties", "patternProperties", "dependentSchemas"})
DEFINITIONS = frozenset({"$defs", "definitions"})
# the work the judgement may take (parts looked at): past it, the schema is not judged
# (llguidance's own bounds still hold it); about a second at most
BUDGET = 200_000


class OverBudget(Exception):
    pass


def endless_part(schema: Any) -> str | None:
    """The reference (as the schema writes it, `"#"` for the whole) to a part of `schema`
    that only an endless answer satisfies; None where each part can end, or where the
    schema is beyond what is judged (too large, nested too deep)."""
    try:
        return Judgement(schema).endless()
    except (OverBudget, RecursionError):
        return None


class Judgement:
    def __init__(self, schema: Any) -> None:
        self.schema = schema
        self.targets: dict[int, Path] = {}  # each "$ref"-holding part's target, by its id
        self.written: dict[Path, str] = {}  # each target's reference as the schema writes it
        self.left = BUDGET
        self._find_references(schema, (), ())

    def endless(self) -> str | None:
        ends = dict.fromkeys(self.written, False)
        parts = {target: part_at(self.schema, target) for target in self.written}
        changed = True
        while changed:
            changed = False
            for target, part in reversed(parts.items()):  # (the deepest found first)
                if not ends[target] and self.can_end(part, ends):
                    ends[target] = changed = True
        endless = [target for target, ended in ends.items() if not ended]
        if not endless:
            return None
        return self.written[min(endless, key=len)]  # the outermost

    def can_end(self, part: Any, ends: dict[Path, bool]) -> bool:
        """Whether some JSON of finite length satisfies `part`, the references' targets
        judged as `ends` says (not yet known to end: taken as endless)."""
        self.left -= 1
        if self.left < 0:
            raise OverBudget
        if not isinstance(part, dict):
            return True  # (true, false: no reference in them)
        target = self.targets.get(id(part))
        if target is not None and not ends[target]:
            return False
        every = part.get("allOf")
        if isinstance(every, list) and not all(self.can_end(each, ends) for each in every):
            return False
        for keyword in ("anyOf", "oneOf"):
            branches = part.get(keyword)
            if isinstance(branches, list) and branches and not self._any_ends(branches, ends):
                return False
        if "const" in part or "enum" in part:
            return True  # (a value given: finite)
        types = part.get("type")
        if isinstance(types, str):
            types = [types]
        if not isinstance(types, list):
            return True  # any type: a number would do
        return any(self._type_can_end(kind, part, ends) for kind in types)

    def _any_ends(self, branches: list[Any], ends: dict[Path, bool]) -> bool:
        return any(self.can_end(each, ends) for each in branches)

    def _type_can_end(self, kind: Any, part: dict[str, Any], ends: dict[Path, bool]) -> bool:
        if kind == "object":
            listed = part.get("properties")
            listed = listed if isinstance(listed, dict) else {}
            required = part.get("required")
            required = required if isinstance(required, list) else []
            return all(self.can_end(listed.get(name, True), ends) for name in required)
        if kind == "array":
            least = part.get("minItems", 0)
            if not isinstance(least, int) or least <= 0:
                return True
            prefix = part.get("prefixItems")
            items = part.get("items", True)
            if isinstance(items, list):  # (the older form of prefixItems)
                prefix, items = items, part.get("additionalItems", True)
            prefix = prefix if isinstance(prefix, list) else []
            needed = prefix[:least] + ([items] if least > len(prefix) else [])
            return all(self.can_end(each, ends) for each in needed)
        return True

    def _find_references(self, part: Any, path: Path, resource: Path) -> None:
        """Each local reference under `part` (at `path`, in the resource at `resource`),
        and under the parts they lead to: those an answer may reach (a part only named
        in "$defs" is none of them)."""
        self.left -= 1
        if self.left < 0:
            raise OverBudget
        if isinstance(part, list):
            for index, each in enumerate(part):
                self._find_references(each, (*path, index), resource)
            return
        if not isinstance(part, dict):
            return
        if isinstance(part.get("$id"), str):
            resource = path
        reference = part.get("$ref")
        if isinstance(reference, str) and reference.startswith("#"):
            target = within(self.schema, resource, reference)
            if target is not None:
                self.targets[id(part)] = target
                if target not in self.written:
                    self.written[target] = reference
                    self._find_references(
                        part_at(self.schema, target), target, resource_of(self.schema, target)
                    )
        for key, value in part.items():
            if key in DEFINITIONS:
                continue
            if key in NAMED and isinstance(value, dict):  # (a property may be named "enum")
                for name, each in value.items():
                    self._find_references(each, (*path, key, name), resource)
            elif key not in DATA:
                self._find_references(value, (*path, key), resource)


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


def resource_of(schema: Any, path: Path) -> Path:
    """Where the resource holding the part at `path` begins: its nearest "$id"."""
    begins: Path = ()
    part = schema
    for depth, step in enumerate(path):
        part = part[step]
        if isinstance(part, dict) and isinstance(part.get("$id"), str):
            begins = path[: depth + 1]
    return begins


def part_at(schema: Any, path: Path) -> Any:
    for step in path:
        schema = schema[step]
    return schema
