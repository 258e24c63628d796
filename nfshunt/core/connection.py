"""A handled connection: the pair (`Conn`), its states and the entry it gets back when its
flows leave. No I/O. The pairs of a switch and the transitions between the states, with
the one take-down: pairs.py.

States of a pair (a shunt or a block), and the only transitions there are:

    PENDING ──confirmed──> DRAINING ──entry deleted──> LIVE
       │                      │                          │
       │ (rollback:           └──────────┬───────────────┘
       │  forgotten)                     │ take_down()
       │                                 v
       └───── confirmed, but a ──> TAKING_DOWN ──both flows gone──> GONE (forgotten)
              take-down waited

- PENDING: flows sent, the switch has not confirmed them. A take-down asked for now waits
  for the confirmation (the switch may still be applying the flows).
- DRAINING: confirmed; the conntrack entry is kept until the switch forwards on the flows
  and the slow path has drained (confirmation.py: `confirm`, `drain`).
- LIVE: confirmed, its conntrack entry deleted: the firewall no longer tracks it.
- TAKING_DOWN: its flows are being removed (one direction's flow-removed may have come).
  A close the catchers caught is watched first: its flows stay a moment, changed to show
  the controller each packet (close_watch.py, `watch_over`). An RST's pair is TAKING_DOWN
  through its grace, still forwarding, and is handed back at its end; its own traffic
  contradicting the RST puts it back in the state it left (`resume`: the one way back),
  unless a take-down was asked for meanwhile (`down_asked`): then it is handed back for it.
- A LIVE pair that a reconnected switch lost with its table (a reboot) goes back to PENDING
  to be installed again; its entry stays deleted (`entry_deleted`), which the take-down
  rule (pairs.py) knows. One that a switch which kept its table no longer holds timed out
  while the switch was away: it is rolled back, its entry re-created (reconcile.py).
- A shunt whose entry reports a closing state (its FINs crossed the firewall before the
  switch carried it) is taken down (`closed_on_firewall`; a pending one once confirmed):
  the shunt would outlive the connection and carry a later one on the same ports past the
  firewall. A forged FIN can reach the firewall too (the switch not yet forwarding on the
  flows): the close is watched first, like a caught one (close_watch.py).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from operator import attrgetter
from typing import Callable, Generic, NamedTuple, TypeVar, overload

from nfshunt.config.switch import PortGroup, RoutedSide
from nfshunt.records import cookies, markcodec
from nfshunt.records.model import TCP, Action, ConnEvent, EventKind, FlowTuple, NatRange, NextHop, Rewrite, nat_ranges
from nfshunt.records.segment import Segment

from .close_watch import CloseWatch

T = TypeVar("T")


class State(enum.Enum):
    PENDING = "pending"
    DRAINING = "draining"
    LIVE = "live"
    TAKING_DOWN = "taking down"


ACTIVE = frozenset((State.DRAINING, State.LIVE))  # confirmed, not being taken down
HELD = frozenset((State.PENDING, State.DRAINING, State.LIVE))  # may be taken down

# Conntrack TCP states (include/uapi/linux/netfilter/nf_conntrack_tcp.h).
CT_TCP_ESTABLISHED, CT_TCP_FIN_WAIT, CT_TCP_CLOSE_WAIT = 3, 4, 5
CT_TCP_LAST_ACK, CT_TCP_TIME_WAIT, CT_TCP_CLOSE = 6, 7, 8
REEVALUATE_TIMEOUT = 300  # an ESTABLISHED entry handed back for re-evaluation (traffic refreshes it)
IDLE_RESTORE_TIMEOUT = 432000  # an idled-out shunt's entry: Linux's own ESTABLISHED timeout (5 days)
# A closing entry's timeout: Linux's own for each closing state (FIN_WAIT ... CLOSE).
TEARDOWN_TIMEOUT = {CT_TCP_FIN_WAIT: 120, CT_TCP_CLOSE_WAIT: 60, CT_TCP_LAST_ACK: 30, CT_TCP_TIME_WAIT: 120,
                    CT_TCP_CLOSE: 10}
# An entry left tracking a close that crossed the firewall only in part (the rest took the
# switch): it might wait in FIN_WAIT for 2 minutes, and a strict firewall calls a new SYN
# on its ports INVALID meanwhile. Traffic of a half-closed connection renews it as usual.
SPLIT_CLOSE_TIMEOUT = 10


@dataclass(frozen=True, slots=True)
class Handback:
    """The conntrack entry a TCP connection gets back when its flows leave."""
    tcp_state: int = CT_TCP_ESTABLISHED
    timeout: int = REEVALUATE_TIMEOUT
    closer_is_reply: bool = False
    keep_decision: bool = False  # a closing entry keeps its mark: nothing is left to decide

    @property
    def closing(self) -> bool:
        return self.tcp_state != CT_TCP_ESTABLISHED


REEVALUATE = Handback()
IDLE = Handback(timeout=IDLE_RESTORE_TIMEOUT)


class DownAsked(NamedTuple):
    """A take-down asked for during an RST's grace (pairs.py `take_down`): its reason and the
    entry it asked to hand back."""
    reason: str
    how: Handback


def closing(tcp_state: int, closer_is_reply: bool) -> Handback:
    return Handback(tcp_state, TEARDOWN_TIMEOUT[tcp_state], closer_is_reply, keep_decision=True)


def closed_on_firewall(tcp_state: int | None) -> Handback:
    """The entry a connection gets back when its close was seen on the firewall after its
    entry was deleted: the closing state the event reported (LAST_ACK when it reported
    none), with the decision kept, so that its last packets are not judged, and shunted,
    again."""
    state = tcp_state if tcp_state in TEARDOWN_TIMEOUT else CT_TCP_LAST_ACK
    return closing(state, False)


class FlowCount(NamedTuple):
    """A removed flow's counts, as its flow-removed reported them."""
    packets: int
    bytes: int
    duration: float


@dataclass(slots=True)
class Seldom:
    """What few pairs ever set (a NAT's, an IDS's, a close's, a take-down's), kept apart:
    each of 100,000 plain shunts held 18 empty fields, 14 MB. Read and set as the pair's
    own fields (`Conn`), which make this part when one is first set to other than its
    default."""
    removing_since: float | None = None
    removal_resent: float | None = None
    gone: set[bool] | None = None
    stats: dict[bool, FlowCount] | None = None
    resume: ConnEvent | None = None
    fins: int = 0
    first_fin_reply: bool = False
    fin_seqs: dict[bool, int] | None = None
    remove_reason: str | None = None
    adopted: bool = False
    closed_on_firewall: bool = False
    closed_by_reset: bool = False
    early: list[tuple[int, int, Segment | None]] | None = None
    nat: tuple[Rewrite, Rewrite] | None = None
    nat_refreshed: float | None = None
    idle_timeout: int | None = None
    watch: CloseWatch | None = None
    down_asked: DownAsked | None = None
    hard_timeout: int = 0
    entry_id: int | None = None


class _Seldom(Generic[T]):
    """A field of `Conn` kept in its `Seldom` part: its default while the pair has none."""

    def __init__(self, default: T) -> None:
        self.default = default
        self.name = ""
        self._get: Callable[[Seldom], T] = attrgetter("")

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self._get = attrgetter(name)

    @overload
    def __get__(self, conn: None, owner: type) -> _Seldom[T]: ...
    @overload
    def __get__(self, conn: Conn, owner: type) -> T: ...

    def __get__(self, conn: Conn | None, owner: type) -> T | _Seldom[T]:
        if conn is None:
            return self
        part = conn._seldom
        return self.default if part is None else self._get(part)

    def __set__(self, conn: Conn, value: T) -> None:
        part = conn._seldom
        if part is None:
            if value is self.default:  # (None, False, 0: nothing to keep)
                return
            part = conn._seldom = Seldom()
        setattr(part, self.name, value)


@dataclass(eq=False, slots=True)
class Conn:
    orig: FlowTuple
    # The reply direction's tuple as given, kept only where it is not the original's mirror
    # (a NAT entry's): 100,000 pairs kept 10 MB of mirrors, and their index as much. Read it
    # as `reply`.
    _reply: FlowTuple | None
    ct_id: int  # its entry's kernel id (a 32-bit hash: another live entry, or one re-made on the tuple, may share it)
    action: Action  # SHUNT or BLOCK
    ingress: PortGroup  # bridge port the original direction entered by
    egress: PortGroup
    event_time: float
    state: State = State.PENDING
    confirmed_time: float | None = None
    # What a retry of the event that created it needs (if the switch had no room); the
    # event itself is not kept: held until confirmation, 100,000 of them fragmented memory.
    event_kind: EventKind | None = None  # None: adopted from a switch, never retried
    tcp_state: int | None = None
    mark: int = 0  # the entry's mark: hand-backs keep the admin's bits
    action_counted: bool = True  # still counted in the budget (an evicted pair is not)
    entry_deleted: bool = False  # the firewall no longer tracks it (see the take-down rule)
    entries: int = 2  # flow entries the pair takes on the switch (set when remembered)
    slot: int = 0  # tells it apart from live pairs whose ct_id is the same (cookies.py)
    hops: tuple[NextHop, NextHop] | None = None  # a routing firewall's: the original's, the reply's (routing.py)
    # A routing firewall's: the interfaces the original entered and left by (the mark's;
    # read back: the flows' tags), whose tags its flows match and put on; None bridged,
    # where a side's tag is its group's for the entry's zone.
    sides: tuple[RoutedSide, RoutedSide] | None = None
    # What decided it (cookies.Authority, named in its cookie): an IDS's rule or an operator's
    # pin that changed the policy's decision bounds the pair on the switch itself with
    # `hard_timeout` (seconds from its install; adopted: what its flows had left; 0 none).
    authority: cookies.Authority = cookies.Authority.POLICY
    _seldom: Seldom | None = None

    # --- the seldom fields (Seldom: set after the pair is made) ------------------------------
    removing_since = _Seldom[float | None](None)
    # When a tick sent its removal again, unconfirmed (removal.py `overdue`): the
    # removing_since it gave it then, so that a removal begun since is sent again too.
    removal_resent = _Seldom[float | None](None)
    gone = _Seldom[set[bool] | None](None)  # directions whose flow was removed (allocated on removal)
    stats = _Seldom[dict[bool, FlowCount] | None](None)
    resume = _Seldom[ConnEvent | None](None)  # an event that waits for this pair to leave
    fins = _Seldom[int](0)  # FINs caught: 1 original direction, 2 reply
    first_fin_reply = _Seldom[bool](False)
    # Each direction's caught FIN's sequence number (True: the reply's), where its packet-in
    # had the headers (close_watch.py: what data after the close may be).
    fin_seqs = _Seldom[dict[bool, int] | None](None)
    remove_reason = _Seldom[str | None](None)  # set when NFShunt itself takes the pair down
    adopted = _Seldom[bool](False)  # read back from a switch, not installed from a policy decision
    # Its entry reported closing: the connection closed on the slow path while the flows
    # went in. An entry not yet deleted is tracking the close and is left to it; a deleted
    # one comes back in the closing state reported (`closed_on_firewall`).
    closed_on_firewall = _Seldom[bool](False)
    closed_by_reset = _Seldom[bool](False)  # (closed_on_firewall) in CLOSE: an RST, sent by a side no one can tell
    # FIN/RST packet-ins (cookie, in_port, segment) caught before the barrier reply: the
    # catchers forward as soon as the switch has them, so a connection may close before the
    # controller knows its flows are in; they are taken once it does.
    early = _Seldom[list[tuple[int, int, Segment | None]] | None](None)
    # A NAT entry's (forward, reverse) rewrite (records.model.nat_rewrite): its flows translate
    # as the firewall did, and its entry is kept for the pair's life (confirmation.py).
    nat = _Seldom[tuple[Rewrite, Rewrite] | None](None)
    nat_refreshed = _Seldom[float | None](None)  # when its kept entry's timeout was last given (core/nat.py)
    idle_timeout = _Seldom[int | None](None)  # its IDS rule's (pins.py); None: the config's default for its action
    watch = _Seldom[CloseWatch | None](None)  # a caught close being watched (close_watch.py)
    # A take-down asked for during its RST's grace, kept for what ends the grace (pairs.py).
    down_asked = _Seldom[DownAsked | None](None)
    hard_timeout = _Seldom[int](0)  # (authority)
    # Its kernel entry's id where that is not ct_id: a NAT pair kept at a pair's takeover,
    # whose entry conntrackd's commit made anew (routed_adoption.py). None: ct_id.
    entry_id = _Seldom[int | None](None)

    def __post_init__(self) -> None:
        if self._reply is not None and self.orig.mirrors(self._reply):
            self._reply = None

    @property
    def reply(self) -> FlowTuple:
        """The reply direction's tuple: the original's mirror unless the entry was NATed."""
        reply = self._reply
        return self.orig.reversed() if reply is None else reply

    @property
    def translated(self) -> bool:
        """Its reply is not the original's mirror (a NAT entry's): the tables index both."""
        return self._reply is not None

    @property
    def entry(self) -> int:
        """The id its kernel entry has: what the entry's events carry and requests name."""
        return self.ct_id if self.entry_id is None else self.entry_id

    @property
    def key(self) -> int:
        """What the pair's cookies name, and what the table holds it by."""
        return cookies.key(self.ct_id, self.slot)

    @property
    def kind(self) -> cookies.Kind:
        return cookies.Kind.SHUNT if self.action is Action.SHUNT else cookies.Kind.BLOCK

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    @property
    def leaving(self) -> bool:
        """Its flows are leaving the switch, or will once what its take-down waits for comes:
        a pending pair's confirmation, its RST's grace's end (pairs.py `take_down`)."""
        return self.state is State.TAKING_DOWN or self.remove_reason is not None

    @property
    def owed_entry(self) -> bool:
        """A TCP shunt gets its entry back when its flows leave; a block is not owed a
        life: the firewall judges its next packet as it finds it (behind a strict firewall,
        INVALID), and a re-created ESTABLISHED entry would let that packet through."""
        return self.action is Action.SHUNT and self.orig.proto == TCP

    @property
    def nat_ranges(self) -> tuple[NatRange, ...]:
        """What a re-creation of a NAT pair's entry must carry (CTA_NAT_*, design F13/F14)."""
        return nat_ranges(self.orig, self.reply) if self.nat is not None else ()

    @property
    def ports(self) -> tuple[int, int]:
        """The physdevins its mark names: a routed one's interfaces' (a VLAN's own), else its groups'."""
        if self.sides is not None:
            return self.sides[0].physdevin, self.sides[1].physdevin
        return self.ingress.physdevin, self.egress.physdevin

    @property
    def tags(self) -> tuple[int, int] | None:
        """(ingress side's, egress side's) tag of the original direction's frames (0:
        untagged), or None: a zone neither side carries (admission shunts none)."""
        if self.sides is not None:
            return self.sides[0].vid, self.sides[1].vid
        zone = self.orig.zone
        vid_in, vid_out = self.ingress.vid_of_zone.get(zone), self.egress.vid_of_zone.get(zone)
        return None if vid_in is None or vid_out is None else (vid_in, vid_out)

    def cookie(self, reply: bool) -> int:
        return cookies.make(self.kind, self.key, reply, self.authority)

    def describe(self) -> str:
        ingress, egress = self.ports
        return (f"{self.orig} ports {ingress}->{egress}"
                f" (switch {self.ingress.fast}<->{self.egress.fast}) ct_id={self.ct_id}")

    def handback_mark(self, how: Handback) -> int:
        """The mark the re-created entry carries: the admin's bits and the bridge ports
        always; the decision only for a closing entry. An adopted pair's mark is not known:
        its port bits are made from its port groups."""
        mark = self.mark or markcodec.encode(*self.ports)
        return mark if how.keep_decision else mark & ~markcodec.DECISION_MASK
