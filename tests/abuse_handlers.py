"""`--handler` factories for the abuse tests: models whose cost is known in advance.

Each returns f(inputs: list, **params) -> list, as `tests.handlers` does.
"""

from __future__ import annotations

import os
import time


def paced():
    """Echoes each input after a model call's worth of sleep: a fixed part per call
    (RAWSERVE_TEST_CALL_MS, default 30) plus a part per item (RAWSERVE_TEST_ITEM_MS,
    default 0.3): a batch of 32 costs little more than a batch of one, as on a real
    encoder, so the order of the queue, not the model, decides who waits."""
    call = float(os.environ.get("RAWSERVE_TEST_CALL_MS", "30")) / 1000
    per_item = float(os.environ.get("RAWSERVE_TEST_ITEM_MS", "0.3")) / 1000

    def handle(inputs, **params):
        time.sleep(call + per_item * len(inputs))
        return [{"input": item, "batch_size": len(inputs)} for item in inputs]

    return handle


def big_answers():
    """Answers each input with RAWSERVE_TEST_ANSWER_BYTES (default 4 MiB) of text: a
    response the client must read for a while."""
    size = int(os.environ.get("RAWSERVE_TEST_ANSWER_BYTES", str(4 * 1024 * 1024)))

    def handle(inputs, **params):
        return ["x" * size for _ in inputs]

    return handle
