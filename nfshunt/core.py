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
import enum
from dataclasses import dataclass
from typing import Iterable, Union

from . import cookies, markcodec
from .config import Config, PortGroup
from .model import TCP, TCP_CLOSING, UDP, ConnEvent, EventKind, FlowTuple, SwitchFlow

OFP10 = 0x01
OFP13 = 0x04
REMOVAL_GRACE = 5.0  # seconds a half-removed pair may wait for its second flow-removed
WAITING_MAX = 65536  # connections remembered while waiting for room on the switch
# Conntrack TCP states (include/uapi/linux/netfilter/nf_conntrack_tcp.h) and timeouts for
# the entry re-created on teardown.
CT_TCP_ESTABLISHED, CT_TCP_LAST_ACK, CT_TCP_CLOSE = 3, 6, 8
TEARDOWN_TIMEOUT = {CT_TCP_LAST_ACK: 30, CT_TCP_CLOSE: 10}
REEVALUATE_TIMEOUT = 300  # an ESTABLISHED entry re-created for re-evaluation (refreshed by traffic)
IDLE_RESTORE_TIMEOUT = 432000  # an idled-out TCP shunt's entry: Linux's own ESTABLISHED timeout (5 days)
SWEEP_AFTER = 1.0  # seconds after confirmation to sweep entries re-created by in-flight packets
COUNTER_POLL = 0.05  # seconds between reads of a new shunt's packet counters (confirm: counters)


class State(enum.Enum):
    PENDING = "pending"
    ACTIVE = "active"
    REMOVING = "removing"


@dataclass(eq=False, slots=True)
class Conn:
    orig: FlowTuple
    reply: FlowTuple
    ct_id: int
    action: str  # "shunt" or "block"
    ingress: PortGroup  # bridge port the original direction entered by
    egress: PortGroup
    event_time: float
    state: State = State.PENDING
    confirmed_time: float | None = None
    removing_since: float | None = None
    gone: set[bool] | None = None  # directions whose flow was removed (allocated on removal)
    stats: dict[bool, tuple[int, int, float]] | None = None
    resume: ConnEvent | None = None
    # What a retry of the event that created it needs (if the switch had no room); the
    # event itself is not kept: held until confirmation, 100,000 of them fragmented memory.
    event_kind: EventKind | None = None  # None: adopted from a switch, never retried
    tcp_state: int | None = None
    mark: int = 0  # the entry's mark: restores keep the admin's bits
    action_counted: bool = True  # still counted in the budget (an evicted pair is not)
    fins: int = 0  # FINs caught: 1 original direction, 2 reply
    first_fin_reply: bool = False
    remove_reason: str | None = None  # set when NFShunt itself takes the pair down
    adopted: bool = False  # read back from a switch, not installed from a policy decision
    entry_kept: bool = False  # ACTIVE, its conntrack entry not deleted yet (see `confirm`)
    entries: int = 2  # flow entries the pair takes on the switch (set when remembered)
    # FIN/RST packet-ins (cookie, in_port) caught before the barrier reply: the catchers
    # forward as soon as the switch has them, so a connection may close before the
    # controller knows its flows are in; they are taken once it does.
    early: list[tuple[int, int]] | None = None

    @property
    def kind(self) -> cookies.Kind:
        return cookies.Kind.SHUNT if self.action == "shunt" else cookies.Kind.BLOCK

    def cookie(self, reply: bool) -> int:
        return cookies.make(self.kind, self.ct_id, reply)

    def describe(self) -> str:
        return (f"{self.orig} ports {self.ingress.physdevin}->{self.egress.physdevin}"
                f" (switch {self.ingress.fast}<->{self.egress.fast}) ct_id={self.ct_id}")


@dataclass(slots=True)
class Pin:
    action: str  # "ignore" or "block"
    expires: float
    ct_id: int | None = None  # the entry it applied to; its DESTROY ends an unshunt pin


# --- commands ---------------------------------------------------------------------------
# Not frozen: several are made a shunt, and a frozen dataclass costs three times as much
# to build. Nothing changes a command once made.

@dataclass(slots=True)
class InstallDefaults:
    groups: tuple[PortGroup, ...]


@dataclass(slots=True)
class InstallPipeline:
    """The pipeline layout's shared table-1 flows: per port group, FIN and RST catchers
    (IPv4 and IPv6) and the output (see flows.py)."""
    groups: tuple[PortGroup, ...]


@dataclass(slots=True)
class DeleteAllFlows:
    pass


@dataclass(slots=True)
class LimitPacketIns:
    """Have the switch rate-limit the packet-ins it sends (an OpenFlow 1.3 meter on the
    controller port): a host sending FIN segments must not saturate the controller."""
    rate: int  # packets per second


@dataclass(slots=True)
class DeleteSwitchFlow:
    flow: SwitchFlow
    reason: str


@dataclass(slots=True)
class RequestSwitchFlows:
    """Read NFShunt's flows back from the switch; answer with core.reconcile()."""


@dataclass(slots=True)
class RequestTableSize:
    """Ask the switch how many entries its table 0 holds; answer with core.table_size()."""


@dataclass(slots=True)
class ResyncConntrack:
    """Dump the conntrack table and feed every entry to core.conntrack_event()."""


@dataclass(slots=True)
class InstallFlows:
    conn: Conn


@dataclass(slots=True)
class RemoveFlows:
    conn: Conn
    directions: tuple[bool, ...]
    reason: str


@dataclass(slots=True)
class RestoreConntrack:
    """Re-create the connection's conntrack entry (a closing TCP state on teardown,
    ESTABLISHED with the decision cleared on re-evaluation); run `then` once the kernel
    has acknowledged it (or refused: the flows must go either way)."""
    conn: Conn
    tcp_state: int
    timeout: int
    closer_is_reply: bool
    then: tuple["Command", ...]
    mark: int = 0


@dataclass(slots=True)
class Later:
    """Run `commands` after `delay` seconds (the app's timer posts them back)."""
    delay: float
    commands: tuple["Command", ...]


@dataclass(slots=True)
class EntryDue:
    """The shunt's conntrack entry may go now (answer with core.entry_due())."""
    conn: Conn


@dataclass(slots=True)
class ReadCounters:
    """Read the pair's packet counters from the switch (answer with core.counters_read())."""
    conn: Conn


@dataclass(slots=True)
class DeleteConntrack:
    family: int
    orig: FlowTuple
    ct_id: int | None  # None: whatever entry holds this tuple


@dataclass(slots=True)
class Ignored:
    reason: str
    event: ConnEvent


@dataclass(slots=True)
class Installed:
    conn: Conn
    latency: float  # seconds from the event being read to the switch's confirmation


@dataclass(slots=True)
class Refused:
    conn: Conn
    reason: str


@dataclass(slots=True)
class Removed:
    conn: Conn
    reason: str


Command = Union[InstallDefaults, InstallPipeline, DeleteAllFlows, LimitPacketIns, DeleteSwitchFlow, RequestSwitchFlows,
                RequestTableSize, ResyncConntrack, InstallFlows, RemoveFlows, DeleteConntrack, Later, EntryDue,
                ReadCounters, Ignored, Installed, Refused, Removed, RestoreConntrack]

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


def catches_teardown(version: int | None, cfg: Config, conn: Conn) -> bool:
    """A TCP shunt on OpenFlow 1.3 gets FIN and RST catchers (see the module's docstring)."""
    return version != OFP10 and cfg.tcp_teardown and conn.action == "shunt" and conn.orig.proto == TCP


PIPELINE_ENTRIES = 5  # table-1 flows per port group: FIN and RST catchers for IPv4 and IPv6, the output
PIPELINE_READ_AGAIN = 0.1  # seconds: table 1 read back incomplete at connect (a lagging switch), read again
PIPELINE_READS = 50  # ... this many times (5 s), then reconcile anyway (and say so)


def pair_entries(version: int | None, cfg: Config, conn: Conn, pipeline: bool = False) -> int:
    """Flow entries a pair takes on the switch: two, and in the single-table layout four
    catchers with teardown (the pipeline layout shares its catchers per port group)."""
    return 6 if not pipeline and catches_teardown(version, cfg, conn) else 2


def goes_to_pipeline(version: int | None, cfg: Config, action: str, proto: int, pipeline: bool) -> bool:
    """Whether a pair's table-0 flows go on to table 1 (pipeline layout, TCP shunt with
    teardown) instead of outputting (or dropping) themselves."""
    return pipeline and version != OFP10 and cfg.tcp_teardown and action == "shunt" and proto == TCP


class Core:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.version: int | None = None  # negotiated OpenFlow version; None: no switch (or not master)
        self.pipeline = False  # the switch's flows use the pipeline layout (two tables)
        self.pipeline_reads = 0  # reads of the switch's flows at connect that lacked table-1 flows
        self.backup = cfg.pair is not None  # one of a pair, not (yet) granted MASTER
        # Every pair by conntrack id (what its cookies name), keyed by an int the pair holds
        # anyway: 100,000 pairs took 10 MB more as a table by original tuple and another
        # by cookie (a new int each). `tuples` serves lookups by either direction.
        self.by_id: dict[int, Conn] = {}
        self.tuples: dict[FlowTuple, Conn] = {}  # both directions' tuples -> conn
        self.reconciled = False
        self.shunts = 0  # shunt pairs in the table
        self.blocks = 0  # block pairs in the table (with shunts: counted against the budget)
        self.budget = cfg.max_shunts  # pairs allowed at once (0: no limit)
        self.table_max: int | None = None  # entries the switch's table 0 holds, as it reported them
        self.entries = 0  # entries NFShunt's pairs take on the switch (defaults not included)
        # Connections refused for lack of room, oldest first; blocks go to the front.
        self.waiting: collections.OrderedDict[FlowTuple, ConnEvent] = collections.OrderedDict()
        # Operator overrides by tuple (both directions): "ignore" (unshunt) or "block".
        self.pins: dict[FlowTuple, Pin] = {}
        self._sweeps: collections.deque[tuple[float, Conn]] = collections.deque()
        self._removing: set[Conn] = set()  # so tick() need not scan every connection

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
        if self.cfg.default_no_shunting:
            out.append(InstallDefaults(self.cfg.ports))
        if pipeline:
            out.append(InstallPipeline(self.cfg.ports))
        if version >= OFP13 and self.cfg.tcp_teardown and self.cfg.packet_in_rate:
            out.append(LimitPacketIns(self.cfg.packet_in_rate))
        out.append(RequestTableSize())
        out.append(RequestSwitchFlows())
        return out

    def stopping(self) -> list[Command]:
        """Shutting down: nothing new goes onto the switch from now on (a pair that leaves
        must not let a queued connection take its place), and every pair is taken down."""
        self.version = None
        self.reconciled = False
        return [RemoveFlows(conn, (False, True), "controller stopped") for conn in self.by_id.values()]

    def stand_by(self) -> list[Command]:
        """In a pair, no longer master: the other controller programs the switch now and
        owns every pair on it (it adopts them), so they are forgotten here, not removed.
        Pending installs were never confirmed: their entries stay on the slow path."""
        out = self.switch_disconnected()
        for conn in list(self.by_id.values()):
            self._forget(conn)
        self.waiting.clear()
        self._sweeps.clear()
        self.reconciled = False
        self.backup = True
        return out

    def switch_disconnected(self) -> list[Command]:
        """Pending installs are abandoned: their conntrack entries were never deleted, so
        the connections stay on the slow path and the resync on reconnect retries them."""
        self.version = None
        out: list[Command] = []
        for conn in [c for c in self.by_id.values() if c.state is State.PENDING]:
            self._forget(conn)
            out.append(Refused(conn, "switch disconnected before confirming"))
        return out

    def reconcile(self, flows: Iterable[SwitchFlow], now: float) -> list[Command]:
        """Bring the switch and the table into agreement after a (re)connect.

        Complete shunt/block pairs that match the config are adopted (never bounced);
        connections we know of that the switch lost are installed again; NFShunt flows
        nobody accounts for are deleted when delete_flows_on_startup is set.
        """
        if self.reconciled:  # a read asked for before a reconnect, answered after this one's
            return []
        flows = list(flows)
        if self.pipeline and not self._table_1_complete(flows) and self.pipeline_reads < PIPELINE_READS:
            # A switch that applies flow-mods after its barrier (hardware) may not have table
            # 1 yet: a shunt sent there now would have its packets dropped at the table miss.
            self.pipeline_reads += 1
            return [Later(PIPELINE_READ_AGAIN, (RequestSwitchFlows(),))]
        out: list[Command] = []
        pairs: dict[tuple[cookies.Kind, int], dict[bool, SwitchFlow]] = {}
        catchers: list[tuple[int, SwitchFlow]] = []
        expected_defaults = {(g.slow, g.fast) for g in self.cfg.ports} | {(g.fast, g.slow) for g in self.cfg.ports}
        for flow in flows:
            parsed = cookies.parse(flow.cookie)
            if parsed is None:
                continue
            kind, ct_id, reply = parsed
            if kind is cookies.Kind.DEFAULT:
                # In a pair, another firewall's defaults are the peer's: it no longer decides.
                if (flow.in_port, flow.out_port) not in expected_defaults and (
                        self.cfg.delete_flows_on_startup or self.cfg.pair is not None):
                    out.append(DeleteSwitchFlow(flow, "default flow not in config"))
                continue
            if kind is cookies.Kind.TEARDOWN:
                catchers.append((ct_id, flow))
                continue
            if kind is cookies.Kind.PIPELINE:
                # Table-1 flows of a port group (re-installed at every connect), or of
                # another layout or port list: those are only reachable by flows of ours
                # that are deleted too, so they go whatever delete_flows_on_startup says.
                if not self.pipeline or ct_id >= len(self.cfg.ports) or \
                        flow.out_port != self.cfg.ports[ct_id].fast:
                    out.append(DeleteSwitchFlow(flow, "table-1 flow not in this layout"))
                continue
            pairs.setdefault((kind, ct_id), {})[reply] = flow
        present: set[int] = set()
        for (kind, ct_id), dirs in pairs.items():
            conn = self._named(kind, ct_id)
            if conn is None and len(dirs) == 2:
                conn = self._adopt(kind, ct_id, dirs, now)
            if conn is not None and len(dirs) == 2 and self._matches(conn, dirs):
                present.add(id(conn))
                continue
            if self.cfg.delete_flows_on_startup or conn is None:
                for flow in dirs.values():
                    out.append(DeleteSwitchFlow(flow, "orphan: half a pair or not in config"))
        for ct_id, flow in catchers:
            conn = self._named(cookies.Kind.SHUNT, ct_id)
            if conn is None or id(conn) not in present:
                out.append(DeleteSwitchFlow(flow, "orphan teardown catcher"))
        for conn in list(self.by_id.values()):
            if conn.state is State.REMOVING:
                # Taken down while the switch was away (flush, unshunt, block, policy):
                # the decision holds, whatever the switch still has.
                if id(conn) in present:
                    conn.removing_since = now
                    out.append(RemoveFlows(conn, (False, True), conn.remove_reason or "removal"))
                else:
                    out.extend(self._finish_removal(conn, conn.remove_reason or "removal"))
            elif conn.state is State.ACTIVE and id(conn) not in present:
                if conn.adopted:
                    # Read back from a switch, never decided here: nothing to re-install.
                    self._forget(conn)
                    out.append(Removed(conn, "not on the switch after a reconnect"))
                    continue
                conn.state = State.PENDING
                conn.event_time = now
                out.append(InstallFlows(conn))
        self.reconciled = True
        out.append(ResyncConntrack())
        return out

    def _table_1_complete(self, flows: list[SwitchFlow]) -> bool:
        """Every table-1 flow of this config is on the switch."""
        found = collections.Counter()
        for flow in flows:
            parsed = cookies.parse(flow.cookie)
            if parsed is not None and parsed[0] is cookies.Kind.PIPELINE and parsed[1] < len(self.cfg.ports) \
                    and flow.out_port == self.cfg.ports[parsed[1]].fast:
                found[parsed[1]] += 1
        return all(found[i] >= PIPELINE_ENTRIES for i in range(len(self.cfg.ports)))

    def _matches(self, conn: Conn, dirs: dict[bool, SwitchFlow]) -> bool:
        """The switch's pair is this connection's (a flow under its cookie with another
        tuple was not put there by this controller) in this layout."""
        return dirs[False].match == conn.orig and dirs[True].match == conn.reply and \
            self._shaped(conn.action, conn.orig.proto, dirs)

    def _shaped(self, action: str, proto: int, dirs: dict[bool, SwitchFlow]) -> bool:
        """Both flows go on to table 1 exactly when this layout sends the pair there: a pair
        of the other layout would meet table-1 flows that are not there (a drop) or keep
        catchers nobody removes."""
        goto = goes_to_pipeline(self.version, self.cfg, action, proto, self.pipeline)
        return dirs[False].goto == goto and dirs[True].goto == goto

    def _adopt(self, kind: cookies.Kind, ct_id: int, dirs: dict[bool, SwitchFlow], now: float) -> Conn | None:
        fwd, rev = dirs[False], dirs[True]
        if fwd.match is None or rev.match is None:
            return None
        ports = {g.fast: g for g in self.cfg.ports}
        ingress, egress = ports.get(fwd.in_port or -1), ports.get(rev.in_port or -1)
        if ingress is None or egress is None:
            return None
        if kind is cookies.Kind.SHUNT and (fwd.out_port != egress.fast or rev.out_port != ingress.fast):
            return None
        if fwd.match in self.tuples or rev.match in self.tuples or ct_id in self.by_id:
            return None  # (an id held by a pair of the other kind: its flows go as orphans)
        reply = fwd.match.reversed()  # sharing the address objects, as the listener's tuples do
        if rev.match != reply:
            return None  # not a pair NFShunt builds (it never shunts NAT)
        if not self._shaped("shunt" if kind is cookies.Kind.SHUNT else "block", fwd.match.proto, dirs):
            return None
        conn = Conn(fwd.match, reply, ct_id, "shunt" if kind is cookies.Kind.SHUNT else "block",
                    ingress, egress, now, state=State.ACTIVE, confirmed_time=now, adopted=True)
        self._remember(conn)
        return conn

    # --- conntrack ------------------------------------------------------------------------

    def conntrack_event(self, ev: ConnEvent) -> list[Command]:
        if ev.kind is EventKind.DESTROY:
            self.waiting.pop(ev.orig, None)  # gone from the firewall: nothing to shunt later
            pin = self.pins.get(ev.orig)
            if pin is not None and pin.action == "ignore" and pin.ct_id == ev.ct_id:
                self._unpin(ev.orig, ev.reply)  # the connection it held back has ended
            return [Ignored(R_DESTROY, ev)]
        # A connection we handle: either side may be the new entry's original direction.
        existing = self.tuples.get(ev.orig)
        if existing is not None:
            if existing.state is State.ACTIVE and existing.ct_id != ev.ct_id:
                # Packets still in the slow path when the flows went in re-created an entry
                # (loose pickup); the connection runs on the fast path, so it is stale.
                return [DeleteConntrack(ev.orig.family, ev.orig, ev.ct_id), Ignored(R_DUPLICATE, ev)]
            if existing.state is not State.REMOVING:
                return [Ignored(R_DUPLICATE, ev)]
        if ev.mark & markcodec.NFSHUNT_BITS == 0:
            return [Ignored(R_UNMARKED, ev)]
        mark = markcodec.decode(ev.mark)
        if not mark.complete:
            return [Ignored(R_INCOMPLETE, ev)]
        action = self.cfg.action_name(mark.action)  # type: ignore[arg-type]
        if action is None:
            return [Ignored(R_UNKNOWN_ACTION, ev)]
        pin = self.pins.get(ev.orig) if self.pins else None
        if pin is not None:
            pin.ct_id = ev.ct_id
            if pin.action == "ignore":
                return [Ignored(R_PINNED, ev)]
            action = pin.action
        if action == "ignore":
            return [Ignored(R_POLICY_IGNORE, ev)]
        ingress = self.cfg.by_physdevin.get(mark.ingress)  # type: ignore[arg-type]
        egress = self.cfg.by_physdevin.get(mark.egress)  # type: ignore[arg-type]
        if ingress is None or egress is None:
            return [Ignored(R_UNKNOWN_PORT, ev)]
        if ingress is egress:
            return [Ignored(R_SAME_PORT, ev)]
        if ev.orig.proto not in (TCP, UDP):
            return [Ignored(R_PROTOCOL, ev)]
        if ev.orig.proto == TCP and ev.tcp_state in TCP_CLOSING:
            return [Ignored(R_CLOSING, ev)]
        if ev.reply != ev.orig.reversed():
            return [Ignored(R_NAT, ev)]  # the switch would have to rewrite addresses
        if existing is not None:  # REMOVING: handle once the old pair is gone
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
        if ev.ct_id in self.by_id:
            # Ids are 32 bits and reused: a live pair has this one. The connection waits
            # on the slow path until that pair is gone, so no pair ever stands for two.
            self._wait(ev, front=action == "block")
            return [Ignored(R_ID_COLLISION, ev)]
        out: list[Command] = []
        if self.budget and self.shunts + self.blocks >= self.budget:
            if action == "shunt":
                self._wait(ev, front=False)
                return [Ignored(R_BUDGET, ev)]
            victim = self._evict_for_block(ev.received) if self._blocks_may_evict() else None
            if victim is None:
                self._wait(ev, front=True)
                return [Ignored(R_BUDGET, ev)]
            out.append(victim)
        self.waiting.pop(ev.orig, None)
        conn = Conn(ev.orig, ev.reply, ev.ct_id, action, ingress, egress, ev.received,
                    event_kind=ev.kind, tcp_state=ev.tcp_state, mark=ev.mark)
        self._remember(conn)
        out.append(InstallFlows(conn))
        return out

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

    def _evict_for_block(self, now: float) -> RemoveFlows | None:
        """Make room for a block: take down the newest active shunt (blocks come first)."""
        victim: Conn | None = None
        for conn in self.by_id.values():
            if conn.action == "shunt" and conn.state is State.ACTIVE and (
                    victim is None or (conn.confirmed_time or 0) >= (victim.confirmed_time or 0)):
                victim = conn
        if victim is None:
            return None
        # The budget is freed now; the evicted connection returns to the slow path and,
        # re-created there by its next packet, waits for room like any other shunt.
        self._start_removal(victim, "evicted for a block", now)
        self._count(victim, -1)
        victim.action_counted = False
        return RemoveFlows(victim, (False, True), "evicted for a block")

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
        if self.by_id.get(conn.ct_id) is not conn or conn.state is not State.PENDING:
            return []
        conn.state = State.ACTIVE
        conn.confirmed_time = now
        if conn.remove_reason is not None:
            # Taken down (flush, unshunt, policy) while the switch was confirming: the
            # entry is kept, so the connection goes on through the firewall.
            reason = conn.remove_reason
            self._start_removal(conn, reason, now)
            return [RemoveFlows(conn, (False, True), reason)]
        installed = Installed(conn, now - conn.event_time)
        if conn.early is not None:
            early, conn.early = conn.early, None
            out: list[Command] = [installed]
            for cookie, in_port in early:
                out.extend(self.teardown_packet(cookie, in_port, now) or ())
            if conn.state is State.REMOVING:
                # It closed while the switch was confirming: its entry, never deleted, is
                # put in the closing state and the flows go (teardown_packet's commands).
                return out
        cfg = self.cfg
        if cfg.confirm == "counters" and conn.action == "shunt":
            conn.entry_kept = True
            return [installed, ReadCounters(conn)]
        wait = (cfg.confirm_delay if cfg.confirm == "delay" else 0.0) + cfg.drain
        if wait and conn.action == "shunt":
            conn.entry_kept = True
            return [installed, self._entry_goes(conn, wait, now)]
        return [self._delete_entry(conn, now), installed]

    def _entry_goes(self, conn: Conn, wait: float, now: float) -> Command:
        """The shunt's entry goes after `wait` (now, with none)."""
        return Later(wait, (EntryDue(conn),)) if wait > 0 else self._delete_entry(conn, now)

    def _delete_entry(self, conn: Conn, now: float) -> DeleteConntrack:
        conn.entry_kept = False
        self._sweeps.append((now + SWEEP_AFTER, conn))
        return DeleteConntrack(conn.orig.family, conn.orig, conn.ct_id)

    def entry_due(self, conn: Conn, now: float) -> list[Command]:
        """The wait for a shunt's forwarding and drain is over: its entry goes, unless the
        pair was taken down meanwhile (then the entry carries the connection on)."""
        if self.by_id.get(conn.ct_id) is not conn or conn.state is not State.ACTIVE or not conn.entry_kept:
            return []
        return [self._delete_entry(conn, now)]

    def counters_read(self, conn: Conn, packets: dict[bool, int], now: float) -> list[Command]:
        """The pair's packet counters by direction (confirm: counters). The switch forwards
        on the flows once both directions counted packets, or one did and confirm_delay has
        passed (the other direction is idle); then the slow path drains. Until then the
        counters are read again; a pair that carries nothing at all is read every second."""
        if self.by_id.get(conn.ct_id) is not conn or conn.state is not State.ACTIVE or not conn.entry_kept:
            return []
        waited = now - (conn.confirmed_time or now)
        counted = sum(1 for n in packets.values() if n > 0)
        if counted == 2 or (counted == 1 and waited >= self.cfg.confirm_delay):
            return [self._entry_goes(conn, self.cfg.drain, now)]
        return [Later(COUNTER_POLL if waited < max(1.0, self.cfg.confirm_delay) else 1.0, (ReadCounters(conn),))]

    def flows_failed(self, conn: Conn, reason: str, table_full: bool = False, now: float = 0.0) -> list[Command]:
        """The switch refused a flow of this pair: withdraw the other, keep the entry. If
        its table was full, the connection waits for room (a block evicts a shunt)."""
        if self.by_id.get(conn.ct_id) is not conn:
            return []
        self._forget(conn)
        out: list[Command] = [RemoveFlows(conn, (False, True), "rollback"), Refused(conn, reason)]
        if table_full and conn.event_kind is not None:
            if conn.action == "block" and self._blocks_may_evict():
                victim = self._evict_for_block(now)
                if victim is not None:
                    out.append(victim)
            self._wait(self._created_by(conn), front=conn.action == "block")
        return out

    def install_dropped(self, conn: Conn, reason: str, wait: bool) -> list[Command]:
        """An install that never went to the switch (its queue was full, or the pair was
        taken down while it waited): nothing to roll back on the switch, the entry is kept.
        With `wait`, the connection waits for room like one the table refused."""
        if self.by_id.get(conn.ct_id) is not conn or conn.state is not State.PENDING:
            return []
        self._forget(conn)
        if wait and conn.event_kind is not None:
            self._wait(self._created_by(conn), front=conn.action == "block")
        return [Refused(conn, reason)]

    def room_freed(self, room: int) -> list[Command]:
        """The switch can take `room` more installs (the flow-mod queue drained)."""
        if not self.waiting or not self.reconciled:
            return []
        return self._retry_waiting(room)

    def _start_removal(self, conn: Conn, reason: str, now: float) -> None:
        conn.state = State.REMOVING
        conn.removing_since = now
        conn.remove_reason = conn.remove_reason or reason
        self._removing.add(conn)

    def remove(self, conn: Conn, reason: str, now: float, reevaluate: bool = False) -> list[Command]:
        """Take a pair down (flush, manual unshunt, policy change); a pending one as soon
        as the switch confirms it. With `reevaluate`, a TCP connection's entry is first
        re-created ESTABLISHED with the policy decision cleared, so its next packet is
        judged by the current policy and a strict firewall does not drop it as INVALID."""
        if self.by_id.get(conn.ct_id) is not conn:
            return []
        if conn.state is State.PENDING:
            conn.remove_reason = reason
            return []
        if conn.state is not State.ACTIVE:
            return []
        self._start_removal(conn, reason, now)
        remove = RemoveFlows(conn, (False, True), reason)
        if reevaluate and conn.orig.proto == TCP and self.version is not None:
            return [self._reopen(conn, REEVALUATE_TIMEOUT, remove)]
        return [remove]

    @staticmethod
    def _reopen(conn: Conn, timeout: int, then: Command) -> RestoreConntrack:
        """The TCP connection's entry (re-)created ESTABLISHED with the policy's decision
        cleared, then `then`: its next packet crosses the firewall, which judges it again."""
        mark = conn.mark & ~markcodec.DECISION_MASK
        return RestoreConntrack(conn, CT_TCP_ESTABLISHED, timeout, False, (then,), mark)

    def flush(self, reason: str, now: float, reevaluate: bool = False) -> list[Command]:
        """Every shunt and block back to the slow path, where policy re-evaluates it;
        connections waiting for room are dropped from the queue (their next packet is
        judged again)."""
        out: list[Command] = []
        self.waiting.clear()
        for conn in list(self.by_id.values()):
            out.extend(self.remove(conn, reason, now, reevaluate))
        return out

    def find(self, ct_id: int | None = None, tuple_: FlowTuple | None = None) -> Conn | None:
        """A handled connection by conntrack id or by either direction's tuple."""
        if tuple_ is not None:
            return self.tuples.get(tuple_)
        return self.by_id.get(ct_id) if ct_id is not None else None

    def _named(self, kind: cookies.Kind, ct_id: int) -> Conn | None:
        """The pair a cookie of this kind and conntrack id names."""
        conn = self.by_id.get(ct_id)
        return conn if conn is not None and conn.kind is kind else None

    def pin(self, orig: FlowTuple, action: str, now: float) -> list[Command]:
        """An operator's unshunt ("ignore") or block for a connection, by tuple: its flows
        go, and the entry its next packet re-creates on the slow path is held there
        (unshunt) or blocked. Dumping conntrack applies it to a connection that is on
        the slow path already."""
        if action not in ("ignore", "block"):
            raise ValueError(action)
        pin = Pin(action, now + PIN_TTL)
        self.pins[orig] = self.pins[orig.reversed()] = pin
        out: list[Command] = []
        conn = self.tuples.get(orig)
        if conn is not None and not (action == "block" and conn.action == "block"):
            out.extend(self.remove(conn, "unshunt by operator" if action == "ignore" else "blocked by operator", now))
        if action == "block":
            out.append(ResyncConntrack())
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
        if parsed is None or parsed[0] is not cookies.Kind.TEARDOWN:
            return None
        _, ct_id, reply = parsed
        conn = self._named(cookies.Kind.SHUNT, ct_id)
        if conn is None or in_port != (conn.egress.fast if reply else conn.ingress.fast):
            return None  # an orphan catcher (reconcile removes it), or not its port
        out: list[Command] = []
        if conn.state is State.PENDING:
            if conn.early is None:
                conn.early = []
            conn.early.append((cookie, in_port))
            return out
        if conn.state is not State.ACTIVE:
            return out
        rst = cookies.is_rst(cookie)
        if rst:
            state, reason, closer = CT_TCP_CLOSE, "tcp rst", reply
        else:
            if conn.fins == 0:
                conn.first_fin_reply = reply
            conn.fins |= 2 if reply else 1
            if conn.fins != 3:
                return out
            state, reason, closer = CT_TCP_LAST_ACK, "tcp fin", conn.first_fin_reply
        self._start_removal(conn, reason, now)
        restore = RestoreConntrack(conn, state, TEARDOWN_TIMEOUT[state], closer,
                                   (RemoveFlows(conn, (False, True), reason),), conn.mark)
        if rst and self.cfg.rst_grace:
            # The side that reset may have data still coming (an aborted transfer has about
            # one RTT in flight): it stays on the fast path for a moment, as it would with
            # no firewall at all, instead of meeting a firewall that tracks a closed entry.
            out.append(Later(self.cfg.rst_grace, (restore,)))
        else:
            out.append(restore)
        return out

    def catchers_counted(self, counted: Iterable[int], now: float) -> tuple[list[Command], int]:
        """Catchers whose packet counters show a FIN or RST (read after the switch dropped
        packet-ins, see teardown_sweep): each is taken as its packet-in. The commands, and
        how many shunts this ended."""
        out: list[Command] = []
        ended = 0
        for cookie in counted:
            parsed = cookies.parse(cookie)
            if parsed is None or parsed[0] is not cookies.Kind.TEARDOWN:
                continue
            conn = self._named(cookies.Kind.SHUNT, parsed[1])
            if conn is None or conn.state is not State.ACTIVE:
                continue
            out.extend(self.teardown_packet(cookie, conn.egress.fast if parsed[2] else conn.ingress.fast, now) or ())
            ended += conn.state is not State.ACTIVE
        return out, ended

    def flow_removed(self, cookie: int, reason: str, packets: int, nbytes: int,
                     duration: float, now: float) -> list[Command]:
        parsed = cookies.parse(cookie)
        if parsed is None or parsed[0] is cookies.Kind.DEFAULT:
            return []
        kind, ct_id, reply = parsed
        conn = self._named(kind, ct_id)
        if conn is None or conn.state is State.PENDING:
            return []
        if conn.gone is None:
            conn.gone, conn.stats = set(), {}
        conn.gone.add(reply)
        conn.stats[reply] = (packets, nbytes, duration)  # type: ignore[index]
        out: list[Command] = []
        if conn.state is State.ACTIVE:
            kept = conn.entry_kept
            self._start_removal(conn, reason, now)
            partner = RemoveFlows(conn, (not reply,), f"partner {reason}")
            if conn.action == "shunt" and conn.orig.proto == TCP and not kept and self.version is not None:
                # The connection is back on the slow path, idle, and may resume: a firewall
                # without loose pickup would drop its next packet as INVALID. Its entry comes
                # back first (and the policy shunts it again).
                out.append(self._reopen(conn, IDLE_RESTORE_TIMEOUT, partner))
            else:
                out.append(partner)
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
            if conn.state is State.ACTIVE and self.by_id.get(conn.ct_id) is conn:
                out.append(DeleteConntrack(conn.orig.family, conn.orig, None))
        if self.version is not None:  # while the switch is away, removals wait for it
            for conn in list(self._removing):
                if conn.removing_since is not None and now - conn.removing_since > REMOVAL_GRACE:
                    out.extend(self._finish_removal(conn, "removal not confirmed"))
        if self.pins:
            for t in [t for t, p in self.pins.items() if p.expires <= now]:
                del self.pins[t]
        return out

    def _finish_removal(self, conn: Conn, reason: str) -> list[Command]:
        self._forget(conn)
        out: list[Command] = [Removed(conn, reason)]
        if conn.resume is not None:
            out.extend(self.conntrack_event(conn.resume))
        if self.waiting and self.reconciled:
            out.extend(self._retry_waiting(1))
        return out

    # --- table ------------------------------------------------------------------------------

    def _count(self, conn: Conn, delta: int) -> None:
        if conn.action == "shunt":
            self.shunts += delta
        else:
            self.blocks += delta

    def default_entries(self) -> int:
        """Entries of table 0 that are not any connection's."""
        return 2 * len(self.cfg.ports) if self.cfg.default_no_shunting else 0

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
        return 6 if self.version != OFP10 and self.cfg.tcp_teardown and not self.pipeline else 2

    def _remember(self, conn: Conn) -> None:
        self.by_id[conn.ct_id] = conn
        self.tuples[conn.orig] = self.tuples[conn.reply] = conn
        self._count(conn, 1)
        conn.entries = pair_entries(self.version, self.cfg, conn, self.pipeline)
        self.entries += conn.entries

    def _forget(self, conn: Conn) -> None:
        self._removing.discard(conn)
        if self.by_id.get(conn.ct_id) is conn:
            del self.by_id[conn.ct_id]
            self.entries -= conn.entries
            if conn.action_counted:
                self._count(conn, -1)
        for t in (conn.orig, conn.reply):
            if self.tuples.get(t) is conn:
                del self.tuples[t]
