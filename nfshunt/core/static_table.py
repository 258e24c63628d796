"""One switch's static shunts as the core keeps them: the flows the config wants, their
counters as last read, operators' and IDSs' blocks inside a stream; installed at connect, brought
into agreement by the reconcile, changed by a reload as the difference only. No I/O.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from nfshunt.config.static import StaticFlow, switch_flows
from nfshunt.records import cookies
from nfshunt.records.model import VID_PRESENT, FlowTuple, SwitchFlow, retag_ops

from .commands import Command, InstallStatic, RemoveStatic
from .static_view import Counts, StaticIndex, StaticTotals, matching, page, summary

RENEW = 2.0  # seconds before the switch ends a block's drop that a pin holding longer writes it again

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

    def __init__(self, cfg: "Config", switch: "SwitchConfig"):
        self.flows = switch_flows(cfg, switch)
        self.index = StaticIndex.of(self.flows)
        self.counts: dict[int, Counts] = {}
        self.totals = StaticTotals()  # the counts added up when they are read (status, metrics: no walk)
        self.block_priority = cfg.block_priority
        # Operators' and IDSs' blocks of tuples inside a static stream, by cookie: (flow,
        # expires). The stream never reaches conntrack, so a pin alone would never be decided.
        self.blocks: dict[int, tuple[StaticFlow, float]] = {}

    @property
    def entries(self) -> int:
        return len(self.flows)

    def connected(self) -> list[Command]:
        """At connect, before anything else: every static flow (an identical one on the
        switch is overwritten in place)."""
        flows = (*self.flows.values(), *(f for f, _ in self.blocks.values()))
        return [InstallStatic(flows, "switch connected")] if flows else []

    def block(self, t: FlowTuple, now: float, lifetime: int) -> list[Command]:
        """An operator's or an IDS's block of a tuple (either direction) some static flow
        carries: an exact drop above it, for the pin's lifetime (the switch's hard timeout
        ends it). A block of a tuple blocked already is written again: its hard timeout
        is the new pin's (an OpenFlow add of the same match and priority replaces it)."""
        flows = [f.block(u, self.block_priority, lifetime) for f in self.flows.values() for u in (t, t.reversed())
                 if f.covers(u)]
        for f in flows:
            self.blocks[f.cookie] = (f, now + lifetime)
        return [InstallStatic(tuple(flows), "blocked")] if flows else []

    def unblock(self, t: FlowTuple, reason: str) -> list[Command]:
        """An operator's unshunt, or the end of the IDS rule that blocked it, lifts the block
        of a static stream's tuple."""
        gone = [f for f, _ in self.blocks.values() if _blocked(f) in (t, t.reversed())]
        for f in gone:
            del self.blocks[f.cookie]
        return [RemoveStatic(tuple(f.cookie for f in gone), tuple(f.describe() for f in gone), reason)] if gone else []

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
        wrong = [f for cookie, f in self.flows.items() if cookie in found and not _right(f, found[cookie])]
        missing = [f for cookie, f in self.flows.items() if cookie not in found]
        out: list[Command] = []
        if stale:
            out.append(RemoveStatic(tuple(stale), tuple(f"cookie 0x{c:016x}" for c in stale), "not in the config"))
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
        added = tuple(f for cookie, f in new.items() if cookie not in base)
        removed = tuple(f for cookie, f in base.items() if cookie not in new)
        out: list[Command] = []
        if added:
            out.append(InstallStatic(added, "reload"))
        if removed:
            out.append(RemoveStatic(tuple(f.cookie for f in removed), tuple(f.describe() for f in removed), "reload"))
        return StaticChange(base, new, tuple(out), StaticIndex.of(new))

    def reload(self, cfg: "Config", switch: "SwitchConfig", change: "StaticChange | None" = None) -> list[Command]:
        """A new config's static flows taken, as the difference only (`change`: worked out
        beforehand from this table as it still is, or else here)."""
        if change is None or change.base is not self.flows:
            change = self.change(cfg, switch, None if change is None else change.flows)
        gone = change.base.keys() - change.flows.keys()
        counted = [(self.index.group[cookie], got) for cookie in gone if (got := self.counts.pop(cookie, None))]
        self.flows, self.index = change.flows, change.index
        self.totals = self.totals.without(counted)
        return list(change.commands)

    def counted(self, flows: Iterable[SwitchFlow]) -> None:
        """A read of the static flows' counters (flow stats by cookie), added up once here."""
        self.counts, self.totals = StaticTotals.read(flows, self.index)

    def summary(self) -> dict[str, Any]:
        """Status's and the metrics' view: counts and sums, O(1)."""
        return summary(len(self.flows), self.index, self.totals)

    def rows(self, name: str | None = None, offset: int = 0, limit: int = 100) -> list[dict[str, Any]]:
        """One page of the flows, one row each (of the stream `name` names, if given)."""
        return page(self.flows, self.index, self.counts, name, offset, limit)

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
    if flow.vid_in or flow.vid_out or flow.pcp is not None:  # a VLAN's: its tag, priority and retag
        return f.vlan == (VID_PRESENT | flow.vid_in if flow.vid_in else 0) and f.pcp == flow.pcp and \
            f.retag == (retag_ops(flow.vid_in, flow.vid_out) if flow.out_port is not None else ())
    return f.vlan in (None, 0) and f.pcp is None and not f.retag  # untagged: as before, no tag put on
