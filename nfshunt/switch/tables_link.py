"""A routing firewall's questions to its own tables (docs/design/routed.md 5.3): asked of the
route follower's thread (kernel/routes.py), never on the event loop, the answers posted back as
commands; the follower started at the first question, its troubles counted. The dispatcher
(dispatch.py) hands it the routed commands."""
from __future__ import annotations

import logging
import time
from typing import Callable

from nfshunt.core import commands as c
from nfshunt.core import routing
from nfshunt.kernel.routes import R_LOOKUP_FAILED, R_UNRESOLVED, Answer, Interface, TableFollower
from nfshunt.observe.logs import RateLimitedLog
from nfshunt.observe.metrics import Counters
from nfshunt.openflow.announce import announcements

from .switch import Switch

LOG = logging.getLogger("nfshunt")

Post = Callable[[Switch, tuple[c.Command, ...]], None]


class TablesLink:
    def __init__(self, counters: Counters, post: Post, clock: Callable[[], float] = time.monotonic,
                 on_tables: Callable[[dict[str, Answer]], None] | None = None):
        self.counters = counters
        self.post = post  # run commands on the event loop from another thread
        self.clock = clock  # the event loop's
        self.on_tables = on_tables  # the follower's news (to every switch's core: feeds)
        self.rlog = RateLimitedLog(LOG)
        self.follower: TableFollower | None = None

    def resolve_hops(self, sw: Switch, cmd: c.ResolveHops) -> list[c.Command] | None:
        """Asked of the route follower's thread (a route, a link and a neighbour lookup a new
        destination, 0.6-1.8 ms with pyroute2 0.9.7 on the 2-core VM: never on the event
        loop); its answer comes back as a HopsKnown."""
        failed = self._ask_tables(cmd.addresses, lambda answers: self.post(sw, (c.HopsKnown(answers, cmd.event,
                                                                                             cmd.attempt),)))
        if failed is not None:  # (asked again: the retry of a failed lookup, routing.RETRIES)
            return sw.core.next_hops_known(failed, cmd.event, self.clock(), cmd.attempt)
        return None

    def resolve_static(self, sw: Switch, cmd: c.ResolveStatic) -> list[c.Command] | None:
        """The static shunts' next hops (`via`), asked of the route follower as a pair's are;
        the answer comes back as a StaticHopsKnown."""
        failed = self._ask_tables(cmd.addresses, lambda answers: self.post(sw, (c.StaticHopsKnown(answers,
                                                                                                   cmd.attempt),)))
        if failed is not None:
            return sw.core.tables_changed(failed, self.clock(), cmd.attempt)
        return None

    def check_adopted(self, sw: Switch, cmd: c.CheckAdopted) -> list[c.Command] | None:
        """The routed pairs a reconcile adopted: their destinations asked of the route
        follower as any next hop is, the ones not resolved solicited (a new master never sent
        to them); the answer comes back as an AdoptedHopsKnown."""
        def answered(answers: dict[str, Answer]) -> None:  # (on the follower's thread: counters are thread-safe)
            solicited = sum(answer == R_UNRESOLVED for answer in answers.values())
            if solicited:
                self.counters.inc("routed_next_hops_solicited", solicited)
            self.post(sw, (c.AdoptedHopsKnown(cmd.conns, answers),))
        failed = self._ask_tables(cmd.addresses, answered, solicit=True)
        if failed is not None:  # (handed back: what the pairs rewrite is not known to be right)
            return sw.core.adopted_answer(c.AdoptedHopsKnown(cmd.conns, failed), self.clock())
        return None

    def _ask_tables(self, addresses: tuple[str, ...], answered: Callable[[dict[str, Answer]], None],
                    solicit: bool = False) -> dict[str, Answer] | None:
        """Ask the route follower; `answered` runs on its thread. A follower that cannot
        start answers at once: every lookup failed."""
        follower = self._follower()
        if follower is None:
            return {address: R_LOOKUP_FAILED for address in addresses}
        follower.ask(addresses, answered, solicit)
        return None

    def _follower(self) -> TableFollower | None:
        """The route follower, started at the first question; None: it cannot start (said, counted)."""
        if self.follower is None:
            follower = TableFollower(self.on_tables or (lambda _news: None), self._follower_error)
            try:
                follower.start()
            except OSError as exc:
                self.counters.add("routed_table_errors", "route follower not started")
                self.rlog.warning("route-follower", "cannot follow the firewall's route tables: %s", exc)
                follower.stop()
                return None
            self.follower = follower
        return self.follower

    def announce_gateways(self, sw: Switch, cmd: c.AnnounceGateways) -> None:
        """The routed interfaces read on the follower's thread (their MACs and addresses now:
        keepalived has just added the gateways); the frames go back to the loop."""
        names = tuple(dict.fromkeys(side.interface for side in cmd.sides if side.interface))

        def read(interfaces: dict[str, Interface | None]) -> None:  # (on the follower's thread)
            frames = []
            for side in cmd.sides:
                found = interfaces.get(side.interface or "")
                if found is None:
                    self.counters.add("routed_table_errors", "interface not found")
                    LOG.warning("cannot tell the hosts behind port %d%s this firewall's MAC: its routed interface %s "
                                "is not there", side.group.fast, f" (VLAN {side.vid})" if side.vid else "",
                                side.interface)
                    continue
                frames += [c.PortFrame(side.group.fast, frame)
                           for frame in announcements(found.mac, found.addresses, side.vid)]
            self.post(sw, (c.SendAnnouncements(tuple(frames), names),))
        follower = self._follower()
        if follower is not None:
            follower.interfaces(names, read)

    def _follower_error(self, what: str) -> None:  # (on the follower's thread: counters are thread-safe)
        self.counters.add("routed_table_errors", what)

    def neighbour_held_down(self, _sw: Switch, cmd: c.NeighbourHeldDown) -> None:
        self.counters.inc("routed_neighbours_held_down")
        LOG.warning("neighbour %s on %s changed its MAC more than %d times in %.0f s: held down %.0f s (its "
                    "routed pairs go back to the firewall, new ones stay there)", cmd.address, cmd.interface,
                    routing.FLAP_CHANGES, routing.FLAP_WINDOW, cmd.seconds)

    def close(self) -> None:
        if self.follower is not None:
            self.follower.stop()
