"""What the switch says back, each to its one handler: a reply goes to the handler of the
request it answers (found in flight by its xid: inflight.py), an error to the handler of
what it refused, a request given up to its kind's give-up; packet-ins and flow-removed
go to the core. Handlers pass the core plain values and `now`, and run what it returns.

Given up (the switch answered nothing for inflight.EXPIRY, or answered past it: inflight.py's
rules): a barrier's installs are rolled back; what the core waits for (its reconcile read, a
shunt's counters, the table size, a role request) is asked again; a periodic read is asked
again when next due; an operator's read is answered without the switch's flows.
"""
from __future__ import annotations

import collections
import logging
from typing import Any, Callable, Iterable

from nfshunt.core import commands as c
from nfshunt.core.core import PIPELINE_READ_AGAIN, PIPELINE_READS
from nfshunt.core.policy_state import PolicyWatch
from nfshunt.observe.logs import RateLimitedLog
from nfshunt.observe.metrics import Counters
from nfshunt.openflow.channel import table_full
from nfshunt.openflow.flows import OFPR_INVALID_TTL, REMOVED_REASONS, metadata_teardown, packet_out
from nfshunt.openflow.inflight import (
    Barrier,
    Batch,
    CatcherRead,
    CounterRead,
    FlowsRead,
    GivenUp,
    MeterRead,
    MeterSet,
    ReconcileRead,
    Request,
    RoleAsk,
    StaticRead,
    TableSize,
    WatchRead,
)
from nfshunt.openflow.session import Session
from nfshunt.records import cookies
from nfshunt.records.model import SwitchFlow
from nfshunt.records.segment import parse_segment

from .role_link import RoleLink
from .switch import Switch

LOG = logging.getLogger("nfshunt")

Run = Callable[[Switch, Iterable[c.Command]], None]
OnReply = Callable[[Switch, Session, Any, Any, float], None]  # (switch, session, request, message, now)


class Replies:
    def __init__(self, counters: Counters, rlog: RateLimitedLog, policy: PolicyWatch, roles: RoleLink, run: Run):
        self.counters = counters
        self.rlog = rlog
        self.policy = policy
        self.roles = roles
        self.run = run
        self.on_reply: dict[type[Request], OnReply] = {
            Barrier: lambda sw, _s, req, _msg, now: self._settle(sw, req.answered(), now),
            RoleAsk: lambda sw, _s, _req, msg, _now: self.roles.reply(sw, msg),
            TableSize: self._table_size,
            MeterRead: self._meter_read,
            CatcherRead: self._catcher_read,
            WatchRead: self._watch_read,
            CounterRead: self._counter_read,
            StaticRead: self._static_read,
            ReconcileRead: self._reconcile_read,
            FlowsRead: self._flows_read,
        }
        self.on_error: dict[type[Request], Callable[[Switch, Session, str], None]] = {
            TableSize: lambda sw, _s, reason: LOG.warning(
                "switch %s did not report its table size (%s): set max_shunts to what its table holds (a pair "
                "takes up to %d entries)", sw.name, reason, sw.core.max_pair_entries()),
            MeterSet: self._meter_refused,
            MeterRead: self._meter_refused,
        }
        self.on_give_up: dict[type[Request], Callable[[Switch, Session, Any, float], None]] = {
            RoleAsk: lambda sw, _s, req, _now: self.roles.request(sw, req.request),
            TableSize: lambda sw, _s, _req, _now: self.run(sw, [c.RequestTableSize()]),
            ReconcileRead: lambda sw, _s, _req, _now: self.run(sw, [c.RequestSwitchFlows()]),
            CounterRead: lambda sw, _s, req, _now: self.run(sw, [c.ReadCounters(req.conn)]),
            CatcherRead: lambda sw, _s, _req, _now: sw.sweep.swept(),
            FlowsRead: lambda _sw, _s, req, _now: req.done(None),
        }

    # --- answers to what was asked ------------------------------------------------------------

    def reply(self, sw: Switch, msg: Any, now: float, more: bool = False) -> None:
        """A reply (or a part of one, `more` to come) to the handler of what it answers."""
        s = sw.session
        assert s is not None  # messages come from a served connection only (the app checks)
        request = s.inflight.answer(msg.xid, now, done=not more)
        if request is None:
            self.counters.add("openflow_unasked", type(msg).__name__)
            return
        self.on_reply[type(request)](sw, s, request, msg, now)

    def stats(self, sw: Switch, msg: Any, now: float) -> None:
        """A multipart reply's part."""
        assert sw.session is not None
        self.reply(sw, msg, now, sw.session.fb.more_follows(msg))

    def _settle(self, sw: Switch, batch: Batch | None, now: float, failed: tuple[str, bool] | None = None) -> None:
        if batch is None:
            return
        out: list[c.Command] = []
        for conn in batch.conns:
            failure = failed or batch.failed.get(id(conn))
            if failure is None:
                out.extend(sw.core.flows_confirmed(conn, now))
            else:
                out.extend(sw.core.flows_failed(conn, *failure, now=now))
        self.run(sw, out)

    def _table_size(self, sw: Switch, _s: Session, _req: TableSize, msg: Any, _now: float) -> None:
        """Table features (or table stats, OpenFlow 1.0): table 0's size is the budget's."""
        core = sw.core
        for table in msg.body:
            if table.table_id != 0:
                continue
            max_entries = table.max_entries
            budget = core.table_size(max_entries)
            if core.default_entries() >= max_entries:
                LOG.error("switch %s table 0 holds %d entries: the defaults and %d static shunt flows take %d, "
                          "the switch refuses what does not fit and no shunt has room", sw.name, max_entries,
                          core.static.entries, core.default_entries())
            if budget is None:
                LOG.info("switch %s table 0 holds %d entries; max_shunts %d is the budget", sw.name, max_entries,
                         sw.switch.max_shunts)
            else:
                LOG.info("switch %s table 0 holds %d entries: budget %d shunt and block pairs (max_shunts unset; "
                         "%d entries for the defaults, at most %d a pair)", sw.name, max_entries, budget,
                         core.default_entries(), core.max_pair_entries())
            if budget:  # connections that waited for a budget the switch turned out to allow
                self.run(sw, core.room_freed(max(0, budget - core.shunts - core.blocks)))

    def _meter_read(self, sw: Switch, s: Session, _req: MeterRead, msg: Any, now: float) -> None:
        ofp = s.dp.ofproto
        dropped = sum(band.packet_band_count for meter in msg.body if meter.meter_id == ofp.OFPM_CONTROLLER
                      for band in meter.band_stats)
        new = sw.sweep.meter_read(dropped)
        if new:
            self.counters.inc("packet_in_dropped", new)
        if new and sw.core.pipeline:
            # The shared catchers' counters cannot say which connections closed.
            self.rlog.warning("teardowns-untraceable", "the switch dropped %d teardown packet-ins (packet_in_rate "
                              "%d/s): in the pipeline layout a shunt that lost one FIN's ends as half-closed, one "
                              "that lost both at the idle timeout (%d s); flow_layout single finds them from "
                              "per-connection catchers", new, sw.switch.packet_in_rate, sw.cfg.default_shunt_timeout)
        if not sw.core.pipeline and sw.sweep.due(now):
            s.ask(s.fb.catcher_stats_request(), CatcherRead(now))
            s.send.flush()

    def _catcher_read(self, sw: Switch, s: Session, req: CatcherRead, msg: Any, now: float) -> None:
        """A part of the catcher read after dropped packet-ins (see teardown_sweep)."""
        req.counted.extend(stats.cookie for stats in msg.body if stats.packet_count)
        if s.fb.more_follows(msg):
            return
        sw.sweep.swept()
        out, ended = sw.core.catchers_counted(req.counted, now)
        if ended:
            self.counters.inc("teardowns_from_counters", ended)
            self.rlog.warning("teardowns-from-counters", "the switch dropped teardown packet-ins (packet_in_rate "
                              "%d/s): %d shunts ended from their FIN/RST catchers' counters", sw.switch.packet_in_rate,
                              ended)
        self.run(sw, out)

    def _watch_read(self, sw: Switch, s: Session, req: WatchRead, msg: Any, now: float) -> None:
        """A part of a half-closed shunt's catcher read; once complete, what it says."""
        req.counted.extend(stats.cookie for stats in msg.body if stats.packet_count)
        if s.fb.more_follows(msg):
            return
        out, ended = sw.core.catchers_counted(req.counted, now)
        if ended:
            self.counters.inc("teardowns_from_counters", ended)
            self.rlog.warning("teardowns-lost", "the switch lost teardown packet-ins: %d shunts ended from their "
                              "FIN/RST catchers' counters", ended)
        self.run(sw, out)

    def _counter_read(self, sw: Switch, s: Session, req: CounterRead, msg: Any, now: float) -> None:
        """A new shunt's counters (confirm: counters)."""
        for stats in msg.body:
            reply = bool(stats.cookie & cookies.DIRECTION_BIT)
            req.packets[reply] = req.packets.get(reply, 0) + stats.packet_count
        if not s.fb.more_follows(msg):
            self.run(sw, sw.core.counters_read(req.conn, req.packets, now))

    def _static_read(self, sw: Switch, s: Session, req: StaticRead, msg: Any, _now: float) -> None:
        """The static flows' counters (status, metrics)."""
        req.flows.extend(s.fb.parse_stats(stats) for stats in msg.body)
        if not s.fb.more_follows(msg):
            sw.core.static.counted(req.flows)

    def _parse(self, s: Session, msg: Any, into: list[SwitchFlow]) -> bool:
        """A flow-stats part read into `into`; True once the reply is complete."""
        for stats in msg.body:
            try:
                into.append(s.fb.parse_stats(stats))
            except Exception as exc:  # an odd flow on the switch is not ours to crash on
                self.counters.inc("openflow_malformed")
                LOG.warning("unreadable flow in stats reply: %s", exc)
        return not s.fb.more_follows(msg)

    def _flows_read(self, _sw: Switch, s: Session, req: FlowsRead, msg: Any, _now: float) -> None:
        if self._parse(s, msg, req.flows):
            req.done(req.flows)

    def _reconcile_read(self, sw: Switch, s: Session, req: ReconcileRead, msg: Any, now: float) -> None:
        if not self._parse(s, msg, req.flows):
            return
        core, flows = sw.core, req.flows
        if core.reconciled:
            return  # a read asked for before this connection's reconcile, answered after it
        out = core.reconcile(flows, now)
        if not core.reconciled:  # table 1 not (yet) all on the switch: read again
            self.run(sw, out)
            return
        self.policy.reconciled(sw.index)
        if core.pipeline_reads >= PIPELINE_READS:
            LOG.error("switch %s still lacks table 1's flows %.0f s after they were sent: TCP shunts may have "
                      "their packets dropped there; set flow_layout single if it cannot hold them", sw.name,
                      PIPELINE_READS * PIPELINE_READ_AGAIN)
        kinds = collections.Counter(type(cmd).__name__ for cmd in out)
        kept = {True: "it kept its table", False: "it lost its table", None: "whether it kept its table not known"}
        LOG.info("reconciled with switch %s (%s): %d NFShunt flows read, %d pairs held, %d re-installed, "
                 "%d flows deleted, %d pairs forgotten", sw.name, kept[core.table_kept], len(flows), len(core.by_key),
                 kinds["InstallFlows"], kinds["DeleteSwitchFlow"], kinds["Removed"])
        self.run(sw, out)

    # --- errors, and what was given up -----------------------------------------------------------

    def error(self, sw: Switch, msg: Any, now: float) -> None:
        s = sw.session
        assert s is not None
        self.counters.add("openflow_error", str(msg.type), str(msg.code))
        request = s.inflight.answer(msg.xid, now)
        if isinstance(request, RoleAsk) and msg.type == msg.datapath.ofproto.OFPET_ROLE_REQUEST_FAILED:
            self.roles.refused(sw, msg)
            return
        self.roles.refused_as_slave(sw, msg)  # (a demotion gives the session a new send path)
        reason = f"switch error type={msg.type} code={msg.code}"
        on_error = None if request is None else self.on_error.get(type(request))
        if on_error is not None:
            on_error(sw, s, reason)
            return
        full = table_full(msg)
        conn = s.send.error(msg.xid, reason, full)
        if conn is not None:
            self.rlog.warning("refused-flow", "switch refused a flow of %s: %s", conn.describe(), reason)
        elif (what := s.send.refused_change(msg.xid, f"{reason}{' (table full)' if full else ''}")) is not None:
            self.rlog.warning("refused-change", "switch %s refused %s: %s%s", sw.name, what, reason,
                              " (table full)" if full else "")
        else:
            self.rlog.warning(f"error-{msg.type}-{msg.code}", "switch error for xid %s: %s", msg.xid, reason)

    @staticmethod
    def _meter_refused(_sw: Switch, s: Session, reason: str) -> None:
        s.meter_on = False
        LOG.warning("the switch refused the packet-in rate limit (controller meter: %s): a host sending "
                    "FIN/RST segments can load the controller; on Open vSwitch set the Controller "
                    "record's controller_rate_limit instead", reason)

    def give_up(self, sw: Switch, s: Session, now: float) -> None:
        """The requests the switch left unanswered too long (inflight's one rule)."""
        for request, why in s.inflight.expired(now):
            if isinstance(request, Barrier):
                self._barrier_given_up(sw, request, why, now)
                continue
            self.counters.add("given_up", why.name.lower())
            self.rlog.warning(f"given-up-{why.name.lower()}", "switch %s %s: %s given up", sw.name, why.value,
                              type(request).__name__)
            on_give_up = self.on_give_up.get(type(request))
            if on_give_up is not None:
                on_give_up(sw, s, request, now)

    def _barrier_given_up(self, sw: Switch, request: Barrier, why: GivenUp, now: float) -> None:
        batch = request.answered(f"the switch {why.value}")
        if batch is None:
            return
        self.counters.inc("install_timeouts", len(batch.conns))
        LOG.warning("switch %s did not answer a barrier (it %s): %d installs rolled back", sw.name, why.value,
                    len(batch.conns))
        self._settle(sw, batch, now, ("no answer from the switch", False))

    @staticmethod
    def abandoned(s: Session) -> None:
        """The connection ended: whoever waits for a read of it is answered without, and
        whoever watches a change is told it was not confirmed."""
        for _, read in s.inflight.of(FlowsRead):
            read.done(None)
        s.inflight.unanswerable("the switch's connection ended before it answered: the flows go in when it connects "
                                "again")

    # --- what the switch sends unasked ----------------------------------------------------------

    def packet_in(self, sw: Switch, msg: Any, now: float) -> None:
        """Only the TCP teardown catchers send packets here (OpenFlow 1.3), and a caught
        close's flows while it is watched (core/close_watch.py); only the headers: the switch
        forwarded the packet itself."""
        cookie = getattr(msg, "cookie", None)
        in_port = msg.match.get("in_port") if hasattr(msg.match, "get") else None
        if cookie is None or in_port is None:
            self._unexpected_packet_in("no cookie or in_port", cookie)
            return
        if getattr(msg, "reason", None) == OFPR_INVALID_TTL:
            self._ttl_expired(sw, in_port, bytes(msg.data))
            return
        parsed = cookies.parse(cookie)
        if parsed is not None and parsed.kind is cookies.Kind.SHUNT:
            self.counters.add("packet_in", "teardown")
            self.run(sw, sw.core.watch_sample(parsed.key, parsed.reply, parse_segment(bytes(msg.data)), now))
            return
        if parsed is not None and parsed.kind is cookies.Kind.PIPELINE and parsed.reply:
            # A shared table-1 catcher: the metadata names the connection and direction.
            metadata = msg.match.get("metadata")
            if metadata is None:
                self._unexpected_packet_in("no metadata", cookie)
                return
            cookie = cookies.make_teardown(*metadata_teardown(metadata), cookies.is_rst(cookie))
        out = sw.core.teardown_packet(cookie, in_port, now, parse_segment(bytes(msg.data)))
        if out is None:
            self._unexpected_packet_in("no connection of ours", cookie)
            return
        self.counters.add("packet_in", "teardown")
        self.run(sw, out)

    def _ttl_expired(self, sw: Switch, in_port: int, data: bytes) -> None:
        """A routed shunt's frame whose TTL would expire (its dec_ttl comes first, so the
        frame is as it arrived): to the firewall, by its side's slow port, which answers
        as a router must (ICMP time exceeded: traceroute shows the firewall's hop)."""
        group = next((g for g in sw.switch.ports if g.fast == in_port), None)
        if group is None or sw.session is None:
            self._unexpected_packet_in("ttl expired on no fast port", None)
            return
        self.counters.add("packet_in", "ttl expired")
        sw.session.send.queue([packet_out(sw.session.dp, group.slow, data)])
        self.run(sw, [])  # (written now)

    def _unexpected_packet_in(self, reason: str, cookie: int | None) -> None:
        self.counters.add("packet_in", reason)
        self.rlog.warning(f"packet-in-{reason}", "unexpected packet-in (%s), cookie %s", reason,
                          "none" if cookie is None else f"0x{cookie:016x}")

    def flow_removed(self, sw: Switch, m: Any, now: float) -> None:
        reason = REMOVED_REASONS.get(m.reason, f"reason {m.reason}")
        self.run(sw, sw.core.flow_removed(m.cookie, reason, m.packet_count, m.byte_count,
                                         m.duration_sec + m.duration_nsec / 1e9, now))
