"""The dispatcher: one handler for each command type the core returns.

A command acts on the switch (through its session's send path: flow-mods, and requests
registered in flight), on the kernel (through the conntrack worker), on time (a timer), or
reports an outcome (accounting.Outcomes). A handler may return commands of its own (a
core answer), which `run` executes in the same turn before it writes the turn to the
switch. A new kind of command adds one handler here.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
import time
from typing import Any, Callable, Iterable, Iterator, TypeVar

from nfshunt.config.static import StaticFlow
from nfshunt.core import commands as c
from nfshunt.core.connection import CT_TCP_ESTABLISHED, Action
from nfshunt.kernel.routes import Answer
from nfshunt.kernel.worker import ConntrackWorker
from nfshunt.observe.accounting import Outcomes
from nfshunt.observe.logs import RateLimitedLog
from nfshunt.openflow.flows import ALL_ONES_64, invalid_ttl_packet_ins, packet_out
from nfshunt.openflow.inflight import (
    Barrier,
    ChangeWatch,
    CounterRead,
    FlowsRead,
    MeterSet,
    ReconcileRead,
    StaticRead,
    TableSize,
    TurnWaiter,
)
from nfshunt.openflow.rewrite import rewrite
from nfshunt.openflow.session import Session
from nfshunt.records import cookies
from nfshunt.records.model import OFP10, TCP, ConnEvent, SwitchFlow

from . import clearing
from .switch import Switch
from .tables_link import TablesLink

LOG = logging.getLogger("nfshunt")

Handler = Callable[[Switch, Any], "list[c.Command] | None"]
OnSwitch = Callable[[Switch, Session, Any], None]
Schedule = Callable[[float, Switch, tuple[c.Command, ...]], None]
Post = Callable[[Switch, tuple[c.Command, ...]], None]
F = TypeVar("F")


def _static_add(f: StaticFlow) -> str:
    """A watched static flow-mod, named only if the switch refuses it."""
    return f"the add of static flow {f.shunt.label} ({'reply' if f.reply else 'original'}): {f.describe()}"


def _static_delete(what: str) -> str:
    return f"the delete of static flow {what}"


class Dispatcher:
    def __init__(self, worker: ConntrackWorker, outcomes: Outcomes, schedule: Schedule, post: Post,
                 clock: Callable[[], float] = time.monotonic,
                 on_tables: Callable[[dict[str, Answer]], None] | None = None):
        self.worker = worker
        self.clock = clock  # the event loop's (monotonic)
        self.outcomes = outcomes
        self.counters = outcomes.counters
        self.schedule = schedule  # run commands after a delay (the app's timer)
        self.post = post  # run commands on the event loop from another thread
        self.turn: TurnWaiter | None = None  # who waits for the turn being run, told what of it failed
        self.watch: ChangeWatch | None = None  # the change the turn being run is (its static flow-mods')
        self.rlog = RateLimitedLog(LOG)
        # A routing firewall's tables, followed on a thread of their own from the first
        # question (kernel/routes.py); its news go to every switch's core (on_tables: feeds).
        self.tables = TablesLink(self.counters, post, clock, on_tables)
        report = {t: (lambda _sw, cmd, h=h: h(cmd)) for t, h in outcomes.handlers.items()}
        self.handlers: dict[type, Handler] = {
            **report,
            c.InstallFlows: self.install_flows,
            c.DeleteConntrack: lambda _sw, cmd: self.worker.delete(cmd.family, cmd.orig, cmd.ct_id, cmd.counted),
            c.ShortenConntrack: lambda _sw, cmd: self.worker.expire(cmd.family, cmd.orig, cmd.ct_id, cmd.timeout),
            c.RestoreConntrack: self.restore_conntrack,
            c.RefreshConntrack: lambda _sw, cmd: self.worker.refresh(cmd.family, cmd.orig, cmd.ct_id, cmd.timeout),
            c.ClearDecision: lambda _sw, cmd: self.worker.clear_decision(cmd.family, cmd.orig, cmd.ct_id),
            **self._routed_handlers(),
            c.ResyncConntrack: lambda _sw, _cmd: self.worker.dump(),
            c.ClearDecisions: lambda sw, _cmd: clearing.clear_decisions(self.worker, self.post, self.clock, sw),
            c.ClearingDone: clearing.clearing_done,
            c.EntryBack: lambda sw, cmd: sw.core.conns.entry_back(cmd.conn, self.clock()),
            c.EntryDue: lambda sw, cmd: sw.core.entry_due(cmd.conn, self.clock()),
            c.WatchEnds: lambda sw, cmd: sw.core.watch_ends(cmd.conn, cmd.watch, self.clock()),
            c.CloseContradicted: self.close_contradicted,
            c.Later: lambda sw, cmd: self.schedule(cmd.delay, sw, cmd.commands),
        }
        # Commands that write to the switch: dropped while it is away (the core knows, and
        # its reconcile repairs what they would have done).
        self.on_switch: dict[type, OnSwitch] = {
            c.RemoveFlows: lambda _sw, s, cmd: s.send.queue(s.fb.remove(cmd.conn, cmd.directions)),
            c.WatchFlows: lambda _sw, s, cmd: s.send.queue(s.fb.watch(cmd.conn)),
            c.UnwatchFlows: lambda _sw, s, cmd: s.send.queue(s.fb.install(cmd.conn)),
            c.RewriteFlows: self.rewrite_flows,
            c.InstallDefaults: self.install_defaults,
            c.SendAnnouncements: self.send_announcements,
            c.InstallPipeline: lambda _sw, s, cmd: s.send.queue(s.fb.pipeline_flows(cmd.groups)),
            c.LimitPacketIns: self.limit_packet_ins,
            c.DeleteAllFlows: self.delete_all_flows,
            c.DeleteSwitchFlow: self.delete_switch_flow,
            c.RequestKeptDefaults: self.request_kept_defaults,
            c.RequestTableSize: lambda _sw, s, _cmd: s.ask(s.fb.table_size_request(), TableSize(self.clock())),
            c.RequestSwitchFlows: lambda _sw, s, _cmd: s.ask(s.fb.owned_flow_stats_request(),
                                                             ReconcileRead(self.clock())),
            c.ReadCounters: lambda _sw, s, cmd: s.ask(s.fb.pair_stats_request(cmd.conn),
                                                      CounterRead(self.clock(), cmd.conn)),
            c.InstallStatic: self.install_static,
            c.RemoveStatic: self.remove_static,
            c.ReadStaticCounters: lambda _sw, s, _cmd: s.ask(s.fb.static_stats_request(),
                                                             StaticRead(self.clock())),
            c.InstallAddressBlocks: self.install_address_blocks,
            c.RemoveAddressBlocks: self.remove_address_blocks,
        }

    def _routed_handlers(self) -> dict[type, Handler]:
        """A routing firewall's: its tables asked and followed, adopted pairs checked."""
        t = self.tables
        return {
            c.ResolveHops: t.resolve_hops,
            c.ResolveStatic: t.resolve_static,
            c.StaticHopsKnown: lambda sw, cmd: sw.core.tables_changed(cmd.answers, self.clock(), cmd.attempt),
            c.HopsKnown: lambda sw, cmd: sw.core.next_hops_known(cmd.answers, cmd.event, self.clock(), cmd.attempt),
            c.CheckAdopted: t.check_adopted,
            c.AdoptedHopsKnown: lambda sw, cmd: sw.core.adopted_answer(cmd, self.clock()),
            c.LookUpEntry: self.look_up_entry,
            c.EntryFound: lambda sw, cmd: sw.core.adopted_answer(cmd, self.clock()),
            c.TablesChanged: lambda sw, cmd: sw.core.tables_changed(cmd.answers, self.clock()),
            c.NeighbourHeldDown: t.neighbour_held_down,
            c.AnnounceGateways: t.announce_gateways,
        }

    def execute(self, sw: Switch, cmd: c.Command) -> list[c.Command] | None:
        kind = type(cmd)
        on_switch = self.on_switch.get(kind)
        if on_switch is None:
            return self.handlers[kind](sw, cmd)
        if sw.session is not None:
            on_switch(sw, sw.session, cmd)
        return None

    def run(self, sw: Switch, commands: Iterable[c.Command], waiter: threading.Event | None = None) -> None:
        """Execute a switch's core's commands (and what executing them brings back from the
        core), then write the turn to the switch, behind a barrier whose answer sets `waiter`,
        a TurnWaiter told what of the turn failed (`_failed`). A ChangeWatch also gets the xids
        of the static flow-mods the commands make, and what the switch refuses of them."""
        work = collections.deque(commands)
        session = sw.session
        if session is not None and session.send.queued:
            work.extend(self._release(sw, session))
        self.turn = waiter if isinstance(waiter, TurnWaiter) else None
        self.watch = waiter if isinstance(waiter, ChangeWatch) else None
        try:
            with self.worker.batched():  # the turn's conntrack requests go to the worker at once
                while work:
                    cmd = work.popleft()
                    try:
                        follow = self.execute(sw, cmd)
                    except Exception as exc:
                        LOG.exception("failed to execute %s", type(cmd).__name__)
                        self._failed(f"the {type(cmd).__name__} command", f"failed: {type(exc).__name__}: {exc}")
                        continue
                    if follow:
                        work.extend(follow)
        finally:
            self.turn = self.watch = None
        if sw.session is not None:
            sw.session.send.flush(waiter)
        elif isinstance(waiter, ChangeWatch):
            waiter.end("the switch is not connected: the flows go in when it connects")
        elif waiter is not None:
            waiter.set()

    @contextlib.contextmanager
    def held(self, switches: Iterable[Switch]) -> Iterator[None]:
        """Turns run inside write nothing to the switches (nor hand conntrack requests to
        the worker) until the last ends, then each switch's in one write: a drain of IDS
        calls makes one write for its requests, not a write, a thread hand-over and a wait
        for the interpreter's lock each (bench ids). Each turn keeps its own barrier."""
        held = [(sw, sw.session, sw.session.send) for sw in switches if sw.session is not None]
        for _, _, send in held:
            send.hold += 1
        try:
            with self.worker.batched():
                yield
        finally:
            for _, _, send in held:
                send.hold -= 1
            for sw, session, send in held:
                if send.hold or sw.session is not session or session.send is not send:
                    continue  # (still held further out; or a session gone or disowned meanwhile: moot)
                try:
                    send.write()
                except Exception:  # one switch's failure keeps none of the others' turns unwritten
                    self.counters.inc("internal_errors")
                    LOG.exception("failed to write held turns to switch %s", sw.name)

    def _release(self, sw: Switch, session: Session) -> list[c.Command]:
        """Paced installs whose turn has come go out; the queue's freed room goes to
        connections that waited for it."""
        send, core = session.send, sw.core
        before = len(send.queued)
        out: list[c.Command] = []
        for conn in send.release(self.clock()):
            out.extend(core.install_dropped(conn, "taken down before it was sent", wait=False))
        drained = before - len(send.queued)
        if drained and core.waiting:
            out.extend(core.room_freed(min(drained, send.queue_max - len(send.queued))))
        return out

    def _failed(self, what: str, why: str) -> None:
        """What of the turn failed inside the controller (a handler raised, a flow could not
        be built: a bug past the checks), counted and told to the turn's waiter, whose barrier
        confirms none of it (TurnWaiter.failed: a reload names it, an IDS's add fails)."""
        self.counters.inc("internal_errors")
        if self.turn is not None:
            self.turn.failed.append((what, why))

    # --- the switch -------------------------------------------------------------------------

    def install_flows(self, sw: Switch, cmd: c.InstallFlows) -> list[c.Command] | None:
        conn = cmd.conn
        try:
            sent = sw.session is None or sw.session.send.install(conn)
        except Exception as exc:  # its flows, built whole before any is queued, could not be: none went
            self._failed(f"the install of {conn.describe()}", f"not built: {type(exc).__name__}: {exc}")
            self.rlog.log(logging.ERROR, f"{sw.name} install", "switch %s: cannot build the flows of %s: rolled "
                          "back, its entry kept", sw.name, conn.describe(), exc_info=True)
            self.outcomes.not_installed(conn)  # (who waits for its install: an IDS's add, answered failed)
            return sw.core.install_dropped(conn, "its flows could not be built (logged)", wait=False)
        if not sent:
            self.counters.inc("install_queue_full")
            return sw.core.install_dropped(conn, "flow-mod queue full", wait=True)
        if conn.action is Action.SHUNT and conn.orig.proto == TCP:
            # The switch applies the pair's flows one at a time (hardware: late, in any
            # order): the firewall must not call INVALID the acknowledgements it then
            # sees of data that already took the fast path.
            self.worker.liberal(conn.orig.family, conn.orig, conn.entry)
        return None

    @staticmethod
    def install_defaults(sw: Switch, s: Session, cmd: c.InstallDefaults) -> None:
        if sw.switch.experimental_routed:  # (at every connect, as the defaults: the setting is the connection's)
            s.send.queue([invalid_ttl_packet_ins(s.dp)])
        s.send.queue(s.fb.defaults(cmd.groups))
        LOG.info("default slow-path flows installed for %d port groups of switch %s", len(cmd.groups), sw.name)

    def request_kept_defaults(self, sw: Switch, s: Session, _cmd: c.RequestKeptDefaults) -> None:
        def done(flows: list[SwitchFlow] | None) -> None:  # on the event loop
            if flows is not None:  # (None: the switch went, or never answered: not known)
                sw.core.defaults_kept(flows)
        s.ask(s.fb.cookie_stats_request(cookies.make(cookies.Kind.DEFAULT), cookies.OWNED_MASK | cookies.KIND_MASK),
              FlowsRead(self.clock(), done))
        # A switch may reorder what no barrier separates: the defaults sent next must not
        # be in the table this read reports.
        s.ask(s.fb.barrier(), Barrier(self.clock()))

    def limit_packet_ins(self, _sw: Switch, s: Session, cmd: c.LimitPacketIns) -> None:
        delete, add = s.fb.controller_meter(cmd.rate)
        s.send.queue([delete])
        s.ask(add, MeterSet(self.clock()))
        s.meter_on = True

    @staticmethod
    def delete_all_flows(sw: Switch, s: Session, _cmd: c.DeleteAllFlows) -> None:
        s.send.queue([s.fb.delete_all()])
        LOG.warning("deleting every flow on switch %s (delete_foreign_flows_on_startup)", sw.name)

    def delete_switch_flow(self, sw: Switch, s: Session, cmd: c.DeleteSwitchFlow) -> None:
        s.send.queue([s.fb.delete_switch_flow(cmd.flow)])
        self.counters.inc("reconcile_deleted")
        LOG.info("deleting switch %s flow cookie=0x%016x: %s", sw.name, cmd.flow.cookie, cmd.reason)

    def _built(self, sw: Switch, flows: Iterable[F], build: Callable[[F], Any], name: Callable[[F], str]
               ) -> tuple[list[F], list[Any]]:
        """Each flow's message built on its own, and the flows built: one command carries
        every static stream's (every address block's) flows at a connect, so one that
        cannot be built (a bug past the config's or the rules' checks) is counted, named
        (rate-limited; to the turn's waiter: `_failed`) and left out, not all of them."""
        done, msgs = [], []
        for f in flows:
            try:
                msgs.append(build(f))
            except Exception as exc:
                self._failed(name(f), f"not built: {type(exc).__name__}: {exc}")  # (a reload's answer names it)
                key = f"{sw.name} {name(f)}"  # (as many keys as entries: bounded by the config and ids.max_rules)
                self.rlog.log(logging.ERROR, key, "switch %s: cannot build %s: left out", sw.name, name(f),
                              exc_info=True)
                continue
            done.append(f)
        return done, msgs

    def install_static(self, sw: Switch, s: Session, cmd: c.InstallStatic) -> None:
        flows, msgs = self._built(sw, cmd.flows, s.fb.static_add, _static_add)
        if self.watch is None:
            s.send.queue(msgs)
        else:
            s.send.queue_watched(msgs, [functools.partial(_static_add, f) for f in flows], self.watch)
        self.outcomes.static("static_installed", sw.name, [(f.cookie, f.describe()) for f in flows], cmd.reason)

    def remove_static(self, sw: Switch, s: Session, cmd: c.RemoveStatic) -> None:
        msgs = [s.fb.delete_by_cookie(cookie, ALL_ONES_64) for cookie in cmd.cookies]
        if self.watch is None:
            s.send.queue(msgs)
        else:
            s.send.queue_watched(msgs, [functools.partial(_static_delete, what) for what in cmd.what], self.watch)
        self.outcomes.static(cmd.event, sw.name, list(zip(cmd.cookies, cmd.what, strict=True)), cmd.reason)

    def install_address_blocks(self, sw: Switch, s: Session, cmd: c.InstallAddressBlocks) -> None:
        if s.fb.version == OFP10:  # no prefix or IPv6 matches (the backend refuses new ones; kept ones wait)
            LOG.error("switch %s speaks OpenFlow 1.0: %d IDS address-block flows not installed (%s)", sw.name,
                      len(cmd.flows), cmd.reason)
            return
        now = self.clock()
        flows, msgs = self._built(sw, cmd.flows, lambda f: s.fb.address_block_add(f, now),
                                  lambda f: f"the add of IDS address-block flow {f.describe()}")
        s.send.queue(msgs)
        self.outcomes.static("address_block_installed", sw.name, [(f.cookie, f.describe()) for f in flows],
                             cmd.reason, "address_blocks")

    def remove_address_blocks(self, sw: Switch, s: Session, cmd: c.RemoveAddressBlocks) -> None:
        s.send.queue([s.fb.delete_by_cookie(cookie, ALL_ONES_64) for cookie in cmd.cookies])
        self.outcomes.static("address_block_removed", sw.name, list(zip(cmd.cookies, cmd.what, strict=True)),
                             cmd.reason, "address_blocks")

    # --- the kernel ---------------------------------------------------------------------------

    def look_up_entry(self, sw: Switch, cmd: c.LookUpEntry) -> None:
        """An adopted NAT pair's kept entry, looked up by the conntrack worker (its own
        thread); the answer comes back as an EntryFound."""
        conn = cmd.conn

        def done(entry: ConnEvent | None, failed: str | None) -> None:  # on the worker thread
            self.post(sw, (c.EntryFound(conn, entry, failed),))
        self.worker.look_up(conn.orig, done)

    def send_announcements(self, _sw: Switch, s: Session, cmd: c.SendAnnouncements) -> None:
        s.send.queue([packet_out(s.dp, f.port, f.data) for f in cmd.frames])
        self.counters.inc("routed_announcements", len(cmd.frames))
        LOG.info("told the hosts this firewall's MACs: %d announcements of the addresses of %s", len(cmd.frames),
                 ", ".join(cmd.interfaces))

    def rewrite_flows(self, _sw: Switch, s: Session, cmd: c.RewriteFlows) -> None:
        self.counters.inc("routed_rewrites")
        s.send.queue(rewrite(s.fb, cmd.conn))

    def close(self) -> None:
        self.tables.close()

    def restore_conntrack(self, sw: Switch, cmd: c.RestoreConntrack) -> None:
        """The entry first; the commands that wait for it (the flows' removal) run on the
        event loop once the kernel has answered."""
        self.counters.inc("teardowns" if cmd.tcp_state != CT_TCP_ESTABLISHED else "reevaluations")
        then = cmd.then if cmd.handed_back is None else (c.EntryBack(cmd.handed_back), *cmd.then)
        self.worker.restore(cmd.orig.family, cmd.orig, cmd.reply, cmd.tcp_state, cmd.timeout, cmd.closer_is_reply,
                            cmd.mark, lambda: self.post(sw, then), cmd.nat)

    def close_contradicted(self, _sw: Switch, cmd: c.CloseContradicted) -> None:
        """A caught close its own traffic contradicted: a FIN or RST the endpoints did not
        send (forged on the path, most likely)."""
        self.counters.inc("teardowns_contradicted")
        self.rlog.warning("close-contradicted", "a close (%s) was contradicted by the "
                          "connection's traffic (%s; forged?): its shunt goes on, or is judged again by the "
                          "policy: %s", cmd.claimed, cmd.by, cmd.conn.describe())
