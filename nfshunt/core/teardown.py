"""TCP teardown: a shunt's close heard of by its catchers, and the hand-back it calls for. No I/O.

On OpenFlow 1.3 with `tcp_teardown`, a TCP shunt also gets per-direction FIN and RST
catchers (its own in the single layout, table 1's shared ones in the pipeline layout) that
forward the packet to the peer port in the switch and send its headers to the controller
(nothing is re-injected: a packet the switch could not carry by packet-out would strand
the close). On an RST, or once both directions have sent a FIN, the connection's
conntrack entry is re-created in the state the close reached (CLOSE, TIME_WAIT) and only
then do the flows go: the rest of the close crosses the firewall, which recognises it
instead of seeing stray packets of a connection it no longer tracks. Anyone on the path
can send a FIN or RST with the tuple, so the flows first show the connection's next
packets to the controller for a moment (close_watch.py), and traffic that contradicts the
close undoes the take-down. A shunt with one FIN heard of is looked at again
(teardown_sweep) in case the other's packet-in was lost.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from nfshunt.records import cookies
from nfshunt.records.segment import FIN, Segment

from .close_watch import SEQ_MASK, CloseWatch, Verdict, judge
from .commands import CloseContradicted, Command, Later, WatchEnds, WatchFlows
from .connection import ACTIVE, CT_TCP_CLOSE, CT_TCP_TIME_WAIT, Conn, State, closing
from .state import CoreState


@dataclass(slots=True)
class HalfClosedDue:
    """What the half-closed shunts due a look call for (Core.half_closed_due)."""
    catchers: list[int] = field(default_factory=list)  # cookies of catchers to read (single layout)
    commands: list[Command] = field(default_factory=list)  # hand-backs (pipeline layout)
    ended: int = 0


class Teardown:
    def __init__(self, shared: CoreState):
        self.shared = shared

    def packet(self, cookie: int, in_port: int, now: float, seg: Segment | None = None) -> list[Command] | None:
        """A FIN or RST seen by a catcher (packet-in of its headers; the switch has
        forwarded the packet itself). An RST ends the shunt (at the end of its grace); a
        FIN only once both directions have sent one: after a single FIN the other side may
        still send data (half-close), and the sender's retransmissions of data in flight
        are still due, so the fast path stays. Either is watched (close_watch.py). None:
        the packet-in names no connection of ours."""
        parsed = cookies.parse(cookie)
        if parsed is None or parsed.kind is not cookies.Kind.TEARDOWN:
            return None
        reply = parsed.reply
        conn = self.shared.conns.named(cookies.Kind.SHUNT, parsed.key)
        if conn is None or in_port != (conn.egress.fast if reply else conn.ingress.fast):
            return None  # an orphan catcher (reconcile removes it), or not its port
        if conn.state is State.PENDING:
            if conn.early is None:
                conn.early = []
            conn.early.append((cookie, in_port, seg))
            return []
        if conn.state not in ACTIVE:
            return []
        rst = cookies.is_rst(cookie)
        if rst:
            self.shared.half_closed.discard(conn.key)
            if self.shared.cfg.rst_grace:
                return self._rst_grace(conn, reply, now)
            state, reason, closer = CT_TCP_CLOSE, "tcp rst", reply
        else:
            if conn.fins == 0:
                conn.first_fin_reply = reply
            conn.fins |= 2 if reply else 1
            if seg is not None and seg.flags & FIN:
                conn.fin_seqs = conn.fin_seqs or {}
                conn.fin_seqs[reply] = (seg.seq + seg.payload) & SEQ_MASK
            if conn.fins != 3:
                self.shared.half_closed.add(conn.key, now)
                return []
            # Both FINs crossed, each answered at once by its receiver's ACK on the shunt still
            # installed: the endpoints are in TIME_WAIT (the first closer) and closed. TIME_WAIT
            # takes a resent FIN and its ACK as LAST_ACK would, and a SYN on the ports opens a
            # new entry there (LAST_ACK, for 30 s, let it through in the closed one's).
            state, reason, closer = CT_TCP_TIME_WAIT, "tcp fin", conn.first_fin_reply
        self.shared.half_closed.discard(conn.key)
        watch = CloseWatch(frozenset((reply,)) if rst else frozenset(), not rst, fin_seqs=conn.fin_seqs or {})
        return self.shared.conns.hand_back(conn, reason, now, closing(state, closer), watch=watch)

    def _rst_grace(self, conn: Conn, reply: bool, now: float) -> list[Command]:
        """The side that reset may have data still coming (an aborted transfer has about one
        RTT in flight): the pair goes on forwarding for `rst_grace`, as it would with no
        firewall at all, instead of meeting a firewall that tracks a closed entry. It is
        being taken down, and shows the controller its packets meanwhile (close_watch.py)."""
        conn.watch = watch = CloseWatch(frozenset((reply,)), False, forwarding=True,
                                        draining=conn.state is State.DRAINING)
        self.shared.conns.going(conn, "tcp rst", now)
        return [WatchFlows(conn), Later(self.shared.cfg.rst_grace, (WatchEnds(conn, watch),))]

    def _reset_handed_back(self, conn: Conn, now: float) -> list[Command]:
        """An RST's grace is over, the reset standing: its entry in CLOSE, then the flows go."""
        assert conn.watch is not None
        conn.watch.settled = True
        return self.shared.conns.hand_back(conn, "tcp rst", now, closing(CT_TCP_CLOSE, True in conn.watch.reset))

    def sample(self, key: int, reply: bool, seg: Segment | None, now: float) -> list[Command]:
        """A packet of a watched close, its headers sent by the pair's flow of direction
        `reply` (close_watch.py). Anything else (a pair no longer watched: packet-ins still
        on their way when its watch ended) changes nothing."""
        conn = self.shared.conns.named(cookies.Kind.SHUNT, key)
        watch = None if conn is None else conn.watch
        if conn is None or watch is None or watch.settled or seg is None or conn.state is not State.TAKING_DOWN:
            return []
        verdict = judge(watch, reply, seg)
        if verdict is Verdict.NONE:
            return []
        if verdict is Verdict.REOPENED:
            return self._reset_handed_back(conn, now) if watch.forwarding else \
                self.shared.conns.watch_over(conn, False)
        report = CloseContradicted(conn, watch.describe(),
                                   f"{'the reply' if reply else 'the original'} side's {seg.describe()}")
        if watch.forwarding:  # nothing was handed back: the pair goes on (or for a take-down asked meanwhile)
            watch.settled, conn.watch = True, None
            return [report, *self.shared.conns.resume(conn, watch.draining, now)]
        return [report, *self.shared.conns.watch_over(conn, True)]

    def watch_ends(self, conn: Conn, watch: CloseWatch, now: float) -> list[Command]:
        """A watch's time is up with nothing against the close: an RST's grace hands the
        connection back; a handed-back close's flows go."""
        if conn.watch is not watch or watch.settled or not self.shared.conns.holds(conn, State.TAKING_DOWN):
            return []
        if watch.forwarding:
            return self._reset_handed_back(conn, now)
        return self.shared.conns.watch_over(conn, False)

    def catchers_counted(self, counted: Iterable[int], now: float) -> tuple[list[Command], int]:
        """Catchers whose packet counters show a FIN or RST (read after the switch dropped
        packet-ins, see teardown_sweep): each is taken as its packet-in. The commands, and
        how many shunts this ended."""
        out: list[Command] = []
        ended = 0
        for cookie in counted:
            parsed = cookies.parse(cookie)
            if parsed is None or parsed.kind is not cookies.Kind.TEARDOWN:
                continue
            conn = self.shared.conns.named(cookies.Kind.SHUNT, parsed.key)
            if conn is None or conn.state not in ACTIVE:
                continue
            out.extend(self.packet(cookie, conn.egress.fast if parsed.reply else conn.ingress.fast, now) or ())
            ended += conn.state not in ACTIVE
        return out, ended

    def _half_closed(self, key: int) -> Conn | None:
        """The half-closed shunt of this key still live, else None (and the key is dropped)."""
        conn = self.shared.conns.named(cookies.Kind.SHUNT, key)
        if conn is None or conn.state not in ACTIVE or conn.fins not in (1, 2):
            self.shared.half_closed.discard(key)
            return None
        return conn

    def half_closed_due(self, now: float) -> HalfClosedDue:
        """Half-closed shunts due a look (teardown_sweep): in the single layout the catchers
        to read, of each the other direction's FIN and both RSTs; in the pipeline layout
        (shared catchers, no per-connection evidence) each is handed back in the closing state,
        as if its second FIN had been heard of (see teardown_sweep). Ended pairs are dropped
        from the watch."""
        due = HalfClosedDue()
        fins = []
        for key in self.shared.half_closed.due(now):
            conn = self._half_closed(key)
            if conn is None:
                continue
            fin = cookies.make_teardown(key, conn.fins == 1, False)
            if self.shared.pipeline:
                fins.append(fin)
                continue
            due.catchers.append(fin)
            due.catchers.extend(cookies.make_teardown(key, reply, True) for reply in (False, True))
        if fins:
            due.commands, due.ended = self.catchers_counted(fins, now)
        return due
