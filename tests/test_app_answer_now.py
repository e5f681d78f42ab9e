"""What the app answers in the pass that read a request: probes, and refusals."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from rawserve.api.app import App
from rawserve.api.served import ServedModel, ServedModels
from rawserve.api.settings import AppSettings
from rawserve.http.errors import (
    GatewayTimeout,
    HTTPError,
    ServiceUnavailable,
    Unauthorized,
    error_response,
)
from rawserve.http.exchange import HttpRequest, HttpResponse
from rawserve.serving.core import SchedulerCore
from rawserve.serving.driver import Scheduler
from rawserve.serving.service import ModelService
from rawserve.serving.status import LoadState
from rawserve.shared.messages import WorkerReady
from tests.test_scheduler import FakeBackend, next_batch, taught


def loaded(task: str) -> WorkerReady:
    """What a worker reported when it loaded."""
    return WorkerReady(pid=1, task=task, device="cpu", dtype="float32", load_seconds=0.0)


class Workers(FakeBackend):
    """The worker pool's face the app reads, on the scheduler's fake backend."""

    ready = True
    healthy = True
    loaded = loaded("text-classification")

    def load_state(self):
        return LoadState.LOADING, None

    restart_in: float | None = None  # a first load: no estimate

    def back_in(self):
        return self.restart_in

    def status(self):
        return []


def request(method: str, path: str, body: bytes = b"", headers=()) -> HttpRequest:
    path, _, query = path.partition("?")
    return HttpRequest(method, path, query, list(headers), body, request_id="test")


@pytest.fixture
def app():
    workers = Workers()
    scheduler = Scheduler(SchedulerCore(max_queue=2), workers)
    model = ServedModel("test-model", ModelService(scheduler, workers))
    return App(ServedModels([model]), AppSettings(api_key="secret"))


def test_probes_are_answered_at_once(app):
    assert json.loads(app.answer_now(request("GET", "/health")).body) == {"status": "ok"}
    ready = app.answer_now(request("GET", "/ready"))
    assert ready.status == 200 and json.loads(ready.body)["task"] == "text-classification"
    app.start_draining()
    assert app.answer_now(request("HEAD", "/ready")).status == 503
    # new work is refused in the words, and with the wait, of the work the queue held
    with pytest.raises(ServiceUnavailable) as refused:
        app.answer_now(request("POST", "/", b"hello", [("authorization", "Bearer secret")]))
    assert str(refused.value) == "server shutting down"
    assert ("Retry-After", "1") in refused.value.headers


def test_ready_with_full_ok_counts_a_full_queue_as_ready():
    """Kubernetes takes a pod whose readiness fails out of its Service: under an overload
    of every replica, /ready's "full" took them all out, and clients' connections were
    refused where each replica would have answered a fast 503 with Retry-After."""
    model, other = served("model", "text-classification"), served("other", "fill-mask")
    app = App(ServedModels([model, other]))
    fill(model)

    def ready(path: str) -> tuple[int, dict]:
        answer = app.answer_now(request("GET", path))
        assert answer is not None
        return answer.status, json.loads(answer.body)

    assert ready("/ready") == (
        503,
        {"status": "full", "models": {"model": "full", "other": "ready"}},
    )
    assert ready("/ready?full=ok") == (
        200,
        {"status": "full", "models": {"model": "full", "other": "ready"}},
    )
    assert ready("/ready/model?full=ok") == (200, {"status": "full", "task": "text-classification"})
    assert ready("/ready/other?x=1&full=ok") == (200, {"status": "ready", "task": "fill-mask"})
    assert ready("/ready/model")[0] == 503
    for wrong in ("full=yes", "full=", "full=ok&full=ok", "full"):
        with pytest.raises(HTTPError) as refused:
            app.answer_now(request("GET", f"/ready?{wrong}"))
        assert refused.value.status == 400 and "full=ok" in str(refused.value)
    other.serving.workers.ready = False  # loading, or draining: never ready
    assert ready("/ready?full=ok")[0] == 503
    app.start_draining()
    assert ready("/ready/model?full=ok") == (503, {"status": "draining"})
    # told when to come back, as the work it refuses is (a proxy's next try goes elsewhere)
    drained = app.answer_now(request("GET", "/ready"))
    assert drained is not None and ("Retry-After", "1") in drained.headers


async def test_inference_goes_the_long_way_until_the_queue_is_full(app):
    authorized = [("authorization", "Bearer secret")]
    post = request("POST", "/", b"hello", authorized)
    assert app.answer_now(post) is None  # room in the queue: handled by `handle`
    for value in ("a", "b"):
        core = app.models.default.serving.queue.core
        core.admit([core.new_item(value, {}, 1e9, 0.0)])
    with pytest.raises(ServiceUnavailable) as refused:
        app.answer_now(post)
    assert "queue full" in str(refused.value)
    with pytest.raises(Unauthorized):  # the key is checked first, full queue or not
        app.answer_now(request("POST", "/", b"hello"))


def test_other_routes_go_the_long_way(app):
    authorized = [("authorization", "Bearer secret")]
    assert app.answer_now(request("GET", "/info", headers=authorized)) is None
    assert app.answer_now(request("GET", "/metrics")) is None
    assert app.answer_now(request("POST", "/tokenize", b"{}", authorized)) is None


@pytest.mark.parametrize(
    ("method", "path", "headers", "status"),
    [
        ("POST", "/tokenize", [], 401),  # its body is not needed to refuse it
        ("GET", "/info", [], 401),
        ("POST", "/no-such-route", [], 404),
        ("DELETE", "/health", [], 405),
        ("POST", "/health", [], 405),
        ("PUT", "/tokenize", [("authorization", "Bearer secret")], 405),
        ("POST", "/models/no-such-model", [("authorization", "Bearer secret")], 404),
    ],
)
def test_what_the_head_alone_refuses_is_refused_from_the_head(app, method, path, headers, status):
    assert refusal(app, request(method, path, b"{}", headers)).status == status


def refusal(app: App, head: HttpRequest) -> HttpResponse:
    """What the app refuses from `head` alone: raised for the protocol to render in
    rawserve's shape, or rendered where the route's own dialect says how (TEI's types)."""
    try:
        answer = app.answer_now(head)
    except HTTPError as error:
        return error_response(error)
    assert answer is not None, "not refused"
    return answer


def tei_refusal(app: App, head: HttpRequest) -> tuple[int, str, dict[str, str]]:
    """A refusal on one of TEI's routes: its status, TEI's error type, its headers."""
    answer = app.answer_now(head)
    assert answer is not None, "not refused"
    return answer.status, json.loads(answer.body)["error_type"], dict(answer.headers)


def test_a_full_queues_ready_says_to_come_back_when_its_refusals_do():
    """/ready's Retry-After for a full queue was always 1 s, beside refusals of that queue
    saying 4: a balancer came back to the same full server before the clients it sent
    away did. It says what a refusal says now."""
    import math

    model = served("model", "text-classification", max_queue=8)
    app = App(ServedModels([model]))
    fill(model)
    core = model.serving.queue.core
    core.cost_model.observe(16, 3.0)  # queued items that take seconds to drain
    core.cost_model.observe(16, 3.0)
    refusal = model.serving.admission()
    assert refusal is not None and refusal.retry_after is not None and refusal.retry_after > 1
    ready = app.answer_now(request("GET", "/ready"))
    assert ready is not None and ready.status == 503
    assert ("Retry-After", str(math.ceil(refusal.retry_after))) in ready.headers


def served(name: str, task: str, max_queue: int = 1) -> ServedModel:
    workers = Workers()
    workers.loaded = loaded(task)
    scheduler = Scheduler(SchedulerCore(max_queue=max_queue), workers)
    return ServedModel(name, ModelService(scheduler, workers))


def fill(model: ServedModel) -> None:
    core = model.serving.queue.core
    while len(core) < core.max_queue:
        core.admit([core.new_item("queued", {}, 1e9, 0.0)])


async def test_routes_whose_body_names_the_model_are_refused_from_the_head_when_none_can_take_it():
    embedder = served("embedder", "feature-extraction")
    other_embedder = served("other", "feature-extraction")
    classifier = served("classifier", "text-classification")
    app = App(ServedModels([embedder, other_embedder, classifier]))
    embeddings = request("POST", "/v1/embeddings", b'{"input": "hi", "model": "embedder"}')
    predict = request("POST", "/predict", b'{"inputs": "hi"}')
    fill(embedder)
    fill(other_embedder)
    # two embedding models fit: the body is read to see which is named, and refused then
    # (before its texts are tokenized), in the route's dialect: OpenAI's shape
    assert app.answer_now(embeddings) is None
    refused = await app.handle(embeddings)
    assert refused.status == 503
    assert "queue full" in json.loads(refused.body)["error"]["message"]
    assert dict(refused.headers)["Retry-After"]
    assert app.answer_now(predict) is None  # the classifier's queue has room
    fill(classifier)
    assert app.answer_now(predict) is None  # (of several served, the body says which)
    refused = await app.handle(predict)
    assert refused.status == 503 and json.loads(refused.body)["error_type"] == "Overloaded"
    # /tokenize runs in the server: never refused for a full queue
    assert app.answer_now(request("POST", "/tokenize", b'{"inputs": "hi"}')) is None
    # a route no served model fits is a 404 whatever its body: refused from the head
    unfit = app.answer_now(request("POST", "/v1/chat/completions", b"{}"))
    assert unfit is not None and unfit.status == 404
    message = json.loads(unfit.body)["error"]["message"]
    assert "no served model fits" in message and "'classifier' serves" in message
    alone = App(ServedModels([served("embedder", "feature-extraction")]))
    unfit = refusal(alone, request("POST", "/predict", b'{"inputs": "hi"}'))
    assert unfit.status == 404 and b"'embedder' serves feature-extraction" in unfit.body


def busy_rows(model: ServedModel, rows: int = 8) -> None:
    """The model's continuous worker with every row running a 128-token answer sent
    now: ~4.3 s each, at the measured ~0.03 s a token."""
    core = model.serving.queue.core
    core.max_batch_size, core.workers, core.default_new_tokens = 1, rows, 16
    taught(core)
    now = time.monotonic()
    for _ in range(rows):
        core.admit([core.new_item("prompt", {"max_new_tokens": 128}, now + 30, now)], now)
        assert next_batch(core, now) is not None


async def test_a_generation_whose_row_would_free_past_its_deadline_is_refused_from_the_head():
    """Behind rows that free in ~4.3 s, a request due in 2 s is refused 503 from its
    head, whatever its body would ask (it is never read), in its route's dialect, with a
    Retry-After, counted once; one due in 30 s is read and judged whole."""
    chat = served("chat", "text-generation", max_queue=64)
    busy_rows(chat)
    drops = Drops()
    chat.serving.queue.metrics = drops
    app = App(ServedModels([chat]))
    soon = [("x-request-timeout", "2")]
    refused = refusal(app, request("POST", "/v1/chat/completions", b"", soon))
    assert refused.status == 503 and int(dict(refused.headers)["Retry-After"]) >= 1
    message = json.loads(refused.body)["error"]["message"]
    assert "would outlast the request's deadline" in message
    assert drops.reasons == ["rejected"]
    assert tei_refusal(app, request("POST", "/generate", b"", soon))[:2] == (503, "overloaded")
    assert refusal(app, request("POST", "/", b"", soon)).status == 503
    later = [("x-request-timeout", "30")]
    for path in ("/v1/chat/completions", "/v1/completions", "/generate", "/"):
        assert app.answer_now(request("POST", path, b"", later)) is None
    assert drops.reasons == ["rejected"] * 3


class Drops:
    """The scheduler's metrics, keeping the reasons of the drops it counts."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def drop(self, reason: str, count: int = 1) -> None:
        self.reasons += [reason] * count

    def observe_batch(self, size: int, compute_seconds: float) -> None:
        pass

    def observe_queue(self, waits) -> None:
        pass


async def test_a_refusal_is_counted_once_against_the_model_the_request_is_for():
    """Of several models a route fits, all of them full, the refusal was given from the
    head in the first one's name and counted against it, whichever the body named."""
    embedder = served("embedder", "feature-extraction")
    spare = served("spare", "feature-extraction", max_queue=4)
    app = App(ServedModels([embedder, spare]))
    drops = {model.name: Drops() for model in (embedder, spare)}
    for model in (embedder, spare):
        model.serving.queue.metrics = drops[model.name]
    for_spare = request("POST", "/embed", b'{"inputs": "hi", "model": "spare"}')
    fill(embedder)
    fill(spare)
    assert app.answer_now(for_spare) is None  # the body says which
    refused = await app.handle(for_spare)
    assert refused.status == 503 and json.loads(refused.body)["error_type"] == "Overloaded"
    assert (drops["embedder"].reasons, drops["spare"].reasons) == ([], ["rejected"])
    # a name not served is 404, where the one model that fits the route is full or
    # restarting too (its 503 answered a typo, counted against it)
    reader = served("reader", "text-classification")
    app = App(ServedModels([embedder, reader]))
    for body in (b'{"inputs": "hi", "model": "nope"}', b'{"inputs": "hi", "model": "reader"}'):
        typo = request("POST", "/embed", body)
        assert app.answer_now(typo) is None
        assert (await app.handle(typo)).status == 404
    assert drops["embedder"].reasons == []
    # where one model fits the route, from the head, counted once against it
    alone = served("alone", "feature-extraction")
    alone.serving.queue.metrics = counted = Drops()
    single = App(ServedModels([alone]))
    assert app.answer_now(request("POST", "/embed", b"")) is None  # (several fit here)
    fill(alone)
    status, _, _ = tei_refusal(single, request("POST", "/embed", b'{"inputs": "hi"}'))
    assert status == 503 and counted.reasons == ["rejected"]


async def test_options_star_asks_about_the_server_as_a_whole(app):
    """`OPTIONS *` (RFC 9110 section 9.3.7) is answered with the methods the server
    serves, key or not (it names no route); any other method on `*` is 405."""
    answer = app.answer_now(request("OPTIONS", "*"))
    assert answer is not None and answer.status == 204 and answer.body == b""
    allowed = {method.strip() for method in dict(answer.headers)["Allow"].split(",")}
    assert allowed == {"GET", "HEAD", "OPTIONS", "POST"}
    assert (await app.handle(request("OPTIONS", "*"))).status == 204
    with pytest.raises(HTTPError) as refused:
        app.answer_now(request("GET", "*"))
    assert refused.value.status == 405


async def test_a_preflight_of_options_star_allows_every_method_the_server_serves(app):
    """A CORS preflight of `*` asking for POST was 405 "method not allowed: this path
    takes OPTIONS": `*` stands for the server as a whole, whose methods `OPTIONS *`
    lists."""
    from dataclasses import replace

    settings = replace(app.settings, cors_allow_origins=("https://app.example",))
    cors = App(app.models, settings)
    asked = [("origin", "https://app.example"), ("access-control-request-method", "POST")]
    answer = await cors.handle(request("OPTIONS", "*", headers=asked))
    assert answer.status == 204, answer.body
    allowed = dict(answer.headers)["Access-Control-Allow-Methods"].split(", ")
    assert set(allowed) == {"GET", "HEAD", "OPTIONS", "POST"}
    unserved = [asked[0], ("access-control-request-method", "DELETE")]
    assert (await cors.handle(request("OPTIONS", "*", headers=unserved))).status == 405


async def test_of_several_models_one_loading_the_body_names_which_refuses():
    loading = served("loading", "feature-extraction")
    loading.serving.workers.ready = False
    full = served("full", "feature-extraction")
    app = App(ServedModels([loading, full]))
    fill(full)
    for named, error in (("loading", "the model is loading"), ("full", "queue full")):
        embed = request("POST", "/embed", b'{"inputs": "hi", "model": "%s"}' % named.encode())
        assert app.answer_now(embed) is None  # the body is read
        answer = await app.handle(embed)
        assert answer.status == 503 and error in json.loads(answer.body)["error"], answer.body


@pytest.mark.parametrize(
    ("state", "healthy", "message", "counted"),
    [
        (LoadState.LOADING, True, "the model is loading", False),
        (LoadState.WARMING, True, "the model is warming up", False),
        (LoadState.RESTARTING, True, "the model worker is restarting", True),
        (
            LoadState.RESTARTING,
            False,
            "the model worker keeps dying; it cannot take requests",
            True,
        ),
    ],
)
def test_a_model_that_takes_no_work_says_why_as_ready_does(state, healthy, message, counted):
    """A client refused while the model's worker restarts (or keeps dying) is told so,
    not that the model is loading, as /ready and /health tell the operator; and that
    refusal of a model that served is shedding, counted as rejected as a full queue's
    (a first load's is not: no balancer sends work to a replica not yet ready)."""
    model = served("model", "text-classification")
    workers = model.serving.workers
    workers.ready, workers.healthy = False, healthy
    workers.load_state = lambda: (state, None)  # type: ignore[method-assign]
    drops = Drops()
    model.serving.queue.metrics = drops
    app = App(ServedModels([model]))
    for _ in range(2):
        with pytest.raises(ServiceUnavailable) as refused:
            app.answer_now(request("POST", "/", b"hi"))
        assert str(refused.value) == message
    assert drops.reasons == (["rejected"] * 2 if counted else [])
    ready = json.loads(app.answer_now(request("GET", "/ready")).body)  # type: ignore[union-attr]
    assert ready["status"] == state.value


async def test_tokenize_and_decode_answer_while_the_worker_restarts(tiny_model):
    """They run on the tokenizer the server holds since the first load: they answered 503
    while the worker restarted, though nothing of it was needed. Before any load the
    server has no tokenizer: 503 as the model's other routes."""
    from pathlib import Path

    model = served("model", "feature-extraction")
    tokenizer = (Path(tiny_model("sentence-embedding")) / "tokenizer.json").read_text()
    workers = model.serving.workers
    workers.loaded = replace(loaded("feature-extraction"), tokenizer=tokenizer)
    workers.ready = False
    workers.load_state = lambda: (LoadState.RESTARTING, None)  # type: ignore[method-assign]
    app = App(ServedModels([model]))
    tokenize = request("POST", "/tokenize", b'{"inputs": "hello world"}')
    assert app.answer_now(tokenize) is None
    answer = await app.handle(tokenize)
    assert answer.status == 200 and [t["text"] for t in json.loads(answer.body)[0]][1:3] == [
        "hello",
        "world",
    ]
    decode = request("POST", "/decode", b'{"ids": [2, 3]}')
    assert (await app.handle(decode)).status == 200
    embed = request("POST", "/embed", b'{"inputs": "hi"}')
    assert tei_refusal(app, embed)[:2] == (503, "Unhealthy")  # the model's own work waits
    workers.loaded = None  # never loaded: no tokenizer here yet
    assert (await app.handle(tokenize)).status == 503


# 0.0: a restart overdue (its expected time passed): "Retry-After: 0" had balancers
# retry at once
@pytest.mark.parametrize(
    ("restart_in", "wait"), [(None, "5"), (12.4, "13"), (0.2, "1"), (0.0, "1")]
)
def test_a_restarting_model_asks_for_the_wait_its_restart_should_take(restart_in, wait):
    """A model whose workers restart asks clients to come back when it should serve
    again (a large model's restart takes far longer than 5 s), in whole seconds rounded up
    (never sooner than it should), never under a second; a
    first load, with nothing to go by, asks for 5 s."""
    model = served("restarting", "feature-extraction")
    model.serving.workers.ready = False
    model.serving.workers.restart_in = restart_in
    app = App(ServedModels([model]))
    status, error_type, headers = tei_refusal(app, request("POST", "/embed", b'{"inputs": "hi"}'))
    assert (status, error_type, headers["Retry-After"]) == (503, "Unhealthy", wait)
    ready = app.answer_now(request("GET", "/ready"))
    assert ready is not None and ready.status == 503
    assert dict(ready.headers)["Retry-After"] == wait


def test_ready_of_several_restarting_models_asks_for_the_wait_of_the_last_back():
    """/ready is 200 again only when every model is back: it asked for the first
    restarting model's wait (13 s), and a balancer polled again 3 s before the other
    (16 s) was back."""
    first, last, loaded_one = (
        served("embedder", "feature-extraction"),
        served("generator", "text-generation"),
        served("classifier", "text-classification"),
    )
    for model, restart_in in ((first, 12.4), (last, 15.2)):
        model.serving.workers.ready = False
        model.serving.workers.restart_in = restart_in
    app = App(ServedModels([loaded_one, first, last]))
    ready = app.answer_now(request("GET", "/ready"))
    assert ready is not None and ready.status == 503
    assert dict(ready.headers)["Retry-After"] == "16"
    body = json.loads(ready.body)
    assert body["status"] == "loading"
    assert body["models"] == {"classifier": "ready", "embedder": "loading", "generator": "loading"}
    one = app.answer_now(request("GET", "/ready/embedder"))
    assert one is not None and dict(one.headers)["Retry-After"] == "13"


def test_each_models_entry_in_info_gives_its_input_limits():
    """Of several models, /info's top gives the default model's limits (TEI's, TGI's):
    each model's entry gives its own, the most tokens it reads of an input, or for a
    model that generates, of a prompt and of a prompt with its answer (a tester found no
    way to learn a second model's)."""
    from rawserve.api.operations import input_limits

    encoder, generator = served("emb", "feature-extraction"), served("gen", "text-generation")
    for model, positions in ((encoder, 512), (generator, 256)):
        workers = model.serving.workers
        workers.loaded = replace(workers.loaded, details={"max_input_length": positions})
    assert input_limits(encoder) == {"max_input_length": 512}
    assert input_limits(generator) == {
        "max_input_tokens": 255,
        "max_input_length": 255,
        "max_total_tokens": 256,
    }


async def test_a_deadline_counts_from_the_requests_head_not_from_its_checked_body(app):
    """It counted from when the body had been read and each long text tokenized for its
    length: a list of long texts had its 504 up to 0.37 s past its X-Request-Timeout."""
    headers = [("authorization", "Bearer secret"), ("x-request-timeout", "5")]
    post = request("POST", "/", b"hello", headers)
    post.received_at = time.monotonic() - 5.5  # its head came 5.5 s ago
    with pytest.raises(GatewayTimeout):
        await app.handle(post)
    on_time = request("POST", "/", b"hello", headers)
    assert app.inference.context.deadline(on_time) == on_time.received_at + 5


async def test_a_models_own_readiness_needs_no_api_key_as_ready_does(app):
    """GET /ready/<name> is a probe: with --api-key a load balancer calls it without one,
    and the document says it needs none."""
    for path in ("/ready", "/ready/test-model"):
        answer = app.answer_now(request("GET", path))
        assert answer is not None and answer.status == 200, path
        assert json.loads(answer.body)["status"] == "ready"
    document = json.loads((await app.openapi(request("GET", "/openapi.json"))).body)
    assert document["paths"]["/ready/test-model"]["get"]["security"] == []


def test_a_deadline_is_the_timeout_without_the_header_and_the_header_up_to_the_most():
    """--timeout is the deadline of a request without X-Request-Timeout; the header may
    ask for more than --timeout, up to --max-timeout (swapped, a request without it had
    the most, and the header was held to --timeout)."""
    from rawserve.api.context import RouteContext

    context = RouteContext(None, AppSettings(timeout=30.0, max_timeout=300.0))  # type: ignore[arg-type]
    plain = request("POST", "/", b"x")
    assert context.deadline(plain) == plain.received_at + 30.0
    longer = request("POST", "/", b"x", [("x-request-timeout", "100")])
    assert context.deadline(longer) == longer.received_at + 100.0
    most = request("POST", "/", b"x", [("x-request-timeout", "1000")])
    assert context.deadline(most) == most.received_at + 300.0
