"""One switch's static shunts as the core keeps them: the flows the config wants, their
counters as last read, operators' and IDSs' blocks inside a stream; installed at connect, brought
into agreement by the reconcile, changed by a reload as the difference only. No I/O.

A block, an unblock or a routed flow's new next hop while the switch is not this
controller's to program (away, or a pair's backup: EQUAL before a grant, SLAVE) is kept
here and makes no flow-mod: `connected` installs what is kept when the switch is ours.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

from nfshunt.config.static import StaticFlow, switch_flows
from nfshunt.records import cookies
from nfshunt.records.model import VID_PRESENT, FlowRewrite, FlowTuple, NextHop, SwitchFlow, retag_ops
from nfshunt.records.routed import Answer

from .commands import Command, InstallStatic, RemoveStatic, ResolveStatic
from .routing import R_FLAPPING, R_HOP_ELSEWHERE
from .static_view import Counts, HopState, StaticIndex, StaticTotals, matching, page, summary

RENEW = 2.0  # seconds before the switch ends a block's drop that a pin holding longer writes it again
R_VIA_OFF_LINK = "routed: via is not on the subnet of the destination side's interface"

if TYPE_CHECKING:
    from nfshunt.config.settings import Config
    from nfshunt.config.switch import SwitchConfig


@dataclass(frozen=True)
class StaticChange:
    """A reload's static flows and what it takes to get there from a table's (`base`), worked
    out off the event loop (10,000 entries' flows and their removals' descriptions: 0.7 s)."""
    base: dict[int, StaticFlow]
    flows: dict[int, StaticFlow]
    commands: tuple[Command, ...]
    index: StaticIndex  # the new flows' (status's listing and totals)


class StaticTable:
    """One switch's static flows: what the config wants, and their counters as last read."""

    def __init__(self, cfg: "Config", switch: "SwitchConfig", ours: Callable[[], bool] = lambda: True):
        """ours: whether the switch is this controller's to program now (the core's)."""
        self.ours = ours
        self.flows = switch_flows(cfg, switch)
        self.index = StaticIndex.of(self.flows)
        self.counts: dict[int, Counts] = {}
        self.totals = StaticTotals()  # the counts added up when they are read (status, metrics: no walk)
        self.block_priority = cfg.block_priority
        # Operators' and IDSs' blocks of tuples inside a static stream, by cookie: (flow,
        # expires). The stream never reaches conntrack, so a pin alone would never be decided.
        self.blocks: dict[int, tuple[StaticFlow, float]] = {}
        # A routing firewall's (`via`): each routed flow's next hop, and the interface each fast
        # port's group routes by, per tag (where a next hop must lie: a trunk's VLAN's own).
        self.interfaces = {at: side.interface for at, side in switch.side_at.items()}
        self.hops: dict[int, HopState] = {cookie: None for cookie, f in self.flows.items() if f.via is not None}

    @property
    def entries(self) -> int:
        return len(self.flows)

    def connected(self) -> list[Command]:
        """At connect, before anything else: every static flow (an identical one on the
        switch is overwritten in place)."""
        flows = (*self._placed(self.flows.values()), *(f for f, _ in self.blocks.values()))
        out: list[Command] = [InstallStatic(flows, "switch connected")] if flows else []
        return out + self.resolve()

    # --- through a routing firewall (`via`) ---------------------------------------------------

    def _placed(self, flows: Iterable[StaticFlow]) -> list[StaticFlow]:
        """The flows as they go on the switch: a bridged one as it is, a routed one with its
        next hop's rewrite, and only while it has one."""
        out = []
        for f in flows:
            if f.via is None:
                out.append(f)
            elif isinstance(hop := self.hops.get(f.cookie), NextHop):
                out.append(dataclasses.replace(f, hop=hop))
        return out

    def resolve(self, attempt: int = 0) -> list[Command]:
        """Ask the firewall's tables for every routed flow's next hop (the route follower then
        tells of their changes: hops_known again)."""
        vias = sorted({f.via for f in self.flows.values() if f.via is not None})
        return [ResolveStatic(tuple(vias), attempt)] if vias else []

    def hops_known(self, answers: dict[str, Answer], held_down: Callable[[NextHop, str], bool]) -> list[Command]:
        """The tables' answers (to a ResolveStatic, or the follower's news): each routed flow
        whose next hop is given is installed with its rewrite (again, when its MAC changed:
        an add of the same match replaces the actions, the counters kept); one whose next hop
        went (failed, moved to another interface, no route, held down) is withdrawn, counted
        and logged by its reason: its stream crosses the firewall, which routes it."""
        put: dict[str, list[StaticFlow]] = {}
        gone: dict[tuple[str, bool], list[StaticFlow]] = {}  # (why, it was installed this run)
        for cookie, was in list(self.hops.items()):
            f = self.flows[cookie]
            answer = answers.get(f.via) if f.via is not None else None
            if answer is None:
                continue
            now = self._verdict(f, answer, held_down)
            self.hops[cookie] = now
            if isinstance(now, NextHop) and now != was:
                why = "next hop's MAC changed" if isinstance(was, NextHop) else "next hop resolved"
                put.setdefault(why, []).append(dataclasses.replace(f, hop=now))
            elif isinstance(now, str) and not isinstance(was, str):
                gone.setdefault((now, was is not None), []).append(f)
        out: list[Command] = [InstallStatic(tuple(flows), why) for why, flows in put.items()]
        out.extend(RemoveStatic(tuple(f.cookie for f in flows), tuple(f.describe() for f in flows), why,
                                "static_removed" if installed else "static_withheld")
                   for (why, installed), flows in gone.items())
        return out if self.ours() else []

    def _verdict(self, f: StaticFlow, answer: Answer, held_down: Callable[[NextHop, str], bool]) -> NextHop | str:
        """The next hop a routed flow may leave by, or why not: it must leave by the interface
        of its output port's group; an entry's own `via` must be on that interface's subnet
        (the route to it is direct: it is its own neighbour); its neighbour not flapping."""
        if isinstance(answer, str):
            return answer
        assert f.via is not None
        if answer.ifname != self.interfaces.get((f.out_port or 0, f.vid_out)):
            return R_HOP_ELSEWHERE
        if not f.reply and f.via == f.shunt.via and answer.neighbour not in ("", f.via):
            return R_VIA_OFF_LINK
        if held_down(answer, f.via):
            return R_FLAPPING
        return answer

    def block(self, t: FlowTuple, now: float, lifetime: int,
              among: Iterable[StaticFlow] | None = None) -> list[Command]:
        """An operator's or an IDS's block of a tuple (either direction) some static flow
        carries (of `among` only, if given: a reload's new ones): an exact drop above it, for
        the pin's lifetime (the switch's hard timeout ends it). A block of a tuple blocked
        already is written again: its hard timeout is the new pin's (an OpenFlow add of the
        same match and priority replaces it)."""
        flows = [f.block(u, self.block_priority, lifetime) for f in (self.flows.values() if among is None else among)
                 for u in (t, t.reversed()) if f.covers(u)]
        for f in flows:
            self.blocks[f.cookie] = (f, now + lifetime)
        return [InstallStatic(tuple(flows), "blocked")] if flows and self.ours() else []

    def unblock(self, t: FlowTuple, reason: str) -> list[Command]:
        """An operator's unshunt, or the end of the IDS rule that blocked it, lifts the block
        of a static stream's tuple."""
        gone = [f for f, _ in self.blocks.values() if _blocked(f) in (t, t.reversed())]
        for f in gone:
            del self.blocks[f.cookie]
        if not gone or not self.ours():
            return []
        return [RemoveStatic(tuple(f.cookie for f in gone), tuple(f.describe() for f in gone), reason)]

    def expire(self, now: float) -> list[tuple[FlowTuple, float]]:
        """Blocks the switch's hard timeout has ended are forgotten; those it ends within
        RENEW s are returned (their tuples and ends) for the core to write again if a pin
        holds them longer (a hard timeout is at most 18 h: written again before it runs out,
        the drop never lapses)."""
        for cookie in [k for k, (_, until) in self.blocks.items() if until <= now]:
            del self.blocks[cookie]
        return [(_blocked(f), until) for f, until in self.blocks.values() if until - RENEW <= now]

    def reconcile(self, flows: list[SwitchFlow]) -> tuple[list[SwitchFlow], list[Command]]:
        """Split the switch's static flows from the rest. One of ours exactly right is
        kept; one under our cookie that differs, or a second one, goes and is installed
        again; a missing one is installed; a static flow no entry names any more goes."""
        statics, rest = cookies.split(flows, cookies.Kind.STATIC)
        found: dict[int, list[SwitchFlow]] = {}
        for flow in statics:
            found.setdefault(flow.cookie, []).append(flow)
        # A block nobody here names (an operator's or an IDS's of another run or of the
        # pair's other controller) is a drop with its own end: kept until then.
        stale = [cookie for cookie, got in found.items() if cookie not in self.flows and cookie not in self.blocks
                 and not all(f.out_port is None and f.hard_timeout and f.priority == self.block_priority for f in got)]
        # (a routed flow whose next hop is not known yet is left as it is: the tables' answer
        # writes it again or withdraws it; one withdrawn while the switch was away goes now)
        withdrawn = {cookie: why for cookie in found if isinstance(why := self.hops.get(cookie), str)}
        placed = {f.cookie: f for f in self._placed(self.flows.values())}
        wrong = [f for cookie, f in placed.items() if cookie in found and not _right(f, found[cookie])]
        missing = [f for cookie, f in placed.items() if cookie not in found]
        out: list[Command] = []
        if stale:
            out.append(RemoveStatic(tuple(stale), tuple(f"cookie 0x{c:016x}" for c in stale), "not in the config"))
        for why in sorted(set(withdrawn.values())):
            gone = [self.flows[cookie] for cookie, reason in withdrawn.items() if reason == why]
            out.append(RemoveStatic(tuple(f.cookie for f in gone), tuple(f.describe() for f in gone), why))
        if wrong:
            out.append(RemoveStatic(tuple(f.cookie for f in wrong), tuple(f.describe() for f in wrong),
                                    "not as configured"))
        if wrong or missing:
            out.append(InstallStatic((*wrong, *missing), "missing after connect"))
        return rest, out

    def change(self, cfg: "Config", switch: "SwitchConfig",
               flows: dict[int, StaticFlow] | None = None) -> "StaticChange":
        """A new config's static flows for this switch (`flows`: switch_flows(cfg, switch), if
        built already) as the difference from this table's: new ones first, then the old ones
        go (an entry that changed in place is overwritten by its new flow); an unchanged flow
        is not touched. Changes nothing: a reload works it out off the event loop (it only
        reads `flows`, which nothing changes in place) and `reload` commits it there."""
        base = self.flows
        new = switch_flows(cfg, switch) if flows is None else flows
        added = tuple(f for cookie, f in new.items() if cookie not in base and f.via is None)
        routed = sorted({f.via for cookie, f in new.items() if cookie not in base and f.via is not None})
        removed = tuple(f for cookie, f in base.items() if cookie not in new)
        out: list[Command] = []
        if added:
            out.append(InstallStatic(added, "reload"))
        if routed:  # (installed once the tables give their next hops: hops_known)
            out.append(ResolveStatic(tuple(routed)))
        if removed:
            out.append(RemoveStatic(tuple(f.cookie for f in removed), tuple(f.describe() for f in removed), "reload"))
        return StaticChange(base, new, tuple(out), StaticIndex.of(new))

    def reload(self, cfg: "Config", switch: "SwitchConfig", change: "StaticChange | None" = None) -> list[Command]:
        """A new config's static flows taken, as the difference only (`change`: worked out
        beforehand from this table as it still is, or else here). What it changes it
        replaces, never changes in place: `saved` puts it back."""
        if change is None or change.base is not self.flows:
            change = self.change(cfg, switch, None if change is None else change.flows)
        gone = change.base.keys() - change.flows.keys()
        counted = [(self.index.group[cookie], got) for cookie in gone if (got := self.counts.get(cookie))]
        if counted:
            self.counts = {cookie: got for cookie, got in self.counts.items() if cookie not in gone}
        self.flows, self.index = change.flows, change.index
        self.hops = {cookie: self.hops.get(cookie) for cookie, f in change.flows.items() if f.via is not None}
        self.totals = self.totals.without(counted)
        return list(change.commands)

    def saved(self) -> Callable[[], None]:
        """What `reload` replaces, as a function that puts it back (in the same turn of the
        event loop: a reload whose turn failed part way, app/reloading.py)."""
        flows, index, hops, counts, totals = self.flows, self.index, self.hops, self.counts, self.totals
        blocks = dict(self.blocks)  # (a reload's new flows get the held blocks' drops: Overrides.reloaded)

        def put_back() -> None:
            self.flows, self.index, self.hops, self.counts, self.totals = flows, index, hops, counts, totals
            self.blocks = blocks
        return put_back

    def counted(self, flows: Iterable[SwitchFlow]) -> None:
        """A read of the static flows' counters (flow stats by cookie), added up once here."""
        self.counts, self.totals = StaticTotals.read(flows, self.index)

    def summary(self) -> dict[str, Any]:
        """Status's and the metrics' view: counts and sums, O(1)."""
        return summary(len(self.flows), self.index, self.totals)

    def rows(self, name: str | None = None, offset: int = 0, limit: int = 100) -> list[dict[str, Any]]:
        """One page of the flows, one row each (of the stream `name` names, if given)."""
        return page(self.flows, self.index, self.counts, self.hops, name, offset, limit)

    def matching(self, name: str | None = None) -> int:
        """How many flows `rows` pages through."""
        return matching(self.flows, self.index, name)


def _blocked(flow: StaticFlow) -> FlowTuple:
    """The tuple a block's exact drop matches."""
    assert flow.src is not None and flow.dst is not None and flow.family is not None and flow.proto is not None
    return FlowTuple(flow.family, flow.proto, str(flow.src.network_address), str(flow.dst.network_address),
                     flow.src_port or 0, flow.dst_port or 0, flow.zone)


def _right(flow: StaticFlow, found: list[SwitchFlow]) -> bool:
    """The switch's flow under this cookie is the one we install (the masked match is not
    read back: the cookie names the entry's fields, the rest is checked here)."""
    if len(found) != 1:
        return False
    f = found[0]
    if not (f.priority == flow.priority and f.in_port == flow.in_port and f.out_port == flow.out_port
            and not f.goto):
        return False
    hop = flow.hop if flow.out_port is not None else None
    if f.rewrite != (None if hop is None else FlowRewrite(hop.eth_src, hop.eth_dst)):
        return False  # (a routed flow's MACs are its next hop's now; a bridged one rewrites nothing)
    if flow.vid_in or flow.vid_out or flow.pcp is not None:  # a VLAN's: its tag, priority and retag
        return f.vlan == (VID_PRESENT | flow.vid_in if flow.vid_in else 0) and f.pcp == flow.pcp and \
            f.retag == (retag_ops(flow.vid_in, flow.vid_out) if flow.out_port is not None else ())
    return f.vlan in (None, 0) and f.pcp is None and not f.retag  # untagged: as before, no tag put on
