"""Every pair of one switch, the transitions between a pair's states (connection.py) with
their guards, and the one way a pair's flows leave the switch. No I/O.

The take-down rule, written once here (`Connections.hand_back`): a connection whose flows
leave the switch goes back to the firewall *alive*. A TCP connection's conntrack entry is
(re-)created before its flows go: ESTABLISHED with the policy's decision cleared (its next
packet is judged by the current policy), or in the state a close reached (CLOSE after an
RST, TIME_WAIT after both FINs). A caught close, or one seen on the firewall, that the
connection's own traffic then contradicts (a forged FIN or RST) is brought back
ESTABLISHED with the decision cleared. Without it a strict firewall (tcp_loose 0, INVALID
dropped) drops every later segment of a connection whose entry was deleted when the
shunt was confirmed. Only a first install rolled back before its confirmation, and a
connection that closed on the firewall before its entry was deleted (unless its traffic
contradicts the close), keep their entry as it is.
UDP needs no entry: its next packet is a new one, judged by the policy. A block is not
handed back (`Conn.owed_entry`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterator

from nfshunt.records import cookies
from nfshunt.records.model import Action, FlowTuple

from .close_watch import WATCH, CloseWatch
from .commands import (
    ClearDecision,
    Command,
    EntryDue,
    Later,
    RemoveFlows,
    RestoreConntrack,
    ShortenConntrack,
    UnwatchFlows,
    WatchEnds,
    WatchFlows,
)
from .connection import HELD, REEVALUATE, SPLIT_CLOSE_TIMEOUT, Conn, DownAsked, Handback, State

CONTRADICTED = "close contradicted by its traffic"  # a watched close undone (close_watch.py): the removal's reason


class Connections:
    """Every pair of one switch by conntrack id and by either direction's tuple, what they
    take on the switch, and the state transitions with their guards."""

    def __init__(self) -> None:
        # Every pair by key (conntrack id and slot: what its cookies name), an int the pair
        # makes from what it holds anyway: 100,000 pairs took 10 MB more as a table by
        # original tuple and another by cookie. `tuples` holds each pair by its original
        # tuple, and a NAT pair by its reply too; a pair's reply is otherwise found by its
        # mirror (`by_tuple`): indexed, 100,000 pairs' replies took 15 MB.
        self.by_key: dict[int, Conn] = {}
        self.tuples: dict[FlowTuple, Conn] = {}
        self.shunts = 0  # shunt pairs in the table
        self.blocks = 0  # block pairs (with shunts: counted against the budget)
        self.entries = 0  # switch entries the pairs take (defaults not included)
        self.removing: set[Conn] = set()  # so a tick need not scan every connection
        # The switch can show a watched close's packets (layout.watches_closes; Core sets it
        # as the switch connects and at a reload).
        self.watch_closes = False

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

    def by_tuple(self, t: FlowTuple) -> Conn | None:
        """The pair with `t` as either direction's tuple."""
        conn = self.tuples.get(t)
        if conn is not None:
            return conn
        conn = self.tuples.get(t.reversed())  # `t` a reply: the mirror of its original
        return conn if conn is not None and conn.reply == t else None

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
        self.tuples[conn.orig] = conn
        if conn.translated:
            self.tuples[conn.reply] = conn
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
        for t in (conn.orig, conn.reply) if conn.translated else (conn.orig,):
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
        """LIVE or DRAINING -> PENDING: a reconnected switch lost the pair; it goes again (a
        PENDING one too: found on the switch, its barrier reply lost to a second break)."""
        conn.state = State.PENDING
        conn.event_time = now

    def take_down(self, conn: Conn, reason: str, now: float, how: Handback = REEVALUATE) -> list[Command]:
        """A take-down asked for (flush, unshunt, block, policy change, a close seen on the
        firewall): handed back to the firewall alive; a pending pair as soon as the switch
        confirms it (flows_confirmed), so its flows are not withdrawn while in flight; a
        pair in an RST's grace once the grace ends (`in_grace`)."""
        if not self.holds(conn, HELD):
            if self.in_grace(conn) and conn.down_asked is None:
                conn.down_asked = DownAsked(reason, how)
            return []
        if conn.state is State.PENDING and not conn.entry_deleted:
            conn.remove_reason = reason
            return []
        return self.hand_back(conn, reason, now, how)

    def in_grace(self, conn: Conn) -> bool:
        """The pair is in an RST's grace (close_watch.py): TAKING_DOWN, still forwarding,
        nothing handed back yet, and the RST (anyone on the path may forge one) not yet
        judged. A take-down asked now is kept (`Conn.down_asked`) for what ends the grace:
        the RST's traffic contradicting it (`resume`), or the grace's end (`hand_back`)."""
        watch = conn.watch
        return self.holds(conn, State.TAKING_DOWN) and watch is not None and watch.forwarding \
            and not watch.settled

    def cut_short(self, conn: Conn, reason: str, now: float) -> list[Command]:
        """An RST's grace (`in_grace`) that cannot run to its end (a reconnect's reconcile,
        a stopping controller): nothing was handed back yet, and the RST (perhaps forged)
        was not judged. Handed back as its end would, but with the decision cleared, so the
        policy judges the next packet: its entry first, then the flows go (removing them
        alone left a live connection with neither). The grace's own end finds it settled."""
        assert conn.watch is not None
        conn.watch.settled = True
        return self.hand_back(conn, reason, now)

    def hand_back(self, conn: Conn, reason: str, now: float, how: Handback = REEVALUATE,
                  directions: tuple[bool, ...] = (False, True), watch: CloseWatch | None = None) -> list[Command]:
        """The one take-down: the pair's flows (`directions` of them) leave the switch, and
        a TCP connection's entry is re-created first (see the module's docstring). The
        pair is TAKING_DOWN until both flow-removed messages came (or a tick gives up).
        With `watch` (a close a catcher caught), or for a close seen on the firewall, the
        flows first show the connection's packets to the controller on their way to the
        firewall, for WATCH seconds (close_watch.py; `watch_over` ends it). A take-down
        asked during an RST's grace that the reset outlived (its entry handed back closing)
        has the decision cleared if it asked so: a re-evaluation's clearing of the marks
        missed the entry, deleted while the pair was live."""
        asked, conn.down_asked = conn.down_asked, None
        if asked is not None and how.keep_decision and not asked.how.keep_decision:
            how = replace(how, keep_decision=False)
        self.going(conn, reason, now)
        remove = RemoveFlows(conn, directions, reason)
        if not conn.owed_entry:
            if conn.nat is not None and not conn.entry_deleted:  # a UDP NAT pair's kept entry
                return [ClearDecision(conn.orig.family, conn.orig, conn.entry), remove]
            return [remove]
        if conn.closed_on_firewall and watch is None and self.watch_closes and not conn.closed_by_reset:
            # The firewall's word is no better than a catcher's: a FIN anyone on the path sends
            # reaches it while the switch is not yet forwarding on the flows, and the entry's
            # liberal window tracking takes it wherever its sequence number lies. (An RST's
            # side is not told: the data of the side that did not reset would contradict it.)
            watch = CloseWatch(frozenset(), True, firewall=True)
        then: tuple[Command, ...] = (remove,)
        if watch is not None:
            conn.watch = watch
            then = (WatchFlows(conn), Later(WATCH, (WatchEnds(conn, watch),)))
        if conn.closed_on_firewall and not conn.entry_deleted:
            # An entry tracking the close keeps its state (not brought back to ESTABLISHED);
            # part of the close may have taken the switch, so it is not left waiting long.
            return [ShortenConntrack(conn.orig.family, conn.orig, conn.entry, SPLIT_CLOSE_TIMEOUT), *then]
        conn.entry_deleted = False
        # The removal waits for the kernel's answer, which a worker behind a mass take-down
        # may give late: its grace (removal.py `overdue`) starts when the entry is back
        # (`handed_back`), so that a removal sent again never goes before it.
        conn.removing_since = None
        return [RestoreConntrack(conn.orig, conn.reply, how.tcp_state, how.timeout, how.closer_is_reply,
                                 conn.handback_mark(how), then, conn.nat_ranges, conn)]

    def going(self, conn: Conn, reason: str, now: float) -> None:
        """-> TAKING_DOWN (the hand-back may come later: an RST's grace, close_watch.py)."""
        conn.state = State.TAKING_DOWN
        conn.removing_since = now
        conn.remove_reason = conn.remove_reason or reason
        self.removing.add(conn)

    @staticmethod
    def entry_back(conn: Conn, now: float) -> list[Command]:
        """A handed-back pair's entry is re-created, and its removal goes: the grace for its
        flow-removed messages (removal.py `overdue`) starts now."""
        if conn.state is State.TAKING_DOWN and conn.removing_since is None:
            conn.removing_since = now
        return []

    def resume(self, conn: Conn, draining: bool, now: float) -> list[Command]:
        """TAKING_DOWN -> DRAINING or LIVE, as it was: an RST's grace that the connection's
        traffic contradicted (close_watch.py). Nothing was handed back, its entry is as it
        was, and its flows go back to as installed. A take-down asked for during the grace
        is not undone with the RST: the pair is handed back for it now, as it would have
        been with no RST (an attacker who forges one, then sends data, keeps no shunt that
        an unshunt, a block, a flush or a re-evaluation took down meanwhile)."""
        conn.state = State.DRAINING if draining else State.LIVE
        conn.removing_since = conn.remove_reason = None
        self.removing.discard(conn)
        asked, conn.down_asked = conn.down_asked, None
        if asked is not None:
            return self.hand_back(conn, asked.reason, now, asked.how)
        return [UnwatchFlows(conn), *((EntryDue(conn),) if draining else ())]

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
                                 conn.handback_mark(REEVALUATE), (), conn.nat_ranges),
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
                                 conn.handback_mark(how), (remove,), conn.nat_ranges)]
