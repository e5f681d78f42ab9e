"""What one request may cost the server process: a `/tokenize` input at most the model's
input length in tokens (422 naming it, or cut with `truncate: true`), an answer at most
`max_answer_bytes` (413 naming it; `/embed_all` refused before the work), and the memory of
a large answer given back.

The tokenizer's rules are checked in-process against the `tokenizers` library's own
truncation; the memory bound on a real server, by its RSS in /proc.
"""

from __future__ import annotations

import asyncio
import json
import platform
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import tokenizers
from hypothesis import given
from hypothesis import strategies as st

from rawserve.api.app import App
from rawserve.api.prompts import LISTED_BYTES, check_echo_size
from rawserve.api.served import ServedModel, ServedModels
from rawserve.api.settings import AppSettings
from rawserve.api.tei import MAX_LISTED_TOKENS, MAX_TOKENIZE_TOKENS
from rawserve.api.tokens import (
    AnswerTooLarge,
    ServerTokenizer,
    TokenBound,
    TooManyTokens,
    tokens_json,
)
from rawserve.http.errors import PayloadTooLarge
from rawserve.serving.service import ModelService
from rawserve.shared.memory import give_back_free_memory
from rawserve.tasks.text_generation import MIN_TOKENS_PAST_ROOM
from rawserve.tasks.windows import pieces
from tests.server import RunningServer
from tests.test_api_shapes import Idle, Loaded, post

LIMIT = 128  # the tiny models' positions
LONG = "a " * 450_000  # the 900 KB body of the report: 450,000 tokens


@pytest.fixture(scope="module")
def tokenizer_json(tiny_model) -> str:
    return (Path(tiny_model("sentence-embedding")) / "tokenizer.json").read_text()


@pytest.fixture(scope="module")
def tokenizer(tokenizer_json) -> ServerTokenizer:
    return ServerTokenizer(tokenizer_json)


def library_truncated(tokenizer_json: str, text: str, direction: str) -> list[int]:
    """The ids the `tokenizers` library gives `text` cut to LIMIT tokens, encoding it whole."""
    library = tokenizers.Tokenizer.from_str(tokenizer_json)
    library.no_padding()
    library.enable_truncation(LIMIT, direction=direction)
    return library.encode(text).ids


# --- the tokenizer's bound ------------------------------------------------------------


@pytest.mark.parametrize("text", [LONG, "word " * 200, "x" * 100 + " b" * 200])
def test_an_input_past_the_limit_is_refused_naming_it(tokenizer, text):
    with pytest.raises(TooManyTokens, match=f"more than {LIMIT} tokens"):
        tokenizer.encode(text, True, TokenBound(LIMIT))


@pytest.mark.parametrize("direction", ["right", "left"])
@pytest.mark.parametrize(
    "text",
    [LONG, "the movie was very good " * 10_000, "héllo wörld € " * 3000, "short text"],
    ids=["900KB", "words", "utf8", "short"],
)
def test_truncation_keeps_what_the_library_keeps(tokenizer, tokenizer_json, text, direction):
    """Counting a long text a piece at a time cuts it where encoding it whole would."""
    encoding, start = tokenizer.encode(text, True, TokenBound(LIMIT, True, direction))
    assert encoding.ids == library_truncated(tokenizer_json, text, direction)
    assert len(encoding.ids) <= LIMIT


def test_truncated_offsets_point_into_the_whole_text(tokenizer):
    text = "héllo wörld € " * 3000
    body = asyncio.run(tokenizer.tokenize([text], False, TokenBound(LIMIT, True, "left"), 2**20))
    [tokens] = json.loads(body)
    raw = text.encode()
    assert len(tokens) == LIMIT
    assert tokens[-1]["stop"] == len(raw) - 1  # the last character is a space
    for token in tokens:
        assert raw[token["start"] : token["stop"]].decode() == token["text"]


class Counting:
    """A tokenizer that counts the texts encoded one at a time and in batches."""

    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.alone: list[int] = []  # each encoded text's length, one at a time
        self.batches: list[int] = []  # each batch's texts

    def encode(self, text: str, **options):
        self.alone.append(len(text))
        return self.tokenizer.encode(text, **options)

    def encode_batch(self, texts: list[str], **options):
        self.batches.append(len(texts))
        return self.tokenizer.encode_batch(texts, **options)

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)


def test_a_tokenize_answer_encodes_its_texts_in_one_batch_as_the_whole_texts_would(
    tokenizer_json,
):
    """The library's encode of one text holds the GIL throughout, its batch's lets go of
    it: 32 texts of 3,000 words, encoded one by one on a thread, took the event loop's
    turns for 0.2 s a request (a tester: /health's p99 280-380 ms beside three such
    clients). Each text's pieces counted past a long one's bound are short."""
    served = ServerTokenizer(tokenizer_json)
    texts = ["the movie was very good " * 600, "héllo wörld € " * 100, "short"] * 4
    bound = TokenBound(LIMIT, True)
    expected = []  # each text encoded alone
    for text in texts:
        encoding, start = served.encode(text, True, bound)
        expected.append(json.loads(tokens_json(encoding, text, start)))
    counting = Counting(served.tokenizer)
    served.tokenizer = counting  # type: ignore[assignment]
    answer = json.loads(asyncio.run(served.tokenize(texts, True, bound, 2**24)))
    assert answer == expected and counting.batches == [len(texts)]
    assert max(counting.alone, default=0) < 1000  # (a long text's pieces, counted)


@pytest.mark.parametrize("add_special", [True, False])
def test_offsets_are_the_librarys_where_the_post_processor_trims_them(add_special):
    """A RoBERTa-style tokenizer's post-processor takes the space out of a "Ġword" token's
    offsets: once, as encoding the text whole does (not once more when the special tokens
    are added, which would cut a letter off each word)."""
    from tests.tiny_models import bpe_tokenizer

    library = bpe_tokenizer().backend_tokenizer
    library.post_processor = tokenizers.processors.RobertaProcessing(("</s>", 2), ("<s>", 1))
    text = "héllo the movie 😀 was good"
    body = asyncio.run(
        ServerTokenizer(library.to_str()).tokenize([text], add_special, TokenBound(LIMIT), 2**20)
    )
    [tokens] = json.loads(body)
    expected = library.encode(text, add_special_tokens=add_special)
    assert [token["id"] for token in tokens] == expected.ids
    spans = zip(expected.offsets, expected.special_tokens_mask, strict=True)
    assert [token["text"] for token in tokens if not token["special"]] == [
        text[start:stop] for (start, stop), special in spans if not special
    ]


def test_a_long_word_without_spaces_is_answered_whole(tokenizer):
    """One word of 900 KB is one unknown token: counted in pieces, it fits."""
    encoding, _ = tokenizer.encode("a" * 900_000, True, TokenBound(LIMIT))
    assert len(encoding.ids) == 3  # [CLS] [UNK] [SEP]


def test_an_answer_over_the_bound_is_refused_naming_it(tokenizer):
    texts = ["hello world " * 20] * 8
    with pytest.raises(AnswerTooLarge, match="larger than 10,000 bytes"):
        asyncio.run(tokenizer.tokenize(texts, True, TokenBound(LIMIT), 10_000))
    assert asyncio.run(tokenizer.tokenize(texts[:1], True, TokenBound(LIMIT), 10_000))


def test_an_answer_of_exactly_the_bound_is_answered(tokenizer):
    """The bound is on the answer's bytes: one of exactly as many is taken (a comma after
    its last text was counted, and it was refused), one byte fewer refused."""
    texts = ["hello world"] * 3
    whole = asyncio.run(tokenizer.tokenize(texts, True, TokenBound(LIMIT), 2**20))
    assert asyncio.run(tokenizer.tokenize(texts, True, TokenBound(LIMIT), len(whole))) == whole
    with pytest.raises(AnswerTooLarge):
        asyncio.run(tokenizer.tokenize(texts, True, TokenBound(LIMIT), len(whole) - 1))


def test_a_large_tokenize_answer_gives_its_memory_back(tokenizer, monkeypatch):
    """Past TRIM_AFTER_TOKENS tokens the answer's objects leave pages the heap keeps:
    given back to the system, the server's memory stays near its start."""
    from rawserve.api import tokens

    calls: list[int] = []
    monkeypatch.setattr(tokens, "give_back_free_memory", lambda: calls.append(1))
    texts = ["hello world " * 1000] * 10  # past INLINE_LIMIT: counted off the loop
    bound = TokenBound(4096, truncate=True)
    listed = json.loads(asyncio.run(tokenizer.tokenize(texts, False, bound, 2**26)))
    assert sum(len(tokens) for tokens in listed) > tokens.TRIM_AFTER_TOKENS
    assert calls == [1]
    asyncio.run(tokenizer.tokenize(["hello world"], True, bound, 2**26))
    assert calls == [1]


def test_token_counts_stop_at_the_limit(tokenizer):
    assert tokenizer.count(["hello", LONG], LIMIT) == [3, LIMIT]


@given(st.text(alphabet="ab \n", max_size=300), st.integers(4, 40), st.booleans())
def test_pieces_cover_the_text_once_in_order(text, size, from_end):
    spans = list(pieces(text, size, from_end))
    if from_end:
        spans.reverse()
    assert [i for start, end in spans for i in range(start, end)] == list(range(len(text)))
    assert all(start < end for start, end in spans)


def test_free_memory_is_given_back_where_glibc_is():
    assert give_back_free_memory() is (platform.libc_ver()[0] == "glibc")


# --- the routes, in-process -----------------------------------------------------------


def app_for(task, tokenizer_json, details, **settings):
    workers = Loaded(task, {"max_input_length": LIMIT, **details}, tokenizer_json)
    model = ServedModel("m", ModelService(Idle(), workers), {"batching": {}})
    return App(ServedModels([model]), AppSettings(**settings))


@pytest.mark.parametrize("path", ["/generate", "/generate_stream"])
def test_a_tgi_prompt_past_the_positions_is_422_before_it_queues(tokenizer_json, path):
    """Counted before it queues (the idle queue fails any call), in the words TGI's
    clients read; queued, it took a batch's place, and a stream's 200 ended in an error."""
    app = app_for("text-generation", tokenizer_json, {})
    document = {"inputs": "hello world " * 100, "parameters": {"max_new_tokens": 2}}
    status, body = post(app, path, document)
    assert status == 422, body
    assert "longer than the model's context length" in body["error"]
    assert body["error_type"] == "validation"


def test_tokenize_lists_a_text_past_the_models_length_and_cuts_it_when_asked(tokenizer_json):
    """As TEI's /tokenize: a client counts a document's tokens to know where to cut it
    (tei-client's `tokenize` failed on the 422 it got); a bound holds all the same."""
    app = app_for("feature-extraction", tokenizer_json, {})
    status, body = post(app, "/tokenize", {"inputs": "a " * 300, "add_special_tokens": False})
    assert status == 200 and len(body[0]) == 300 > LIMIT
    # of a list, each text at most the model's length: 16 texts of 30,000 tokens took 6 s
    # and 250 MB of the server's memory
    status, body = post(app, "/tokenize", {"inputs": ["a " * 300, "b"]})
    assert status == 422 and f"more than {LIMIT} tokens" in body["error"]
    assert f"of a list (one text alone: up to {MAX_LISTED_TOKENS:,})" in body["error"]
    status, body = post(app, "/tokenize", {"inputs": LONG})
    assert status == 422 and f"more than {MAX_LISTED_TOKENS} tokens" in body["error"]
    assert "truncate" in body["error"]
    status, body = post(app, "/tokenize", {"inputs": LONG, "truncate": True})
    assert status == 200 and len(body[0]) == LIMIT
    assert body[0][0]["special"] and body[0][-1]["special"]  # [CLS] ... [SEP]


def test_tokenize_of_a_model_of_unknown_length_bounds_a_list_as_one_text(tokenizer_json):
    """A model that names no length (a question-answering model strides over a context):
    a list's texts are bounded as one text is, and the refusal says no other bound."""
    app = app_for("question-answering", tokenizer_json, {"max_input_length": 0})
    status, body = post(app, "/tokenize", {"inputs": ["a " * (MAX_TOKENIZE_TOKENS + 1), "b"]})
    assert status == 422 and f"more than {MAX_TOKENIZE_TOKENS} tokens" in body["error"]
    assert "one text alone" not in body["error"], body


def test_tokenize_refuses_an_answer_over_the_bound(tokenizer_json):
    app = app_for("feature-extraction", tokenizer_json, {}, max_answer_bytes=10_000)
    status, body = post(app, "/tokenize", {"inputs": ["hello world " * 20] * 8})
    assert status == 413 and "10,000 bytes" in body["error"]


def test_decode_refuses_an_answer_over_the_bound_as_tokenize_does(tokenizer_json):
    """A larger --max-body-bytes let 32 lists of 250,000 ids make a 48 MB answer."""
    app = app_for("feature-extraction", tokenizer_json, {}, max_answer_bytes=10_000)
    ids = tokenizers.Tokenizer.from_str(tokenizer_json).encode("hello world the movie").ids
    status, texts = post(app, "/decode", {"ids": [ids * 20] * 2})
    assert status == 200 and len(texts) == 2, texts
    status, body = post(app, "/decode", {"ids": [ids * 300] * 8})
    assert status == 413 and "10,000 bytes" in body["error"], body


def test_embed_all_over_the_bound_is_refused_before_the_work(tokenizer_json):
    """The idle queue fails any call: a 413 here was decided before the model ran."""
    app = app_for(
        "feature-extraction", tokenizer_json, {"token_dimensions": 32}, max_answer_bytes=100_000
    )
    status, body = post(app, "/embed_all", {"inputs": ["hello world " * 60] * 4})
    assert status == 413 and "100,000 bytes" in body["error"]
    assert "fewer or shorter" in body["error"]


def test_an_echo_with_logprobs_over_the_bound_is_refused_before_the_work(tokenizer_json):
    """Each echoed prompt token lists its alternatives in every choice: 4 prompts of about
    120 tokens with 20 alternatives make about 200 KB of answer. The idle queue fails
    any call: a 413 here was decided before the model ran."""
    app = app_for("text-generation", tokenizer_json, {}, max_answer_bytes=100_000)
    one = "hello world " * 60
    document = {"prompt": one, "max_tokens": 0, "echo": True, "logprobs": 20}
    # (best_of's completions each come back with their lists, the ones not chosen too)
    for larger in (
        {"prompt": [one] * 4},
        {"n": 4},
        {"n": 4, "max_tokens": 1},
        {"best_of": 4, "temperature": 1.0},
    ):
        status, body = post(app, "/v1/completions", {**document, **larger})
        assert status == 413 and "100,000 bytes" in body["error"]["message"]
    # one prompt, one choice: about 50 KB; without log probabilities: the prompt's text
    for smaller in ({}, {"prompt": [one] * 4, "logprobs": None}):
        status, body = post(app, "/v1/completions", {**document, **smaller})
        assert status != 413, body


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "document"),
    [
        ("/v1/chat/completions", {"messages": HI, "reasoning_effort": "high"}),
        ("/v1/responses", {"input": "hi", "reasoning": {"effort": "high"}}),
    ],
)
def test_a_model_with_no_chat_template_says_so_before_an_effort_is_refused(path, document):
    """An effort is the template's to read: a model with none was told its template
    reads no reasoning_effort, and once the effort was dropped, that it has none."""
    app = app_for("text-generation", "{}", {})
    status, body = post(app, path, document)
    assert status == 400 and "has no chat template" in body["error"]["message"], body


@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_logprobs_over_the_bound_are_refused_before_the_work(tokenizer_json, stream):
    """A Response's stream ends with events that each list every token (its text's end,
    its part's, its item's, the Response's): counted as the whole answer is, where a
    chat's stream lists each token once as it goes. The idle queue fails any call."""
    template = {"chat_template": "{{ messages }}"}
    app = app_for("text-generation", tokenizer_json, template, max_answer_bytes=100_000)
    document = {"input": "hello", "max_output_tokens": 200, "stream": stream}
    document.update(include=["message.output_text.logprobs"], top_logprobs=20)
    status, body = post(app, "/v1/responses", document)
    assert status == 413 and "100,000 bytes" in body["error"]["message"], body
    assert body["error"]["param"] == "max_output_tokens"
    status, body = post(app, "/v1/responses", {**document, "max_output_tokens": 20})
    assert status != 413, body


def test_best_of_counts_every_completions_log_probabilities_before_the_work(tokenizer_json):
    """The worker sends back each of best_of's completions with its tokens' alternatives
    (the likeliest are chosen after): n 20 was 413 where best_of 20 took the same work.
    The idle queue fails any call: a 413 here was decided before the model ran."""
    app = app_for("text-generation", tokenizer_json, {}, max_answer_bytes=100_000)
    document = {"prompt": "hello", "max_tokens": 100, "logprobs": 20, "temperature": 1.0}
    for larger in ({"n": 20}, {"best_of": 20}):
        status, body = post(app, "/v1/completions", {**document, **larger})
        assert status == 413 and "100,000 bytes" in body["error"]["message"], body
    status, body = post(app, "/v1/completions", {**document, "best_of": 2})
    assert status != 413, body


@pytest.mark.parametrize("stream", [False, True])
def test_a_min_tokens_a_prompt_surely_leaves_no_room_for_is_400_before_the_work(
    tokenizer_json, stream
):
    """Streamed, a later prompt's min_tokens past its room came as an error event (the
    worker's refusal, in the shape of an input's 422) after the first prompt's tokens,
    where the whole answer was a 400: counted here, it is a 400 before anything streams.
    The idle queue fails any call: these were decided before the model ran."""
    app = app_for("text-generation", tokenizer_json, {})  # (max_input_length: LIMIT)
    short, long_one = "hello", "hello world " * 30  # about 60 tokens of the 128
    document = {"prompt": [short, long_one], "max_tokens": 100, "min_tokens": 80}
    status, body = post(app, "/v1/completions", {**document, "stream": stream})
    assert (status, body["error"]["param"]) == (400, "min_tokens"), body
    assert body["error"]["message"].startswith(MIN_TOKENS_PAST_ROOM), body
    # and the room the longest prompt leaves, as the worker says it (it was not said)
    said = re.search(
        r"the prompt is (\d+) tokens of the model's context length of 128, "
        r"which leaves room for (\d+) new tokens$",
        body["error"]["message"],
    )
    assert said is not None, body
    assert int(said[1]) + int(said[2]) == 128 and int(said[2]) < 80 < int(said[1]) + 80


def test_the_prompt_s_tokens_in_tgi_details_over_the_bound_are_refused_before_the_work(
    tokenizer_json,
):
    """`decoder_input_details` lists each of the prompt's tokens (`prefill`, about 50
    bytes each): a prompt of the model's whole length is megabytes for a long-context
    model, several of them on `POST /` more. They are counted with the new tokens' before
    the request queues; the idle queue fails any call, so a 413 here came first."""
    app = app_for("text-generation", tokenizer_json, {}, max_answer_bytes=5_000)
    asked = {"details": True, "decoder_input_details": True, "max_new_tokens": 1}
    long_one, half = "hello world " * 60, "hello world " * 30  # about 120 and 60 tokens
    best_of = {**asked, "best_of": 2, "do_sample": True}  # (TGI's: two answers listed)
    for path, inputs, parameters in (
        ("/generate", long_one, asked),
        ("/", [half, half], asked),
        ("/generate", half, best_of),
        ("/", [half], best_of),
    ):
        status, body = post(app, path, {"inputs": inputs, "parameters": parameters})
        assert status == 413, body
        assert "5,000 bytes" in body["error"] and "decoder_input_details" in body["error"]
    without = {**asked, "decoder_input_details": False}
    for path, inputs, parameters in (
        ("/generate", long_one, without),
        ("/generate", half, asked),
        ("/", [half], asked),
        # TGI's truncate: the prompts list only their last 20 tokens each
        ("/generate", long_one, {**asked, "truncate": 20}),
        ("/", [long_one, half], {**asked, "truncate": 20}),
        # best_of without details answers one text: the details it is chosen by, unlisted
        ("/generate", half, {"max_new_tokens": 60, "best_of": 2, "do_sample": True}),
    ):
        status, body = post(app, path, {"inputs": inputs, "parameters": parameters})
        assert status != 413, body
    # (with them, its two answers' 60 new tokens each are 6,000 bytes)
    listed = {"max_new_tokens": 60, "best_of": 2, "do_sample": True, "details": True}
    status, body = post(app, "/generate", {"inputs": half, "parameters": listed})
    assert status == 413 and "fewer new tokens" in body["error"], body


class CountingTokenizers:
    """The server's tokenizers, as check_echo_size asks them: one word, one token."""

    def __init__(self) -> None:
        self.asked = 0

    async def get(self, model):
        self.asked += 1
        return self

    def count(self, texts, most):
        return [len(text.split()) for text in texts]


def test_an_echo_answer_of_the_bound_exactly_is_allowed_and_counted_only_if_it_may_not_fit():
    tokenizers = CountingTokenizers()
    model = SimpleNamespace(positions=10)  # as ServedModel says it: its input length
    per_token = 2 * 3 * LISTED_BYTES  # 2 listed in each of 3 choices

    def check(prompts, tokens, model=model):
        asyncio.run(check_echo_size(tokenizers, model, prompts, 2, 3, tokens * per_token))

    check(["a b c"], 10)  # a prompt of the model's whole length fits: nothing counted
    assert tokenizers.asked == 0
    check(["a b c", [1, 2]], 5)  # five tokens in all: the bound exactly
    assert tokenizers.asked == 1
    with pytest.raises(PayloadTooLarge, match="answer"):
        check(["a b c", [1, 2, 3]], 5)
    check(["a b c"] * 100, 0, SimpleNamespace(positions=0))  # not loaded: the worker checks
    assert tokenizers.asked == 2  # the refused one's only


# --- a real server's memory -------------------------------------------------------------


def memory_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc")
def test_four_900kb_tokenize_bodies_at_once_cost_the_server_little(tiny_model):
    """The report's case: four 900 KB bodies at once took the server from 70 to 1,220 MB
    and left it at 680 MB. Now the peak stays within 100 MB of the start, and the server
    is back within 20 MB of it once they are answered."""
    with RunningServer(["--model", tiny_model("sentence-embedding"), "--threads", "1"]) as server:
        assert server.process is not None
        pid = server.process.pid
        assert server.post_json({"inputs": "warm up"}, "/tokenize")[0] == 200
        start = memory_kib(pid, "VmRSS")
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak counts from here
        statuses: list[int] = []

        def send(document):
            statuses.append(server.post_json(document, "/tokenize")[0])

        for document in ({"inputs": LONG}, {"inputs": LONG, "truncate": True}):
            clients = [threading.Thread(target=send, args=(document,)) for _ in range(4)]
            for client in clients:
                client.start()
            for client in clients:
                client.join()
        assert statuses == [422] * 4 + [200] * 4
        peak, after = memory_kib(pid, "VmHWM"), memory_kib(pid, "VmRSS")
        assert peak - start <= 100 * 1024, (start, peak)
        assert after - start <= 20 * 1024, (start, after)


def test_tokenize_of_a_model_of_huge_positions_bounds_a_lists_texts(tokenizer_json):
    """/tokenize's bound of a list's texts is MAX_TOKENIZE_TOKENS however many positions
    the model names (a memory bound)."""
    app = app_for("feature-extraction", tokenizer_json, {"max_input_length": 10**7})
    status, body = post(app, "/tokenize", {"inputs": ["a " * (MAX_TOKENIZE_TOKENS + 1), "b"]})
    assert status == 422 and f"more than {MAX_TOKENIZE_TOKENS} tokens" in body["error"], body
