"""Requests in flight to one switch connection, by xid: what was asked, so its answer goes
to the one handler of what was asked (replies.py), and one rule for giving up on it.

Every request that expects an answer is registered here when it is sent: barriers (their
batch of installs and a waiter), flow-stats reads (reconcile, a new shunt's counters, the
static flows', the catchers', an operator's status), meter reads, the packet-in meter's
setting, table size, role requests. An answer (a reply part, an error) names its request
by xid; a reply to no request in flight is dropped (replies.py counts it).

The expiry rule: a request is given up once the switch has answered nothing for EXPIRY
seconds since it was asked (SILENT). A switch still answering is working through what it
was sent (it answers in order): a burst it takes 16 s to apply must not be given up at 5.
A give-up restarts the clock for the rest, so one lost answer does not take every later
request with it. But a switch that answers what was asked after a request, and not the
request, has lost it (PASSED): it keeps every other request alive with its answers, so the
first rule alone would wait for it for ever (a reconcile read lost at connect, and the
default flows' counters read and answered every tick: the switch never programmed). So a
request is also given up once nothing of its answer came for EXPIRY while a later request
of the same kind of message (a switch answers those in order), or a later barrier (after
whose reply nothing asked before it is answered: OpenFlow 1.3, 6.2), has been answered.
A packet-in meter's setting, answered only by a refusal, is not held to that. What a
given-up request's kind does then is its handler's (replies.py).
"""
from __future__ import annotations

import dataclasses
import enum
import threading
import time
from typing import Callable, ClassVar, Iterator, TypeVar

from nfshunt.core.connection import Conn
from nfshunt.core.roles import RoleRequest
from nfshunt.records.model import SwitchFlow

EXPIRY = 5.0  # seconds the switch may answer nothing before what it was asked is given up
BARRIER, FLOW_STATS = "barrier", "flow stats"  # kinds of message (Request.MESSAGE)


class GivenUp(enum.Enum):
    """Why a request was given up (replies.py says it)."""
    SILENT = f"answered nothing for {EXPIRY:.0f} s"
    PASSED = f"answered later requests, not this one, for {EXPIRY:.0f} s"


@dataclasses.dataclass(slots=True)
class Request:
    """A request in flight; `asked` is when it was sent (monotonic); `heard` when a part of
    its answer last came (`asked` until then); `order` its place among the requests asked."""
    asked: float
    heard: float = dataclasses.field(default=0.0, kw_only=True)
    order: int = dataclasses.field(default=0, kw_only=True)
    # The message it is sent as (its answers come in order with the same kind's); None: only
    # a refusal answers it.
    MESSAGE: ClassVar[str | None] = FLOW_STATS


@dataclasses.dataclass(slots=True)
class Batch:
    """Installs sent behind one barrier; errors for their flow-mods name them by xid (the
    map goes with the batch: one table of every xid in flight kept its peak size)."""
    conns: list[Conn]
    xids: dict[int, Conn]
    failed: dict[int, tuple[str, bool]] = dataclasses.field(default_factory=dict)  # id(conn) -> (reason, full)


class TurnWaiter(threading.Event):
    """Who waits for the barrier behind a turn (Dispatcher.run) and must know that the turn
    went to the switch whole (an IDS's add): `failed` names what of it failed inside the
    controller (a command whose handler raised, a flow that could not be built), as (what,
    why). That never went to the switch: the barrier's answer confirms none of it."""

    def __init__(self) -> None:
        super().__init__()
        self.failed: list[tuple[str, str]] = []


class ChangeWatch(TurnWaiter):
    """A change whose every flow-mod must be known to be in the switch (a reload's static
    flows): the flow-mods' xids, what the switch refused of them (errors come before the
    barrier behind them), and how that barrier ended. Set once it is known: the switch
    answered, or it cannot answer (given up, gone, or this controller no longer master)."""

    def __init__(self) -> None:
        super().__init__()
        self.xids: dict[int, Callable[[], str]] = {}  # a flow-mod's xid -> what it does (said only if refused)
        self.refused: list[tuple[str, str]] = []  # (what, the switch's error)
        self.unanswered: str | None = None  # why the switch's answer is not known (None: it answered)
        self.at: float | None = None  # when it was set (monotonic)

    def end(self, unanswered: str | None = None) -> None:
        if not self.is_set():
            self.unanswered = unanswered
            self.at = time.monotonic()
            self.set()


@dataclasses.dataclass(slots=True)
class Barrier(Request):
    """A barrier: the batch of installs it confirms, and who waits for its answer."""
    MESSAGE: ClassVar[str | None] = BARRIER
    batch: Batch | None = None
    waiter: threading.Event | None = None

    def answered(self, unanswered: str | None = None) -> Batch | None:
        """The switch answered (`unanswered`: or why it will not): the waiter is told; the
        batch to settle."""
        if isinstance(self.waiter, ChangeWatch):
            self.waiter.end(unanswered)
        elif self.waiter is not None:
            self.waiter.set()
        return self.batch

    def refused(self, xid: int, reason: str) -> str | None:
        """An error for a flow-mod of the change this barrier's waiter watches: what it did."""
        watch = self.waiter
        if not isinstance(watch, ChangeWatch) or xid not in watch.xids:
            return None
        what = watch.xids[xid]()
        watch.refused.append((what, reason))
        return what


@dataclasses.dataclass(slots=True)
class TableSize(Request):
    """How many entries table 0 holds (table features, or table stats in OpenFlow 1.0)."""
    MESSAGE: ClassVar[str | None] = "table size"


@dataclasses.dataclass(slots=True)
class MeterSet(Request):
    """The packet-in meter's setting: only a refusal answers it."""
    MESSAGE: ClassVar[str | None] = None


@dataclasses.dataclass(slots=True)
class MeterRead(Request):
    """The packet-in meter's drop count (every tick)."""
    MESSAGE: ClassVar[str | None] = "meter stats"


@dataclasses.dataclass(slots=True)
class RoleAsk(Request):
    """A pair's role request (roles.py)."""
    MESSAGE: ClassVar[str | None] = "role"
    request: RoleRequest


@dataclasses.dataclass(slots=True)
class CatcherRead(Request):
    """The catchers read after dropped packet-ins (teardown_sweep): cookies that counted."""
    counted: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class WatchRead(Request):
    """A half-closed shunt's catchers read (teardown_sweep): cookies that counted."""
    counted: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class CounterRead(Request):
    """A new shunt's flow counters (confirm: counters), summed over the reply's parts."""
    conn: Conn
    packets: dict[bool, int] = dataclasses.field(default_factory=dict)  # by direction (reply: True)


@dataclasses.dataclass(slots=True)
class StaticRead(Request):
    """The static flows' counters (status and metrics show them)."""
    flows: list[SwitchFlow] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class ReconcileRead(Request):
    """NFShunt's flows on the switch, for the core's reconcile."""
    flows: list[SwitchFlow] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class FlowsRead(Request):
    """NFShunt's flows for someone else (an operator's status, an IDS rule's counters, the
    defaults a connecting switch kept): `done` gets them, or None if the switch went away or
    was given up on."""
    done: Callable[[list[SwitchFlow] | None], None]
    flows: list[SwitchFlow] = dataclasses.field(default_factory=list)


R = TypeVar("R", bound=Request)


class InFlight:
    """One switch connection's requests in flight, by xid."""

    def __init__(self) -> None:
        self._by_xid: dict[int, Request] = {}
        self.answered = 0.0  # when the switch last answered anything (or was given up on)
        self._asked = 0  # requests asked so far (each one's `order`)
        self._passed: dict[str, int] = {}  # by message: the latest asked of those answered (its order)

    def __len__(self) -> int:
        return len(self._by_xid)

    def ask(self, xid: int, request: Request) -> None:
        self._asked += 1
        request.order, request.heard = self._asked, request.asked
        self._by_xid[xid] = request

    def answer(self, xid: int, now: float, done: bool = True) -> Request | None:
        """The request a reply (or a part with more to come: `done` False) or an error
        answers, taken out once done; None: nothing asked by that xid (an error of a
        flow-mod: the send path's batches know those)."""
        request = self._by_xid.pop(xid, None) if done else self._by_xid.get(xid)
        if request is not None:
            self.answered = request.heard = now
            if done and request.MESSAGE is not None:
                self._passed[request.MESSAGE] = max(self._passed.get(request.MESSAGE, 0), request.order)
        return request

    def expired(self, now: float) -> list[tuple[Request, GivenUp]]:
        """Requests given up (the rules above), taken out, each with why."""
        late = [(xid, why) for xid, r in self._by_xid.items() if (why := self._late(r, now)) is not None]
        if late:
            self.answered = now
        return [(self._by_xid.pop(xid), why) for xid, why in late]

    def _late(self, r: Request, now: float) -> GivenUp | None:
        if now - max(r.asked, self.answered) > EXPIRY:
            return GivenUp.SILENT
        if r.MESSAGE is not None and now - r.heard > EXPIRY and (
                self._passed.get(r.MESSAGE, 0) > r.order or self._passed.get(BARRIER, 0) > r.order):
            return GivenUp.PASSED
        return None

    def of(self, kind: type[R]) -> Iterator[tuple[int, R]]:
        """The requests of one kind in flight, with their xids, oldest first."""
        return ((xid, r) for xid, r in self._by_xid.items() if type(r) is kind)

    def count(self, kind: type[Request]) -> int:
        return sum(1 for _ in self.of(kind))

    def drop(self, kind: type[Request]) -> list[Request]:
        """Forget every request of one kind (their answers, if any, are then unknown)."""
        gone = [xid for xid, r in self._by_xid.items() if type(r) is kind]
        return [self._by_xid.pop(xid) for xid in gone]

    def unanswerable(self, why: str) -> None:
        """The switch will answer none of the barriers in flight here (the connection ended,
        or this controller stopped being master): whoever watches a change is told why."""
        for _, barrier in self.of(Barrier):
            if isinstance(barrier.waiter, ChangeWatch):
                barrier.waiter.end(why)
