"""Admission: a conntrack event in, an install or the reason there is none. No I/O.

What the mark (and an operator's pin) decided for the entry and the port groups it
crossed; then whether the switch has room. With a budget (`max_shunts`, or derived from
the table size the switch reports when that is unset), or when the switch reports its
table full, a shunt stays on the slow path (its entry kept) and waits; waiting
connections are retried, blocks first, as pairs leave. A block that finds no room evicts
the newest shunt, up to `max_block_share` of the budget.
"""
from __future__ import annotations

import enum
from typing import NamedTuple

from nfshunt.config.switch import PortGroup, RoutedSide
from nfshunt.records import markcodec, routed
from nfshunt.records.cookies import Authority
from nfshunt.records.model import OFP13, TCP, TCP_ENDED, UDP, ConnEvent, EventKind, Rewrite, nat_rewrite

from . import nat, routing
from .commands import Command, DeleteConntrack, Ignored, InstallFlows, ResolveHops
from .connection import ACTIVE, CT_TCP_CLOSE, Action, Conn, State, closed_on_firewall
from .layout import goes_to_pipeline
from .overrides import follows_policy
from .pins import hard_timeout
from .routing import NextHopTable
from .state import CoreState

# What `decide` found: action, port groups, idle timeout, authority, hard timeout, and on a
# routing firewall the interfaces the mark named (ingress, egress: each a VLAN's, or a group's own).
Sides = tuple[RoutedSide, RoutedSide]
Decided = tuple[Action, PortGroup, PortGroup, "int | None", Authority, int, "Sides | None"]
WAITING_MAX = 65536  # connections remembered while waiting for room on the switch

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
R_PINNED = "kept on the slow path by an operator"
R_NAT = "nat: reply tuple is not the original reversed"
R_REPLY_HELD = "nat: its reply tuple is a held pair's"
R_PORTS_MOVED = "its entry's mark names other ports now"  # also the removal's reason
R_ID_COLLISION = "conntrack id of a live pair"
R_CLOSED_ON_FIREWALL = "tcp closed on the firewall"  # also the removal's reason
R_IDS_SERVER = "ids shunt: not the server it was judged on"
# What the policy decided in an entry read before a re-evaluation's clearing of the decisions
# in the kernel ended: maybe the old policy's (policy_state.Clearing). A dump reads it again.
R_DECIDED_BEFORE = "read before a re-evaluation cleared the decisions"
# The entry a pair holds has had its decision cleared (a re-evaluation's clearing read late,
# or an admin's `conntrack -U --mark`): the pair goes, its connection judged again. Also the
# removal's reason.
R_WITHDRAWN = "its decision was withdrawn"
# An entry in a conntrack zone that its ingress or egress port group does not carry (its
# `vlans` and `untagged`; without them only zone 0, so e.g. an admin's own `-j CT --zone`
# rule's): there is no tag to match or put back, and untagged flows would carry another
# VLAN's traffic.
R_VLAN = "vlan: zone not configured on its port groups"
# A router on a stick's (two VLANs of one trunk): the pipeline layout's table 1 outputs a
# group's shunts to its port, which OpenFlow drops for frames that came in by it.
R_STICK_PIPELINE = "routed: two VLANs of one trunk need the single flow layout"
# A routing firewall's connection would need the router's rewrite (MACs, TTL; NAT): not
# built yet, so it stays on the firewall (docs/design/routed.md, slice 1).
R_ROUTED = "routed: shunting through a routing firewall is not enabled (experimental_routed)"
# With experimental_routed (slice 2): the next hops are being asked for, or the firewall
# would route a direction out of another interface than its port group's (routing.py).
R_HOP_UNKNOWN = routing.R_HOP_UNKNOWN
R_HOP_ELSEWHERE = routing.R_HOP_ELSEWHERE
# The firewall's tables said no (routing.TABLE_REASONS): the event waits for their change (tables.py).
R_NO_ROUTE, R_BLACKHOLE, R_UNRESOLVED, R_NEXT_HOP_FAILED = \
    routed.R_NO_ROUTE, routed.R_BLACKHOLE, routed.R_UNRESOLVED, routed.R_NEXT_HOP_FAILED
R_ROUTE_MOVED, R_FLAPPING = routing.R_ROUTE_MOVED, routing.R_FLAPPING


def _nat(ev: ConnEvent) -> tuple[Rewrite, Rewrite] | None:
    """A routed shunt's NAT rewrite, if its entry translates (docs/design/routed.md, 5.6)."""
    return None if ev.orig.mirrors(ev.reply) else nat_rewrite(ev.orig, ev.reply)


class Act(enum.Enum):
    """What admission does with an event (its verdict's step)."""
    IGNORE = "ignore"  # counted under its reason, nothing else
    FORGET = "forget"  # a DESTROY: what waited or was pinned for the entry goes
    DELETE_STALE = "delete stale"  # an entry re-created behind a live pair: deleted
    TAKE_DOWN = "take down"  # a shunt whose entry closed on the firewall
    NAT_GONE = "nat entry gone"  # the DESTROY of the entry a NAT pair keeps: the pair goes
    MOVED = "ports moved"  # its entry's mark names other ports: the pair goes, the event waits for it
    WITHDRAWN = "withdrawn"  # its entry's decision was cleared: the pair goes
    QUEUE = "queue"  # waits for the pair being taken down on its tuple
    WAIT = "wait"  # decided, no room (budget, id slots): waits on the slow path
    EVICT = "evict"  # a block that takes the newest shunt's room, installed
    INSTALL = "install"


# The members as module names: the per-event checks below read them (an Enum member read
# from its class is a slow attribute lookup, several an event).
IGNORE, FORGET, DELETE_STALE, TAKE_DOWN, NAT_GONE, MOVED, WITHDRAWN, QUEUE, WAIT, EVICT, INSTALL = Act



class Verdict(NamedTuple):
    """An event's verdict (`Admission.verdict`): the step, the R_* reason where nothing is
    installed ("": installed), the pair its tuple names (EVICT: the shunt evicted), what the
    policy (and a pin) decided where it got that far, and the slot an install takes."""
    act: Act
    reason: str
    existing: Conn | None
    decided: Decided | None
    slot: int
    ignored: Ignored | None = None  # the outcome decide made, where it said why not (made once)


_new_verdict = tuple.__new__  # Verdict(...) goes through a Python-level __new__: one an event


_BOTH_PORTS = markcodec.FLAG_INGRESS | markcodec.FLAG_EGRESS
_DECIDED = markcodec.FLAG_DECIDED


def _moved(conn: Conn, mark: int) -> bool:
    """Whether an entry's mark names other ports than the ones its pair was installed on."""
    if mark & _BOTH_PORTS != _BOTH_PORTS:
        return False
    return ((mark & markcodec.INGRESS_MASK) >> markcodec.INGRESS_SHIFT,
            (mark & markcodec.EGRESS_MASK) >> markcodec.EGRESS_SHIFT) != conn.ports


def _withdrawn(conn: Conn, ev: ConnEvent) -> bool:
    """Whether an update (or a dump) of the entry a pair holds says the decision the pair
    rests on was cleared: a re-evaluation's clearing (its update read after a shunt the
    listener read late: policy_state.Clearing), or an admin's `conntrack -U --mark`. A NEW
    event is another entry made on the tuple (the kernel reuses ids), not the pair's."""
    return not ev.mark & _DECIDED and conn.mark & _DECIDED != 0 and ev.kind is not EventKind.NEW \
        and follows_policy(conn)


def _entry_outlived_adoption(conn: Conn) -> bool:
    """An event of the entry of an adopted pair: a pair's entry is taken as deleted by the
    run that installed it, and this one is still there (a first install whose barrier reply
    a disconnect lost, forgotten and then found on the switch; a controller stopped during a
    pair's drain). The switch carries the connection: the entry goes, as a stale one."""
    return conn.adopted and conn.entry_deleted and conn.state is State.LIVE


def _of_held(existing: Conn, ev: ConnEvent) -> Verdict:
    """An event of a held pair's tuple, the pair not being taken down: news of its own entry
    (moved, its decision withdrawn, an adopted pair's entry still there), or a duplicate."""
    own = existing.entry == ev.ct_id
    if own and _moved(existing, ev.mark):
        return _new_verdict(Verdict, (MOVED, R_PORTS_MOVED, existing, None, 0, None))
    if own and _withdrawn(existing, ev):
        return _new_verdict(Verdict, (WITHDRAWN, R_WITHDRAWN, existing, None, 0, None))
    if _entry_outlived_adoption(existing):
        return _new_verdict(Verdict, (DELETE_STALE, R_DUPLICATE, existing, None, 0, None))
    return _new_verdict(Verdict, (IGNORE, R_DUPLICATE, existing, None, 0, None))


def created_by(conn: Conn) -> ConnEvent:
    """The event that created the pair, made again for a retry."""
    assert conn.event_kind is not None
    return ConnEvent(conn.event_kind, conn.entry, conn.orig, conn.reply, conn.mark, conn.tcp_state,
                     conn.event_time)


class Admission:
    def __init__(self, shared: CoreState):
        self.shared = shared

    def conntrack_event(self, ev: ConnEvent) -> list[Command]:
        sh = self.shared
        closing = sh.closing.closing(ev)  # learnt from every event, whichever way it goes
        if closing:
            sh.waiting.pop(ev.orig, None)  # what waited for room has ended: nothing to shunt later
            if ev.tcp_state in TCP_ENDED and sh.pins:
                sh.pins.closed(ev)  # an operator's unshunt ends with its connection
        act, reason, conn, decided, slot, ignored = self.verdict(ev, closing)
        if act is IGNORE:
            if reason == R_DECIDED_BEFORE:
                sh.clearing.ignored += 1  # (said at the clearing's end: a re-evaluation's answer, a start-up's log)
            if reason == R_HOP_UNKNOWN:  # asked, then judged again (core.next_hops_known)
                return [ResolveHops(ev, NextHopTable.wanted(ev)), ignored or Ignored(reason, ev)]
            if reason in routing.TABLE_REASONS:  # the tables said no: judged again when they change (tables.py)
                sh.next_hops.wait(ev, ev.received)
            return [ignored or Ignored(reason, ev)]
        if (act is MOVED or act is WITHDRAWN) and conn is not None:
            # MOVED: the egress a flooded first packet's copy recorded, set right by the connection's
            # reply (iptables.py): the pair sends the connection to the wrong group's port.
            # WITHDRAWN: the decision the pair rests on is gone from its entry.
            conn.mark = ev.mark  # (the hand-back writes the entry's mark as it is now)
            down = sh.conns.take_down(conn, reason, ev.received)
            if act is MOVED:
                conn.resume = ev  # judged again once the pair is gone (WITHDRAWN: by its next packet)
            return [*down, Ignored(reason, ev)]
        if act is NAT_GONE and conn is not None:
            down = sh.conns.take_down(conn, nat.R_NAT_ENTRY_GONE, ev.received)
            return [*down, Ignored(R_DESTROY, ev)]
        if act is FORGET:
            sh.waiting.pop(ev.orig, None)  # gone from the firewall: nothing to shunt later
            sh.next_hops.forget(ev.orig)  # (nor once its next hop is known: routing.py)
            sh.pins.destroyed(ev)
            return [Ignored(R_DESTROY, ev)]
        if act is DELETE_STALE:
            # Packets still in the slow path when the flows went in re-created an entry
            # (loose pickup); the connection runs on the fast path, so it is stale.
            return [DeleteConntrack(ev.orig.family, ev.orig, ev.ct_id), Ignored(R_DUPLICATE, ev)]
        if act is TAKE_DOWN and conn is not None:
            # Its FINs crossed the firewall while the flows went in: the shunt would
            # outlive the connection, carrying a later one on its ports past the firewall.
            conn.closed_on_firewall = True
            conn.closed_by_reset = ev.tcp_state == CT_TCP_CLOSE
            if conn.remove_reason is not None:  # a take-down already waits for the confirmation
                return [Ignored(R_CLOSING, ev)]
            down = sh.conns.take_down(conn, R_CLOSED_ON_FIREWALL, ev.received, closed_on_firewall(ev.tcp_state))
            return [*down, Ignored(R_CLOSING, ev)]
        if act is QUEUE and conn is not None:
            conn.resume = ev  # handled once the old pair is gone
            return [Ignored(R_QUEUED, ev)]
        assert decided is not None
        action = decided[0]
        if act is WAIT:
            self.wait(ev, front=action is Action.BLOCK)
            return [Ignored(reason, ev)]
        out: list[Command] = []
        if act is EVICT:
            out.extend(self.evict_for_block(ev.received, conn) or ())
        sh.waiting.pop(ev.orig, None)
        out.append(InstallFlows(self._pair(ev, decided, slot)))
        return out

    def _pair(self, ev: ConnEvent, decided: Decided, slot: int) -> Conn:
        """The pair an event's decision makes, remembered."""
        action, ingress, egress, idle, authority, hard, sides = decided
        conn = Conn(ev.orig, ev.reply, ev.ct_id, action, ingress, egress, ev.received, event_kind=ev.kind,
                    tcp_state=ev.tcp_state, mark=ev.mark, slot=slot, authority=authority, sides=sides)
        conn.idle_timeout, conn.hard_timeout = idle, hard
        if action is Action.SHUNT and sides is not None and self.shared.switch.experimental_routed:
            hops = self.shared.next_hops.hops(ev, sides, ev.received)  # (decide found them)
            conn.hops = hops if not isinstance(hops, str) else None
            if conn.hops is not None:
                self.shared.next_hops.use(conn)  # (found by the tables' news: core/tables.py)
            conn.nat = _nat(ev)
        self.shared.remember(conn)
        return conn

    def verdict(self, ev: ConnEvent, closing: bool) -> Verdict:
        """What conntrack_event does with an event, and why: decided before anything is
        changed (only `decide` notes on a pin the entry it applies to), so a dry run
        (`dry_run`: nfshunt explain) gets the very reason an event would get."""
        sh = self.shared
        if ev.kind is EventKind.DESTROY:
            held = sh.conns.by_tuple(ev.orig)  # (mostly a drained pair's own delete: found, no NAT)
            if held is not None and nat.keeps(held, ev.ct_id):
                return _new_verdict(Verdict, (NAT_GONE, R_DESTROY, held, None, 0, None))
            return _new_verdict(Verdict, (FORGET, R_DESTROY, None, None, 0, None))
        # A connection we handle: either side may be the new entry's original direction.
        existing = sh.conns.by_tuple(ev.orig)
        if existing is not None:
            if existing.state in ACTIVE and existing.entry != ev.ct_id:
                return _new_verdict(Verdict, (DELETE_STALE, R_DUPLICATE, existing, None, 0, None))
            if closing and existing.entry == ev.ct_id and existing.action is Action.SHUNT \
                    and existing.state is not State.TAKING_DOWN:
                return _new_verdict(Verdict, (TAKE_DOWN, R_CLOSING, existing, None, 0, None))
            if existing.state is not State.TAKING_DOWN:
                return _of_held(existing, ev)
        decided = self.decide(ev, closing)
        if existing is None and not isinstance(decided, Ignored) and (sh.version is None or not sh.reconciled):
            # (before a routed shunt's next hops: a backup, or a controller whose switch is
            # away, neither asks the tables nor parks the event until they answer)
            return _new_verdict(Verdict, (IGNORE, R_BACKUP if sh.backup else R_NO_SWITCH, None, decided, 0, None))
        if not isinstance(decided, Ignored) and decided[6] is not None and decided[0] is Action.SHUNT:
            hops = sh.next_hops.hops(ev, decided[6], ev.received)  # (routing.py)
            decided = Ignored(hops, ev) if isinstance(hops, str) else decided
        if isinstance(decided, Ignored):
            return _new_verdict(Verdict, (IGNORE, decided.reason, existing, None, 0, decided))
        action = decided[0]
        if existing is None and decided[6] is not None and not ev.orig.mirrors(ev.reply) \
                and sh.conns.by_tuple(ev.reply) is not None:  # (NAT is shunted routed only: `sides`)
            # A translation onto a held pair's tuple (that pair's entry went at its drain, so
            # nf_nat saw no clash): its reply flow would take the held pair's place on the switch.
            return _new_verdict(Verdict, (IGNORE, R_REPLY_HELD, None, decided, 0, None))
        if existing is not None:  # TAKING_DOWN: handle once the old pair is gone
            if ev.kind is EventKind.DUMP:
                # Most likely the entry whose deletion is still on its way. A connection
                # that really resumes says so with live events of its own.
                return _new_verdict(Verdict, (IGNORE, R_DUPLICATE, existing, decided, 0, None))
            return _new_verdict(Verdict, (QUEUE, R_QUEUED, existing, decided, 0, None))
        assert sh.version is not None  # (a backup's, and an away switch's, returned above)
        if ev.orig.family == 6 and sh.version < OFP13:
            return _new_verdict(Verdict, (IGNORE, R_IPV6_OF10, None, decided, 0, None))
        slot = sh.conns.free_slot(ev.ct_id)
        if slot is None:
            # Ids are a 32-bit hash: live pairs share one now and then and take the next
            # slot; with every slot of this id taken, the connection waits on the slow path.
            return _new_verdict(Verdict, (WAIT, R_ID_COLLISION, None, decided, 0, None))
        if sh.budget and sh.conns.shunts + sh.conns.blocks >= sh.budget:
            victim = None if action is Action.SHUNT else self._victim()
            if victim is None:
                return _new_verdict(Verdict, (WAIT, R_BUDGET, None, decided, 0, None))
            return _new_verdict(Verdict, (EVICT, "", victim, decided, slot, None))  # (`existing`: the one evicted)
        return _new_verdict(Verdict, (INSTALL, "", None, decided, slot, None))

    def dry_run(self, ev: ConnEvent) -> Verdict:
        """The verdict an event for this entry would get now, with nothing changed: the
        closing entries are asked, not taught, and a pin keeps the entry it applied to."""
        sh = self.shared
        pin = sh.pins.get(ev.orig) if sh.pins else None
        applied = pin.ct_id if pin is not None else None
        try:
            return self.verdict(ev, sh.closing.peek(ev))
        finally:
            if pin is not None:
                pin.ct_id = applied

    def decide(self, ev: ConnEvent, closing: bool) -> Ignored | Decided:
        """What the mark (and a pin) decided for a new or updated entry, the port groups it
        crossed and the pin's idle timeout (an IDS rule's, where its action is taken;
        None: the config's default); what decided it and, for a pin that changed the
        policy's decision, the hard timeout that ends its pair with the pin; or why nothing
        is to be done. `closing`: the entry is a closing TCP one, as its event or an earlier
        one said (closing.py)."""
        if ev.mark & markcodec.NFSHUNT_BITS == 0:
            return Ignored(R_UNMARKED, ev)
        mark = markcodec.decode(ev.mark)
        if not mark.complete:
            return Ignored(R_INCOMPLETE, ev)
        cfg = self.shared.cfg
        action = cfg.action_for(mark.action)  # type: ignore[arg-type]
        if action is None:
            return Ignored(R_UNKNOWN_ACTION, ev)
        pins = self.shared.pins
        pin = pins.get(ev.orig) if pins else None
        idle, authority, hard = None, Authority.POLICY, 0
        overridden = False  # a pin decided whatever the policy said: an operator's, an IDS's block
        if pin is not None and pin.server is not None and pin.server != (ev.orig.dst, ev.orig.dport):
            # An IDS shunt judged on the other end as the server (before the entry was
            # seen): this connection goes the other way round, outside what was judged.
            if action is Action.IGNORE:
                return Ignored(R_IDS_SERVER, ev)
            pin = None
        if pin is not None:
            now = max(ev.received, self.shared.now)
            pin.ct_id = ev.ct_id
            if pin.action is Action.IGNORE:
                return Ignored(R_PINNED, ev)
            # (A pin at its end is not applied: an IDS rule's is released by its tick.)
            if pin.expires > now and (pin.source is None or pin.action is Action.BLOCK or action is Action.IGNORE):
                # (an IDS's shunt only of what the policy accepted and left alone)
                overridden = pin.source is None or pin.action is Action.BLOCK
                if action is not pin.action:  # the pin, not the policy, decides: bounded by it
                    authority = Authority.OPERATOR if pin.source is None else Authority.IDS
                    hard = hard_timeout(pin.expires, now)
                action = pin.action
            if action is pin.action:
                idle = pin.idle_timeout
        if action is Action.IGNORE:
            return Ignored(R_POLICY_IGNORE, ev)
        ports = self._ports(ev, mark, action)
        if isinstance(ports, Ignored):
            return ports
        ingress, egress, sides = ports
        if ev.orig.proto not in (TCP, UDP):
            return Ignored(R_PROTOCOL, ev)
        if closing:
            return Ignored(R_CLOSING, ev)
        if not ev.orig.mirrors(ev.reply) and not self.shared.switch.experimental_routed:
            return Ignored(R_NAT, ev)  # the switch would have to rewrite addresses (a router's: slice 4)
        if not overridden and ev.received < self.shared.clearing.since:
            # The decision (or an IDS's shunt, which rests on it) may be an old policy's: a
            # re-evaluation's clearing had not ended when the entry was read (policy_state.Clearing).
            return Ignored(R_DECIDED_BEFORE, ev)
        return action, ingress, egress, idle, authority, hard, sides

    def _ports(self, ev: ConnEvent, mark: markcodec.Mark,
               action: Action) -> Ignored | tuple[PortGroup, PortGroup, Sides | None]:
        """The port groups the mark names (and a routing firewall's interfaces), or why not."""
        switch = self.shared.switch
        zone = ev.orig.zone
        if switch.forwarding == "routed":
            # The mark names the router's interfaces: a trunk's VLANs are each its own, and
            # two of one trunk are routed between (router on a stick) as any two are.
            a, b = switch.sides.get(mark.ingress), switch.sides.get(mark.egress)  # type: ignore[arg-type]
            if a is None or b is None:
                return Ignored(R_UNKNOWN_PORT, ev)
            if a is b:
                return Ignored(R_SAME_PORT, ev)
            if not switch.experimental_routed:
                return Ignored(R_ROUTED, ev)  # (a bridge's flows would hand the host the router's frames)
            if zone != a.zone or zone != b.zone:  # (an admin's own CT rule)
                return Ignored(R_VLAN, ev)
            if a.group is b.group and goes_to_pipeline(self.shared.version, self.shared.cfg, action, ev.orig.proto,
                                                       self.shared.pipeline):
                return Ignored(R_STICK_PIPELINE, ev)  # (table 1 outputs to the group's port: dropped)
            return a.group, b.group, (a, b)
        ingress = switch.by_physdevin.get(mark.ingress)  # type: ignore[arg-type]
        egress = switch.by_physdevin.get(mark.egress)  # type: ignore[arg-type]
        if ingress is None or egress is None:
            return Ignored(R_UNKNOWN_PORT, ev)
        if ingress is egress:
            return Ignored(R_SAME_PORT, ev)
        # Each side must carry the zone (a tag to match and put back): else, e.g. an admin's
        # own CT rule's.
        if zone not in ingress.vid_of_zone or zone not in egress.vid_of_zone:
            return Ignored(R_VLAN, ev)
        return ingress, egress, None

    # --- room on the switch -----------------------------------------------------------------

    def wait(self, ev: ConnEvent, front: bool) -> None:
        waiting = self.shared.waiting
        waiting[ev.orig] = ev
        if front:
            waiting.move_to_end(ev.orig, last=False)
        while len(waiting) > WAITING_MAX:
            waiting.popitem(last=True)

    def wait_again(self, conn: Conn) -> None:
        """A pair the switch had no room for (its table full, or its install never sent)
        waits again as the event that created it. An adopted pair is never retried, nor one
        taken down meanwhile (its connection closed, or was unshunted)."""
        if conn.event_kind is not None and conn.remove_reason is None:
            self.wait(created_by(conn), front=conn.action is Action.BLOCK)

    def _blocks_may_evict(self) -> bool:
        """Blocks take room from shunts only up to `max_block_share` of the budget: a host
        that gets itself blocked on many connections cannot push every shunt off the switch."""
        conns = self.shared.conns
        budget = self.shared.budget or (conns.shunts + conns.blocks)
        return conns.blocks < budget * self.shared.cfg.max_block_share

    def evict_for_block(self, now: float, victim: Conn | None = None) -> list[Command] | None:
        """Make room for a block: take down the newest active shunt (blocks come first; the
        verdict names it). None: blocks may not evict (max_block_share), or there is no
        shunt to evict."""
        victim = victim or self._victim()
        if victim is None:
            return None
        # The budget is freed now; the evicted connection returns to the slow path alive
        # and, judged there again, waits for room like any other shunt.
        conns = self.shared.conns
        conns.uncount(victim)
        return conns.hand_back(victim, "evicted for a block", now)

    def _victim(self) -> Conn | None:
        """The shunt a block would evict: the newest active one, if blocks may evict."""
        if not self._blocks_may_evict():
            return None
        victim: Conn | None = None
        for conn in self.shared.conns.by_key.values():
            if conn.action is Action.SHUNT and conn.state in ACTIVE and (
                    victim is None or (conn.confirmed_time or 0) >= (victim.confirmed_time or 0)):
                victim = conn
        return victim

    def room_freed(self, room: int) -> list[Command]:
        """The switch can take `room` more installs: that many waiting connections are
        tried again, oldest first (blocks were put first)."""
        if not self.shared.waiting or not self.shared.reconciled:
            return []
        waiting = self.shared.waiting
        out: list[Command] = []
        while waiting and room > 0:
            _, ev = waiting.popitem(last=False)
            got = self.conntrack_event(ev)
            if ev.orig in waiting:
                # Still no room, or its id still held: it was counted as ignored when it
                # first waited (counted at every retry, one collision read as thousands).
                out.extend(c for c in got if not isinstance(c, Ignored))
                break
            out.extend(got)
            if any(isinstance(c, InstallFlows) for c in got):
                room -= 1
        return out
