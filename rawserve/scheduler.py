"""The design card's name for the serving side's first half, the deadline scheduler.

It lives in `rawserve.serving` (the driver in `serving.driver`, its decisions in
`serving.core`); this module only re-exports the driver under the card's name. Code
imports it from `rawserve.serving`.
"""

from rawserve.serving import Scheduler

__all__ = ["Scheduler"]
