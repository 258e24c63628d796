"""An IDS call handed to the event loop, and its answer waited for or told.

Every call runs on the event loop (EventIds, as the control socket's requests do); the
thread that posted it waits for its `Answer`, or the answer's `then` tells whoever needs
it (an add's, ids_backend.submit_async). At most QUEUED
calls are in the loop's queue at once: os-ken's queue (128 events) also carries the
switch's replies, which must never wait behind a flood of requests (feeds.HANDOVERS). A
caller that must not wait for room asks with `try_call` (the API's process's frame reader,
whose other frames would wait behind it): a full queue is its answer at once.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterable, Protocol

from os_ken.controller import event

from nfshunt.config.settings import Config
from nfshunt.core import commands as c
from nfshunt.records.model import ConnEvent
from nfshunt.switch.switch import Switch

from .calls import Outcome

LOG = logging.getLogger("nfshunt")
QUEUED = 32  # IDS calls in the event loop's queue at most
BUSY = "the controller is busy: its event loop has too many IDS requests queued (nothing was done)"


class EventIds(event.EventBase):
    """An IDS API call, run on the event loop."""

    def __init__(self, work: Callable[[], None]):
        super().__init__()
        self.work = work


@dataclass
class Answer:
    """One call's answer, from the event loop to the API thread that waits for it (on
    `done` alone: LoopCalls.wait)."""
    done: threading.Event = field(default_factory=threading.Event)
    taken: bool = False  # the loop has it; read only once `done` was not set in time
    outcome: Outcome | None = None
    barriers: list[threading.Event] = field(default_factory=list)  # then these switches' confirmations
    then: Callable[["Answer"], None] | None = None  # called on the event loop once answered

    def answer(self, outcome: Outcome, barriers: Iterable[threading.Event] = ()) -> None:
        self.outcome = outcome
        self.barriers = list(barriers)
        self.done.set()
        # Called once, and dropped: an add's `then` holds what holds this answer, a cycle
        # that only a full garbage collection would free (19 objects an add, collector.py).
        then, self.then = self.then, None
        if then is not None:
            then(self)


class Host(Protocol):
    """What the IDS backend needs of the app: its switches, and its event loop's services."""
    cfg: Config
    switches: list[Switch]

    def run(self, sw: Switch, commands: Iterable[c.Command], waiter: threading.Event | None = None) -> None: ...

    def post(self, ev: event.EventBase) -> None: ...

    def feed(self, events: list[ConnEvent]) -> None: ...

    def held(self) -> ContextManager[None]:
        """Turns run inside are written to the switches together when it ends."""


class LoopCalls:
    """Posts calls to the event loop (the host's) with room for QUEUED at once. Calls
    posted while one is waiting for the loop join it: the loop runs them in one turn
    (`_drain`), their flow-mods in one write. At a thousand requests a second, a turn, a
    write and an answer each took the loop's thread through the interpreter's lock three
    times a request, and latency grew with the clients' connections (bench ids)."""

    def __init__(self, host: Host):
        self.host = host
        self._room = threading.BoundedSemaphore(QUEUED)
        self._lock = threading.Lock()
        self._calls: list[Callable[[], None]] = []  # posted, not yet run
        self._posted = False  # an EventIds for them is in the loop's queue

    def call(self, work: Callable[[Answer], None], timeout: float, ans: Answer | None = None) -> Answer:
        """Post `work` to the event loop (TimeoutError if there was no room in time); its
        answer (`ans`, or a new one) is waited for with `wait`, or told by its `then`."""
        if not self._room.acquire(timeout=timeout):
            raise TimeoutError(BUSY)
        return self._post(work, ans if ans is not None else Answer())

    def try_call(self, work: Callable[[Answer], None], ans: Answer) -> bool:
        """`call` for a thread that must not wait for room (the API's process's frame reader:
        the child's other frames wait behind it): False, nothing posted, while QUEUED calls
        wait for the loop."""
        if not self._room.acquire(blocking=False):
            return False
        self._post(work, ans)
        return True

    def _post(self, work: Callable[[Answer], None], ans: Answer) -> Answer:
        """`work` posted, its room in the queue taken (given back when the loop runs it)."""
        def run() -> None:
            self._room.release()
            ans.taken = True
            work(ans)
        with self._lock:
            self._calls.append(run)
            if self._posted:
                return ans
            self._posted = True
        try:
            self.host.post(EventIds(self._drain))
        except BaseException:  # not posted: this call is not made; those that joined it are, by the next
            with self._lock:
                self._posted = False
                if run in self._calls:
                    self._calls.remove(run)
                    self._room.release()
            raise
        return ans

    def _drain(self) -> None:
        """On the event loop: every call posted until now, in order, in one turn. One that
        raises does not keep the rest from running; the first error is raised after them
        (the loop counts it as a handler's)."""
        with self._lock:
            calls, self._calls, self._posted = self._calls, [], False
        failed: Exception | None = None
        with self.host.held():
            for run in calls:
                try:
                    run()
                except Exception as exc:
                    if failed is not None:  # (the first is the loop's to count and log)
                        LOG.error("an IDS call failed on the event loop", exc_info=exc)
                    failed = failed or exc
        if failed is not None:
            raise failed

    @staticmethod
    def wait(ans: Answer, take: float, answer: float) -> bool:
        """Whether `ans` was answered: within `take` seconds, or `answer` more if the loop
        took the call by then; TimeoutError if it had not. One Event waited on, not one for
        the taking and then one for the answer: the taking's woke the API thread while the
        loop still ran the call, to contend with it for the GIL (bench ids)."""
        if ans.done.wait(take):
            return True
        if not ans.taken:
            raise TimeoutError("the controller's event loop did not take the request in time")
        return ans.done.wait(answer)
