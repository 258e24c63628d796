"""Memory a burst freed, given back to the system once the burst has settled.

glibc keeps freed heap pages mapped, so after a burst (100,000 conntrack events read,
parsed, queued and answered within seconds) the controller's RSS stayed near the burst's
peak although Python had freed those objects. `malloc_trim(0)` hands them back. It walks
the heap (milliseconds), so it runs from the 1 s tick only after a quiet second that
followed enough work to be worth it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Callable

LOG = logging.getLogger("nfshunt")
TRIM_AFTER = 10_000  # conntrack events read since the last trim that make another worth it


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim): nothing to do
        return None


class Trimmer:
    def __init__(self, trim: Callable[[int], int] | None = None):
        self._trim = trim if trim is not None else _malloc_trim()
        self._trimmed_at = 0  # events read at the last trim
        self._seen = 0  # events read at the last tick

    def tick(self, events_read: int, busy: bool) -> bool:
        """Once a second: trim when no event came since the last tick, nothing is waiting
        for the switch, and a burst's worth of events came since the last trim."""
        quiet = events_read == self._seen
        self._seen = events_read
        if self._trim is None or busy or not quiet or events_read - self._trimmed_at < TRIM_AFTER:
            return False
        self._trimmed_at = events_read
        self._trim(0)
        return True
