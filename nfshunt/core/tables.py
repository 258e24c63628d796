"""The router's tables are the truth (docs/design/routed.md 5.4, issue 38 item 2): what the
route follower's news (kernel/routes.py) does to the routed pairs and to the events waiting
for a next hop. A neighbour's new MAC rewrites the pairs using it in place; a next hop FAILED,
a route moved to another interface, gone or blackholed hands them back to the firewall (the
one take-down: alive, counted by reason); a neighbour flapping is held down (routing.py); a
next hop newly given admits the events that waited for it. Pure: commands out."""
from __future__ import annotations

from nfshunt.records.model import ConnEvent, NextHop
from nfshunt.records.routed import R_LOOKUP_FAILED, Answer

from . import routing
from .admission import Admission
from .commands import Command, Ignored, Later, NeighbourHeldDown, ResolveHops, ResolveStatic, RewriteFlows
from .connection import HELD, Conn
from .routed_adoption import RoutedAdoption
from .routing import Change
from .state import CoreState

PRUNE = 10.0  # seconds between sweeps of the index of routed pairs for the ones gone


class TableNews:
    def __init__(self, shared: CoreState, admission: Admission, adoption: RoutedAdoption):
        self.shared = shared
        self.admission = admission
        self.adoption = adoption  # (adopted pairs waiting for a next hop the kernel was asked to resolve)
        self.next_prune = 0.0

    def _alive(self, conn: Conn) -> bool:
        return conn.hops is not None and self.shared.conns.holds(conn, HELD)

    def answered(self, answers: dict[str, Answer], ev: ConnEvent, now: float, attempt: int) -> list[Command]:
        """The tables answered a ResolveHops: the event is judged again. What the tables said
        no to waits for their change (routing.TABLE_REASONS); a lookup that failed (the
        socket) is asked again, routing.RETRIES times."""
        table = self.shared.next_hops
        table.learn(answers, now)
        out = self.admission.conntrack_event(ev)
        reasons = {x.reason for x in out if isinstance(x, Ignored)}
        if reasons & routing.TABLE_REASONS:
            table.wait(ev, now)
        elif attempt < routing.RETRIES and R_LOOKUP_FAILED in reasons:
            again = ResolveHops(ev, table.wanted(ev), attempt + 1)
            out.append(Later(routing.KEEP_NONE, (again,)))
        return out

    def changed(self, answers: dict[str, Answer], now: float, attempt: int | None = None) -> list[Command]:
        """The follower's news: the pairs through what changed rewritten or handed back; the
        events waiting for a destination now given a next hop judged again."""
        table = self.shared.next_hops
        out: list[Command] = [NeighbourHeldDown(ifname, address, routing.HOLD_DOWN)
                              for ifname, address in table.changed(answers, now)]
        for conn in table.users_of(answers, self._alive):
            out.extend(self._pair(conn, answers, now))
        out.extend(self.static_answered(answers, now, routing.RETRIES if attempt is None else attempt))
        given = {address for address, answer in answers.items() if isinstance(answer, NextHop)}
        if given:
            out.extend(self.retry(table.due(given, now), now))
        return out

    def _pair(self, conn: Conn, answers: dict[str, Answer], now: float) -> list[Command]:
        assert conn.hops is not None
        table = self.shared.next_hops
        hops = list(conn.hops)
        rewrite = False
        for direction, address in enumerate((conn.reply.src, conn.orig.src)):
            answer = answers.get(address)
            if answer is None:
                continue
            change = table.change(hops[direction], address, answer, now)
            if isinstance(change, str):
                return self.shared.conns.take_down(conn, change, now)
            if change is Change.REWRITE:
                assert isinstance(answer, NextHop)
                hops[direction], rewrite = answer, True
        if not rewrite:
            return []
        conn.hops = (hops[0], hops[1])
        return [RewriteFlows(conn)]

    def static_answered(self, answers: dict[str, Answer], now: float, attempt: int) -> list[Command]:
        """The tables' word on the static shunts' next hops (`via`): their flows installed,
        rewritten or withdrawn (static_table.hops_known); a lookup that failed asked again."""
        table = self.shared.next_hops
        out = self.shared.static.hops_known(answers, lambda hop, address: table.held_down(
            routing.neighbour_of(hop, address), now))
        failed = tuple(sorted(a for a, answer in answers.items() if answer == R_LOOKUP_FAILED))
        if failed and attempt < routing.RETRIES:
            out.append(Later(routing.KEEP_NONE, (ResolveStatic(failed, attempt + 1),)))
        return out

    def retry(self, events: list[ConnEvent], now: float) -> list[Command]:
        """Waiting events judged again, as if their tables' answer had just come."""
        out: list[Command] = []
        for ev in events:
            out.extend(self.answered({}, ev, now, routing.RETRIES))
        return out

    def tick(self, now: float) -> list[Command]:
        """Hold-downs over: what waited for them is judged again; the waiting too old dropped;
        adopted pairs whose next hop did not resolve in time handed back."""
        table = self.shared.next_hops
        if now >= self.next_prune:
            self.next_prune = now + PRUNE
            table.prune(self._alive)
        released = table.released(now)
        out = self.retry(table.due(None if released else set(), now), now) + self.adoption.overdue(now)
        return out + self.shared.static.resolve() if released else out  # (a static next hop held down, too)

