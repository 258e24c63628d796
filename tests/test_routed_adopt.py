"""A routing firewall's pairs read back after a controller restart or a switch reconnect
(docs/design/routed.md 5.6, 5.7): the flow reader keeps a routed flow's rewrite (dec_ttl, the
MACs, a NAT's set_fields) as typed fields; the reconcile adopts a routed pair and checks it
against the firewall's tables (asked off the event loop) and a NAT pair against its kept
conntrack entry (one lookup): kept as it is, rewritten in place, or handed back alive."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import pytest

os.environ.setdefault("OSKEN_HUB_TYPE", "native")
from os_ken.ofproto import ofproto_protocol, ofproto_v1_3_parser  # noqa: E402

from nfshunt.core import routed_adoption, routing  # noqa: E402
from nfshunt.core.connection import CT_TCP_FIN_WAIT, State  # noqa: E402
from nfshunt.core.routed_adoption import R_NAT_ENTRY_GONE, R_NAT_ENTRY_OTHER  # noqa: E402
from nfshunt.openflow.flows import FlowBuilder  # noqa: E402
from nfshunt.openflow.stats import FlowEntry  # noqa: E402
from nfshunt.records import cookies, markcodec  # noqa: E402
from nfshunt.records.model import (  # noqa: E402
    OFP13,
    TCP,
    UDP,
    ConnEvent,
    EventKind,
    FlowRewrite,
    FlowTuple,
    NextHop,
    Rewrite,
    nat_ranges,
)
from nfshunt.records.routed import R_NO_ROUTE, R_UNRESOLVED  # noqa: E402
from tests.helpers import config, event  # noqa: E402
from tests.support.rig import Rig, fast, slow  # noqa: E402
from tests.test_flowstats import _entry, _parse, _reply  # noqa: E402
from tests.test_routed import FW0, FW1, GOOD, H1_MAC, H2_MAC, ROUTED_PORTS  # noqa: E402

ROUTED = dict(forwarding="routed", ports=ROUTED_PORTS, openflow_versions=["1.3"], experimental_routed=True,
              flow_layout="single")
DP = ofproto_protocol.ProtocolDesc(OFP13)
P, OFP = DP.ofproto_parser, DP.ofproto
NEW_MAC = "02:00:00:00:02:99"
H1, H2 = "10.0.0.1", "10.0.0.2"
# A masquerade of h1's address and port (design F11's shape on the helpers' addresses).
MASQ_REPLY = FlowTuple(4, TCP, H2, "10.0.0.254", 5201, 61000)


class FakeFollower:
    """The route follower (kernel/routes.TableFollower) as the dispatcher reaches it: each
    question answered on the loop from `answers` (the firewall's tables, the test's)."""

    def __init__(self, answers: dict[str, Any]):
        self.answers = answers
        self.asked: list[tuple[str, ...]] = []
        self.solicited: list[str] = []  # the unresolved next hops the kernel was asked to resolve

    def ask(self, addresses: tuple[str, ...], answered: Callable[[dict[str, Any]], None],
            solicit: bool = False) -> None:
        self.asked.append(tuple(addresses))
        answers = {a: self.answers.get(a, R_NO_ROUTE) for a in addresses}
        if solicit:
            self.solicited += [a for a, answer in answers.items() if answer == R_UNRESOLVED]
        answered(answers)

    def stop(self) -> None:
        pass


def routed_rig(answers: dict[str, Any], switch=None, now=100.0, **cfg: Any) -> Rig:
    """A routed controller on the rig, the firewall's tables answering from `answers`."""
    rig = Rig(OFP13, switch=switch, now=now, connect=False, **cfg)
    rig.dispatcher.tables.follower = FakeFollower(dict(answers))
    rig.connect(rig.switch)
    return rig


def _rig(answers=None, switch=None, now=100.0) -> Rig:
    return routed_rig(GOOD if answers is None else answers, switch, now, **ROUTED)


def _shunted(rig: Rig, ev: ConnEvent):
    rig.events([ev])
    conn = rig.core.find(tuple_=ev.orig)
    assert conn is not None and conn.hops is not None, "not shunted with the router's rewrite"
    rig.advance(rig.core.switch.drain)
    assert conn.state is State.LIVE
    return conn


def _nat_event(**kw) -> ConnEvent:
    ev = event(**{"received": 100.0, **kw})
    ev.reply = MASQ_REPLY
    return ev


def _pair_flows(rig: Rig) -> list[Any]:
    """The switch's shunt flows read back as the controller reads them (SwitchFlow)."""
    fb = rig.s.fb
    return [fb.parse_stats(FlowEntry.parser(rig.switch.stats_entry(e), 0)) for e in rig.flows(cookies.Kind.SHUNT)]


def _restarted(first: Rig, answers=None) -> Rig:
    """A new controller on the same switch (which kept its table): the pairs read back."""
    return _rig(answers, switch=first.switch, now=first.now + 1)


# --- the reader -------------------------------------------------------------------------------

def _routed_builder():
    fb = FlowBuilder(DP, config(**ROUTED))
    fb.templated = False
    return fb


def _routed_conn(reply: FlowTuple | None = None, **kw):
    from nfshunt.core import core as c
    core = c.Core(config(**ROUTED))
    core.switch_connected(OFP13)
    core.reconcile([], 0.0)
    ev = event(**kw)
    if reply is not None:
        ev.reply = reply
    core.shared.next_hops.learn({**GOOD, "fd00::2": GOOD[H2], "fd00::1": GOOD[H1]}, ev.received)
    (install,) = core.conntrack_event(ev)
    return install.conn


def test_a_routed_pair_s_rewrite_reads_back_as_typed_fields_the_same_both_ways():
    """dec_ttl and both MACs, and a NAT's set_fields, from the bytes (FlowEntry) as from
    os-ken's parse; the flows and their catchers, IPv4 and IPv6, TCP and UDP."""
    fb = _routed_builder()
    plain, masq = _routed_conn(), _routed_conn(reply=MASQ_REPLY, ct_id=8)
    v6 = _routed_conn(family=6, proto=UDP, ct_id=9,
                      reply=FlowTuple(6, UDP, "fd00::2", "fd00::fe", 5201, 61001))
    mods = fb.install(plain) + fb.install(masq) + fb.install(v6)
    buf = _reply([_entry(m) for m in mods])
    lean = [fb.parse_stats(s) for s in _parse(buf, FlowEntry)]
    assert lean == [fb.parse_stats(s) for s in _parse(buf, ofproto_v1_3_parser.OFPFlowStats)]
    by_cookie = {f.cookie: f for f in lean}
    assert by_cookie[plain.cookie(False)].rewrite == FlowRewrite(FW1, H2_MAC)
    assert by_cookie[plain.cookie(True)].rewrite == FlowRewrite(FW0, H1_MAC)
    assert by_cookie[masq.cookie(False)].rewrite == FlowRewrite(FW1, H2_MAC, Rewrite(src="10.0.0.254", sport=61000))
    assert by_cookie[masq.cookie(True)].rewrite == FlowRewrite(FW0, H1_MAC, Rewrite(dst=H1, dport=40000))
    assert by_cookie[v6.cookie(False)].rewrite == FlowRewrite(FW1, H2_MAC, Rewrite(src="fd00::fe", sport=61001))
    pairs = [f for f in lean if cookies.parse(f.cookie)[0] is cookies.Kind.SHUNT]
    assert len(pairs) == 6 and all(f.exact for f in pairs)
    catchers = [f for f in lean if cookies.parse(f.cookie)[0] is cookies.Kind.TEARDOWN]
    assert len(catchers) == 8 and all(f.rewrite is not None for f in catchers)


@pytest.mark.parametrize("actions", [
    [P.OFPActionDecNwTtl(), P.OFPActionSetField(eth_src=FW1), P.OFPActionOutput(3)],  # one MAC
    [P.OFPActionSetField(eth_src=FW1), P.OFPActionSetField(eth_dst=H2_MAC), P.OFPActionOutput(3)],  # no dec_ttl
    [P.OFPActionSetField(eth_src=FW1), P.OFPActionDecNwTtl(), P.OFPActionSetField(eth_dst=H2_MAC),
     P.OFPActionOutput(3)],  # out of order
    [P.OFPActionDecNwTtl(), P.OFPActionSetField(eth_src=FW1), P.OFPActionSetField(eth_dst=H2_MAC),
     P.OFPActionSetField(tcp_src=9), P.OFPActionSetField(ipv4_src="10.0.0.9"), P.OFPActionOutput(3)],  # NAT order
    [P.OFPActionDecNwTtl(), P.OFPActionSetField(eth_src=FW1), P.OFPActionSetField(eth_dst=H2_MAC),
     P.OFPActionSetField(ip_dscp=1), P.OFPActionOutput(3)],  # another field
    [P.OFPActionOutput(3), P.OFPActionDecNwTtl(), P.OFPActionSetField(eth_src=FW1),
     P.OFPActionSetField(eth_dst=H2_MAC)],  # after the frame left
])
def test_a_rewrite_of_another_shape_is_never_read_as_a_routed_pair_s(actions):
    t = event().orig
    mod = P.OFPFlowMod(DP, cookie=cookies.make(cookies.Kind.SHUNT, 7), priority=33000,
                       match=_routed_builder().match(1, t, vid=0),
                       instructions=[P.OFPInstructionActions(OFP.OFPIT_APPLY_ACTIONS, actions)])
    fb = _routed_builder()
    buf = _reply([_entry(mod)])
    lean, lib = ([fb.parse_stats(s) for s in _parse(buf, body)] for body in (FlowEntry,
                                                                            ofproto_v1_3_parser.OFPFlowStats))
    assert lean == lib and not lean[0].exact


# --- adoption: a routed pair ------------------------------------------------------------------

def test_a_restarted_controller_adopts_a_routed_pair_whose_next_hops_are_the_tables_answer():
    first = _rig()
    conn = _shunted(first, event(received=first.now))
    entries = {e.cookie: e for e in first.flows(cookies.Kind.SHUNT)}
    again = _restarted(first)
    adopted = again.core.find(tuple_=conn.orig)
    assert adopted is not None and adopted.adopted and adopted.state is State.LIVE and adopted.key == conn.key
    assert again.dispatcher.tables.follower.asked == [(H2, H1)]  # asked, once, off the loop
    assert adopted.hops == (GOOD[H2], GOOD[H1]) and adopted.nat is None
    # Not re-installed, not rewritten: the very entries (same cookies, same install time).
    assert {e.cookie: e for e in again.flows(cookies.Kind.SHUNT)} == entries
    assert all(e.added == entries[e.cookie].added for e in again.flows(cookies.Kind.SHUNT))
    counted = again.counters.flat()
    assert counted.get("routed_rewrites", 0) == 0 and counted.get("reconcile_deleted", 0) == 0
    assert not again.worker.restores and not again.worker.looked_up
    assert fast(again, adopted)
    # Followed as any routed pair: the tables' news finds it.
    assert again.core.shared.next_hops.users_of([H2], lambda c: True) == [adopted]


def test_an_adopted_routed_pair_whose_neighbour_changed_its_mac_is_rewritten_in_place():
    first = _rig()
    conn = _shunted(first, event(received=first.now))
    before = {e.cookie for e in first.flows(cookies.Kind.SHUNT)}
    again = _restarted(first, {**GOOD, H2: dataclasses.replace(GOOD[H2], eth_dst=NEW_MAC)})
    adopted = again.core.find(tuple_=conn.orig)
    assert adopted is not None and adopted.state is State.LIVE and adopted.hops[0].eth_dst == NEW_MAC
    assert again.counters.flat().get("routed_rewrites", 0) == 1
    flows = {f.cookie: f for f in _pair_flows(again)}
    assert set(flows) == before
    assert flows[conn.cookie(False)].rewrite == FlowRewrite(FW1, NEW_MAC)
    assert flows[conn.cookie(True)].rewrite == FlowRewrite(FW0, H1_MAC)
    assert not again.worker.restores and fast(again, adopted)


@pytest.mark.parametrize("answer,reason", [
    (NextHop("fw-eth0", FW0, H2_MAC), routing.R_ROUTE_MOVED),
    (R_NO_ROUTE, R_NO_ROUTE),
])
def test_an_adopted_routed_pair_whose_route_moved_or_went_is_handed_back_alive(answer, reason):
    first = _rig()
    conn = _shunted(first, event(received=first.now))
    again = _restarted(first, {**GOOD, H2: answer})
    adopted = again.core.find(tuple_=conn.orig)
    assert adopted is not None and adopted.state is State.TAKING_DOWN and adopted.remove_reason == reason
    assert [r.orig for r in again.worker.restores] == [conn.orig]  # its entry comes back first (alive)
    again.kernel_answers()
    assert slow(again, conn) and not again.core.by_key
    assert again.counters.flat().get(f"removed:shunt:{reason}") == 1


def test_a_new_master_keeps_an_adopted_pair_while_its_kernel_resolves_a_next_hop_it_never_sent_to():
    """A routed pair's takeover (docs/routed.md "A firewall pair"): the flows carry the old
    master's MAC as source; the new master's kernel has no entry for h2 (its slow ports heard
    nothing while it stood by). The next hop is solicited and the pair keeps its flows
    meanwhile; resolved, the tables' news rewrites them in place with the new master's MAC."""
    first = _rig()
    conn = _shunted(first, event(received=first.now))
    before = {e.cookie for e in first.flows(cookies.Kind.SHUNT)}
    again = _restarted(first, {**GOOD, H2: R_UNRESOLVED})
    adopted = again.core.find(tuple_=conn.orig)
    assert adopted is not None and adopted.state is State.LIVE
    assert again.dispatcher.tables.follower.solicited == [H2]
    assert again.counters.flat().get("routed_next_hops_solicited") == 1
    again.advance(routed_adoption.RESOLVE_WAIT - 1)
    assert adopted.state is State.LIVE and fast(again, adopted) and not again.worker.restores
    mine = dataclasses.replace(GOOD[H2], eth_src=NEW_MAC)  # (the new master's egress MAC)
    again.run(again.core.tables_changed({H2: mine}, again.now))
    again.advance(routed_adoption.RESOLVE_WAIT)  # (past the wait: resolved, it stays)
    assert adopted.state is State.LIVE and adopted.hops[0] == mine
    flows = {f.cookie: f for f in _pair_flows(again)}
    assert set(flows) == before  # the same flows, rewritten in place
    assert flows[conn.cookie(False)].rewrite == FlowRewrite(NEW_MAC, H2_MAC)
    assert flows[conn.cookie(True)].rewrite == FlowRewrite(FW0, H1_MAC)
    assert not again.worker.restores and fast(again, adopted)


def test_an_adopted_pair_whose_resolution_reached_the_core_as_an_answer_not_as_news_is_rewritten_too():
    """Another question for h2 (a new connection's ResolveHops) can be answered with the
    resolved MAC before the follower tells it as news: the follower then has no change to
    tell, and the adoption's own check rewrites the pair."""
    first = _rig()
    conn = _shunted(first, event(received=first.now))
    again = _restarted(first, {**GOOD, H2: R_UNRESOLVED})
    adopted = again.core.find(tuple_=conn.orig)
    mine = dataclasses.replace(GOOD[H2], eth_src=NEW_MAC)
    again.core.shared.next_hops.learn({H2: mine}, again.now)  # (an answer, no news)
    again.advance(1.0)
    assert adopted.state is State.LIVE and adopted.hops[0] == mine
    assert {f.cookie: f for f in _pair_flows(again)}[conn.cookie(False)].rewrite == FlowRewrite(NEW_MAC, H2_MAC)


def test_an_adopted_pair_whose_next_hop_does_not_resolve_goes_back_alive_after_the_wait():
    first = _rig()
    conn = _shunted(first, event(received=first.now))
    again = _restarted(first, {**GOOD, H2: R_UNRESOLVED})
    adopted = again.core.find(tuple_=conn.orig)
    again.advance(routed_adoption.RESOLVE_WAIT - 1)
    assert adopted.state is State.LIVE and fast(again, adopted)
    again.advance(2)
    assert adopted.state is State.TAKING_DOWN and adopted.remove_reason == R_UNRESOLVED
    assert [r.orig for r in again.worker.restores] == [conn.orig]  # its entry comes back first (alive)
    again.kernel_answers()
    assert slow(again, conn) and again.counters.flat().get(f"removed:shunt:{R_UNRESOLVED}") == 1


def test_a_routed_pair_whose_mac_changed_while_the_switch_was_away_is_rewritten_at_the_reconnect():
    """The tables' news came while the switch was away: its RewriteFlows went nowhere. The
    switch kept its table: the reconcile finds the old MAC in the flows and rewrites them."""
    rig = _rig()
    conn = _shunted(rig, event(received=rig.now))
    rig.disconnect()
    rig.run(rig.core.tables_changed({H2: dataclasses.replace(GOOD[H2], eth_dst=NEW_MAC)}, rig.now))
    assert conn.hops[0].eth_dst == NEW_MAC
    rig.connect(rig.switch)
    assert conn.state is State.LIVE and rig.core.find(tuple_=conn.orig) is conn
    flows = {f.cookie: f for f in _pair_flows(rig)}
    assert flows[conn.cookie(False)].rewrite == FlowRewrite(FW1, NEW_MAC)
    assert not rig.worker.restores and fast(rig, conn)


# --- adoption: a NAT pair ---------------------------------------------------------------------

def _kept_entry(conn, ct_id=None, reply=None) -> ConnEvent:
    return ConnEvent(EventKind.DUMP, conn.ct_id if ct_id is None else ct_id, conn.orig, reply or conn.reply,
                     0x10010000, 3, 0.0)


def test_a_restarted_controller_adopts_a_nat_pair_by_its_reply_tuple_when_its_entry_is_there():
    first = _rig()
    conn = _shunted(first, _nat_event())
    assert conn.nat is not None and not conn.entry_deleted
    entries = {e.cookie: e.added for e in first.flows(cookies.Kind.SHUNT)}
    again = Rig(OFP13, switch=first.switch, now=first.now + 1, connect=False, **ROUTED)
    again.dispatcher.tables.follower = FakeFollower(GOOD)
    again.worker.entries[conn.orig] = _kept_entry(conn)
    again.connect(again.switch)
    adopted = again.core.find(tuple_=conn.orig)
    assert adopted is not None and adopted.reply == MASQ_REPLY and again.core.find(tuple_=MASQ_REPLY) is adopted
    assert adopted.nat == conn.nat and not adopted.entry_deleted
    assert again.worker.looked_up == [conn.orig]  # one lookup, through the worker
    again.kernel_answers()  # (the lookup's answer)
    assert adopted.state is State.LIVE and not again.worker.restores and not again.worker.deleted
    assert {e.cookie: e.added for e in again.flows(cookies.Kind.SHUNT)} == entries
    assert fast(again, adopted)
    # Its kept entry is the controller's to keep alive, as before the restart.
    again.advance(2.0)
    assert [t for t, _, _ in again.worker.refreshed] == [conn.orig]


@pytest.mark.parametrize("action,kept", [(1, True), (0, False), (2, False)])
def test_a_nat_pair_s_entry_made_anew_with_its_tuples_is_kept_when_its_mark_decided_the_same(action, kept):
    """A pair's takeover: conntrackd's commit makes the synced entry anew on the new master
    (another id; the same tuples and mark): the pair is kept, its entry refreshed by its tuple.
    The same tuples decided otherwise (ignored, blocked: the policy changed meanwhile) are
    another connection's: deleted, and the pair handed back with its NAT."""
    first = _rig()
    conn = _shunted(first, _nat_event())
    entries = {e.cookie: e.added for e in first.flows(cookies.Kind.SHUNT)}
    again = Rig(OFP13, switch=first.switch, now=first.now + 1, connect=False, **ROUTED)
    again.dispatcher.tables.follower = FakeFollower(GOOD)
    again.worker.entries[conn.orig] = ConnEvent(EventKind.DUMP, 99, conn.orig, conn.reply,
                                                markcodec.encode(1, 2, action, admin=0x1234), 3, 0.0)
    again.connect(again.switch)
    adopted = again.core.find(tuple_=conn.orig)
    again.kernel_answers()  # (the lookup's answer)
    if kept:
        assert adopted.state is State.LIVE and not again.worker.restores and not again.worker.deleted
        assert {e.cookie: e.added for e in again.flows(cookies.Kind.SHUNT)} == entries and fast(again, adopted)
        again.advance(2.0)
        assert [(t, ct_id) for t, ct_id, _ in again.worker.refreshed] == [(conn.orig, 99)]
        # Its entry's events carry the new id: the pair's own, not a stale duplicate to delete
        # (the refresh reports one) ...
        again.events([_nat_event(ct_id=99, received=again.now)])
        assert adopted.state is State.LIVE and not again.worker.deleted
        # ... and its close seen on the firewall takes the shunt down.
        again.events([_nat_event(ct_id=99, received=again.now, state=CT_TCP_FIN_WAIT)])
        assert adopted.state is State.TAKING_DOWN and not again.worker.deleted
    else:
        assert adopted.state is State.TAKING_DOWN and adopted.remove_reason == R_NAT_ENTRY_OTHER
        assert again.worker.deleted == [(conn.orig, 99)]


@pytest.mark.parametrize("other", [False, True])
def test_a_nat_pair_whose_entry_is_gone_or_another_s_is_handed_back_with_its_nat(other):
    first = _rig()
    conn = _shunted(first, _nat_event())
    again = Rig(OFP13, switch=first.switch, now=first.now + 1, connect=False, **ROUTED)
    again.dispatcher.tables.follower = FakeFollower(GOOD)
    if other:  # re-created while the controller was away, with another translation
        again.worker.entries[conn.orig] = _kept_entry(conn, ct_id=99, reply=MASQ_REPLY._replace(dport=61999))
    again.connect(again.switch)
    adopted = again.core.find(tuple_=conn.orig)
    assert adopted is not None and adopted.state is State.LIVE
    again.kernel_answers()  # (the lookup's answer)
    assert adopted.state is State.TAKING_DOWN
    assert adopted.remove_reason == (R_NAT_ENTRY_OTHER if other else R_NAT_ENTRY_GONE)
    assert again.worker.deleted == ([(conn.orig, 99)] if other else [])
    (restore,) = again.worker.restores
    assert restore.orig == conn.orig and restore.nat == nat_ranges(conn.orig, MASQ_REPLY) != ()
    again.kernel_answers()
    assert slow(again, adopted) and not again.core.by_key


def test_a_bridged_switch_never_adopts_a_routed_pair_and_a_routed_one_never_a_bridged_pair():
    first = _rig()
    conn = _shunted(first, event(received=first.now))
    bridged = Rig(OFP13, switch=first.switch, now=first.now + 1)  # the same flows, a bridge's config
    assert bridged.core.find(tuple_=conn.orig) is None and not bridged.flows(cookies.Kind.SHUNT)
    plain = Rig(OFP13)
    shunt = plain.event()
    plain.advance(plain.core.switch.drain)
    routed = _rig(switch=plain.switch, now=plain.now + 1)
    assert routed.core.find(tuple_=shunt.orig) is None and not routed.flows(cookies.Kind.SHUNT)


def test_the_worker_looks_an_entry_up_on_its_thread_before_a_dump_asked_after_it(monkeypatch):
    """One lookup by the original tuple (kernel/table.entry_of) on the worker's thread; a
    kernel that cannot be asked answers why, and nothing is raised."""
    from nfshunt.kernel import worker as wk
    found = ConnEvent(EventKind.DUMP, 7, event().orig, MASQ_REPLY, 0, 3, 0.0)
    order: list[str] = []

    def entry_of(t):
        order.append("lookup")
        if t.sport == 1:
            raise OSError("netlink gone")
        return found if t == found.orig else None
    monkeypatch.setattr(wk, "entry_of", entry_of)
    w = wk.ConntrackWorker(on_dump=lambda events: None, on_malformed=lambda what: None)
    w._dump = lambda: order.append("dump")  # (no kernel)
    answers: list[Any] = []
    w.look_up(found.orig, lambda entry, failed: answers.append((entry, failed)))
    w.look_up(found.orig._replace(sport=2), lambda entry, failed: answers.append((entry, failed)))
    w.look_up(found.orig._replace(sport=1), lambda entry, failed: answers.append((entry, failed)))
    w.dump()
    w.start()
    w.stop()
    assert answers == [(found, None), (None, None), (None, "netlink gone")]
    assert order == ["lookup"] * 3 + ["dump"]
