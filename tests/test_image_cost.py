"""What an image costs the scheduler: the pixels its header declares, which the worker
will decode (a JPEG's at the scale libjpeg decodes it), not its bytes. By its bytes, 32
PNGs of 14 KB declaring 9400x9400 pixels went as one batch costed as thumbnails, and a
photo's JPEG of a few megabytes was over a GPU's token budget alone, so photos went one
to a batch.
"""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import zlib

import pytest

from rawserve.serving import SchedulerCore
from rawserve.tasks import estimate_tokens, input_estimate
from rawserve.tasks.image_sizes import (
    HEADER_CHARS,
    PIXELS_PER_TOKEN,
    decoded_pixels,
    image_tokens,
    shrink_factors,
)
from tests.test_scheduler import next_batch, queue_items

Image = pytest.importorskip("PIL.Image")

GPU_TOKEN_BUDGET = 16_384  # --max-batch-tokens' default on a GPU


def encoded(image, image_format: str, **options) -> str:
    file = io.BytesIO()
    image.save(file, image_format, **options)
    return base64.b64encode(file.getvalue()).decode("ascii")


@pytest.fixture(scope="module")
def photo() -> str:
    """A 12-megapixel photo's JPEG (of one colour: quick to make, the header is the same)."""
    return encoded(Image.new("RGB", (4000, 3000), (90, 120, 150)), "JPEG")


def test_a_small_png_declaring_many_pixels_costs_its_pixels():
    declared = encoded(Image.new("1", (9400, 9400)), "PNG", optimize=True)
    assert len(declared) < 20_000  # bytes a hundred-odd tokens of text would have
    assert image_tokens(declared) == 9400 * 9400 // PIXELS_PER_TOKEN
    thumbnail = encoded(Image.new("RGB", (224, 224), (1, 2, 3)), "PNG")
    assert image_tokens(thumbnail) == 224 * 224 // PIXELS_PER_TOKEN
    assert image_tokens(declared) > 1000 * image_tokens(thumbnail)


@pytest.mark.parametrize("size", [(300, 200), (2100, 500), (4000, 3000), (9000, 9000)])
def test_a_jpeg_costs_the_pixels_the_worker_decodes(size):
    """The worker asks libjpeg for the image at its shrunk size (`decode_image`); the
    cost follows what libjpeg then decodes, at 1/1 to 1/8 of it."""
    jpeg = encoded(Image.new("RGB", size, (5, 6, 7)), "JPEG")
    image = Image.open(io.BytesIO(base64.b64decode(jpeg)))
    across, down = shrink_factors(image.size, squashed=True)
    image.draft("RGB", (size[0] // across, size[1] // down))
    drafted = image.size[0] * image.size[1]
    assert decoded_pixels(size, "JPEG") == drafted
    assert image_tokens(jpeg) == max(1, drafted // PIXELS_PER_TOKEN)


def test_what_shows_no_header_is_weighed_by_its_bytes():
    png = encoded(Image.new("RGB", (64, 64)), "PNG")
    not_an_image = base64.b64encode(b"hello world, not a picture").decode()
    cut_short = base64.b64encode(base64.b64decode(png)[:12]).decode()
    for value in (not_an_image, cut_short):
        assert image_tokens(value) == estimate_tokens(value)


def test_a_header_past_what_is_read_leaves_the_bytes_to_weigh_it():
    """A JPEG whose comments push its frame header past `HEADER_CHARS` is weighed by its
    bytes, as many tokens as the header's place is deep; one comment, and it is read."""
    plain = base64.b64decode(encoded(Image.new("RGB", (64, 64)), "JPEG"))

    def commented(comments: int) -> str:
        comment = b"\xff\xfe" + (65_535).to_bytes(2, "big") + b"x" * 65_533  # COM, its most
        return base64.b64encode(plain[:2] + comment * comments + plain[2:]).decode()

    assert image_tokens(commented(1)) == 1  # 64x64: one tile
    deep = commented(4)
    assert len(deep) > HEADER_CHARS
    assert image_tokens(deep) == estimate_tokens(deep) > HEADER_CHARS // 4


def test_a_png_is_weighed_by_its_ihdr_whatever_text_chunks_follow():
    """Opened by Pillow, a PNG's compressed text chunks were inflated before its size was
    known: 60 of 1 KB inflating to 1 MB each held the serving process's event loop a
    quarter of a second an image (a tester); past Pillow's 64 MB of text it was then
    weighed by its bytes."""
    png = base64.b64decode(encoded(Image.new("RGB", (640, 480)), "PNG"))

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    text = zlib.compress(b"a" * (1 << 20), 9)
    texts = b"".join(chunk(b"zTXt", b"k%d\0\0" % i + text) for i in range(70))
    crafted = base64.b64encode(png[:33] + texts + png[33:]).decode()
    assert image_tokens(crafted) == 640 * 480 // PIXELS_PER_TOKEN


def test_an_image_over_pillows_limit_is_weighed_by_its_bytes_as_the_worker_refuses_it():
    """The worker refuses it from its header at once: it costs nothing like its pixels."""
    bomb = encoded(Image.new("1", (10_000, 10_000)), "PNG", optimize=True)
    assert Image.MAX_IMAGE_PIXELS < 10_000 * 10_000
    assert image_tokens(bomb) == estimate_tokens(bomb)


def test_image_models_are_weighed_by_pixels_and_the_rest_as_text():
    assert input_estimate("image-classification") is image_tokens
    for task in ("feature-extraction", "text-generation", "custom", None):
        assert input_estimate(task) is estimate_tokens


def test_photos_share_a_batch_under_a_gpu_token_budget(photo):
    """Costed by its 250 KB of base64 (62,000 tokens), each photo was over the budget
    alone and went alone; by its 12 megapixels (2,929 tokens) five go together."""
    core = SchedulerCore(
        max_batch_size=64,
        max_batch_tokens=GPU_TOKEN_BUDGET,
        estimate=input_estimate("image-classification"),
    )
    queue_items(core, [photo] * 16)
    assert len(next_batch(core, now=0.0)) == GPU_TOKEN_BUDGET // (4000 * 3000 // PIXELS_PER_TOKEN)

    by_bytes = SchedulerCore(max_batch_size=64, max_batch_tokens=GPU_TOKEN_BUDGET)
    queue_items(by_bytes, [photo] * 16)
    assert len(next_batch(by_bytes, now=0.0)) == 1


def test_the_server_weighs_an_image_models_inputs_by_their_pixels(tiny_model):
    """`build_model` gives the scheduler the estimate of the task the model's folder says."""
    from rawserve.config import plan_workers
    from rawserve.main import build_model
    from rawserve.models.plan import plan_models
    from rawserve.ops.metrics import Metrics
    from rawserve.options import parse_config
    from rawserve.serving import CoreShare

    for kind, estimate in (
        ("image-classification", image_tokens),
        ("text-classification", estimate_tokens),
    ):
        config = parse_config(["--model", tiny_model(kind)])
        plans = plan_models(config.models, task=config.task, handler=config.handler)
        loop = asyncio.new_event_loop()
        try:
            workers = plan_workers(config.model, plans)
            model = build_model(plans[0], config, workers, Metrics(), CoreShare(cores=1), loop)
        finally:
            loop.close()
        assert model.scheduler.core.estimate is estimate
