"""How deep a JSON schema's references make llguidance nest: the longest chain of
references that meets no part twice, each part's own levels of subschemas summed
(`longest_chain`). llguidance compiles a reference's target within its referrer's the
first time it meets it, and refers to it after; a chain of 1,000 overflowed its stack
(rawserve.worker.endless_schemas refuses a schema past MOST_NESTED_LEVELS).

Within a cycle (parts each reached from each other) such a chain holds at most all its
parts, or, where a few parts ("hubs", such as the one union every node type of
pydantic's refers back to) take every cycle through them, each hub once and a chain
among the others between each two. Walks of their own, not Python's recursion: a chain
of references runs thousands deep.
"""

from __future__ import annotations

from collections.abc import Callable

from rawserve.worker.schema_references import Path

# The most levels of subschemas followed through references, each part's own levels
# summed along a chain of them that meets no part twice (`longest_chain`): pydantic's nest
# tens; llguidance compiles a reference's target within its referrer's, and overflowed its
# stack (SIGSEGV) at 1,000 references of two levels each, and at 250 of twenty (600 of
# two, 120 of eleven compiled; a union of 1,000 node types each referring back to it, in
# 0.2 s).
MOST_NESTED_LEVELS = 512
# how many times the parts most referred to and referring are taken out of a cycle, each
# time from each cycle left, to find its hubs (`cycle_span`): pydantic's shapes have one
# or two, a syntax tree's one a union (five unions of 40 node types took five); a cycle
# that needs more is counted whole. The work stays within BUDGET: 0.2 s at most measured
# (nine unions of 370 types, 10,000 references), as with four
HUB_ROUNDS = 8
MOST_HUB_WORK = 10_000  # references within a cycle: past it, not looked into for hubs


def longest_chain(
    refers: dict[Path, list[Path]], levels: dict[Path, int], spend: Callable[[], None]
) -> int:
    """The most levels in a chain of references from the root (`()`) through `refers`,
    each part's `levels` summed. llguidance compiles a reference's target within its
    referrer's the first time it meets it, and never again: what it nests is a chain of
    references that meets no part twice. Within a cycle (several parts each reached from
    each other) such a chain is bounded by `cycle_span`; the cycles are then summed along
    the references between them. `spend`: called for each step of the work."""
    nodes = [()] + [node for node in refers if node != ()]
    cycles = components(nodes, refers, spend)
    cycle_of = {node: index for index, members in enumerate(cycles) for node in members}
    spans = [cycle_span(members, refers, levels, spend) for members in cycles]
    longest = [0] * len(cycles)
    for here, members in enumerate(cycles):  # (each after those that refer to it)
        longest[here] = max(longest[here], spans[here])
        for node in members:
            for target in refers.get(node, []):
                spend()
                there = cycle_of[target]
                if there != here:
                    longest[there] = max(longest[there], longest[here] + spans[there])
    return max(longest)


def components(
    nodes: list[Path], refers: dict[Path, list[Path]], spend: Callable[[], None]
) -> list[list[Path]]:
    """The cycles of the graph of `nodes` and the references among them (`refers`, those to
    other nodes left out), each a list of its parts (a part in no cycle alone), in an order
    that puts each after those that refer to it: Kosaraju's two passes, walks of their own
    (not Python's recursion: a chain of references runs thousands deep)."""
    among = set(nodes)
    order: list[Path] = []
    seen: set[Path] = set()
    for first in nodes:  # the first pass: the parts by when their walk ended
        if first in seen:
            continue
        seen.add(first)
        stack: list[tuple[Path, int]] = [(first, 0)]
        while stack:
            node, next_edge = stack.pop()
            edges = refers.get(node, [])
            spend()
            if next_edge < len(edges):
                stack.append((node, next_edge + 1))
                target = edges[next_edge]
                if target in among and target not in seen:
                    seen.add(target)
                    stack.append((target, 0))
            else:
                order.append(node)
    referred: dict[Path, list[Path]] = {node: [] for node in nodes}
    for node in nodes:
        for target in refers.get(node, []):
            if target in among:
                referred[target].append(node)
    cycle_of: dict[Path, int] = {}
    cycles: list[list[Path]] = []
    for start in reversed(order):  # the second pass, on the references reversed
        if start in cycle_of:
            continue
        cycle_of[start] = len(cycles)
        members, pending = [start], [start]
        while pending:
            for source in referred[pending.pop()]:
                spend()
                if source not in cycle_of:
                    cycle_of[source] = len(cycles)
                    members.append(source)
                    pending.append(source)
        cycles.append(members)
    return cycles


def cycle_span(
    members: list[Path],
    refers: dict[Path, list[Path]],
    levels: dict[Path, int],
    spend: Callable[[], None],
) -> int:
    """The most levels a chain of references within the cycle `members` may nest, meeting
    no part twice: at most all of them; and where some parts ("hubs") take every cycle
    through them, as the one union definition every node type of pydantic's refers back
    to, the hubs once each, and a chain among the others between each two of them (the
    others, the hubs left out, hold no cycle: their longest chain is summed directly).
    The hubs are found greedily, the part most referred to and referring taken first."""
    total = sum(levels[node] for node in members)
    edges = sum(len(refers.get(node, [])) for node in members)
    if len(members) == 1 or total <= MOST_NESTED_LEVELS or edges > MOST_HUB_WORK:
        return total  # (a bound within the most nested decides nothing more)
    enough = min(total, MOST_NESTED_LEVELS + 1)  # (a bound past this decides nothing)
    left = set(members)
    hubs: list[Path] = []
    for rounds in range(HUB_ROUNDS + 1):
        inner = {
            node: [t for t in refers.get(node, []) if t in left and t != node] for node in left
        }
        cycles = [cycle for cycle in components(list(left), inner, spend) if len(cycle) > 1]
        if not cycles:
            break
        if rounds == HUB_ROUNDS or sum(levels[hub] for hub in hubs) >= enough:
            return total  # (no hubs as few as that)
        for cycle in cycles:
            hub = most_connected(cycle, inner, spend)
            left.discard(hub)
            hubs.append(hub)
    # the others hold no cycle now: their longest chain, each after those that refer to it
    chain = 0
    longest = dict.fromkeys(left, 0)
    for (node,) in components(list(left), inner, spend):
        longest[node] += levels[node]
        chain = max(chain, longest[node])
        for target in inner[node]:
            spend()
            longest[target] = max(longest[target], longest[node])
    return min(total, sum(levels[hub] for hub in hubs) + (len(hubs) + 1) * chain)


def most_connected(
    cycle: list[Path], inner: dict[Path, list[Path]], spend: Callable[[], None]
) -> Path:
    """The part of `cycle` most referred to and referring within it."""
    within = set(cycle)
    into = dict.fromkeys(cycle, 0)
    for node in cycle:
        for target in inner[node]:
            spend()
            if target in within:
                into[target] += 1
    return max(cycle, key=lambda node: into[node] * sum(t in within for t in inner[node]))
