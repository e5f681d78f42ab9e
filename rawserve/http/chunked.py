"""The size of a chunked request body as the client sends it, not only as h11 delivers it.

h11 hands over a chunked body's data and drops its framing: the chunk-size lines (with
any chunk extensions) and the trailer fields. A client could send megabytes of
extensions around a few bytes of data, or announce a chunk of 2^76 bytes and trickle it.
`ChunkedMeter` reads the same bytes alongside h11 (it only measures; h11 still parses
and refuses malformed framing) and counts toward the body limit every byte sent, the
framing too (each chunk's size line with its extensions, as soon as it is announced, its
data and CRLF, and the trailers), so both are refused with 413 as soon as they are
announced. Past its first `CHUNKS_AS_SENT` chunks, a chunk counts at least
`MIN_CHUNK_BYTES`: each costs the event loop a pass of h11's Python whatever its size, and
a body of a million 1-byte chunks held the loop (and every other client of the process)
for 4.7 s. Knows nothing of sockets or of the rest of HTTP.
"""

from __future__ import annotations

import enum

from rawserve.http.head_lines import MAX_HEADER_LINES

_HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")
MAX_SIZE_DIGITS = 20  # h11 refuses longer chunk sizes as malformed
# What a chunk counts at least toward the body limit, after the first few (counted as
# sent): a 1 MiB limit takes some 8,000 chunks (about 0.1 s of h11), where a client's
# chunks are kilobytes (a JSON encoder's pieces streamed as chunks, a few bytes each: a
# 24 KB body made 4,213)
CHUNKS_AS_SENT = 16
MIN_CHUNK_BYTES = 128


class _State(enum.Enum):
    SIZE_LINE = "size line"  # reading a chunk-size line, up to its CRLF
    DATA = "data"  # skipping a chunk's data and its CRLF
    TRAILERS = "trailers"  # after the last chunk: trailer lines, up to an empty one
    DONE = "done"


class ChunkedMeter:
    def __init__(self, limit: int):
        self.limit = limit
        self.sent = 0  # bytes sent or announced so far
        self.surcharge = 0  # what tiny chunks count above their bytes (to MIN_CHUNK_BYTES)
        self.chunks = 0
        self._state = _State.SIZE_LINE
        self._line = bytearray()
        self._skip = 0  # data and CRLF bytes left in the current chunk
        # a chunk-size line ended by a bare LF: h11 waits for a CRLF that may never come
        # (the body then sat until --body-timeout's 408); refused at once instead (h11
        # takes a bare LF in the trailers)
        self.malformed = False
        self.trailer_fields = 0  # h11 parses each as a header line: they are bounded alike

    @property
    def counted(self) -> int:
        """What counts toward the limit so far: the bytes, tiny chunks at the minimum."""
        return self.sent + self.surcharge

    @property
    def over(self) -> bool:
        """Over the limit, counting a size or trailer line still waiting for its end."""
        return self.counted + len(self._line) > self.limit

    @property
    def too_many_chunks(self) -> bool:
        """Over the limit by its chunks' count, not by the bytes sent."""
        return self.over and self.sent + len(self._line) <= self.limit

    @property
    def too_many_trailers(self) -> bool:
        return self.trailer_fields > MAX_HEADER_LINES

    @property
    def done(self) -> bool:
        return self._state is _State.DONE

    @property
    def _reading(self) -> bool:
        """Whether more bytes are measured: not over a bound, and the body not ended."""
        return not (self.over or self.too_many_trailers or self.done)

    def feed(self, data: bytes) -> None:
        """Measure the next bytes of the body (bytes past its end are ignored)."""
        at = 0
        while at < len(data) and self._reading:
            if self._state is _State.DATA:
                taken = min(self._skip, len(data) - at)
                self._skip -= taken
                at += taken
                if not self._skip:
                    self._state = _State.SIZE_LINE
                continue
            end = data.find(b"\n", at)
            if end < 0:
                self._line += data[at:]
                return
            self._line += data[at : end + 1]
            at = end + 1
            line = bytes(self._line)
            self._line.clear()
            self._on_line(line)

    def _on_line(self, line: bytes) -> None:
        if self._state is _State.TRAILERS:
            self.sent += len(line)
            if line.strip() == b"":
                self._state = _State.DONE
            else:
                self.trailer_fields += 1
            return
        if not line.endswith(b"\r\n"):
            self.malformed = True
            self._state = _State.DONE
            return
        digits = 0
        while digits < len(line) and line[digits] in _HEX_DIGITS:
            digits += 1
        if not digits or digits > MAX_SIZE_DIGITS:
            self._state = _State.DONE  # not a chunk-size line h11 takes: it refuses the body
            return
        size = int(line[:digits], 16)
        if size == 0:
            self.sent += len(line)
            self._state = _State.TRAILERS
        else:
            self.chunks += 1
            sent = len(line) + size + 2
            self.sent += sent
            if self.chunks > CHUNKS_AS_SENT:
                self.surcharge += max(0, MIN_CHUNK_BYTES - sent)
            self._state = _State.DATA
            self._skip = size + 2  # the data, then its CRLF
