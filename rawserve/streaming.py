"""Token streaming for text-generation: `"stream": true` → text/event-stream, TGI's shape.

Owns the server side of a stream: it registers a token listener with the executor,
queues the request through the scheduler like any other (the stream id in its
parameters keeps it out of other requests' batches and tells the worker to send a
`TokenChunk` per new token), and turns the chunks into server-sent events:

    data: {"index": 0, "token": {"id", "text", "logprob", "special"}, "generated_text": null, "details": null}
    ...
    data: {"index": n, "token": {...}, "generated_text": "...", "details": {...}}

The last token's event carries the full text, as TGI's does (one token is held back
until the batch's result says whether it was the last). When the client leaves, the
protocol closes the event iterator: the listener is removed, the queued item withdrawn,
and the worker told to stop generating. Never imports torch.
"""  # noqa: E501

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from rawserve.errors import BadRequest, HTTPError
from rawserve.http import HttpResponse
from rawserve.tasks import STREAM_ID_PARAM, ParsedRequest

_DONE = None  # put on a stream's queue when its request has finished


def sse(document: Any) -> bytes:
    return b"data:" + json.dumps(document, separators=(",", ":")).encode() + b"\n\n"


class TokenStreams:
    def __init__(self, scheduler: Any, executor: Any):
        self.scheduler = scheduler
        self.executor = executor

    async def open(self, parsed: ParsedRequest, deadline: float) -> HttpResponse:
        """Start a streamed generation; errors before its first token keep their status."""
        if not hasattr(self.executor, "open_stream"):
            raise BadRequest("this server cannot stream")
        queue: asyncio.Queue[Any] = asyncio.Queue()
        stream_id = self.executor.open_stream(queue.put_nowait)
        params = {**parsed.params, STREAM_ID_PARAM: stream_id}
        run = asyncio.ensure_future(self.scheduler.run(parsed.inputs, params, deadline))
        run.add_done_callback(lambda _: queue.put_nowait(_DONE))
        try:
            first = await queue.get()
            if first is _DONE:
                run.result()  # raises the request's error, with its status
        except BaseException:
            self._close(stream_id, run)
            raise
        return HttpResponse(
            200,
            headers=[("Cache-Control", "no-cache")],
            content_type="text/event-stream",
            stream=self._events(first, queue, run, stream_id),
        )

    async def _events(
        self, first: Any, queue: asyncio.Queue[Any], run: asyncio.Future, stream_id: int
    ) -> AsyncIterator[bytes]:
        from rawserve.app import unwrap

        try:
            held = first
            index = 0
            emitted = ""  # the text of the tokens sent so far
            while held is not _DONE:
                chunk = await queue.get()
                if chunk is _DONE:
                    break
                yield sse(_event(index, held.token))
                emitted += held.token["text"]
                index += 1
                held = chunk
            try:
                [result] = run.result()
                output = unwrap(result)
            except HTTPError as error:
                yield sse({"error": error.message, "error_type": error.error_type})
                return
            last_token = dict(held.token) if held is not _DONE else None
            text = output["generated_text"]
            if last_token is not None and not last_token["special"] and text.startswith(emitted):
                # the last token carries whatever a cut multi-byte character held back
                last_token["text"] = text[len(emitted) :]
            yield sse(_event(index, last_token, text, output.get("details")))
        finally:
            self._close(stream_id, run)

    def _close(self, stream_id: int, run: asyncio.Future) -> None:
        self.executor.close_stream(stream_id)
        if not run.done():
            run.cancel()


def _event(
    index: int,
    token: Any,
    generated_text: str | None = None,
    details: Any = None,
) -> dict[str, Any]:
    return {
        "index": index,
        "token": dict(token) if token is not None else None,
        "generated_text": generated_text,
        "details": details,
    }
