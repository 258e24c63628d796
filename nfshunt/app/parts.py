"""What the controller is made of: its parts built from the config and wired to each other,
and what the app's handlers ask of them as a whole (a batch of conntrack events, a tick, a
shutdown, a control request), given plain values and `now`. No os-ken here: the os-ken app
(switch_app.py) is these parts with its handlers, its event loop and its threads.

Threads and timers that feed the event loop: feeds.py. Who may be the switch and each
one's session: peers.py. Replies, errors, packet-ins, flow-removed: replies.py
(requests in flight: inflight.py). A pair's roles: role_link.py. Periodic work:
housekeeping.py. Control requests: operator_api.py.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, ContextManager

from nfshunt.config.settings import Config
from nfshunt.core.policy_state import PolicyWatch
from nfshunt.core.roles import Change
from nfshunt.ids.backend import IdsBackend
from nfshunt.ids.process import ApiProcess
from nfshunt.kernel import table
from nfshunt.kernel.listener import ConntrackListener
from nfshunt.kernel.worker import ConntrackWorker
from nfshunt.observe.accounting import Outcomes, audit_logger
from nfshunt.observe.collector import FullCollections
from nfshunt.observe.flowrecords import FlowRecords
from nfshunt.observe.logs import BatchedFileHandler, RateLimitedLog, flush_all
from nfshunt.observe.metrics import Metrics
from nfshunt.observe.trim import Trimmer
from nfshunt.openflow.channel import install_connection_factory
from nfshunt.records.model import ConnEvent
from nfshunt.switch.dispatch import Dispatcher
from nfshunt.switch.feeds import EventRun, Feeds
from nfshunt.switch.housekeeping import Housekeeping
from nfshunt.switch.peers import Peers
from nfshunt.switch.replies import Replies
from nfshunt.switch.role_link import RoleLink
from nfshunt.switch.switch import Router, Switch

from .control import ControlServer
from .operator_api import EventControl, OperatorAPI, gauges

LOG = logging.getLogger("nfshunt")


class Parts:
    # The host's kernel as the controller reaches it: conntrack's worker and listener, the
    # policy's chains. Made here; a test's rig (tests/support) subclasses the app with fakes of them.
    Worker: Callable[..., ConntrackWorker] = ConntrackWorker
    Listener: Callable[..., ConntrackListener] = ConntrackListener
    Policy: Callable[..., PolicyWatch] = PolicyWatch

    def __init__(self, cfg: Config, config_path: str | None = None, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.clock = clock  # monotonic: every handler's `now` (a test's rig gives its own)
        self.config_path = config_path  # read again by a reload (operator_api)
        # The control socket is bound before the pair's state file is read (Switch): a role
        # that `nfshunt role` recorded there because no socket answered is read, or else the
        # command finds the socket when it asks again (served from start()).
        self.control: ControlServer | None = None
        if self.cfg.control_socket:
            self.control = ControlServer(self.cfg.control_socket, self._control_request)
        self.switches = [Switch(self.cfg, i) for i in range(len(self.cfg.switches))]
        self.router = Router(self.cfg)
        self.trimmer = Trimmer()
        self.collections = FullCollections(clock())
        self._events_read = 0  # conntrack events and dumped entries taken by the event loop
        self.feeds = Feeds(self.switches, self.post, clock)
        self.operator = OperatorAPI(self)
        # The IDS API (issue 28): served by a process of its own, whose calls this process's
        # threads hand to this event loop.
        self.ids: IdsBackend | None = None
        self.ids_api: ApiProcess | None = None
        self.started = time.time()
        self.metrics = Metrics(lambda: gauges(self.switches, self.ids))
        self.counters = self.metrics.counters
        self.audit = audit_logger(self.cfg.audit_log)
        if self.cfg.metrics_address:
            self.metrics.serve(self.cfg.metrics_address, self.cfg.metrics_port)
        self.worker = self.Worker(on_dump=self.feeds.dump, on_malformed=self._malformed,
                                  on_failed=lambda: self.counters.inc("internal_errors"))
        outcomes = Outcomes(self.metrics, self.audit)
        if self.cfg.accounting_log:  # a record for each pair that leaves, with the slow path's counts
            outcomes.records = FlowRecords(self.cfg.accounting_log, self.cfg)
            self.worker.on_counted = outcomes.records.slow_counted
        self.dispatcher = Dispatcher(self.worker, outcomes, self.feeds.schedule,
                                     lambda sw, cmds: self.post(EventRun(sw, cmds)), clock, self.feeds.tables)
        self.run = self.dispatcher.run
        self.operator.restore_pins()  # (before the IDS's rules: an operator's pin beats them)
        if self.cfg.ids is not None:
            self.ids = IdsBackend(self.cfg.ids, self, self.counters, self.audit, table.lookup)
            self.dispatcher.outcomes.watch = self.ids
            self.ids.load()
            self.ids_api = ApiProcess(self.cfg.ids, self.ids, self.ids.submit_async,
                                      count=lambda why: self.counters.add("ids_refused", why.value),
                                      restarted=lambda: self.counters.inc("ids_api_restarts"),
                                      bad_frame=lambda: self.counters.inc("ids_api_bad_frames"),
                                      busy=lambda op: self.counters.add("ids_busy", op))
        self.policy = self.Policy(self.cfg.state_dir, len(self.switches), self.cfg.pair is not None)
        for sw in self.switches:
            sw.core.stale_policy = self.policy.stale
        rlog = RateLimitedLog(LOG)
        self.roles = RoleLink(self.counters, self.run, clock)
        self.replies = Replies(self.counters, rlog, self.policy, self.roles, self.run)
        self.housekeeping = Housekeeping(self.counters, rlog, self.replies, self.roles, self.run)
        self.peers = Peers(self.switches, self.cfg.tls is not None, self.counters, rlog, self.replies,
                           self.roles, self.run, clock)
        install_connection_factory(self.peers.admit, self.peers.failed)  # before os-ken's listener starts
        self.listener = self.Listener(self.cfg.netlink_rcvbuf, self.feeds.events, self.feeds.overflow,
                                      self._malformed)

    def post(self, ev: Any) -> None:
        """Hand an event to the event loop (from any thread): the app's."""
        raise NotImplementedError

    def start_threads(self) -> None:
        self.worker.start()
        self.listener.start()
        if self.control is not None:
            self.control.start()
        if self.ids_api is not None:
            self.ids_api.start()

    def close(self) -> None:
        """Stop every thread; the worker first finishes the conntrack deletes it has queued."""
        self.feeds.stop()
        self.metrics.stop()
        if self.control is not None:
            self.control.stop()
        if self.ids_api is not None:
            self.ids_api.stop()
        if self.ids is not None:
            self.ids.save()
        self.listener.stop()
        self.dispatcher.close()
        self.worker.stop()

    def held(self) -> ContextManager[None]:
        """Turns run inside (an IDS drain's calls) are written to the switches together."""
        return self.dispatcher.held(self.switches)

    def feed(self, events: list[ConnEvent]) -> None:
        """Entries read outside the listener (an IDS request's lookup), decided as events are."""
        outs = self.router.dispatch(events, [sw.core for sw in self.switches], self.counters)
        for sw, out in zip(self.switches, outs, strict=True):
            if out:
                self.run(sw, out)

    def conntrack(self, events: list[ConnEvent], dump: bool) -> None:
        """A batch the listener (or a dump) handed over, decided for every switch."""
        try:
            self._events_read += len(events)
            outs = self.router.dispatch(events, [sw.core for sw in self.switches], self.counters)
            if dump:
                self.counters.inc("conntrack_resyncs")
            for sw, out in zip(self.switches, outs, strict=True):
                if out or (sw.session is not None and sw.session.send.queued):
                    self.run(sw, out)
        finally:
            self.feeds.taken()

    def overflow(self) -> None:
        self.counters.inc("netlink_overflows")
        LOG.warning("conntrack events were lost (ENOBUFS); resyncing from a dump")
        self.worker.dump()

    def _malformed(self, what: str) -> None:
        # Called from the listener thread; Counter increments are atomic enough for stats.
        self.counters.inc("netlink_malformed")
        LOG.warning("skipped malformed conntrack message: %s", what)

    def tick(self, now: float) -> None:
        busy = any(sw.session is not None and sw.session.send.pending() > 0 for sw in self.switches)
        try:
            for sw in self.switches:
                self.housekeeping.tick(sw, now)
            self.operator.save_ended_pins(now)
            if self.ids is not None:
                self.ids.tick()
            if self.trimmer.tick(self._events_read, busy):
                LOG.debug("returned the memory of a settled burst to the system (malloc_trim)")
        finally:  # (Python collects nothing old itself: a tick that raises must not stop this)
            if self.collections.tick(now, self._events_read, busy) is not None:
                self.counters.inc("gc_full_collections")
            flush_all()  # batched log lines are at most a second late

    def watch(self, now: float) -> None:
        for sw in self.switches:
            self.housekeeping.watch(sw, now)

    def shutdown(self, now: float, done: threading.Event) -> None:
        self.operator.save_ended_pins(now)
        self.housekeeping.shutdown(self.switches, now, done,
                                   lambda sw, done: self.worker.after(lambda: self.post(EventRun(sw, (), done))))

    def reopen_logs(self) -> None:
        """SIGHUP: reopen the audit log (after logrotate moved it), then reload the config
        (the reload logs its outcome; nobody waits for the answer)."""
        records = self.dispatcher.outcomes.records
        for handler in [*self.audit.handlers, *([records.handler] if records is not None else [])]:
            if isinstance(handler, BatchedFileHandler):
                handler.reopen()
        LOG.info("reopened the audit log")
        self.post(EventControl({"cmd": "reload", "by": "SIGHUP"}))

    def role_change(self, sw: Switch, change: Change) -> None:
        """Act on a pair's role change (the operator API's takeover and step-down)."""
        self.roles.change(sw, change)

    def _control_request(self, request: dict[str, Any]) -> dict[str, Any]:
        """On the control server's thread: what reads the kernel or a file is read here
        (operator_api.off_loop), the rest is handed over to the event loop."""
        reply = self.operator.off_loop(request, self._ask_loop)
        return reply if reply is not None else self._ask_loop(request)

    def _ask_loop(self, request: dict[str, Any], context: Any = None) -> dict[str, Any]:
        """Hand a request (and what was read for it) to the event loop and wait."""
        ev = EventControl(request, context)
        self.post(ev)
        if not ev.done.wait(5.0):
            return {"error": "the controller did not answer within 5 s"}
        return ev.reply
