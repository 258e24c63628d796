"""The decision core: conntrack events and switch feedback in, commands out. No I/O.

The switch side (switch_app) executes InstallFlows / RemoveFlows / DeleteConntrack and
reports back through flows_confirmed / flows_failed / flow_removed; everything else a
command carries (Ignored, Installed, Refused, Removed) is for logs and counters.

A connection's life: PENDING (flows sent, waiting for the barrier) -> ACTIVE (switch
confirmed; conntrack entry deleted once the switch forwards on the flows and the slow
path has drained, see below) -> REMOVING (one direction's flow is gone, the other
is being deleted so the pair leaves together) -> forgotten. Its conntrack entry is only
deleted once the switch has confirmed both flows, so a refused flow-mod leaves the
connection safely on the slow path.

When the entry goes (`confirm`): a hardware switch answers the barrier before its data
plane forwards on the new flows (up to 400 ms later on a Pica8), so packets of the
connection keep reaching the firewall meanwhile; and packets already queued on the slow
path arrive after any confirmation. Either would meet a firewall that no longer tracks
the connection (INVALID behind a strict policy). So the entry is kept until the switch is
known to forward (the barrier reply; the pair's packet counters rising, read by flow
stats; or a fixed delay) and then for `drain` more.

Room on the switch: with a budget (`max_shunts`, or derived from the table size the switch
reports when that is unset), or when the switch reports its table full,
a shunt stays on the slow path (its entry kept) and waits; waiting connections are
retried, blocks first, as pairs leave. A block that finds no room evicts the newest shunt.

TCP teardown (OpenFlow 1.3, `tcp_teardown`): a shunt also gets per-direction FIN and RST
catchers that forward the packet to the peer port in the switch and send its headers to
the controller (nothing is re-injected: a packet the switch could not carry by packet-out
would strand the close). On an RST, or once both directions have sent a FIN, the core
re-creates the connection's conntrack entry in the closing state (CLOSE, LAST_ACK) and
only then removes the flows: the rest of the close crosses the firewall, which recognises
it instead of seeing stray packets of a connection it no longer tracks.

Trust: only pairs this controller installed from a policy decision are ever installed
again after a reconnect; pairs adopted from a switch's flow table (a restart) are kept
while the switch has them and forgotten when it does not, so a peer that posed as the
switch cannot get a forged pair onto the real one.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Iterable

from . import cookies, markcodec
from .commands import (ClearDecisions, Command, DeleteAllFlows, DeleteConntrack, DeleteSwitchFlow, EntryDue,
                       Ignored, InstallDefaults, InstallFlows, InstallPipeline, Installed, Later, LimitPacketIns,
                       ReadCounters, Refused, RemoveFlows, Removed, RequestSwitchFlows, RequestTableSize,
                       ResyncConntrack)
from .config import Config, PortGroup
from .connection import (ACTIVE, CT_TCP_CLOSE, CT_TCP_LAST_ACK, HELD, IDLE, Action, Conn, Connections,
                         FlowCount, State, closing)
from .model import OFP10, OFP13, TCP, TCP_CLOSING, UDP, ConnEvent, EventKind, FlowTuple, SwitchFlow
from .static import StaticTable
from .teardown_sweep import HalfClosed

REMOVAL_GRACE = 5.0  # seconds a half-removed pair may wait for its second flow-removed
WAITING_MAX = 65536  # connections remembered while waiting for room on the switch
SWEEP_AFTER = 1.0  # seconds after confirmation to sweep entries re-created by in-flight packets
COUNTER_POLL = 0.05  # seconds between reads of a new shunt's packet counters (confirm: counters)


@dataclass(slots=True)
class Pin:
    action: Action  # IGNORE (unshunt) or BLOCK
    expires: float
    ct_id: int | None = None  # the entry it applied to; its DESTROY ends an unshunt pin


# Reasons an event is ignored; fixed strings so they can label metrics.
R_UNMARKED = "unmarked"
R_INCOMPLETE = "mark incomplete"
R_UNKNOWN_ACTION = "unknown action"
R_UNKNOWN_PORT = "unknown port"
R_SAME_PORT = "same ingress and egress port"
R_POLICY_IGNORE = "policy ignore"
R_PROTOCOL = "protocol not tcp/udp"
R_CLOSING = "tcp closing"
R_DESTROY = "destroy"
R_NO_SWITCH = "no switch connected"
R_BACKUP = "backup: the pair's other firewall is active"
R_IPV6_OF10 = "ipv6 needs openflow 1.3"
R_DUPLICATE = "duplicate"
R_QUEUED = "queued behind removal"
R_BUDGET = "flow budget full"
R_WAITING = "waiting for room on the switch"
R_PINNED = "kept on the slow path by an operator"
PIN_TTL = 3600.0  # seconds an operator's unshunt/block holds for a tuple
R_NO_SHUNTING = "default_no_shunting is false"
R_NAT = "nat: reply tuple is not the original reversed"
R_ID_COLLISION = "conntrack id of a live pair"


@dataclass(slots=True)
class HalfClosedDue:
    """What the half-closed shunts due a look call for (Core.half_closed_due)."""
    catchers: list[int] = field(default_factory=list)  # cookies of catchers to read (single layout)
    commands: list[Command] = field(default_factory=list)  # hand-backs (pipeline layout)
    ended: int = 0


def catches_teardown(version: int | None, cfg: Config, conn: Conn) -> bool:
    """A TCP shunt on OpenFlow 1.3 gets FIN and RST catchers (see the module's docstring)."""
    return version != OFP10 and cfg.tcp_teardown and conn.action is Action.SHUNT and conn.orig.proto == TCP


PIPELINE_ENTRIES = 5  # table-1 flows per port group: FIN and RST catchers for IPv4 and IPv6, the output
PIPELINE_READ_AGAIN = 0.1  # seconds: table 1 read back incomplete at connect (a lagging switch), read again
PIPELINE_READS = 50  # ... this many times (5 s), then reconcile anyway (and say so)
SINGLE_TCP_ENTRIES = 6  # a TCP shunt in the single layout: its two flows and four catchers


def entries_per_pair(teardown: bool, pipeline: bool) -> int:
    """Entries a pair takes in table 0: a TCP shunt with its catchers (`teardown`) in the
    single layout, else its two flows (the pipeline layout shares its catchers)."""
    return SINGLE_TCP_ENTRIES if teardown and not pipeline else 2


def max_pair_entries(version: int | None, cfg: Config, pipeline: bool) -> int:
    """The most entries one pair takes in table 0."""
    return entries_per_pair(version != OFP10 and cfg.tcp_teardown, pipeline)


def pair_entries(version: int | None, cfg: Config, conn: Conn, pipeline: bool = False) -> int:
    """Flow entries this pair takes on the switch."""
    return entries_per_pair(catches_teardown(version, cfg, conn), pipeline)


def goes_to_pipeline(version: int | None, cfg: Config, action: Action, proto: int, pipeline: bool) -> bool:
    """Whether a pair's table-0 flows go on to table 1 (pipeline layout, TCP shunt with
    teardown) instead of outputting (or dropping) themselves."""
    return pipeline and version != OFP10 and cfg.tcp_teardown and action is Action.SHUNT and proto == TCP


class Core:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.version: int | None = None  # negotiated OpenFlow version; None: no switch (or not master)
        self.pipeline = False  # the switch's flows use the pipeline layout (two tables)
        self.pipeline_reads = 0  # reads of the switch's flows at connect that lacked table-1 flows
        self.backup = cfg.pair is not None  # one of a pair, not (yet) granted MASTER
        self.conns = Connections()
        self.reconciled = False
        # The policy changed since the pairs on the switch were decided (set by the app at
        # start, from policy_state.py): the first reconcile hands every adopted pair back.
        self.stale_policy = False
        self.budget = cfg.max_shunts  # pairs allowed at once (0: no limit)
        self.table_max: int | None = None  # entries the switch's table 0 holds, as it reported them
        # Connections refused for lack of room, oldest first; blocks go to the front.
        self.waiting: collections.OrderedDict[FlowTuple, ConnEvent] = collections.OrderedDict()
        # Operator overrides by tuple (both directions): IGNORE (unshunt) or BLOCK.
        self.pins: dict[FlowTuple, Pin] = {}
        self._sweeps: collections.deque[tuple[float, Conn]] = collections.deque()
        self.static = StaticTable(cfg)  # engineered streams (static.py): not pairs, not in the budget
        # TCP shunts with one FIN caught: where a lost packet-in is looked for (teardown_sweep).
        self.half_closed = HalfClosed()

    # Read by status, metrics and tests; the table itself is connection.py's.
    @property
    def by_key(self) -> dict[int, Conn]:
        return self.conns.by_key

    @property
    def shunts(self) -> int:
        return self.conns.shunts

    @property
    def blocks(self) -> int:
        return self.conns.blocks

    @property
    def entries(self) -> int:
        return self.conns.entries

    # --- switch lifecycle ---------------------------------------------------------------

    def switch_connected(self, version: int, pipeline: bool = False) -> list[Command]:
        """The switch is ours to program (connected; in a pair, granted MASTER)."""
        self.version = version
        self.pipeline = pipeline
        self.pipeline_reads = 0
        self.backup = False
        self.reconciled = False
        out: list[Command] = []
        if self.cfg.delete_foreign_flows_on_startup:
            out.append(DeleteAllFlows())
        out.extend(self.static.connected())  # before the defaults: their first frame never crosses the firewall
        if self.cfg.default_no_shunting:
            out.append(InstallDefaults(self.cfg.ports))
        if pipeline:
            out.append(InstallPipeline(self.cfg.ports))
        if version >= OFP13 and self.cfg.tcp_teardown and self.cfg.packet_in_rate:
            out.append(LimitPacketIns(self.cfg.packet_in_rate))
        out.append(RequestTableSize())
        out.append(RequestSwitchFlows())
        return out

    def reload(self, cfg: Config) -> list[Command]:
        """A reloaded config (reload.py keeps every key but the live ones): static shunts
        change as the difference only; the packet-in meter takes a new rate."""
        old, self.cfg = self.cfg, cfg
        out: list[Command] = self.static.reload(cfg)
        if self.version is not None and self.version >= OFP13 and cfg.tcp_teardown and cfg.packet_in_rate and \
                cfg.packet_in_rate != old.packet_in_rate:
            out.append(LimitPacketIns(cfg.packet_in_rate))
        return out

    def stopping(self, now: float, take_down: bool) -> list[Command]:
        """Shutting down: nothing new goes onto the switch from now on (a pair that leaves
        must not let a queued connection take its place). With `take_down`, every pair is
        handed back to the firewall alive (connection.py's rule), pending ones rolled back;
        without, the pairs stay on the switch for the next start to adopt."""
        out: list[Command] = []
        for conn in self.conns if take_down else ():
            if conn.state is State.PENDING:
                out.extend(self.conns.roll_back(conn, "controller stopped"))
            elif conn.state in ACTIVE:
                out.extend(self.conns.hand_back(conn, "controller stopped", now))
            else:  # already being taken down (its entry handed back): the removal goes now
                out.append(RemoveFlows(conn, (False, True), conn.remove_reason or "controller stopped"))
        self.version = None
        self.reconciled = False
        return out

    def stand_by(self) -> list[Command]:
        """In a pair, no longer master: the other controller programs the switch now and
        owns every pair on it (it adopts them, and its take-downs hand them back), so they
        are forgotten here, not taken down. Pending installs were never confirmed: their
        entries stay on the slow path."""
        out = self.switch_disconnected()
        for conn in self.conns:
            self.conns.forget(conn)
        self.waiting.clear()
        self._sweeps.clear()
        self.half_closed.clear()
        self.reconciled = False
        self.backup = True
        return out

    def switch_disconnected(self) -> list[Command]:
        """Pending first installs are abandoned: their conntrack entries were never deleted,
        so the connections stay on the slow path and the resync on reconnect retries them.
        A pending re-install (its entry deleted) stays: the reconcile finds it."""
        self.version = None
        out: list[Command] = []
        for conn in self.conns:
            if conn.state is State.PENDING and not conn.entry_deleted:
                self.conns.forget(conn)
                out.append(Refused(conn, "switch disconnected before confirming"))
        return out

    # --- reconcile --------------------------------------------------------------------------

    def reconcile(self, flows: Iterable[SwitchFlow], now: float) -> list[Command]:
        """Bring the switch and the table into agreement after a (re)connect.

        Complete shunt/block pairs of exactly the shape this version installs are adopted
        (never bounced), unless the policy changed since they were decided: then they are
        handed back to it. Connections we know of that the switch lost are installed again;
        NFShunt flows nobody accounts for are deleted when delete_flows_on_startup is set.
        """
        if self.reconciled:  # a read asked for before a reconnect, answered after this one's
            return []
        flows = list(flows)
        if self.pipeline and not self._table_1_complete(flows) and self.pipeline_reads < PIPELINE_READS:
            # A switch that applies flow-mods after its barrier (hardware) may not have table
            # 1 yet: a shunt sent there now would have its packets dropped at the table miss.
            self.pipeline_reads += 1
            return [Later(PIPELINE_READ_AGAIN, (RequestSwitchFlows(),))]
        flows, out = self.static.reconcile(flows)
        pairs, catchers = self._sort_flows(flows, out)
        present: set[int] = set()
        for (kind, key), dirs in pairs.items():
            conn = self.conns.named(kind, key)
            if conn is None and len(dirs) == 2:
                conn = self._adopt(kind, key, dirs, now)
            if conn is not None and len(dirs) == 2 and self._matches(conn, dirs):
                present.add(id(conn))
                continue
            if self.cfg.delete_flows_on_startup or conn is None:
                for flow in dirs.values():
                    out.append(DeleteSwitchFlow(flow, "orphan: half a pair or not in config"))
        for key, flow in catchers:
            conn = self.conns.named(cookies.Kind.SHUNT, key)
            if conn is None or id(conn) not in present:
                out.append(DeleteSwitchFlow(flow, "orphan teardown catcher"))
        for conn in self.conns:
            out.extend(self._repair(conn, id(conn) in present, now))
        if self.stale_policy:
            self.stale_policy = False
            out.append(ClearDecisions())
        self.reconciled = True
        out.append(ResyncConntrack())
        return out

    def _sort_flows(self, flows: list[SwitchFlow], out: list[Command]) -> tuple[
            dict[tuple[cookies.Kind, int], dict[bool, SwitchFlow]], list[tuple[int, SwitchFlow]]]:
        """NFShunt's flows by pair and the teardown catchers; defaults and table-1 flows
        that are not this config's are deleted on the way."""
        pairs: dict[tuple[cookies.Kind, int], dict[bool, SwitchFlow]] = {}
        catchers: list[tuple[int, SwitchFlow]] = []
        crowded: dict[tuple[cookies.Kind, int], list[SwitchFlow]] = {}
        expected_defaults = {(g.slow, g.fast) for g in self.cfg.ports} | {(g.fast, g.slow) for g in self.cfg.ports}
        for flow in flows:
            parsed = cookies.parse(flow.cookie)
            if parsed is None:
                continue
            kind, key, reply = parsed
            if kind is cookies.Kind.DEFAULT:
                # In a pair, another firewall's defaults are the peer's: it no longer decides.
                if (flow.in_port, flow.out_port) not in expected_defaults and (
                        self.cfg.delete_flows_on_startup or self.cfg.pair is not None):
                    out.append(DeleteSwitchFlow(flow, "default flow not in config"))
            elif kind is cookies.Kind.TEARDOWN:
                catchers.append((key, flow))
            elif kind is cookies.Kind.PIPELINE:
                # Table-1 flows of a port group (re-installed at every connect), or of
                # another layout or port list: those are only reachable by flows of ours
                # that are deleted too, so they go whatever delete_flows_on_startup says.
                if not self.pipeline or key >= len(self.cfg.ports) or \
                        flow.out_port != self.cfg.ports[key].fast:
                    out.append(DeleteSwitchFlow(flow, "table-1 flow not in this layout"))
            else:
                dirs = pairs.setdefault((kind, key), {})
                if reply in dirs or not flow.exact:
                    # A second flow under one cookie, or one of another shape (an older
                    # release's, a wildcarded one): none of them is adopted, all go.
                    crowded.setdefault((kind, key), []).extend((flow, dirs.get(reply, flow)))
                dirs[reply] = flow
        for key, odd in crowded.items():
            for flow in {id(f): f for f in (*pairs.pop(key).values(), *odd)}.values():
                out.append(DeleteSwitchFlow(flow, "not exactly the shape of a pair this version installs"))
        return pairs, catchers

    def _repair(self, conn: Conn, present: bool, now: float) -> list[Command]:
        """One known pair after a reconnect, by what the switch still has of it."""
        if conn.state is State.TAKING_DOWN:
            # Taken down while the switch was away (flush, unshunt, block, policy): the
            # decision holds, whatever the switch still has.
            if present:
                return self.conns.hand_back(conn, conn.remove_reason or "removal", now)
            return self._finish_removal(conn, conn.remove_reason or "removal")
        if present:
            if conn.adopted and self.stale_policy:
                return self.conns.hand_back(conn, "policy changed while the controller was stopped", now)
            return []
        if conn.state not in ACTIVE and not conn.entry_deleted:
            return []
        if conn.adopted:
            # Read back from a switch, never decided here: nothing to re-install. Its
            # connection, if it lives, is back on the firewall: its entry comes back.
            return [*self.conns.roll_back(conn, "not on the switch after a reconnect"),
                    Removed(conn, "not on the switch after a reconnect")]
        self.conns.reinstall(conn, now)
        return [InstallFlows(conn)]

    def _table_1_complete(self, flows: list[SwitchFlow]) -> bool:
        """Every table-1 flow of this config is on the switch."""
        found: collections.Counter[int] = collections.Counter()
        for flow in flows:
            parsed = cookies.parse(flow.cookie)
            if parsed is not None and parsed.kind is cookies.Kind.PIPELINE and parsed.key < len(self.cfg.ports) \
                    and flow.out_port == self.cfg.ports[parsed.key].fast:
                found[parsed.key] += 1
        return all(found[i] >= PIPELINE_ENTRIES for i in range(len(self.cfg.ports)))

    def _matches(self, conn: Conn, dirs: dict[bool, SwitchFlow]) -> bool:
        """The switch's pair is this connection's (a flow under its cookie with another
        tuple was not put there by this controller) in this layout."""
        return dirs[False].match == conn.orig and dirs[True].match == conn.reply and \
            self._shaped(conn.action, conn.orig.proto, dirs)

    def _shaped(self, action: Action, proto: int, dirs: dict[bool, SwitchFlow]) -> bool:
        """Both flows go on to table 1 exactly when this layout sends the pair there: a pair
        of the other layout would meet table-1 flows that are not there (a drop) or keep
        catchers nobody removes."""
        goto = goes_to_pipeline(self.version, self.cfg, action, proto, self.pipeline)
        return dirs[False].goto == goto and dirs[True].goto == goto

    def _adopt(self, kind: cookies.Kind, key: int, dirs: dict[bool, SwitchFlow], now: float) -> Conn | None:
        fwd, rev = dirs[False], dirs[True]
        if fwd.match is None or rev.match is None:
            return None
        ports = {g.fast: g for g in self.cfg.ports}
        ingress, egress = ports.get(fwd.in_port or -1), ports.get(rev.in_port or -1)
        if ingress is None or egress is None:
            return None
        if kind is cookies.Kind.SHUNT and (fwd.out_port != egress.fast or rev.out_port != ingress.fast):
            return None
        if fwd.match in self.conns.tuples or rev.match in self.conns.tuples or key in self.conns.by_key:
            return None  # (an id held by a pair of the other kind: its flows go as orphans)
        reply = fwd.match.reversed()  # sharing the address objects, as the listener's tuples do
        if rev.match != reply:
            return None  # not a pair NFShunt builds (it never shunts NAT)
        action = Action.SHUNT if kind is cookies.Kind.SHUNT else Action.BLOCK
        if not self._shaped(action, fwd.match.proto, dirs):
            return None
        # Decided by an earlier run, which deleted its entry once the switch confirmed it.
        conn = Conn(fwd.match, reply, key & 0xFFFFFFFF, action, ingress, egress, now, state=State.LIVE,
                    confirmed_time=now, adopted=True, entry_deleted=True, slot=key >> cookies.KEY_SLOT_SHIFT)
        self._remember(conn)
        return conn

    # --- conntrack ------------------------------------------------------------------------

    def conntrack_event(self, ev: ConnEvent) -> list[Command]:
        if ev.kind is EventKind.DESTROY:
            self.waiting.pop(ev.orig, None)  # gone from the firewall: nothing to shunt later
            pin = self.pins.get(ev.orig)
            if pin is not None and pin.action is Action.IGNORE and pin.ct_id == ev.ct_id:
                self._unpin(ev.orig, ev.reply)  # the connection it held back has ended
            return [Ignored(R_DESTROY, ev)]
        # A connection we handle: either side may be the new entry's original direction.
        existing = self.conns.tuples.get(ev.orig)
        if existing is not None:
            if existing.state in ACTIVE and existing.ct_id != ev.ct_id:
                # Packets still in the slow path when the flows went in re-created an entry
                # (loose pickup); the connection runs on the fast path, so it is stale.
                return [DeleteConntrack(ev.orig.family, ev.orig, ev.ct_id), Ignored(R_DUPLICATE, ev)]
            if existing.state is not State.TAKING_DOWN:
                return [Ignored(R_DUPLICATE, ev)]
        decided = self._decide(ev)
        if isinstance(decided, Ignored):
            return [decided]
        action, ingress, egress = decided
        if existing is not None:  # TAKING_DOWN: handle once the old pair is gone
            if ev.kind is EventKind.DUMP:
                # Most likely the entry whose deletion is still on its way. A connection
                # that really resumes says so with live events of its own.
                return [Ignored(R_DUPLICATE, ev)]
            existing.resume = ev
            return [Ignored(R_QUEUED, ev)]
        if self.version is None or not self.reconciled:
            return [Ignored(R_BACKUP if self.backup else R_NO_SWITCH, ev)]
        if ev.orig.family == 6 and self.version < OFP13:
            return [Ignored(R_IPV6_OF10, ev)]
        slot = self.conns.free_slot(ev.ct_id)
        if slot is None:
            # Ids are a 32-bit hash: live pairs share one now and then and take the next
            # slot; with every slot of this id taken, the connection waits on the slow path.
            self._wait(ev, front=action is Action.BLOCK)
            return [Ignored(R_ID_COLLISION, ev)]
        out: list[Command] = []
        if self.budget and self.shunts + self.blocks >= self.budget:
            if action is Action.SHUNT:
                self._wait(ev, front=False)
                return [Ignored(R_BUDGET, ev)]
            victim = self._evict_for_block(ev.received) if self._blocks_may_evict() else None
            if victim is None:
                self._wait(ev, front=True)
                return [Ignored(R_BUDGET, ev)]
            out.extend(victim)
        self.waiting.pop(ev.orig, None)
        conn = Conn(ev.orig, ev.reply, ev.ct_id, action, ingress, egress, ev.received,
                    event_kind=ev.kind, tcp_state=ev.tcp_state, mark=ev.mark, slot=slot)
        self._remember(conn)
        out.append(InstallFlows(conn))
        return out

    def _decide(self, ev: ConnEvent) -> Ignored | tuple[Action, PortGroup, PortGroup]:
        """What the mark (and an operator's pin) decided for a new or updated entry, and the
        port groups it crossed; or why nothing is to be done."""
        if ev.mark & markcodec.NFSHUNT_BITS == 0:
            return Ignored(R_UNMARKED, ev)
        mark = markcodec.decode(ev.mark)
        if not mark.complete:
            return Ignored(R_INCOMPLETE, ev)
        action = self.cfg.action_for(mark.action)  # type: ignore[arg-type]
        if action is None:
            return Ignored(R_UNKNOWN_ACTION, ev)
        pin = self.pins.get(ev.orig) if self.pins else None
        if pin is not None:
            pin.ct_id = ev.ct_id
            if pin.action is Action.IGNORE:
                return Ignored(R_PINNED, ev)
            action = pin.action
        if action is Action.IGNORE:
            return Ignored(R_POLICY_IGNORE, ev)
        ingress = self.cfg.by_physdevin.get(mark.ingress)  # type: ignore[arg-type]
        egress = self.cfg.by_physdevin.get(mark.egress)  # type: ignore[arg-type]
        if ingress is None or egress is None:
            return Ignored(R_UNKNOWN_PORT, ev)
        if ingress is egress:
            return Ignored(R_SAME_PORT, ev)
        if ev.orig.proto not in (TCP, UDP):
            return Ignored(R_PROTOCOL, ev)
        if ev.orig.proto == TCP and ev.tcp_state in TCP_CLOSING:
            return Ignored(R_CLOSING, ev)
        if ev.reply != ev.orig.reversed():
            return Ignored(R_NAT, ev)  # the switch would have to rewrite addresses
        return action, ingress, egress

    # --- room on the switch -----------------------------------------------------------------

    @staticmethod
    def _created_by(conn: Conn) -> ConnEvent:
        """The event that created the pair, made again for a retry."""
        assert conn.event_kind is not None
        return ConnEvent(conn.event_kind, conn.ct_id, conn.orig, conn.reply, conn.mark, conn.tcp_state,
                         conn.event_time)

    def _wait(self, ev: ConnEvent, front: bool) -> None:
        self.waiting[ev.orig] = ev
        if front:
            self.waiting.move_to_end(ev.orig, last=False)
        while len(self.waiting) > WAITING_MAX:
            self.waiting.popitem(last=True)

    def _blocks_may_evict(self) -> bool:
        """Blocks take room from shunts only up to `max_block_share` of the budget: a host
        that gets itself blocked on many connections cannot push every shunt off the switch."""
        budget = self.budget or (self.shunts + self.blocks)
        return self.blocks < budget * self.cfg.max_block_share

    def _evict_for_block(self, now: float) -> list[Command] | None:
        """Make room for a block: take down the newest active shunt (blocks come first)."""
        victim: Conn | None = None
        for conn in self.conns.by_key.values():
            if conn.action is Action.SHUNT and conn.state in ACTIVE and (
                    victim is None or (conn.confirmed_time or 0) >= (victim.confirmed_time or 0)):
                victim = conn
        if victim is None:
            return None
        # The budget is freed now; the evicted connection returns to the slow path alive
        # and, judged there again, waits for room like any other shunt.
        self.conns.uncount(victim)
        return self.conns.hand_back(victim, "evicted for a block", now)

    def _retry_waiting(self, room: int) -> list[Command]:
        out: list[Command] = []
        while self.waiting and room > 0:
            _, ev = self.waiting.popitem(last=False)
            got = self.conntrack_event(ev)
            if ev.orig in self.waiting:
                # Still no room, or its id still held: it was counted as ignored when it
                # first waited (counted at every retry, one collision read as thousands).
                out.extend(c for c in got if not isinstance(c, Ignored))
                break
            out.extend(got)
            if any(isinstance(c, InstallFlows) for c in got):
                room -= 1
        return out

    # --- switch feedback ------------------------------------------------------------------

    def flows_confirmed(self, conn: Conn, now: float) -> list[Command]:
        if not self.conns.holds(conn, State.PENDING):
            return []
        cfg = self.cfg
        counters = cfg.confirm == "counters" and conn.action is Action.SHUNT
        wait = (cfg.confirm_delay if cfg.confirm == "delay" else 0.0) + cfg.drain
        keep = conn.action is Action.SHUNT and (counters or wait > 0)
        self.conns.confirmed(conn, now, keep_entry=keep)
        if conn.remove_reason is not None:
            # Taken down (flush, unshunt, policy) while the switch was confirming.
            return self.conns.hand_back(conn, conn.remove_reason, now)
        installed = Installed(conn, now - conn.event_time)
        out: list[Command] = [installed]
        if conn.early is not None:
            early, conn.early = conn.early, None
            for cookie, in_port in early:
                out.extend(self.teardown_packet(cookie, in_port, now) or ())
            if conn.state is State.TAKING_DOWN:
                # It closed while the switch was confirming: its entry is put in the closing
                # state and the flows go (teardown_packet's commands).
                return out
        if conn.state is State.LIVE:
            if conn.entry_deleted:  # a re-install after a reconnect: its entry went long ago
                return out
            return [self._delete_entry(conn, now), installed]
        out.append(ReadCounters(conn) if counters else self._entry_goes(conn, wait, now))
        return out

    def _entry_goes(self, conn: Conn, wait: float, now: float) -> Command:
        """The shunt's entry goes after `wait` (now, with none)."""
        return Later(wait, (EntryDue(conn),)) if wait > 0 else self._delete_entry(conn, now)

    def _delete_entry(self, conn: Conn, now: float) -> DeleteConntrack:
        self.conns.entry_gone(conn)
        self._sweeps.append((now + SWEEP_AFTER, conn))
        return DeleteConntrack(conn.orig.family, conn.orig, conn.ct_id)

    def entry_due(self, conn: Conn, now: float) -> list[Command]:
        """The wait for a shunt's forwarding and drain is over: its entry goes, unless the
        pair was taken down meanwhile (then the entry carries the connection on)."""
        if not self.conns.holds(conn, State.DRAINING):
            return []
        return [self._delete_entry(conn, now)]

    def counters_read(self, conn: Conn, packets: dict[bool, int], now: float) -> list[Command]:
        """The pair's packet counters by direction (confirm: counters). The switch forwards
        on the flows once both directions counted packets, or one did and confirm_delay has
        passed (the other direction is idle); then the slow path drains. Until then the
        counters are read again; a pair that carries nothing at all is read every second."""
        if not self.conns.holds(conn, State.DRAINING):
            return []
        waited = now - (conn.confirmed_time or now)
        counted = sum(1 for n in packets.values() if n > 0)
        if counted == 2 or (counted == 1 and waited >= self.cfg.confirm_delay):
            return [self._entry_goes(conn, self.cfg.drain, now)]
        return [Later(COUNTER_POLL if waited < max(1.0, self.cfg.confirm_delay) else 1.0, (ReadCounters(conn),))]

    def flows_failed(self, conn: Conn, reason: str, table_full: bool = False, now: float = 0.0) -> list[Command]:
        """The switch refused a flow of this pair: withdraw the other, keep the entry. If
        its table was full, the connection waits for room (a block evicts a shunt)."""
        if not self.conns.holds(conn):
            return []
        out: list[Command] = [*self.conns.roll_back(conn, "rollback"), Refused(conn, reason)]
        if table_full and conn.event_kind is not None:
            if conn.action is Action.BLOCK and self._blocks_may_evict():
                victim = self._evict_for_block(now)
                if victim is not None:
                    out.extend(victim)
            self._wait(self._created_by(conn), front=conn.action is Action.BLOCK)
        return out

    def install_dropped(self, conn: Conn, reason: str, wait: bool) -> list[Command]:
        """An install that never went to the switch (its queue was full, or the pair was
        taken down while it waited): nothing to roll back on the switch. A first install's
        entry is kept; with `wait`, the connection waits for room like one the table refused."""
        if not self.conns.holds(conn, State.PENDING):
            return []
        out: list[Command] = [c for c in self.conns.roll_back(conn, reason) if not isinstance(c, RemoveFlows)]
        if wait and conn.event_kind is not None:
            self._wait(self._created_by(conn), front=conn.action is Action.BLOCK)
        return [*out, Refused(conn, reason)]

    def room_freed(self, room: int) -> list[Command]:
        """The switch can take `room` more installs (the flow-mod queue drained)."""
        if not self.waiting or not self.reconciled:
            return []
        return self._retry_waiting(room)

    # --- take-downs -------------------------------------------------------------------------

    def remove(self, conn: Conn, reason: str, now: float) -> list[Command]:
        """Take a pair down (flush, manual unshunt, policy change): handed back to the
        firewall alive, its next packet judged by the current policy; a pending one as soon
        as the switch confirms it."""
        if not self.conns.holds(conn, HELD):
            return []
        if conn.state is State.PENDING and not conn.entry_deleted:
            conn.remove_reason = reason  # flows_confirmed takes it down
            return []
        return self.conns.hand_back(conn, reason, now)

    def flush(self, reason: str, now: float) -> list[Command]:
        """Every shunt and block back to the slow path, where policy re-evaluates it;
        connections waiting for room are dropped from the queue (their next packet is
        judged again)."""
        out: list[Command] = []
        self.waiting.clear()
        for conn in self.conns:
            out.extend(self.remove(conn, reason, now))
        return out

    def find(self, ct_id: int | None = None, tuple_: FlowTuple | None = None) -> Conn | None:
        """A handled connection by conntrack id or by either direction's tuple."""
        if tuple_ is not None:
            return self.conns.tuples.get(tuple_)
        return self.conns.with_id(ct_id) if ct_id is not None else None

    def pin(self, orig: FlowTuple, action: Action, now: float) -> list[Command]:
        """An operator's unshunt (IGNORE) or block for a connection, by tuple: its flows
        go, and the entry its next packet re-creates on the slow path is held there
        (unshunt) or blocked. Dumping conntrack applies it to a connection that is on
        the slow path already."""
        if action not in (Action.IGNORE, Action.BLOCK):
            raise ValueError(action)
        pin = Pin(action, now + PIN_TTL)
        self.pins[orig] = self.pins[orig.reversed()] = pin
        out: list[Command] = []
        conn = self.conns.tuples.get(orig)
        if conn is not None and not (action is Action.BLOCK and conn.action is Action.BLOCK):
            out.extend(self.remove(conn, "unshunt by operator" if action is Action.IGNORE else "blocked by operator",
                                   now))
        if action is Action.BLOCK:
            out.append(ResyncConntrack())
            out.extend(self.static.block(orig, now, int(PIN_TTL)))
        else:
            out.extend(self.static.unblock(orig))
        return out

    def _unpin(self, *tuples: FlowTuple) -> None:
        for t in tuples:
            self.pins.pop(t, None)

    def teardown_packet(self, cookie: int, in_port: int, now: float) -> list[Command] | None:
        """A FIN or RST seen by a teardown flow (packet-in of its headers; the switch has
        forwarded the packet itself). An RST ends the shunt at once; a FIN only once both
        directions have sent one: after a single FIN the other side may still send data
        (half-close), and the sender's retransmissions of data in flight are still due, so
        the fast path stays. None: the packet-in names no connection of ours."""
        parsed = cookies.parse(cookie)
        if parsed is None or parsed.kind is not cookies.Kind.TEARDOWN:
            return None
        reply = parsed.reply
        conn = self.conns.named(cookies.Kind.SHUNT, parsed.key)
        if conn is None or in_port != (conn.egress.fast if reply else conn.ingress.fast):
            return None  # an orphan catcher (reconcile removes it), or not its port
        if conn.state is State.PENDING:
            if conn.early is None:
                conn.early = []
            conn.early.append((cookie, in_port))
            return []
        if conn.state not in ACTIVE:
            return []
        rst = cookies.is_rst(cookie)
        if rst:
            state, reason, closer = CT_TCP_CLOSE, "tcp rst", reply
        else:
            if conn.fins == 0:
                conn.first_fin_reply = reply
            conn.fins |= 2 if reply else 1
            if conn.fins != 3:
                self.half_closed.add(conn.key, now)
                return []
            state, reason, closer = CT_TCP_LAST_ACK, "tcp fin", conn.first_fin_reply
        self.half_closed.discard(conn.key)
        down = self.conns.hand_back(conn, reason, now, closing(state, closer))
        if rst and self.cfg.rst_grace:
            # The side that reset may have data still coming (an aborted transfer has about
            # one RTT in flight): it stays on the fast path for a moment, as it would with
            # no firewall at all, instead of meeting a firewall that tracks a closed entry.
            return [Later(self.cfg.rst_grace, tuple(down))]
        return down

    def catchers_counted(self, counted: Iterable[int], now: float) -> tuple[list[Command], int]:
        """Catchers whose packet counters show a FIN or RST (read after the switch dropped
        packet-ins, see teardown_sweep): each is taken as its packet-in. The commands, and
        how many shunts this ended."""
        out: list[Command] = []
        ended = 0
        for cookie in counted:
            parsed = cookies.parse(cookie)
            if parsed is None or parsed.kind is not cookies.Kind.TEARDOWN:
                continue
            conn = self.conns.named(cookies.Kind.SHUNT, parsed.key)
            if conn is None or conn.state not in ACTIVE:
                continue
            out.extend(self.teardown_packet(cookie, conn.egress.fast if parsed.reply else conn.ingress.fast, now) or ())
            ended += conn.state not in ACTIVE
        return out, ended

    def _half_closed(self, key: int) -> Conn | None:
        """The half-closed shunt of this key still live, else None (and the key is dropped)."""
        conn = self.conns.named(cookies.Kind.SHUNT, key)
        if conn is None or conn.state not in ACTIVE or conn.fins not in (1, 2):
            self.half_closed.discard(key)
            return None
        return conn

    def half_closed_due(self, now: float) -> HalfClosedDue:
        """Half-closed shunts due a look (teardown_sweep): in the single layout the catchers
        to read, of each the other direction's FIN and both RSTs; in the pipeline layout
        (shared catchers, no per-connection evidence) each is handed back in the closing state,
        as if its second FIN had been heard of (see teardown_sweep). Ended pairs are dropped
        from the watch."""
        due = HalfClosedDue()
        fins = []
        for key in self.half_closed.due(now):
            conn = self._half_closed(key)
            if conn is None:
                continue
            fin = cookies.make_teardown(key, conn.fins == 1, False)
            if self.pipeline:
                fins.append(fin)
                continue
            due.catchers.append(fin)
            due.catchers.extend(cookies.make_teardown(key, reply, True) for reply in (False, True))
        if fins:
            due.commands, due.ended = self.catchers_counted(fins, now)
        return due

    def flow_removed(self, cookie: int, reason: str, packets: int, nbytes: int,
                     duration: float, now: float) -> list[Command]:
        parsed = cookies.parse(cookie)
        if parsed is None or parsed.kind is cookies.Kind.DEFAULT:
            return []
        kind, key, reply = parsed
        conn = self.conns.named(kind, key)
        if conn is None or conn.state is State.PENDING:
            return []
        if conn.gone is None:
            conn.gone, conn.stats = set(), {}
        conn.gone.add(reply)
        conn.stats[reply] = FlowCount(packets, nbytes, duration)  # type: ignore[index]
        out: list[Command] = []
        if conn.state in ACTIVE:
            # Idled out (or deleted by someone else): the connection is back on the slow
            # path, idle, and may resume; the partner flow follows it.
            out.extend(self.conns.hand_back(conn, reason, now, IDLE, directions=(not reply,)))
        if len(conn.gone) == 2:
            out.extend(self._finish_removal(conn, conn.remove_reason or reason))
        return out

    def tick(self, now: float) -> list[Command]:
        """Housekeeping: a pair whose second flow-removed never came is forgotten."""
        out: list[Command] = []
        # Packets still queued in the slow path when the entry was deleted can re-create it
        # (loose pickup) in a way no event reports as ours; one sweep by tuple clears them.
        while self._sweeps and self._sweeps[0][0] <= now:
            _, conn = self._sweeps.popleft()
            if self.conns.holds(conn, State.LIVE):
                out.append(DeleteConntrack(conn.orig.family, conn.orig, None))
        if self.version is not None:  # while the switch is away, removals wait for it
            for conn in list(self.conns.removing):
                if conn.removing_since is not None and now - conn.removing_since > REMOVAL_GRACE:
                    out.extend(self._finish_removal(conn, "removal not confirmed"))
        if self.pins:
            for t in [t for t, p in self.pins.items() if p.expires <= now]:
                del self.pins[t]
        self.static.expire(now)
        return out

    def _finish_removal(self, conn: Conn, reason: str) -> list[Command]:
        self.conns.forget(conn)
        out: list[Command] = [Removed(conn, reason)]
        if conn.resume is not None:
            out.extend(self.conntrack_event(conn.resume))
        if self.waiting and self.reconciled:
            out.extend(self._retry_waiting(1))
        return out

    # --- table ------------------------------------------------------------------------------

    def default_entries(self) -> int:
        """Entries of table 0 that are not any connection's: the defaults, the static shunts."""
        return (2 * len(self.cfg.ports) if self.cfg.default_no_shunting else 0) + self.static.entries

    def shared_entries(self) -> int:
        """The pipeline layout's table 1 (its own table: not counted against table 0)."""
        return PIPELINE_ENTRIES * len(self.cfg.ports) if self.pipeline else 0

    def table_size(self, max_entries: int) -> int | None:
        """The switch reported how many entries its table 0 holds: with no `max_shunts`,
        the budget becomes what fits after the defaults, counting every pair at the most a
        pair takes (a TCP shunt with its teardown catchers). Returns the new budget."""
        self.table_max = max_entries
        if self.cfg.max_shunts or self.version is None:
            return None
        self.budget = max(1, (max_entries - self.default_entries()) // self.max_pair_entries())
        return self.budget

    def max_pair_entries(self) -> int:
        """The most entries one pair takes with this switch: a TCP shunt with catchers."""
        return max_pair_entries(self.version, self.cfg, self.pipeline)

    def _remember(self, conn: Conn) -> None:
        self.conns.remember(conn, pair_entries(self.version, self.cfg, conn, self.pipeline))
