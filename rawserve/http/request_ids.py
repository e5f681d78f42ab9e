"""Request ids: the client's `X-Request-Id` when it is sane, else one made here.

Made ids are a random prefix per process and a counter, 32 hex digits like a UUID's,
unique across replicas and restarts without a system call per request.
"""

from __future__ import annotations

import itertools
import re
import secrets

_GIVEN_ID = re.compile(r"[\x21-\x7e]{1,128}")  # 1-128 visible ASCII characters
_PREFIX = secrets.token_hex(8)
_COUNTER = itertools.count()


def new_request_id() -> str:
    return f"{_PREFIX}{next(_COUNTER):016x}"


def request_id(given: str | None) -> str:
    """The client's id if it may be echoed (1-128 visible ASCII characters), else a new one."""
    return given if given and _GIVEN_ID.fullmatch(given) else new_request_id()
