"""What each served switch needs done on a timer: every second, what the switch left
unanswered is given up (inflight.py's rule), a pair's master checks its role, the
packet-in meter, the static flows' and the default flows' counters are read, and the core
ticks; every WATCH_PERIOD, half-closed shunts whose second FIN may have been lost are looked
at; at shutdown, the pairs are taken down."""
from __future__ import annotations

import logging
import threading
from typing import Callable, Iterable

from nfshunt.core import commands as c
from nfshunt.core.teardown_sweep import CHECK_AFTER
from nfshunt.observe.metrics import Counters
from nfshunt.openflow.channel import RateLimitedLog
from nfshunt.openflow.inflight import FlowsRead, MeterRead, StaticRead, WatchRead
from nfshunt.openflow.session import Session
from nfshunt.records import cookies
from nfshunt.records.model import OFP10, SwitchFlow

from .replies import Replies
from .role_link import RoleLink
from .switch import Switch

LOG = logging.getLogger("nfshunt")
WATCH_READS_MAX = 1000  # catcher reads in flight at most (teardown_sweep)

Run = Callable[[Switch, Iterable[c.Command]], None]


class Housekeeping:
    def __init__(self, counters: Counters, rlog: RateLimitedLog, replies: Replies, roles: RoleLink, run: Run):
        self.counters = counters
        self.rlog = rlog
        self.replies = replies
        self.roles = roles
        self.run = run

    def tick(self, sw: Switch, now: float) -> None:
        if sw.session is not None:
            self.replies.give_up(sw, sw.session, now)
        self.roles.check(sw, now)
        s = sw.session
        if s is not None and s.meter_on and not s.inflight.count(MeterRead):
            s.ask(s.fb.controller_meter_stats_request(), MeterRead(now))
        if s is not None and sw.core.static.entries and not s.inflight.count(StaticRead):
            self.run(sw, [c.ReadStaticCounters()])  # once a tick: status and metrics show them
        if s is not None and s.fb.version != OFP10 and sw.slow_path_reading is not s:
            self.read_slow_path(sw, s, now)
        if s is not None and s.fb.version != OFP10 and sw.vlan_drops_reading is not s and \
                any(g.trunk for g in sw.switch.ports):
            self.read_vlan_drops(sw, s, now)
        self.run(sw, sw.core.tick(now))

    @staticmethod
    def read_slow_path(sw: Switch, s: Session, now: float) -> None:
        """The default flows' counters (OpenFlow 1.3: read by cookie): every byte the switch
        hands the firewall and takes back, the slow path's traffic (metrics)."""
        slow_ports = {g.slow for g in sw.switch.ports}
        cookie, mask = cookies.make(cookies.Kind.DEFAULT), cookies.OWNED_MASK | cookies.KIND_MASK

        def done(flows: list[SwitchFlow] | None) -> None:  # on the event loop
            if sw.slow_path_reading is s:
                sw.slow_path_reading = None
            if flows is not None:  # (a switch that answers with other flows too: only the defaults count)
                defaults = [f for f in flows if f.cookie & mask == cookie & mask]
                to_fw = sum(f.bytes for f in defaults if f.in_port not in slow_ports)
                sw.slow_path_bytes = {"to_firewall": to_fw, "from_firewall": sum(f.bytes for f in defaults) - to_fw}
        sw.slow_path_reading = s
        s.ask(s.fb.cookie_stats_request(cookie, mask), FlowsRead(now, done))

    @staticmethod
    def read_vlan_drops(sw: Switch, s: Session, now: float) -> None:
        """A trunk's drop flows' counters (OpenFlow 1.3: by cookie kind): the frames of tags
        no group carries (another VLAN, VLAN 0, 4095, untagged where not carried), by port."""
        cookie, mask = cookies.make(cookies.Kind.VLAN_DROP), cookies.OWNED_MASK | cookies.KIND_MASK

        def done(flows: list[SwitchFlow] | None) -> None:  # on the event loop
            if sw.vlan_drops_reading is s:
                sw.vlan_drops_reading = None
            if flows is not None:
                drops = [f for f in flows if f.cookie & mask == cookie & mask and f.in_port is not None]
                sw.vlan_dropped = {f.in_port: f.packets for f in drops}  # type: ignore[misc]
        sw.vlan_drops_reading = s
        s.ask(s.fb.cookie_stats_request(cookie, mask), FlowsRead(now, done))

    def watch(self, sw: Switch, now: float) -> None:
        """Half-closed shunts whose second FIN's packet-in may have been lost (teardown_sweep):
        their catchers are read (single layout), or they are handed back (pipeline layout)."""
        s = sw.session
        if s is None or not sw.core.reconciled or not sw.core.half_closed:
            return
        due = sw.core.half_closed_due(now)
        if due.ended:
            self.counters.inc("teardowns_half_closed", due.ended)
            self.rlog.warning("teardowns-half-closed", "%d half-closed shunts handed back: their second FIN not "
                              "heard of within %.1f s (a lost packet-in, or a long half-close)", due.ended,
                              CHECK_AFTER)
        if s.inflight.count(WatchRead) < WATCH_READS_MAX:  # a switch that does not answer is not asked more
            for cookie in due.catchers:
                s.ask(s.fb.catcher_stats_request_exact(cookie), WatchRead(now))
        self.run(sw, due.commands)

    def shutdown(self, switches: list[Switch], now: float, done: threading.Event,
                 after: Callable[[Switch, threading.Event], None]) -> None:
        """Every pair is taken down (delete_flows_on_shutdown) the one way there is: TCP
        shunts' entries re-created first, by the worker, then the flows go. `done` is set
        once the worker has answered every re-creation and the switch the last barrier
        (`after(sw, waiter)`: once the worker has answered all it was asked, a turn on the
        switch whose barrier's answer sets `waiter`)."""
        waiting = [sw for sw in switches if sw.session is not None and sw.cfg.delete_flows_on_shutdown]
        all_set = AllSet(len(waiting), done)
        for sw in switches:
            commands = sw.core.stopping(now, sw in waiting)  # from here on nothing new is installed
            if sw not in waiting:
                continue
            LOG.info("shutting down: taking down %d shunts and blocks on switch %s (delete_flows_on_shutdown)",
                     len(sw.core.conns.removing), sw.name)
            self.run(sw, commands)
            # The worker answers in order: its re-creations' follow-ups (the removals) are
            # on the event queue before this.
            after(sw, all_set)


class AllSet(threading.Event):
    """Set once `count` others have set it (each switch's shutdown barrier); then `done`."""

    def __init__(self, count: int, done: threading.Event):
        super().__init__()
        self._left = count
        self._done = done
        self._lock = threading.Lock()
        if count == 0:
            done.set()

    def set(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left <= 0:
                self._done.set()
