"""The one place where the serving side's refusals and failures become HTTP statuses."""

from __future__ import annotations

import json
import math

import pytest

from rawserve.api.outcomes import http_error, unwrap
from rawserve.api.served import ServedModel
from rawserve.http.errors import (
    GatewayTimeout,
    ServiceUnavailable,
    error_response,
    tgi_error_response,
)
from rawserve.serving.face import FailureKind, ItemFailure, ItemResult, Reason, Refusal, Refused


@pytest.mark.parametrize(
    ("reason", "status"),
    [
        (Reason.QUEUE_FULL, 503),
        (Reason.DEADLINE_UNREACHABLE, 503),
        (Reason.NEVER_ADMISSIBLE, 413),  # a retry cannot help: never 503
        (Reason.NO_WORKER, 503),
        (Reason.LOADING, 503),
        (Reason.SHUTTING_DOWN, 503),
        (Reason.DEADLINE_PASSED, 504),
        (Reason.OUT_OF_MEMORY, 503),
        (Reason.MODEL_FAILED, 500),
    ],
)
def test_every_reason_has_its_status_and_keeps_its_message(reason, status):
    error = http_error(Refusal(reason, "what the client reads"))
    assert error.status == status and error.message.startswith("what the client reads")


@pytest.mark.parametrize("reason", [Reason.DEADLINE_PASSED, Reason.DEADLINE_UNREACHABLE])
def test_a_deadline_refusal_names_the_header_that_asks_for_a_longer_one(reason):
    """A client that named no deadline got `--timeout`'s, and a 504 or 503 that only said
    it passed (or would): a long generation cut at 30 s never learnt how to ask for more."""
    message = http_error(Refusal(reason, "the request's deadline passed")).message
    assert message.startswith("the request's deadline passed") and "X-Request-Timeout" in message


async def test_a_served_models_deadline_error_says_the_most_a_request_may_ask():
    """A client that asked X-Request-Timeout 1000 was given --max-timeout's 300 s: told
    only to ask for a longer deadline, it would ask for 1000 again."""

    class Late:
        async def run(self, inputs, params, deadline, control):
            raise Refused.because(Reason.DEADLINE_PASSED, "the request's deadline passed")

        def admission(self, deadline):  # the wait for a row outlasts its deadline
            return Refusal(Reason.DEADLINE_UNREACHABLE, "no row would free in time", 2.0)

    served = ServedModel("m", Late(), longest_deadline=300.0)  # type: ignore[arg-type]
    with pytest.raises(GatewayTimeout) as late:
        await served.run(["hello"], {}, deadline=0.0)
    longer = "X-Request-Timeout asks for a longer deadline, in seconds, up to 300"
    assert late.value.message.endswith(longer)
    with pytest.raises(ServiceUnavailable) as refused:  # from the head, its body unread
        served.refuse_if_busy(deadline=0.0)
    assert refused.value.message.endswith(longer)


@pytest.mark.parametrize("reason", [r for r in Reason if "DEADLINE" not in r.name])
def test_no_other_refusal_speaks_of_deadlines(reason):
    assert http_error(Refusal(reason, "what the client reads")).message == "what the client reads"


def test_a_refusal_that_a_retry_can_help_says_when_and_defaults_to_a_second():
    full = error_response(http_error(Refusal(Reason.QUEUE_FULL, "server busy: queue full", 2.6)))
    # 2.6 s spread over one more drain (up to 5.2 s), in whole seconds rounded up
    assert 3 <= int(dict(full.headers)["Retry-After"]) <= 6
    stopping = error_response(http_error(Refusal(Reason.SHUTTING_DOWN, "server shutting down")))
    assert ("Retry-After", "1") in stopping.headers
    late = error_response(http_error(Refusal(Reason.DEADLINE_PASSED, "deadline passed")))
    assert not any(name == "Retry-After" for name, _ in late.headers)


@pytest.mark.parametrize("reason", [Reason.QUEUE_FULL, Reason.DEADLINE_UNREACHABLE])
def test_the_refusals_of_a_busy_burst_ask_for_waits_spread_over_one_more_drain(reason):
    # Told the same wait, every client refused in a burst comes back at the same instant
    # and is refused again (the openai SDKs wait exactly the milliseconds they are told)
    waits = []
    for _ in range(20):
        headers = dict(error_response(http_error(Refusal(reason, "server busy", 1.5))).headers)
        waits.append(int(headers["Retry-After-Ms"]))
        # in seconds rounded up: a client reading only those comes back no sooner
        assert math.ceil(waits[-1] / 1000) == int(headers["Retry-After"])
    assert all(1500 <= wait <= 3000 for wait in waits) and len(set(waits)) > 10


def test_an_item_failure_is_the_clients_422_or_the_models_500():
    def status_of(kind: FailureKind) -> int:
        with pytest.raises(Exception) as raised:
            unwrap(ItemResult(ItemFailure(kind, "no"), 0.0, 1, 0.0))
        return raised.value.status

    assert status_of(FailureKind.INPUT) == 422
    assert status_of(FailureKind.INTERNAL) == 500
    assert status_of(FailureKind.OUT_OF_MEMORY) == 500
    assert unwrap(ItemResult({"label": "x"}, 0.0, 1, 0.0)) == {"label": "x"}


@pytest.mark.parametrize(
    ("reason", "error_type"),
    [
        (Reason.QUEUE_FULL, "overloaded"),
        (Reason.DEADLINE_UNREACHABLE, "overloaded"),
        (Reason.LOADING, "unavailable"),  # the server's state, not its load
    ],
)
def test_tgi_routes_type_a_busy_503_as_tgis_clients_read_an_overload(reason, error_type):
    """InferenceClient raised UnknownError("server busy: queue full") for a full queue on
    POST / and /generate: it raises OverloadedError for TGI's type "overloaded"."""
    from huggingface_hub.errors import OverloadedError
    from huggingface_hub.inference._common import _parse_text_generation_error

    answer = tgi_error_response(http_error(Refusal(reason, "server busy", 1.0)))
    document = json.loads(answer.body)
    assert answer.status == 503 and document["error_type"] == error_type
    assert "Retry-After" in dict(answer.headers)
    raised = _parse_text_generation_error(document["error"], document["error_type"])
    assert isinstance(raised, OverloadedError) == (error_type == "overloaded")


def test_a_list_that_failed_says_which_input_failed():
    """Of a list of 32 texts, one without a mask failed the request 422 with the
    model's words alone, and its client could not tell which: the message says the
    index. A single input's message is the model's own."""
    from rawserve.api.outcomes import unwrap_all
    from rawserve.http.errors import UnprocessableInput

    fine = ItemResult([{"token_str": "a"}], 0.0, 1, 0.0)
    no_mask = ItemFailure(FailureKind.INPUT, "No mask_token ([MASK]) found on the input")
    bad = ItemResult(no_mask, 0.0, 1, 0.0)
    assert unwrap_all([fine, fine]) == [fine.output, fine.output]
    with pytest.raises(UnprocessableInput) as failed:
        unwrap_all([fine, fine, bad])
    assert failed.value.message == (
        "the input at index 2: No mask_token ([MASK]) found on the input"
    )
    with pytest.raises(UnprocessableInput) as alone:
        unwrap_all([bad])
    assert alone.value.message == "No mask_token ([MASK]) found on the input"


def test_a_list_whose_every_input_failed_alike_says_so():
    """A handler's unknown keyword failed each input alike: "the input at index 0" blamed
    one input for the request's parameters, and a message naming none left a client of a
    list whose every text lacked a mask to guess whether one or all did. Inputs that
    failed otherwise are still named."""
    from rawserve.api.outcomes import unwrap_all
    from rawserve.http.errors import UnprocessableInput

    said = "invalid parameters for the handler: got an unexpected keyword argument 'sufix'"
    keyword = ItemResult(ItemFailure(FailureKind.INPUT, said), 0.0, 1, 0.0)
    with pytest.raises(UnprocessableInput) as failed:
        unwrap_all([keyword, keyword, keyword])
    assert failed.value.message == f"each of the 3 inputs: {said}"
    other = ItemResult(ItemFailure(FailureKind.INPUT, "another fault"), 0.0, 1, 0.0)
    with pytest.raises(UnprocessableInput) as failed:
        unwrap_all([keyword, other])
    assert failed.value.message == f"the input at index 0: {said}"
