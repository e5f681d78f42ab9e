"""An image's width and height read from the first bytes of its file, in the serving
process, for the scheduler to weigh it: each format's few size fields, the rest skipped by
the lengths the file declares.

Not by Pillow, which reads what comes before the size as it opens a file, and in Python:
it inflates a PNG's compressed text chunks (11 crafted PNGs held the event loop 3 s),
collects a JPEG's and a GIF's comments, and reads a TIFF's every tag (16,000 of them,
77 ms an image). Each reader follows where Pillow takes the size from, so the worker,
opening the whole file with Pillow, decodes what was weighed.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable

Size = tuple[int, int]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_CHUNK_TYPE = re.compile(rb"\w{4}")  # what Pillow takes for a chunk's type
# JPEG markers as Pillow reads them: those that frame an image (SOF0-15 but DHT, JPG and
# DAC, and DHP), those with no length after them, and those Pillow knows at all (one it
# does not ends its reading).
JPEG_FRAMES = frozenset({*range(0xC0, 0xD0), 0xDE}) - {0xC4, 0xC8, 0xCC}
JPEG_BARE = frozenset({0xC8, *range(0xD0, 0xDA), *range(0xF0, 0xFE)})
JPEG_KNOWN = frozenset(range(0xC0, 0xFF))
JPEG_SCAN = 0xDA  # start of scan: the image data follows, and no more headers
GIF_EXTENSION, GIF_IMAGE, GIF_TRAILER = 0x21, 0x2C, 0x3B
GIF_COMMENT, GIF_APPLICATION = 0xFE, 0xFF  # extension labels Pillow reads apart
# the sizes of the BMP information headers Pillow reads width and height from as 32 bits
# (12, OS/2's, has them as 16)
BMP_INFO_HEADERS = (40, 52, 56, 64, 108, 124)
TIFF_WIDTH, TIFF_HEIGHT = 256, 257
# The markers, blocks or stray bytes a reader passes before it gives up and the image is
# weighed by its bytes: a photo's JPEG has a dozen before its frame header, and a crafted
# one of 4-byte comments 49,000 in what is read (20 ms an image, each in the event loop).
MOST_STEPS = 1024
# TIFF field types Pillow reads a size from, by their struct format
TIFF_INTEGERS = {1: "B", 3: "H", 4: "I", 6: "b", 8: "h", 9: "i", 16: "Q", 17: "q"}


def image_size(head: bytes) -> tuple[Size, str] | None:
    """The width and height an image declares, with its format as Pillow names it, from
    `head`, its first bytes; None where they are no image of `READERS`' formats, or the
    size lies past them."""
    for signatures, image_format, reader in READERS:
        if head.startswith(signatures):
            try:
                size = reader(head)
            except (struct.error, OverflowError, IndexError):  # fields past any sense
                return None
            if size is None or min(size) <= 0:
                return None
            return size, image_format
    return None


def png_size(head: bytes) -> Size | None:
    """From the last IHDR chunk before the image data, the chunks between skipped by
    their lengths (the format puts IHDR first; Pillow reads one after others too); None
    where the image data is not reached in `head`."""
    size = None
    position = len(PNG_SIGNATURE)
    for _ in range(MOST_STEPS):
        if position + 8 > len(head):
            return None
        length, kind = struct.unpack(">I4s", head[position : position + 8])
        if not PNG_CHUNK_TYPE.fullmatch(kind):
            return None  # Pillow: "broken PNG file"
        if kind == b"IDAT":
            return size
        if kind == b"IHDR" and position + 16 <= len(head):
            size = struct.unpack(">II", head[position + 8 : position + 16])
        position += 12 + length  # length, type, data, CRC
    return None


def jpeg_size(head: bytes) -> Size | None:
    """From the last frame header before the scan, each marker's segment skipped by its
    length, junk between markers by a search, as Pillow walks them; None where the scan
    is not reached in `head` (a later frame header could change the size)."""
    size = None
    position = 2  # past the start-of-image marker: the next marker's 0xFF
    for _ in range(MOST_STEPS):
        if position + 1 >= len(head):
            break
        if head[position] != 0xFF:
            position = head.find(b"\xff", position)
            if position < 0:
                break
            continue
        marker = head[position + 1]
        if marker == 0xFF:  # fill: the second 0xFF starts the marker
            position += 1
            continue
        position += 2
        if marker == 0x00 or marker in JPEG_BARE:
            continue
        if marker not in JPEG_KNOWN:
            return None  # Pillow stops: "no marker found"
        if position + 2 > len(head):
            break
        length = int.from_bytes(head[position : position + 2], "big")
        if marker in JPEG_FRAMES:
            if position + 7 > len(head):
                break
            height, width = struct.unpack(">HH", head[position + 3 : position + 7])
            size = (width, height)
        if marker == JPEG_SCAN:
            return size
        position += max(length, 2)
    return None


def gif_size(head: bytes) -> Size | None:
    """The logical screen's size, grown to hold the first frame where that reaches past
    it (as Pillow grows it); the blocks before that frame skipped by their lengths."""
    if len(head) < 13:
        return None
    width, height, flags = struct.unpack("<HHB", head[6:11])
    position = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    steps = 0
    while position < len(head):
        block = head[position]
        if block == GIF_TRAILER:
            return None
        if block == GIF_IMAGE:
            if position + 9 > len(head):
                return None
            left, top, across, down = struct.unpack("<HHHH", head[position + 1 : position + 9])
            return (max(width, left + across), max(height, top + down))
        if block == GIF_EXTENSION:
            position, sub_blocks = skip_gif_extension(head, position + 1)
            steps += sub_blocks
        else:
            position += 1  # Pillow passes over a byte that starts no block
        steps += 1
        if steps > MOST_STEPS:
            return None
    return None


def skip_gif_extension(head: bytes, position: int) -> tuple[int, int]:
    """Where an extension whose label is at `position` ends, as Pillow reads it, and how
    many sub-blocks it read: a comment's up to its first empty one; any other's first
    sub-block whatever its length (an empty one ends nothing there), a NETSCAPE
    application block's next one too, then sub-blocks up to an empty one."""
    label = head[position] if position < len(head) else None
    first, position = gif_sub_block(head, position + 1)
    block, steps = first, 1
    if label == GIF_COMMENT:
        while block and steps <= MOST_STEPS:
            block, position = gif_sub_block(head, position)
            steps += 1
        return position, steps
    if label == GIF_APPLICATION and first and first.startswith(b"NETSCAPE2.0"):
        _, position = gif_sub_block(head, position)
        steps += 1
    while steps <= MOST_STEPS:
        block, position = gif_sub_block(head, position)
        steps += 1
        if not block:
            break
    return position, steps


def gif_sub_block(head: bytes, position: int) -> tuple[bytes | None, int]:
    """The sub-block at `position` (a length byte and that many bytes) and where the next
    starts; None for an empty one, which ends a run of them (or for none left)."""
    if position >= len(head):
        return None, position
    length = head[position]
    if not length:
        return None, position + 1
    return head[position + 1 : position + 1 + length], position + 1 + length


def bmp_size(head: bytes) -> Size | None:
    if len(head) < 26:
        return None
    header = int.from_bytes(head[14:18], "little")
    if header == 12:
        return struct.unpack("<HH", head[18:22])
    if header not in BMP_INFO_HEADERS:
        return None
    width, height = struct.unpack("<II", head[18:26])
    if head[25] == 0xFF:  # a negative height: the rows stored top-down
        height = 2**32 - height
    return (width, height)


def tiff_size(head: bytes) -> Size | None:
    """From the width and height fields of the first directory, of a TIFF or BigTIFF,
    either byte order; the fields past them unread (an offset past `head` raises)."""
    order = "<" if head[:2] == b"II" else ">"
    big = head[2:4] in (b"+\x00", b"\x00+")
    offset_format, count_format, entry = ("Q", "Q", 20) if big else ("I", "H", 12)
    offset_at = 8 if big else 4
    (directory,) = struct.unpack_from(order + offset_format, head, offset_at)
    (entries,) = struct.unpack_from(order + count_format, head, directory)
    first = directory + struct.calcsize(count_format)
    inline = 8 if big else 4  # a value of more bytes is stored where this many point
    found: dict[int, int] = {}
    for index in range(min(entries, (len(head) - first) // entry, MOST_STEPS)):
        at = first + index * entry
        tag, kind = struct.unpack_from(order + "HH", head, at)
        if tag not in (TIFF_WIDTH, TIFF_HEIGHT) or kind not in TIFF_INTEGERS:
            continue
        (count,) = struct.unpack_from(order + offset_format, head, at + 4)
        value_at = at + entry - inline
        if count * struct.calcsize(TIFF_INTEGERS[kind]) > inline:
            (value_at,) = struct.unpack_from(order + offset_format, head, value_at)
        (found[tag],) = struct.unpack_from(order + TIFF_INTEGERS[kind], head, value_at)
        if len(found) == 2:
            return (found[TIFF_WIDTH], found[TIFF_HEIGHT])
    return None


def webp_size(head: bytes) -> Size | None:
    """The canvas's size from the first chunk: a lossy, lossless or extended one's."""
    if head[8:12] != b"WEBP":
        return None
    chunk = head[12:16]
    if chunk == b"VP8 " and len(head) >= 30 and head[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack("<HH", head[26:30])
        return (width & 0x3FFF, height & 0x3FFF)
    if chunk == b"VP8X" and len(head) >= 30:
        return (
            int.from_bytes(head[24:27], "little") + 1,
            int.from_bytes(head[27:30], "little") + 1,
        )
    if chunk == b"VP8L" and len(head) >= 25 and head[20] == 0x2F:
        bits = int.from_bytes(head[21:25], "little")
        return ((bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
    return None


# Each format's signatures, its name as Pillow gives it, and its reader: the formats of
# `image_sizes.IMAGE_FORMATS`, which are all a worker opens.
READERS: tuple[tuple[tuple[bytes, ...], str, Callable[[bytes], Size | None]], ...] = (
    ((PNG_SIGNATURE,), "PNG", png_size),
    ((b"\xff\xd8\xff",), "JPEG", jpeg_size),
    ((b"GIF87a", b"GIF89a"), "GIF", gif_size),
    ((b"BM",), "BMP", bmp_size),
    ((b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"), "TIFF", tiff_size),
    ((b"RIFF",), "WEBP", webp_size),
)
