"""A request's windows counted before it queues (`rawserve.api.window_checks`): the
defaults the pipelines read a long text with, and the request refused (422) where its
windows would hold more tokens than the budget."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from rawserve.api.tokens import ServerTokenizer
from rawserve.api.window_checks import check_windows
from rawserve.http.errors import UnprocessableInput


@pytest.fixture(scope="module")
def reader_tokenizer(tiny_model):
    folder = Path(tiny_model("question-answering"))
    return ServerTokenizer((folder / "tokenizer.json").read_text())


class Tokenizers:
    def __init__(self, tokenizer: ServerTokenizer):
        self.tokenizer = tokenizer

    async def get(self, model):
        return self.tokenizer


def checked(tokenizer, task, inputs, params, positions=128):
    model = SimpleNamespace(positions=positions, task=task)
    asyncio.run(check_windows(Tokenizers(tokenizer), model, inputs, params))


def test_a_context_without_a_doc_stride_is_counted_at_the_pipelines_default(
    reader_tokenizer,
):
    """The pipeline overlaps windows by half of one at most (64 of 128 positions): a
    1.3 MB context sent without `doc_stride` makes 4,500 windows, past the budget, and is
    refused before it queues (counted at its largest stride, it was queued); a smaller
    overlap asked for fits."""
    item = {"question": "what?", "context": "word " * 260_000}
    with pytest.raises(UnprocessableInput, match="128 tokens at doc_stride 64") as refused:
        checked(reader_tokenizer, "question-answering", [item], {})
    assert refused.value.param == "doc_stride"
    checked(reader_tokenizer, "question-answering", [item], {"doc_stride": 32})


def test_a_dense_stride_on_a_text_to_tag_is_refused_and_a_normal_one_fits(reader_tokenizer):
    text = "word " * 20_000
    with pytest.raises(UnprocessableInput, match="at stride 125") as refused:
        checked(reader_tokenizer, "token-classification", [text], {"stride": 125})
    assert refused.value.param == "stride"
    checked(reader_tokenizer, "token-classification", [text], {"stride": 32})
    checked(reader_tokenizer, "token-classification", [text * 10], {})  # no stride: cut
