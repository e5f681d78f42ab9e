"""An image's size read from its header without Pillow, as Pillow reads it: the worker
decodes with Pillow what the serving process weighed. Opened by Pillow in the serving
process, a crafted file made the event loop wait while Pillow read what comes before
the size: a PNG's compressed text chunks (3 s for 11 PNGs), a JPEG's or GIF's comments,
a TIFF's every tag (77 ms an image of 16,000).
"""

from __future__ import annotations

import base64
import io
import struct
import warnings
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rawserve.tasks import estimate_tokens
from rawserve.tasks.image_headers import MOST_STEPS, image_size
from rawserve.tasks.image_sizes import PIXELS_PER_TOKEN, image_tokens

Image = pytest.importorskip("PIL.Image")

SIZES = [(1, 1), (3, 7), (640, 480), (1000, 10), (4000, 3000)]
# each format with the ways of saving it that change its header
SAVED = [
    ("PNG", {}),
    ("JPEG", {}),
    ("JPEG", {"progressive": True}),
    ("JPEG", {"exif": b"Exif\0\0" + bytes(200)}),
    ("GIF", {}),
    ("BMP", {}),
    ("TIFF", {}),
    ("TIFF", {"compression": "tiff_lzw"}),
    ("WEBP", {}),
    ("WEBP", {"lossless": True}),
]


def saved(image, image_format: str, **options) -> bytes:
    file = io.BytesIO()
    image.save(file, image_format, **options)
    return file.getvalue()


def pillows_reading(data: bytes):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Image.open(io.BytesIO(data)) as image:
            return image.size, image.format


def files() -> list[bytes]:
    return [
        saved(Image.new(mode, size), image_format, **options)
        for size in SIZES[:3]
        for mode in ("RGB", "L", "RGBA")
        for image_format, options in SAVED
        if not (image_format == "JPEG" and mode == "RGBA")
    ]


FILES = files()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize(("image_format", "options"), SAVED)
def test_each_format_is_read_as_pillow_reads_it(image_format, options, size):
    data = saved(Image.new("RGB", size, (10, 20, 30)), image_format, **options)
    assert image_size(data) == pillows_reading(data)


def test_the_serving_process_reads_sizes_without_pillow(monkeypatch):
    """Each format weighed by its declared pixels with Pillow unable to open anything."""
    encoded = {
        image_format: base64.b64encode(saved(Image.new("RGB", (640, 480)), image_format))
        for image_format, _ in SAVED
    }

    def refused(*args, **kwargs):
        raise AssertionError("the serving process opened an image with Pillow")

    monkeypatch.setattr(Image, "open", refused)
    for image_format, value in encoded.items():
        assert image_tokens(value.decode()) == 640 * 480 // PIXELS_PER_TOKEN, image_format


def test_a_gif_frame_past_its_screen_grows_the_size_as_pillow_grows_it():
    gif = saved(Image.new("P", (10, 10)), "GIF")
    descriptor = gif.index(b"\x2c", 13)  # the first image descriptor, after the palette
    moved = bytearray(gif)
    moved[descriptor + 1 : descriptor + 9] = struct.pack("<HHHH", 3000, 2000, 10, 10)
    assert image_size(bytes(moved)) == pillows_reading(bytes(moved)) == ((3010, 2010), "GIF")


def test_comments_before_the_size_are_skipped_by_their_lengths():
    """Many comments, each read and kept by Pillow, are passed over by their lengths."""
    jpeg = saved(Image.new("RGB", (800, 600)), "JPEG")
    comment = b"\xff\xfe" + struct.pack(">H", 2 + 60_000) + b"c" * 60_000
    commented_jpeg = jpeg[:2] + comment * 3 + jpeg[2:]
    gif = saved(Image.new("P", (800, 600)), "GIF")
    palette_end = gif.index(b"\x2c", 13)
    comments = (b"\x21\xfe" + (b"\xff" + b"c" * 255) * 200 + b"\x00") * 3
    commented_gif = gif[:palette_end] + comments + gif[palette_end:]
    for data in (commented_jpeg, commented_gif):
        assert image_size(data) == pillows_reading(data)
        assert image_size(data)[0] == (800, 600)


def test_a_header_behind_more_blocks_than_a_file_has_is_weighed_by_its_bytes():
    """Thousands of four-byte comments, or one-byte comment blocks, cost the event loop
    a step each: past `MOST_STEPS` the image is weighed by its bytes instead."""
    jpeg = saved(Image.new("RGB", (64, 64)), "JPEG")
    gif = saved(Image.new("P", (64, 64)), "GIF")
    palette_end = gif.index(b"\x2c", 13)

    def jpeg_commented(comments: int) -> bytes:
        return jpeg[:2] + b"\xff\xfe\x00\x02" * comments + jpeg[2:]

    def gif_commented(blocks: int) -> bytes:
        return gif[:palette_end] + b"\x21\xfe" + b"\x01c" * blocks + b"\x00" + gif[palette_end:]

    for crafted, image_format in ((jpeg_commented, "JPEG"), (gif_commented, "GIF")):
        assert image_size(crafted(MOST_STEPS // 2)) == ((64, 64), image_format)
        many = crafted(50 * MOST_STEPS)
        assert image_size(many) is None
        value = base64.b64encode(many).decode()
        assert image_tokens(value) == estimate_tokens(value)


def test_a_gif_frame_is_found_where_pillow_finds_it_past_an_extension_s_empty_block():
    """An extension whose first sub-block is empty reads on to the next empty one in
    Pillow: a frame descriptor of 1x1 behind it (and a screen of 1x1) was taken for the
    image, and 36 megapixels costed as one tile (a tester)."""
    gif = saved(Image.new("P", (3000, 2000)), "GIF")
    descriptor = gif.index(b"\x2c", 13)
    decoy = b"\x2c" + struct.pack("<HHHH", 0, 0, 1, 1) + b"\x00" + bytes(35)
    screen = gif[:6] + struct.pack("<HH", 1, 1) + gif[10:descriptor]
    for extension in (b"\x21\x01\x00", b"\x21\xff\x0bNETSCAPE2.0\x00"):
        crafted = screen + extension + decoy + b"\x00" + gif[descriptor:]
        assert image_size(crafted) == pillows_reading(crafted) == ((3000, 2000), "GIF")


def test_a_png_chunk_before_its_header_is_skipped_as_pillow_skips_it():
    png = saved(Image.new("1", (9400, 9400)), "PNG", optimize=True)
    for kind, body in ((b"tEXt", b"a\x00b"), (b"prVt", b"")):
        chunk = (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )
        crafted = png[:8] + chunk + png[8:]
        assert image_size(crafted) == pillows_reading(crafted) == ((9400, 9400), "PNG")


def test_offsets_past_any_file_leave_the_image_weighed_by_its_bytes():
    """A BigTIFF's 64-bit offset of 2**63 raised OverflowError: a 500 (a tester)."""
    directory_far = b"II+\x00\x08\x00\x00\x00" + struct.pack("<Q", 2**63) + bytes(16)
    field_far = b"II+\x00\x08\x00\x00\x00" + struct.pack("<Q", 16) + struct.pack("<Q", 1)
    field_far += struct.pack("<HHQQ", 256, 4, 3, 2**63)
    for crafted in (directory_far, field_far, b"II*\x00\xff\xff\xff\xff"):
        assert image_size(crafted) is None
        value = base64.b64encode(crafted).decode()
        assert image_tokens(value) == estimate_tokens(value)


def test_a_tiff_size_is_read_from_its_first_directory_whatever_follows():
    """16,000 tags after the size: Pillow read them all; only the two are read here."""
    fields = [struct.pack("<HHII", 256, 4, 1, 300), struct.pack("<HHII", 257, 3, 1, 200)]
    fields += [struct.pack("<HHII", 40_000 + index, 3, 1, 1) for index in range(16_000)]
    directory = struct.pack("<H", len(fields)) + b"".join(fields) + bytes(4)
    tiff = b"II*\x00" + struct.pack("<I", 8) + directory
    assert image_size(tiff) == ((300, 200), "TIFF")


@settings(
    max_examples=300,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_damaged_headers_are_read_as_pillow_reads_them_or_not_at_all(data):
    """A file with some of its first bytes changed: the reading raises nothing, and a size
    it reads is the size Pillow reads (or Pillow cannot open it, nor the worker)."""
    original = data.draw(st.sampled_from(FILES))
    damaged = bytearray(original[:2048])
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, min(len(damaged), 300) - 1))
        if data.draw(st.booleans()):
            damaged[at] = data.draw(st.integers(0, 255))
        else:  # bytes put in: a block, a chunk, a marker where none was
            damaged[at:at] = data.draw(st.binary(min_size=1, max_size=12))
    read = image_size(bytes(damaged))
    try:
        expected = pillows_reading(bytes(damaged) + original[2048:])
    except Exception:  # noqa: BLE001 - Pillow refuses it: the worker answers 422
        return
    assert read is None or read[0] == expected[0]
