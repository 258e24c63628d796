"""A routing firewall's pairs read back at a reconcile (docs/design/routed.md 5.6, 5.7): a
controller restart, a switch that kept its table across a reconnect, or a pair's takeover.

A routed shunt's flows carry the router's rewrite (dec_ttl, the MACs) and a NAT pair's its
translation; its reverse flow matches the reply tuple as it arrives (not the original
reversed). Such a pair is adopted with the next hops its flows name, and then checked against
what the firewall says now: its tables (asked as any next hop is, off the event loop: the
route follower) and, for a NAT pair, its kept conntrack entry (one lookup, the conntrack
worker). The same next hops: kept as it is; only a MAC changed: its flows rewritten in place;
its route moved to another interface, gone, blackholed, its neighbour failed: handed back to
the firewall alive (the one take-down). A next hop the firewall has no MAC for (a pair's new
master never sent to it: its slow ports heard nothing while it stood by) is solicited, and the
pair keeps the MAC its flows carry meanwhile, for RESOLVE_WAIT: resolved, the tables' news
rewrites it as any neighbour's change does (tables.py); not, it goes back. A NAT pair whose
entry is gone, or is another connection's now, is handed back with its entry re-created with
its NAT (the worker creates it with CTA_NAT_* when the kept one is gone); one whose entry a
takeover's commit made anew is kept, the entry's new id beside its own. Pure: flows and
answers in, commands out.
"""
from __future__ import annotations

from dataclasses import dataclass

from nfshunt.config.switch import RoutedSide, SwitchConfig
from nfshunt.records import markcodec
from nfshunt.records.cookies import Authority
from nfshunt.records.model import (
    VID_MASK,
    ConnEvent,
    FlowTuple,
    NextHop,
    Rewrite,
    SwitchFlow,
    nat_rewrite,
    retag_ops,
)
from nfshunt.records.routed import R_LOOKUP_FAILED, R_UNRESOLVED, Answer

from .commands import AdoptedHopsKnown, CheckAdopted, Command, DeleteConntrack, EntryFound, LookUpEntry, RewriteFlows
from .connection import ACTIVE, Conn
from .nat import R_NAT_ENTRY_GONE
from .routing import Change
from .state import CoreState

R_NAT_ENTRY_OTHER = "routed: its NAT entry is another connection's"
R_NAT_ENTRY_UNKNOWN = "routed: its NAT entry could not be looked up"
NO_NAT = (Rewrite(), Rewrite())
# Seconds an adopted pair's next hop may take to resolve: the kernel's three ARP requests
# (or neighbour solicitations) one second apart, and margin.
RESOLVE_WAIT = 5.0

Shape = tuple[FlowTuple, tuple[NextHop, NextHop] | None, tuple[Rewrite, Rewrite] | None]


@dataclass(frozen=True, slots=True)
class Resolving:
    """An adopted pair waiting for next hops its firewall had no MAC for (solicited)."""
    conn: Conn
    addresses: tuple[str, ...]  # its destinations not resolved at adoption
    since: float


def flow_sides(switch: SwitchConfig, fwd: SwitchFlow, rev: SwitchFlow) -> tuple[RoutedSide, RoutedSide] | None:
    """The routed interfaces a pair read back joins: each direction's in_port and match tag
    name one (a block's too); None where one names none (not a pair of this config's)."""
    if fwd.in_port is None or rev.in_port is None or fwd.vlan is None or rev.vlan is None:
        return None
    a = switch.side_at.get((fwd.in_port, fwd.vlan & VID_MASK))
    b = switch.side_at.get((rev.in_port, rev.vlan & VID_MASK))
    if a is None or b is None or a is b:
        return None
    # Each flow retags (a shunt's) from its side's tag to the other's, as this version builds it.
    shunt = fwd.out_port is not None
    if shunt and (fwd.retag != retag_ops(a.vid, b.vid) or rev.retag != retag_ops(b.vid, a.vid)):
        return None
    return a, b


def routed_shape(routed: bool, fwd: SwitchFlow, rev: SwitchFlow,
                 sides: tuple[RoutedSide, RoutedSide] | None) -> Shape | None:
    """(reply tuple, next hops, NAT rewrite) of a pair read back, if its flows rewrite as this
    version's do for this switch: a routed shunt (`routed`) dec_ttl and both MACs, then the
    translation its tuples define; anything else nothing, its reply the original reversed.
    None: not a pair this version installs here."""
    assert fwd.match is not None and rev.match is not None
    if not routed:
        if fwd.rewrite is not None or rev.rewrite is not None or not fwd.match.mirrors(rev.match):
            return None
        return fwd.match.reversed(), None, None  # (sharing the address objects, as the listener's tuples do)
    if fwd.rewrite is None or rev.rewrite is None:
        return None
    nat = nat_rewrite(fwd.match, rev.match)
    if (fwd.rewrite.nat, rev.rewrite.nat) != nat:
        return None
    if sides is None:
        return None
    hops = (NextHop(sides[1].interface or "", fwd.rewrite.eth_src, fwd.rewrite.eth_dst),
            NextHop(sides[0].interface or "", rev.rewrite.eth_src, rev.rewrite.eth_dst))
    return rev.match, hops, (None if nat == NO_NAT else nat)


def macs_differ(conn: Conn, fwd: SwitchFlow, rev: SwitchFlow) -> bool:
    """A known routed pair's flows carry other MACs than its next hops now (a rewrite lost
    while the switch was away)."""
    if conn.hops is None:
        return False
    return any(f.rewrite is not None and (f.rewrite.eth_src, f.rewrite.eth_dst) != (hop.eth_src, hop.eth_dst)
               for f, hop in zip((fwd, rev), conn.hops, strict=True))


def rewrite_fits(conn: Conn, fwd: SwitchFlow, rev: SwitchFlow) -> bool:
    """A known pair's flows rewrite as its own do: nothing for a bridge's or a block, a
    routed shunt's the router's rewrite with its own translation (its MACs may be older)."""
    if conn.hops is None:
        return fwd.rewrite is None and rev.rewrite is None
    nat = conn.nat or NO_NAT
    return fwd.rewrite is not None and rev.rewrite is not None and (fwd.rewrite.nat, rev.rewrite.nat) == nat


class RoutedAdoption:
    def __init__(self, shared: CoreState):
        self.shared = shared
        self.resolving: dict[int, Resolving] = {}  # by pair key

    def checks(self, adopted: list[Conn]) -> list[Command]:
        """What the firewall is asked about the routed pairs just adopted (those still active):
        their destinations, once each, in one question; each NAT pair's entry."""
        conns = tuple(c for c in adopted if c.hops is not None and self.shared.conns.holds(c, ACTIVE))
        if not conns:
            return []
        addresses = tuple(dict.fromkeys(a for c in conns for a in (c.reply.src, c.orig.src)))
        return [CheckAdopted(conns, addresses), *(LookUpEntry(c) for c in conns if c.nat is not None)]

    def answered(self, answer: AdoptedHopsKnown | EntryFound, now: float) -> list[Command]:
        if isinstance(answer, AdoptedHopsKnown):
            return self.hops_known(answer.conns, answer.answers, now)
        return self.entry_found(answer.conn, answer.entry, answer.failed, now)

    def hops_known(self, conns: tuple[Conn, ...], answers: dict[str, Answer], now: float) -> list[Command]:
        """The tables' answer for the adopted pairs: each kept, rewritten or handed back."""
        self.shared.next_hops.learn(answers, now)
        out: list[Command] = []
        for conn in conns:
            if conn.hops is not None and self.shared.conns.holds(conn, ACTIVE):
                out.extend(self._pair(conn, answers, now))
        return out

    def _pair(self, conn: Conn, answers: dict[str, Answer], now: float) -> list[Command]:
        assert conn.hops is not None
        hops = list(conn.hops)
        rewrite = False
        unresolved = []
        for direction, address in enumerate((conn.reply.src, conn.orig.src)):
            answer = answers.get(address, R_LOOKUP_FAILED)
            if answer == R_UNRESOLVED:  # (solicited: the flows' MAC meanwhile)
                unresolved.append(address)
                continue
            change = self.shared.next_hops.change(hops[direction], address, answer, now)
            if isinstance(change, str):
                return self.shared.conns.take_down(conn, change, now)
            assert isinstance(answer, NextHop)
            hops[direction], rewrite = answer, rewrite or change is Change.REWRITE
        conn.hops = (hops[0], hops[1])  # (the answers: their neighbour, what a hold-down goes by)
        if unresolved:
            self.resolving[conn.key] = Resolving(conn, tuple(unresolved), now)
        return [RewriteFlows(conn)] if rewrite else []

    def overdue(self, now: float) -> list[Command]:
        """Adopted pairs whose solicited next hops are resolved now let go of, checked against
        the tables' answers as at adoption (their news rewrote them already, unless a question
        asked meanwhile took the news' place: then it is done here); the ones RESOLVE_WAIT
        after, still not, handed back."""
        out: list[Command] = []
        table = self.shared.next_hops
        for key, waiting in list(self.resolving.items()):
            conn = waiting.conn
            if not self.shared.conns.holds(conn, ACTIVE):
                del self.resolving[key]
                continue
            known = [table.answers.get(a) for a in waiting.addresses]
            if all(k is not None and k[1] >= waiting.since and isinstance(k[0], NextHop) for k in known):
                del self.resolving[key]
                answers = {a: got[0] for a in (conn.reply.src, conn.orig.src) if (got := table.answers.get(a))}
                out.extend(self._pair(conn, answers, now))
            elif now - waiting.since >= RESOLVE_WAIT:
                del self.resolving[key]
                out.extend(self.shared.conns.take_down(conn, R_UNRESOLVED, now))
        return out

    def _decided_alike(self, entry: ConnEvent, conn: Conn) -> bool:
        """The policy decided the pair (an IDS's or an operator's is the old master's: handed
        back, as a bridged pair's), and the entry's mark says its action between its port groups."""
        mark, switch = markcodec.decode(entry.mark), self.shared.switch
        return conn.authority is Authority.POLICY and mark.complete and \
            self.shared.cfg.action_for(mark.action or 0) is conn.action and \
            conn.sides == (switch.sides.get(mark.ingress or 0), switch.sides.get(mark.egress or 0))

    def entry_found(self, conn: Conn, entry: ConnEvent | None, failed: str | None, now: float) -> list[Command]:
        """The kernel's answer for an adopted NAT pair's entry: the same entry keeps the pair
        (its id and tuples; or its tuples and, under another id, the same decision in its mark:
        conntrackd's commit at a pair's takeover makes the synced entry anew, and an entry re-made
        while the controller was away and judged alike is this pair's all the same: its id is
        kept beside the pair's, Conn.entry); none, or another's, hands it back with its NAT re-created
        (another connection's entry on its tuple deleted first: its translation is not this one's)."""
        if not self.shared.conns.holds(conn, ACTIVE):
            return []
        if failed is None and entry is not None and (entry.orig, entry.reply) == (conn.orig, conn.reply) and \
                (entry.ct_id == conn.ct_id or self._decided_alike(entry, conn)):
            conn.entry_id = None if entry.ct_id == conn.ct_id else entry.ct_id  # (its events and requests)
            return []
        if failed is not None:
            return self.shared.conns.take_down(conn, R_NAT_ENTRY_UNKNOWN, now)
        if entry is None:
            return self.shared.conns.take_down(conn, R_NAT_ENTRY_GONE, now)
        delete = DeleteConntrack(entry.orig.family, entry.orig, entry.ct_id)
        return [delete, *self.shared.conns.take_down(conn, R_NAT_ENTRY_OTHER, now)]
