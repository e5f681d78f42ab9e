"""The options the routes read, fixed when the server starts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class AppSettings:
    timeout: float = 30.0  # default request deadline, seconds
    max_timeout: float = 300.0  # the most X-Request-Timeout may ask for
    api_key: str | None = field(default=None, repr=False)  # Bearer token; None: open
    max_client_batch_size: int = 32  # inputs in one request (TEI's name and default); more: 413
    cors_allow_origins: tuple[str, ...] = ()  # browser origins that may call; "*": any
    max_answer_bytes: int = 32 * 2**20  # the most one answer may hold (about); more: 413
    stream_keepalive: float | None = 15.0  # a silent stream's comment interval; None: none
    thinking_in_content: bool = False  # a reasoning model's thinking not apart (`reasoning`)
    # when the server started (Unix time): /v1/models' `created`, made once where the
    # options are read, so every HTTP process (a restarted one too) says the same; not a
    # setting: configs read apart are still equal
    started: int = field(default_factory=lambda: int(time.time()), compare=False)
