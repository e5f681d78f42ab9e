"""A long text narrowed before its tokenizer truncates it (`rawserve.worker.long_texts`,
`tasks.windows.span_past`): the same tokens as the whole text truncated, from either end,
and a worker's tokenizer never handed more than a few pieces of a 1 MB text."""

from __future__ import annotations

import numpy as np
import pytest

from rawserve.shared.messages import EMBEDDING_ROUTE, Engine
from rawserve.tasks import LOGITS_PARAM
from rawserve.tasks.windows import PIECE_CHARS, span_past
from rawserve.worker.long_texts import encode_cut, narrowed, narrowed_texts
from rawserve.worker.pairs import cut_pair, cut_text

transformers = pytest.importorskip("transformers")

# what a worker's tokenizer may be handed of a long text: the pieces counted, the span kept
MOST_HANDED = 2 * PIECE_CHARS
MEGABYTE_TEXT = "hello " * 174000  # the tester's body: 1 MB, 1.5 KB gzipped

LONG_TEXTS = {
    "words": "hello world the movie was unbelievable, naïve. " * 1500,
    "one enormous word": "abcdefghij" * 7000,
    "one letter, no whitespace": "x" * 70000,
    "mostly whitespace": (" " * 5000 + "hello world ") * 12 + "\n\t " * 8000,
    "multi-byte": "naïve 😀 é 日本語のテキスト 🇫🇷 ß " * 2500,
    "lines": "the movie\n\n\nwas good.\n" * 3000,
}


@pytest.fixture(
    scope="module", params=["text-classification", "text-generation", "seq2seq", "minilm"]
)
def tokenizer(request, tiny_model):
    """WordPiece (a tiny BERT's, the packaged MiniLM's), byte-level BPE (GPT-2's), and
    a seq2seq model's."""
    if request.param == "minilm":
        from rawserve.models.folder import default_model

        return transformers.AutoTokenizer.from_pretrained(default_model())
    return transformers.AutoTokenizer.from_pretrained(tiny_model(request.param))


@pytest.mark.parametrize("name", sorted(LONG_TEXTS))
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("limit", [16, 256])
def test_a_narrowed_text_truncates_to_the_whole_texts_tokens(tokenizer, name, side, limit):
    tokenizer.truncation_side = side
    text = LONG_TEXTS[name]

    def encode(texts):
        return tokenizer(texts, truncation=True, max_length=limit, padding=True)

    whole = encode([text])
    cut = narrowed_texts(tokenizer, [text], limit)
    assert encode_cut(encode, [text], cut, limit)["input_ids"] == whole["input_ids"]
    if cut[0] is not text:  # narrowed: its own tokens are the whole text's, guard or not
        assert len(cut[0]) < len(text)
        assert encode(cut)["input_ids"] == whole["input_ids"]


def test_the_span_is_counted_from_the_end_kept():
    text = "a b c d " * 10000  # one token a letter, counted a piece at a time
    start, end = span_past(lambda piece: len(piece.split()), text, 10, from_end=False)
    assert start == 0 and end < len(text) // 2
    start, end = span_past(lambda piece: len(piece.split()), text, 10, from_end=True)
    assert end == len(text) and start > len(text) // 2
    assert span_past(lambda piece: len(piece.split()), text, 40000, from_end=False) is None


def test_a_short_text_is_left_as_it_is(tokenizer):
    text = "hello world " * 100
    assert narrowed(tokenizer, text, 16) is text


def watched_tokenizer(patch, tokenizer) -> list[int]:
    """The length of every text the tokenizer's class is handed from now on."""
    handed: list[int] = []
    called = type(tokenizer).__call__

    def watched(self, text=None, text_pair=None, *args, **kwargs):
        for each in (text, text_pair):
            for item in each if isinstance(each, list | tuple) else [each]:
                if isinstance(item, str):
                    handed.append(len(item))
        return called(self, text, text_pair, *args, **kwargs)

    patch.setattr(type(tokenizer), "__call__", watched)
    return handed


def as_before(patch, *modules) -> None:
    """Each module's long texts handed whole to the tokenizer, as before they were cut."""
    for module in modules:
        if hasattr(module, "narrowed_texts"):
            patch.setattr(module, "narrowed_texts", lambda tokenizer, texts, limit: list(texts))
        if hasattr(module, "narrowed"):
            patch.setattr(module, "narrowed", lambda tokenizer, text, limit: text)


@pytest.fixture(scope="module")
def runner(tiny_model):
    from rawserve.worker.loading import load_runner
    from tests.tiny_models import worker_config

    loaded = {}

    def get(kind: str, task: str | None = None):
        if kind not in loaded:
            if kind == "minilm":
                from rawserve.models.folder import default_model

                folder = default_model()
            else:
                folder = tiny_model(kind)
            config = worker_config(folder, task, dtype="float32", engine=Engine.TORCH)
            loaded[kind] = load_runner(config, "cpu")
        return loaded[kind]

    return get


@pytest.mark.parametrize("kind", ["sentence-embedding", "feature-extraction", "minilm"])
@pytest.mark.parametrize("direction", ["right", "left"])
def test_a_megabyte_text_is_embedded_from_a_few_pieces_as_the_whole_text(runner, kind, direction):
    """The whole 1 MB text was tokenized, then cut to the model's length: 0.75 s of a
    worker's CPU and 150 MB for MiniLM's 256 tokens, sixteen such bodies 13 s."""
    from rawserve.worker import encoder

    serving = runner(kind)
    texts = [MEGABYTE_TEXT, LONG_TEXTS["multi-byte"] * 5, "a short one"]
    params = {"truncation_direction": direction}
    with pytest.MonkeyPatch.context() as patch:
        handed = watched_tokenizer(patch, serving.tokenizer)
        answers = serving.run(texts, dict(params), EMBEDDING_ROUTE)
    assert handed and max(handed) <= MOST_HANDED
    with pytest.MonkeyPatch.context() as patch:
        as_before(patch, encoder)
        expected = serving.run(texts, dict(params), EMBEDDING_ROUTE)
    for found, whole in zip(answers, expected, strict=True):
        assert found["tokens"] == whole["tokens"]
        np.testing.assert_allclose(found["embedding"], whole["embedding"], atol=1e-6)


@pytest.mark.parametrize("direction", ["right", "left"])
def test_token_ids_past_the_model_s_length_are_cut_from_the_side_asked(runner, direction):
    """As a text's tokens are: `truncation_direction` left keeps the last ids, right the
    first; ids cut from the other end answered the vector of another input."""
    serving = runner("feature-extraction")
    most = serving.max_length
    ids = [5] * 40 + [6 + (i % 17) for i in range(most)]
    kept = ids[-most:] if direction == "left" else ids[:most]
    [cut] = serving.run([ids], {"pooling": "mean", "truncation_direction": direction})
    [expected] = serving.run([kept], {"pooling": "mean"})
    np.testing.assert_allclose(np.asarray(cut), np.asarray(expected), atol=1e-6)


def test_a_long_text_is_still_refused_where_it_is_not_truncated(runner):
    serving = runner("sentence-embedding")
    with pytest.raises(ValueError, match="send truncate: true"):
        serving.run([LONG_TEXTS["words"]], {"truncate": False})


@pytest.mark.parametrize("direction", ["right", "left"])
def test_a_long_text_is_scored_from_a_few_pieces_as_the_whole_text(runner, direction):
    """TEI's /predict, and /rerank's pairs, truncated: a 1 MB text beside a short one."""
    from rawserve.worker import pairs, pipeline

    serving = runner("text-classification")
    texts = [MEGABYTE_TEXT, {"text": "who is there", "text_pair": MEGABYTE_TEXT}]
    params = {LOGITS_PARAM: True, "truncate": True, "truncation_direction": direction}
    for batch in ([texts[0], "short"], [texts[1]], texts):
        with pytest.MonkeyPatch.context() as patch:
            handed = watched_tokenizer(patch, serving.pipe.tokenizer)
            found = serving.run(batch, dict(params))
        assert handed and max(handed) <= MOST_HANDED
        with pytest.MonkeyPatch.context() as patch:
            as_before(patch, pipeline, pairs)
            expected = serving.run(batch, dict(params))
        assert [one["tokens"] for one in found] == [one["tokens"] for one in expected]
        np.testing.assert_allclose(
            np.array([one["logits"] for one in found]),
            np.array([one["logits"] for one in expected]),
            atol=1e-6,
        )


def test_a_long_text_is_classified_zero_shot_from_a_few_pieces(runner):
    from rawserve.worker import pairs

    serving = runner("zero-shot-classification", "zero-shot-classification")
    params = {"candidate_labels": ["city", "film", "food"]}
    with pytest.MonkeyPatch.context() as patch:
        handed = watched_tokenizer(patch, serving.pipe.tokenizer)
        [found] = serving.run([MEGABYTE_TEXT], dict(params))
    assert handed and max(handed) <= MOST_HANDED
    with pytest.MonkeyPatch.context() as patch:
        as_before(patch, pairs)
        [expected] = serving.run([MEGABYTE_TEXT], dict(params))
    assert [entry["label"] for entry in found] == [entry["label"] for entry in expected]
    assert [e["score"] for e in found] == pytest.approx([e["score"] for e in expected], abs=1e-6)


def test_a_long_text_is_summarized_from_a_few_pieces(runner):
    from rawserve.worker import seq2seq_lm

    serving = runner("seq2seq", "summarization")
    params = {"max_new_tokens": 4}
    with pytest.MonkeyPatch.context() as patch:
        handed = watched_tokenizer(patch, serving.tokenizer)
        found = serving.run([MEGABYTE_TEXT], dict(params))
    assert handed and max(handed) <= MOST_HANDED
    with pytest.MonkeyPatch.context() as patch:
        as_before(patch, seq2seq_lm)
        expected = serving.run([MEGABYTE_TEXT], dict(params))
    assert found == expected


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("lengths", [(1, 0), (0, 1), (1, 1), (1, 2)])
def test_a_long_pair_is_cut_to_the_whole_texts_tokens(tokenizer, side, lengths):
    """Each text of a pair narrowed before its offsets are taken: the pair truncates as
    the whole texts do, which is the longer included (longest_first gives it the odd
    token), and a zero-shot text as well."""
    tokenizer.truncation_side = side
    # (the whole pair truncated, for the expected tokens, makes every window of one text
    # with every window of the other: texts of a few pieces, windows of a few hundred)
    limit = 256
    long = "hello world the movie was unbelievable, naïve. " * 400
    first, second = [long * n if n else "a short question" for n in lengths]
    whole = tokenizer(first, second, truncation=True, max_length=limit)["input_ids"]
    cut = tokenizer(*cut_pair(tokenizer, first, second, limit), truncation=True, max_length=limit)
    assert cut["input_ids"] == whole
    only_first = tokenizer(first, "a label", truncation="only_first", max_length=limit)
    cut_first = cut_text(tokenizer, first, limit)
    assert len(cut_first) <= len(first)
    assert (
        tokenizer(cut_first, "a label", truncation="only_first", max_length=limit)["input_ids"]
        == only_first["input_ids"]
    )
