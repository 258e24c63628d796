"""The os-ken application: the one thread where conntrack events, switch messages and
timers meet the decision core.

Every input arrives as an os-ken event on this app's queue and is handled on its event
loop thread, so the core needs no locks. Commands from the core become OpenFlow messages
on the switch channel's send path (channel.SendPath: one write and one barrier per
batch; the barrier reply confirms a shunt or block).

Only the configured switches are served (one, or several in `switches`; switch.py keeps
each one's state): a peer outside `switch_addresses` is refused before its handshake, a
datapath that is not configured after it, and every handler drops messages of any
connection but a served one (counted, logged rate-limited). A new connection of a served
switch replaces its old one (a reboot or a re-pointed switch), when it comes from the same
address or over TLS. Conntrack events go to the switch whose port groups they crossed.

In a firewall pair (`pair`), the switch is programmed only once it has granted this
controller MASTER (roles.py); until then, and after a takeover by the other controller,
the core stands by and the switch refuses this controller's flow-mods anyway.
"""
from __future__ import annotations

import collections
import heapq
import logging
import threading
import time
from typing import Any, Iterable

from os_ken.base import app_manager
from os_ken.controller import event, ofp_event
from os_ken.controller.handler import (CONFIG_DISPATCHER, DEAD_DISPATCHER, MAIN_DISPATCHER,
                                       set_ev_cls)
from os_ken.lib import hub

from . import commands as c
from . import cookies
from .accounting import Outcomes, audit_logger
from .channel import ChannelDatapath, RateLimitedLog, SendPath, address_allowed, table_full
from .config import Config
from .conntrack import ConntrackListener, ConntrackWorker
from .control import ControlServer
from .logs import BatchedFileHandler, flush_all
from .connection import Conn, State
from .core import PIPELINE_ENTRIES, PIPELINE_READ_AGAIN, PIPELINE_READS
from .dispatch import Dispatcher
from .flows import REMOVED_REASONS, FlowBuilder, metadata_teardown
from .metrics import Metrics
from .operator_api import EventControl, OperatorAPI, totals
from .model import OFP10, ConnEvent, openflow_label
from .policy_state import PolicyWatch
from .roles import MASTER, ROLE_NAMES, Change, RoleRequest
from .switch import Asked, CatcherRead, Router, Switch
from .teardown_sweep import CHECK_AFTER, WATCH_PERIOD
from .trim import Trimmer

LOG = logging.getLogger("nfshunt")
PENDING_TIMEOUT = 5.0  # seconds an install may wait for its barrier reply before it is rolled back
METER_READ_TIMEOUT = 5.0  # a meter read unanswered this long is asked again
STATIC_READ_TIMEOUT = 5.0  # a read of the static flows' counters unanswered this long is asked again
DUMP_SLICE = 2000  # dumped entries the event loop takes in one turn
HANDOVERS = 2  # conntrack hand-overs (the listener's or a dump's) in the event queue at most
TIMER_RESOLUTION = 0.05  # seconds: how late a delayed command (an RST's grace) may run
WATCH_READS_MAX = 1000  # catcher reads in flight at most (teardown_sweep)




class EventConntrack(event.EventBase):
    def __init__(self, events: list[ConnEvent], dump: bool = False):
        super().__init__()
        self.events = events
        self.dump = dump


class EventOverflow(event.EventBase):
    pass


class EventTick(event.EventBase):
    pass


class EventWatch(event.EventBase):
    """A look at the catchers for lost packet-ins (teardown_sweep), every WATCH_PERIOD."""


class EventRun(event.EventBase):
    """A switch's core commands to run on the event loop (a worker's follow-up, a delayed
    command, paced installs whose turn came)."""

    def __init__(self, switch: Switch, commands: tuple[c.Command, ...], waiter: threading.Event | None = None):
        super().__init__()
        self.switch = switch
        self.commands = commands
        self.waiter = waiter  # set once the switch has answered this turn's barrier


class EventShutdown(event.EventBase):
    def __init__(self, done: threading.Event):
        super().__init__()
        self.done = done


class NFShuntApp(app_manager.OSKenApp):
    OFP_VERSIONS: list[int] = []  # set from the config by controller.run() before start

    def __init__(self, *args: Any, nfshunt_config: Config, nfshunt_config_path: str | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.cfg = nfshunt_config
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
        self._events_read = 0  # conntrack events and dumped entries taken by the event loop
        self._later: list[tuple[float, int, Switch, tuple[c.Command, ...]]] = []  # heap of (due, seq, switch, cmds)
        self._later_seq = 0
        self._later_lock = threading.Lock()
        self.rlog = RateLimitedLog(LOG)
        ChannelDatapath.admit = self._admit
        ChannelDatapath.failed = self._connection_failed
        self.operator = OperatorAPI(self)
        self._running = True
        self._handover_room = threading.BoundedSemaphore(HANDOVERS)
        self._dump_feed = threading.Lock()
        self.started = time.time()
        self.metrics = Metrics(self._metrics_snapshot)
        self.counters = self.metrics.counters
        self.audit = audit_logger(self.cfg.audit_log)
        self.outcomes = Outcomes(self.metrics, self.audit)
        if self.cfg.metrics_address:
            self.metrics.serve(self.cfg.metrics_address, self.cfg.metrics_port)
        self.worker = ConntrackWorker(on_dump=self._post_dump, on_malformed=self._malformed)
        self.dispatcher = Dispatcher(self.worker, self.outcomes, self._schedule,
                                     lambda sw, cmds: self.send_event(self.name, EventRun(sw, cmds)))
        self.policy = PolicyWatch(self.cfg.state_dir, len(self.switches), self.cfg.pair is not None)
        for sw in self.switches:
            sw.core.stale_policy = self.policy.stale
        self.listener = ConntrackListener(self.cfg.netlink_rcvbuf, self._post_events,
                                          self._post_overflow, self._malformed)

    # --- threads feeding the event loop --------------------------------------------------

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
        self.threads.append(hub.spawn(self._ticker))

    def _ticker(self) -> None:
        """The 1 s housekeeping tick, and the core's delayed commands (Later) when due: one
        thread however many are waiting (an RST storm must not start a thread per RST)."""
        next_tick = next_watch = time.monotonic() + 1.0
        while self._running:
            time.sleep(TIMER_RESOLUTION)
            now = time.monotonic()
            due: dict[int, list[c.Command]] = {}
            with self._later_lock:
                while self._later and self._later[0][0] <= now:
                    _, _, sw, commands = heapq.heappop(self._later)
                    due.setdefault(sw.index, []).extend(commands)
            for sw in self.switches:
                send = sw.send
                if sw.index in due or (send is not None and send.queued):  # paced installs wait for their turn
                    self.send_event(self.name, EventRun(sw, tuple(due.get(sw.index, ()))))
            if now >= next_watch:
                next_watch = now + WATCH_PERIOD
                self.send_event(self.name, EventWatch())
            if now >= next_tick:
                next_tick = now + 1.0
                self.send_event(self.name, EventTick())

    def _post_events(self, events: list[ConnEvent]) -> None:
        self._hand_over(EventConntrack(events))

    def _hand_over(self, ev: EventConntrack) -> bool:
        """Queue conntrack events for the event loop, at most HANDOVERS at a time (the
        rest wait in the kernel's buffer, or in the dump). os-ken's event queue (128) also
        carries the switch's replies: when conntrack events filled it, the thread reading
        the switch blocked, the switch stopped reading flow-mods with its replies unread,
        the event loop blocked writing to it and never drained the queue, and barriers
        expired until the connection dropped (events handed over 1,000 at a time filled
        it in one 100,000 burst: 16% of it stayed unshunted)."""
        while not self._handover_room.acquire(timeout=0.5):
            if not self._running:
                return False
        self.send_event(self.name, ev)
        return True

    def _post_dump(self, events: list[ConnEvent]) -> None:
        # In slices: 100,000 entries in one turn of the event loop kept it from the switch's
        # barrier replies for seconds; the switch, its replies unread, stopped reading our
        # flow-mods, and the connection was lost. Fed on a thread of its own, one dump at a
        # time: the worker goes on deleting entries meanwhile.
        def feed() -> None:
            with self._dump_feed:
                for at in range(0, max(len(events), 1), DUMP_SLICE):
                    if not self._hand_over(EventConntrack(events[at:at + DUMP_SLICE], dump=at == 0)):
                        return
        threading.Thread(target=feed, name="conntrack-dump-feed", daemon=True).start()

    def _post_overflow(self) -> None:
        self.send_event(self.name, EventOverflow())

    def _malformed(self, what: str) -> None:
        # Called from the listener thread; Counter increments are atomic enough for stats.
        self.counters.inc("netlink_malformed")
        LOG.warning("skipped malformed conntrack message: %s", what)

    def close(self) -> None:
        """Stop every thread; the worker first finishes the conntrack deletes it has queued."""
        self._running = False
        self.metrics.stop()
        if self.control is not None:
            self.control.stop()
        self.listener.stop()
        self.worker.stop()

    def reopen_logs(self) -> None:
        """SIGHUP: reopen the audit log (after logrotate moved it), then reload the config
        (the reload logs its outcome; nobody waits for the answer)."""
        for handler in self.audit.handlers:
            if isinstance(handler, BatchedFileHandler):
                handler.reopen()
        LOG.info("reopened the audit log")
        self.send_event(self.name, EventControl({"cmd": "reload", "by": "SIGHUP"}))

    def _metrics_snapshot(self) -> dict[str, Any]:
        """The gauges' values, read on the scrape thread (plain reads of the event loop's state)."""
        per_switch = []
        for sw in self.switches:
            table = OperatorAPI.table(sw)  # what status shows, the same numbers
            per_switch.append({"datapath_id": sw.name, "connected": 1 if sw.dp is not None else 0,
                               "shunts": sw.core.shunts, "blocks": sw.core.blocks, "max_shunts": sw.core.budget,
                               "table_max": table["max_entries"], "table_used": table["used"],
                               "table_1": table["table_1"], "static": sw.core.static.status()})
        maxes = [sw["table_max"] for sw in per_switch]
        roles = self.switches[0].roles
        return {"switches": per_switch,
                **totals(per_switch, ("shunts", "blocks", "connected", "max_shunts", "table_used", "table_1")),
                "waiting": sum(len(sw.core.waiting) for sw in self.switches),
                "queued": sum(len(sw.send.queued) for sw in self.switches if sw.send is not None),
                "table_max": None if None in maxes else sum(maxes),  # type: ignore[arg-type]
                "pair": roles.status() if roles is not None else None,
                "static": [row for sw in per_switch for row in sw["static"]]}

    # --- switch lifecycle -----------------------------------------------------------------

    def _admit(self, address: tuple[str, int]) -> str | None:
        """On os-ken's accept thread, before the handshake: the peer's address."""
        if any(address_allowed(address[0], sw.cfg.switch_addresses) for sw in self.switches):
            return None
        self.counters.add("switch_refused", "address not allowed")
        self.rlog.warning("refused-address", "refused an OpenFlow connection from %s: not in switch_addresses",
                          address[0])
        return "address not allowed"

    def _connection_failed(self, address: tuple[str, int], exc: Exception) -> None:
        """On a connection's thread: what a peer sent could not be read (address "?": a
        message os-ken dropped)."""
        self.counters.inc("openflow_malformed")
        if address[0] != "?":  # os-ken's own parse errors are logged (rate-limited) where they happen
            self.rlog.warning("connection-failed", "OpenFlow connection from %s ended on what it sent: %s: %s",
                              address[0], type(exc).__name__, exc)

    def _refuse(self, dp: Any, reason: str, detail: str) -> None:
        self.counters.add("switch_refused", reason)
        self.rlog.warning(f"refused-{reason}", "refused switch %016x from %s: %s", dp.id or 0, dp.address[0], detail)
        dp.close()

    @set_ev_cls(ofp_event.EventOFPStateChange, [MAIN_DISPATCHER, DEAD_DISPATCHER])
    def _state_change(self, ev: Any) -> None:
        dp = ev.datapath
        if ev.state == MAIN_DISPATCHER:
            sw = self._switch_for(dp)
            if sw is None:
                self._refuse(dp, "datapath id not configured", "not the configured datapath_id " + ", ".join(
                    s.name for s in self.switches))
                return
            if not address_allowed(dp.address[0], sw.cfg.switch_addresses):
                self._refuse(dp, "address not allowed", f"not in the switch_addresses of {sw.name}")
                return
            old = sw.dp
            if old is not None and old is not dp:
                # The served switch again (rebooted, re-pointed, or its old connection is
                # dead and not yet noticed): the new connection replaces the old one. Only
                # the same datapath from the same address, or any over TLS (authenticated).
                if dp.id != old.id or (self.cfg.tls is None and dp.address[0] != old.address[0]):
                    self._refuse(dp, "another switch is served",
                                 f"switch {old.id:016x} from {old.address[0]} is served")
                    return
                LOG.warning("switch %016x connected again from %s: replacing its old connection",
                            dp.id, dp.address[0])
                self._disconnected(sw, "replaced by a new connection")
                old.close()
            sw.dp = dp
            dp.nfshunt_switch = sw
            sw.fb = FlowBuilder(dp, sw.cfg, self._pipeline(dp))
            sw.send = self._send_path(sw)
            self.counters.inc("switch_connects")
            LOG.info("switch %016x connected from %s:%s, OpenFlow %s", dp.id, dp.address[0],
                     dp.address[1], openflow_label(dp.ofproto.OFP_VERSION))
            sw.flow_stats = []
            if sw.roles is None:
                self.run(sw, sw.core.switch_connected(dp.ofproto.OFP_VERSION, sw.fb.pipeline))
            else:  # nothing is programmed before the switch grants MASTER
                self._role_request(sw, sw.roles.connected())
        elif ev.state == DEAD_DISPATCHER:
            sw = getattr(dp, "nfshunt_switch", None)
            if sw is not None and dp is sw.dp:
                self._disconnected(sw, "connection closed or echo unanswered")

    def _switch_for(self, dp: Any) -> Switch | None:
        """The configured switch a datapath id belongs to (one without a datapath_id: any)."""
        for sw in self.switches:
            if sw.cfg.datapath_id is None or sw.cfg.datapath_id == dp.id:
                return sw
        return None

    def _send_path(self, sw: Switch) -> SendPath:
        def wanted(conn: Conn) -> bool:  # a queued install the core still wants sent
            return sw.core.conns.holds(conn, State.PENDING) \
                and conn.remove_reason is None
        return SendPath(sw.dp, sw.fb, sw.cfg.flow_mod_rate, sw.cfg.install_queue, wanted)

    @set_ev_cls(ofp_event.EventOFPSwitchFeatures, CONFIG_DISPATCHER)
    def _features(self, ev: Any) -> None:
        """How many tables the switch has (the layout is chosen when it is served)."""
        ev.msg.datapath.nfshunt_tables = ev.msg.n_tables

    def _pipeline(self, dp: Any) -> bool:
        """The flow layout for this switch (config flow_layout), logged with why."""
        cfg = dp.nfshunt_switch.cfg
        layout, tables = cfg.flow_layout, getattr(dp, "nfshunt_tables", 0)
        if layout == "single" or not cfg.tcp_teardown:
            return False
        if dp.ofproto.OFP_VERSION == OFP10 or tables < 2:
            why = "OpenFlow 1.0" if dp.ofproto.OFP_VERSION == OFP10 else f"the switch reports {tables} table(s)"
            log = LOG.warning if layout == "pipeline" else LOG.info
            log("flow_layout %s: %s, so the single-table layout (6 entries a TCP shunt)", layout, why)
            return False
        LOG.info("pipeline flow layout: TCP shunts go on to table 1 (2 entries a shunt, %d shared per port group; "
                 "the switch has %d tables)", PIPELINE_ENTRIES, tables)
        return True

    def _disconnected(self, sw: Switch, why: str) -> None:
        LOG.warning("switch %016x disconnected (%s)", sw.dp.id or 0, why)
        self.counters.inc("switch_disconnects")
        sw.gone()
        if sw.roles is not None:
            sw.roles.disconnected()
        self.operator.switch_gone(sw)
        self.run(sw, sw.core.switch_disconnected())

    def _ours(self, msg: Any, what: str) -> Switch | None:
        """The switch of a message of a served connection; anything else is counted and dropped."""
        sw = getattr(msg.datapath, "nfshunt_switch", None)
        if sw is not None and msg.datapath is sw.dp:
            return sw
        self.counters.add("openflow_ignored", what)
        self.rlog.warning(f"foreign-{what}", "ignored %s from %s: not a served switch connection", what,
                          getattr(msg.datapath, "address", ("?",))[0])
        return None

    # --- switch messages --------------------------------------------------------------------

    @set_ev_cls(ofp_event.EventOFPBarrierReply, MAIN_DISPATCHER)
    def _barrier_reply(self, ev: Any) -> None:
        sw = self._ours(ev.msg, "barrier reply")
        if sw is None or sw.send is None:
            return
        batch = sw.send.barrier_reply(ev.msg.xid)
        if batch is not None:
            self._settle(sw, batch.conns, batch.failed)

    def _settle(self, sw: Switch, conns: list[Conn], failed: dict[int, tuple[str, bool]]) -> None:
        now = time.monotonic()
        out: list[c.Command] = []
        for conn in conns:
            failure = failed.get(id(conn))
            if failure is None:
                out.extend(sw.core.flows_confirmed(conn, now))
            else:
                out.extend(sw.core.flows_failed(conn, *failure, now=now))
        self.run(sw, out)

    # --- a pair's roles ------------------------------------------------------------------------

    def _role_request(self, sw: Switch, req: RoleRequest) -> None:
        if sw.dp is None:
            return
        msg = sw.dp.ofproto_parser.OFPRoleRequest(sw.dp, req.role, req.generation)
        sw.role_xids.add(sw.dp.set_xid(msg))
        if req.role == MASTER:
            LOG.info("claiming MASTER of switch %s with generation %d", sw.name, req.generation)
        self._queue(sw, msg)
        self._flush(sw)

    def role_change(self, sw: Switch, change: Change) -> None:
        roles = sw.roles
        if roles is None:
            return
        if change.demoted is not None:
            self.counters.inc("role_demotions")
            LOG.warning("no longer master of switch %s (%s): standing by, the switch's pairs are the other "
                        "controller's now", sw.name, change.demoted)
            if sw.dp is not None:  # what was queued for the switch is not ours to send any more
                sw.send = self._send_path(sw)
            self.run(sw, sw.core.stand_by())
        if change.promoted and sw.dp is not None:
            self.counters.inc("role_promotions")
            LOG.warning("master of switch %s with generation %d: programming it (defaults to this firewall, "
                        "adopting the pairs on the switch)", sw.name, roles.generation)
            self.run(sw, sw.core.switch_connected(sw.dp.ofproto.OFP_VERSION, sw.fb.pipeline))
        if change.request is not None:
            self._role_request(sw, change.request)

    @set_ev_cls(ofp_event.EventOFPRoleReply, MAIN_DISPATCHER)
    def _role_reply(self, ev: Any) -> None:
        msg = ev.msg
        sw = self._ours(msg, "role reply")
        if sw is None or sw.roles is None:
            return
        sw.role_xids.discard(msg.xid)
        LOG.debug("role reply: %s, generation %d", ROLE_NAMES.get(msg.role, msg.role), msg.generation_id)
        self.role_change(sw, sw.roles.reply(msg.role, msg.generation_id))

    def _role_error(self, sw: Switch, msg: Any) -> bool:
        """A role request refused, or a message refused because we are slave; True: handled."""
        ofp = msg.datapath.ofproto
        assert sw.roles is not None
        if msg.xid in sw.role_xids and msg.type == ofp.OFPET_ROLE_REQUEST_FAILED:
            sw.role_xids.discard(msg.xid)
            if msg.code == ofp.OFPRRFC_STALE:
                LOG.warning("the switch refused this controller's role request as stale: a newer master holds it")
                self.role_change(sw, sw.roles.stale())
            else:
                LOG.error("the switch refused the role request (code %d): it may not support controller roles; "
                          "this controller stays backup and programs nothing", msg.code)
            return True
        if msg.type == ofp.OFPET_BAD_REQUEST and msg.code == ofp.OFPBRC_IS_SLAVE:
            # A takeover we had not noticed yet: the switch refused what we sent.
            self.role_change(sw, sw.roles.refused_as_slave())
        return False

    @set_ev_cls(ofp_event.EventOFPErrorMsg, [CONFIG_DISPATCHER, MAIN_DISPATCHER])
    def _error(self, ev: Any) -> None:
        msg = ev.msg
        sw = self._ours(msg, "error")
        if sw is None:
            return  # before the handshake or from a refused peer: no key per type and code
        self.counters.add("openflow_error", str(msg.type), str(msg.code))
        if sw.roles is not None and self._role_error(sw, msg):
            return
        reason = f"switch error type={msg.type} code={msg.code}"
        if msg.xid == sw.table_xid:
            LOG.warning("switch %s did not report its table size (%s): set max_shunts to what its table holds "
                        "(a pair takes up to %d entries)", sw.name, reason, sw.core.max_pair_entries())
            return
        if msg.xid in (sw.meter_xid, sw.meter_read and sw.meter_read.xid):
            sw.meter_on = False
            LOG.warning("the switch refused the packet-in rate limit (controller meter: %s): a host sending "
                        "FIN/RST segments can load the controller; on Open vSwitch set the Controller "
                        "record's controller_rate_limit instead", reason)
            return
        conn = sw.send.error(msg.xid, reason, table_full(msg)) if sw.send is not None else None
        if conn is not None:
            self.rlog.warning("refused-flow", "switch refused a flow of %s: %s", conn.describe(), reason)
        else:
            self.rlog.warning(f"error-{msg.type}-{msg.code}", "switch error for xid %s: %s", msg.xid, reason)

    @set_ev_cls(ofp_event.EventOFPPacketIn, MAIN_DISPATCHER)
    def _packet_in(self, ev: Any) -> None:
        """Only the TCP teardown catchers send packets here (OpenFlow 1.3), and only the
        headers: the switch forwarded the packet itself."""
        msg = ev.msg
        sw = self._ours(msg, "packet-in")
        if sw is None:
            return
        cookie = getattr(msg, "cookie", None)
        in_port = msg.match.get("in_port") if hasattr(msg.match, "get") else None
        if cookie is None or in_port is None:
            self._unexpected_packet_in("no cookie or in_port", cookie)
            return
        parsed = cookies.parse(cookie)
        if parsed is not None and parsed.kind is cookies.Kind.PIPELINE and parsed.reply:
            # A shared table-1 catcher: the metadata names the connection and direction.
            metadata = msg.match.get("metadata")
            if metadata is None:
                self._unexpected_packet_in("no metadata", cookie)
                return
            cookie = cookies.make_teardown(*metadata_teardown(metadata), cookies.is_rst(cookie))
        out = sw.core.teardown_packet(cookie, in_port, time.monotonic())
        if out is None:
            self._unexpected_packet_in("no connection of ours", cookie)
            return
        self.counters.add("packet_in", "teardown")
        self.run(sw, out)

    def _unexpected_packet_in(self, reason: str, cookie: int | None) -> None:
        self.counters.add("packet_in", reason)
        self.rlog.warning(f"packet-in-{reason}", "unexpected packet-in (%s), cookie %s", reason,
                          "none" if cookie is None else f"0x{cookie:016x}")

    @set_ev_cls(ofp_event.EventOFPFlowRemoved, MAIN_DISPATCHER)
    def _flow_removed(self, ev: Any) -> None:
        m = ev.msg
        sw = self._ours(m, "flow-removed")
        if sw is None:
            return
        reason = REMOVED_REASONS.get(m.reason, f"reason {m.reason}")
        self.run(sw, sw.core.flow_removed(m.cookie, reason, m.packet_count, m.byte_count,
                                         m.duration_sec + m.duration_nsec / 1e9, time.monotonic()))

    @set_ev_cls(ofp_event.EventOFPFlowStatsReply, MAIN_DISPATCHER)
    def _flow_stats_reply(self, ev: Any) -> None:
        sw = self._ours(ev.msg, "flow stats")
        if sw is None or sw.fb is None:
            return
        fb = sw.fb
        if sw.catcher_read is not None and ev.msg.xid == sw.catcher_read.xid:
            self._catchers_read(sw, ev.msg)
            return
        if sw.static_read is not None and ev.msg.xid == sw.static_read.xid:  # static flows' counters (status, metrics)
            sw.static_flows.extend(fb.parse_stats(stats) for stats in ev.msg.body)
            if not fb.more_follows(ev.msg):
                sw.core.static.counted(sw.static_flows)
                sw.static_read, sw.static_flows = None, []
            return
        if ev.msg.xid in sw.watch_reads:
            self._watch_read(sw, ev.msg)
            return
        read = sw.counter_reads.get(ev.msg.xid)
        if read is not None:  # a new shunt's counters (confirm: counters)
            conn, packets = read.conn, read.packets
            for stats in ev.msg.body:
                reply = bool(stats.cookie & cookies.DIRECTION_BIT)
                packets[reply] = packets.get(reply, 0) + stats.packet_count
            if not fb.more_follows(ev.msg):
                del sw.counter_reads[ev.msg.xid]
                self.run(sw, sw.core.counters_read(conn, packets, time.monotonic()))
            return
        status = self.operator.collecting(sw, ev.msg.xid)  # an operator's request, or a reconcile
        collected = status if status is not None else sw.flow_stats
        for stats in ev.msg.body:
            try:
                collected.append(fb.parse_stats(stats))
            except Exception as exc:  # an odd flow on the switch is not ours to crash on
                self.counters.inc("openflow_malformed")
                LOG.warning("unreadable flow in stats reply: %s", exc)
        if fb.more_follows(ev.msg):
            return
        if status is not None:
            self.operator.answer_status(sw, ev.msg.xid)
            return
        flows, sw.flow_stats = sw.flow_stats, []
        core = sw.core
        if core.reconciled:
            return  # a read asked for before this connection's reconcile, answered after it
        out = core.reconcile(flows, time.monotonic())
        if not core.reconciled:  # table 1 not (yet) all on the switch: read again
            self.run(sw, out)
            return
        self.policy.reconciled(sw.index)
        if core.pipeline_reads >= PIPELINE_READS:
            LOG.error("switch %s still lacks table 1's flows %.0f s after they were sent: TCP shunts may have "
                      "their packets dropped there; set flow_layout single if it cannot hold them", sw.name,
                      PIPELINE_READS * PIPELINE_READ_AGAIN)
        kinds = collections.Counter(type(cmd).__name__ for cmd in out)
        LOG.info("reconciled with switch %s: %d NFShunt flows read, %d pairs held, %d re-installed, "
                 "%d flows deleted, %d pairs forgotten", sw.name, len(flows), len(core.by_key), kinds["InstallFlows"],
                 kinds["DeleteSwitchFlow"], kinds["Removed"])
        self.run(sw, out)

    @set_ev_cls(ofp_event.EventOFPMeterStatsReply, MAIN_DISPATCHER)
    def _meter_stats(self, ev: Any) -> None:
        sw = self._ours(ev.msg, "meter stats")
        if sw is None or sw.meter_read is None or ev.msg.xid != sw.meter_read.xid:
            return
        sw.meter_read = None
        ofp = ev.msg.datapath.ofproto
        dropped = sum(band.packet_band_count for meter in ev.msg.body if meter.meter_id == ofp.OFPM_CONTROLLER
                      for band in meter.band_stats)
        new = sw.sweep.meter_read(dropped)
        if new:
            self.counters.inc("packet_in_dropped", new)
        if new and sw.core.pipeline:
            # The shared catchers' counters cannot say which connections closed.
            self.rlog.warning("teardowns-untraceable", "the switch dropped %d teardown packet-ins (packet_in_rate "
                              "%d/s): in the pipeline layout a shunt that lost one FIN's ends as half-closed, one "
                              "that lost both at the idle timeout (%d s); flow_layout single finds them from "
                              "per-connection catchers", new, sw.cfg.packet_in_rate, sw.cfg.default_shunt_timeout)
        if sw.fb is not None and not sw.core.pipeline and sw.sweep.due(time.monotonic()):
            msg = sw.fb.catcher_stats_request()
            sw.catcher_read = CatcherRead(sw.dp.set_xid(msg), [])
            self._queue(sw, msg)
            self._flush(sw)

    def _catchers_read(self, sw: Switch, msg: Any) -> None:
        """A part of the catcher read after dropped packet-ins (see teardown_sweep)."""
        assert sw.catcher_read is not None and sw.fb is not None
        counted = sw.catcher_read.counted
        counted.extend(stats.cookie for stats in msg.body if stats.packet_count)
        if sw.fb.more_follows(msg):
            return
        sw.catcher_read = None
        sw.sweep.swept()
        out, ended = sw.core.catchers_counted(counted, time.monotonic())
        if ended:
            self.counters.inc("teardowns_from_counters", ended)
            self.rlog.warning("teardowns-from-counters", "the switch dropped teardown packet-ins (packet_in_rate "
                              "%d/s): %d shunts ended from their FIN/RST catchers' counters", sw.cfg.packet_in_rate,
                              ended)
        self.run(sw, out)

    @set_ev_cls(EventWatch)
    def _watch(self, ev: EventWatch) -> None:
        """Half-closed shunts whose second FIN's packet-in may have been lost (teardown_sweep):
        their catchers are read (single layout), or they are handed back (pipeline layout)."""
        now = time.monotonic()
        for sw in self.switches:
            fb = sw.fb
            if fb is None or not sw.core.reconciled or not sw.core.half_closed:
                continue
            due = sw.core.half_closed_due(now)
            if due.ended:
                self.counters.inc("teardowns_half_closed", due.ended)
                self.rlog.warning("teardowns-half-closed", "%d half-closed shunts handed back: their second FIN not "
                               "heard of within %.1f s (a lost packet-in, or a long half-close)", due.ended,
                               CHECK_AFTER)
            msgs = [fb.catcher_stats_request_exact(cookie) for cookie in due.catchers
                    if len(sw.watch_reads) < WATCH_READS_MAX]  # a switch that does not answer is not asked more
            for msg in msgs:
                sw.watch_reads[sw.dp.set_xid(msg)] = []
            self._queue(sw, *msgs)
            self.run(sw, due.commands)

    def _watch_read(self, sw: Switch, msg: Any) -> None:
        """A part of a half-closed shunt's catcher read; once complete, what it says."""
        assert sw.fb is not None
        counted = sw.watch_reads[msg.xid]
        counted.extend(stats.cookie for stats in msg.body if stats.packet_count)
        if sw.fb.more_follows(msg):
            return
        del sw.watch_reads[msg.xid]
        out, ended = sw.core.catchers_counted(counted, time.monotonic())
        if ended:
            self.counters.inc("teardowns_from_counters", ended)
            self.rlog.warning("teardowns-lost", "the switch lost teardown packet-ins: %d shunts ended from their "
                              "FIN/RST catchers' counters", ended)
        self.run(sw, out)

    @set_ev_cls(ofp_event.EventOFPTableFeaturesStatsReply, MAIN_DISPATCHER)
    def _table_features(self, ev: Any) -> None:
        sw = self._ours(ev.msg, "table features")
        if sw is not None:
            self._table_reported(sw, [(t.table_id, t.max_entries) for t in ev.msg.body])

    @set_ev_cls(ofp_event.EventOFPTableStatsReply, MAIN_DISPATCHER)
    def _table_stats(self, ev: Any) -> None:
        sw = self._ours(ev.msg, "table stats")
        if sw is not None and ev.msg.datapath.ofproto.OFP_VERSION == OFP10:
            self._table_reported(sw, [(t.table_id, t.max_entries) for t in ev.msg.body])

    def _table_reported(self, sw: Switch, tables: list[tuple[int, int]]) -> None:
        core = sw.core
        for table_id, max_entries in tables:
            if table_id != 0:
                continue
            budget = core.table_size(max_entries)
            if core.default_entries() >= max_entries:
                LOG.error("switch %s table 0 holds %d entries: the defaults and %d static shunt flows take %d, "
                          "the switch refuses what does not fit and no shunt has room", sw.name, max_entries,
                          core.static.entries, core.default_entries())
            if budget is None:
                LOG.info("switch %s table 0 holds %d entries; max_shunts %d is the budget", sw.name, max_entries,
                         sw.cfg.max_shunts)
            else:
                LOG.info("switch %s table 0 holds %d entries: budget %d shunt and block pairs (max_shunts unset; "
                         "%d entries for the defaults, at most %d a pair)", sw.name, max_entries, budget,
                         core.default_entries(), core.max_pair_entries())
            if budget:  # connections that waited for a budget the switch turned out to allow
                self.run(sw, core.room_freed(max(0, budget - core.shunts - core.blocks)))

    # --- conntrack and timers ---------------------------------------------------------------

    @set_ev_cls(EventConntrack)
    def _conntrack(self, ev: EventConntrack) -> None:
        try:
            self._conntrack_events(ev)
        finally:
            self._handover_room.release()

    def _conntrack_events(self, ev: EventConntrack) -> None:
        counters = self.counters
        switches = self.switches
        outs: list[list[c.Command]] = [[] for _ in switches]
        route = self.router.route
        self._events_read += len(ev.events)
        for cev in ev.events:
            counters.add("conntrack_event", cev.kind.value)
            to = route(cev)
            if isinstance(to, c.Ignored):
                outs[0].append(to)
            else:
                outs[to].extend(switches[to].core.conntrack_event(cev))
        if ev.dump:
            counters.inc("conntrack_resyncs")
        for sw, out in zip(switches, outs, strict=True):
            if out or (sw.send is not None and sw.send.queued):
                self.run(sw, out)

    @set_ev_cls(EventOverflow)
    def _overflow(self, ev: EventOverflow) -> None:
        self.counters.inc("netlink_overflows")
        LOG.warning("conntrack events were lost (ENOBUFS); resyncing from a dump")
        self.worker.dump()

    # --- control socket: the operator API ------------------------------------------------

    def _control_request(self, request: dict[str, Any]) -> dict[str, Any]:
        """On the control server's thread: hand over to the event loop and wait."""
        ev = EventControl(request)
        self.send_event(self.name, ev)
        if not ev.done.wait(5.0):
            return {"error": "the controller did not answer within 5 s"}
        return ev.reply

    @set_ev_cls(EventControl)
    def _control(self, ev: EventControl) -> None:
        self.operator.handle(ev)

    @set_ev_cls(EventRun)
    def _run_later(self, ev: "EventRun") -> None:
        self.run(ev.switch, ev.commands, ev.waiter)

    @set_ev_cls(EventTick)
    def _tick(self, ev: EventTick) -> None:
        now = time.monotonic()
        for sw in self.switches:
            self._switch_tick(sw, now)
        busy = any(sw.send is not None and sw.send.pending() > 0 for sw in self.switches)
        if self.trimmer.tick(self._events_read, busy):
            LOG.debug("returned the memory of a settled burst to the system (malloc_trim)")
        flush_all()  # batched log lines are at most a second late

    def _switch_tick(self, sw: Switch, now: float) -> None:
        if sw.send is not None:
            for batch in sw.send.expired(now, PENDING_TIMEOUT):
                self.counters.inc("install_timeouts", len(batch.conns))
                LOG.warning("switch %s did not answer a barrier within %.0f s: %d installs rolled back",
                            sw.name, PENDING_TIMEOUT, len(batch.conns))
                self._settle(sw, batch.conns, {id(conn): ("no answer from the switch", False) for conn in batch.conns})
        pair = sw.cfg.pair
        if sw.roles is not None and pair is not None and sw.dp is not None and \
                now - sw.role_checked >= pair.role_check_interval:
            sw.role_checked = now
            check = sw.roles.check()  # no role status in OpenFlow 1.3: ask whether we are still master
            if check is not None:
                self._role_request(sw, check)
        if sw.meter_on and sw.fb is not None and (sw.meter_read is None or
                                                  now - sw.meter_read.at > METER_READ_TIMEOUT):
            msg = sw.fb.controller_meter_stats_request()
            sw.meter_read = Asked(sw.dp.set_xid(msg), now)
            self._queue(sw, msg)
        if sw.core.static.entries and sw.fb is not None and (sw.static_read is None or
                                                             now - sw.static_read.at > STATIC_READ_TIMEOUT):
            sw.static_flows = []  # a read the switch never answered is given up
            self.run(sw, [c.ReadStaticCounters()])  # once a tick: status and metrics show them
        self.run(sw, sw.core.tick(now))

    @set_ev_cls(EventShutdown)
    def _shutdown(self, ev: EventShutdown) -> None:
        """Every pair is taken down (delete_flows_on_shutdown) the one way there is: TCP
        shunts' entries re-created first, by the worker, then the flows go. `done` is set
        once the worker has answered every re-creation and the switch the last barrier."""
        now = time.monotonic()
        waiting = [sw for sw in self.switches if sw.fb is not None and sw.cfg.delete_flows_on_shutdown]
        done = _AllSet(len(waiting), ev.done)
        for sw in self.switches:
            take_down = sw in waiting
            commands = sw.core.stopping(now, take_down)  # from here on nothing new is installed
            if not take_down:
                continue
            LOG.info("shutting down: taking down %d shunts and blocks on switch %s (delete_flows_on_shutdown)",
                     len(sw.core.conns.removing), sw.name)
            self.run(sw, commands)
            # The worker answers in order: its re-creations' follow-ups (the removals) are
            # on the event queue before this.
            self.worker.after(lambda sw=sw: self.send_event(self.name, EventRun(sw, (), done)))

    # --- the one send path ---------------------------------------------------------------------

    def run(self, sw: Switch, commands: Iterable[c.Command], waiter: threading.Event | None = None) -> None:
        """Execute a switch's core's commands (and what executing them brings back from the
        core), then flush the batch to the switch."""
        work = collections.deque(commands)
        if sw.send is not None and sw.send.queued:
            work.extend(self._release(sw))
        execute = self.dispatcher.execute
        with self.worker.batched():  # the turn's conntrack requests go to the worker at once
            while work:
                cmd = work.popleft()
                try:
                    follow = execute(sw, cmd)
                except Exception:
                    self.counters.inc("internal_errors")
                    LOG.exception("failed to execute %s", type(cmd).__name__)
                    continue
                if follow:
                    work.extend(follow)
        self._flush(sw, waiter)

    def _schedule(self, delay: float, sw: Switch, commands: tuple[c.Command, ...]) -> None:
        """Run `commands` after `delay` (the ticker posts them when due)."""
        with self._later_lock:
            self._later_seq += 1  # ties never compare the commands
            heapq.heappush(self._later, (time.monotonic() + delay, self._later_seq, sw, commands))

    def _release(self, sw: Switch) -> list[c.Command]:
        """Paced installs whose turn has come go out; the queue's freed room goes to
        connections that waited for it."""
        send, core = sw.send, sw.core
        assert send is not None
        before = len(send.queued)
        out: list[c.Command] = []
        for conn in send.release(time.monotonic()):
            out.extend(core.install_dropped(conn, "taken down before it was sent", wait=False))
        drained = before - len(send.queued)
        if drained and core.waiting:
            out.extend(core.room_freed(min(drained, send.queue_max - len(send.queued))))
        return out

    def request(self, sw: Switch, msg: Any) -> None:
        """Send one request to the switch now (an operator's read)."""
        self._queue(sw, msg)
        self._flush(sw)

    def _queue(self, sw: Switch, *msgs: Any) -> None:
        if sw.send is not None:
            sw.send.queue(list(msgs))

    def _flush(self, sw: Switch, waiter: threading.Event | None = None) -> None:
        if sw.send is not None:
            sw.send.flush(waiter)
        elif waiter is not None:
            waiter.set()


class _AllSet(threading.Event):
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
