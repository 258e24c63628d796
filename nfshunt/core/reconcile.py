"""Reconcile: the switch's flows read back after a (re)connect, and the table brought into
agreement with them. No I/O.

Complete shunt/block pairs of exactly the shape this version installs are adopted (never
bounced), unless the policy changed since they were decided: then they are handed back
to it, the kernel's decisions are cleared, and no decision read before that is done is
acted on (policy_state.Clearing). A pair we know of that is missing: if the switch kept its table (its defaults were
there before they were sent again), it timed out while the switch was away and is handed
back as its flow-removed would have been; if the switch lost its table (a reboot), it is
installed again. A pair we know of that the switch still holds gets what the break left
undone (`_repair`): a take-down asked meanwhile is carried out (removals wait for this:
removal.py `overdue`), an RST's grace the break cut short is handed back, a re-install
whose barrier reply the break lost is sent again, a draining pair's counters are read
again. NFShunt flows nobody accounts for are deleted when delete_flows_on_startup is set.

Trust: only pairs this controller installed from a policy decision are ever installed
again after a reconnect; pairs adopted from a switch's flow table (a restart) are kept
while the switch has them and forgotten when it does not, so a peer that posed as the
switch cannot get a forged pair onto the real one.

Authority: an adopted pair is kept only while this controller can name what decided it
(its cookie says: the policy, an IDS's rule, an operator's pin; overrides.judge_adopted).
A shunt an IDS or an operator decided whose rule or pin is not held here (it ended while
the controller was down, the restarted controller judged it again and dropped it, or the
pair's other controller decided it) is handed back to the firewall; such a block is kept
until its own hard timeout.

Routed: a pair's flows carry the router's rewrite, and a NAT pair's reverse flow matches
its reply tuple; adopted, such a pair is checked against the firewall's tables and entry
(routed_adoption.py). A known routed pair whose flows carry older MACs is rewritten.
"""
from __future__ import annotations

import collections
import math

from nfshunt.config.switch import SwitchConfig
from nfshunt.records import cookies
from nfshunt.records.model import VID_PRESENT, SwitchFlow

from .commands import (
    ClearDecisions,
    Command,
    DeleteSwitchFlow,
    InstallFlows,
    ReadCounters,
    Removed,
    RemoveFlows,
    ResyncConntrack,
    RewriteFlows,
)
from .connection import ACTIVE, Action, Conn, State
from .layout import PIPELINE_ENTRIES, goes_to_pipeline
from .overrides import Overrides
from .removal import Removal
from .routed_adoption import RoutedAdoption, flow_sides, macs_differ, rewrite_fits, routed_shape
from .state import CoreState

R_TIMED_OUT_AWAY = "timed out while the switch was away"
R_PIN_ENDED_AWAY = "its IDS rule or operator's pin ended while the switch was away"
R_NOT_ON_SWITCH = "not on the switch after a reconnect"  # adopted, or a re-install unconfirmed at a second break
PairKey = tuple[cookies.Kind, int]
Pairs = dict[PairKey, dict[bool, SwitchFlow]]  # NFShunt's flows by pair, each direction's


def default_paths(switch: SwitchConfig) -> set[tuple[int, int, int | None]]:
    """(in_port, out_port, tag) of each default flow this switch's config installs: an
    untagged group's match any tag (None), a trunk's each tag it carries (SwitchFlow.vlan)."""
    paths: set[tuple[int, int, int | None]] = set()
    for g in switch.ports:
        tags = [VID_PRESENT | vid if vid else 0 for vid in g.zone_of_vid] if g.trunk else [None]
        paths.update((a, b, tag) for tag in tags for a, b in ((g.fast, g.slow), (g.slow, g.fast)))
    return paths


def vlan_drops(switch: SwitchConfig) -> dict[tuple[int, bool], int]:
    """(port group index, slow side) -> the in_port of each trunk's drop of the tags it does not carry."""
    return {(i, slow): port for i, g in enumerate(switch.ports) if g.trunk
            for slow, port in ((False, g.fast), (True, g.slow))}


def table_1_complete(switch: SwitchConfig, flows: list[SwitchFlow]) -> bool:
    """Every table-1 flow of this switch's config is on the switch."""
    ports = switch.ports
    found: collections.Counter[int] = collections.Counter()
    for flow in cookies.split(flows, cookies.Kind.PIPELINE)[0]:
        parsed = cookies.parse(flow.cookie)
        if parsed is not None and parsed.key < len(ports) and flow.out_port == ports[parsed.key].fast:
            found[parsed.key] += 1
    return all(found[i] >= PIPELINE_ENTRIES for i in range(len(ports)))


class Reconciler:
    def __init__(self, shared: CoreState, removal: Removal, overrides: Overrides):
        self.shared = shared
        self.removal = removal
        self.overrides = overrides
        self.routed = RoutedAdoption(shared)
        self.adopted: list[Conn] = []  # this reconcile's

    def reconcile(self, flows: list[SwitchFlow], now: float) -> list[Command]:
        """The switch's flows (table 1 complete, or waited for long enough: Core.reconcile)."""
        sh = self.shared
        flows, out = sh.static.reconcile(flows)
        flows, stale = sh.address_blocks.reconcile(flows)
        out.extend(stale)
        pairs, catchers = self._sort_flows(flows, out)
        present: set[int] = set()
        self.adopted = []
        for (kind, key), dirs in pairs.items():
            conn = sh.conns.named(kind, key)
            if conn is None and len(dirs) == 2:
                conn = self._adopt(kind, key, dirs, now)
            if conn is not None and len(dirs) == 2 and self._matches(conn, dirs):
                present.add(id(conn))
                if macs_differ(conn, dirs[False], dirs[True]):
                    out.append(RewriteFlows(conn))
                continue
            if sh.cfg.delete_flows_on_startup or conn is None:
                for flow in dirs.values():
                    out.append(DeleteSwitchFlow(flow, "orphan: half a pair or not in config"))
        for key, flow in catchers:
            conn = sh.conns.named(cookies.Kind.SHUNT, key)
            if conn is None or id(conn) not in present:
                out.append(DeleteSwitchFlow(flow, "orphan teardown catcher"))
        for conn in sh.conns:
            out.extend(self._repair(conn, id(conn) in present, now))
        out.extend(self.routed.checks(self.adopted))  # (before the resync: a NAT entry's lookup first)
        sh.reconciled = True
        if sh.stale_policy:
            # What the event loop reads until the kernel has cleared the old policy's
            # decisions may carry one: none is acted on (policy_state.Clearing); the
            # clearing's end (ClearingDone, whatever the kernel answered) reads every entry.
            sh.stale_policy = False
            sh.clearing.begin()
            out.append(ClearDecisions())
        else:
            out.append(ResyncConntrack())
        return out

    def _sort_flows(self, flows: list[SwitchFlow], out: list[Command]) -> tuple[Pairs, list[tuple[int, SwitchFlow]]]:
        """NFShunt's flows by pair and the teardown catchers; defaults and table-1 flows
        that are not this config's are deleted on the way."""
        cfg, ports = self.shared.cfg, self.shared.switch.ports
        pairs: Pairs = {}
        catchers: list[tuple[int, SwitchFlow]] = []
        crowded: dict[PairKey, list[SwitchFlow]] = {}
        expected_defaults = default_paths(self.shared.switch)
        drops = vlan_drops(self.shared.switch)
        for flow in flows:
            parsed = cookies.parse(flow.cookie)
            if parsed is None:
                continue
            kind, key, reply = parsed
            if kind is cookies.Kind.DEFAULT:
                # In a pair, another firewall's defaults are the peer's: it no longer decides.
                if (flow.in_port, flow.out_port, flow.vlan) not in expected_defaults and (
                        cfg.delete_flows_on_startup or cfg.pair is not None):
                    out.append(DeleteSwitchFlow(flow, "default flow not in config"))
            elif kind is cookies.Kind.VLAN_DROP:
                # Checked as the defaults are: its port, no output, the whole port (no tag named).
                if (drops.get((key, reply)) != flow.in_port or flow.out_port is not None or flow.vlan is not None) \
                        and (cfg.delete_flows_on_startup or cfg.pair is not None):
                    out.append(DeleteSwitchFlow(flow, "VLAN drop not in config"))
            elif kind is cookies.Kind.TEARDOWN:
                catchers.append((key, flow))
            elif kind is cookies.Kind.PIPELINE:
                # Table-1 flows of a port group (re-installed at every connect), or of
                # another layout or port list: those are only reachable by flows of ours
                # that are deleted too, so they go whatever delete_flows_on_startup says.
                if not self.shared.pipeline or key >= len(ports) or flow.out_port != ports[key].fast:
                    out.append(DeleteSwitchFlow(flow, "table-1 flow not in this layout"))
            else:
                dirs = pairs.setdefault((kind, key), {})
                if reply in dirs or not flow.exact:
                    # A second flow under one cookie, or one of another shape (an older
                    # release's, a wildcarded one): none of them is adopted, all go.
                    crowded.setdefault((kind, key), []).extend((flow, dirs.get(reply, flow)))
                dirs[reply] = flow
        for pair, odd in crowded.items():
            for flow in {id(f): f for f in (*pairs.pop(pair).values(), *odd)}.values():
                out.append(DeleteSwitchFlow(flow, "not exactly the shape of a pair this version installs"))
        return pairs, catchers

    def _repair(self, conn: Conn, present: bool, now: float) -> list[Command]:
        """One known pair after a reconnect, by what the switch still has of it."""
        conns = self.shared.conns
        if conn.state is State.TAKING_DOWN:
            return self._removal(conn, present, now)
        if present:
            return self._present(conn, now)
        if conn.state not in ACTIVE and not conn.entry_deleted:
            return []
        if conn.adopted or self.shared.table_kept:
            # Adopted: read back from a switch, never decided here, nothing to re-install.
            # Or the switch kept its table, so it removed this pair (timed out) while the
            # controller was away and its flow-removed went nowhere: not installed again for
            # a connection that may have ended (a new one on its ports would cross the switch
            # unseen by the firewall). Either way its connection, if it lives, is back on the
            # firewall: its entry comes back, with the re-evaluation's 300 s (a resuming
            # connection's traffic renews it; closes went unheard, so not an idle-out's 5 days).
            reason = R_TIMED_OUT_AWAY if conn.state in ACTIVE and not conn.adopted else R_NOT_ON_SWITCH
            return [*conns.roll_back(conn, reason), Removed(conn, reason)]
        if not self.overrides.reinstall_bound(conn, now):
            return [*conns.roll_back(conn, R_PIN_ENDED_AWAY), Removed(conn, R_PIN_ENDED_AWAY)]
        conns.reinstall(conn, now)
        return [InstallFlows(conn)]

    def _present(self, conn: Conn, now: float) -> list[Command]:
        """A pair the switch holds whole, not being taken down."""
        if conn.state is State.PENDING:
            # A re-install (a first install is forgotten at a disconnect) whose barrier reply
            # a second break lost: nothing else would confirm it. Sent again (an add changes
            # nothing the switch holds), this session's barrier confirms it (flows_confirmed:
            # the FIN or RST its catchers caught meanwhile, a take-down waiting, taken then).
            self.shared.conns.reinstall(conn, now)
            return [InstallFlows(conn)]
        if conn.state is State.DRAINING and self.shared.switch.confirm == "counters":
            # Its counters' read again fell due while the switch was away (dropped: no
            # session), or its answer was lost with the connection: nothing else reads them.
            return [ReadCounters(conn)]
        if conn.adopted and self.shared.stale_policy:
            return self.shared.conns.hand_back(conn, "policy changed while the controller was stopped", now)
        return self.overrides.judge_adopted(conn, now) if conn.adopted else []

    def _removal(self, conn: Conn, present: bool, now: float) -> list[Command]:
        """A pair being taken down (flush, unshunt, block, policy, a close), most likely
        while the switch was away, its removal dropped (removals wait for this: removal.py
        `overdue`): the decision holds, whatever the switch still has. A caught close's
        entry is the close's already (close_watch.py): its watch ends, its flows go; an
        RST's grace, which hands back only at its end, is handed back now. A pair the switch
        does not hold whole is forgotten, the half a switch may have left of it (one
        direction idled out) deleted with it."""
        reason = conn.remove_reason or "removal"
        watch = conn.watch
        if self.shared.conns.in_grace(conn):
            # An RST's grace the break cut short (pairs.cut_short). One the switch no longer
            # holds is forgotten too, its entry asked for all the same (removing flows
            # alone, or forgetting, left it with neither).
            back = self.shared.conns.cut_short(conn, reason, now)
            return back if present else [*back, *self.removal.finish(conn, reason)]
        if present and watch is not None:
            watch.settled = True
            return [RemoveFlows(conn, (False, True), conn.remove_reason or "close")]
        if present:
            return self.shared.conns.hand_back(conn, reason, now)
        return [RemoveFlows(conn, (False, True), reason), *self.removal.finish(conn, reason)]

    def _matches(self, conn: Conn, dirs: dict[bool, SwitchFlow]) -> bool:
        """The switch's pair is this connection's (a flow under its cookie with another
        tuple was not put there by this controller) in this layout."""
        return dirs[False].match == conn.orig and dirs[True].match == conn.reply and \
            self._shaped(conn.action, conn.orig.proto, dirs) and rewrite_fits(conn, dirs[False], dirs[True])

    def _shaped(self, action: Action, proto: int, dirs: dict[bool, SwitchFlow]) -> bool:
        """Both flows go on to table 1 exactly when this layout sends the pair there: a pair
        of the other layout would meet table-1 flows that are not there (a drop) or keep
        catchers nobody removes."""
        goto = goes_to_pipeline(self.shared.version, self.shared.cfg, action, proto, self.shared.pipeline)
        return dirs[False].goto == goto and dirs[True].goto == goto

    def _adopt(self, kind: cookies.Kind, key: int, dirs: dict[bool, SwitchFlow], now: float) -> Conn | None:
        """A complete pair on the switch that no pair of ours holds: adopted if it is exactly
        what this version installs for its tuple and ports in this layout."""
        fwd, rev = dirs[False], dirs[True]
        if fwd.match is None or rev.match is None:
            return None
        ports = {g.fast: g for g in self.shared.switch.ports}
        ingress, egress = ports.get(fwd.in_port or -1), ports.get(rev.in_port or -1)
        if ingress is None or egress is None:
            return None
        if kind is cookies.Kind.SHUNT and (fwd.out_port != egress.fast or rev.out_port != ingress.fast):
            return None
        conns = self.shared.conns
        if conns.by_tuple(fwd.match) is not None or conns.by_tuple(rev.match) is not None or key in conns.by_key:
            return None  # (an id held by a pair of the other kind: its flows go as orphans)
        switch = self.shared.switch
        sides = flow_sides(switch, fwd, rev) if switch.sides else None
        if switch.sides and sides is None:
            return None  # (a routed pair joins two interfaces of the router's: its tags name them)
        routed = kind is cookies.Kind.SHUNT and switch.experimental_routed
        shape = routed_shape(routed, fwd, rev, sides)
        if shape is None:
            return None  # not a pair NFShunt builds here (a bridge's, a router's, a NAT's)
        reply, hops, nat = shape
        action = Action.SHUNT if kind is cookies.Kind.SHUNT else Action.BLOCK
        if not self._shaped(action, fwd.match.proto, dirs):
            return None
        # Decided by an earlier run, which deleted its entry once the switch confirmed it; its
        # hard timeout, if it has one, is what its flows have left.
        bounded = [f for f in (fwd, rev) if f.hard_timeout]
        left = max(1, math.ceil(min(f.hard_timeout - f.duration for f in bounded))) if bounded else 0
        authority = cookies.authority(fwd.cookie)
        if cookies.authority(rev.cookie) is not authority:
            authority = cookies.Authority.UNKNOWN  # not a pair this version writes: never named
        # A NAT pair's entry was kept (routed.md 5.6): looked up before it is relied on.
        conn = Conn(fwd.match, reply, key & 0xFFFFFFFF, action, ingress, egress, now, state=State.LIVE,
                    confirmed_time=now, entry_deleted=nat is None, slot=key >> cookies.KEY_SLOT_SHIFT,
                    authority=authority, hops=hops, sides=sides)
        conn.adopted, conn.hard_timeout, conn.nat = True, left, nat
        self.shared.remember(conn)
        if hops is not None:
            self.shared.next_hops.use(conn)  # (the tables' news find it: tables.py)
            self.adopted.append(conn)
        return conn
