"""What every route family shares: reading a JSON or text body, the deadline a request
asks for, and JSON responses with their Server-Timing.

The one JSON body reader and the one way answers are encoded (orjson, through
`rawserve.http.encoding`).
"""

from __future__ import annotations

import asyncio
import codecs
import json
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from rawserve.http.encoding import dumps, dumps_in_pieces
from rawserve.http.errors import (
    BadRequest,
    MalformedRequest,
    PayloadTooLarge,
    UnsupportedMediaType,
    single_header,
)
from rawserve.http.exchange import HttpRequest, HttpResponse
from rawserve.http.header_numbers import header_decimal
from rawserve.serving.face import ItemResult
from rawserve.shared import json_text

# Python's own encodings (its docs' "Python Specific Encodings"), which are no charset a
# client names; decoding a megabyte as punycode (or idna, which calls it) takes a minute.
PYTHON_ENCODINGS = frozenset(
    {"idna", "palmos", "punycode", "raw-unicode-escape", "undefined", "unicode-escape"}
)
BYTE_ORDER_MARK = "\ufeff"
UTF8_BYTE_ORDER_MARK = BYTE_ORDER_MARK.encode("utf-8")
# Entries (tokens, and their alternatives) an answer lists past which it is built and
# encoded on a thread: shaping a few megabytes of log probabilities takes the event loop
# a few hundred milliseconds, during which no other client of this process is heard.
LARGE_ANSWER_ENTRIES = 4_000
# Numbers of a vector that weigh as much as one such entry: orjson writes 2 million
# float32 in about 57 ms, a thirtieth of what shaping and encoding as many entries takes.
NUMBERS_PER_ENTRY = 25
MAX_JSON_DEPTH = json_text.MAX_DEPTH  # levels of nested arrays and objects in a request body
TOO_DEEP = f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep"


def read_json(request: HttpRequest) -> Any:
    """The request's body as JSON; 400 when it is not valid JSON, is nested more than
    `MAX_JSON_DEPTH` levels, or holds a lone UTF-16 surrogate (`"\\ud800"`: valid JSON,
    but no text a tokenizer can take); 415 for a form upload (curl -F), whose parts'
    framing is no JSON."""
    refuse_form_upload(request, "the JSON body (curl -d or --json)")
    body = request.body
    try:
        document = json_text.loads(body)
    except RecursionError:  # the parser's own limit, well past ours
        raise MalformedRequest(TOO_DEEP) from None
    except UnicodeDecodeError:  # (the JSON of a charset=latin-1 or gbk body, say)
        refuse_media_not_json(request)
        raise MalformedRequest("the body is not valid JSON: JSON is read as UTF-8") from None
    except json.JSONDecodeError:
        refuse_media_not_json(request)
        raise MalformedRequest("the body is not valid JSON") from None
    except json_text.PastFloatRange as exc:
        raise MalformedRequest(f"the body holds {exc}") from None
    except json_text.NotJsonNumber as exc:
        raise MalformedRequest(f"the body is not valid JSON: {exc}") from None
    except ValueError:  # a number of more digits than Python converts (4,300)
        raise MalformedRequest("the body holds a number too long to read") from None
    # Each check runs only where the bytes allow its problem: fewer brackets than the
    # limit cannot nest past it, and a surrogate is written as an escape or as its own
    # bytes (not UTF-8, but json.loads reads them). Neither walks the document in
    # Python: a walk of 340,000 empty lists (1 MB, 1 KB gzipped) held the loop 0.3 s.
    encoding = json.detect_encoding(body)  # json.loads reads UTF-16 and UTF-32 too
    utf8 = encoding.startswith("utf-8")
    if not utf8:  # scanned as the UTF-8 it reads as (a raw surrogate too: always checked)
        body = body.decode(encoding, "surrogatepass").encode("utf-8", "surrogatepass")
    if json_text.nested_deeper_than(body, MAX_JSON_DEPTH):
        raise MalformedRequest(TOO_DEEP)
    written = b"\\ud" in body or b"\\uD" in body or _RAW_SURROGATE.search(body)
    if (not utf8 or written) and holds_lone_surrogate(document):
        raise MalformedRequest("the JSON body holds a lone surrogate (\\ud800-\\udfff)")
    return document


# a surrogate's UTF-8 bytes, which no valid UTF-8 holds (json.loads takes them)
_RAW_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


def holds_lone_surrogate(document: Any) -> bool:
    """Whether a string of `document` (a key too) holds a lone UTF-16 surrogate: its JSON
    text, written by the C encoder, cannot be UTF-8."""
    try:
        json.dumps(document, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# what `curl -d` types any body it sends: a JSON object so sent had its own text scored,
# or generated from with its parameters unread, answered 200 (a form is key=value pairs)
CURL_FORM = "application/x-www-form-urlencoded"
JSON_MEDIA_TYPES = ("application/json", "text/json")
JSON_SPACE = b" \t\r\n"


def is_json(request: HttpRequest) -> bool:
    """The body is JSON: so typed (application/json, the older text/json, or a type of
    JSON's suffix, application/vnd.api+json), or untyped (InferenceClient posts JSON
    without a Content-Type) or typed as curl -d types everything, and starting like an
    object (after a byte order mark: `curl -d @body.json` of a file Notepad saved), in
    any encoding JSON is read in (UTF-8, UTF-16 or UTF-32: PowerShell's Out-File)."""
    content_type = (request.header("content-type") or "").split(";")[0].strip().lower()
    if content_type in JSON_MEDIA_TYPES or content_type.endswith("+json"):
        return True
    if content_type not in ("", CURL_FORM):
        return False
    body = request.body
    encoding = json.detect_encoding(body[:4])
    if encoding.startswith("utf-8"):  # (JSON's whitespace before it, however much)
        return body.removeprefix(UTF8_BYTE_ORDER_MARK).lstrip(JSON_SPACE)[:1] == b"{"
    return body.decode(encoding, "ignore").lstrip(BYTE_ORDER_MARK + JSON_SPACE.decode())[:1] == "{"


# the media types that are never text, whatever their bytes decode as
MEDIA_NOT_TEXT = ("image/", "audio/", "video/")


def read_text(request: HttpRequest) -> str:
    """The request's body as text, in the charset its Content-Type names (UTF-8 where it
    names none); 415 for a charset this server cannot read, bytes that are not in it, or
    a multipart form, whose framing would be read as the text. A charset ignored would
    read UTF-16 as UTF-8 with a NUL after each letter."""
    refuse_form_upload(request, "the text itself, or JSON")
    content_type = request.header("content-type") or ""
    media_type = content_type.split(";")[0].strip().lower()
    if media_type.startswith(MEDIA_NOT_TEXT):  # (a short WAV can be valid UTF-8)
        raise UnsupportedMediaType(f"the body is {media_type}: this model reads text")
    # a byte order mark says the charset, over what the type names (as browsers read
    # text): UTF-16 read as UTF-8 was 415, or text with a NUL between the letters
    charset = marked_charset(request.body) or media_type_parameter(content_type, "charset")
    charset = charset or "UTF-8"
    try:
        codec = codecs.lookup(charset).name
        if codec in PYTHON_ENCODINGS:
            raise LookupError(charset)
        # a byte order mark is no text (a file saved by Notepad starts with one); the
        # WHATWG decoders drop it, as Python's "utf-16" does but not its "utf-8"
        text = request.body.decode(charset).removeprefix(BYTE_ORDER_MARK)
        if codec != "utf-8":  # UTF-7's "+2AA-" reads as a lone surrogate, no character
            text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        raise MalformedRequest(
            f"the {charset} text holds a lone surrogate (\\ud800-\\udfff)"
        ) from None
    except LookupError:  # not a codec, or one that is not a text encoding (base64)
        raise UnsupportedMediaType(
            f"the charset {charset!r} is not one this server reads"
        ) from None
    except UnicodeDecodeError:
        raise UnsupportedMediaType(f"the body is not {charset} text") from None


def marked_charset(body: bytes) -> str | None:
    """The charset `body`'s byte order mark says (UTF-8's or UTF-16's, as the WHATWG
    decoders read them, and UTF-32's); None where it starts with none."""
    if body.startswith(UTF8_BYTE_ORDER_MARK):
        return "utf-8"
    if body.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):  # (UTF-16's, then two NULs)
        return "utf-32"
    if body.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return "utf-16"  # (its decoder reads the mark's byte order, and drops it)
    return None


def refuse_media_not_json(request: HttpRequest) -> None:
    """415 for a body that is not JSON and is typed as media no JSON is (an image sent to
    TGI's /generate was "not valid JSON: JSON is read as UTF-8", where `POST /` says 415)."""
    media_type = (request.header("content-type") or "").split(";")[0].strip().lower()
    if media_type.startswith(MEDIA_NOT_TEXT):
        raise UnsupportedMediaType(f"the body is {media_type}: this route reads JSON")


def refuse_form_upload(request: HttpRequest, send: str) -> None:
    """415 for a multipart form (curl -F): its parts' framing would be read as the input.
    `send` says what to send instead."""
    content_type = request.header("content-type") or ""
    if content_type.lstrip().lower().startswith("multipart/"):
        raise UnsupportedMediaType(f"a form upload is not read: send {send}")


def media_type_parameter(content_type: str, name: str) -> str | None:
    """A parameter of a media type (`text/plain; charset="utf-8"`, RFC 9110 section
    8.3.1: its name in any case, its value a token or a quoted string), or None."""
    for parameter in content_type.split(";")[1:]:
        key, _, value = parameter.partition("=")
        if key.strip().lower() == name:
            return value.strip().strip('"')
    return None


def check_client_batch(count: int, limit: int) -> None:
    """413 for a request with more inputs than one request may carry: it never fits."""
    if count > limit:
        raise PayloadTooLarge(
            f"{count} inputs in one request: at most {limit} are allowed (--max-client-batch-size)"
        )


def request_timeout(request: HttpRequest, default: float, longest: float) -> float:
    """Seconds the request may take: its X-Request-Timeout (at most `longest`) or `default`.
    Two such headers are refused as a bad value is (`single_header`), as they are when a
    proxy joins them into one list, which is no number."""
    try:
        header = single_header(request, "x-request-timeout")
    except MalformedRequest as exc:  # typed as a bad value is (TGI's 422 "validation")
        raise BadRequest(str(exc)) from None
    if header is None:
        return default
    seconds = header_decimal(header)
    if seconds is None:  # HTTP's grammar: digits and at most one dot
        raise BadRequest("X-Request-Timeout must be a number of seconds in digits, such as 2.5")
    if seconds <= 0:
        raise BadRequest("X-Request-Timeout must be more than 0 seconds")
    return min(seconds, longest)


def server_timing(results: Sequence[ItemResult]) -> str:
    queue_ms = 1000 * max(r.queue_seconds for r in results)
    model_ms = 1000 * max(r.compute_seconds for r in results)
    batch = max(r.batch_size for r in results)
    return f'queue;dur={queue_ms:.2f}, model;dur={model_ms:.2f}, batch;desc="{batch}"'


def json_response(
    status: int, document: Any, headers: list[tuple[str, str]] | None = None
) -> HttpResponse:
    return HttpResponse(status, dumps(document), headers or [])


def answer(document: Any, results: Sequence[ItemResult]) -> HttpResponse:
    """200 with `document`, timed by the results it was made of."""
    return encoded_answer(dumps(document), results)


def encoded_answer(body: bytes, results: Sequence[ItemResult]) -> HttpResponse:
    """200 with the JSON `body`, timed by the results it was made of."""
    return HttpResponse(200, body, [("Server-Timing", server_timing(results))])


async def built_answer(
    build: Callable[[], Any], results: Sequence[ItemResult], entries: int
) -> HttpResponse:
    """200 with the document `build` makes, as `answer`. One listing more than
    `LARGE_ANSWER_ENTRIES` entries is built and encoded on a thread: that work holds the
    GIL, but Python hands it to the event loop's thread every switch interval (5 ms), so
    the loop goes on serving other clients meanwhile; the encoding goes a list's item at
    a time for that (`dumps_in_pieces`), as one orjson call does not let go of the GIL.
    A small one is built where it is asked for (a thread's hop costs more than it saves)."""
    if entries <= LARGE_ANSWER_ENTRIES:
        return answer(build(), results)
    return await asyncio.to_thread(lambda: encoded_answer(dumps_in_pieces(build()), results))


def vector_entries(outputs: Iterable[Any]) -> int:
    """What the numbers of the numpy arrays among `outputs` (token vectors, embeddings)
    weigh against `LARGE_ANSWER_ENTRIES`; anything else weighs nothing."""
    numbers = sum(output.size for output in outputs if isinstance(output, np.ndarray))
    return numbers // NUMBERS_PER_ENTRY
