"""A handled connection's life, and the one way its flows leave the switch. No I/O.

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
  contradicting the RST puts it back in the state it left (`resume`: the one way back).
- A LIVE pair that a reconnected switch lost with its table (a reboot) goes back to PENDING
  to be installed again; its entry stays deleted (`entry_deleted`), which the take-down
  rule below knows. One that a switch which kept its table no longer holds timed out
  while the switch was away: it is rolled back, its entry re-created (reconcile.py).
- A shunt whose entry reports a closing state (its FINs crossed the firewall before the
  switch carried it) is taken down (`closed_on_firewall`; a pending one once confirmed):
  the shunt would outlive the connection and carry a later one on the same ports past the
  firewall.

The take-down rule, written once here (`Connections.hand_back`): a connection whose flows
leave the switch goes back to the firewall *alive*. A TCP connection's conntrack entry is
(re-)created before its flows go: ESTABLISHED with the policy's decision cleared (its next
packet is judged by the current policy), or in the state a close reached (CLOSE after an
RST, TIME_WAIT after both FINs). A caught close that the connection's own traffic then
contradicts (a forged FIN or RST) is brought back ESTABLISHED with the decision cleared.
Without it a strict firewall (tcp_loose 0, INVALID dropped) drops every later segment
of a connection whose entry was deleted when the shunt was confirmed. Only a first install
rolled back before its confirmation, and a connection that closed on the firewall before
its entry was deleted, keep their entry as it is.
UDP needs no entry: its next packet is a new one, judged by the policy. A block is not
handed back (`Conn.owed_entry`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterator, NamedTuple

from nfshunt.config.switch import PortGroup
from nfshunt.records import cookies, markcodec
from nfshunt.records.model import TCP, Action, ConnEvent, EventKind, FlowTuple

from .close_watch import WATCH, CloseWatch
from .commands import Command, Later, RemoveFlows, RestoreConntrack, ShortenConntrack, WatchEnds, WatchFlows


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
CONTRADICTED = "close contradicted by its traffic"  # a watched close undone (close_watch.py): the removal's reason


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


def closing(tcp_state: int, closer_is_reply: bool) -> Handback:
    return Handback(tcp_state, TEARDOWN_TIMEOUT[tcp_state], closer_is_reply, keep_decision=True)


def closed_on_firewall(tcp_state: int | None) -> Handback:
    """The entry a connection gets back when its close was seen on the firewall after its
    entry was deleted: the closing state the event reported (LAST_ACK when it reported
    none), with the decision kept, so that its last packets are not judged, and shunted,
    again."""
    state = tcp_state if tcp_state in TEARDOWN_TIMEOUT else CT_TCP_LAST_ACK
    return closing(state, False)


@dataclass(eq=False, slots=True)
class Conn:
    orig: FlowTuple
    reply: FlowTuple
    ct_id: int  # the kernel's id of its entry (32 bits, a hash: another live entry may share it)
    action: Action  # SHUNT or BLOCK
    ingress: PortGroup  # bridge port the original direction entered by
    egress: PortGroup
    event_time: float
    state: State = State.PENDING
    confirmed_time: float | None = None
    removing_since: float | None = None
    gone: set[bool] | None = None  # directions whose flow was removed (allocated on removal)
    stats: dict[bool, "FlowCount"] | None = None
    resume: ConnEvent | None = None  # an event that waits for this pair to leave
    # What a retry of the event that created it needs (if the switch had no room); the
    # event itself is not kept: held until confirmation, 100,000 of them fragmented memory.
    event_kind: EventKind | None = None  # None: adopted from a switch, never retried
    tcp_state: int | None = None
    mark: int = 0  # the entry's mark: hand-backs keep the admin's bits
    action_counted: bool = True  # still counted in the budget (an evicted pair is not)
    fins: int = 0  # FINs caught: 1 original direction, 2 reply
    first_fin_reply: bool = False
    remove_reason: str | None = None  # set when NFShunt itself takes the pair down
    adopted: bool = False  # read back from a switch, not installed from a policy decision
    entry_deleted: bool = False  # the firewall no longer tracks it (see the take-down rule)
    # Its entry reported closing: the connection closed on the slow path while the flows
    # went in. An entry not yet deleted is tracking the close and is left to it; a deleted
    # one comes back in the closing state reported (`closed_on_firewall`).
    closed_on_firewall: bool = False
    entries: int = 2  # flow entries the pair takes on the switch (set when remembered)
    # FIN/RST packet-ins (cookie, in_port) caught before the barrier reply: the catchers
    # forward as soon as the switch has them, so a connection may close before the
    # controller knows its flows are in; they are taken once it does.
    early: list[tuple[int, int]] | None = None
    slot: int = 0  # tells it apart from live pairs whose ct_id is the same (cookies.py)
    idle_timeout: int | None = None  # its IDS rule's (pins.py); None: the config's default for its action
    watch: CloseWatch | None = None  # a caught close being watched (close_watch.py)
    # What decided it (cookies.Authority, named in its cookie): an IDS's rule or an operator's
    # pin that changed the policy's decision bounds the pair on the switch itself with
    # `hard_timeout` (seconds from its install; adopted: what its flows had left; 0 none).
    authority: cookies.Authority = cookies.Authority.POLICY
    hard_timeout: int = 0

    @property
    def key(self) -> int:
        """What the pair's cookies name, and what the table holds it by."""
        return self.ct_id | self.slot << cookies.KEY_SLOT_SHIFT

    @property
    def kind(self) -> cookies.Kind:
        return cookies.Kind.SHUNT if self.action is Action.SHUNT else cookies.Kind.BLOCK

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    @property
    def owed_entry(self) -> bool:
        """A TCP shunt gets its entry back when its flows leave; a block is not owed a
        life: the firewall judges its next packet as it finds it (behind a strict firewall,
        INVALID), and a re-created ESTABLISHED entry would let that packet through."""
        return self.action is Action.SHUNT and self.orig.proto == TCP

    def cookie(self, reply: bool) -> int:
        return cookies.make(self.kind, self.key, reply, self.authority)

    def describe(self) -> str:
        return (f"{self.orig} ports {self.ingress.physdevin}->{self.egress.physdevin}"
                f" (switch {self.ingress.fast}<->{self.egress.fast}) ct_id={self.ct_id}")

    def handback_mark(self, how: Handback) -> int:
        """The mark the re-created entry carries: the admin's bits and the bridge ports
        always; the decision only for a closing entry. An adopted pair's mark is not known:
        its port bits are made from its port groups."""
        mark = self.mark or markcodec.encode(self.ingress.physdevin, self.egress.physdevin)
        return mark if how.keep_decision else mark & ~markcodec.DECISION_MASK


class FlowCount(NamedTuple):
    """A removed flow's counts, as its flow-removed reported them."""
    packets: int
    bytes: int
    duration: float


class Connections:
    """Every pair of one switch by conntrack id and by either direction's tuple, what they
    take on the switch, and the state transitions with their guards."""

    def __init__(self) -> None:
        # Every pair by key (conntrack id and slot: what its cookies name), an int the pair
        # makes from what it holds anyway: 100,000 pairs took 10 MB more as a table by
        # original tuple and another by cookie. `tuples` serves lookups by either direction.
        self.by_key: dict[int, Conn] = {}
        self.tuples: dict[FlowTuple, Conn] = {}
        self.shunts = 0  # shunt pairs in the table
        self.blocks = 0  # block pairs (with shunts: counted against the budget)
        self.entries = 0  # switch entries the pairs take (defaults not included)
        self.removing: set[Conn] = set()  # so a tick need not scan every connection

    def __iter__(self) -> Iterator[Conn]:
        return iter(list(self.by_key.values()))

    def __len__(self) -> int:
        return len(self.by_key)

    def holds(self, conn: Conn, states: frozenset[State] | State | None = None) -> bool:
        """The guard of every transition: `conn` is still the pair its id names (not one
        forgotten meanwhile, whose id a new pair may hold) and, given `states`, in one."""
        if self.by_key.get(conn.key) is not conn:
            return False
        if states is None:
            return True
        return conn.state is states if isinstance(states, State) else conn.state in states

    def named(self, kind: cookies.Kind, key: int) -> Conn | None:
        """The pair a cookie of this kind and key names."""
        conn = self.by_key.get(key)
        return conn if conn is not None and conn.kind is kind else None

    def with_id(self, ct_id: int) -> Conn | None:
        """A pair of this conntrack id (the first slot's there is)."""
        for slot in range(cookies.SLOTS):
            conn = self.by_key.get(cookies.key(ct_id, slot))
            if conn is not None:
                return conn
            if slot >= 16:  # colliding ids take the lowest free slots: no further one in practice
                return None
        return None

    def free_slot(self, ct_id: int) -> int | None:
        """The lowest slot no live pair of this conntrack id holds; None if every one is."""
        if ct_id not in self.by_key:  # slot 0's key is the id itself: the common case, one lookup
            return 0
        for slot in range(1, cookies.SLOTS):
            if cookies.key(ct_id, slot) not in self.by_key:
                return slot
        return None

    def remember(self, conn: Conn, entries: int) -> None:
        self.by_key[conn.key] = conn
        self.tuples[conn.orig] = self.tuples[conn.reply] = conn
        self._count(conn, 1)
        conn.entries = entries
        self.entries += entries

    def forget(self, conn: Conn) -> None:
        self.removing.discard(conn)
        if self.by_key.get(conn.key) is conn:
            del self.by_key[conn.key]
            self.entries -= conn.entries
            if conn.action_counted:
                self._count(conn, -1)
        for t in (conn.orig, conn.reply):
            if self.tuples.get(t) is conn:
                del self.tuples[t]

    def uncount(self, conn: Conn) -> None:
        """The pair no longer counts against the budget (evicted: its room is given now)."""
        if conn.action_counted:
            self._count(conn, -1)
            conn.action_counted = False

    def _count(self, conn: Conn, delta: int) -> None:
        if conn.action is Action.SHUNT:
            self.shunts += delta
        else:
            self.blocks += delta

    # --- transitions --------------------------------------------------------------------

    @staticmethod
    def confirmed(conn: Conn, now: float, keep_entry: bool) -> None:
        """PENDING -> DRAINING (the entry waits for `confirm` and `drain`) or LIVE."""
        conn.state = State.DRAINING if keep_entry and not conn.entry_deleted else State.LIVE
        conn.confirmed_time = now

    @staticmethod
    def entry_gone(conn: Conn) -> None:
        """DRAINING -> LIVE: the conntrack entry is being deleted."""
        conn.state = State.LIVE
        conn.entry_deleted = True

    @staticmethod
    def reinstall(conn: Conn, now: float) -> None:
        """LIVE or DRAINING -> PENDING: a reconnected switch lost the pair; it goes again."""
        conn.state = State.PENDING
        conn.event_time = now

    def take_down(self, conn: Conn, reason: str, now: float, how: Handback = REEVALUATE) -> list[Command]:
        """A take-down asked for (flush, unshunt, block, policy change, a close seen on the
        firewall): handed back to the firewall alive; a pending pair as soon as the switch
        confirms it (flows_confirmed), so its flows are not withdrawn while in flight."""
        if not self.holds(conn, HELD):
            return []
        if conn.state is State.PENDING and not conn.entry_deleted:
            conn.remove_reason = reason
            return []
        return self.hand_back(conn, reason, now, how)

    def hand_back(self, conn: Conn, reason: str, now: float, how: Handback = REEVALUATE,
                  directions: tuple[bool, ...] = (False, True), watch: CloseWatch | None = None) -> list[Command]:
        """The one take-down: the pair's flows (`directions` of them) leave the switch, and
        a TCP connection's entry is re-created first (see the module's docstring). The
        pair is TAKING_DOWN until both flow-removed messages came (or a tick gives up).
        With `watch` (a close a catcher caught), the flows first show the connection's
        packets to the controller on their way to the firewall, for WATCH seconds
        (close_watch.py; `watch_over` ends it)."""
        self.going(conn, reason, now)
        remove = RemoveFlows(conn, directions, reason)
        if not conn.owed_entry:
            return [remove]
        if conn.closed_on_firewall and not conn.entry_deleted:
            # An entry tracking the close keeps its state (not brought back to ESTABLISHED);
            # part of the close may have taken the switch, so it is not left waiting long.
            return [ShortenConntrack(conn.orig.family, conn.orig, conn.ct_id, SPLIT_CLOSE_TIMEOUT), remove]
        conn.entry_deleted = False
        then: tuple[Command, ...] = (remove,)
        if watch is not None:
            conn.watch = watch
            then = (WatchFlows(conn), Later(WATCH, (WatchEnds(conn, watch),)))
        return [RestoreConntrack(conn.orig, conn.reply, how.tcp_state, how.timeout, how.closer_is_reply,
                                 conn.handback_mark(how), then)]

    def going(self, conn: Conn, reason: str, now: float) -> None:
        """-> TAKING_DOWN (the hand-back may come later: an RST's grace, close_watch.py)."""
        conn.state = State.TAKING_DOWN
        conn.removing_since = now
        conn.remove_reason = conn.remove_reason or reason
        self.removing.add(conn)

    def resume(self, conn: Conn, draining: bool) -> None:
        """TAKING_DOWN -> DRAINING or LIVE, as it was: an RST's grace that the connection's
        traffic contradicted (close_watch.py). Nothing was handed back, its entry is as it was."""
        conn.state = State.DRAINING if draining else State.LIVE
        conn.removing_since = conn.remove_reason = None
        self.removing.discard(conn)

    def watch_over(self, conn: Conn, contradicted: bool) -> list[Command]:
        """A watched close is decided (close_watch.py): its flows go now. Contradicted (the
        endpoints did not close), its entry is brought back ESTABLISHED with the decision
        cleared, so that its next packet is judged by the policy, and shunted, again. The
        closing entry the watch began with carries the connection meanwhile (its window
        tracking liberal), so the flows need not wait for the kernel's answer."""
        assert conn.watch is not None
        conn.watch.settled = True
        if not contradicted:
            return [RemoveFlows(conn, (False, True), conn.remove_reason or "close")]
        conn.remove_reason = CONTRADICTED
        return [RestoreConntrack(conn.orig, conn.reply, REEVALUATE.tcp_state, REEVALUATE.timeout, False,
                                 conn.handback_mark(REEVALUATE), ()),
                RemoveFlows(conn, (False, True), CONTRADICTED)]

    def roll_back(self, conn: Conn, reason: str, how: Handback = REEVALUATE) -> list[Command]:
        """Flows the switch does not hold (refused, unanswered, never sent, or gone while it
        was away) are withdrawn and the pair forgotten. A first install's entry was never
        deleted and carries on as it is; a re-install's was, so it is handed back like any
        take-down (`how`)."""
        self.forget(conn)
        remove = RemoveFlows(conn, (False, True), reason)
        if not conn.entry_deleted or not conn.owed_entry:
            return [remove]
        conn.entry_deleted = False
        return [RestoreConntrack(conn.orig, conn.reply, how.tcp_state, how.timeout, how.closer_is_reply,
                                 conn.handback_mark(how), (remove,))]
