"""An install's answer from the switch, and when the shunt's conntrack entry goes. No I/O.

A pair is PENDING until the switch confirms both flows (the barrier reply); its conntrack
entry is only deleted after that, so a refused flow-mod leaves the connection safely on
the slow path. A refused or never-sent install is rolled back, and waits for room if that
was what it lacked.

When the entry goes: a hardware switch answers the barrier before its data plane forwards
on the new flows (up to 400 ms later on a Pica8), so packets of the connection keep
reaching the firewall meanwhile; and packets already queued on the slow path arrive after
any confirmation. Either would meet a firewall that no longer tracks the connection
(INVALID behind a strict policy). So the entry is kept (DRAINING) until the switch is
known to forward (`confirm`: the barrier reply; the pair's packet counters rising, read
by flow stats; or a fixed delay) and then for `drain` more.
"""
from __future__ import annotations

import collections

from .admission import Admission
from .commands import Command, DeleteConntrack, EntryDue, Installed, Later, ReadCounters, Refused, RemoveFlows
from .connection import Action, Conn, State
from .state import CoreState
from .teardown import Teardown

SWEEP_AFTER = 1.0  # seconds after confirmation to sweep entries re-created by in-flight packets
COUNTER_POLL = 0.05  # seconds between reads of a new shunt's packet counters (confirm: counters)


class Confirmation:
    def __init__(self, shared: CoreState, admission: Admission, teardown: Teardown):
        self.shared = shared
        self.admission = admission
        self.teardown = teardown
        # Deleted entries to sweep by tuple once in-flight packets are through (sweep()).
        self.sweeps: collections.deque[tuple[float, Conn]] = collections.deque()

    def flows_confirmed(self, conn: Conn, now: float) -> list[Command]:
        conns = self.shared.conns
        if not conns.holds(conn, State.PENDING):
            return []
        if conn.nat is not None:
            return self._nat_confirmed(conn, now)
        sw = self.shared.switch
        counters = sw.confirm == "counters" and conn.action is Action.SHUNT
        wait = (sw.confirm_delay if sw.confirm == "delay" else 0.0) + sw.drain
        keep = conn.action is Action.SHUNT and (counters or wait > 0)
        conns.confirmed(conn, now, keep_entry=keep)
        if conn.remove_reason is not None:
            # Taken down (flush, unshunt, policy) while the switch was confirming.
            return conns.hand_back(conn, conn.remove_reason, now)
        installed = Installed(conn, now - conn.event_time)
        out: list[Command] = [installed]
        if conn.early is not None:
            early, conn.early = conn.early, None
            for cookie, in_port, seg in early:
                out.extend(self.teardown.packet(cookie, in_port, now, seg) or ())
            if conn.state is State.TAKING_DOWN:
                # It closed while the switch was confirming: its entry is put in the closing
                # state and the flows go (the teardown's commands).
                return out
        if conn.state is State.LIVE:
            if conn.entry_deleted:  # a re-install after a reconnect: its entry went long ago
                return out
            return [self._delete_entry(conn, now), installed]
        out.append(ReadCounters(conn) if counters else self._entry_goes(conn, wait, now))
        return out

    def _nat_confirmed(self, conn: Conn, now: float) -> list[Command]:
        """A NAT pair keeps its entry (docs/design/routed.md, 5.6): it holds the translated
        port (nf_nat picks a free one from the table alone), translates the connection's
        ICMP errors, and its take-down clears its decision rather than re-creating it. Its
        window tracking was made liberal before the install (dispatch); housekeeping keeps
        its timeout ahead of the flows' (`nat_refresh`)."""
        self.shared.conns.confirmed(conn, now, keep_entry=False)  # LIVE, its entry not deleted
        if conn.remove_reason is not None:
            return self.shared.conns.hand_back(conn, conn.remove_reason, now)
        out: list[Command] = [Installed(conn, now - conn.event_time)]
        if conn.early is not None:
            early, conn.early = conn.early, None
            for cookie, in_port, seg in early:
                out.extend(self.teardown.packet(cookie, in_port, now, seg) or ())
        return out

    def _entry_goes(self, conn: Conn, wait: float, now: float) -> Command:
        """The shunt's entry goes after `wait` (now, with none)."""
        return Later(wait, (EntryDue(conn),)) if wait > 0 else self._delete_entry(conn, now)

    def _delete_entry(self, conn: Conn, now: float) -> DeleteConntrack:
        self.shared.conns.entry_gone(conn)
        self.sweeps.append((now + SWEEP_AFTER, conn))
        return DeleteConntrack(conn.orig.family, conn.orig, conn.entry, counted=True)

    def entry_due(self, conn: Conn, now: float) -> list[Command]:
        """The wait for a shunt's forwarding and drain is over: its entry goes, unless the
        pair was taken down meanwhile (then the entry carries the connection on)."""
        if not self.shared.conns.holds(conn, State.DRAINING):
            return []
        return [self._delete_entry(conn, now)]

    def counters_read(self, conn: Conn, packets: dict[bool, int], now: float) -> list[Command]:
        """The pair's packet counters by direction (confirm: counters). The switch forwards
        on the flows once both directions counted packets, or one did and confirm_delay has
        passed (the other direction is idle); then the slow path drains. Until then the
        counters are read again; a pair that carries nothing at all is read every second."""
        if not self.shared.conns.holds(conn, State.DRAINING):
            return []
        sw = self.shared.switch
        waited = now - (conn.confirmed_time or now)
        counted = sum(1 for n in packets.values() if n > 0)
        if counted == 2 or (counted == 1 and waited >= sw.confirm_delay):
            return [self._entry_goes(conn, sw.drain, now)]
        return [Later(COUNTER_POLL if waited < max(1.0, sw.confirm_delay) else 1.0, (ReadCounters(conn),))]

    def sweep(self, now: float) -> list[Command]:
        """Packets still queued in the slow path when the entry was deleted can re-create it
        (loose pickup) in a way no event reports as ours; one sweep by tuple clears them."""
        out: list[Command] = []
        while self.sweeps and self.sweeps[0][0] <= now:
            _, conn = self.sweeps.popleft()
            if self.shared.conns.holds(conn, State.LIVE):
                out.append(DeleteConntrack(conn.orig.family, conn.orig, None))
        return out

    def flows_failed(self, conn: Conn, reason: str, table_full: bool, now: float) -> list[Command]:
        """The switch refused a flow of this pair: withdraw the other, keep the entry. If
        its table was full, the connection waits for room (a block evicts a shunt)."""
        if not self.shared.conns.holds(conn):
            return []
        out: list[Command] = [*self.shared.conns.roll_back(conn, "rollback"), Refused(conn, reason)]
        if table_full and conn.event_kind is not None:
            if conn.action is Action.BLOCK:
                out.extend(self.admission.evict_for_block(now) or ())
            self.admission.wait_again(conn)
        return out

    def install_dropped(self, conn: Conn, reason: str, wait: bool) -> list[Command]:
        """An install that never went to the switch (its queue was full, or the pair was
        taken down while it waited): nothing to roll back on the switch. A first install's
        entry is kept; with `wait`, the connection waits for room like one the table refused."""
        if not self.shared.conns.holds(conn, State.PENDING):
            return []
        out: list[Command] = [c for c in self.shared.conns.roll_back(conn, reason) if not isinstance(c, RemoveFlows)]
        if wait:
            self.admission.wait_again(conn)
        return [*out, Refused(conn, reason)]
