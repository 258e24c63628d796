"""When Python's cyclic garbage collector walks what the controller holds.

Python collects its youngest objects every GC_YOUNG allocations (its default: 700), and
every tenth collection of a generation is one of the next; a full one is due whenever a
quarter more objects have reached the oldest generation since the last. A full collection
walks every object the controller holds. With 60,000 IDS rules and their pairs it stopped
every thread for 0.7 s and 1.7 s within one minute of 1,000 requests a second, and every
answer and every shunt waited for it; the middle generation's collections, walking the
pairs and rules of the last ~10 s, stopped it for 80-120 ms every ~9 s
(bench/results/2026-11-25).

So the collector walks only what is new. Each tick freezes what lives (gc.freeze: left out
of every collection until the next full one; it also restarts Python's count towards the
next young collection, which then comes only after GC_YOUNG more objects within a second).
Full collections are the controller's, from the tick, with everything unfrozen first: after
a quiet second (no conntrack event, nothing waiting for a switch) at most once every FULL_MIN
seconds, and FULL_MAX seconds after the last whether busy or not. Cyclic garbage, young or
old, may wait that long: the controller's own paths make none (tests hold an add, an
install, an idle-out and a flush to it), and what the full collections find is logged.
Collecting the young generations at each tick instead walked a second's new pairs and rules
every second (18 ms median, 45 ms at most at 1,000 requests a second) and lost the goal.
"""
from __future__ import annotations

import abc
import gc
import logging
import time
from typing import Callable

LOG = logging.getLogger("nfshunt")
GC_YOUNG = 10_000  # allocations between collections of the youngest generation (Python's default: 700)
NEVER = 1 << 30  # the oldest generation's threshold: Python never starts a full collection itself
FULL_MIN = 30.0  # seconds between full collections at least (a quiet controller)
FULL_MAX = 300.0  # seconds between full collections at most (a busy one)
SLOW = 0.1  # seconds: a full collection that took longer is logged
FOUND_MANY = 100_000  # unreachable objects: a full collection that freed more is logged (a cycle to break)


def tune() -> None:
    """At start-up, once the controller's modules are imported: young collections less
    often (a reconcile or a burst allocates millions of objects: with GC_YOUNG the
    controller's part of reconciling 100,000 pairs fell from 2.7-2.9 s to 2.0 s on the
    2-core VM), full ones left to FullCollections, start-up's objects frozen, the imports'
    abstract classes' caches emptied."""
    clear_abc_caches()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG, gc.get_threshold()[1], NEVER)


def clear_abc_caches() -> int:
    """Empty every abstract class's subclass-check caches; returns how many classes.

    os-ken's packet module, at import, asks of every class of every protocol module whether
    it is a PacketBase; each answer is kept in the negative cache of PacketBase and of each
    of its 46 subclasses: 19,000 weak references, 3.3 MB of the controller's RSS, never used
    again. A cache emptied is refilled only with what is asked later."""
    classes = [obj for obj in gc.get_objects() if isinstance(obj, abc.ABCMeta)]
    for cls in classes:
        cls._abc_caches_clear()  # type: ignore[attr-defined]  # (ABCMeta's; not in typeshed)
    return len(classes)


class FullCollections:
    """The full collections `tune` took from Python, made from the controller's tick."""

    def __init__(self, now: float, collect: Callable[[int], int] = gc.collect,
                 clock: Callable[[], float] = time.perf_counter, freeze: Callable[[], None] = gc.freeze,
                 unfreeze: Callable[[], None] = gc.unfreeze):
        self._collect = collect
        self._clock = clock
        self._freeze = freeze
        self._unfreeze = unfreeze
        self._last = now  # when the last one ran (start-up's counts as one: tune)
        self._seen = -1  # conntrack events read at the last tick
        self.count = 0
        self.seconds = 0.0  # the threads' time they took, in all

    def tick(self, now: float, events_read: int, busy: bool) -> float | None:
        """Once a second: a full collection if one is due, then what lives frozen; how long
        the collection took (s), or None."""
        quiet = events_read == self._seen and not busy
        self._seen = events_read
        since = now - self._last
        if since < FULL_MIN or (since < FULL_MAX and not quiet):
            self._freeze()
            return None
        start = self._clock()
        self._unfreeze()
        found = self._collect(2)
        self._freeze()
        took = self._clock() - start
        self._last = now
        self.count += 1
        self.seconds += took
        if took > SLOW or found > FOUND_MANY:
            LOG.info("a full garbage collection held the controller for %.2f s (%d unreachable objects freed, "
                     "%s)", took, found, "quiet" if quiet else f"busy: none for {since:.0f} s")
        return took
