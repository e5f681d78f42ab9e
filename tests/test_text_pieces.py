"""A sequence's text, token by token (rawserve.worker.text_pieces.TextPieces): the pieces
add up to what the tokenizer decodes of the whole sequence, a character cut between
tokens waits for its last byte, and the backend is called directly only where the
tokenizer's own `decode` would add nothing to it."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from rawserve.worker.text_pieces import (  # noqa: E402
    HELD_WINDOW,
    TextPieces,
    alternative_text,
    byte_values,
    generated_text,
    prompt_context,
    text_decoder,
)
from tests.tiny_models import VOCAB, bpe_tokenizer, byte_fallback_tokenizer  # noqa: E402

TEXTS = ["the movie was good", "héllo wörld, naïve café", "日本語のテキスト and more", "a"]


def cleaning_bpe_tokenizer():
    """The byte-level BPE told to clean up spaces all the same, as some GPT-2 configs."""
    tokenizer = bpe_tokenizer()
    tokenizer.clean_up_tokenization_spaces = True
    forced = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    setattr(tokenizer, forced, True)
    return tokenizer


def wordpiece_tokenizer():
    """A BERT tokenizer that cleans up spaces, as BERT configs often say, with an "'"."""
    import transformers

    words = [*VOCAB, "'"]
    tokenizer = transformers.BertTokenizer(vocab={word: i for i, word in enumerate(words)})
    tokenizer.clean_up_tokenization_spaces = True
    return tokenizer


ALL_KINDS = [bpe_tokenizer, byte_fallback_tokenizer, cleaning_bpe_tokenizer, wordpiece_tokenizer]


@pytest.mark.parametrize("text", TEXTS)
def test_the_pieces_add_up_to_the_whole_texts_decoding(text):
    tokenizer = bpe_tokenizer()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = TextPieces(tokenizer)
    made = [pieces.next_piece(ids[: n + 1]) for n in range(len(ids))]
    assert "".join(made) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in piece for piece in made)  # a cut character waits, whole


def test_a_character_cut_between_tokens_adds_nothing_until_it_is_whole():
    tokenizer = bpe_tokenizer()
    ids = tokenizer("日", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1  # its three bytes are tokens of their own here
    pieces = TextPieces(tokenizer)
    assert [pieces.next_piece(ids[: n + 1]) for n in range(len(ids))] == [""] * (len(ids) - 1) + [
        "日"
    ]


def test_the_backend_is_called_directly_only_where_decode_adds_nothing():
    import transformers

    def its_own(ids, skip_special_tokens=False):
        return "the tokenizer's own decode"

    bpe = bpe_tokenizer()  # cleans nothing up: its backend's text is its text
    ids = bpe("the movie , good", add_special_tokens=False)["input_ids"]
    bpe.decode = its_own
    assert text_decoder(bpe)(ids) == "the movie , good"
    bpe.clean_up_tokenization_spaces = True  # as old GPT-2 configs say: a BPE skips it
    assert text_decoder(bpe)(ids) == "the movie , good"
    forced = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    setattr(bpe, forced, True)  # unless told to clean up all the same
    assert text_decoder(bpe)(ids) == "the tokenizer's own decode"
    words = transformers.BertTokenizer(vocab={word: i for i, word in enumerate(VOCAB)})
    words.clean_up_tokenization_spaces = True  # its decode may change the backend's text
    words.decode = its_own
    assert text_decoder(words)([5, 6]) == "the tokenizer's own decode"


def test_a_run_of_byte_tokens_adds_its_text_once_the_run_is_over():
    # a byte-fallback tokenizer (Llama's) decodes a run of byte tokens as a whole: "é"
    # followed by a lone byte is three U+FFFDs, not "é" and one
    tokenizer = byte_fallback_tokenizer()
    bytes_ = tokenizer.convert_tokens_to_ids(["<0xC3>", "<0xA9>", "<0xE2>"])
    ids = bytes_ + tokenizer.encode(" the", add_special_tokens=False)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert whole.startswith("\ufffd" * 3)
    pieces = TextPieces(tokenizer)
    made = [pieces.next_piece(ids[: n + 1]) for n in range(len(ids))]
    assert made[:3] == ["", "", ""]
    assert "".join(made) == whole


def test_a_run_of_byte_tokens_that_a_special_token_follows_adds_its_text_with_the_next_word():
    # the special token's own text is left out of the text, and so is all it would add
    # (a client skips special tokens' texts): the run's text comes with the next word
    tokenizer = byte_fallback_tokenizer()
    eos = tokenizer.eos_token_id
    ids = tokenizer.convert_tokens_to_ids(["<0x5D>", "<0x52>"]) + [eos]
    ids += tokenizer.encode(" the", add_special_tokens=False)
    pieces = TextPieces(tokenizer)
    made = [pieces.next_piece(ids[: n + 1]) for n in range(len(ids))]
    assert made[:3] == ["", "", ""]
    assert "".join(made) == tokenizer.decode(ids, skip_special_tokens=True) == "]R the"
    # the last token, special or not, adds what was held back
    pieces = TextPieces(tokenizer)
    made = [pieces.next_piece(ids[: n + 1], n == 2) for n in range(3)]
    assert made == ["", "", "]R"]


@pytest.mark.parametrize(
    "names, texts",
    [
        (["<0x21>"], ["!"]),  # a whole character alone: its own, not the next word's
        (["<0x21>", "<0x3F>"], ["!", "?"]),
        (["<0xE2>", "<0x82>", "<0xAC>"], ["", "", "€"]),  # at its last byte, as OpenAI's
        (["<0x21>", "</s>", "<0x3F>"], ["!", "", "?"]),  # the decoding skips the special
        (["<0x21>", "<0xE2>"], ["\ufffd", "\ufffd"]),  # not UTF-8: a U+FFFD a byte
    ],
)
def test_each_byte_token_lists_the_text_it_adds_once_its_run_is_over(names, texts):
    tokenizer = byte_fallback_tokenizer()
    good = tokenizer.convert_tokens_to_ids(["▁goo"])
    ids = good + tokenizer.convert_tokens_to_ids(names) + good
    pieces = TextPieces(tokenizer)
    made = [pieces.next_pieces(ids[: n + 1]) for n in range(len(ids))]
    assert made == [["goo"]] + [[]] * len(names) + [[*texts, " goo"]]
    # the run ends the sequence: the last token lets it out
    pieces = TextPieces(tokenizer)
    ids = ids[:-1]
    made = [pieces.next_pieces(ids[: n + 1], n == len(ids) - 1) for n in range(len(ids))]
    assert made == [["goo"]] + [[]] * (len(names) - 1) + [texts]


@pytest.mark.parametrize("build", ALL_KINDS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(picks=st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=10))
def test_each_token_gets_a_text_and_the_texts_add_up_to_the_pieces_whatever_the_tokens(
    build, picks
):
    tokenizer = _tokenizers(build)
    ids = [pick % 3 if pick % 4 == 0 else 3 + pick % (len(tokenizer) - 3) for pick in picks]
    pieces, texts = TextPieces(tokenizer), []
    for n in range(len(ids)):
        texts += pieces.next_pieces(ids[: n + 1], n == len(ids) - 1)
        assert len(texts) <= n + 1
    assert len(texts) == len(ids)
    assert "".join(texts) == tokenizer.decode(ids, skip_special_tokens=True)
    # cut short (a beam's end, a cancel): the rest let out as though the last were so
    pieces, texts = TextPieces(tokenizer), []
    for n in range(len(ids)):
        texts += pieces.next_pieces(ids[: n + 1])
    assert len(texts + pieces.rest(ids)) == len(ids)


@pytest.mark.parametrize("build", ALL_KINDS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(picks=st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=10))
def test_the_pieces_so_far_are_the_start_of_the_whole_decoding_whatever_the_tokens(build, picks):
    # any tokens, bytes that never make UTF-8 and special tokens (one in four) too: the
    # text sent so far never changes
    tokenizer = _tokenizers(build)
    ids = [pick % 3 if pick % 4 == 0 else 3 + pick % (len(tokenizer) - 3) for pick in picks]
    pieces = TextPieces(tokenizer)
    made = ""
    for n in range(len(ids)):
        made += pieces.next_piece(ids[: n + 1])
        assert tokenizer.decode(ids[: n + 1], skip_special_tokens=True).startswith(made)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert whole.startswith(made)
    # told which token is the last, the pieces add up to the whole decoding
    pieces = TextPieces(tokenizer)
    made = "".join(pieces.next_piece(ids[: n + 1], n == len(ids) - 1) for n in range(len(ids)))
    assert made == whole


@pytest.mark.parametrize("build", ALL_KINDS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=6),
    picks=st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=8),
)
def test_the_pieces_after_a_prompt_add_up_to_the_generated_text_whatever_the_tokens(
    build, prompt, picks
):
    # decoded after the end of any prompt (bytes that never make UTF-8 and special tokens
    # in either), the text sent so far never changes and the pieces add up to the text
    tokenizer = _tokenizers(build)
    prompt_ids, ids = (
        [pick % 3 if pick % 4 == 0 else 3 + pick % (len(tokenizer) - 3) for pick in picks]
        for picks in (prompt, picks)
    )
    context = prompt_context(tokenizer, prompt_ids)
    assert len(context) <= 1 and set(context) <= set(prompt_ids)
    whole = generated_text(tokenizer, ids, context)
    pieces = TextPieces(tokenizer, context)
    made = ""
    for n in range(len(ids)):
        made += pieces.next_piece(ids[: n + 1], n == len(ids) - 1)
        assert whole.startswith(made)
    assert made == whole


def test_the_first_word_after_a_prompt_keeps_its_space_where_a_run_of_bytes_ends_it():
    # a Llama's decoder strips the space a text starts with: decoded after the prompt's
    # last word, the first new word keeps it, and the prompt's own run of byte tokens
    # (an emoji it ends with) is left out, so that new bytes cannot join it
    tokenizer = byte_fallback_tokenizer()
    good = tokenizer.convert_tokens_to_ids(["▁goo"])
    assert tokenizer.decode(good) == "goo"  # alone: the space stripped
    for prompt, emoji in [("the movie", 0), ("the movie 😀", 4)]:  # its four byte tokens
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        context = prompt_context(tokenizer, prompt_ids)
        assert context == prompt_ids[len(prompt_ids) - emoji - 1 :][:1]
        pieces = TextPieces(tokenizer, context)
        ids = good + tokenizer.convert_tokens_to_ids(["<0xE2>", "<0x82>", "<0xAC>"]) + good
        made = [pieces.next_piece(ids[: n + 1], n == len(ids) - 1) for n in range(len(ids))]
        assert made == [" goo", "", "", "", "€ goo"]
        assert generated_text(tokenizer, ids, context) == " goo€ goo"
    assert prompt_context(tokenizer, tokenizer.convert_tokens_to_ids(["<0xE2>"])) == []


def test_the_first_word_keeps_its_space_after_a_one_word_prompt_or_one_a_special_ends():
    # the prompt's last word is found however short the prompt, and a special token
    # (an end of turn a template closes with) is passed over: its text is left out of
    # the decoding, which would strip the first new word's space after it
    tokenizer = byte_fallback_tokenizer()
    good = tokenizer.convert_tokens_to_ids(["▁goo"])
    word = tokenizer.encode("movie", add_special_tokens=False)
    assert len(word) == 1
    movie = tokenizer.encode("the movie", add_special_tokens=False)
    for prompt, context in [(word, word), (movie + [tokenizer.eos_token_id], movie[-1:])]:
        assert prompt_context(tokenizer, prompt) == context
        assert TextPieces(tokenizer, context).next_piece(good) == " goo"
        assert generated_text(tokenizer, good, context) == " goo"


def test_a_prompts_end_that_clean_up_changes_leaves_the_generated_text_whole():
    # a GPT-2 config that forces clean-up turns " ." into ".": decoded after the prompt's
    # last token (a space), the text no longer starts with that token's text, and cutting
    # its length off anyway lost the answer's first character, in the pieces as well
    tokenizer = cleaning_bpe_tokenizer()
    context = prompt_context(tokenizer, tokenizer.encode("the movie ", add_special_tokens=False))
    assert tokenizer.decode(context) == " "
    ids = tokenizer.encode(". good", add_special_tokens=False)
    assert generated_text(tokenizer, ids, context) == ". good"
    assert _token_texts(tokenizer, ids, context) == [".", " good"]


def test_a_space_that_a_later_token_cleans_up_is_held_until_that_token():
    # a space token, then ".": the space is not given out until the "." says it goes (it
    # was given, and the "." added nothing: "the movie  good" for "the movie. good")
    tokenizer = cleaning_bpe_tokenizer()
    ids = tokenizer.encode("the movie . good , bad", add_special_tokens=False)
    assert tokenizer.decode(ids) == "the movie. good, bad"
    texts = _token_texts(tokenizer, ids)
    assert "".join(texts) == "the movie. good, bad"
    assert texts[texts.index(".") - 1] == ""  # the space token adds nothing: it went
    ids = tokenizer.encode("the movie  good", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids[-2:]) == ["Ġ", "Ġgood"]
    # a space that stays is its own token's, given with the word after it
    assert _token_texts(tokenizer, ids)[-2:] == [" ", " good"]


def test_a_wordpiece_answer_reads_as_its_whole_decoding_where_clean_up_joins_words():
    # a WordPiece decoder puts a space between words and its clean-up takes some out
    # again: "do n ' t" is "don't" (" ' " then " n't"), "good ." is "good."
    tokenizer = wordpiece_tokenizer()
    tokens = ["the", "n", "'", "t", "movie", ".", "good", "'", "s"]
    ids = tokenizer.convert_tokens_to_ids(tokens)
    assert tokenizer.decode(ids) == "then't movie. good's"
    texts = ["the", "n", "'", "t", " movie", ".", " good", "'", "s"]  # each what it adds
    assert _token_texts(tokenizer, ids) == texts
    pieces = TextPieces(tokenizer)  # cut short, the held text still comes out
    texts = [t for n in range(3) for t in pieces.next_pieces(ids[: n + 1])]
    assert texts == ["the"] and pieces.rest(ids[:3]) == [" n", " '"]


# the tokens a clean-up turns on, by tokenizer: spaces, punctuation, "n", "'", "t", "s"
CLEANED_TOKENS = {
    "cleaning_bpe_tokenizer": ["Ġ", ".", "'", "n", "t", "s", ",", "Ġgood", "Ġn", "?", "</s>"],
    "wordpiece_tokenizer": [".", "'", "n", "t", "s", ",", "good", "movie", "?", "[SEP]"],
}


@pytest.mark.parametrize("build", [cleaning_bpe_tokenizer, wordpiece_tokenizer])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.lists(st.integers(min_value=0, max_value=10), min_size=1, max_size=4),
    picks=st.lists(st.integers(min_value=0, max_value=10), min_size=1, max_size=8),
)
def test_what_a_clean_up_changes_is_never_given_out_before_it_is_known(build, prompt, picks):
    # any mix of the tokens that a clean-up takes spaces around: each text given out is
    # the start of the answer's, and they add up to it, told the last or cut short
    tokenizer = _tokenizers(build)
    names = CLEANED_TOKENS[build.__name__]
    prompt_ids, ids = (
        tokenizer.convert_tokens_to_ids([names[i % len(names)] for i in picks])
        for picks in (prompt, picks)
    )
    context = prompt_context(tokenizer, prompt_ids)
    whole = generated_text(tokenizer, ids, context)
    for told in (True, False):
        pieces, texts = TextPieces(tokenizer, context), []
        for n in range(len(ids)):
            texts += pieces.next_pieces(ids[: n + 1], told and n == len(ids) - 1)
            assert whole.startswith("".join(texts))
        texts += pieces.rest(ids)
        assert "".join(texts) == whole and len(texts) == len(ids)
    # each token's text is what it adds where nothing is cleaned up, less the spaces a
    # clean-up takes (a space held for the next token is its own token's, still)
    plain = _token_texts(tokenizer, ids)
    tokenizer.clean_up_tokenization_spaces = False
    try:
        raw = _token_texts(tokenizer, ids)
    finally:
        tokenizer.clean_up_tokenization_spaces = True
    assert all(_less_spaces(r, p) for r, p in zip(raw, plain, strict=True)), (raw, plain)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(picks=st.lists(st.integers(min_value=0, max_value=13), min_size=20, max_size=70))
def test_a_long_run_of_spaces_a_clean_up_may_take_reads_a_few_tokens_a_step(picks):
    # each space of a run may yet be taken by a "." after it: held whole, the window
    # grew with the run (a step decoded all of it: quadratic)
    tokenizer = _tokenizers(cleaning_bpe_tokenizer)
    names = [*CLEANED_TOKENS["cleaning_bpe_tokenizer"], "Ġ", "Ġ", "Ġ"]
    ids = tokenizer.convert_tokens_to_ids([names[i % len(names)] for i in picks])
    run = tokenizer.convert_tokens_to_ids(["Ġ"] * 60)
    # each " ' " taken from the left, overlapping the next: held whole, all the same
    quotes = tokenizer.encode(" '" * 40, add_special_tokens=False)
    for tokens in (ids, run + ids, ids + run, quotes + ids, ids + quotes):
        pieces = TextPieces(tokenizer)
        read = _window_lengths(pieces)
        texts: list[str] = []
        for n in range(len(tokens)):
            texts += pieces.next_pieces(tokens[: n + 1], n == len(tokens) - 1)
            assert generated_text(tokenizer, tokens).startswith("".join(texts))
        assert "".join(texts) == generated_text(tokenizer, tokens) and len(texts) == len(tokens)
        assert max(read) <= HELD_WINDOW + 2


def test_a_character_that_never_completes_before_a_held_space_holds_up_nothing():
    # a lone continuation byte is a U+FFFD for good: the text given stopped at it while a
    # space after it was held, read as a character still coming, and the tokens after
    # it were let out empty (cut short, their text was lost: " good" for " good\ufffd n")
    tokenizer = _tokenizers(cleaning_bpe_tokenizer)
    ids = tokenizer.convert_tokens_to_ids(["Ġgood", "Ĺ", "Ġ", "<unk>", "n"])
    pieces, texts = TextPieces(tokenizer), []
    for n in range(len(ids)):
        texts += pieces.next_pieces(ids[: n + 1])
    assert texts == [" good", ""]  # the " n" may yet be " n't": held, the tokens from it wait
    assert "".join(texts + pieces.rest(ids)) == generated_text(tokenizer, ids) == " good\ufffd n"


def _window_lengths(pieces: TextPieces) -> list[int]:
    """How many tokens each window `pieces` decodes from now on holds, as it decodes it."""
    read: list[int] = []
    decode = pieces.decode
    pieces.decode = lambda window: read.append(len(window)) or decode(window)
    return read


def _less_spaces(raw: str, text: str) -> bool:
    """Whether `text` is `raw` with none or some of its spaces taken out."""
    kept = 0
    for char in raw:
        if kept < len(text) and text[kept] == char:
            kept += 1
        elif char != " ":
            return False
    return kept == len(text)


def _token_texts(tokenizer, ids, context=()):
    pieces = TextPieces(tokenizer, context)
    return [t for n in range(len(ids)) for t in pieces.next_pieces(ids[: n + 1], n == len(ids) - 1)]


@pytest.mark.parametrize("build", [bpe_tokenizer, byte_fallback_tokenizer])
def test_a_steps_decoding_reads_a_few_tokens_however_long_the_text_has_grown(build):
    # the window slides on with each piece: decoding the whole text at every token costs
    # a long answer's steps more and more (quadratic over the answer)
    tokenizer = _tokenizers(build)
    prompt = tokenizer.encode("the movie", add_special_tokens=False)
    ids = tokenizer.encode(" was good and the film was great" * 20, add_special_tokens=False)
    assert len(ids) > 100
    pieces = TextPieces(tokenizer, prompt_context(tokenizer, prompt))
    read = _window_lengths(pieces)
    made = "".join(pieces.next_piece(ids[: n + 1], n == len(ids) - 1) for n in range(len(ids)))
    assert made == generated_text(tokenizer, ids, prompt_context(tokenizer, prompt))
    assert max(read) <= 8, read


def test_an_alternative_reads_as_it_would_where_chosen():
    # after a word: a Llama's "▁goo" keeps its space; a byte token, a special token and
    # a byte-level BPE's tokens read as they do alone
    llama = byte_fallback_tokenizer()
    ids = llama.convert_tokens_to_ids(["▁goo", "<0xE2>", "</s>"])
    assert [alternative_text(llama, i) for i in ids] == [" goo", "\ufffd", "</s>"]
    bpe = _tokenizers(bpe_tokenizer)
    assert all(alternative_text(bpe, i) == bpe.decode([i]) for i in range(len(bpe)))


@functools.cache
def _tokenizers(build):
    return build()


def test_a_tokenizer_without_byte_tokens_has_none_though_their_names_read_as_its_unk_token():
    # a byte-level BPE has no <0xFF>: the name reads as <unk>, which is no byte (taken
    # for one, an <unk> made waited as though a run of bytes went on, then read U+FFFD)
    tokenizer = _tokenizers(bpe_tokenizer)
    unknown = tokenizer.unk_token_id
    assert unknown is not None and tokenizer.convert_tokens_to_ids("<0xFF>") == unknown
    assert byte_values(tokenizer) == {}


@pytest.mark.parametrize("build", [bpe_tokenizer, byte_fallback_tokenizer])
def test_a_special_token_between_words_adds_nothing_and_the_next_word_keeps_its_space(build):
    # a skipped special token must not start the next window: Llama's decoder drops the
    # space of the window's first word
    tokenizer = _tokenizers(build)
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("the movie", add_special_tokens=False) + [eos, eos]
    ids += tokenizer.encode(" was good", add_special_tokens=False)
    pieces = TextPieces(tokenizer)
    made = [pieces.next_piece(ids[: n + 1]) for n in range(len(ids))]
    assert "".join(made) == tokenizer.decode(ids, skip_special_tokens=True) == "the movie was good"
