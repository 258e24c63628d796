"""The decision core: conntrack events and switch feedback in, commands out. No I/O.

The switch side (switch_app) executes InstallFlows / RemoveFlows / DeleteConntrack and
reports back through flows_confirmed / flows_failed / flow_removed; everything else a
command carries (Ignored, Installed, Refused, Removed) is for logs and counters.

`Core` is the one object the app calls for a switch: it holds the switch's lifecycle
(connect, reload, stop, stand by, disconnect), the housekeeping tick and the table's size,
and hands the rest to its parts, each given the state they share (core_state.CoreState):

- admission: an event decided (the mark, an operator's pin, the port groups), the budget,
  the connections waiting for room, a block's eviction of a shunt;
- confirmation: the switch's answer to an install, and when the shunt's entry goes;
- teardown: a TCP shunt's FIN and RST caught, its close handed back and watched;
- removal: take-downs asked for, flows the switch removed, a pair's end;
- reconcile: the switch's flows read back after a (re)connect, pairs adopted or repaired.

A connection's states and the one take-down are connection.py's; the entries a pair
takes on the switch layout.py's; the operator's pins pins.py's.
"""
from __future__ import annotations

from typing import Generic, Iterable, TypeVar, cast, overload

from nfshunt.config.settings import Config
from nfshunt.config.static import Network
from nfshunt.config.switch import SwitchConfig
from nfshunt.records.model import OFP13, ConnEvent, FlowTuple, NextHop, SwitchFlow
from nfshunt.records.routed import Answer
from nfshunt.records.segment import Segment

from . import nat
from .admission import Admission, Verdict
from .close_watch import CloseWatch
from .commands import (
    AdoptedHopsKnown,
    Command,
    DeleteAllFlows,
    EntryFound,
    InstallDefaults,
    InstallPipeline,
    Later,
    LimitPacketIns,
    Refused,
    RemoveFlows,
    RequestKeptDefaults,
    RequestSwitchFlows,
    RequestTableSize,
)
from .confirmation import Confirmation
from .connection import ACTIVE, Action, Conn, State
from .layout import PIPELINE_ENTRIES, max_pair_entries, watches_closes
from .overrides import Overrides
from .pins import PIN_TTL, IdsHold
from .reconcile import Reconciler, default_paths, table_1_complete
from .removal import Removal
from .state import CoreState
from .static_table import StaticChange
from .tables import TableNews
from .teardown import HalfClosedDue, Teardown

PIPELINE_READ_AGAIN = 0.1  # seconds: table 1 read back incomplete at connect (a lagging switch), read again
PIPELINE_READS = 50  # ... this many times (5 s), then reconcile anyway (and say so)
T = TypeVar("T")


class _Shared(Generic[T]):
    """A Core attribute that is the parts' shared state's, read and written through it
    (T: its type in CoreState, so that reads through the Core are checked)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, core: None, owner: type | None = None) -> _Shared[T]: ...
    @overload
    def __get__(self, core: Core, owner: type | None = None) -> T: ...

    def __get__(self, core: Core | None, owner: type | None = None) -> T | _Shared[T]:
        return self if core is None else cast(T, getattr(core.shared, self.name))

    def __set__(self, core: Core, value: T) -> None:
        setattr(core.shared, self.name, value)


class Core:
    # The switch as the core knows it (core_state.py says what each one means).
    cfg: _Shared[Config] = _Shared()  # the controller's keys
    switch: _Shared[SwitchConfig] = _Shared()  # this switch's own keys
    version: _Shared[int | None] = _Shared()
    pipeline: _Shared[bool] = _Shared()
    backup: _Shared[bool] = _Shared()
    reconciled: _Shared[bool] = _Shared()
    stale_policy: _Shared[bool] = _Shared()  # set by the app at start (policy_state.py)
    budget: _Shared[int] = _Shared()

    def __init__(self, cfg: Config, switch: SwitchConfig | None = None):
        """switch: which of cfg.switches this core decides for (the first by default)."""
        sh = self.shared = CoreState(cfg, cfg.switches[0] if switch is None else switch)
        # The shared tables, read by status, metrics and tests (never rebound); a re-evaluation's clearing.
        self.conns, self.waiting, self.pins, self.static, self.half_closed, self.clearing = \
            sh.conns, sh.waiting, sh.pins, sh.static, sh.half_closed, sh.clearing
        self.table_max: int | None = None  # entries the switch's table 0 holds, as it reported them
        self.pipeline_reads = 0  # reads of the switch's flows at connect that lacked table-1 flows
        self._admission = Admission(sh)
        self._teardown = Teardown(sh)
        self._removal = Removal(sh, self._admission)
        self._confirmation = Confirmation(sh, self._admission, self._teardown)
        self._overrides = Overrides(sh)
        self._reconciler = Reconciler(sh, self._removal, self._overrides)
        self._tables = TableNews(sh, self._admission, self._reconciler.routed)

    # Read by status, metrics and tests; the table itself is connection.py's.
    @property
    def by_key(self) -> dict[int, Conn]:
        return self.conns.by_key

    @property
    def table_kept(self) -> bool | None:
        """Whether the switch kept its table across the break (RequestKeptDefaults)."""
        return self.shared.table_kept

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
        sh, cfg, switch = self.shared, self.shared.cfg, self.shared.switch
        sh.version = version
        sh.pipeline = pipeline
        self.pipeline_reads = 0
        sh.backup = False
        sh.reconciled = False
        sh.table_kept = None
        out: list[Command] = []
        if cfg.delete_foreign_flows_on_startup:
            out.append(DeleteAllFlows())  # (pairs lost to it are ours to install again: no question asked)
        elif cfg.default_no_shunting and version >= OFP13:
            # Asked first, before the defaults go again: whether the switch kept its table
            # tells a pair that timed out while it was away from one it lost (reconcile.py).
            out.append(RequestKeptDefaults())
        out.extend(sh.static.connected())  # before the defaults: their first frame never crosses the firewall
        out.extend(sh.address_blocks.connected())  # likewise: a blocked host's first frame is dropped
        if cfg.default_no_shunting:
            out.append(InstallDefaults(switch.ports))
        if pipeline:
            out.append(InstallPipeline(switch.ports))
        sh.conns.watch_closes = watches_closes(version, cfg, switch)
        if sh.conns.watch_closes:
            out.append(LimitPacketIns(switch.packet_in_rate))
        out.append(RequestTableSize())
        out.append(RequestSwitchFlows())
        return out

    def defaults_kept(self, found: list[SwitchFlow]) -> None:
        """The default flows the switch held when it connected (RequestKeptDefaults): one of
        this config's means it kept its table across the break (a pair's other firewall's
        defaults, or anything a switch answers unfiltered, say nothing of ours)."""
        mine = default_paths(self.shared.switch)
        self.shared.table_kept = any((f.in_port, f.out_port, f.vlan) in mine for f in found)

    def reload(self, cfg: Config, switch: SwitchConfig, static: StaticChange | None, now: float) -> list[Command]:
        """A reloaded config (reload.py keeps every key but the live ones): static shunts change as the difference
        only (`static`: StaticTable.change), held blocks' drops first above new flows (overrides.py); the packet-in
        meter takes a new rate. Nothing goes to a switch not ours now (away, a backup). CoreState.saved undoes it."""
        sh = self.shared
        old, sh.cfg, sh.switch, base = sh.switch, cfg, switch, sh.static.flows
        out: list[Command] = sh.static.reload(cfg, switch, static)
        out[:0] = self._overrides.reloaded(base, now)
        if sh.version is None:  # away, or a pair's backup: the switch gets the new set when it is ours
            return []           # (switch_connected installs every static flow; the reconcile deletes the rest)
        sh.conns.watch_closes = watches_closes(sh.version, cfg, switch)
        if sh.conns.watch_closes and switch.packet_in_rate != old.packet_in_rate:
            out.append(LimitPacketIns(switch.packet_in_rate))
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
            elif self.conns.in_grace(conn):  # an RST's grace: nothing handed back yet
                out.extend(self.conns.cut_short(conn, conn.remove_reason or "controller stopped", now))
            else:  # already being taken down (its entry handed back): the removal goes now
                out.append(RemoveFlows(conn, (False, True), conn.remove_reason or "controller stopped"))
        self.shared.version = None
        self.shared.reconciled = False
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
        self._confirmation.sweeps.clear()
        self.half_closed.clear()
        self.shared.reconciled = False
        self.shared.backup = True
        return out

    def switch_disconnected(self) -> list[Command]:
        """Pending first installs are abandoned: their conntrack entries were never deleted,
        so the connections stay on the slow path and the resync on reconnect retries them.
        A pending re-install (its entry deleted) stays: the reconcile finds it."""
        self.shared.version = None
        out: list[Command] = []
        for conn in self.conns:
            if conn.state is State.PENDING and not conn.entry_deleted:
                self.conns.forget(conn)
                out.append(Refused(conn, "switch disconnected before confirming"))
        return out

    def reconcile(self, flows: Iterable[SwitchFlow], now: float) -> list[Command]:
        """Bring the switch and the table into agreement after a (re)connect (reconcile.py),
        once the pipeline layout's table 1 is all on the switch: one that applies flow-mods
        after its barrier (hardware) may not have it yet, and a shunt sent there now would
        have its packets dropped at the table miss. Read again a while, then go on."""
        if self.shared.reconciled:  # a read asked for before a reconnect, answered after this one's
            return []
        flows = list(flows)
        if self.shared.pipeline and not table_1_complete(self.shared.switch, flows) and \
                self.pipeline_reads < PIPELINE_READS:
            self.pipeline_reads += 1
            return [Later(PIPELINE_READ_AGAIN, (RequestSwitchFlows(),))]
        return self._reconciler.reconcile(flows, now)

    # --- conntrack (admission.py) -----------------------------------------------------------

    def conntrack_event(self, ev: ConnEvent) -> list[Command]:
        """A conntrack event: the install it calls for, or why there is none."""
        return self._admission.conntrack_event(ev)

    def next_hops_known(self, answers: dict[str, NextHop | str], ev: ConnEvent, now: float,
                        attempt: int = 0) -> list[Command]:
        """The firewall's tables answered a ResolveHops: the event judged again (tables.py)."""
        return self._tables.answered(answers, ev, now, attempt)

    def tables_changed(self, answers: dict[str, Answer], now: float, attempt: int | None = None) -> list[Command]:
        """The route follower's news, or its answer to a ResolveStatic (`attempt`: its failed
        lookups asked again): routed pairs and static flows rewritten or handed back (tables.py)."""
        return self._tables.changed(answers, now, attempt)

    def adopted_answer(self, answer: AdoptedHopsKnown | EntryFound, now: float) -> list[Command]:
        """The firewall's tables or kernel answered about pairs a reconcile adopted (routed_adoption.py)."""
        return self._reconciler.routed.answered(answer, now)

    def dry_run(self, ev: ConnEvent) -> Verdict:
        """The verdict an event for this entry would get now, nothing changed (explain)."""
        return self._admission.dry_run(ev)

    def room_freed(self, room: int) -> list[Command]:
        """The switch can take `room` more installs (the flow-mod queue drained)."""
        return self._admission.room_freed(room)

    # --- switch feedback (confirmation.py, removal.py) --------------------------------------

    def flows_confirmed(self, conn: Conn, now: float) -> list[Command]:
        """The switch confirmed the pair's flows (its barrier reply)."""
        return self._confirmation.flows_confirmed(conn, now)

    def entry_due(self, conn: Conn, now: float) -> list[Command]:
        """The wait for a shunt's forwarding and drain is over: its entry goes."""
        return self._confirmation.entry_due(conn, now)

    def counters_read(self, conn: Conn, packets: dict[bool, int], now: float) -> list[Command]:
        """The pair's packet counters by direction (confirm: counters)."""
        return self._confirmation.counters_read(conn, packets, now)

    def flows_failed(self, conn: Conn, reason: str, table_full: bool = False, now: float = 0.0) -> list[Command]:
        """The switch refused a flow of this pair; with `table_full`, it waits for room."""
        return self._confirmation.flows_failed(conn, reason, table_full, now)

    def install_dropped(self, conn: Conn, reason: str, wait: bool) -> list[Command]:
        """An install that never went to the switch; with `wait`, it waits for room."""
        return self._confirmation.install_dropped(conn, reason, wait)

    def flow_removed(self, cookie: int, reason: str, packets: int, nbytes: int,
                     duration: float, now: float) -> list[Command]:
        """The switch removed a flow of a pair: an idle-out hands it back; both gone, it ends."""
        return self._removal.flow_removed(cookie, reason, packets, nbytes, duration, now)

    # --- take-downs and the operator (connection.py, pins.py) -------------------------------

    def remove(self, conn: Conn, reason: str, now: float) -> list[Command]:
        """Take a pair down (flush, manual unshunt, policy change), handed back alive."""
        return self.conns.take_down(conn, reason, now)

    def flush(self, reason: str, now: float) -> list[Command]:
        """Every pair back to the slow path; the connections waiting for room forgotten."""
        return self._removal.flush(reason, now)

    def find(self, ct_id: int | None = None, tuple_: FlowTuple | None = None) -> Conn | None:
        """A handled connection by conntrack id or by either direction's tuple."""
        if tuple_ is not None:
            return self.conns.by_tuple(tuple_)
        return self.conns.with_id(ct_id) if ct_id is not None else None

    def pin(self, orig: FlowTuple, action: Action, now: float, ttl: float = PIN_TTL) -> list[Command]:
        """An operator's unshunt (IGNORE) or block for a connection, by tuple (overrides.py)."""
        return self._overrides.pin(orig, action, now, ttl)

    # --- an IDS's rules (ids_backend.py decides with ids_rules.precedence; overrides.py acts) --

    def ids_pin(self, orig: FlowTuple, hold: IdsHold, now: float) -> list[Command]:
        """An IDS's shunt or block of a connection, held as a lower pin."""
        return self._overrides.ids_pin(orig, hold, now)

    def ids_release(self, orig: FlowTuple, source: str, reason: str, now: float,
                    successor: IdsHold | None = None) -> list[Command]:
        """An IDS's rule of a connection ended: its pin goes (to `successor`, if one is left)."""
        return self._overrides.ids_release(orig, source, reason, now, successor)

    def block_address(self, net: Network, expires: float, reason: str) -> list[Command]:
        """An IDS's block of every frame to or from a prefix, until `expires` (monotonic)."""
        return self.shared.address_blocks.block(net, expires, reason)

    def unblock_address(self, net: Network, reason: str) -> list[Command]:
        return self.shared.address_blocks.unblock(net, reason)

    # --- TCP teardown (teardown.py) ---------------------------------------------------------

    def teardown_packet(self, cookie: int, in_port: int, now: float,
                        seg: Segment | None = None) -> list[Command] | None:
        """A FIN or RST seen by a catcher (its headers, where the packet-in had them). None:
        the packet-in names no connection of ours."""
        return self._teardown.packet(cookie, in_port, now, seg)

    def watch_sample(self, key: int, reply: bool, seg: Segment | None, now: float) -> list[Command]:
        """A packet a watched close's flow showed the controller (close_watch.py)."""
        return self._teardown.sample(key, reply, seg, now)

    def watch_ends(self, conn: Conn, watch: CloseWatch, now: float) -> list[Command]:
        return self._teardown.watch_ends(conn, watch, now)

    def catchers_counted(self, counted: Iterable[int], now: float) -> tuple[list[Command], int]:
        """Catchers whose counters show a FIN or RST: the commands, and the shunts ended."""
        return self._teardown.catchers_counted(counted, now)

    def half_closed_due(self, now: float) -> HalfClosedDue:
        """Half-closed shunts due a look for a lost packet-in (teardown_sweep)."""
        return self._teardown.half_closed_due(now)

    def tick(self, now: float) -> list[Command]:
        """Housekeeping: deleted entries swept, overdue removals given up, pins expired."""
        self.shared.now = now
        out = self._confirmation.sweep(now)
        out.extend(self._removal.overdue(now))
        self.pins.expire(now)
        out.extend(self._overrides.renew_drops(now))  # a pin that outlasts its drops' hard timeout
        self.shared.address_blocks.expire(now)
        out.extend(self._tables.tick(now))
        out.extend(nat.refreshes(self.cfg, self._nat_pairs(), now))
        return out

    def _nat_pairs(self) -> list[Conn]:
        """The NAT pairs (routed shunts only: none unless experimental_routed)."""
        return [conn for conn in self.shared.conns if conn.nat is not None] if self.switch.experimental_routed else []

    # --- table ------------------------------------------------------------------------------

    def default_entries(self) -> int:
        """Entries of table 0 that are not any connection's: the defaults, the static shunts,
        the address blocks."""
        return (sum(g.default_flows for g in self.switch.ports) if self.cfg.default_no_shunting else 0) + \
            self.static.entries + \
            self.shared.address_blocks.entries

    def shared_entries(self) -> int:
        """The pipeline layout's table 1 (its own table: not counted against table 0)."""
        return PIPELINE_ENTRIES * len(self.switch.ports) if self.pipeline else 0

    def table_size(self, max_entries: int) -> int | None:
        """The switch reported how many entries its table 0 holds: with no `max_shunts`,
        the budget becomes what fits after the defaults, counting every pair at the most a
        pair takes (a TCP shunt with its teardown catchers). Returns the new budget."""
        self.table_max = max_entries
        if self.switch.max_shunts or self.version is None:
            return None
        self.budget = max(1, (max_entries - self.default_entries()) // self.max_pair_entries())
        return self.budget

    def max_pair_entries(self) -> int:
        """The most entries one pair takes with this switch: a TCP shunt with catchers."""
        return max_pair_entries(self.version, self.cfg, self.pipeline)
