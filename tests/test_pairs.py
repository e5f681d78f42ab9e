"""Text pairs cut before the tokenizer truncates them (`rawserve.worker.pairs`): the same
tokens as the whole texts truncated, at a bounded cost however long the texts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rawserve.worker.pairs import SLACK, cut_pair

transformers = pytest.importorskip("transformers")

WORDS = ["hello", "world", "the", "movie", "unbelievable", "naïve", ",", ".", "😀", "é", "x"]
texts = st.lists(st.sampled_from(WORDS), max_size=300).map(" ".join)


@pytest.fixture(scope="module", params=["text-classification", "text-generation"])
def tokenizer(request, tiny_model):
    """A WordPiece tokenizer (BERT's) and a byte-level BPE one (GPT-2's)."""
    loaded = transformers.AutoTokenizer.from_pretrained(tiny_model(request.param))
    if loaded.pad_token is None:
        loaded.pad_token = loaded.eos_token
    return loaded


@settings(deadline=None, max_examples=400)
@given(first=texts, second=texts, limit=st.sampled_from([8, 17, 64]))
@pytest.mark.parametrize("side", ["right", "left"])
def test_a_cut_pair_truncates_to_the_same_tokens_as_the_whole_texts(
    tokenizer, side, first, second, limit
):
    tokenizer.truncation_side = side
    whole = tokenizer(first, second, truncation=True, max_length=limit)["input_ids"]
    cut = tokenizer(*cut_pair(tokenizer, first, second, limit), truncation=True, max_length=limit)
    assert cut["input_ids"] == whole


def test_each_text_of_a_long_pair_is_cut_to_a_few_times_the_limit(tokenizer):
    """Two texts of 8,000 tokens cut to 128: the tokenizer made 16,509 encodings (every
    window of one with every window of the other), 1.8 GB, for one pair."""
    tokenizer.truncation_side = "right"
    long = "hello world the movie " * 2000
    first, second = cut_pair(tokenizer, long, long + " x", 128)
    counts = [
        len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in (first, second)
    ]
    assert counts == [SLACK * 128, SLACK * 128 + 1]  # the longer stays the longer
    assert long.startswith(first) and second.startswith(first)
    assert cut_pair(tokenizer, "a short one", "and another", 128) == ("a short one", "and another")


def test_cutting_a_text_past_the_models_length_warns_of_no_indexing_errors(tiny_model):
    """Tokenized whole to find where to cut it, a long text made transformers warn that
    running it "will result in indexing errors" (once a tokenizer): it is never run."""
    folder = tiny_model("text-classification")
    fresh = transformers.AutoTokenizer.from_pretrained(folder, model_max_length=512)
    long = "hello world the movie " * 2000
    first, _ = cut_pair(fresh, long, "a question", 128)
    assert len(first) < len(long)
    assert "sequence-length-is-longer-than-the-specified-maximum" not in fresh.deprecation_warnings


@pytest.fixture(scope="module")
def classifier(tiny_model):
    from rawserve.shared.messages import Engine
    from rawserve.worker.loading import load_runner
    from tests.tiny_models import worker_config

    config = worker_config(
        tiny_model("text-classification"), None, dtype="float32", engine=Engine.TORCH
    )
    return load_runner(config, "cpu")


def test_a_long_pair_is_scored_as_the_whole_texts_truncated(classifier):
    """/rerank and /predict's pairs, truncated (their default): the scores of two long
    texts are those of the whole pair truncated by the tokenizer, which is handed no
    text of more than a few times the model's limit."""
    import numpy as np
    import torch

    from rawserve.tasks import LOGITS_PARAM

    serving = classifier
    tokenizer, limit = serving.pipe.tokenizer, serving.max_length
    query, document = "who is there " * 150, "hello world the movie " * 300
    tokenizer.truncation_side = "right"
    whole = tokenizer(query, document, truncation=True, max_length=limit, return_tensors="pt")
    with torch.inference_mode():
        expected = serving.pipe.model(**whole).logits[0].float().numpy()
    handed: list[int] = []
    called = type(tokenizer).__call__

    def watched(self, text, pair=None, **kwargs):
        if pair is not None:
            texts = pair if isinstance(pair, list) else [pair]
            handed.extend(len(self(t, add_special_tokens=False)["input_ids"]) for t in texts)
        return called(self, text, pair, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(tokenizer), "__call__", watched)
        [found] = serving.run(
            [{"text": query, "text_pair": document}], {LOGITS_PARAM: True, "truncate": True}
        )
    np.testing.assert_allclose(found["logits"], expected, atol=1e-5)
    assert found["tokens"] == limit  # the pair cut to the model's length
    assert handed and max(handed) <= SLACK * limit + 1


def test_a_long_text_is_classified_zero_shot_as_the_whole_text_cut(tiny_model):
    """The pipeline pairs the text with each label and cuts only the text: each pair made
    every window of it (880 KB and 32 labels: 22 s). Cut once first, the scores are the
    whole text's."""
    from rawserve.shared.messages import Engine
    from rawserve.worker.loading import load_runner
    from tests.tiny_models import worker_config

    config = worker_config(
        tiny_model("zero-shot-classification"),
        "zero-shot-classification",
        dtype="float32",
        engine=Engine.TORCH,
    )
    serving = load_runner(config, "cpu")
    tokenizer, limit = serving.pipe.tokenizer, serving.max_length
    text, labels = "hello world the movie " * 300, ["city", "film", "food"]
    expected = serving.pipe(text, candidate_labels=labels)
    longest = []
    called = type(tokenizer).__call__

    def watched(self, text, *args, **kwargs):
        pairs = [
            t for t in (text if isinstance(text, list) else [text]) if isinstance(t, tuple | list)
        ]
        if pairs:  # the pipeline's (text, hypothesis) pairs
            firsts = [called(self, first, add_special_tokens=False) for first, _ in pairs]
            longest.append(max(len(first["input_ids"]) for first in firsts))
        return called(self, text, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(tokenizer), "__call__", watched)
        [found] = serving.run([text], {"candidate_labels": labels})
    assert [entry["label"] for entry in found] == expected["labels"]
    assert [entry["score"] for entry in found] == pytest.approx(expected["scores"], abs=1e-6)
    assert longest and max(longest) <= SLACK * limit
