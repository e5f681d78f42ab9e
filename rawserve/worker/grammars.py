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
gets a copy of its matcher, and the mask at its start, computed once when it compiled: a
copy computes its own anew (44 ms on a CPU for a schema at llguidance's bound, which 32
choices of one request paid inline, in the step every sequence waits for). A grammar
that fails a sequence is dropped from those kept: its lexer, grown to llguidance's bound
on the way, held about 100 MB. A new one compiles on a thread of its own (llguidance lets go
of the GIL): a regular expression such as `a{1000000}` takes about a second to reach
llguidance's bound, and the sequences already running go on meanwhile. A step's masks
are computed together, unpacked from bits at once, and laid on each row in place: with a
50,257-token vocabulary, 28-32 µs a row a step at 16-64 rows (CPU), against 61 µs masking
a row at a time. Worker process only.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy
import torch

from rawserve.tasks.text_generation import (
    FORMAT_RESOURCE,
    GRAMMAR_FAILED,
    GRAMMAR_REFUSED,
    OPENED_IN_PROMPT,
    REASONING_END,
    REASONING_START,
    TOOL_RESOURCE,
)
from rawserve.worker.endless_schemas import schema_fault
from rawserve.worker.schema_rewrites import compilable

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # (declared in its stubs only)

log = logging.getLogger("rawserve.generation")

COMPILED_KEPT = 16  # a grammar grown near llguidance's bounds can hold ~100 MB
# A step's masks past which the rows are timed alone, as they are computed: a row over it
# in this many steps ends (its item fails). Every row of a step waits for its masks, and
# llguidance's bounds leave some grammars tens of ms a step (a 130-byte `a{150000}` held
# every other sequence of its worker at 25-100 times its time for as long as it ran); a
# JSON schema's mask takes well under a millisecond. (Rows each under it, many of them,
# still add up: counted by request, a client's own X-Request-Id would have named whose.)
MASK_SECONDS = 0.02
SLOW_STEPS_ALLOWED = 3
# llguidance's own bounds on a grammar's work, its errors without the parser's state (the
# message goes to the client) and nothing printed: a fault is raised, not logged
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# how JSON is laid out (a schema's own "x-guidance" is an annotation: a client's JSON is JSON)
JSON_LAYOUT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    # held as anyOf, as xgrammar (vLLM's) holds it: pydantic writes oneOf for its
    # discriminated unions, whose branches their discriminator keeps apart
    "coerce_one_of": True,
}
# llguidance's words for faults a client meets, and what they mean to one (the library's
# own go to the debug log)
FAULT_WORDS = (
    (
        re.compile(r"NoExtensionBias"),
        "the grammar allows no text: a schema that refers to itself with nothing else to "
        "generate, or a pattern that matches nothing",
    ),
    # a TGI or vLLM regex the library cannot read: its reason, not its own grammar's text
    # and place ("at 1(8): invalid regex ... 1 | start: /(ab/ ^")
    (re.compile(r"invalid regex .*? \(in regex\): (.*) \d+ \| start: "), r"\1"),
    # a $ref (or $schema) naming a document elsewhere: never fetched, in the library's words
    (
        re.compile(r"Resource '(.*)' is not present in a registry and retrieving it failed"),
        r"the schema refers to '\1', outside it: a $ref is followed only within the schema",
    ),
    (re.compile(r"Unimplemented keys: (\[.*?\])"), lambda found: unheld_keywords(found[1])),
    (
        re.compile(r"Too many items \(limit"),
        "a step of the grammar needs more work than allowed: no answer may complete it (an "
        "object that must always hold another), or it matches text a byte at a time",
    ),
    (
        re.compile(r"too many expressions constructed"),
        "the grammar grew past the bound on its size (a pattern repeated a great many times)",
    ),
    (re.compile(r"Expected f64 for '([^']*)', got null"), r"'\1' is not a finite number"),
    (
        re.compile(r"Value is not JSON serializable: (\S+)"),
        r"the schema holds a number past 64 bits: \1",
    ),
    # a number's bounds are written out as a regular expression of its digits, which
    # the library makes in 64 bits, and not of every range within them (an integer's
    # minimum of 1e18 is refused, its maximum not)
    (
        re.compile(r"Failed to generate regex for (?:float|integer) range: min=(\S+), max=(\S+)"),
        lambda found: (
            "a number's bounds are more than a grammar can hold ("
            f"{bounds_said(found[1], found[2])}): bound it nearer 0, or leave the bound out"
        ),
    ),
)


def bounds_said(least: str, most: str) -> str:
    """llguidance's `Some(-1e308)`, `None` of a range as its bounds (an exclusive one is
    said as the library holds it; an integer's past 64 bits as the most it holds)."""
    said = [
        f"{name} {bound[5:-1]}"
        for name, bound in (("lower bound", least), ("upper bound", most))
        if bound.startswith("Some(")
    ]
    return ", ".join(said)


# the resources rawserve gives a tool's parameters and a response_format beside tools, as a
# message names a place in them, and llguidance's name for a schema that gives no `$id`
OUR_RESOURCES = re.compile(
    f"(?:{re.escape(TOOL_RESOURCE)}(?P<function>[A-Za-z0-9_-]+)|{re.escape(FORMAT_RESOURCE)})"
    r"(?P<fragment>#[^\s'\"]*)?"
)
PLACEHOLDER = "json-schema:///"


# llguidance's faults for what a schema may say that a grammar leaves be: a "format" it
# does not know (lenient, a warning instead), and `uniqueItems` (pydantic writes it for a
# set, which takes a repeated item as one)
UNKNOWN_FORMAT = "Unknown format"
UNIQUE_ITEMS = 'Unimplemented keys: ["uniqueItems"]'
ANNOTATIONS = (UNKNOWN_FORMAT, UNIQUE_ITEMS)


def grammar_text(grammar: Mapping[str, Any]) -> str:
    """llguidance's grammar for TGI's `{"type": "json" | "regex", "value": ...}`."""
    if grammar["type"] == "regex":
        pattern = grammar["value"]
        if (len(pattern) - len(pattern.rstrip("\\"))) % 2:  # (llguidance drops it)
            raise ValueError("regex parse error: the pattern ends in a lone backslash")
        refuse_verbose_lines(pattern)
        return str(llguidance.LLMatcher.grammar_from_regex(ascii_classes(pattern)))
    schema = compilable(grammar["value"])
    return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT))


# \d, \w and \s as TGI's outlines, vLLM's xgrammar and a JSON schema's pattern read them:
# ASCII (llguidance's regex reads Unicode's: \d{4} wrote Arabic-Indic digits, which int()
# reads and JavaScript does not). Each is a class, valid inside another class too (a
# nested class, as llguidance's regex syntax takes it); a space written \x20, which a
# verbose pattern's (?x) does not drop.
ASCII_CLASSES = {
    "d": "[0-9]",
    "D": "[^0-9]",
    "w": "[0-9A-Za-z_]",
    "W": "[^0-9A-Za-z_]",
    "s": "[\\t\\n\\x0B\\f\\r\\x20]",
    "S": "[^\\t\\n\\x0B\\f\\r\\x20]",
}


def ascii_classes(pattern: str) -> str:
    """`pattern` with its \\d, \\w and \\s (and their complements) read as ASCII; any
    other escape (`\\\\d`, an escaped backslash and a d) as written. Each is kept from a
    (?i) flag, which folds k and s to the Kelvin sign and the long s: alone, in a
    (?-i:...) of its own; within a class, the whole class (its other letters then match
    as written)."""
    written: list[str] = []
    depth = 0  # classes open at this point (nested ones too)
    opened = 0  # where in `written` the outermost class opened
    lettered = False  # a \w or \W within it
    at = 0
    while at < len(pattern):
        char = pattern[at]
        if char == "\\" and at + 1 < len(pattern):
            escape = pattern[at : at + 2]
            ascii_class = ASCII_CLASSES.get(pattern[at + 1])
            ranged = depth and pattern[at + 2 : at + 3] == "-" and pattern[at + 3 : at + 4] != "]"
            if ascii_class is None or ranged:  # (a class as a range's start: refused as is)
                written.append(escape)
            elif depth:
                written.append(ascii_class)
                lettered = lettered or pattern[at + 1] in "wW"
            else:
                written.append(f"(?-i:{ascii_class})")
            at += 2
            continue
        written.append(char)
        at += 1
        if char == "[":  # a class opens; a "]" first in it (after a "^") is a character
            if not depth:
                opened, lettered = len(written) - 1, False
            depth += 1
            for literal in "^]":
                if pattern.startswith(literal, at):
                    written.append(literal)
                    at += 1
        elif char == "]" and depth:
            depth -= 1
            if not depth and lettered:
                written.insert(opened, "(?-i:")
                written.append(")")
    return "".join(written)


def refuse_verbose_lines(pattern: str) -> None:
    """ValueError for a verbose (?x) pattern of several lines: llguidance writes a line's
    end as an escape, which matches a newline and ends no comment ("(?x)1 # one\\n a"
    matched "1", the rest dropped without a word; "(?x)1\\n a" wanted a newline)."""
    if "\n" in pattern and re.search(r"\(\?[a-zA-Z]*x", pattern):
        raise ValueError(
            "regex parse error: a verbose (?x) pattern of several lines is not read here (its "
            "line ends would be matched, its comments run on): write it on one line"
        )


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


def as_annotations(message: str) -> bool:
    return any(annotation in message for annotation in ANNOTATIONS)


def formats_as_annotations(grammar: Mapping[str, Any]) -> str | None:
    """llguidance's grammar for a JSON schema whose "format"s it does not know are taken as
    annotations, as JSON Schema takes them (pydantic writes "binary" for bytes, "password"
    for SecretStr, "path" for Path...), and so is `uniqueItems` (a set's); the formats it
    knows are held to still. None where the schema has other faults too (the first of them
    is the one to report)."""
    lenient: JsonCompileOptions = {**JSON_LAYOUT, "lenient": True}
    schema = compilable(grammar["value"])
    text = str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=lenient))
    failed, faults = llguidance.LLMatcher.validate_grammar_with_warnings(text, limits=LIMITS)
    if failed or not all(as_annotations(warning) for warning in faults):
        return None
    return text


class TextAsText:
    """A tokenizer for llguidance that reads a grammar's text as text: the tokens as
    llguidance read them from the model's tokenizer (their bytes, which are special), and
    text tokenized as it tokenizes it, but for the spellings of special tokens, which are
    the characters they are (in tokens of the vocabulary, longest first).

    llguidance tokenizes the text a grammar forces next with the model's tokenizer, which
    reads `</s>` in it as the end-of-sequence token: a schema's `"const": "</s>"` (a
    regex, a choice, a tool's parameter named so) let the model end its answer there,
    `{"x": "` with finish_reason "stop", and `<s>` failed in the parser's own words. The
    control tokens a chat template writes are kept from a message's text the same way
    (`rawserve.worker.chat_controls`)."""

    def __init__(self, hf_tokenizer: Any, read: llguidance.LLTokenizer):
        self.read = read
        self.eos_token_id = read.eos_token
        self.bos_token_id = hf_tokenizer.bos_token_id
        self.tokens = [read.decode_bytes([i]) for i in range(read.vocab_size)]
        self.special_token_ids = [i for i in range(read.vocab_size) if read.is_special_token(i)]
        special = set(self.special_token_ids)
        spellings = sorted(
            {str(added) for i, added in hf_tokenizer.added_tokens_decoder.items() if i in special},
            key=len,
            reverse=True,
        )
        pattern = "(" + "|".join(map(re.escape, spellings)) + ")"
        self.specials = re.compile(pattern) if spellings else None

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # (so llguidance hands over text, never cut bytes)
            raise TypeError("text only")
        if self.specials is None:
            return self.read.tokenize_str(text)
        ids: list[int] = []
        for index, piece in enumerate(self.specials.split(text)):
            if piece:  # (the spellings are the odd pieces)
                spelt = index % 2
                ids += self.read.greedy_tokenize(piece) if spelt else self.read.tokenize_str(piece)
        return ids


class Compiled(NamedTuple):
    matcher: llguidance.LLMatcher  # at the grammar's start, never moved on
    opening: bytes  # its mask there: what may come first


class Grammars:
    """One model's grammars: a fresh matcher for each sequence that asks for one. Used
    from one thread (the worker's); only compiling runs on another."""

    def __init__(self, tokenizer: Any, vocabulary: int):
        self.hf_tokenizer = tokenizer
        self.vocabulary = vocabulary  # the scores' width: the model's token count
        self.tokenizer: llguidance.LLTokenizer | None = None  # made at first use
        self.compiled: OrderedDict[str, Compiled] = OrderedDict()
        self.compiling: dict[str, Future[Compiled]] = {}
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

    def keep(self, key: str, compiling: Future[Compiled]) -> Compiled:
        """A compiled grammar, kept for the next sequence that asks (ValueError for one
        that cannot be used, then asked again afresh)."""
        self.compiling.pop(key, None)
        compiled = compiling.result()
        self.compiled[key] = compiled
        self.compiled.move_to_end(key)
        while len(self.compiled) > COMPILED_KEPT:
            self.compiled.popitem(last=False)
        return compiled

    def forget(self, key: str) -> None:
        """Drop a compiled grammar: one that failed a sequence is compiled afresh if asked
        again, rather than kept at the size its failure grew it to."""
        self.compiled.pop(key, None)

    def _compile(self, grammar: Mapping[str, Any]) -> Compiled:
        try:
            text = grammar_text(grammar)
        except ValueError as exc:  # a schema it cannot read at all
            raise ValueError(GRAMMAR_REFUSED + in_words(str(exc))) from None
        # (llguidance's fault would show steps later, after a stream's first tokens, or
        # take the worker down)
        # judged as it is compiled: its annotations left out, its objects closed
        judged = compilable(grammar["value"]) if grammar["type"] == "json" else None
        if judged is not None and (faulty := schema_fault(judged)):
            raise ValueError(GRAMMAR_REFUSED + faulty.words)
        pristine, opening = self._matcher(self._held(text, grammar))
        # a format it does not know (or uniqueItems), alone, is an annotation (else the
        # first fault is told)
        annotated = None
        error = pristine.get_error() if pristine.is_error() else ""
        if grammar["type"] == "json" and as_annotations(error):
            annotated = formats_as_annotations(grammar)
        if annotated is not None:
            pristine, opening = self._matcher(self._held(annotated, grammar))
        if pristine.is_error():
            raise ValueError(GRAMMAR_REFUSED + fault(self._as_written(grammar, pristine)))
        return Compiled(pristine, opening)

    def _as_written(self, grammar: Mapping[str, Any], failed: llguidance.LLMatcher) -> Any:
        """The matcher whose fault a client is told: a regex's as the client wrote it
        (`\\d(`, not the `[0-9](` its ASCII classes made of it)."""
        if grammar["type"] != "regex":
            return failed
        written = llguidance.LLMatcher.grammar_from_regex(grammar["value"])
        matcher, _ = self._matcher(str(written))
        return matcher if matcher.is_error() else failed

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

    def _matcher(self, text: str) -> tuple[llguidance.LLMatcher, bytes]:
        """A matcher at the start of `text`, and its first mask (some faults show only
        once one is asked)."""
        pristine = llguidance.LLMatcher(self._tokenizer(), text, log_level=0, limits=LIMITS)
        return pristine, pristine.compute_bitmask()

    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self.tokenizer is None:
            try:
                read = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocabulary)
                wrapper = llguidance.TokenizerWrapper(TextAsText(self.hf_tokenizer, read))
                self.tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=self.vocabulary)
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

    def __init__(self, grammars: Grammars, key: str, compiling: Future[Compiled]):
        self.grammars = grammars
        self.key = key
        self.compiling = compiling

    @property
    def ready(self) -> bool:
        return self.compiling.done()

    def matcher(self) -> llguidance.LLMatcher:
        """The sequence's own matcher (waiting for its grammar if it is not ready); ValueError
        for a grammar that cannot be used."""
        return self.held().matcher

    def held(self) -> Held:
        """The sequence's own matcher and the grammar's first mask (as `matcher`)."""
        compiled = self.grammars.keep(self.key, self.compiling)
        return Held(compiled.matcher.deep_copy(), compiled.opening, self.forget)

    def forget(self) -> None:
        self.grammars.forget(self.key)


class Held:
    """A sequence's grammar: its own matcher, and the mask at the grammar's start while
    no token has moved it on (shared by the grammar's sequences: computed once)."""

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        opening: bytes | None = None,
        forget: Callable[[], None] | None = None,
    ):
        self.matcher = matcher
        self.opening = opening
        self._forget = forget
        self.slow_steps = 0  # steps its mask took over MASK_SECONDS
        self.watched = False  # its mask is computed and timed apart

    def consume_token(self, token: int) -> bool:
        self.opening = None
        return self.matcher.consume_token(token)

    def failed(self) -> None:
        """It cannot go on: its compiled grammar is not kept at what the failure grew."""
        if self._forget is not None:
            self._forget()


def fault(matcher: llguidance.LLMatcher) -> str:
    """A matcher's error, on one line (llguidance's message points at the fault in lines),
    in a client's words where it has them."""
    return in_words(" ".join(matcher.get_error().replace("<non-verbose/>", "").split()))


def in_words(message: str) -> str:
    """llguidance's `message` as a client can act on it (`FAULT_WORDS`), or as it is, its
    places in the client's terms (`in_clients_terms`)."""
    for pattern, words in FAULT_WORDS:
        if (found := pattern.search(message)) is not None:
            log.debug("grammar fault: %s", message)
            said = found.expand(words) if isinstance(words, str) else words(found)
            return in_clients_terms(said)
    return in_clients_terms(message)


def in_clients_terms(message: str) -> str:
    """`message` with the places llguidance names as the client names them: a part of a
    tool's parameters ("urn:rawserve:tool:f#/$defs/x") by its reference, the function
    named after, and its placeholder for a schema without an `$id` ("json-schema:///")
    left out."""
    whose: list[str] = []

    def reference(found: re.Match[str]) -> str:
        named = (
            f"the parameters' schema of function {found['function']!r}"
            if found["function"]
            else "the response_format's schema"
        )
        if named not in whose:
            whose.append(named)
        return found["fragment"] or "#"

    said = OUR_RESOURCES.sub(reference, message).replace(PLACEHOLDER, "")
    return f"{said} (in {' and '.join(whose)})" if whose else said


def unheld_keywords(listed: str) -> str:
    """llguidance's list of the keywords it does not implement, said without `uniqueItems`,
    which is taken as an annotation: only the others are at fault."""
    try:
        keywords = [keyword for keyword in json.loads(listed) if keyword != "uniqueItems"]
    except (ValueError, TypeError):  # not the JSON list it writes: as it came
        return f"the schema uses keywords a grammar cannot hold: {listed}"
    return f"the schema uses keywords a grammar cannot hold: {json.dumps(keywords)}"


def constrain(scores: torch.Tensor, rows: list[tuple[int, Held]]) -> list[tuple[int, str]]:
    """Rows of scores, in place: -inf for every token a row's grammar does not allow next
    (`rows`: each row's index in `scores` and its grammar), the masks computed together
    on llguidance's threads (but a grammar's first, known). Returns the rows whose grammar
    cannot go on, each with why (its matcher failed, past one of llguidance's limits say,
    or it allows no token of this model's): their scores are left as they are, and the
    caller ends them."""
    stuck = [
        (index, GRAMMAR_FAILED + fault(held.matcher))
        for index, held in rows
        if held.matcher.is_error()
    ]
    rows = [(index, held) for index, held in rows if not held.matcher.is_error()]
    if not rows:
        return stuck
    width = scores.shape[-1]
    bitmask = llguidance.numpy.allocate_token_bitmask(len(rows), width)
    targets = []
    for place, (_, held) in enumerate(rows):
        if held.opening is not None and len(held.opening) == bitmask[place].nbytes:
            bitmask[place] = numpy.frombuffer(held.opening, dtype=bitmask.dtype)
        else:
            targets.append((held, place))
    slow = fill_masks(targets, bitmask)
    bits = numpy.unpackbits(bitmask.view(numpy.uint8), axis=1, bitorder="little")
    allowed = bits[:, :width].view(numpy.bool_)
    way_on = numpy.any(allowed, axis=1).tolist()  # (else nothing would be left)
    blocked = torch.from_numpy(~allowed).to(scores.device)
    for place, (index, _) in enumerate(rows):
        if place in slow:
            stuck.append((index, slow[place]))
        elif way_on[place]:
            scores[index].masked_fill_(blocked[place], float("-inf"))
        else:
            stuck.append((index, "the grammar allows no token this model can write next"))
    return stuck


def fill_masks(rows: list[tuple[Held, int]], bitmask: numpy.ndarray) -> dict[int, str]:
    """Each row's mask into its place of `bitmask`: together on llguidance's threads, but
    a row being watched (after a step whose masks together took over MASK_SECONDS) alone,
    timed as it is computed; returns the rows over it for the SLOW_STEPS_ALLOWED-th time,
    with why they end, by place. (Timed again after the step, each mask came from the
    library's caches at a fraction of its cost.)"""
    watched = [(held, place) for held, place in rows if held.watched]
    together = [(held, place) for held, place in rows if not held.watched]
    if together and fill_timed(together, bitmask) > MASK_SECONDS:
        for held, _ in together:  # (which it was is told from the next step)
            held.watched = True
    ended = {}
    for held, place in watched:
        seconds = fill_timed([(held, place)], bitmask)
        if seconds <= MASK_SECONDS:
            held.watched = False
            continue
        held.slow_steps += 1
        if held.slow_steps >= SLOW_STEPS_ALLOWED:
            ended[place] = GRAMMAR_FAILED + (
                f"a step of the grammar took {seconds * 1000:.0f} ms to follow, past the "
                f"{MASK_SECONDS * 1000:.0f} ms allowed (every sequence beside it waits for "
                "it): a pattern repeated a great many times, say"
            )
    return ended


def fill_timed(rows: list[tuple[Held, int]], bitmask: numpy.ndarray) -> float:
    """Seconds `rows`' masks took, computed together into `bitmask`."""
    started = time.perf_counter()
    targets = [(held.matcher, place) for held, place in rows]
    llguidance.numpy.fill_next_token_bitmask_par(executor(), targets, bitmask)
    return time.perf_counter() - started


_executor: llguidance.LLExecutor | None = None


def executor() -> llguidance.LLExecutor:
    """The threads that compute masks, made at first use (llguidance's default count: 80 %
    of the cores, at most 32)."""
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    return _executor
