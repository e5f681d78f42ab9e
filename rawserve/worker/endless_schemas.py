"""JSON schemas that a grammar cannot hold an answer to: one with a part whose every value
must hold another of itself (a required property, or a least number of items, that refers
back to it), so that no JSON of finite length satisfies it; and one whose references
nest deeper than llguidance can follow.

llguidance compiles the first kind and lets a model begin it; the fault shows only steps
later, when its parser runs out of room ("a step of the grammar needs more work than
allowed"), after a stream has sent its first tokens with a 200. The second kind took
the worker down: llguidance compiles a reference's target within its referrer's, and a
chain of 1,000 (a 90 KB schema) overflowed its stack (SIGSEGV; 600 compiled). Found
here, before the first token, each is refused with its status.

The parts that may be endless are those a `$ref` names (only a reference makes a schema
infinite); each is judged as a context-free grammar's productive symbols are, from the
ones seen to end upwards, a part judged again once one it refers to is seen to end. A part
is judged with what a value of it is held to besides: its allOf's parts and its $ref's
target, and theirs (the keys they require, their properties' schemas, the least number of
properties or items), as it is compiled (`rawserve.worker.schema_rewrites.compilable`: objects
closed). A reference leads by a JSON pointer, an anchor (`$anchor`, an older draft's
`"$id": "#name"`) or a URI, resolved against the `$id`s of the resources it is in.

The nesting is bounded by the longest chain of references that meets no part twice
(rawserve.worker.schema_chains); references are resolved as
rawserve.worker.schema_references says.

A reference the judgement cannot follow within the schema is refused: llguidance may
follow one it does not (a chain of 1,000 through URIs written another way took the worker
down), and fetches no document elsewhere.

Not judged (llguidance lets a model begin them, and fails steps later): a required
property held by a `patternProperties` pattern that cannot be read, or matched within
PATTERN_SECONDS (the `regex` module's: Python's `re` backtracks without bound);
parts that each end alone but not together (an allOf of two schemas of a property that
no value satisfies both of). Keywords llguidance refuses in any case
(`contains`, `dependentRequired`, `dependentSchemas`, `if`...) need no judging.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import regex

from rawserve.tasks.text_generation import FORMAT_RESOURCE, TOOL_RESOURCE
from rawserve.worker.schema_chains import MOST_NESTED_LEVELS, longest_chain
from rawserve.worker.schema_references import (
    DEFAULT_BASE,
    Path,
    anchors_of,
    begins_resource,
    identifying,
    joined,
    part_at,
    resource_of,
    within,
    without_fragment,
)

# The keywords whose values are schemas, as JSON Schema has them: one, a list of them, or
# them by name. Only these are walked (a client's own keyword holds data: 200,000 zeros
# under one spent the judgement's budget, and a chain of references went unjudged); the
# parts under "$defs" are reached by reference alone.
ONE = frozenset(
    {
        "items",
        "additionalItems",
        "additionalProperties",
        "contains",
        "if",
        "then",
        "else",
        "not",
        "propertyNames",
        "unevaluatedItems",
        "unevaluatedProperties",
    }
)
LISTED = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
NAMED = frozenset({"properties", "patternProperties", "dependentSchemas"})
DEFINITIONS = frozenset({"$defs", "definitions"})
# what a part beside a $ref may add to its target that can leave no value of finite length
HOLDING = frozenset({"allOf", "type", "required", "minProperties", "minItems", "properties"})
# the work the judgement may take (parts looked at), about a second at most: a schema
# past it is refused, as too large to judge (not judged, a deep one took the worker down)
BUDGET = 200_000
PATTERN_SECONDS = 0.25  # the most a judgement spends matching patterns to names


class OverBudget(Exception):
    pass


@dataclass(frozen=True)
class Fault:
    """What a schema's grammar cannot hold, in words a client can act on."""

    words: str


def schema_fault(schema: Any) -> Fault | None:
    """What makes `schema` one a grammar cannot hold (an endless part, references nested
    too deep, too much to judge); None where nothing does."""
    try:
        judgement = Judgement(schema)
        return judgement.astray() or judgement.too_deep() or judgement.endless()
    except OverBudget:
        return Fault(
            f"the schema is too large to judge: its references reach more than {BUDGET:,} "
            "parts to look at"
        )


class Judgement:
    def __init__(self, schema: Any) -> None:
        self.schema = schema
        self.targets: dict[int, Path] = {}  # each "$ref"-holding part's target, by its id
        self.written: dict[Path, str] = {}  # each target's reference as the schema writes it
        self.resources: dict[Path, Any] = {}  # each target's resource's "$id" (None: none)
        self.refers: dict[Path, list[Path]] = {(): []}  # the targets a part refers to
        self.levels: dict[Path, int] = {(): 1}  # ... and its own levels of subschemas
        self.left = BUDGET
        # a client's patterns are matched against property names within PATTERN_SECONDS
        # of the first match (Python's `re` backtracked: `^(a+)+$` against 30 a's and a
        # "!" took minutes); from then, not from the start (a schema padded to take that
        # long to walk had its endless part go unjudged)
        self.patterns_until: float | None = None
        self.keyword = identifying(schema)  # ("$id", or draft 4's "id")
        self.merging: set[int] = set()  # the parts being judged with what they are held to
        # the first reference an answer may reach that leads nowhere known, and its base
        self.unresolved: tuple[str, str] | None = None
        self._index()
        self._find_references()

    def endless(self) -> Fault | None:
        ends = dict.fromkeys(self.written, False)
        parts = {target: part_at(self.schema, target) for target in self.written}
        referrers: dict[Path, list[Path]] = {}
        for node, targets in self.refers.items():
            for target in targets:
                referrers.setdefault(target, []).append(node)
        # a worklist: a part is judged again only once a part it refers to is seen to end
        # (judging them all again until nothing changed took a pass a part of a chain)
        waiting = list(self.written)  # (the deepest found, last, judged first)
        queued = set(waiting)
        while waiting:
            target = waiting.pop()
            queued.discard(target)
            if ends[target] or not self.can_end(parts[target], ends):
                continue
            ends[target] = True
            for node in referrers.get(target, []):
                if node in ends and not ends[node] and node not in queued:
                    waiting.append(node)
                    queued.add(node)
        endless = [target for target, ended in ends.items() if not ended]
        if not endless:
            return None
        target = min(endless, key=len)  # the outermost
        return Fault(
            f"no answer can complete it: {self.named(target)} has no value of finite length, "
            "as each value of it must hold another (a required property, a least number of "
            "items, or a $ref alone leads back to it)"
        )

    def astray(self) -> Fault | None:
        """A reference the judgement cannot follow: refused, as what was not judged may be
        one llguidance follows (a chain of 1,000 through URIs it normalises took the worker
        down) or one it refuses (a document elsewhere, never fetched)."""
        if self.unresolved is None:
            return None
        reference, base = self.unresolved
        if reference.startswith("#") and any(name == reference[1:] for _, name in self.doubled):
            return Fault(
                f"{self.whose(base)} refers to {reference!r}, an anchor it gives two parts: "
                "name each part once"
            )
        return Fault(
            f"{self.whose(base)} refers to {reference!r}, outside it: a $ref is followed only "
            "within the schema (a JSON pointer, an anchor, or an $id it gives)"
        )

    def too_deep(self) -> Fault | None:
        deepest = longest_chain(self.refers, self.levels, self._spend)
        if deepest <= MOST_NESTED_LEVELS:
            return None
        return Fault(
            f"its subschemas nest {deepest:,} levels deep through its references (a chain "
            f"of $refs, each within the part before), where at most {MOST_NESTED_LEVELS} "
            "are followed"
        )

    def named(self, target: Path) -> str:
        """The part at `target` as a client names it: its reference, and whose it is."""
        reference, resource = self.written[target], self.resources.get(target)
        whose = self.whose(resource)
        return whose if reference == "#" else f'"{reference}" in {whose}'

    @staticmethod
    def whose(resource: Any) -> str:
        """The schema a resource's `$id` names, as a client names it."""
        if isinstance(resource, str) and resource.startswith(TOOL_RESOURCE):
            return f"the parameters' schema of function {resource.removeprefix(TOOL_RESOURCE)!r}"
        if resource == FORMAT_RESOURCE:
            return "the response_format's schema"
        return "the schema"

    def can_end(self, part: Any, ends: dict[Path, bool]) -> bool:
        """Whether some JSON of finite length satisfies `part`, the references' targets
        judged as `ends` says (not yet known to end: taken as endless)."""
        self._spend()
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
        if target is not None and not HOLDING & part.keys():
            return True  # (its target, seen to end, and nothing more)
        if id(part) in self.merging:
            return True  # (within its own judgement: not judged twice over)
        # what else it is held to: its allOf's parts and its $ref's target (and theirs), an
        # object's required keys and its properties' schemas in any of them
        self.merging.add(id(part))
        try:
            held = self.conjuncts(part)
            return self._held_can_end(held, ends)
        finally:
            self.merging.discard(id(part))

    def _held_can_end(self, held: list[dict[str, Any]], ends: dict[Path, bool]) -> bool:
        kinds: set[str] | None = None
        for each in held:
            types = each.get("type")
            if isinstance(types, str | list):
                stated = {types} if isinstance(types, str) else set(map(str, types))
                if "number" in stated:  # (an integer is a number)
                    stated.add("integer")
                kinds = stated if kinds is None else kinds & stated
        if not kinds:
            # any type: a number would do; none at all (an integer held to be a string):
            # no value, endless or not, which is llguidance's to refuse
            return True
        return any(self._type_can_end(kind, held, ends) for kind in kinds)

    def conjuncts(self, part: dict[str, Any]) -> list[dict[str, Any]]:
        """`part` and the schemas a value of it is held to besides: its allOf's parts, its
        $ref's target, and theirs in turn."""
        found: list[dict[str, Any]] = []
        seen: set[int] = set()
        pending: list[Any] = [part]
        while pending:
            each = pending.pop()
            if not isinstance(each, dict) or id(each) in seen:
                continue
            self._spend()
            seen.add(id(each))
            found.append(each)
            every = each.get("allOf")
            if isinstance(every, list):
                pending.extend(every)
            target = self.targets.get(id(each))
            if target is not None:
                pending.append(part_at(self.schema, target))
        return found

    def _any_ends(self, branches: list[Any], ends: dict[Path, bool]) -> bool:
        return any(self.can_end(each, ends) for each in branches)

    def _type_can_end(self, kind: str, held: list[dict[str, Any]], ends: dict[Path, bool]) -> bool:
        if kind == "object":
            required = {
                name
                for each in held
                if isinstance(each.get("required"), list)
                for name in each["required"]
                if isinstance(name, str)
            }
            if not all(self._property_can_end(name, held, ends) for name in required):
                return False
            least = max((count(each.get("minProperties")) for each in held), default=0)
            if least <= len(required):
                return True
            if any(self._open(each, ends) for each in held):
                return True  # (keys of its own: as many as it needs)
            listed = {
                name
                for each in held
                if isinstance(each.get("properties"), dict)
                for name in each["properties"]
            }
            ending = [name for name in listed if self._property_can_end(name, held, ends)]
            return len(ending) >= least
        if kind == "array":
            least = max((count(each.get("minItems")) for each in held), default=0)
            if least <= 0:
                return True
            for each in held:
                prefix = each.get("prefixItems")
                items = each.get("items", True)
                if isinstance(items, list):  # (the older form of prefixItems)
                    prefix, items = items, each.get("additionalItems", True)
                prefix = prefix if isinstance(prefix, list) else []
                needed = prefix[:least] + ([items] if least > len(prefix) else [])
                if not all(self.can_end(item, ends) for item in needed):
                    return False
        return True

    def _property_can_end(
        self, name: str, held: list[dict[str, Any]], ends: dict[Path, bool]
    ) -> bool:
        if self.patterns_until is None and any("patternProperties" in each for each in held):
            self.patterns_until = time.monotonic() + PATTERN_SECONDS
        until = self.patterns_until or 0.0
        return all(
            self.can_end(schema, ends)
            for each in held
            for schema in property_schemas(each, name, until)
        )

    def _open(self, part: dict[str, Any], ends: dict[Path, bool]) -> bool:
        """Whether an object of `part` may hold keys it does not list (patterns' taken as
        letting some in: not judged)."""
        if part.get("patternProperties"):
            return True
        extra = part.get("additionalProperties", True)
        return extra is not False and self.can_end(extra, ends)

    def _find_references(self) -> None:
        """Each local reference an answer may reach, from the root through the parts
        they lead to (a part only named in "$defs" is none of them), with which targets
        each part (the root, or a target) refers to directly, and its levels. A walk of
        its own, not Python's recursion: a chain of references runs thousands deep."""
        # (a part, where it is, its level within the root or target it is in, that root
        # or target, and its resource's path and base URI)
        root_base = self.bases[()]
        waiting: list[tuple[Any, Path, int, Path, Path, str]] = [
            (self.schema, (), 0, (), (), root_base)
        ]
        while waiting:
            part, path, level, node, resource, base = waiting.pop()
            self._spend()
            if not isinstance(part, dict):
                continue
            self.levels[node] = max(self.levels[node], level + 1)
            if begins_resource(part, self.keyword):
                resource, base = path, self.bases.get(path, base)
            reference = part.get("$ref")
            if isinstance(reference, str):
                target = self.resolve(base, resource, reference)
                if target is None and self.unresolved is None:
                    self.unresolved = (reference, base)
                if target is not None:
                    self.targets[id(part)] = target
                    self.refers[node].append(target)
                    if target not in self.written:
                        self.written[target] = reference
                        self.refers[target], self.levels[target] = [], 1
                        begins, begins_id = resource_of(self.schema, target, self.keyword)
                        self.resources[target] = begins_id
                        at = part_at(self.schema, target)
                        begins_base = self.bases.get(begins, root_base)
                        waiting.append((at, target, 0, target, begins, begins_base))
            below = level + 1
            for each, at_path in children(part, path, NAMED):
                waiting.append((each, at_path, below, node, resource, base))

    def _index(self) -> None:
        """Where each resource (`$id`, resolved against the one it is in) and each anchor
        (`$anchor`, an older draft's `"$id": "#name"`) is, walking every subschema, those
        under "$defs" too."""
        root_base = DEFAULT_BASE
        root = self.schema
        if isinstance(root, dict) and begins_resource(root, self.keyword):  # ("...root.json#")
            root_base = without_fragment(joined(DEFAULT_BASE, root[self.keyword]))
        self.bases: dict[Path, str] = {(): root_base}  # each resource's base URI
        self.uris: dict[str, Path] = {root_base: ()}
        self.anchors: dict[tuple[str, str], Path] = {}
        self.doubled: set[tuple[str, str]] = set()  # anchors given to two parts
        waiting: list[tuple[Any, Path, str]] = [(self.schema, (), root_base)]
        while waiting:
            part, path, base = waiting.pop()
            self._spend()
            if not isinstance(part, dict):
                continue
            if path and begins_resource(part, self.keyword):
                base = without_fragment(joined(base, part[self.keyword]))
                self.bases[path] = base
                self.uris.setdefault(base, path)
            for name in anchors_of(part):
                if self.anchors.setdefault((base, name), path) != path:
                    self.doubled.add((base, name))
            waiting += [(each, at, base) for each, at in children(part, path, NAMED | DEFINITIONS)]

    def resolve(self, base: str, resource: Path, reference: str) -> Path | None:
        """Where `reference`, met within the resource at `resource` (its base URI `base`),
        leads: a JSON pointer or an anchor within it, or within another resource by its
        URI; None where it leads nowhere known (not judged)."""
        if reference.startswith("#"):
            uri, fragment, at = base, reference[1:], resource
        else:
            uri, _, fragment = joined(base, reference).partition("#")
            if (found := self.uris.get(uri)) is None:
                return None
            at = found
        if not fragment or fragment.startswith("/"):
            return within(self.schema, at, "#" + fragment)
        if (uri, unquote(fragment)) in self.doubled:
            # (one as `$anchor`, one as `"$id": "#name"`: llguidance took the other one,
            # by its draft, and a chain of 1,000 behind it took the worker down)
            return None
        return self.anchors.get((uri, unquote(fragment)))

    def _spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise OverBudget


def children(part: dict[str, Any], path: Path, named: frozenset[str]) -> Iterator[tuple[Any, Path]]:
    """The subschemas `part` (at `path`) holds under JSON Schema's keywords, each with
    where it lies: one (`ONE`), listed (`LISTED`), or by name (`named`)."""
    for key, value in part.items():
        if key in ONE and isinstance(value, dict):
            yield value, (*path, key)
        elif key in LISTED and isinstance(value, list):
            yield from ((each, (*path, key, index)) for index, each in enumerate(value))
        elif key in named and isinstance(value, dict):
            yield from ((each, (*path, key, name)) for name, each in value.items())


def property_schemas(part: dict[str, Any], name: str, until: float) -> list[Any]:
    """The schemas a property `name` of an object `part` is held to: its own, else those
    of the patterns it matches, else the additional properties' (a name no pattern can be
    read for, or matched by the monotonic time `until`, is not judged)."""
    listed = part.get("properties")
    if isinstance(listed, dict) and name in listed:
        return [listed[name]]
    patterns = part.get("patternProperties")
    matched = []
    if isinstance(patterns, dict):
        for pattern, each in patterns.items():
            left = until - time.monotonic()
            try:
                if left <= 0:
                    return []
                if regex.search(pattern, name, timeout=left):
                    matched.append(each)
            except (regex.error, TypeError, TimeoutError):  # (not read, or not in time)
                return []
    if matched:
        return matched
    extra = part.get("additionalProperties", True)
    return [extra] if isinstance(extra, dict) else []


def count(value: Any) -> int:
    """A count keyword's value (`minItems`, `minProperties`) as a number, 0 where it is
    not one (an integral float, `1.0`, is that integer, as JSON takes it)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0
    return int(value) if value == value and abs(value) != float("inf") else 0
