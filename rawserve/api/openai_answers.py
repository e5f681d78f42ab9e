"""OpenAI's generation answers: a choice per generated text, whole or as SSE chunks
streamed as the worker's tokens come, in chat's or completions' shape.

Text stops before a stop sequence, as OpenAI's does, streamed too: text that may be the
start of a stop sequence is held back until the next token says. Log probabilities are
listed with the chunk that sends their token's text; an answer held to tools is read back
as OpenAI's calls (`openai_tools`); a reasoning model's thinking goes apart from its answer
(`reasoning`). Server process; plain Python.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rawserve import __version__
from rawserve.api.openai_logprobs import (
    Listed,
    adding,
    answer_tokens,
    chat_logprobs,
    completion_logprobs,
    listed,
    prompt_tokens,
)
from rawserve.api.openai_tools import WORDS_OPENING, StreamedWords, Tools, words_end
from rawserve.api.reasoning import CONTENT, REASONING, Thinking, said, split_answer
from rawserve.api.streaming import TokenStream, merged, spaced_sse
from rawserve.http.errors import openai_error_document
from rawserve.tasks.text_generation import stop_start, stop_tail

# finish reasons: the worker's (TGI's) → OpenAI's
FINISH_REASONS = {"eos_token": "stop", "stop_sequence": "stop", "length": "length"}
# OpenAI's answers name the backend's configuration; TGI's client requires it
SYSTEM_FINGERPRINT = f"rawserve-{__version__}"
# what ends an OpenAI stream, after its last chunk or its error event
DONE = b"data: [DONE]\n\n"


def cut_at_stop(text: str, stops: Sequence[str], stops_from: int = 0) -> str:
    """`text` before the first stop sequence in it (all of it when there is none); one
    that ends at or before `stops_from` (in the text before `min_tokens`) does not count."""
    found = [index for stop in stops if (index := stop_start(text, stop, stops_from)) >= 0]
    return text[: min(found)] if found else text


def releasable(text: str, stops: Sequence[str], stops_from: int = 0) -> tuple[str, bool]:
    """How much of a streamed text may be sent now, and whether a stop sequence was
    reached: text that could be the start of a stop sequence waits for the next token."""
    found = [index for stop in stops if (index := stop_start(text, stop, stops_from)) >= 0]
    if found:
        return text[: min(found)], True
    held = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:size]):
                held = size
                break
    return text[: len(text) - held], False


def stops_from(output: Mapping[str, Any]) -> int:
    """Where in a finished output's text stop sequences start to count: the worker says
    where `min_tokens` put it (vLLM's reading: no stop in the text before it)."""
    return int(output["details"].get("stops_from", 0))


def finish_reason(details: dict[str, Any]) -> str:
    return FINISH_REASONS.get(details.get("finish_reason", ""), "stop")


def usage(outputs: Sequence[dict[str, Any]], n: int = 1) -> dict[str, Any]:
    """Tokens read and written: a prompt's once, however many choices follow it (`n`, each
    prompt's choices one after another); a reasoning model's chat answers', the tokens
    their thinking took among them (OpenAI's `completion_tokens_details`, as vLLM's)."""
    prompt = sum(int(o["details"]["prompt_tokens"]) for o in outputs[::n])
    completion = sum(int(o["details"]["generated_tokens"]) for o in outputs)
    counted: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    thought = [
        o["details"]["reasoning_tokens"] for o in outputs if "reasoning_tokens" in o["details"]
    ]
    if thought:
        counted["completion_tokens_details"] = {"reasoning_tokens": sum(thought)}
    return counted


class Unsent:
    """A stream's tokens whose text has not gone out yet, each with where its text starts
    in the whole text."""

    def __init__(self) -> None:
        self.tokens: list[tuple[Listed, int]] = []

    def add(self, token: Listed, start: int) -> None:
        self.tokens.append((token, start))

    def take(self, sent: int, every: bool = False) -> tuple[list[Listed], int]:
        """The tokens whose text starts within the first `sent` characters (now sent),
        and where the first of them starts; a token starting past them (past a stop
        sequence's start, when the text ends there) stays. `every`: the whole text is
        sent, and those that add nothing at its end go too."""
        taken = [(token, start) for token, start in self.tokens if every or start < sent]
        self.tokens = self.tokens[len(taken) :]
        return [token for token, _ in taken], taken[0][1] if taken else 0


@dataclass(frozen=True)
class Echo:
    """A prompt as its completion echoes it: its text, and whether it came as token ids
    (then every token is listed, special ones too: one entry per id sent)."""

    text: str
    token_ids: bool


class Answer:
    """The shape of one route's answers: ids, objects, and where the text goes."""

    def __init__(
        self,
        chat: bool,
        model: str,
        logprobs: int | None = None,
        clock: Callable[[], float] = time.time,
        tools: Tools | None = None,
        stops_after: int = 0,
        thinking: str | None = None,
    ):
        self.chat = chat
        self.model = model
        self.logprobs = logprobs  # None: not asked; else the alternatives each token lists
        # the tools an answer is held to (a call, or words in JSON): read back as OpenAI's
        self.tools = tools if tools is not None and tools.held else None
        # OpenAI's min_tokens: no stop sequence counts in the text of the tokens before it
        self.stops_after = stops_after
        # a reasoning model's chat answer: where its thinking opens (`reasoning`); one held
        # to tools or a grammar thinks first too, held only after it (the worker's grammar)
        self.thinking = thinking if chat else None
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(clock())
        self.listed: set[int] = set()  # the streamed choices that listed a token
        # a stream that ends with a usage chunk: the chunks before it say "usage": null,
        # as OpenAI's spec has them (a client reading chunk["usage"] finds the key)
        self.usage_in_chunks = False

    def head(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        head: dict[str, Any] = {
            "id": self.id,
            "object": f"{kind}.chunk" if chunk and self.chat else kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }
        if self.chat:  # (what "auto" is served as, as OpenAI's chat answers say it)
            head["service_tier"] = "default"
        if chunk and self.usage_in_chunks:
            head["usage"] = None
        return head

    def whole(
        self,
        outputs: Sequence[dict[str, Any]],
        stops: Sequence[str],
        echoed: Sequence[Echo] | None = None,
        n: int = 1,
    ) -> dict[str, Any]:
        """The answer: a choice per output, each prompt's `n` one after another (`echoed`:
        the prompt each one follows)."""
        choices = []
        for index, output in enumerate(outputs):
            text = cut_at_stop(output["generated_text"], self.text_stops(stops), stops_from(output))
            tokens = answer_tokens(output["details"], len(text), len(output["generated_text"]))
            if echoed is not None:  # the stop sequences cut the completion, not the prompt
                echo = echoed[index]
                text = echo.text + text
                tokens = prompt_tokens(output["details"], echo.token_ids, echo.text) + tokens
            choice: dict[str, Any] = {"index": index}
            reason = finish_reason(output["details"])
            if self.chat:
                choice["message"], reason = self.message(text, reason, output["details"], stops)
                tokens = self.words_tokens(tokens, text, choice["message"], stops)
            else:
                choice["text"] = text
            choice["logprobs"] = self.listing(tokens)
            choice["finish_reason"] = reason
            choices.append(choice)
        return {**self.head(False), "choices": choices, "usage": usage(outputs, n)}

    def words_tokens(
        self,
        tokens: Sequence[Listed],
        text: str,
        message: Mapping[str, Any],
        stops: Sequence[str],
    ) -> list[Listed]:
        """`tokens` (those of the generated `text`), up to where a stop sequence cut the
        words of an answer that tools held (`message`'s content): those past it are not
        the answer's, as a plain answer's are not."""
        words = message.get("content")
        if not stops or self.tools is None or not isinstance(words, str):
            return list(tokens)
        end = words_end(text, len(words))
        if end is None:
            return list(tokens)
        rest = StreamedWords()  # the words past those said: cut where a stop begins them
        rest.add(WORDS_OPENING + text[end:])
        if not any(rest.sent.startswith(stop) for stop in stops):
            return list(tokens)  # (not cut: every token is the answer's)
        kept, offset = [], 0
        for token in tokens:
            if offset >= end:
                break
            kept.append(token)
            offset += len(token.text)
        return kept

    def text_stops(self, stops: Sequence[str]) -> Sequence[str]:
        """The stop sequences that cut the generated text: none where tools hold it (they
        cut the words of an answer that does not call: `message`)."""
        return () if self.tools is not None else stops

    def message(
        self,
        text: str,
        reason: str,
        details: Mapping[str, Any] | None = None,
        stops: Sequence[str] = (),
    ) -> tuple[dict[str, Any], str]:
        """A chat answer's message and finish reason: a tool call, where tools hold it (read
        from the answer after a reasoning model's thinking, which opens where the worker's
        `details` say, else where the model's do); an answer in words that tools held
        stops before the first of `stops` in its words ("stop"), never a call."""
        reasoning: str | None = None
        content: str | None = text
        if self.thinking is not None:
            reasoning, content = split_answer(text, details or {}, self.thinking)
        thought = said(REASONING, reasoning) if reasoning is not None else {}
        if self.tools is None or content is None:  # (thinking never closed: no call)
            return {"role": "assistant", **said(CONTENT, content), **thought}, reason
        message, called = self.tools.message(content)
        words = message.get("content")
        # (an answer cut before it said anything is its JSON as it came: no stop cuts it)
        read = words != content and self.tools.answer_format is None
        if stops and words and called is None and read:
            cut = cut_at_stop(words, stops)
            if len(cut) < len(words):
                message, reason = {**message, "content": cut}, "stop"
        return {**message, **thought}, called or reason

    def held_end(
        self,
        index: int,
        output: dict[str, Any],
        stops: Sequence[str],
        sent: str,
        tokens: Sequence[Listed] = (),
        thought: str = "",
    ) -> tuple[bytes | None, str]:
        """The end of a streamed answer held to tools: its call, or its words past those
        `sent` as they came (None: nothing left), with its `tokens` (listed where log
        probabilities are asked: a stream's output does not list them), its thinking past
        the `thought` sent, and its finish reason."""
        text = output["generated_text"]
        details = output["details"]
        message, reason = self.message(text, finish_reason(details), details, stops)
        tokens = self.words_tokens(tokens, text, message, stops)
        reasoning = message.get(REASONING) or ""
        thinking = reasoning[len(thought) :] if reasoning.startswith(thought) else ""
        calls = message.get("tool_calls")
        if calls:
            delta: dict[str, Any] = {
                "tool_calls": [{"index": place, **call} for place, call in enumerate(calls)]
            }
        elif "function_call" in message:
            delta = {"function_call": message["function_call"]}
        else:
            words = message["content"] or ""
            rest = words[len(sent) :] if words.startswith(sent) else words
            if not rest and (sent or thought) and not thinking:
                return None, reason
            delta = {"content": rest} if rest or not thinking else {}
        if thinking:
            delta = {**said(REASONING, thinking), **delta}
        chunk = self.chunk(index, None, tokens)
        chunk["choices"][0]["delta"] = delta
        return spaced_sse(chunk), reason

    def chunk(
        self,
        index: int,
        text: str | None,
        tokens: Sequence[Listed] = (),
        offset: int = 0,
        finish: str | None = None,
    ) -> dict[str, Any]:
        """A streamed chunk of choice `index`: its text, and the tokens it sends (`offset`:
        where the first one's text starts in the choice's whole text)."""
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice["text"] = text or ""
        choice["logprobs"] = None
        if tokens:
            choice["logprobs"] = self.listing(tokens, offset)
            self.listed.add(index)
        elif finish is not None and index not in self.listed:
            # a choice that ends having listed none (a stop cut it at once) says so, as its
            # whole answer lists none: a client adding up the chunks found null
            choice["logprobs"] = self.listing((), offset)
        choice["finish_reason"] = finish
        return {**self.head(True), "choices": [choice]}

    def sending(
        self,
        index: int,
        sending: Release | None,
        thoughts: Sequence[ThoughtChoice] | None,
        ended: bool = False,
    ) -> list[dict[str, Any]]:
        """The chunks that a choice's released text (and, `ended`, the end) sends: a
        reasoning model's as reasoning or content as its thinking says, each piece's tokens
        with the first chunk that goes after them."""
        if thoughts is None:
            return [self.chunk(index, *sending)] if sending is not None else []
        thought = thoughts[index]
        text, tokens, _ = sending if sending is not None else ("", [], 0)
        thought.tokens += tokens
        pieces = thought.thinking.add(text) + (thought.thinking.end() if ended else [])
        chunks = []
        for kind, piece in pieces:
            chunk = self.chunk(index, piece, thought.tokens)
            chunk["choices"][0]["delta"] = said(kind, piece)
            thought.tokens = []
            chunks.append(chunk)
        if ended and thought.tokens:  # those of a tag, with nothing after it
            chunks.append(self.chunk(index, None, thought.tokens))
        return chunks

    def held_words(
        self,
        index: int,
        piece: str,
        words: tuple[StreamedWords, WordsToStop],
        thought: ThoughtChoice | None,
    ) -> list[dict[str, Any]]:
        """The chunks that a piece of a streamed answer held to tools sends as it comes: a
        reasoning model's thinking as reasoning, the words after it as content (`words`:
        read from the JSON, then sent up to a stop sequence)."""
        read, to_stop = words
        pieces = [(CONTENT, piece)] if thought is None else thought.thinking.add(piece)
        chunks = []
        for kind, text in pieces:
            if kind == REASONING and thought is not None:
                chunk = self.chunk(index, text)
                chunk["choices"][0]["delta"] = said(REASONING, text)
                thought.thought += text
                chunks.append(chunk)
            elif said_words := to_stop.add(read.add(text)):
                chunks.append(self.chunk(index, said_words))
        return chunks

    def listing(self, tokens: Sequence[Listed], offset: int = 0) -> dict[str, Any] | None:
        """Tokens' log probabilities in this route's shape; None where none were asked."""
        if self.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(tokens)
        return completion_logprobs(tokens, offset, self.logprobs)

    async def events(
        self,
        streams: Sequence[TokenStream],
        stops: Sequence[str],
        include_usage: bool,
        n: int = 1,
        echoed: Sequence[str] | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """OpenAI's chunks for a streamed generation (a stream a choice, each prompt's `n`
        one after another, their chunks as they come), then `data: [DONE]`. `echoed`:
        each choice's prompt, its first chunk."""
        self.usage_in_chunks = include_usage
        try:
            choices = [Streamed(self.stops_after) for _ in streams]
            # an answer held to tools: its words as they come (not with log probabilities,
            # which go whole at its end), a call at its end
            held = [self.tools.words() if self.tools else StreamedWords() for _ in streams]
            stopping = [WordsToStop(stops) for _ in streams]  # (the words sent, to a stop)
            held_tokens: list[list[Listed]] = [[] for _ in streams]
            thoughts = [ThoughtChoice(self.thinking) for _ in streams] if self.thinking else None
            words_as_they_come = self.tools is not None and self.logprobs is None
            if self.chat:  # each choice's first chunk says who speaks
                # (an answer that must call has no words: null, as the message's content,
                # and OpenAI's first chunk of a call)
                calls = self.tools is not None and self.tools.mode not in ("auto", "none")
                for index in range(len(streams)):
                    first = self.chunk(index, "")
                    first["choices"][0]["delta"] = {
                        "role": "assistant",
                        "content": None if calls else "",
                    }
                    yield spaced_sse(first)
            if echoed is not None:
                for index, prompt in enumerate(echoed):
                    yield spaced_sse(self.chunk(index, prompt))
            outputs: list[dict[str, Any]] = [{} for _ in streams]  # by choice, as they end
            async for index, chunk in merged(streams):
                choice = choices[index]
                if chunk is not None:
                    if thoughts is not None and chunk.opened is not None:  # its first token
                        thoughts[index] = ThoughtChoice(chunk.opened)
                    if self.tools is not None:
                        # its JSON as it comes (a stop sequence ends its words alone)
                        released = choice.add(chunk.token, (), self.logprobs)
                        piece = released[0] if released is not None else ""
                        held_tokens[index] += released[1] if released is not None else []
                        if words_as_they_come:
                            thought = thoughts[index] if thoughts is not None else None
                            words = (held[index], stopping[index])
                            for ready in self.held_words(index, piece, words, thought):
                                yield spaced_sse(ready)
                        continue
                    if (sending := choice.add(chunk.token, stops, self.logprobs)) is not None:
                        for ready in self.sending(index, sending, thoughts):
                            yield spaced_sse(ready)
                    continue
                output = streams[index].output()
                reason = finish_reason(output["details"])
                if self.tools is not None:
                    if (rest := choice.rest(output, ())) is not None:
                        held_tokens[index] += rest[1]
                    sent = stopping[index].sent
                    thought_sent = thoughts[index].thought if thoughts is not None else ""
                    last, reason = self.held_end(
                        index, output, stops, sent, held_tokens[index], thought_sent
                    )
                    if last is not None:
                        yield last
                else:
                    sending = choice.rest(output, stops)
                    for ready in self.sending(index, sending, thoughts, ended=True):
                        yield spaced_sse(ready)
                yield spaced_sse(self.chunk(index, None, finish=reason))
                outputs[index] = output
            if include_usage:
                every = usage(outputs, n)  # each prompt read once
                yield spaced_sse({**self.head(True), "choices": [], "usage": every})
            yield DONE
        except Exception as exc:  # noqa: BLE001 - a choice's error or a bug: the error, then
            # the end, as vLLM ends it
            yield spaced_sse(openai_error_document(streams[0].failed(exc)))
            yield DONE
        finally:
            for stream in streams:
                stream.close()


class WordsToStop:
    """A streamed answer's words, sent up to the first stop sequence in them: words that
    may begin one wait for the next piece; none goes out past one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = stops
        self.waiting = ""
        self.sent = ""
        self.stopped = False

    def add(self, words: str) -> str:
        """What of the words so far may go out now ("" while they may begin a stop)."""
        if self.stopped or not words:
            return ""
        ready, self.stopped = releasable(self.waiting + words, self.stops)
        self.waiting = (self.waiting + words)[len(ready) :]
        self.sent += ready
        return ready


class ThoughtChoice:
    """One streamed choice of a reasoning model: its thinking, and the tokens whose text
    it holds (the start of a tag, perhaps)."""

    def __init__(self, opened: str) -> None:
        self.thinking = Thinking(opened)
        self.tokens: list[Listed] = []
        self.thought = ""  # (an answer held to tools: its thinking sent as it came)


class Streamed:
    """One streamed choice's text: how long it has grown, what has been sent, and the
    text and tokens that have not gone out yet (they may start a stop sequence).

    Only the unsent text and the last characters sent are kept whole and searched for
    stop sequences: what may begin one is not sent, so none that counts begins further
    back. A token's work then does not grow with the text (searching and copying all of
    it at each token made a long answer's stream cost the server more with every token)."""

    def __init__(self, stops_after: int = 0) -> None:
        self.length = 0  # of the text generated so far (special tokens left out)
        self.pieces: list[str] = []  # the text sent, chunk by chunk
        self.sent_length = 0
        self.held = ""  # the text past what was sent
        self.recent = ""  # the end of the text sent, where a stop may begin
        self.unsent = Unsent()
        self.stops_after = stops_after  # the first token whose text a stop may end in
        self.tokens = 0  # how many have come, special ones too (the worker counts them)
        self.stops_from = 0  # where in the text stops count: the start of that token's
        # the newest token, if special and listed: listed once the next comes (adding
        # nothing) or the text ends (where it may add what byte tokens held back)
        self.special: Mapping[str, Any] | None = None

    @property
    def sent(self) -> str:
        """The text sent so far."""
        if len(self.pieces) > 1:
            self.pieces = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""

    def add(
        self, token: Mapping[str, Any], stops: Sequence[str], logprobs: int | None
    ) -> Release | None:
        """A new token; what can be sent now."""
        self.tokens += 1
        if self.tokens <= self.stops_after:
            self.stops_from = self.length
        if self.special is not None:
            self.unsent.add(listed(adding(self.special, 0)), self.length)
        self.special = token if token["special"] and logprobs is not None else None
        if token["special"]:
            return None
        if logprobs is not None:
            self.unsent.add(listed(token), self.length)
        self.held += token["text"]
        self.length += len(token["text"])
        if not stops:  # nothing to hold back: the text goes as it comes, unsearched
            text, self.held = self.held, ""
            return self._send(text)
        # a stop may begin in the last characters sent: one that counted no more once
        # stops counted from a later token on
        self.recent = stop_tail(self.recent, stops)
        start = self.sent_length - len(self.recent)
        ready, _ = releasable(self.recent + self.held, stops, self.stops_from - start)
        if start + len(ready) <= self.sent_length:
            return None
        text = ready[len(self.recent) :]
        self.held = self.held[len(text) :]
        self.recent += text
        return self._send(text)

    def rest(self, output: dict[str, Any], stops: Sequence[str]) -> Release | None:
        """What a cut character held back, once the whole text is known (listed with
        the special token that ends the text where that token added it)."""
        text = output["generated_text"]
        if self.special is not None:
            ending = adding(self.special, len(text) - self.length)
            self.unsent.add(listed(ending), self.length)
            self.special = None
        whole = cut_at_stop(text, stops, stops_from(output))
        if not whole.startswith(self.sent):
            return None
        self.held = ""
        return self._send(whole[self.sent_length :], ended=len(whole) == len(text))

    def _send(self, text: str, ended: bool = False) -> Release | None:
        """`text`, what follows the text sent, sent now with its tokens and where the
        first one starts (None: nothing to send). `ended`: the whole text, not cut by a
        stop, and with it every token still unsent (those adding nothing at its end)."""
        if not text and not (ended and self.unsent.tokens):
            return None
        self.pieces.append(text)
        self.sent_length += len(text)
        return (text, *self.unsent.take(self.sent_length, every=ended))


Release = tuple[str, list[Listed], int]  # a chunk's text, its tokens, the first's offset
