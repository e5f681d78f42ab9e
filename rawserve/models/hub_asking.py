"""How one model's resolution asks the Hub again, or not (`AskingAgain`, in the client
`rawserve.models.hub.bounded_client` gives huggingface_hub).

huggingface_hub asks a repo's info (model_info, and snapshot_download's own call) once: a
429 there, however short the wait it asked for, failed a start with nothing cached ("try
again later" in a second) and served a cached branch that may have moved on. A 429 for a
repo's info is now waited as huggingface_hub waits one for a file (MAX_HUB_WAIT_SECONDS at
most), and the info asked again. Conversely huggingface_hub asks a file again, five times
with 1 to 8 s between, after its first try went silent: a Hub whose API answered and whose
files never did held a start 45 s with HF_HUB_ETAG_TIMEOUT at 3. A request that went
silent is not sent again in that resolution.

Server process, before any worker starts; never imports torch or transformers, and
huggingface_hub's modules that read HF_* variables as they load only where they are used
(rawserve.models.hub's docstring says why).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any

import httpx2
from huggingface_hub.errors import OfflineModeIsEnabled

log = logging.getLogger("rawserve.models")

# The longest wait a start takes before asking the Hub again where the Hub asks for one
# (a 429's `Retry-After`): huggingface_hub waited whatever it said, an hour a retry at 3600
MAX_HUB_WAIT_SECONDS = 30
REPO_INFO_TRIES = 3  # a repo's info is asked at most this often while the Hub answers 429
# a repo's info (`GET /api/models/<repo>[/revision/<rev>]`), behind a mirror's path if any
REPO_INFO = re.compile(r"/api/models/(?P<repo>[^/]+(?:/[^/]+)?)(?:/revision/.+)?$")


class NotAskedAgain(OfflineModeIsEnabled):
    """A request not sent: it went silent before in this resolution. huggingface_hub takes
    it as a request that offline mode did not send (the cache decides), where it asked a
    silent one again five times; its cause is the first silence."""


class AskingAgain:
    """What one model's resolution has found of its requests: those that went silent, and
    whether a repo's info was refused (429) through all its tries (the next is not waited)."""

    def __init__(self) -> None:
        self.silent: dict[tuple[str, str], httpx2.TimeoutException] = {}
        self.rate_limited = False

    def send(
        self, send: Callable[..., httpx2.Response], request: httpx2.Request, **options: Any
    ) -> httpx2.Response:
        """`send(request, **options)` (a client's own), but not where the same request went
        silent before, and again after a 429's wait where it asked for a repo's info."""
        asked = (request.method, str(request.url))
        if (silence := self.silent.get(asked)) is not None:
            raise NotAskedAgain(
                f"{request.method} {request.url}: no answer within its timeout before, not "
                "asked again"
            ) from silence
        info = REPO_INFO.search(request.url.path) if request.method == "GET" else None
        tries = 1
        while True:
            try:
                response = send(request, **options)
            except httpx2.TimeoutException as exc:
                self.silent[asked] = exc
                raise
            if response.status_code != 429 or info is None or self.rate_limited:
                return response
            if tries == REPO_INFO_TRIES:  # the cache decides; the next info is not waited
                self.rate_limited = True
                return response
            # a wait past the bound is not taken (bounded_retry_after dropped it): sooner
            seconds = wait_asked(response) or tries
            response.close()
            log.warning(
                "the Hub answered 429 for %s's info: asking again in %d s", info["repo"], seconds
            )
            time.sleep(seconds)
            tries += 1


def wait_asked(response: httpx2.Response) -> int:
    """The seconds a response asks to wait before asking again (`Retry-After`, or its rate
    limit's reset); 0 where it names none."""
    # (here: huggingface_hub.utils loads its constants: see rawserve.models.hub's docstring)
    from huggingface_hub.utils import parse_ratelimit_headers

    retry_after = response.headers.get("retry-after", "")
    limits = parse_ratelimit_headers(response.headers)
    return max(
        int(retry_after) if retry_after.isdigit() else 0,
        limits.reset_in_seconds if limits is not None and limits.remaining == 0 else 0,
    )
