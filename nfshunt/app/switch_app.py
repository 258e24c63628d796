"""The os-ken application: the one thread where conntrack events, switch messages and
timers meet the decision core. Each handler finds the switch a message is for and passes
plain values and `now` to the object whose job it is; what comes back is run by the
dispatcher and sent on the switch's send path (one write and one barrier per batch).

Threads and timers that feed the event loop: feeds.py. Who may be the switch and each
one's session: peers.py. Replies, errors, packet-ins, flow-removed: replies.py
(requests in flight: inflight.py). A pair's roles: role_link.py. Periodic work:
housekeeping.py. Control requests: operator_api.py.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from os_ken.base import app_manager
from os_ken.controller import ofp_event
from os_ken.controller.handler import CONFIG_DISPATCHER, DEAD_DISPATCHER, MAIN_DISPATCHER, set_ev_cls
from os_ken.lib import hub

from nfshunt.config.settings import Config
from nfshunt.core.policy_state import PolicyWatch
from nfshunt.core.roles import Change
from nfshunt.ids.backend import IdsBackend
from nfshunt.ids.loop import EventIds
from nfshunt.ids.process import ApiProcess
from nfshunt.kernel import table
from nfshunt.kernel.listener import ConntrackListener
from nfshunt.kernel.worker import ConntrackWorker
from nfshunt.observe.accounting import Outcomes, audit_logger
from nfshunt.observe.collector import FullCollections
from nfshunt.observe.flowrecords import FlowRecords
from nfshunt.observe.logs import BatchedFileHandler, flush_all
from nfshunt.observe.metrics import Metrics
from nfshunt.observe.trim import Trimmer
from nfshunt.openflow.channel import RateLimitedLog, install_connection_factory
from nfshunt.records.model import ConnEvent
from nfshunt.switch.dispatch import Dispatcher
from nfshunt.switch.feeds import EventConntrack, EventOverflow, EventRun, EventShutdown, EventTick, EventWatch, Feeds
from nfshunt.switch.housekeeping import Housekeeping
from nfshunt.switch.peers import Peers
from nfshunt.switch.replies import Replies
from nfshunt.switch.role_link import RoleLink
from nfshunt.switch.switch import Router, Switch

from .control import ControlServer
from .operator_api import EventControl, OperatorAPI, gauges

LOG = logging.getLogger("nfshunt")
# Replies to what was asked (replies.py routes them): how logs and counters name each, and
# whether it is a multipart reply.
REPLIES = {ofp_event.EventOFPBarrierReply: ("barrier reply", False),
           ofp_event.EventOFPRoleReply: ("role reply", False),
           ofp_event.EventOFPFlowStatsReply: ("flow stats", True),
           ofp_event.EventOFPMeterStatsReply: ("meter stats", True),
           ofp_event.EventOFPTableFeaturesStatsReply: ("table features", True),
           ofp_event.EventOFPTableStatsReply: ("table stats", True)}


class NFShuntApp(app_manager.OSKenApp):
    OFP_VERSIONS: list[int] = []  # set from the config by controller.run() before start
    # The host's kernel as the app reaches it: conntrack's worker and listener, the policy's
    # chains. Made here; a test's rig (tests/support) subclasses the app with fakes of them.
    Worker: Callable[..., ConntrackWorker] = ConntrackWorker
    Listener: Callable[..., ConntrackListener] = ConntrackListener
    Policy: Callable[..., PolicyWatch] = PolicyWatch

    def __init__(self, *args: Any, nfshunt_config: Config, nfshunt_config_path: str | None = None,
                 clock: Callable[[], float] = time.monotonic, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.cfg = nfshunt_config
        self.clock = clock  # monotonic: every handler's `now` (a test's rig gives its own)
        self.config_path = nfshunt_config_path  # read again by a reload (operator_api)
        # The control socket is bound before the pair's state file is read (Switch): a role
        # that `nfshunt role` recorded there because no socket answered is read, or else the
        # command finds the socket when it asks again (served from start()).
        self.control: ControlServer | None = None
        if self.cfg.control_socket:
            self.control = ControlServer(self.cfg.control_socket, self._control_request)
        self.switches = [Switch(cfg, i) for i, cfg in enumerate(self.cfg.served)]
        self.router = Router(self.cfg)
        self.trimmer = Trimmer()
        self.collections = FullCollections(clock())
        self._events_read = 0  # conntrack events and dumped entries taken by the event loop
        self.feeds = Feeds(self.switches, lambda ev: self.send_event(self.name, ev), clock)
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
        self.worker = self.Worker(on_dump=self.feeds.dump, on_malformed=self._malformed)
        outcomes = Outcomes(self.metrics, self.audit)
        if self.cfg.accounting_log:  # a record for each pair that leaves, with the slow path's counts
            outcomes.records = FlowRecords(self.cfg.accounting_log, self.cfg)
            self.worker.on_counted = outcomes.records.slow_counted
        self.dispatcher = Dispatcher(self.worker, outcomes, self.feeds.schedule,
                                     lambda sw, cmds: self.send_event(self.name, EventRun(sw, cmds)), clock)
        self.run = self.dispatcher.run
        self.operator.restore_pins()  # (before the IDS's rules: an operator's pin beats them)
        if self.cfg.ids is not None:
            self.ids = IdsBackend(self.cfg.ids, self, self.counters, self.audit, table.lookup)
            self.dispatcher.outcomes.watch = self.ids
            self.ids.load()
            self.ids_api = ApiProcess(self.cfg.ids, self.ids, self.ids.submit_async,
                                      count=lambda why: self.counters.add("ids_refused", why.value),
                                      restarted=lambda: self.counters.inc("ids_api_restarts"),
                                      bad_frame=lambda: self.counters.inc("ids_api_bad_frames"))
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

    # --- threads ----------------------------------------------------------------------------

    def _event_loop(self) -> None:
        """os-ken's event loop, except that a handler that raises is counted and logged and
        the loop goes on. os-ken's own re-raises hub.TaskExit to leave the loop, and with its
        threading hub TaskExit is Exception: any error in any handler ended the loop for good,
        and the controller stopped answering without a word."""
        while self.is_active or not self.events.empty():
            ev, state = self.events.get()
            self._events_sem.release()
            if ev == self._event_stop:
                continue
            for handler in self.get_handlers(ev, state):
                try:
                    handler(ev)
                except Exception:
                    self.counters.inc("handler_errors")
                    LOG.exception("handler %s failed on %s: the event is dropped, the controller goes on",
                                  getattr(handler, "__name__", handler), type(ev).__name__)

    def start(self) -> Any:
        super().start()
        self.worker.start()
        self.listener.start()
        if self.control is not None:
            self.control.start()
        if self.ids_api is not None:
            self.ids_api.start()
        self.threads.append(hub.spawn(self.feeds.ticker))

    def post(self, ev: Any) -> None:
        """Hand an event to the event loop (from any thread)."""
        self.send_event(self.name, ev)

    def feed(self, events: list[ConnEvent]) -> None:
        """Entries read outside the listener (an IDS request's lookup), decided as events are."""
        outs = self.router.dispatch(events, [sw.core for sw in self.switches], self.counters)
        for sw, out in zip(self.switches, outs, strict=True):
            if out:
                self.run(sw, out)

    def _malformed(self, what: str) -> None:
        # Called from the listener thread; Counter increments are atomic enough for stats.
        self.counters.inc("netlink_malformed")
        LOG.warning("skipped malformed conntrack message: %s", what)

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
        self.worker.stop()

    def reopen_logs(self) -> None:
        """SIGHUP: reopen the audit log (after logrotate moved it), then reload the config
        (the reload logs its outcome; nobody waits for the answer)."""
        records = self.dispatcher.outcomes.records
        for handler in [*self.audit.handlers, *([records.handler] if records is not None else [])]:
            if isinstance(handler, BatchedFileHandler):
                handler.reopen()
        LOG.info("reopened the audit log")
        self.send_event(self.name, EventControl({"cmd": "reload", "by": "SIGHUP"}))

    def role_change(self, sw: Switch, change: Change) -> None:
        """Act on a pair's role change (the operator API's takeover and step-down)."""
        self.roles.change(sw, change)

    # --- the switch's messages ------------------------------------------------------------------

    @set_ev_cls(ofp_event.EventOFPStateChange, [MAIN_DISPATCHER, DEAD_DISPATCHER])
    def _state_change(self, ev: Any) -> None:
        if ev.state == MAIN_DISPATCHER:
            self.peers.connected(ev.datapath)
        elif ev.state == DEAD_DISPATCHER:
            self.peers.dead(ev.datapath)

    @set_ev_cls(ofp_event.EventOFPSwitchFeatures, CONFIG_DISPATCHER)
    def _features(self, ev: Any) -> None:
        self.peers.features(ev.msg.datapath, ev.msg.n_tables)

    @set_ev_cls(list(REPLIES), MAIN_DISPATCHER)
    def _reply(self, ev: Any) -> None:
        what, parts = REPLIES[type(ev)]
        sw = self.peers.ours(ev.msg.datapath, what)
        if sw is not None:
            (self.replies.stats if parts else self.replies.reply)(sw, ev.msg, self.clock())

    @set_ev_cls(ofp_event.EventOFPErrorMsg, [CONFIG_DISPATCHER, MAIN_DISPATCHER])
    def _error(self, ev: Any) -> None:
        sw = self.peers.ours(ev.msg.datapath, "error")
        if sw is not None:  # before the handshake or from a refused peer: no key per type and code
            self.replies.error(sw, ev.msg, self.clock())

    @set_ev_cls(ofp_event.EventOFPPacketIn, MAIN_DISPATCHER)
    def _packet_in(self, ev: Any) -> None:
        sw = self.peers.ours(ev.msg.datapath, "packet-in")
        if sw is not None:
            self.replies.packet_in(sw, ev.msg, self.clock())

    @set_ev_cls(ofp_event.EventOFPFlowRemoved, MAIN_DISPATCHER)
    def _flow_removed(self, ev: Any) -> None:
        sw = self.peers.ours(ev.msg.datapath, "flow-removed")
        if sw is not None:
            self.replies.flow_removed(sw, ev.msg, self.clock())

    # --- conntrack, control and timers ------------------------------------------------------------

    @set_ev_cls(EventConntrack)
    def _conntrack(self, ev: EventConntrack) -> None:
        try:
            self._events_read += len(ev.events)
            outs = self.router.dispatch(ev.events, [sw.core for sw in self.switches], self.counters)
            if ev.dump:
                self.counters.inc("conntrack_resyncs")
            for sw, out in zip(self.switches, outs, strict=True):
                if out or (sw.session is not None and sw.session.send.queued):
                    self.run(sw, out)
        finally:
            self.feeds.taken()

    @set_ev_cls(EventOverflow)
    def _overflow(self, ev: EventOverflow) -> None:
        self.counters.inc("netlink_overflows")
        LOG.warning("conntrack events were lost (ENOBUFS); resyncing from a dump")
        self.worker.dump()

    def _control_request(self, request: dict[str, Any]) -> dict[str, Any]:
        """On the control server's thread: what reads the kernel or a file is read here
        (operator_api.off_loop), the rest is handed over to the event loop."""
        reply = self.operator.off_loop(request, self._ask_loop)
        return reply if reply is not None else self._ask_loop(request)

    def _ask_loop(self, request: dict[str, Any], context: Any = None) -> dict[str, Any]:
        """Hand a request (and what was read for it) to the event loop and wait."""
        ev = EventControl(request, context)
        self.send_event(self.name, ev)
        if not ev.done.wait(5.0):
            return {"error": "the controller did not answer within 5 s"}
        return ev.reply

    @set_ev_cls(EventControl)
    def _control(self, ev: EventControl) -> None:
        self.operator.handle(ev)

    @set_ev_cls(EventIds)
    def _ids(self, ev: EventIds) -> None:
        ev.work()

    @set_ev_cls(EventRun)
    def _run_later(self, ev: EventRun) -> None:
        self.run(ev.switch, ev.commands, ev.waiter)

    @set_ev_cls(EventWatch)
    def _watch(self, ev: EventWatch) -> None:
        now = self.clock()
        for sw in self.switches:
            self.housekeeping.watch(sw, now)

    @set_ev_cls(EventTick)
    def _tick(self, ev: EventTick) -> None:
        now = self.clock()
        busy = any(sw.session is not None and sw.session.send.pending() > 0 for sw in self.switches)
        try:
            for sw in self.switches:
                self.housekeeping.tick(sw, now)
            if self.ids is not None:
                self.ids.tick()
            if self.trimmer.tick(self._events_read, busy):
                LOG.debug("returned the memory of a settled burst to the system (malloc_trim)")
        finally:  # (Python collects nothing old itself: a tick that raises must not stop this)
            if self.collections.tick(now, self._events_read, busy) is not None:
                self.counters.inc("gc_full_collections")
            flush_all()  # batched log lines are at most a second late

    @set_ev_cls(EventShutdown)
    def _shutdown(self, ev: EventShutdown) -> None:
        self.housekeeping.shutdown(self.switches, self.clock(), ev.done,
                                   lambda sw, done: self.worker.after(
                                       lambda: self.send_event(self.name, EventRun(sw, (), done))))
