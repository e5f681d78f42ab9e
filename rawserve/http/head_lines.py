"""The lines of a request head, counted as its bytes come, before h11 parses them.

h11 parses a head line by line, ~2.7 µs a line: a head of 16 KiB in 3,000 one-letter
header lines took 8 ms of the event loop, 40 times one of the same size in 10 lines.
Past `MAX_HEADER_LINES` fields (Apache's default limit) the head is refused (431) from
its bytes, before h11 reads it. Plain bytes work; no I/O.
"""

from __future__ import annotations

MAX_HEADER_LINES = 100  # header fields a request head may have (its request line aside)
# the most of a request line kept for a refusal's shape (OpenAI's on its routes)
REQUEST_LINE_KEPT = 8192


class HeadLines:
    """One head's lines so far, up to its end (the empty line after its last field)."""

    def __init__(self) -> None:
        self.count = 0
        self.ended = False
        self._tail = b""  # the last bytes before these: an end may span two reads
        # the request line, once whole: the path of a head refused before h11 parsed it
        self.request_line = b""
        self._start = b""

    def add(self, data: bytes) -> None:
        if self.ended:
            return
        if not self.request_line and len(self._start) <= REQUEST_LINE_KEPT:
            self._start += data[: REQUEST_LINE_KEPT + 1 - len(self._start)]
            line, ended, _ = self._start.partition(b"\n")
            self.request_line = line.rstrip(b"\r") if ended else b""
        seen = self._tail + data
        ends = [at for at in (seen.find(b"\n\r\n"), seen.find(b"\n\n")) if at >= 0]
        stop = min(ends) + 1 if ends else len(seen)  # (the empty line's own end not counted)
        start = len(self._tail)  # the tail's line ends are counted already
        if stop > start:
            self.count += seen.count(b"\n", start, stop)
        self.ended = bool(ends)
        self._tail = seen[-2:]

    @property
    def too_many(self) -> bool:
        return self.count > MAX_HEADER_LINES + 1  # (the request line ends in one too)
