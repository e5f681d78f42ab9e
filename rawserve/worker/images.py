"""An image input, from the base64 text it is queued as to the RGB PIL image the model's
image processor reads: refused where it is not an image, is a decompression bomb, or
would cost the processor far more than its bytes say; shrunk, where it is much larger
than any model reads, before the processor's own resize of it.

What an image costs the processor is its pixels, not its bytes: an 11 KB PNG can
declare 4095x21850 one-bit pixels (6 s and 1.5 GB in a ViT's processor, at full size),
and a one-pixel-wide one of 100,000 pixels made a processor that keeps the aspect ratio
(ConvNeXt's, ResNet's: the shorter side scaled to 224) build an image of billions.
"""

from __future__ import annotations

import base64
import io
import math
import warnings
from typing import Any

# The formats an image input is read in: the raster ones clients send. Pillow opens
# forty-odd by default, EPS among them, which it renders by running Ghostscript on the
# client's PostScript wherever Ghostscript is installed.
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "TIFF", "WEBP")
# The formats libjpeg can decode at 1/2, 1/4 or 1/8 of their size: a JPEG, and the JPEG
# of several pictures that phones and cameras write, which Pillow opens as "MPO".
DRAFTED_FORMATS = ("JPEG", "MPO")
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
# The longest side, in shorter sides, of an image given to a processor that keeps the
# aspect ratio: scaled to its 224 or so pixels on the shorter side, the image it builds
# is this many times as long (a 1x1000 image took 3 s; 1x100000 took the worker down).
MAX_ASPECT = 100


class ImageRefused(ValueError):
    """An image the server will not read, for a reason its message gives the client."""


def decode_image(encoded: str, squashed: bool = True) -> Any:
    """base64 text → an RGB PIL image, shrunk by `shrink_factors` (a JPEG or an MPO decoded
    at 1/2, 1/4 or 1/8 of its size by libjpeg, which is faster still). `squashed`: the
    model's processor resizes to a fixed height and width (otherwise it keeps the aspect
    ratio, and an image longer than `MAX_ASPECT` times its width is refused). Anything
    that is not an image in `IMAGE_FORMATS` is the client's error (ValueError), and so is
    an image of more pixels than Pillow's limit against decompression bombs (a few
    hundred kilobytes of PNG can declare gigabytes of pixels: the header says so before
    anything is decoded)."""
    from PIL import Image, UnidentifiedImageError  # the optional `image` extra

    try:
        with warnings.catch_warnings():
            # Pillow only warns past its limit (and refuses past twice that): refuse both
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(base64.b64decode(encoded)), formats=IMAGE_FORMATS)
        width, height = image.size
        if not squashed and max(width, height) > MAX_ASPECT * min(width, height):
            raise ImageRefused(
                f"the image is {width}x{height} pixels; this model reads an image at most "
                f"{MAX_ASPECT} times as long as it is wide"
            )
        if image.format in DRAFTED_FORMATS:  # at no more than the size it is shrunk to
            across, down = shrink_factors(image.size, squashed)
            image.draft("RGB", (width // across, height // down))
        image.load()  # here, not lazily in the pipeline: a file cut short is the client's
        # (Pillow shrinks no palette, one-bit or 16-bit image)
        return shrunk(image if image.mode == "RGB" else image.convert("RGB"), squashed)
    except ImageRefused:
        raise
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise ImageRefused(
            f"the image has more than {Image.MAX_IMAGE_PIXELS:,} pixels, the most read"
        ) from exc
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        formats = ", ".join(IMAGE_FORMATS)
        raise ImageRefused(f"the input is not an image Pillow can read ({formats})") from exc


def shrunk(image: Any, squashed: bool) -> Any:
    """`image` shrunk by its `shrink_factors`."""
    factors = shrink_factors(image.size, squashed)
    return image if factors == (1, 1) else image.reduce(factors)


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


def blank_image() -> Any:
    """One black pixel: what a batch nobody waits for reads in place of its next image."""
    from PIL import Image  # the optional `image` extra

    return Image.new("RGB", (1, 1))
