"""The os-ken application: the one thread where conntrack events, switch messages and
timers meet the decision core.

Every input arrives as an os-ken event on this app's queue and is handled on its event
loop thread, so the core needs no locks. Commands from the core become OpenFlow messages
on the switch channel's send path (channel.SendPath: one write and one barrier per
batch; the barrier reply confirms a shunt or block).

Only the configured switch is served: a peer outside `switch_addresses` is refused before
its handshake, a datapath other than `datapath_id` after it, and every handler drops
messages of any connection but the served one (counted, logged rate-limited). A new
connection of the served switch replaces the old one (a reboot or a re-pointed switch),
when it comes from the same address or over TLS.

In a firewall pair (`pair`), the switch is programmed only once it has granted this
controller MASTER (roles.py); until then, and after a takeover by the other controller,
the core stands by and the switch refuses this controller's flow-mods anyway.
"""
from __future__ import annotations

import collections
import heapq
import json
import logging
import threading
import time
from typing import Any, Iterable

from os_ken.base import app_manager
from os_ken.controller import event, ofp_event
from os_ken.controller.handler import (CONFIG_DISPATCHER, DEAD_DISPATCHER, MAIN_DISPATCHER,
                                       set_ev_cls)
from os_ken.lib import hub

from . import cookies
from . import core as c
from .accounting import audit_logger, audit_record, conn_fields
from .channel import ChannelDatapath, RateLimitedLog, SendPath, address_allowed, table_full
from .config import Config
from .conntrack import ConntrackListener, ConntrackWorker
from .control import ControlServer
from .logs import BatchedFileHandler, flush_all
from .flows import REMOVED_REASONS, FlowBuilder, metadata_teardown
from .metrics import Metrics
from .operator_api import EventControl, OperatorAPI
from .model import TCP, ConnEvent, EventKind, SwitchFlow
from .roles import ROLE_NAMES, Change, RoleRequest, Roles
from .teardown_sweep import TeardownSweep
from .trim import Trimmer

LOG = logging.getLogger("nfshunt")
PENDING_TIMEOUT = 5.0  # seconds an install may wait for its barrier reply before it is rolled back
METER_READ_TIMEOUT = 5.0  # a meter read unanswered this long is asked again
DUMP_SLICE = 2000  # dumped entries the event loop takes in one turn
TIMER_RESOLUTION = 0.05  # seconds: how late a delayed command (an RST's grace) may run


EVENT_COUNTER = {k: f"conntrack_event:{k.value}" for k in EventKind}  # no per-event formatting
IGNORED_KEYS: dict[str, str] = {}  # reason -> counter key, formatted once


class EventConntrack(event.EventBase):
    def __init__(self, events: list[ConnEvent], dump: bool = False):
        super().__init__()
        self.events = events
        self.dump = dump


class EventOverflow(event.EventBase):
    pass


class EventTick(event.EventBase):
    pass


class EventRun(event.EventBase):
    """Core commands to run on the event loop (a worker's follow-up)."""

    def __init__(self, commands: tuple[c.Command, ...]):
        super().__init__()
        self.commands = commands


class EventShutdown(event.EventBase):
    def __init__(self, done: threading.Event):
        super().__init__()
        self.done = done


class Counters(collections.Counter):
    """Plain counters, keyed by name; read by logs and the status/metrics layers."""


class NFShuntApp(app_manager.OSKenApp):
    OFP_VERSIONS: list[int] = []  # set from the config by controller.run() before start

    def __init__(self, *args: Any, nfshunt_config: Config, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.cfg = nfshunt_config
        self.core = c.Core(self.cfg)
        self.counters = Counters()
        self.dp: Any = None
        self.fb: FlowBuilder | None = None
        self.send: SendPath | None = None
        self._meter_xid: int | None = None
        # The controller meter's drops, read every tick, and the catcher read they call for.
        self._meter_on = False
        self._meter_read: tuple[int, float] | None = None  # (xid, asked at)
        self._catcher_read: tuple[int, list[int]] | None = None  # (xid, cookies of catchers that counted)
        self.sweep = TeardownSweep()
        self.trimmer = Trimmer()
        self._events_read = 0  # conntrack events and dumped entries taken by the event loop
        self._table_xid: int | None = None
        self._role_xids: set[int] = set()
        # confirm: counters: flow-stats requests of new shunts, by xid: (conn, packets by direction)
        self._counter_reads: dict[int, tuple[c.Conn, dict[bool, int]]] = {}
        self._role_checked = 0.0
        self.roles = Roles(self.cfg.pair.state_file, self.cfg.pair.start_role) if self.cfg.pair else None
        self._later: list[tuple[float, int, tuple[c.Command, ...]]] = []  # heap of (due, seq, commands)
        self._later_seq = 0
        self._later_lock = threading.Lock()
        self.rlog = RateLimitedLog(LOG)
        ChannelDatapath.admit = self._admit
        ChannelDatapath.failed = self._connection_failed
        self._flow_stats: list[SwitchFlow] = []
        self.operator = OperatorAPI(self)
        self._running = True
        self.started = time.time()
        self.control: ControlServer | None = None
        self.metrics = Metrics(self._metrics_snapshot)
        self.audit = audit_logger(self.cfg.audit_log)
        if self.cfg.metrics_address:
            self.metrics.serve(self.cfg.metrics_address, self.cfg.metrics_port)
        if self.cfg.control_socket:
            self.control = ControlServer(self.cfg.control_socket, self._control_request)
        self.worker = ConntrackWorker(on_dump=self._post_dump, on_malformed=self._malformed)
        self.listener = ConntrackListener(self.cfg.netlink_rcvbuf, self._post_events,
                                          self._post_overflow, self._malformed)

    # --- threads feeding the event loop --------------------------------------------------

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
        next_tick = time.monotonic() + 1.0
        while self._running:
            time.sleep(TIMER_RESOLUTION)
            now = time.monotonic()
            due: list[c.Command] = []
            with self._later_lock:
                while self._later and self._later[0][0] <= now:
                    due.extend(heapq.heappop(self._later)[2])
            send = self.send
            if due or (send is not None and send.queued):  # paced installs wait for their turn
                self.send_event(self.name, EventRun(tuple(due)))
            if now >= next_tick:
                next_tick = now + 1.0
                self.send_event(self.name, EventTick())

    def _post_events(self, events: list[ConnEvent]) -> None:
        self.send_event(self.name, EventConntrack(events))

    def _post_dump(self, events: list[ConnEvent]) -> None:
        # In slices: 100,000 entries in one turn of the event loop kept it from the switch's
        # barrier replies for seconds; the switch, its replies unread, stopped reading our
        # flow-mods, and the connection was lost.
        for at in range(0, max(len(events), 1), DUMP_SLICE):
            self.send_event(self.name, EventConntrack(events[at:at + DUMP_SLICE], dump=at == 0))

    def _post_overflow(self) -> None:
        self.send_event(self.name, EventOverflow())

    def _malformed(self, what: str) -> None:
        # Called from the listener thread; Counter increments are atomic enough for stats.
        self.counters["netlink_malformed"] += 1
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
        """SIGHUP: reopen the audit log (after logrotate moved it)."""
        for handler in self.audit.handlers:
            if isinstance(handler, BatchedFileHandler):
                handler.reopen()
        LOG.info("reopened the audit log")

    def _metrics_snapshot(self) -> dict[str, Any]:
        """Read on the scrape thread; the event loop may be changing the counters meanwhile."""
        for _ in range(5):
            try:
                counters = dict(self.counters)
                break
            except RuntimeError:  # changed size during the copy: try again
                continue
        else:
            counters = {}
        core = self.core
        send = self.send
        return {"counters": counters, "shunts": core.shunts, "blocks": core.blocks, "waiting": len(core.waiting),
                "connected": 1 if self.dp is not None else 0, "max_shunts": core.budget,
                "queued": len(send.queued) if send is not None else 0,
                "table_max": core.table_max, "table_used": core.default_entries() + core.entries,
                "table_1": core.shared_entries(),
                "pair": self.roles.status() if self.roles is not None else None}

    # --- switch lifecycle -----------------------------------------------------------------

    def _admit(self, address: tuple[str, int]) -> str | None:
        """On os-ken's accept thread, before the handshake: the peer's address."""
        if address_allowed(address[0], self.cfg.switch_addresses):
            return None
        self.counters["switch_refused:address not allowed"] += 1
        self.rlog.warning("refused-address", "refused an OpenFlow connection from %s: not in switch_addresses",
                          address[0])
        return "address not allowed"

    def _connection_failed(self, address: tuple[str, int], exc: Exception) -> None:
        """On a connection's thread: what a peer sent could not be read (address "?": a
        message os-ken dropped)."""
        self.counters["openflow_malformed"] += 1
        if address[0] != "?":  # os-ken's own parse errors are logged (rate-limited) where they happen
            self.rlog.warning("connection-failed", "OpenFlow connection from %s ended on what it sent: %s: %s",
                              address[0], type(exc).__name__, exc)

    def _refuse(self, dp: Any, reason: str, detail: str) -> None:
        self.counters[f"switch_refused:{reason}"] += 1
        self.rlog.warning(f"refused-{reason}", "refused switch %016x from %s: %s", dp.id or 0, dp.address[0], detail)
        dp.close()

    @set_ev_cls(ofp_event.EventOFPStateChange, [MAIN_DISPATCHER, DEAD_DISPATCHER])
    def _state_change(self, ev: Any) -> None:
        dp = ev.datapath
        if ev.state == MAIN_DISPATCHER:
            if self.cfg.datapath_id is not None and dp.id != self.cfg.datapath_id:
                self._refuse(dp, "datapath id not configured",
                             f"not the configured datapath_id {self.cfg.datapath_id:016x}")
                return
            old = self.dp
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
                self._disconnected(old, "replaced by a new connection")
                old.close()
            self.dp = dp
            self.fb = FlowBuilder(dp, self.cfg, self._pipeline(dp))
            self.send = SendPath(dp, self.fb, self.cfg.flow_mod_rate, self.cfg.install_queue, self._wanted)
            self.counters["switch_connects"] += 1
            LOG.info("switch %016x connected from %s:%s, OpenFlow %s", dp.id, dp.address[0],
                     dp.address[1], "1.0" if dp.ofproto.OFP_VERSION == 1 else "1.3")
            self._flow_stats = []
            if self.roles is None:
                self._run(self.core.switch_connected(dp.ofproto.OFP_VERSION, self.fb.pipeline))
            else:  # nothing is programmed before the switch grants MASTER
                self._role_request(self.roles.connected())
        elif ev.state == DEAD_DISPATCHER and dp is self.dp:
            self._disconnected(dp, "connection closed or echo unanswered")

    @set_ev_cls(ofp_event.EventOFPSwitchFeatures, CONFIG_DISPATCHER)
    def _features(self, ev: Any) -> None:
        """How many tables the switch has (the layout is chosen when it is served)."""
        ev.msg.datapath.nfshunt_tables = ev.msg.n_tables

    def _pipeline(self, dp: Any) -> bool:
        """The flow layout for this switch (config flow_layout), logged with why."""
        layout, tables = self.cfg.flow_layout, getattr(dp, "nfshunt_tables", 0)
        if layout == "single" or not self.cfg.tcp_teardown:
            return False
        if dp.ofproto.OFP_VERSION == 1 or tables < 2:
            why = "OpenFlow 1.0" if dp.ofproto.OFP_VERSION == 1 else f"the switch reports {tables} table(s)"
            log = LOG.warning if layout == "pipeline" else LOG.info
            log("flow_layout %s: %s, so the single-table layout (6 entries a TCP shunt)", layout, why)
            return False
        LOG.info("pipeline flow layout: TCP shunts go on to table 1 (2 entries a shunt, %d shared per port group; "
                 "the switch has %d tables)", c.PIPELINE_ENTRIES, tables)
        return True

    def _disconnected(self, dp: Any, why: str) -> None:
        LOG.warning("switch %016x disconnected (%s)", dp.id or 0, why)
        self.counters["switch_disconnects"] += 1
        self.dp = None
        self.fb = None
        self.send = None
        if self.roles is not None:
            self.roles.disconnected()
        self._role_xids.clear()
        self._counter_reads.clear()
        self._meter_on, self._meter_read, self._catcher_read = False, None, None
        self.sweep.reset()
        self.operator.switch_gone()
        self._run(self.core.switch_disconnected())

    def _ours(self, msg: Any, what: str) -> bool:
        """A message of the served connection; anything else is counted and dropped."""
        if msg.datapath is self.dp and self.dp is not None:
            return True
        self.counters[f"openflow_ignored:{what}"] += 1
        self.rlog.warning(f"foreign-{what}", "ignored %s from %s: not the served switch connection", what,
                          getattr(msg.datapath, "address", ("?",))[0])
        return False

    @property
    def switch_connected(self) -> bool:
        return self.dp is not None

    # --- switch messages --------------------------------------------------------------------

    @set_ev_cls(ofp_event.EventOFPBarrierReply, MAIN_DISPATCHER)
    def _barrier_reply(self, ev: Any) -> None:
        if not self._ours(ev.msg, "barrier reply") or self.send is None:
            return
        batch = self.send.barrier_reply(ev.msg.xid)
        if batch is not None:
            self._settle(batch.conns, batch.failed)

    def _settle(self, conns: list[c.Conn], failed: dict[int, tuple[str, bool]]) -> None:
        now = time.monotonic()
        out: list[c.Command] = []
        for conn in conns:
            failure = failed.get(id(conn))
            if failure is None:
                out.extend(self.core.flows_confirmed(conn, now))
            else:
                out.extend(self.core.flows_failed(conn, *failure, now=now))
        self._run(out)

    # --- a pair's roles ------------------------------------------------------------------------

    def _role_request(self, req: RoleRequest) -> None:
        if self.dp is None:
            return
        msg = self.dp.ofproto_parser.OFPRoleRequest(self.dp, req.role, req.generation)
        self._role_xids.add(self.dp.set_xid(msg))
        self._queue(msg)
        self._flush()

    def _role_change(self, change: Change) -> None:
        roles = self.roles
        if roles is None:
            return
        if change.demoted is not None:
            self.counters["role_demotions"] += 1
            LOG.warning("no longer master of switch %016x (%s): standing by, the switch's pairs are the other "
                        "controller's now", self.dp.id if self.dp is not None else 0, change.demoted)
            if self.dp is not None:  # what was queued for the switch is not ours to send any more
                self.send = SendPath(self.dp, self.fb, self.cfg.flow_mod_rate, self.cfg.install_queue, self._wanted)
            self._run(self.core.stand_by())
        if change.promoted and self.dp is not None:
            self.counters["role_promotions"] += 1
            LOG.warning("master of switch %016x with generation %d: programming it (defaults to this firewall, "
                        "adopting the pairs on the switch)", self.dp.id, roles.generation)
            self._run(self.core.switch_connected(self.dp.ofproto.OFP_VERSION, self.fb.pipeline))
        if change.request is not None:
            self._role_request(change.request)

    @set_ev_cls(ofp_event.EventOFPRoleReply, MAIN_DISPATCHER)
    def _role_reply(self, ev: Any) -> None:
        msg = ev.msg
        if not self._ours(msg, "role reply") or self.roles is None:
            return
        self._role_xids.discard(msg.xid)
        LOG.debug("role reply: %s, generation %d", ROLE_NAMES.get(msg.role, msg.role), msg.generation_id)
        self._role_change(self.roles.reply(msg.role, msg.generation_id))

    def _role_error(self, msg: Any) -> bool:
        """A role request refused, or a message refused because we are slave; True: handled."""
        ofp = msg.datapath.ofproto
        if msg.xid in self._role_xids and msg.type == ofp.OFPET_ROLE_REQUEST_FAILED:
            self._role_xids.discard(msg.xid)
            if msg.code == ofp.OFPRRFC_STALE:
                LOG.warning("the switch refused this controller's role request as stale: a newer master holds it")
                self._role_change(self.roles.stale())  # type: ignore[union-attr]
            else:
                LOG.error("the switch refused the role request (code %d): it may not support controller roles; "
                          "this controller stays backup and programs nothing", msg.code)
            return True
        if msg.type == ofp.OFPET_BAD_REQUEST and msg.code == ofp.OFPBRC_IS_SLAVE:
            # A takeover we had not noticed yet: the switch refused what we sent.
            self._role_change(self.roles.refused_as_slave())  # type: ignore[union-attr]
        return False

    @set_ev_cls(ofp_event.EventOFPErrorMsg, [CONFIG_DISPATCHER, MAIN_DISPATCHER])
    def _error(self, ev: Any) -> None:
        msg = ev.msg
        if not self._ours(msg, "error"):
            return  # before the handshake or from a refused peer: no key per type and code
        self.counters[f"openflow_error:{msg.type}:{msg.code}"] += 1
        if self.roles is not None and self._role_error(msg):
            return
        reason = f"switch error type={msg.type} code={msg.code}"
        if msg.xid == self._table_xid:
            LOG.warning("the switch did not report its table size (%s): set max_shunts to what its table holds "
                        "(a pair takes up to %d entries)", reason, self.core.max_pair_entries())
            return
        if msg.xid in (self._meter_xid, self._meter_read and self._meter_read[0]):
            self._meter_on = False
            LOG.warning("the switch refused the packet-in rate limit (controller meter: %s): a host sending "
                        "FIN/RST segments can load the controller; on Open vSwitch set the Controller "
                        "record's controller_rate_limit instead", reason)
            return
        conn = self.send.error(msg.xid, reason, table_full(msg)) if self.send is not None else None
        if conn is not None:
            self.rlog.warning("refused-flow", "switch refused a flow of %s: %s", conn.describe(), reason)
        else:
            self.rlog.warning(f"error-{msg.type}-{msg.code}", "switch error for xid %s: %s", msg.xid, reason)

    @set_ev_cls(ofp_event.EventOFPPacketIn, MAIN_DISPATCHER)
    def _packet_in(self, ev: Any) -> None:
        """Only the TCP teardown catchers send packets here (OpenFlow 1.3), and only the
        headers: the switch forwarded the packet itself."""
        msg = ev.msg
        if not self._ours(msg, "packet-in"):
            return
        cookie = getattr(msg, "cookie", None)
        in_port = msg.match.get("in_port") if hasattr(msg.match, "get") else None
        if cookie is None or in_port is None:
            self._unexpected_packet_in("no cookie or in_port", cookie)
            return
        parsed = cookies.parse(cookie)
        if parsed is not None and parsed[0] is cookies.Kind.PIPELINE and parsed[2]:
            # A shared table-1 catcher: the metadata names the connection and direction.
            metadata = msg.match.get("metadata")
            if metadata is None:
                self._unexpected_packet_in("no metadata", cookie)
                return
            cookie = cookies.make_teardown(*metadata_teardown(metadata), cookies.is_rst(cookie))
        out = self.core.teardown_packet(cookie, in_port, time.monotonic())
        if out is None:
            self._unexpected_packet_in("no connection of ours", cookie)
            return
        self.counters["packet_in:teardown"] += 1
        self._run(out)

    def _unexpected_packet_in(self, reason: str, cookie: int | None) -> None:
        self.counters[f"packet_in:{reason}"] += 1
        self.rlog.warning(f"packet-in-{reason}", "unexpected packet-in (%s), cookie %s", reason,
                          "none" if cookie is None else f"0x{cookie:016x}")

    @set_ev_cls(ofp_event.EventOFPFlowRemoved, MAIN_DISPATCHER)
    def _flow_removed(self, ev: Any) -> None:
        m = ev.msg
        if not self._ours(m, "flow-removed"):
            return
        reason = REMOVED_REASONS.get(m.reason, f"reason {m.reason}")
        self._run(self.core.flow_removed(m.cookie, reason, m.packet_count, m.byte_count,
                                         m.duration_sec + m.duration_nsec / 1e9, time.monotonic()))

    @set_ev_cls(ofp_event.EventOFPFlowStatsReply, MAIN_DISPATCHER)
    def _flow_stats_reply(self, ev: Any) -> None:
        if not self._ours(ev.msg, "flow stats") or self.fb is None:
            return
        if self._catcher_read is not None and ev.msg.xid == self._catcher_read[0]:
            self._catchers_read(ev.msg)
            return
        read = self._counter_reads.get(ev.msg.xid)
        if read is not None:  # a new shunt's counters (confirm: counters)
            conn, packets = read
            for stats in ev.msg.body:
                reply = bool(stats.cookie & cookies.DIRECTION_BIT)
                packets[reply] = packets.get(reply, 0) + stats.packet_count
            if not self.fb.more_follows(ev.msg):
                del self._counter_reads[ev.msg.xid]
                self._run(self.core.counters_read(conn, packets, time.monotonic()))
            return
        status = self.operator.collecting(ev.msg.xid)  # an operator's request, or a reconcile
        collected = status if status is not None else self._flow_stats
        for stats in ev.msg.body:
            try:
                collected.append(self.fb.parse_stats(stats))
            except Exception as exc:  # an odd flow on the switch is not ours to crash on
                self.counters["openflow_malformed"] += 1
                LOG.warning("unreadable flow in stats reply: %s", exc)
        if self.fb.more_follows(ev.msg):
            return
        if status is not None:
            self.operator.answer_status(ev.msg.xid)
            return
        flows, self._flow_stats = self._flow_stats, []
        if self.core.reconciled:
            return  # a read asked for before this connection's reconcile, answered after it
        out = self.core.reconcile(flows, time.monotonic())
        if not self.core.reconciled:  # table 1 not (yet) all on the switch: read again
            self._run(out)
            return
        if self.core.pipeline_reads >= c.PIPELINE_READS:
            LOG.error("the switch still lacks table 1's flows %.0f s after they were sent: TCP shunts may have "
                      "their packets dropped there; set flow_layout single if it cannot hold them",
                      c.PIPELINE_READS * c.PIPELINE_READ_AGAIN)
        kinds = collections.Counter(type(cmd).__name__ for cmd in out)
        LOG.info("reconciled with the switch: %d NFShunt flows read, %d pairs held, %d re-installed, "
                 "%d flows deleted, %d pairs forgotten", len(flows), len(self.core.conns), kinds["InstallFlows"],
                 kinds["DeleteSwitchFlow"], kinds["Removed"])
        self._run(out)

    @set_ev_cls(ofp_event.EventOFPMeterStatsReply, MAIN_DISPATCHER)
    def _meter_stats(self, ev: Any) -> None:
        if not self._ours(ev.msg, "meter stats") or self._meter_read is None or ev.msg.xid != self._meter_read[0]:
            return
        self._meter_read = None
        ofp = ev.msg.datapath.ofproto
        dropped = sum(band.packet_band_count for meter in ev.msg.body if meter.meter_id == ofp.OFPM_CONTROLLER
                      for band in meter.band_stats)
        new = self.sweep.meter_read(dropped)
        if new:
            self.counters["packet_in_dropped"] += new
        if new and self.core.pipeline:
            # The shared catchers' counters cannot say which connections closed.
            self.rlog.warning("teardowns-untraceable", "the switch dropped %d teardown packet-ins (packet_in_rate "
                              "%d/s): in the pipeline layout their shunts end at the idle timeout (%d s); "
                              "flow_layout single finds them from per-connection catchers", new,
                              self.cfg.packet_in_rate, self.cfg.default_shunt_timeout)
        if self.fb is not None and not self.core.pipeline and self.sweep.due(time.monotonic()):
            msg = self.fb.catcher_stats_request()
            self._catcher_read = (self.dp.set_xid(msg), [])
            self._queue(msg)
            self._flush()

    def _catchers_read(self, msg: Any) -> None:
        """A part of the catcher read after dropped packet-ins (see teardown_sweep)."""
        assert self._catcher_read is not None and self.fb is not None
        counted = self._catcher_read[1]
        counted.extend(stats.cookie for stats in msg.body if stats.packet_count)
        if self.fb.more_follows(msg):
            return
        self._catcher_read = None
        self.sweep.swept()
        out, ended = self.core.catchers_counted(counted, time.monotonic())
        if ended:
            self.counters["teardowns_from_counters"] += ended
            self.rlog.warning("teardowns-from-counters", "the switch dropped teardown packet-ins (packet_in_rate "
                              "%d/s): %d shunts ended from their FIN/RST catchers' counters", self.cfg.packet_in_rate,
                              ended)
        self._run(out)

    @set_ev_cls(ofp_event.EventOFPTableFeaturesStatsReply, MAIN_DISPATCHER)
    def _table_features(self, ev: Any) -> None:
        if self._ours(ev.msg, "table features"):
            self._table_reported([(t.table_id, t.max_entries) for t in ev.msg.body])

    @set_ev_cls(ofp_event.EventOFPTableStatsReply, MAIN_DISPATCHER)
    def _table_stats(self, ev: Any) -> None:
        if self._ours(ev.msg, "table stats") and ev.msg.datapath.ofproto.OFP_VERSION == 1:
            self._table_reported([(t.table_id, t.max_entries) for t in ev.msg.body])

    def _table_reported(self, tables: list[tuple[int, int]]) -> None:
        for table_id, max_entries in tables:
            if table_id != 0:
                continue
            budget = self.core.table_size(max_entries)
            if budget is None:
                LOG.info("switch table 0 holds %d entries; max_shunts %d is the budget", max_entries,
                         self.cfg.max_shunts)
            else:
                LOG.info("switch table 0 holds %d entries: budget %d shunt and block pairs (max_shunts unset; "
                         "%d entries for the defaults, at most %d a pair)", max_entries, budget,
                         self.core.default_entries(), self.core.max_pair_entries())
            if budget:  # connections that waited for a budget the switch turned out to allow
                self._run(self.core.room_freed(max(0, budget - self.core.shunts - self.core.blocks)))

    # --- conntrack and timers ---------------------------------------------------------------

    @set_ev_cls(EventConntrack)
    def _conntrack(self, ev: EventConntrack) -> None:
        counters = self.counters
        out: list[c.Command] = []
        self._events_read += len(ev.events)
        for cev in ev.events:
            counters[EVENT_COUNTER[cev.kind]] += 1
            out.extend(self.core.conntrack_event(cev))
        if ev.dump:
            counters["conntrack_resyncs"] += 1
        self._run(out)

    @set_ev_cls(EventOverflow)
    def _overflow(self, ev: EventOverflow) -> None:
        self.counters["netlink_overflows"] += 1
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
        self._run(ev.commands)

    @set_ev_cls(EventTick)
    def _tick(self, ev: EventTick) -> None:
        now = time.monotonic()
        if self.send is not None:
            for batch in self.send.expired(now, PENDING_TIMEOUT):
                self.counters["install_timeouts"] += len(batch.conns)
                LOG.warning("the switch did not answer a barrier within %.0f s: %d installs rolled back",
                            PENDING_TIMEOUT, len(batch.conns))
                self._settle(batch.conns, {id(conn): ("no answer from the switch", False) for conn in batch.conns})
        pair = self.cfg.pair
        if self.roles is not None and pair is not None and self.dp is not None and \
                now - self._role_checked >= pair.role_check_interval:
            self._role_checked = now
            check = self.roles.check()  # no role status in OpenFlow 1.3: ask whether we are still master
            if check is not None:
                self._role_request(check)
        if self._meter_on and self.fb is not None and (self._meter_read is None or
                                                        now - self._meter_read[1] > METER_READ_TIMEOUT):
            msg = self.fb.controller_meter_stats_request()
            self._meter_read = (self.dp.set_xid(msg), now)
            self._queue(msg)
        self._run(self.core.tick(now))
        busy = self.send is not None and self.send.pending() > 0
        if self.trimmer.tick(self._events_read, busy):
            LOG.debug("returned the memory of a settled burst to the system (malloc_trim)")
        flush_all()  # batched log lines are at most a second late

    @set_ev_cls(EventShutdown)
    def _shutdown(self, ev: EventShutdown) -> None:
        removals = self.core.stopping()  # from here on nothing new is installed
        if self.fb is None or not self.cfg.delete_flows_on_shutdown:
            ev.done.set()
            return
        for cmd in removals:
            self._queue(*self.fb.remove(cmd.conn, cmd.directions))
        LOG.info("shutting down: removing %d shunts and blocks (delete_flows_on_shutdown)", len(removals))
        self._flush(waiter=ev.done)

    # --- the one send path ---------------------------------------------------------------------

    def _run(self, commands: Iterable[c.Command]) -> None:
        """Execute the core's commands (and what executing them brings back from the core),
        then flush the batch to the switch."""
        work = collections.deque(commands)
        if self.send is not None and self.send.queued:
            work.extend(self._release())
        while work:
            cmd = work.popleft()
            try:
                follow = self._execute(cmd)
            except Exception:
                self.counters["internal_errors"] += 1
                LOG.exception("failed to execute %s", type(cmd).__name__)
                continue
            if follow:
                work.extend(follow)
        self._flush()

    def _release(self) -> list[c.Command]:
        """Paced installs whose turn has come go out; the queue's freed room goes to
        connections that waited for it."""
        send = self.send
        before = len(send.queued)
        out: list[c.Command] = []
        for conn in send.release(time.monotonic()):
            out.extend(self.core.install_dropped(conn, "taken down before it was sent", wait=False))
        drained = before - len(send.queued)
        if drained and self.core.waiting:
            out.extend(self.core.room_freed(min(drained, send.queue_max - len(send.queued))))
        return out

    def _wanted(self, conn: c.Conn) -> bool:
        """A queued install the core still wants sent."""
        return self.core.conns.get(conn.orig) is conn and conn.state is c.State.PENDING and conn.remove_reason is None

    def _execute(self, cmd: c.Command) -> list[c.Command] | None:
        fb = self.fb
        if isinstance(cmd, c.Ignored):
            key = IGNORED_KEYS.get(cmd.reason)
            if key is None:
                key = IGNORED_KEYS[cmd.reason] = f"ignored:{cmd.reason}"
            self.counters[key] += 1
            if LOG.isEnabledFor(logging.DEBUG):
                LOG.debug("ignored %s %s ct_id=%d mark=0x%08x: %s", cmd.event.kind.value,
                          cmd.event.orig, cmd.event.ct_id, cmd.event.mark, cmd.reason)
        elif isinstance(cmd, c.InstallFlows):
            if self.send is not None and not self.send.install(cmd.conn):
                self.counters["install_queue_full"] += 1
                return self.core.install_dropped(cmd.conn, "flow-mod queue full", wait=True)
            conn = cmd.conn
            if conn.action == "shunt" and conn.orig.proto == TCP:
                # The switch applies the pair's flows one at a time (hardware: late, in any
                # order): the firewall must not call INVALID the acknowledgements it then
                # sees of data that already took the fast path.
                self.worker.liberal(conn.orig.family, conn.orig, conn.ct_id)
        elif isinstance(cmd, c.DeleteConntrack):
            self.worker.delete(cmd.family, cmd.orig, cmd.ct_id)
        elif isinstance(cmd, c.Installed):
            self.counters[f"installed:{cmd.conn.action}"] += 1
            self.metrics.observe_latency(cmd.conn.action, cmd.latency)
            LOG.info("%s %s in %.2f ms", cmd.conn.action, cmd.conn.describe(), cmd.latency * 1000,
                     extra={"fields": conn_fields(cmd.conn, "installed", latency_ms=round(cmd.latency * 1000, 3))})
        elif isinstance(cmd, c.Refused):
            self.counters[f"refused:{cmd.conn.action}"] += 1
            LOG.warning("%s refused, stays on the slow path: %s: %s", cmd.conn.action,
                        cmd.conn.describe(), cmd.reason)
        elif isinstance(cmd, c.Removed):
            self.counters[f"removed:{cmd.conn.action}:{cmd.reason}"] += 1
            stats = (cmd.conn.stats or {}).values()
            pk = sum(s[0] for s in stats)
            by = sum(s[1] for s in stats)
            LOG.info("%s removed (%s): %s, %d packets %d bytes", cmd.conn.action, cmd.reason,
                     cmd.conn.describe(), pk, by,
                     extra={"fields": conn_fields(cmd.conn, "removed", reason=cmd.reason, packets=pk, bytes=by)})
            if self.audit.handlers:
                self.audit.info(json.dumps(audit_record(cmd.conn, cmd.reason)))
        elif isinstance(cmd, c.RemoveFlows):
            if fb is not None:
                self._queue(*fb.remove(cmd.conn, cmd.directions))
        elif isinstance(cmd, c.InstallDefaults):
            if fb is not None:
                self._queue(*fb.defaults(cmd.groups))
                LOG.info("default slow-path flows installed for %d port groups", len(cmd.groups))
        elif isinstance(cmd, c.InstallPipeline):
            if fb is not None:
                self._queue(*fb.pipeline_flows(cmd.groups))
        elif isinstance(cmd, c.LimitPacketIns):
            if fb is not None:
                delete, add = fb.controller_meter(cmd.rate)
                self._queue(delete)
                self._meter_xid = self.dp.set_xid(add)
                self._queue(add)
                self._meter_on = True
        elif isinstance(cmd, c.DeleteAllFlows):
            if fb is not None:
                self._queue(fb.delete_all())
                LOG.warning("deleting every flow on the switch (delete_foreign_flows_on_startup)")
        elif isinstance(cmd, c.DeleteSwitchFlow):
            if fb is not None:
                self._queue(fb.delete_switch_flow(cmd.flow))
                self.counters["reconcile_deleted"] += 1
                LOG.info("deleting switch flow cookie=0x%016x: %s", cmd.flow.cookie, cmd.reason)
        elif isinstance(cmd, c.RequestTableSize):
            if fb is not None:
                msg = fb.table_size_request()
                self._table_xid = self.dp.set_xid(msg)
                self._queue(msg)
        elif isinstance(cmd, c.RequestSwitchFlows):
            if fb is not None:
                self._queue(fb.owned_flow_stats_request())
        elif isinstance(cmd, c.ResyncConntrack):
            self.worker.dump()
        elif isinstance(cmd, c.EntryDue):
            return self.core.entry_due(cmd.conn, time.monotonic())
        elif isinstance(cmd, c.ReadCounters):
            if fb is not None:
                msg = fb.pair_stats_request(cmd.conn)
                self._counter_reads[self.dp.set_xid(msg)] = (cmd.conn, {})
                self._queue(msg)
        elif isinstance(cmd, c.Later):
            with self._later_lock:
                self._later_seq += 1  # ties never compare the commands
                heapq.heappush(self._later, (time.monotonic() + cmd.delay, self._later_seq, cmd.commands))
        elif isinstance(cmd, c.RestoreConntrack):
            conn = cmd.conn
            self.counters["teardowns" if cmd.tcp_state != c.CT_TCP_ESTABLISHED else "reevaluations"] += 1
            then = cmd.then
            self.worker.restore(conn.orig.family, conn.orig, conn.reply, cmd.tcp_state, cmd.timeout,
                                cmd.closer_is_reply, cmd.mark, lambda: self.send_event(self.name, EventRun(then)))

    def _queue(self, *msgs: Any) -> None:
        if self.send is not None:
            self.send.queue(list(msgs))

    def _flush(self, waiter: threading.Event | None = None) -> None:
        if self.send is not None:
            self.send.flush(waiter)
        elif waiter is not None:
            waiter.set()
