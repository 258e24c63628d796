"""Pairs leaving the switch: a flush (each pair through connection.py's `take_down`),
a flow the switch removed (an idle-out, or our removal confirmed), and the pair's end,
which lets a connection queued behind it and one waiting for room in. Every take-down
goes through connection.py's `hand_back`. No I/O."""
from __future__ import annotations

from nfshunt.records import cookies

from .admission import Admission
from .commands import Command, Removed, RemoveFlows
from .connection import ACTIVE, IDLE, REEVALUATE, Conn, FlowCount, State
from .state import CoreState

R_HARD_TIMEOUT = "hard timeout"  # the switch's reason (flows.REMOVED_REASONS)
REMOVAL_GRACE = 5.0  # seconds a pair's removal may wait for its flow-removed messages (then sent again, once)
R_NOT_CONFIRMED = "removal not confirmed"


class Removal:
    def __init__(self, shared: CoreState, admission: Admission):
        self.shared = shared
        self.admission = admission

    def flush(self, reason: str, now: float) -> list[Command]:
        """Every shunt and block back to the slow path, where policy re-evaluates it;
        connections waiting for room are dropped from the queue (their next packet is
        judged again)."""
        out: list[Command] = []
        self.shared.waiting.clear()
        for conn in self.shared.conns:
            out.extend(self.shared.conns.take_down(conn, reason, now))
        return out

    def flow_removed(self, cookie: int, reason: str, packets: int, nbytes: int,
                     duration: float, now: float) -> list[Command]:
        parsed = cookies.parse(cookie)
        if parsed is None or parsed.kind is cookies.Kind.DEFAULT:
            return []
        kind, key, reply = parsed
        if kind is cookies.Kind.ADDRESS_BLOCK:  # an IDS's address block: its counters, for the rule's end
            self.shared.address_blocks.flow_removed(cookie, packets, nbytes)
            return []
        conns = self.shared.conns
        conn = conns.named(kind, key)
        if conn is None or conn.state is State.PENDING:
            return []
        if conn.gone is None:
            conn.gone, conn.stats = set(), {}
        conn.gone.add(reply)
        conn.stats[reply] = FlowCount(packets, nbytes, duration)  # type: ignore[index]
        out: list[Command] = []
        if conn.state in ACTIVE:
            # Idled out (or deleted by someone else): the connection is back on the slow
            # path, idle, and may resume; the partner flow follows it. Ended by its hard
            # timeout (its IDS rule's or operator's pin's end): judged again by its next packet.
            how = REEVALUATE if reason == R_HARD_TIMEOUT else IDLE
            out.extend(conns.hand_back(conn, reason, now, how, directions=(not reply,)))
        if len(conn.gone) == 2:
            out.extend(self.finish(conn, conn.remove_reason or reason))
        return out

    def overdue(self, now: float) -> list[Command]:
        """A pair whose flow-removed messages did not all come within REMOVAL_GRACE: the
        switch lost them, or lost the removal itself, whose flows would then carry the
        tuple, untracked, until they idle out. So its removal is sent again first (a delete
        is idempotent), and the pair is forgotten only when another grace brings nothing.
        An RST's grace is left to its own end, which hands the pair back.

        Removals wait for the switch and for its reconcile: a pair taken down while the
        switch was away had its removal dropped (no session), and forgotten before the
        reconcile read the switch, its flows would be adopted there as a live pair (the
        take-down undone); the reconcile hands it back again, or finishes it
        (reconcile.py `_repair`)."""
        if self.shared.version is None or not self.shared.reconciled:
            return []
        out: list[Command] = []
        for conn in list(self.shared.conns.removing):
            since, watch = conn.removing_since, conn.watch
            if since is None or now - since <= REMOVAL_GRACE or \
                    (watch is not None and watch.forwarding and not watch.settled):
                continue
            if conn.removal_resent == since:
                out.extend(self.finish(conn, R_NOT_CONFIRMED))
                continue
            conn.removing_since = conn.removal_resent = now
            left = tuple(reply for reply in (False, True) if reply not in (conn.gone or ()))
            out.append(RemoveFlows(conn, left, conn.remove_reason or R_NOT_CONFIRMED))
        return out

    def finish(self, conn: Conn, reason: str) -> list[Command]:
        """The pair is gone from the switch: forgotten; an event queued behind it is taken
        now, and its room goes to a connection that waited for it."""
        self.shared.conns.forget(conn)
        out: list[Command] = [Removed(conn, reason)]
        if conn.resume is not None:
            out.extend(self.admission.conntrack_event(conn.resume))
        out.extend(self.admission.room_freed(1))
        return out
