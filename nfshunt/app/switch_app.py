"""The os-ken application: the one thread where conntrack events, switch messages and
timers meet the decision core. Each handler finds the switch a message is for and passes
plain values and `now` to the object whose job it is; what comes back is run by the
dispatcher and sent on the switch's send path (one write and one barrier per batch).

The app is its parts (parts.py: what they are, how they are wired, what a tick or a batch
of events asks of them) with os-ken's side: the handlers, the event loop, its threads.
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
from nfshunt.ids.loop import EventIds
from nfshunt.switch.feeds import EventConntrack, EventOverflow, EventRun, EventShutdown, EventTick, EventWatch

from .operator_api import EventControl
from .parts import Parts

LOG = logging.getLogger("nfshunt")
# Replies to what was asked (replies.py routes them): how logs and counters name each, and
# whether it is a multipart reply.
REPLIES = {ofp_event.EventOFPBarrierReply: ("barrier reply", False),
           ofp_event.EventOFPRoleReply: ("role reply", False),
           ofp_event.EventOFPFlowStatsReply: ("flow stats", True),
           ofp_event.EventOFPMeterStatsReply: ("meter stats", True),
           ofp_event.EventOFPTableFeaturesStatsReply: ("table features", True),
           ofp_event.EventOFPTableStatsReply: ("table stats", True)}


class NFShuntApp(Parts, app_manager.OSKenApp):
    OFP_VERSIONS: list[int] = []  # set from the config by controller.run() before start

    def __init__(self, *args: Any, nfshunt_config: Config, nfshunt_config_path: str | None = None,
                 clock: Callable[[], float] = time.monotonic, **kwargs: Any):
        app_manager.OSKenApp.__init__(self, *args, **kwargs)
        Parts.__init__(self, nfshunt_config, nfshunt_config_path, clock)

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
        self.start_threads()
        self.threads.append(hub.spawn(self.feeds.ticker))

    def post(self, ev: Any) -> None:
        """Hand an event to the event loop (from any thread)."""
        self.send_event(self.name, ev)

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
        self.conntrack(ev.events, ev.dump)

    @set_ev_cls(EventOverflow)
    def _overflow(self, ev: EventOverflow) -> None:
        self.overflow()

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
        self.watch(self.clock())

    @set_ev_cls(EventTick)
    def _tick(self, ev: EventTick) -> None:
        self.tick(self.clock())

    @set_ev_cls(EventShutdown)
    def _shutdown(self, ev: EventShutdown) -> None:
        self.shutdown(self.clock(), ev.done)
