"""Grammars that constrain what a sequence may generate: TGI's `grammar` (a JSON schema or a
regular expression) and OpenAI's `response_format`, with llguidance (a Rust library,
torch-free, no dependencies; one of vLLM's structured-output backends).

Each step, a sequence's matcher says which tokens may come next; every other token's
score becomes -inf before one is chosen (greedy or sampled), and the chosen token moves
the matcher on. Once the grammar is complete, only the end of the sequence may come.
JSON is written compactly with one space after its separators (`{"a": 1, "b": 2}`): a
model free to put whitespace anywhere can run on with it until its token cap. A reasoning
model's chat answer thinks first, free, and is held after its `</think>` (`thinking_first`;
the grammar's "thinking", which the worker sets per prompt, says where the thinking opens).

A grammar is compiled once per model (the latest `COMPILED_KEPT` kept) and each sequence
gets a copy of its matcher. A new one compiles on a thread of its own (llguidance lets go
of the GIL): a regular expression such as `a{1000000}` takes about a second to reach
llguidance's bound, and the sequences already running go on meanwhile. A step's masks
are computed together, unpacked from bits at once, and laid on each row in place: with a
50,257-token vocabulary, 28-32 µs a row a step at 16-64 rows (CPU), against 61 µs masking
a row at a time. Worker process only.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy
import torch

from rawserve.tasks.text_generation import OPENED_IN_PROMPT, REASONING_END, REASONING_START

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # (declared in its stubs only)

log = logging.getLogger("rawserve.generation")

COMPILED_KEPT = 64
# llguidance's own bounds on a grammar's work, its errors without the parser's state (the
# message goes to the client) and nothing printed: a fault is raised, not logged
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# how JSON is laid out, unless the schema's own "x-guidance" says otherwise
JSON_LAYOUT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


# llguidance's fault for a "format" it does not know: lenient, it is a warning instead
UNKNOWN_FORMAT = "Unknown format"
# the keywords whose value is a schema, a list of schemas, or schemas by name
SUBSCHEMA = ("items", "additionalItems", "additionalProperties", "contains", "if", "then", "else")
SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# what holds an object's keys beside its own properties: closed, one would refuse the other's
COMPOSING = {"allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "dependentSchemas", "not"}


def closed_objects(schema: Any) -> Any:
    """`schema` with each object that lists its properties and leaves `additionalProperties`
    unstated taking those alone, as xgrammar (vLLM's default) and outlines (TGI's) generate
    it; llguidance follows JSON Schema, which lets other keys in: a model wrote keys of its
    own into a call's arguments, which the function called with them refuses. What states
    `additionalProperties` (or `unevaluatedProperties`) is held to what it says, an object
    that requires a key it does not list stays open, and so does a schema that composes an
    object of several (properties beside an anyOf or a $ref, an allOf of two): as written."""
    return schema if composes(schema) else closed(schema)


def composes(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    if "properties" in schema and COMPOSING & schema.keys():
        return True
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return True
    return any(composes(each) for each in subschemas(schema))


def subschemas(schema: dict[str, Any]) -> list[Any]:
    found = [schema.get(keyword) for keyword in SUBSCHEMA]
    found += [
        each for k in SUBSCHEMA_LISTS if isinstance(schema.get(k), list) for each in schema[k]
    ]
    found += [
        each
        for k in SUBSCHEMA_MAPS
        if isinstance(schema.get(k), dict)
        for each in schema[k].values()
    ]
    return [each for each in found if isinstance(each, dict)]


def closed(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return schema
    schema = dict(schema)  # (what is under "not" is left as written: closed, it would open)
    for keyword in SUBSCHEMA:
        if isinstance(schema.get(keyword), dict):
            schema[keyword] = closed(schema[keyword])
    for keyword in SUBSCHEMA_LISTS:
        if isinstance(schema.get(keyword), list):
            schema[keyword] = [closed(each) for each in schema[keyword]]
    for keyword in SUBSCHEMA_MAPS:
        if isinstance(schema.get(keyword), dict):
            schema[keyword] = {name: closed(each) for name, each in schema[keyword].items()}
    listed = schema.get("properties")
    required = schema.get("required", [])
    if (
        isinstance(listed, dict)
        and not {"additionalProperties", "unevaluatedProperties"} & schema.keys()
        and isinstance(required, list)
        and all(isinstance(key, str) and key in listed for key in required)
    ):
        schema["additionalProperties"] = False
    return schema


def grammar_text(grammar: Mapping[str, Any]) -> str:
    """llguidance's grammar for TGI's `{"type": "json" | "regex", "value": ...}`."""
    if grammar["type"] == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(grammar["value"]))
    schema = closed_objects(grammar["value"])
    return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT))


def thinking_first(text: str, opened: str, tag_tokens: Mapping[str, int]) -> str:
    """llguidance's grammar `text` with a reasoning model's thinking before what it holds,
    as vLLM holds such an answer only after its thinking: where it opens in the prompt
    (`OPENED_IN_PROMPT`), free text up to the first `</think>`; else (the model may open
    it) nothing or `<think>` and that. White space may follow the thinking. A tag is its
    text, in any tokens, or its own token (`tag_tokens`: a tag's special token, which
    llguidance does not read as the tag's text: an added one, such as Qwen3's)."""
    top = json.loads(text)
    answer, *others = top["grammars"]

    def tag(name: str) -> str:
        written = json.dumps(name)
        return f"({written} | <[{tag_tokens[name]}]>)" if name in tag_tokens else written

    thought = "thought: through WS?"
    if REASONING_END in tag_tokens:  # (its token is no text a lexeme can end with)
        thought += f" | TEXT? <[{tag_tokens[REASONING_END]}]> WS?"
    start = "thought" if opened == OPENED_IN_PROMPT else f"({tag(REASONING_START)} thought)?"
    closing = REASONING_END.replace("/", "\\/")
    lark = "\n".join(
        (
            f"start: {start} @answer",
            thought,
            f"through[lazy]: /(?s:.*){closing}/",  # (lazy: it ends at the first)
            f"TEXT: /(?s:.+)/ & ~/(?s:.*{closing}.*)/",
            "WS: /[ \\t\\r\\n]+/",
        )
    )
    thinking = {"name": "thinking", "lark_grammar": lark}
    return json.dumps({**top, "grammars": [thinking, {**answer, "name": "answer"}, *others]})


def formats_as_annotations(grammar: Mapping[str, Any]) -> str | None:
    """llguidance's grammar for a JSON schema whose "format"s it does not know are taken as
    annotations, as JSON Schema takes them (pydantic writes "binary" for bytes, "password"
    for SecretStr, "path" for Path...); the formats it knows are held to still. None where
    the schema has other faults too (the first of them is the one to report)."""
    lenient: JsonCompileOptions = {**JSON_LAYOUT, "lenient": True}
    schema = closed_objects(grammar["value"])
    text = str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=lenient))
    failed, faults = llguidance.LLMatcher.validate_grammar_with_warnings(text, limits=LIMITS)
    if failed or not all(UNKNOWN_FORMAT in warning for warning in faults):
        return None
    return text


class Grammars:
    """One model's grammars: a fresh matcher for each sequence that asks for one. Used
    from one thread (the worker's); only compiling runs on another."""

    def __init__(self, tokenizer: Any, vocabulary: int):
        self.hf_tokenizer = tokenizer
        self.vocabulary = vocabulary  # the scores' width: the model's token count
        self.tokenizer: llguidance.LLTokenizer | None = None  # made at first use
        self.compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self.compiling: dict[str, Future[llguidance.LLMatcher]] = {}
        self.thread: ThreadPoolExecutor | None = None  # made at first use

    def matcher(self, grammar: Mapping[str, Any]) -> llguidance.LLMatcher:
        """A matcher at the start of `grammar`, now; ValueError for one that cannot be used."""
        return self.pending(grammar).matcher()

    def pending(self, grammar: Mapping[str, Any]) -> PendingMatcher:
        """A matcher at the start of `grammar` once it is compiled: one seen before at once,
        a new one on the compiling thread (sequences asking for it together share it)."""
        key = json.dumps(grammar, sort_keys=True)
        compiling = self.compiling.get(key)
        # the table holds the compilations under way; one done is its askers' to keep (a
        # grammar whose askers all left is not held here for nobody)
        self.compiling = {named: made for named, made in self.compiling.items() if not made.done()}
        if compiling is None:
            compiling = Future()
            if key in self.compiled:
                compiling.set_result(self.compiled[key])
            else:
                if self.thread is None:
                    self.thread = ThreadPoolExecutor(1, thread_name_prefix="grammars")
                compiling = self.compiling[key] = self.thread.submit(self._compile, grammar)
        return PendingMatcher(self, key, compiling)

    def keep(self, key: str, compiling: Future[llguidance.LLMatcher]) -> llguidance.LLMatcher:
        """A compiled grammar's matcher, kept for the next sequence that asks (ValueError
        for one that cannot be used, then asked again afresh)."""
        self.compiling.pop(key, None)
        pristine = compiling.result()
        self.compiled[key] = pristine
        self.compiled.move_to_end(key)
        while len(self.compiled) > COMPILED_KEPT:
            self.compiled.popitem(last=False)
        return pristine

    def _compile(self, grammar: Mapping[str, Any]) -> llguidance.LLMatcher:
        pristine = self._matcher(self._held(grammar_text(grammar), grammar))
        # a format it does not know, alone, is an annotation (else the first fault is told)
        annotated = None
        if grammar["type"] == "json" and pristine.is_error() and UNKNOWN_FORMAT in fault(pristine):
            annotated = formats_as_annotations(grammar)
        if annotated is not None:
            pristine = self._matcher(self._held(annotated, grammar))
        if pristine.is_error():
            raise ValueError(f"the grammar cannot be used: {fault(pristine)}")
        return pristine

    def _held(self, text: str, grammar: Mapping[str, Any]) -> str:
        """The grammar `text`, after the thinking where `grammar` says it may come first
        (its "thinking": where it opens, the worker's per prompt)."""
        if not grammar.get("thinking"):
            return text
        tokenizer = self._tokenizer()
        ids = self.hf_tokenizer.get_vocab()
        tags = [tag for tag in (REASONING_START, REASONING_END) if tag in ids]
        special = {tag: ids[tag] for tag in tags if tokenizer.is_special_token(ids[tag])}
        return thinking_first(text, grammar["thinking"], special)

    def _matcher(self, text: str) -> llguidance.LLMatcher:
        pristine = llguidance.LLMatcher(self._tokenizer(), text, log_level=0, limits=LIMITS)
        pristine.compute_bitmask()  # (some faults show only once a first mask is asked)
        return pristine

    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self.tokenizer is None:
            try:
                self.tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocabulary
                )
            except ValueError as exc:  # a slow tokenizer, or a decoder it cannot read
                # the library's own words name its internals ("can't determine decoder
                # type: None"): the operator's log has them, the client what they mean
                log.warning("grammars: the tokenizer cannot be read: %s", exc)
                raise ValueError(
                    "this model's tokenizer cannot follow a grammar: a grammar reads each "
                    "token's bytes from a fast tokenizer's decoder (byte-level BPE, byte "
                    "fallback), and this tokenizer's cannot be read"
                ) from None
        return self.tokenizer


class PendingMatcher:
    """A sequence's matcher while its grammar compiles."""

    def __init__(self, grammars: Grammars, key: str, compiling: Future[llguidance.LLMatcher]):
        self.grammars = grammars
        self.key = key
        self.compiling = compiling

    @property
    def ready(self) -> bool:
        return self.compiling.done()

    def matcher(self) -> llguidance.LLMatcher:
        """The sequence's own matcher (waiting for its grammar if it is not ready); ValueError
        for a grammar that cannot be used."""
        return self.grammars.keep(self.key, self.compiling).deep_copy()


def fault(matcher: llguidance.LLMatcher) -> str:
    """A matcher's error, on one line (llguidance's message points at the fault in lines)."""
    return " ".join(matcher.get_error().replace("<non-verbose/>", "").split())


def constrain(
    scores: torch.Tensor, rows: list[tuple[int, llguidance.LLMatcher]]
) -> list[tuple[int, str]]:
    """Rows of scores, in place: -inf for every token a row's grammar does not allow next
    (`rows`: each row's index in `scores` and its matcher), the masks computed together
    on llguidance's threads. Returns the rows whose grammar cannot go on, each with why
    (its matcher failed, past one of llguidance's limits say, or it allows no token of
    this model's): their scores are left as they are, and the caller ends them."""
    stuck = [(index, f"the grammar failed: {fault(m)}") for index, m in rows if m.is_error()]
    rows = [(index, matcher) for index, matcher in rows if not matcher.is_error()]
    if not rows:
        return stuck
    width = scores.shape[-1]
    bitmask = llguidance.numpy.allocate_token_bitmask(len(rows), width)
    targets = [(matcher, place) for place, (_, matcher) in enumerate(rows)]
    llguidance.numpy.fill_next_token_bitmask_par(executor(), targets, bitmask)
    bits = numpy.unpackbits(bitmask.view(numpy.uint8), axis=1, bitorder="little")
    allowed = bits[:, :width].view(numpy.bool_)
    way_on = numpy.any(allowed, axis=1).tolist()  # (else nothing would be left)
    blocked = torch.from_numpy(~allowed).to(scores.device)
    for place, (index, _) in enumerate(rows):
        if way_on[place]:
            scores[index].masked_fill_(blocked[place], float("-inf"))
        else:
            stuck.append((index, "the grammar allows no token this model can write next"))
    return stuck


_executor: llguidance.LLExecutor | None = None


def executor() -> llguidance.LLExecutor:
    """The threads that compute masks, made at first use (llguidance's default count: 80 %
    of the cores, at most 32)."""
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    return _executor
