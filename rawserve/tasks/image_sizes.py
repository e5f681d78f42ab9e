"""What an image input costs, read from its header in the server before any worker decodes
it, and the sizes the worker shrinks an image to, which that cost follows.

An image costs the worker its pixels, not its bytes: an 11 KB PNG can declare 4095x21850
one-bit pixels, and 32 PNGs of 14 KB declaring 9400x9400 each went as one batch, costed
as 32 thumbnails, and held a CPU worker 19 s. Its header says how many
(`image_headers`), so the server can weigh an image by what the worker will decode.
"""

from __future__ import annotations

import base64
import binascii
import math

from rawserve.tasks.estimate import BYTES_PER_TOKEN
from rawserve.tasks.image_headers import image_size

# The formats an image input is read in: the raster ones clients send. Pillow opens
# forty-odd by default, EPS among them, which it renders by running Ghostscript on the
# client's PostScript wherever Ghostscript is installed.
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "TIFF", "WEBP")
# The formats libjpeg can decode at 1/2, 1/4 or 1/8 of their size: a JPEG, and the JPEG
# of several pictures that phones and cameras write, which Pillow opens as "MPO".
DRAFTED_FORMATS = ("JPEG", "MPO")
LARGEST_DRAFT = 8  # libjpeg's smallest scale: 1/8
# An image is shrunk by a whole factor to no less than this many pixels a side: several
# times any classifier's input (224 to 1024). A processor that resizes to a fixed height
# and width drops the aspect ratio, so each side is shrunk on its own; one that keeps it
# (scaling the shorter side) gets the image shrunk alike on both.
KEPT_SIDE = 2048
# The most pixels an image keeps where the processor keeps the aspect ratio: as many as one
# it squashes keeps at most (each side under twice `KEPT_SIDE`). Its shorter side alone
# left a long one whole: 4095x21850 pixels, 3.8 s and 2 GB in a ConvNeXt's processor.
KEPT_PIXELS = (2 * KEPT_SIDE) ** 2
# The shorter side an image is never shrunk below to reach `KEPT_PIXELS`: as large as any
# classifier's input, and so several times what such a processor scales it to (224 to 448).
MIN_KEPT_SIDE = KEPT_SIDE // 2

# An image's cost in the scheduler's tokens: a tile of this many decoded pixels each (a
# 224x224 image 12, a 12-megapixel photo 2,929, a 48-megapixel one's JPEG, decoded at
# half size, as many, a PNG of 9400x9400 21,572); what a token costs in seconds the
# scheduler measures, as for text.
PIXELS_PER_TOKEN = 64 * 64
# The base64 read for an image's header: a PNG's, GIF's, BMP's or WebP's is in its first
# bytes, a JPEG's after its metadata (EXIF's 64 KB at most a segment). A header beyond it
# (TIFF may put it last) leaves the image costed by its bytes, which are then as many.
HEADER_CHARS = 4 * 64 * 1024


def shrink_factors(size: tuple[int, int], squashed: bool) -> tuple[int, int]:
    """The whole factors an image of `size` is shrunk by, across and down: to no less than
    `KEPT_SIDE` a side, each side on its own where the processor drops the aspect ratio
    (`squashed`). Where it keeps it, both alike, and further to `KEPT_PIXELS` while the
    shorter side stays `MIN_KEPT_SIDE` or more: the processor scales that side to its own
    few hundred pixels, and the long side with it, so it reads the image the same."""
    width, height = size
    if squashed:
        return (max(1, width // KEPT_SIDE), max(1, height // KEPT_SIDE))
    shorter = min(width, height)
    to_pixels = math.ceil(math.sqrt(width * height / KEPT_PIXELS))
    factor = max(1, shorter // KEPT_SIDE, min(to_pixels, shorter // MIN_KEPT_SIDE))
    return (factor, factor)


def decoded_pixels(size: tuple[int, int], image_format: str | None) -> int:
    """The pixels the worker decodes of an image of `size`: all of them, but for a JPEG,
    which libjpeg decodes at 1/2, 1/4 or 1/8 of its size where it is shrunk that far (by
    the smaller factor of a side, as a processor that keeps the aspect ratio shrinks)."""
    width, height = size
    if image_format not in DRAFTED_FORMATS:
        return width * height
    factor = min(shrink_factors(size, squashed=True))
    scale = 1
    while scale * 2 <= min(factor, LARGEST_DRAFT):
        scale *= 2
    return math.ceil(width / scale) * math.ceil(height / scale)


def image_tokens(encoded: str) -> int:
    """An image input's cost in tokens (`PIXELS_PER_TOKEN` decoded pixels each), read
    from its header; by its bytes where no header is read there (Pillow, the `image`
    extra, missing; the header cut off; more pixels than Pillow reads, which the worker
    refuses from the header at once)."""
    by_bytes = 2 + len(encoded) // BYTES_PER_TOKEN
    try:
        from PIL import Image  # the optional `image` extra, which image models need

        head = base64.b64decode(encoded[:HEADER_CHARS])
    except (ImportError, binascii.Error, ValueError):
        return by_bytes
    declared = image_size(head)
    if declared is None:  # no header in what was read: weighed by its bytes
        return by_bytes
    size, image_format = declared
    pixels = size[0] * size[1]
    if Image.MAX_IMAGE_PIXELS is not None and pixels > Image.MAX_IMAGE_PIXELS:
        return by_bytes
    return max(1, decoded_pixels(size, image_format) // PIXELS_PER_TOKEN)
