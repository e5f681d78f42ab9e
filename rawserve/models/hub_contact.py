"""Whether the Hub answers, as one start finds it.

A Hub (or a proxy before it) that takes no connection, answers nothing within
HF_HUB_ETAG_TIMEOUT seconds, or fails (a 5xx) was asked again by each step of a model's
resolution (its file list, its modules.json, its snapshot) and again for each model
after it: the timeout waited three times a model (33 s with the default 10 s), or
huggingface_hub's retries run twice (47 s, 90 lines), in silence. Once it has not
answered, the start asks it nothing more: the cache decides, for that model and the
models after it, and one line says so.

Server process, before any worker starts; never imports torch or transformers.
"""

from __future__ import annotations

import logging

import httpx2
from huggingface_hub.errors import HfHubHTTPError

from rawserve.shared.logs import first_line, without_credentials

log = logging.getLogger("rawserve.models")


class HubContact:
    """What one start has found of the Hub: nothing against it yet, or the failure that
    showed it does not answer (`silence`), after which every look-up is made in the
    cache alone (`lost`)."""

    def __init__(self) -> None:
        self.silence: BaseException | None = None  # the first failure that showed it
        self.lost_for: str | None = None  # the repo it was asked about then

    @property
    def lost(self) -> bool:
        return self.silence is not None

    def notes(self, exc: BaseException, repo_id: str, say: bool = True) -> bool:
        """Whether `exc`, or what it was raised from, is the Hub not answering; the first
        such is kept and, where `say` (where no other line tells of it), said."""
        failure = not_answering(exc)
        if failure is None:
            return False
        if self.silence is None:
            self.silence, self.lost_for = failure, repo_id
            if say:
                log.warning(
                    "%s: the cache decides, and the Hub is not asked again in this start for a "
                    "model the cache holds",
                    failed(failure, repo_id),
                )
        return True

    def passes_over(self, repo_id: str) -> None:
        """Says that `repo_id` is not asked of the Hub, and why."""
        log.warning(
            "the Hub is not asked for %s (it failed for %s in this start): the cache decides",
            repo_id,
            self.lost_for,
        )


def not_answering(exc: BaseException) -> BaseException | None:
    """The failure in `exc`'s chain of causes that shows the Hub not answering: no
    connection, no answer in time, or a 5xx; None where there is none (the Hub said
    no, a 429 asked to wait: it answers)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (httpx2.ConnectError, httpx2.TimeoutException)):
            return seen
        if isinstance(seen, HfHubHTTPError) and seen.response is not None:
            return seen if seen.response.status_code >= 500 else None
        seen = seen.__cause__
    return None


def failed(failure: BaseException, repo_id: str) -> str:
    """How the Hub failed when asked for `repo_id`, in words (`not_answering`'s failure)."""
    from huggingface_hub import constants  # (here: see rawserve.models.hub's docstring)

    if isinstance(failure, HfHubHTTPError) and failure.response is not None:
        return f"the Hub answered {failure.response.status_code} for {repo_id}"
    hub = without_credentials(constants.ENDPOINT)  # (a mirror's user and password)
    if isinstance(failure, httpx2.TimeoutException):
        return (
            f"the Hub ({hub}) did not answer for {repo_id} within "
            f"{constants.HF_HUB_ETAG_TIMEOUT} s (HF_HUB_ETAG_TIMEOUT)"
        )
    return (
        f"the Hub ({hub}) cannot be reached for {repo_id} ({first_line(failure)[:200]}; "
        "HF_HUB_OFFLINE=1 does not try)"
    )


def in_short(failure: BaseException) -> str:
    """`not_answering`'s failure in a few words, for the line that ends a start (the
    warning that said it whole may be far above it)."""
    from huggingface_hub import constants  # (here: see rawserve.models.hub's docstring)

    if isinstance(failure, HfHubHTTPError) and failure.response is not None:
        return f"it answered {failure.response.status_code}"
    if isinstance(failure, httpx2.TimeoutException):
        return f"no answer within {constants.HF_HUB_ETAG_TIMEOUT} s, HF_HUB_ETAG_TIMEOUT"
    return first_line(failure)[:200]  # a refused connection, a certificate not trusted
