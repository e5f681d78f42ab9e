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
import warnings
from typing import Any

from rawserve.tasks.image_headers import JPEG_SCAN
from rawserve.tasks.image_sizes import DRAFTED_FORMATS, IMAGE_FORMATS, shrink_factors

# The most scans a JPEG is read with: each is a pass over the whole image (a photo's
# progressive JPEG has about ten), and 20,000 of them, a smallest one repeated, made a 421
# KB file of 4000x4000 take 6 s to decode; 256 still took ten times a photo's decode
# (libjpeg-turbo's advice for untrusted files: `djpeg -maxscans`). A start-of-scan marker
# cannot hide in the image data (a 0xFF there is followed by 0x00 or a restart marker),
# so counting its bytes counts at least them.
MAX_JPEG_SCANS = 64
JPEG_START_OF_SCAN = bytes((0xFF, JPEG_SCAN))
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
            data = base64.b64decode(encoded)
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        width, height = image.size
        if (
            image.format in DRAFTED_FORMATS
            and (scans := data.count(JPEG_START_OF_SCAN)) > MAX_JPEG_SCANS
        ):
            raise ImageRefused(
                f"the JPEG holds {scans:,} scans; at most {MAX_JPEG_SCANS} are read (each is "
                "a pass over the whole image)"
            )
        if not squashed and max(width, height) > MAX_ASPECT * min(width, height):
            raise ImageRefused(
                f"the image is {width}x{height} pixels; this model reads an image at most "
                f"{MAX_ASPECT} times as long as it is wide"
            )
        if image.format in DRAFTED_FORMATS:  # at no more than the size it is shrunk to
            across, down = shrink_factors(image.size, squashed)
            image.draft("RGB", (width // across, height // down))
        image.load()  # here, not lazily in the pipeline: a file cut short is the client's
        factors = shrink_factors(image.size, squashed)  # (of the size decoded: a draft's)
        if image.mode in GREY_MODES:
            # its RGB is each level three times: shrunk first, to the same pixels, at a
            # third of the memory (a 170 KB 16-bit PNG of 4095x21850 took 0.86 GB)
            image, factors = reduced(eight_bit_grey(image), factors), (1, 1)
        # (Pillow shrinks no palette image; others' RGB is not their pixels' average)
        return upright(reduced(image if image.mode == "RGB" else image.convert("RGB"), factors))
    except ImageRefused:
        raise
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise ImageRefused(
            f"the image has more than {Image.MAX_IMAGE_PIXELS:,} pixels, the most read"
        ) from exc
    # (Pillow raises SyntaxError for a broken PNG chunk: "broken PNG file")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as exc:
        formats = ", ".join(IMAGE_FORMATS)
        raise ImageRefused(f"the input is not an image Pillow can read ({formats})") from exc


# Pillow's modes of a 16-bit grey image (PNG's, TIFF's), and of every grey one
SIXTEEN_BIT_GREY = ("I;16", "I;16B", "I;16L", "I;16N")
GREY_MODES = ("1", "L", *SIXTEEN_BIT_GREY)


def eight_bit_grey(image: Any) -> Any:
    """A grey image at 8 bits a pixel ("L", which Pillow shrinks): a one-bit one as 0 and
    255, as its RGB reads it; a 16-bit one as a viewer shows it (Pillow's conversion
    clips each value at 255: a mid grey, 32768, was read as white, as the pipeline reads
    it), rounded at 2 bytes a pixel (by way of 32-bit levels it took twice the memory).
    16-bit colour is read at 8 bits by Pillow."""
    if image.mode in SIXTEEN_BIT_GREY:  # (its levels stay "I;16" until then)
        # (Pillow's point takes "I;16" and "I" alone: a big-endian TIFF's "I;16B" was
        # refused as no image)
        levels = image if image.mode == "I;16" else image.convert("I")
        return levels.point(lambda value: value * (1 / 257) + 0.5).convert("L")
    return image.convert("L") if image.mode == "1" else image


def upright(image: Any) -> Any:
    """`image` turned as its EXIF orientation says, as the pipeline turns it (which then
    finds no orientation left); an EXIF block that cannot be read (not TIFF data) is
    dropped and the picture taken as stored, as viewers show it: the pipeline failed on
    it with a 500."""
    from PIL import ImageOps

    try:
        ImageOps.exif_transpose(image, in_place=True)  # (else it copies an upright one)
    except (SyntaxError, ValueError, OSError, EOFError, IndexError, KeyError):
        image.info.pop("exif", None)
    return image


def reduced(image: Any, factors: tuple[int, int]) -> Any:
    """`image` shrunk by whole `factors` (`shrink_factors`), each pixel the mean of those
    it stands for."""
    return image if factors == (1, 1) else image.reduce(factors)


def blank_image() -> Any:
    """One black pixel: what a batch nobody waits for reads in place of its next image."""
    from PIL import Image  # the optional `image` extra

    return Image.new("RGB", (1, 1))
