"""Who may be the switch, and each served switch's session (session.py) from its
handshake to its end.

Only the configured switches are served: a peer outside `switch_addresses` is refused
before its handshake, a datapath that is not configured after it, and messages of any
connection but a served one are dropped (counted, logged rate-limited). A new connection
of a served switch replaces its old one (a reboot or a re-pointed switch), when it comes
from the same address or over TLS.
"""
from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Callable, Iterable

from nfshunt.core import commands as c
from nfshunt.core.connection import Conn, State
from nfshunt.core.core import PIPELINE_ENTRIES, Core
from nfshunt.observe.logs import RateLimitedLog
from nfshunt.observe.metrics import Counters
from nfshunt.openflow.channel import address_allowed
from nfshunt.openflow.session import Session
from nfshunt.records.model import OFP10, openflow_label

from .replies import Replies
from .role_link import RoleLink
from .switch import Switch

LOG = logging.getLogger("nfshunt")

Run = Callable[[Switch, Iterable[c.Command]], None]


def _wanted(core: Core) -> Callable[[Conn], bool]:
    """Whether the core still wants a paced install sent."""
    return lambda conn: core.conns.holds(conn, State.PENDING) and conn.remove_reason is None


class Peers:
    def __init__(self, switches: list[Switch], tls: bool, counters: Counters, rlog: RateLimitedLog,
                 replies: Replies, roles: RoleLink, run: Run, clock: Callable[[], float] = time.monotonic):
        self.switches = switches
        self.clock = clock  # the event loop's, for each session
        self.tls = tls  # a replacing connection may come from another address (authenticated)
        self.counters = counters
        self.rlog = rlog
        self.replies = replies
        self.roles = roles
        self.run = run
        self._tables: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # datapath -> n_tables

    def admit(self, address: tuple[str, int]) -> str | None:
        """On os-ken's accept thread, before the handshake: the peer's address."""
        if any(address_allowed(address[0], sw.switch.switch_addresses) for sw in self.switches):
            return None
        self.counters.add("switch_refused", "address not allowed")
        self.rlog.warning("refused-address", "refused an OpenFlow connection from %s: not in switch_addresses",
                          address[0])
        return "address not allowed"

    def failed(self, address: tuple[str, int], exc: Exception) -> None:
        """On a connection's thread: what a peer sent could not be read (address "?": a
        message os-ken dropped)."""
        self.counters.inc("openflow_malformed")
        if address[0] != "?":  # os-ken's own parse errors are logged (rate-limited) where they happen
            self.rlog.warning("connection-failed", "OpenFlow connection from %s ended on what it sent: %s: %s",
                              address[0], type(exc).__name__, exc)

    def features(self, dp: Any, n_tables: int) -> None:
        """How many tables the switch has (the layout is chosen when it is served)."""
        self._tables[dp] = n_tables

    def ours(self, dp: Any, what: str) -> Switch | None:
        """The switch of a message of a served connection; anything else is counted and dropped."""
        for sw in self.switches:
            if sw.session is not None and sw.session.dp is dp:
                return sw
        self.counters.add("openflow_ignored", what)
        self.rlog.warning(f"foreign-{what}", "ignored %s from %s: not a served switch connection", what,
                          getattr(dp, "address", ("?",))[0])
        return None

    def _refuse(self, dp: Any, reason: str, detail: str) -> None:
        self.counters.add("switch_refused", reason)
        self.rlog.warning(f"refused-{reason}", "refused switch %016x from %s: %s", dp.id or 0, dp.address[0], detail)
        dp.close()

    def connected(self, dp: Any) -> None:
        """The handshake is done: serve the datapath if it is a configured switch's."""
        sw = next((s for s in self.switches if s.switch.datapath_id is None or s.switch.datapath_id == dp.id), None)
        if sw is None:
            self._refuse(dp, "datapath id not configured", "not the configured datapath_id " + ", ".join(
                s.name for s in self.switches))
            return
        if not address_allowed(dp.address[0], sw.switch.switch_addresses):
            self._refuse(dp, "address not allowed", f"not in the switch_addresses of {sw.name}")
            return
        old = sw.session.dp if sw.session is not None else None
        if old is not None and old is not dp:
            # The served switch again (rebooted, re-pointed, or its old connection is
            # dead and not yet noticed): the new connection replaces the old one. Only
            # the same datapath from the same address, or any over TLS (authenticated).
            if dp.id != old.id or (not self.tls and dp.address[0] != old.address[0]):
                self._refuse(dp, "another switch is served", f"switch {old.id:016x} from {old.address[0]} is served")
                return
            LOG.warning("switch %016x connected again from %s: replacing its old connection", dp.id, dp.address[0])
            self.disconnected(sw, "replaced by a new connection")
            old.close()
        session = sw.session = Session(dp, sw.cfg, self._pipeline(sw, dp), _wanted(sw.core), self.clock, sw.switch)
        self.counters.inc("switch_connects")
        LOG.info("switch %016x connected from %s:%s, OpenFlow %s", dp.id, dp.address[0],
                 dp.address[1], openflow_label(dp.ofproto.OFP_VERSION))
        if sw.roles is None:
            self.run(sw, sw.core.switch_connected(dp.ofproto.OFP_VERSION, session.fb.pipeline))
        else:  # nothing is programmed before the switch grants MASTER
            self.roles.request(sw, sw.roles.connected())

    def _pipeline(self, sw: Switch, dp: Any) -> bool:
        """The flow layout for this switch (config flow_layout), logged with why."""
        layout, tables = sw.switch.flow_layout, self._tables.get(dp, 0)
        if layout == "single" or not sw.cfg.tcp_teardown:
            return False
        if sw.switch.experimental_routed and layout == "auto":  # (pipeline only when asked: docs/routed.md)
            LOG.info("flow_layout auto: routed shunts, so the single-table layout (6 entries a TCP shunt)")
            return False
        if dp.ofproto.OFP_VERSION == OFP10 or tables < 2:
            why = "OpenFlow 1.0" if dp.ofproto.OFP_VERSION == OFP10 else f"the switch reports {tables} table(s)"
            log = LOG.warning if layout == "pipeline" else LOG.info
            log("flow_layout %s: %s, so the single-table layout (6 entries a TCP shunt)", layout, why)
            return False
        LOG.info("pipeline flow layout: TCP shunts go on to table 1 (2 entries a shunt, %d shared per port group; "
                 "the switch has %d tables)", PIPELINE_ENTRIES, tables)
        return True

    def dead(self, dp: Any) -> None:
        """A connection ended (closed, echoes unanswered): a served one's session with it."""
        for sw in self.switches:
            if sw.session is not None and sw.session.dp is dp:
                self.disconnected(sw, "connection closed or echo unanswered")

    def disconnected(self, sw: Switch, why: str) -> None:
        session = sw.gone()
        assert session is not None
        LOG.warning("switch %016x disconnected (%s)", session.dp.id or 0, why)
        self.counters.inc("switch_disconnects")
        if sw.roles is not None:
            sw.roles.disconnected()
        self.replies.abandoned(session)
        self.run(sw, sw.core.switch_disconnected())
