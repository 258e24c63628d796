"""The os-ken application: the one thread where conntrack events, switch messages and
timers meet the decision core, and the one send path to the switch.

Every input arrives as an os-ken event on this app's queue and is handled on its event
loop thread, so the core needs no locks. Commands from the core are turned into
OpenFlow messages, concatenated, and written with a single barrier per batch; the
barrier reply is what confirms a shunt or block.
"""
from __future__ import annotations

import collections
import logging
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
from .flows import REMOVED_REASONS, FlowBuilder
from .model import ConnEvent, EventKind, SwitchFlow

LOG = logging.getLogger("nfshunt")


EVENT_COUNTER = {k: f"conntrack_event:{k.value}" for k in EventKind}  # no per-event formatting


class EventConntrack(event.EventBase):
    def __init__(self, events: list[ConnEvent], dump: bool = False):
        super().__init__()
        self.events = events
        self.dump = dump


class EventOverflow(event.EventBase):
    pass


class EventTick(event.EventBase):
    pass


class EventShutdown(event.EventBase):
    def __init__(self, done: threading.Event):
        super().__init__()
        self.done = done


class Counters(collections.Counter):
    """Plain counters, keyed by name; read by logs and the status/metrics layers."""


def conn_fields(conn: c.Conn, event: str, **more: Any) -> dict[str, Any]:
    """A connection as structured log fields (JSON logs, experiments, accounting)."""
    o = conn.orig
    return {"event": event, "action": conn.action, "ct_id": conn.ct_id, "proto": o.proto, "src": o.src,
            "dst": o.dst, "sport": o.sport, "dport": o.dport, "ingress": conn.ingress.physdevin,
            "egress": conn.egress.physdevin, **more}


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
        self._install_xid: dict[int, c.Conn] = {}
        self._barriers: dict[int, list[c.Conn]] = {}
        self._barrier_waiters: dict[int, threading.Event] = {}
        self._failed: dict[int, str] = {}  # id(conn) -> switch error
        self._flow_stats: list[SwitchFlow] = []
        self._running = True
        self.worker = ConntrackWorker(on_dump=self._post_dump, on_malformed=self._malformed)
        self.listener = ConntrackListener(self.cfg.netlink_rcvbuf, self._post_events,
                                          self._post_overflow, self._malformed)

    # --- threads feeding the event loop --------------------------------------------------

    def start(self) -> Any:
        super().start()
        self.worker.start()
        self.listener.start()
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
            self._install_xid.clear()
            self._barriers.clear()
            self._failed.clear()
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
        conns = self._barriers.pop(xid, None)
        if not conns:
            return
        now = time.monotonic()
        out: list[c.Command] = []
        for conn in conns:
            reason = self._failed.pop(id(conn), None)
            if reason is None:
                out.extend(self.core.flows_confirmed(conn, now))
            else:
                out.extend(self.core.flows_failed(conn, reason))
        self._run(out)

    @set_ev_cls(ofp_event.EventOFPErrorMsg, [CONFIG_DISPATCHER, MAIN_DISPATCHER])
    def _error(self, ev: Any) -> None:
        msg = ev.msg
        self.counters[f"openflow_error:{msg.type}:{msg.code}"] += 1
        conn = self._install_xid.pop(msg.xid, None)
        reason = f"switch error type={msg.type} code={msg.code}"
        if conn is not None:
            self._failed[id(conn)] = reason
            LOG.warning("switch refused a flow of %s: %s", conn.describe(), reason)
        else:
            LOG.warning("switch error for xid %s: %s", msg.xid, reason)

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
        for stats in ev.msg.body:
            try:
                self._flow_stats.append(self.fb.parse_stats(stats))
            except Exception as exc:  # an odd flow on the switch is not ours to crash on
                self.counters["openflow_malformed"] += 1
                LOG.warning("unreadable flow in stats reply: %s", exc)
        if self.fb.more_follows(ev.msg):
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

    @set_ev_cls(EventTick)
    def _tick(self, ev: EventTick) -> None:
        self._run(self.core.tick(time.monotonic()))

    @set_ev_cls(EventShutdown)
    def _shutdown(self, ev: EventShutdown) -> None:
        if self.fb is None or not self.cfg.delete_flows_on_shutdown:
            ev.done.set()
            return
        conns = list(self.core.conns.values())
        for conn in conns:
            self._out.extend(self.fb.remove(conn, (False, True)))
        LOG.info("shutting down: removing %d shunts and blocks (delete_flows_on_shutdown)", len(conns))
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
            self.counters[f"ignored:{cmd.reason}"] += 1
            if LOG.isEnabledFor(logging.DEBUG):
                LOG.debug("ignored %s %s ct_id=%d mark=0x%08x: %s", cmd.event.kind.value,
                          cmd.event.orig, cmd.event.ct_id, cmd.event.mark, cmd.reason)
        elif isinstance(cmd, c.InstallFlows):
            if fb is None:
                return
            for msg in fb.install(cmd.conn):
                self._out.append(msg)
                self._install_xid[self.dp.set_xid(msg)] = cmd.conn
            self._batch.append(cmd.conn)
        elif isinstance(cmd, c.DeleteConntrack):
            self.worker.delete(cmd.family, cmd.orig, cmd.ct_id)
        elif isinstance(cmd, c.Installed):
            self.counters[f"installed:{cmd.conn.action}"] += 1
            LOG.info("%s %s in %.2f ms", cmd.conn.action, cmd.conn.describe(), cmd.latency * 1000,
                     extra={"fields": conn_fields(cmd.conn, "installed", latency_ms=round(cmd.latency * 1000, 3))})
        elif isinstance(cmd, c.Refused):
            self.counters[f"refused:{cmd.conn.action}"] += 1
            LOG.warning("%s refused, stays on the slow path: %s: %s", cmd.conn.action,
                        cmd.conn.describe(), cmd.reason)
        elif isinstance(cmd, c.Removed):
            self.counters[f"removed:{cmd.conn.action}:{cmd.reason}"] += 1
            pk = sum(s[0] for s in cmd.conn.stats.values())
            by = sum(s[1] for s in cmd.conn.stats.values())
            LOG.info("%s removed (%s): %s, %d packets %d bytes", cmd.conn.action, cmd.reason,
                     cmd.conn.describe(), pk, by,
                     extra={"fields": conn_fields(cmd.conn, "removed", reason=cmd.reason, packets=pk, bytes=by)})
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
                self._barriers[xid] = self._batch
                self._batch = []
            if waiter is not None:
                self._barrier_waiters[xid] = waiter
        dp.send(bytes(buf))
