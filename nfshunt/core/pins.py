"""Pins: a decision held for a connection by its tuple (both directions), applied to the
entry its next packet creates on the slow path (admission.decide). An operator's unshunt
(IGNORE) or block beats everything; an IDS's shunt or block (source "ids:<client>",
held until its rule ends: ids_backend.py) is a lower pin: an operator's pin replaces it
and an IDS never replaces an operator's, and an IDS shunt takes effect only where the
policy accepted the connection without deciding (ids_rules.precedence, rules 2 and 3).
An IDS's pin carries its rule's idle timeout and end: the pair built while it holds gets
the idle timeout, and a hard timeout at the end when the pin (not the policy) decided it
(`hard_timeout`), as an operator's block does at its pin's end. An IDS shunt's pin also
names the server it was judged on (ids/rules.precedence: the connection's listening end,
inside ids.may_shunt): it applies only to an entry whose original direction goes to that
server (admission), so a rule judged before its entry was seen cannot shunt a connection
the other way round. No I/O."""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

from nfshunt.records.model import Action, ConnEvent, FlowTuple

PIN_TTL = 3600.0  # seconds an operator's unshunt/block holds for a tuple
HARD_TIMEOUT_MAX = 0xFFFF  # an OpenFlow hard timeout is 16 bits (18 h)
# A pin's pair ends on the switch this long after the pin: a controller that runs ends it
# first (its tick), through the one take-down, with its counters for the rule's end.
HARD_GRACE = 1


@dataclass(slots=True)
class Pin:
    action: Action  # IGNORE (unshunt) or BLOCK
    expires: float  # monotonic; an IDS's: its rule's end (the backend releases it then)
    ct_id: int | None = None  # the entry it applied to; its DESTROY ends an unshunt pin
    source: str | None = None  # None: the operator's; else the IDS's ("ids:<client>"), held until its rule ends
    idle_timeout: int | None = None  # an IDS's: its pair's flows' (None: the config's default for the action)
    server: tuple[str, int] | None = None  # an IDS shunt's: the (address, port) its entry's original direction goes to


@dataclass(frozen=True, slots=True)
class IdsHold:
    """What an IDS's rule holds a connection to: its action (SHUNT or BLOCK), its
    requester, the idle timeout its pair's flows get (None: the config's default), when
    the rule ends (monotonic: the pair's hard timeout on the switch is made from it), and
    for a shunt the server it was judged on (the entry's original destination and port)."""
    action: Action
    source: str
    idle_timeout: int | None = None
    until: float = math.inf
    server: tuple[str, int] | None = None


def hard_timeout(expires: float, now: float) -> int:
    """The hard timeout (s) that ends a pin's pair on the switch itself, controller or none:
    HARD_GRACE after the pin's end (`expires`, monotonic), at most HARD_TIMEOUT_MAX (a pin
    that lasts longer has its pair ended then and made again by its next packet)."""
    return max(1, min(HARD_TIMEOUT_MAX, math.ceil(expires - now - 1e-6) + HARD_GRACE))  # (float noise: no 2 s)


class Pins(dict[FlowTuple, Pin]):
    """The pins by tuple: a dict, read as one on every event the admission decides. The
    operator's, the only ones that expire, are in a heap by expiry as well: the tick
    looks at those due, not at every pin (an IDS holds one for each connection rule: at
    60,000 rules the scan of 120,000 tuples held the event loop 4 ms a tick)."""
    __slots__ = ("_expiring", "_order", "ended")

    def __init__(self) -> None:
        super().__init__()
        self._expiring: list[tuple[float, int, FlowTuple]] = []  # (expires, order, tuple): one a hold
        self._order = itertools.count()  # ties in expiry never compare tuples
        self.ended = False  # an operator's pin ended since the app last wrote them (pin_file.py)

    def hold(self, orig: FlowTuple, action: Action, now: float, ttl: float = PIN_TTL) -> None:
        pin = self[orig] = self[orig.reversed()] = Pin(action, now + ttl)
        heapq.heappush(self._expiring, (pin.expires, next(self._order), orig))

    def hold_for(self, orig: FlowTuple, hold: IdsHold) -> bool:
        """An IDS's SHUNT or BLOCK for a tuple, held until released; False (nothing held)
        where an operator's pin is (it beats every IDS). A block replaces a shunt."""
        had = self.get(orig)
        if had is not None and (had.source is None or (had.action is Action.BLOCK and hold.action is Action.SHUNT)):
            return False
        self[orig] = self[orig.reversed()] = Pin(hold.action, hold.until, source=hold.source,
                                                 idle_timeout=hold.idle_timeout, server=hold.server)
        return True

    def release(self, orig: FlowTuple, source: str) -> Pin | None:
        """The IDS's rule ended: its pin goes (not an operator's or another IDS's); the pin
        released, if one was."""
        had = self.get(orig)
        if had is None or had.source != source:
            return None
        self.pop(orig, None)
        self.pop(orig.reversed(), None)
        return had

    def destroyed(self, ev: ConnEvent) -> None:
        """An entry left the firewall: an unshunt pin that held it back ends with it."""
        pin = self.get(ev.orig)
        if pin is not None and pin.action is Action.IGNORE and pin.ct_id == ev.ct_id:
            self._end(ev.orig)

    def closed(self, ev: ConnEvent) -> None:
        """The tuple's TCP connection is over (its entry reached TIME_WAIT or CLOSE): the
        operator's unshunt pin of it ends, whichever entry it last applied to (one re-created
        at a take-down, or none yet after a restart). Left to the entry's DESTROY, 120 s
        later, it held a new connection that reused the client port, judged no more."""
        pin = self.get(ev.orig)
        if pin is not None and pin.action is Action.IGNORE and pin.source is None:
            self._end(ev.orig)

    def _end(self, orig: FlowTuple) -> None:
        self.pop(orig, None)
        self.pop(orig.reversed(), None)
        self.ended = True

    def expire(self, now: float) -> None:
        """The operator's pins due go. A heap entry outlived by its pin (held again since,
        for longer) or by nothing (the pin ended with its entry) leaves the heap alone."""
        while self._expiring and self._expiring[0][0] <= now:
            orig = heapq.heappop(self._expiring)[2]
            for t in (orig, orig.reversed()):
                pin = self.get(t)
                if pin is not None and pin.expires <= now:
                    del self[t]
