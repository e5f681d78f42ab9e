"""`GET /openapi.json`: the running server describes exactly the routes it serves, for
its model's task, in a document that validates as OpenAPI 3.1; then Schemathesis (an API
fuzzer that reads the document) attacks a running server with it.

The fuzzing is bounded (a few dozen examples per operation) and runs against a fast
handler and a tiny model: no answer may be a 5xx, no answer may break the document's
schemas or statuses, and the server must be healthy afterwards.
"""

from __future__ import annotations

import json

import pytest

from tests.server import RunningServer, running_together

pytestmark = pytest.mark.slow

FUZZ_EXAMPLES = 30  # per operation; the whole module stays within a few minutes
KINDS = {
    # name: (server arguments, paths its document must have, paths it must not)
    "embedding": (
        ["--max-client-batch-size", "4"],
        {
            "/",
            "/embed",
            "/embed_all",
            "/similarity",
            "/tokenize",
            "/decode",
            "/v1/embeddings",
            "/score",
        },
        {
            "/predict",
            "/classify",
            "/rerank",
            "/v1/rerank",
            "/v1/chat/completions",
            "/v1/completions",
            "/embed_sparse",  # (a SPLADE model's)
        },
    ),
    "classifier": (
        [],
        {"/", "/predict", "/tokenize", "/decode", "/classify", "/v1/classify"},
        {
            "/score",
            "/embed",
            "/embed_all",
            "/similarity",
            "/rerank",
            "/v1/embeddings",
            "/v1/chat/completions",
        },
    ),
    "reranker": (
        [],
        {"/", "/predict", "/rerank", "/v1/rerank", "/v2/rerank", "/tokenize", "/decode", "/score"},
        {"/embed"},
    ),
    "chat": (
        [],
        {"/", "/v1/chat/completions", "/v1/completions", "/tokenize", "/decode"},
        {"/embed", "/predict", "/rerank", "/v1/embeddings"},
    ),
    "handler": (
        [],
        {"/"},
        {"/embed", "/predict", "/rerank", "/tokenize", "/decode", "/v1/chat/completions"},
    ),
}
ALWAYS = {"/health", "/ready", "/info", "/metrics", "/v1/models", "/openapi.json"}
MODEL_KINDS = {
    "embedding": "sentence-embedding",
    "classifier": "text-classification",
    "reranker": "reranker",
    "chat": "chat",
}


@pytest.fixture(scope="module")
def servers(tiny_model):
    started = {}
    for name, (extra, _, _) in KINDS.items():
        model = (
            ["--handler", "tests.handlers:echo"]
            if name == "handler"
            else ["--model", tiny_model(MODEL_KINDS[name])]
        )
        started[name] = RunningServer([*model, "--threads", "1", "--timeout", "10", *extra])
    with running_together(started):
        yield started


def document(server):
    status, headers, body = server.request("GET", "/openapi.json")
    assert status == 200 and headers["content-type"] == "application/json"
    return json.loads(body)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_the_document_validates_as_openapi_3_1(servers, name):
    from openapi_spec_validator import validate
    from openapi_spec_validator.validation import OpenAPIV31SpecValidator

    spec = document(servers[name])
    assert spec["openapi"].startswith("3.1.")
    validate(spec, cls=OpenAPIV31SpecValidator)
    assert spec["info"]["title"] and spec["info"]["version"]


@pytest.mark.parametrize("name", sorted(KINDS))
def test_the_document_lists_what_the_server_serves_and_nothing_else(servers, name):
    server = servers[name]
    _, present, absent = KINDS[name]
    paths = document(server)["paths"]
    assert present | ALWAYS <= set(paths)
    assert not absent & set(paths)
    for path, operations in paths.items():  # every documented operation is routed
        for method in operations:
            if method.upper() == "POST":
                status, _, _ = server.request(
                    "POST", path, b"{}", {"Content-Type": "application/json"}
                )
            else:
                status, _, _ = server.request(method.upper(), path)
            assert status not in (404, 405), (method, path, status)
    for path in absent:  # and what it leaves out is not served
        status, _, body = server.request("POST", path, b"{}", {"Content-Type": "application/json"})
        assert status == 404, (path, body)


def test_every_operation_says_its_request_and_answers(servers):
    """Every operation says its request and answers, the status of a body typed as no
    JSON is (an image: 415) among them (/tokenize and /decode answered it, undocumented)."""
    server = servers["embedding"]
    spec = document(server)
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            assert operation["responses"]["200"]["content"], (method, path)
            if method == "post":
                assert operation["requestBody"]["content"], path
                assert "413" in operation["responses"] and "400" in operation["responses"]
                image = {"Content-Type": "image/png"}
                status, _, _ = server.request("POST", path, b"\x89PNG\r\n", image)
                assert str(status) in operation["responses"], (path, status)
    schemas = spec["components"]["schemas"]
    assert set(schemas["ErrorResponse"]["required"]) == {"error", "error_type"}


def test_the_inference_route_is_described_for_the_models_task(servers):
    embedding = document(servers["embedding"])["paths"]["/"]["post"]
    classifier = document(servers["classifier"])["paths"]["/"]["post"]
    assert embedding != classifier  # each task its own request and answer
    assert "feature-extraction" in json.dumps(embedding)
    assert "text-classification" in json.dumps(classifier)


def test_generates_body_takes_one_text_as_the_document_says(servers):
    """TGI's /generate reads one prompt, as its own schema says: the document gave
    `POST /`'s `inputs` (a text, or a list of up to 32), which the route refuses."""
    from jsonschema import Draft202012Validator

    server = servers["chat"]
    for path in ("/generate", "/generate_stream"):
        route = document(server)["paths"][path]["post"]
        schema = Draft202012Validator(route["requestBody"]["content"]["application/json"]["schema"])
        assert schema.is_valid({"inputs": "hello there"})
        assert not schema.is_valid({"inputs": ["hello", "there"]})
    status, body = server.post_json({"inputs": ["hello", "there"]}, "/generate")
    assert status == 422 and body == {
        "error": '"inputs" must be one text',
        "error_type": "validation",
    }


def test_a_generations_details_are_as_the_document_says(servers):
    """/generate's details as they are answered fit the document's schema, each field
    described: it said a prompt token has `special` and a number for `logprob` (the
    first has null, and none has `special`), and left `top_tokens` out."""
    from jsonschema import Draft202012Validator

    server = servers["chat"]
    route = document(server)["paths"]["/generate"]["post"]
    schema = route["responses"]["200"]["content"]["application/json"]["schema"]
    asked = {"max_new_tokens": 2, "decoder_input_details": True, "top_n_tokens": 2}
    status, body = server.post_json({"inputs": "hello there", "parameters": asked}, "/generate")
    assert status == 200, body
    Draft202012Validator(schema).validate(body)
    assert body["details"]["prefill"][0]["logprob"] is None
    described = set(schema["properties"]["details"]["properties"])
    assert set(body["details"]) == described - {"best_of_sequences"}
    # and with TGI's best_of, the answers not chosen beside
    sampled = {**asked, "best_of": 2, "do_sample": True}
    status, body = server.post_json({"inputs": "hello there", "parameters": sampled}, "/generate")
    assert status == 200, body
    Draft202012Validator(schema).validate(body)
    assert set(body["details"]) == described and len(body["details"]["best_of_sequences"]) == 1
    # /invocations answers it in a list, as its own document says (it said /generate's),
    # and a completion's body as a completion (the first fix said a list alone)
    invoked = document(server)["paths"]["/invocations"]["post"]["responses"]["200"]
    answers = Draft202012Validator(invoked["content"]["application/json"]["schema"])
    status, body = server.post_json({"inputs": "hello there", "parameters": asked}, "/invocations")
    assert status == 200, body
    answers.validate(body)
    status, body = server.post_json({"prompt": "hi", "max_tokens": 2}, "/invocations")
    assert status == 200 and body["object"] == "text_completion", body
    answers.validate(body)
    assert "text/event-stream" in invoked["content"]


# --- Schemathesis ---------------------------------------------------------------------


def fuzz(server):
    """Run Schemathesis on every operation of `server`'s document, with requests that fit
    the schemas and requests that break them; the failures it found.

    Every check but one: a request the schemas allow may still be refused (a text too
    long for the model is 422, `1.0` is not an integer here though JSON Schema says it
    is), so "positive data acceptance" is left out. Any 5xx, an answer that breaks its
    schema or has an undocumented status, and a request breaking the schemas that is
    not refused, all fail.
    """
    import hypothesis
    import schemathesis
    from schemathesis import GenerationMode
    from schemathesis.checks import positive_data_acceptance

    # a request that breaks the schemas is refused with any 4xx of the document's: 413 too
    # (a list longer than --max-client-batch-size is refused before its items are read)
    refusals = ["400", "401", "404", "405", "413", "415", "422"]
    config = schemathesis.Config.from_dict(
        {"checks": {"negative_data_rejection": {"expected-statuses": refusals}}}
    )
    url = f"http://127.0.0.1:{server.port}/openapi.json"
    schema = schemathesis.openapi.from_url(url, config=config)
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in GenerationMode:
            if mode is GenerationMode.NEGATIVE and not operation.body:
                continue  # nothing to break in a request without a body

            @hypothesis.settings(
                max_examples=FUZZ_EXAMPLES,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(hypothesis.HealthCheck),
            )
            @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
            def run(case):
                case.call_and_validate(excluded_checks=[positive_data_acceptance], timeout=30)

            try:
                run()
            except Exception as exc:  # noqa: BLE001 - collected, reported together below
                failures.append(
                    f"{operation.method.upper()} {operation.path} ({mode.value}): {exc}"
                )
    return failures


@pytest.mark.parametrize("name", ["handler", "embedding"])
def test_schemathesis_finds_nothing_and_the_server_stays_healthy(servers, name):
    server = servers[name]
    failures = fuzz(server)
    assert not failures, "\n\n".join(failures)
    assert server.process.poll() is None
    assert server.request("GET", "/health")[0] == 200
    assert server.request("GET", "/ready")[0] == 200
    log = server.read_log()
    assert not any("Traceback" in line or "ERROR" in line for line in log), log[-20:]
    # the fuzzer reached every operation, and sent many bodies to those that take one
    paths = document(server)["paths"]
    for path, operations in paths.items():
        if path in ("/health", "/ping") or path.startswith("/ready"):
            continue  # probes are logged at debug level only
        for method, operation in operations.items():
            sent = [line for line in log if f'"{method.upper()} {path}"' in line]
            assert len(sent) >= (10 if "requestBody" in operation else 1), (method, path)
