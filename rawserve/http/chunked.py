"""The size of a chunked request body as the client sends it, not only as h11 delivers it.

h11 hands over a chunked body's data and drops its framing: the chunk-size lines (with
any chunk extensions) and the trailer fields. A client could send megabytes of
extensions around a few bytes of data, or announce a chunk of 2^76 bytes and trickle it.
`ChunkedMeter` reads the same bytes alongside h11 (it only measures; h11 still parses
and refuses malformed framing) and counts toward the body limit every chunk's announced
size, its extensions, and the trailers, so both are refused with 413 as soon as they are
announced. Knows nothing of sockets or of the rest of HTTP.
"""

from __future__ import annotations

import enum

_HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")
MAX_SIZE_DIGITS = 20  # h11 refuses longer chunk sizes as malformed


class _State(enum.Enum):
    SIZE_LINE = "size line"  # reading a chunk-size line, up to its CRLF
    DATA = "data"  # skipping a chunk's data and its CRLF
    TRAILERS = "trailers"  # after the last chunk: trailer lines, up to an empty one
    DONE = "done"


class ChunkedMeter:
    def __init__(self, limit: int):
        self.limit = limit
        self.counted = 0  # announced data, extension and trailer bytes so far
        self._state = _State.SIZE_LINE
        self._line = bytearray()
        self._skip = 0  # data and CRLF bytes left in the current chunk

    @property
    def over(self) -> bool:
        """Over the limit, counting a size or trailer line still waiting for its end."""
        return self.counted + len(self._line) > self.limit

    @property
    def done(self) -> bool:
        return self._state is _State.DONE

    def feed(self, data: bytes) -> None:
        """Measure the next bytes of the body (bytes past its end are ignored)."""
        at = 0
        while at < len(data) and not self.over and self._state is not _State.DONE:
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
            if line.strip() == b"":
                self._state = _State.DONE
            else:
                self.counted += len(line)
            return
        digits = 0
        while digits < len(line) and line[digits] in _HEX_DIGITS:
            digits += 1
        if not digits or digits > MAX_SIZE_DIGITS:
            self._state = _State.DONE  # not a chunk-size line h11 takes: it refuses the body
            return
        size = int(line[:digits], 16)
        extension = len(line.rstrip(b"\r\n")) - digits
        self.counted += size + extension
        if size == 0:
            self._state = _State.TRAILERS
        else:
            self._state = _State.DATA
            self._skip = size + 2  # the data, then its CRLF
