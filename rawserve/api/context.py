"""What every family of routes shares: the served models, the gate, the options, the clock."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rawserve.api.bodies import request_timeout
from rawserve.api.gate import Gate
from rawserve.api.served import ServedModels
from rawserve.api.settings import AppSettings
from rawserve.http.exchange import HttpRequest


@dataclass(frozen=True)
class RouteContext:
    models: ServedModels
    settings: AppSettings = field(default_factory=AppSettings)
    gate: Gate = field(default_factory=Gate)
    clock: Callable[[], float] = time.monotonic

    def deadline(self, request: HttpRequest) -> float:
        """When the request must be answered: now plus its X-Request-Timeout or the default."""
        seconds = request_timeout(request, self.settings.timeout, self.settings.max_timeout)
        return self.clock() + seconds
