"""The dispatcher: one handler for each command type the core returns.

A command acts on the switch (through its send path: flow-mods, requests), on the
kernel (through the conntrack worker), on time (a timer), or reports an outcome
(accounting.Outcomes). A handler may return commands of its own (a core answer), which
the caller runs in the same turn. A new kind of command adds one handler here.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from . import commands as c
from .accounting import Outcomes
from .conntrack import ConntrackWorker
from .flows import ALL_ONES_64
from .connection import CT_TCP_ESTABLISHED, Action
from .markcodec import DECISION_MASK
from .model import TCP
from .switch import Asked, CounterRead, Switch

LOG = logging.getLogger("nfshunt")

Handler = Callable[[Switch, Any], "list[c.Command] | None"]
Schedule = Callable[[float, Switch, tuple[c.Command, ...]], None]
Post = Callable[[Switch, tuple[c.Command, ...]], None]


class Dispatcher:
    def __init__(self, worker: ConntrackWorker, outcomes: Outcomes, schedule: Schedule, post: Post):
        self.worker = worker
        self.outcomes = outcomes
        self.counters = outcomes.counters
        self.schedule = schedule  # run commands after a delay (the app's timer)
        self.post = post  # run commands on the event loop from another thread
        report = {t: (lambda _sw, cmd, h=h: h(cmd)) for t, h in outcomes.handlers.items()}
        self.handlers: dict[type, Handler] = {
            **report,
            c.InstallFlows: self.install_flows,
            c.RemoveFlows: self.remove_flows,
            c.InstallDefaults: self.install_defaults,
            c.InstallPipeline: lambda sw, cmd: self.send(sw, *sw.fb.pipeline_flows(cmd.groups)),
            c.LimitPacketIns: self.limit_packet_ins,
            c.DeleteAllFlows: self.delete_all_flows,
            c.DeleteSwitchFlow: self.delete_switch_flow,
            c.RequestTableSize: self.request_table_size,
            c.RequestSwitchFlows: lambda sw, _cmd: self.send(sw, sw.fb.owned_flow_stats_request()),
            c.ReadCounters: self.read_counters,
            c.DeleteConntrack: lambda _sw, cmd: self.worker.delete(cmd.family, cmd.orig, cmd.ct_id),
            c.RestoreConntrack: self.restore_conntrack,
            c.ResyncConntrack: lambda _sw, _cmd: self.worker.dump(),
            c.ClearDecisions: self.clear_decisions,
            c.EntryDue: lambda sw, cmd: sw.core.entry_due(cmd.conn, time.monotonic()),
            c.Later: lambda sw, cmd: self.schedule(cmd.delay, sw, cmd.commands),
            c.InstallStatic: self.install_static,
            c.RemoveStatic: self.remove_static,
            c.ReadStaticCounters: self.read_static_counters,
        }
        # Commands that write to the switch: dropped while it is away (the core knows, and
        # its reconcile repairs what they would have done).
        self.switch_bound = frozenset((c.RemoveFlows, c.InstallDefaults, c.InstallPipeline,
                                       c.LimitPacketIns, c.DeleteAllFlows, c.DeleteSwitchFlow, c.RequestTableSize,
                                       c.RequestSwitchFlows, c.ReadCounters, c.InstallStatic, c.RemoveStatic,
                                       c.ReadStaticCounters))

    def execute(self, sw: Switch, cmd: c.Command) -> list[c.Command] | None:
        kind = type(cmd)
        if kind in self.switch_bound and sw.fb is None:
            return None
        return self.handlers[kind](sw, cmd)

    @staticmethod
    def send(sw: Switch, *msgs: Any) -> None:
        if sw.send is not None:
            sw.send.queue(list(msgs))

    # --- the switch -------------------------------------------------------------------------

    def install_flows(self, sw: Switch, cmd: c.InstallFlows) -> list[c.Command] | None:
        conn = cmd.conn
        if sw.send is not None and not sw.send.install(conn):
            self.counters.inc("install_queue_full")
            return sw.core.install_dropped(conn, "flow-mod queue full", wait=True)
        if conn.action is Action.SHUNT and conn.orig.proto == TCP:
            # The switch applies the pair's flows one at a time (hardware: late, in any
            # order): the firewall must not call INVALID the acknowledgements it then
            # sees of data that already took the fast path.
            self.worker.liberal(conn.orig.family, conn.orig, conn.ct_id)
        return None

    def remove_flows(self, sw: Switch, cmd: c.RemoveFlows) -> None:
        self.send(sw, *sw.fb.remove(cmd.conn, cmd.directions))

    def install_defaults(self, sw: Switch, cmd: c.InstallDefaults) -> None:
        self.send(sw, *sw.fb.defaults(cmd.groups))
        LOG.info("default slow-path flows installed for %d port groups of switch %s", len(cmd.groups), sw.name)

    def limit_packet_ins(self, sw: Switch, cmd: c.LimitPacketIns) -> None:
        delete, add = sw.fb.controller_meter(cmd.rate)
        self.send(sw, delete)
        sw.meter_xid = sw.dp.set_xid(add)
        self.send(sw, add)
        sw.meter_on = True

    def delete_all_flows(self, sw: Switch, _cmd: c.DeleteAllFlows) -> None:
        self.send(sw, sw.fb.delete_all())
        LOG.warning("deleting every flow on switch %s (delete_foreign_flows_on_startup)", sw.name)

    def delete_switch_flow(self, sw: Switch, cmd: c.DeleteSwitchFlow) -> None:
        self.send(sw, sw.fb.delete_switch_flow(cmd.flow))
        self.counters.inc("reconcile_deleted")
        LOG.info("deleting switch %s flow cookie=0x%016x: %s", sw.name, cmd.flow.cookie, cmd.reason)

    def request_table_size(self, sw: Switch, _cmd: c.RequestTableSize) -> None:
        msg = sw.fb.table_size_request()
        sw.table_xid = sw.dp.set_xid(msg)
        self.send(sw, msg)

    def read_counters(self, sw: Switch, cmd: c.ReadCounters) -> None:
        msg = sw.fb.pair_stats_request(cmd.conn)
        sw.counter_reads[sw.dp.set_xid(msg)] = CounterRead(cmd.conn, {})
        self.send(sw, msg)

    def install_static(self, sw: Switch, cmd: c.InstallStatic) -> None:
        self.send(sw, *(sw.fb.static_add(f) for f in cmd.flows))
        self.outcomes.static("static_installed", sw.name, [(f.cookie, f.describe()) for f in cmd.flows], cmd.reason)

    def remove_static(self, sw: Switch, cmd: c.RemoveStatic) -> None:
        self.send(sw, *(sw.fb.delete_by_cookie(cookie, ALL_ONES_64) for cookie in cmd.cookies))
        self.outcomes.static("static_removed", sw.name, list(zip(cmd.cookies, cmd.what, strict=True)), cmd.reason)

    def read_static_counters(self, sw: Switch, _cmd: c.ReadStaticCounters) -> None:
        msg = sw.fb.static_stats_request()
        sw.static_read = Asked(sw.dp.set_xid(msg), time.monotonic())
        self.send(sw, msg)

    # --- the kernel ---------------------------------------------------------------------------

    def restore_conntrack(self, sw: Switch, cmd: c.RestoreConntrack) -> None:
        """The entry first; the commands that wait for it (the flows' removal) run on the
        event loop once the kernel has answered."""
        self.counters.inc("teardowns" if cmd.tcp_state != CT_TCP_ESTABLISHED else "reevaluations")
        then = cmd.then
        self.worker.restore(cmd.orig.family, cmd.orig, cmd.reply, cmd.tcp_state, cmd.timeout, cmd.closer_is_reply,
                            cmd.mark, lambda: self.post(sw, then))

    def clear_decisions(self, _sw: Switch, _cmd: c.ClearDecisions) -> None:
        def done(cleared: int, failed: int, error: str | None) -> None:  # on the worker thread
            if error is not None:
                LOG.error("could not clear the policy's decisions in conntrack: %s", error)
            else:
                LOG.warning("the policy is not the one last recorded: decisions cleared on %d conntrack "
                            "entries (%d failed); each is judged again by its next packet", cleared, failed)
        self.worker.clear_marks(DECISION_MASK, done)
