"""The os-ken application: the one thread where conntrack events, switch messages and
timers meet the decision core, and the one send path to the switch.

Every input arrives as an os-ken event on this app's queue and is handled on its event
loop thread, so the core needs no locks. Commands from the core are turned into
OpenFlow messages, concatenated, and written with a single barrier per batch; the
barrier reply is what confirms a shunt or block.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from typing import Any, Iterable

from os_ken.base import app_manager
from os_ken.controller import event, ofp_event
from os_ken.controller.handler import (CONFIG_DISPATCHER, DEAD_DISPATCHER, MAIN_DISPATCHER,
                                       set_ev_cls)
from os_ken.lib import hub

from . import core as c
from .config import Config
from .conntrack import ConntrackListener, ConntrackWorker
from .control import ControlServer, parse_tuple
from .logs import BatchedFileHandler, flush_all
from .metrics import Metrics
from .flows import REMOVED_REASONS, FlowBuilder
from .model import ConnEvent, EventKind, FlowTuple, SwitchFlow

LOG = logging.getLogger("nfshunt")


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


class EventControl(event.EventBase):
    """A control-socket request, answered on the event loop."""

    def __init__(self, request: dict[str, Any]):
        super().__init__()
        self.request = request
        self.reply: dict[str, Any] = {}
        self.done = threading.Event()

    def answer(self, reply: dict[str, Any]) -> None:
        self.reply = reply
        self.done.set()


class Counters(collections.Counter):
    """Plain counters, keyed by name; read by logs and the status/metrics layers."""


def conn_fields(conn: c.Conn, event: str, **more: Any) -> dict[str, Any]:
    """A connection as structured log fields (JSON logs, experiments, accounting)."""
    o = conn.orig
    return {"event": event, "action": conn.action, "ct_id": conn.ct_id, "proto": o.proto, "src": o.src,
            "dst": o.dst, "sport": o.sport, "dport": o.dport, "ingress": conn.ingress.physdevin,
            "egress": conn.egress.physdevin, **more}


def audit_record(conn: c.Conn, reason: str) -> dict[str, Any]:
    """The accounting line for a removed pair: shunted bytes never reach iptables' counters."""
    stats = conn.stats or {}
    fwd, rev = stats.get(False), stats.get(True)
    durations = [s[2] for s in (fwd, rev) if s]
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1000) % 1000:03d}Z",
            **conn_fields(conn, "removed", reason=reason),
            "switch_ports": [conn.ingress.fast, conn.egress.fast],
            "duration": round(max(durations), 3) if durations else None,
            "orig_packets": fwd[0] if fwd else None, "orig_bytes": fwd[1] if fwd else None,
            "reply_packets": rev[0] if rev else None, "reply_bytes": rev[1] if rev else None,
            "packets": sum(s[0] for s in (fwd, rev) if s), "bytes": sum(s[1] for s in (fwd, rev) if s)}


def _audit_logger(path: str | None) -> logging.Logger:
    """One JSON line per removed pair, batched; a file logrotate moved is reopened."""
    audit = logging.getLogger("nfshunt.audit")
    audit.propagate = False
    audit.setLevel(logging.INFO)
    for handler in list(audit.handlers):
        audit.removeHandler(handler)
    if path:
        os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
        handler = BatchedFileHandler(path)
        handler.setFormatter(logging.Formatter("%(message)s"))
        audit.addHandler(handler)
    return audit


class NFShuntApp(app_manager.OSKenApp):
    OFP_VERSIONS: list[int] = []  # set from the config by controller.run() before start

    def __init__(self, *args: Any, nfshunt_config: Config, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.cfg = nfshunt_config
        self.core = c.Core(self.cfg)
        self.counters = Counters()
        self.dp: Any = None
        self.fb: FlowBuilder | None = None
        self._out: list[Any] = []  # messages waiting for flush()
        self._batch: list[c.Conn] = []  # installs waiting for the next barrier
        self._batch_xids: list[int] = []  # their flow-mods' xids
        self._install_xid: dict[int, c.Conn] = {}  # until the batch's barrier reply: errors name xids
        self._barriers: dict[int, tuple[list[c.Conn], list[int]]] = {}
        self._barrier_waiters: dict[int, threading.Event] = {}
        self._failed: dict[int, tuple[str, bool]] = {}  # id(conn) -> (switch error, table full)
        self._flow_stats: list[SwitchFlow] = []
        self._stats_requests: dict[int, tuple[list[SwitchFlow], EventControl]] = {}  # status requests
        self._running = True
        self.started = time.time()
        self.control: ControlServer | None = None
        self.metrics = Metrics(self._metrics_snapshot)
        self.audit = _audit_logger(self.cfg.audit_log)
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
        while self._running:
            time.sleep(1.0)
            self.send_event(self.name, EventTick())

    def _post_events(self, events: list[ConnEvent]) -> None:
        self.send_event(self.name, EventConntrack(events))

    def _post_dump(self, events: list[ConnEvent]) -> None:
        self.send_event(self.name, EventConntrack(events, dump=True))

    def _post_overflow(self) -> None:
        self.send_event(self.name, EventOverflow())

    def _malformed(self, what: str) -> None:
        # Called from the listener thread; Counter increments are atomic enough for stats.
        self.counters["netlink_malformed"] += 1
        LOG.warning("skipped malformed conntrack message: %s", what)

    def close(self) -> None:
        self._running = False
        self.metrics.stop()
        if self.control is not None:
            self.control.stop()

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
        return {"counters": counters, "shunts": core.shunts, "blocks": core.blocks, "waiting": len(core.waiting),
                "connected": 1 if self.dp is not None else 0, "max_shunts": self.cfg.max_shunts}
        self.listener.stop()
        self.worker.stop()

    # --- switch lifecycle -----------------------------------------------------------------

    @set_ev_cls(ofp_event.EventOFPStateChange, [MAIN_DISPATCHER, DEAD_DISPATCHER])
    def _state_change(self, ev: Any) -> None:
        dp = ev.datapath
        if ev.state == MAIN_DISPATCHER:
            if self.dp is not None and self.dp is not dp:
                LOG.error("switch %016x connected while %016x is served; refusing it", dp.id or 0, self.dp.id)
                dp.close()
                return
            if self.cfg.datapath_id is not None and dp.id != self.cfg.datapath_id:
                LOG.error("switch %016x is not the configured datapath_id %016x; refusing it",
                          dp.id or 0, self.cfg.datapath_id)
                dp.close()
                return
            self.dp = dp
            self.fb = FlowBuilder(dp, self.cfg)
            self.counters["switch_connects"] += 1
            LOG.info("switch %016x connected from %s:%s, OpenFlow %s", dp.id, dp.address[0],
                     dp.address[1], "1.0" if dp.ofproto.OFP_VERSION == 1 else "1.3")
            self._flow_stats = []
            self._run(self.core.switch_connected(dp.ofproto.OFP_VERSION))
        elif ev.state == DEAD_DISPATCHER and dp is self.dp:
            LOG.warning("switch %016x disconnected", dp.id or 0)
            self.dp = None
            self.fb = None
            self._out.clear()
            self._batch.clear()
            self._batch_xids.clear()
            self._install_xid.clear()
            self._barriers.clear()
            self._failed.clear()
            for _, request in self._stats_requests.values():
                request.answer(self._status(None))
            self._stats_requests.clear()
            self._run(self.core.switch_disconnected())

    @property
    def switch_connected(self) -> bool:
        return self.dp is not None

    # --- switch messages --------------------------------------------------------------------

    @set_ev_cls(ofp_event.EventOFPBarrierReply, MAIN_DISPATCHER)
    def _barrier_reply(self, ev: Any) -> None:
        xid = ev.msg.xid
        waiter = self._barrier_waiters.pop(xid, None)
        if waiter is not None:
            waiter.set()
        batch = self._barriers.pop(xid, None)
        if not batch:
            return
        conns, xids = batch
        for x in xids:  # every error of the batch came before its barrier reply
            self._install_xid.pop(x, None)
        now = time.monotonic()
        out: list[c.Command] = []
        for conn in conns:
            failure = self._failed.pop(id(conn), None)
            if failure is None:
                out.extend(self.core.flows_confirmed(conn, now))
            else:
                out.extend(self.core.flows_failed(conn, *failure, now=now))
        self._run(out)

    @set_ev_cls(ofp_event.EventOFPErrorMsg, [CONFIG_DISPATCHER, MAIN_DISPATCHER])
    def _error(self, ev: Any) -> None:
        msg = ev.msg
        self.counters[f"openflow_error:{msg.type}:{msg.code}"] += 1
        conn = self._install_xid.pop(msg.xid, None)
        reason = f"switch error type={msg.type} code={msg.code}"
        if conn is not None:
            self._failed[id(conn)] = (reason, self._table_full(msg))
            LOG.warning("switch refused a flow of %s: %s", conn.describe(), reason)
        else:
            LOG.warning("switch error for xid %s: %s", msg.xid, reason)

    def _table_full(self, msg: Any) -> bool:
        ofp = msg.datapath.ofproto
        if ofp.OFP_VERSION == 1:
            return msg.type == ofp.OFPET_FLOW_MOD_FAILED and msg.code == ofp.OFPFMFC_ALL_TABLES_FULL
        return msg.type == ofp.OFPET_FLOW_MOD_FAILED and msg.code == ofp.OFPFMFC_TABLE_FULL

    @set_ev_cls(ofp_event.EventOFPPacketIn, MAIN_DISPATCHER)
    def _packet_in(self, ev: Any) -> None:
        """Only the TCP teardown catchers send packets here (OpenFlow 1.3)."""
        msg = ev.msg
        cookie = getattr(msg, "cookie", None)
        in_port = msg.match.get("in_port") if hasattr(msg.match, "get") else None
        if cookie is None or in_port is None or not msg.data:
            self.counters["packet_in_unexpected"] += 1
            return
        out = self.core.teardown_packet(cookie, in_port, bytes(msg.data), time.monotonic())
        if not out:
            self.counters["packet_in_unexpected"] += 1
        self._run(out)

    @set_ev_cls(ofp_event.EventOFPFlowRemoved, MAIN_DISPATCHER)
    def _flow_removed(self, ev: Any) -> None:
        m = ev.msg
        reason = REMOVED_REASONS.get(m.reason, f"reason {m.reason}")
        self._run(self.core.flow_removed(m.cookie, reason, m.packet_count, m.byte_count,
                                         m.duration_sec + m.duration_nsec / 1e9, time.monotonic()))

    @set_ev_cls(ofp_event.EventOFPFlowStatsReply, MAIN_DISPATCHER)
    def _flow_stats_reply(self, ev: Any) -> None:
        if self.fb is None or ev.msg.datapath is not self.dp:
            return
        status = self._stats_requests.get(ev.msg.xid)  # an operator's request, or a reconcile
        collected = status[0] if status is not None else self._flow_stats
        for stats in ev.msg.body:
            try:
                collected.append(self.fb.parse_stats(stats))
            except Exception as exc:  # an odd flow on the switch is not ours to crash on
                self.counters["openflow_malformed"] += 1
                LOG.warning("unreadable flow in stats reply: %s", exc)
        if self.fb.more_follows(ev.msg):
            return
        if status is not None:
            del self._stats_requests[ev.msg.xid]
            status[1].answer(self._status(collected))
            return
        flows, self._flow_stats = self._flow_stats, []
        self._run(self.core.reconcile(flows, time.monotonic()))

    # --- conntrack and timers ---------------------------------------------------------------

    @set_ev_cls(EventConntrack)
    def _conntrack(self, ev: EventConntrack) -> None:
        counters = self.counters
        out: list[c.Command] = []
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

    # --- control socket ------------------------------------------------------------------

    def _control_request(self, request: dict[str, Any]) -> dict[str, Any]:
        """On the control server's thread: hand over to the event loop and wait."""
        ev = EventControl(request)
        self.send_event(self.name, ev)
        if not ev.done.wait(5.0):
            return {"error": "the controller did not answer within 5 s"}
        return ev.reply

    @set_ev_cls(EventControl)
    def _control(self, ev: EventControl) -> None:
        req = ev.request
        cmd = req.get("cmd")
        now = time.monotonic()
        if cmd == "status":
            if req.get("connections") is False:  # counts only: cheap with 100k shunts
                ev.answer(self._status(None, connections=False))
                return
            if self.dp is None or self.fb is None:
                ev.answer(self._status(None))
                return
            msg = self.fb.owned_flow_stats_request()
            xid = self.dp.set_xid(msg)
            self._stats_requests[xid] = ([], ev)
            self._out.append(msg)
            self._flush()
            return
        if cmd == "flush":
            reason = str(req.get("reason") or "flush by operator")
            out = self.core.flush(reason, now)
            self.counters["operator_flush"] += 1
            LOG.warning("operator flush (%s): taking down %d shunts and blocks", reason, len(out))
            self._run(out)
            ev.answer({"ok": True, "removed": len(out)})
            return
        if cmd in ("unshunt", "block"):
            try:
                orig = self._target(req)
            except ValueError as exc:
                ev.answer({"error": str(exc)})
                return
            out = self.core.pin(orig, "ignore" if cmd == "unshunt" else "block", now)
            self.counters[f"operator_{cmd}"] += 1
            LOG.warning("operator %s of %s", cmd, orig)
            self._run(out)
            ev.answer({"ok": True, "tuple": str(orig), "flows_removed": any(isinstance(c_, c.RemoveFlows) for c_ in out)})
            return
        ev.answer({"error": f"unknown command {cmd!r} (status, flush, unshunt, block)"})

    def _target(self, req: dict[str, Any]) -> FlowTuple:
        if "tuple" in req:
            return parse_tuple(str(req["tuple"]))
        ct_id = req.get("ct_id")
        if isinstance(ct_id, bool) or not isinstance(ct_id, int):
            raise ValueError("give 'tuple' or an integer 'ct_id'")
        conn = self.core.find(ct_id=ct_id)
        if conn is None:
            raise ValueError(f"no shunt or block with conntrack id {ct_id}; give the tuple instead")
        return conn.orig

    def _status(self, flows: list[SwitchFlow] | None, connections: bool = True) -> dict[str, Any]:
        by_cookie = {f.cookie: f for f in flows or []}
        now = time.monotonic()
        conns = []
        for conn in self.core.conns.values() if connections else ():
            dirs = [by_cookie.get(conn.cookie(r)) for r in (False, True)]
            conns.append({
                **conn_fields(conn, "status"), "state": conn.state.value, "tuple": str(conn.orig),
                "switch_ports": [conn.ingress.fast, conn.egress.fast],
                "age": round(now - (conn.confirmed_time or conn.event_time), 3),
                "packets": [d.packets if d else None for d in dirs],
                "bytes": [d.bytes if d else None for d in dirs]})
        dp = self.dp
        return {
            "switch": {"connected": dp is not None,
                       "datapath_id": f"{dp.id:016x}" if dp is not None and dp.id is not None else None,
                       "openflow": None if dp is None else ("1.0" if dp.ofproto.OFP_VERSION == 1 else "1.3"),
                       "address": None if dp is None else f"{dp.address[0]}:{dp.address[1]}"},
            "uptime": round(time.time() - self.started, 1),
            "shunts": self.core.shunts, "blocks": self.core.blocks, "waiting": len(self.core.waiting),
            "max_shunts": self.cfg.max_shunts, "flow_stats": flows is not None,
            "counters": dict(self.counters), "connections": conns}

    @set_ev_cls(EventRun)
    def _run_later(self, ev: "EventRun") -> None:
        self._run(ev.commands)

    @set_ev_cls(EventTick)
    def _tick(self, ev: EventTick) -> None:
        self._run(self.core.tick(time.monotonic()))
        flush_all()  # batched log lines are at most a second late

    @set_ev_cls(EventShutdown)
    def _shutdown(self, ev: EventShutdown) -> None:
        removals = self.core.stopping()  # from here on nothing new is installed
        if self.fb is None or not self.cfg.delete_flows_on_shutdown:
            ev.done.set()
            return
        for cmd in removals:
            self._out.extend(self.fb.remove(cmd.conn, cmd.directions))
        LOG.info("shutting down: removing %d shunts and blocks (delete_flows_on_shutdown)", len(removals))
        self._flush(waiter=ev.done)

    # --- the one send path ---------------------------------------------------------------------

    def _run(self, commands: Iterable[c.Command]) -> None:
        """Execute the core's commands, then flush the batch to the switch."""
        for cmd in commands:
            try:
                self._execute(cmd)
            except Exception:
                self.counters["internal_errors"] += 1
                LOG.exception("failed to execute %s", type(cmd).__name__)
        self._flush()

    def _execute(self, cmd: c.Command) -> None:
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
            if fb is None:
                return
            for msg in fb.install(cmd.conn):
                self._out.append(msg)
                x = self.dp.set_xid(msg)
                self._install_xid[x] = cmd.conn
                self._batch_xids.append(x)
            self._batch.append(cmd.conn)
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
                self._out.extend(fb.remove(cmd.conn, cmd.directions))
        elif isinstance(cmd, c.InstallDefaults):
            if fb is not None:
                self._out.extend(fb.defaults(cmd.groups))
                LOG.info("default slow-path flows installed for %d port groups", len(cmd.groups))
        elif isinstance(cmd, c.DeleteAllFlows):
            if fb is not None:
                self._out.append(fb.delete_all())
                LOG.warning("deleting every flow on the switch (delete_foreign_flows_on_startup)")
        elif isinstance(cmd, c.DeleteSwitchFlow):
            if fb is not None:
                self._out.append(fb.delete_switch_flow(cmd.flow))
                self.counters["reconcile_deleted"] += 1
                LOG.info("deleting switch flow cookie=0x%016x: %s", cmd.flow.cookie, cmd.reason)
        elif isinstance(cmd, c.RequestSwitchFlows):
            if fb is not None:
                self._out.append(fb.owned_flow_stats_request())
        elif isinstance(cmd, c.ResyncConntrack):
            self.worker.dump()
        elif isinstance(cmd, c.ForwardPacket):
            if fb is not None:
                self._out.append(fb.packet_out(cmd.data, cmd.in_port, cmd.out_port))
                self.counters["teardown_packets_forwarded"] += 1
        elif isinstance(cmd, c.RestoreConntrack):
            conn = cmd.conn
            self.counters["teardowns"] += 1
            then = cmd.then
            self.worker.restore(conn.orig.family, conn.orig, conn.reply, cmd.tcp_state, cmd.timeout,
                                cmd.closer_is_reply, conn.event.mark if conn.event else 0,
                                lambda: self.send_event(self.name, EventRun(then)))

    def _flush(self, waiter: threading.Event | None = None) -> None:
        dp = self.dp
        if dp is None or (not self._out and waiter is None):
            self._out.clear()
            return
        buf = bytearray()
        for msg in self._out:
            if msg.xid is None:
                dp.set_xid(msg)
            msg.serialize()
            buf += msg.buf
        self._out.clear()
        if self._batch or waiter is not None:
            barrier = self.fb.barrier()
            xid = dp.set_xid(barrier)
            barrier.serialize()
            buf += barrier.buf
            if self._batch:
                self._barriers[xid] = (self._batch, self._batch_xids)
                self._batch, self._batch_xids = [], []
            if waiter is not None:
                self._barrier_waiters[xid] = waiter
        dp.send(bytes(buf))
