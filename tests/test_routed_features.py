"""What exists works routed (issue 38 item 5), on the rig: an IDS's requests (a connection the
policy left alone, shunted by an IDS's rule, carries the router's rewrite and the rule's bound:
its authority in the cookies, its hard timeout on the switch, and goes back to the firewall at
the rule's end; an IDS's block drops on the switch with no next hop to ask), and confirmation
behind a switch that has not answered its barrier (the entry kept meanwhile)."""
from __future__ import annotations

from nfshunt.core.connection import State
from nfshunt.ids.calls import Result
from nfshunt.ids.rules import Kind
from nfshunt.records import cookies
from nfshunt.records.model import OFP13, FlowRewrite
from tests.helpers import event
from tests.support import fakeswitch as fs
from tests.support.rig import Rig, fast, slow
from tests.test_ids_backend import ORIG, rule, setup, tick
from tests.test_routed import FW0, FW1, GOOD, H1_MAC, H2_MAC
from tests.test_routed_adopt import ROUTED, FakeFollower, _pair_flows


def _routed_rig() -> Rig:
    rig = Rig(OFP13, connect=False, **ROUTED)
    rig.dispatcher.tables.follower = FakeFollower(dict(GOOD))
    rig.connect(rig.switch)
    return rig


def test_an_ids_shunt_through_a_routing_firewall_carries_the_routers_rewrite_and_ends_with_its_rule():
    rig, backend, entries, _ = setup(rig=_routed_rig())
    entries[ORIG] = event(action=0, sport=ORIG.sport, ct_id=ORIG.sport)  # (the policy left it alone)
    out = backend.submit(rule(rig, expire=60, connection=ORIG), 1.0)
    assert out.result is Result.ADDED, out
    conn = rig.core.find(tuple_=ORIG)
    assert conn is not None and conn.hops == (GOOD["10.0.0.2"], GOOD["10.0.0.1"])
    rig.advance(rig.core.switch.drain)
    assert conn.state is State.LIVE and fast(rig, conn)
    flows = {f.cookie: f for f in _pair_flows(rig)}
    assert flows[conn.cookie(False)].rewrite == FlowRewrite(FW1, H2_MAC)
    assert flows[conn.cookie(True)].rewrite == FlowRewrite(FW0, H1_MAC)
    assert {cookies.authority(c) for c in flows} == {cookies.Authority.IDS}
    assert {f.hard_timeout for f in flows.values()} == {61}  # (the rule's end, on the switch itself)
    tick(rig, backend, 61)
    rig.kernel_answers()
    assert slow(rig, conn) and rig.core.find(tuple_=ORIG) is None


def test_an_ids_block_through_a_routing_firewall_drops_on_the_switch_without_asking_the_tables():
    rig, backend, entries, _ = setup(rig=_routed_rig())
    entries[ORIG] = event(action=0, sport=ORIG.sport, ct_id=ORIG.sport)
    out = backend.submit(rule(rig, kind=Kind.BLOCK, expire=60, connection=ORIG), 1.0)
    assert out.result is Result.ADDED, out
    conn = rig.core.find(tuple_=ORIG)
    rig.advance(rig.core.switch.drain)
    assert conn is not None and conn.action.value == "block" and conn.hops is None
    assert rig.packet(conn.ingress.fast, conn.orig).dropped
    assert rig.dispatcher.tables.follower.asked == []


def test_a_routed_shunt_s_entry_stays_until_the_switch_confirms_its_flows():
    """A lagging switch (its barrier unanswered): the pair waits, its conntrack entry kept, so
    the frames still on the slow path are tracked; nothing is deleted on the flow-mods alone."""
    rig = _routed_rig()
    rig.switch.mute.add(fs.BARRIER)
    ev = event(received=rig.now)
    rig.events([ev])
    conn = rig.core.find(tuple_=ev.orig)
    assert conn is not None and conn.hops is not None
    rig.advance(1.0)
    assert len(rig.flows(cookies.Kind.SHUNT)) == 2  # (its flows went in: only their confirmation is missing)
    assert conn.state is State.PENDING and not rig.worker.deleted


def test_the_probe_sizes_a_routing_firewall_s_table_for_the_single_layout_its_auto_takes():
    """`auto` is single in routed mode (switch/peers.py): a switch that can do the pipeline
    layout is still recommended single, and max_shunts counted at 6 entries a TCP shunt."""
    from nfshunt import probe
    from tests.helpers import config
    report = probe.Report()
    routed = config(**ROUTED).switches[0]
    probe.recommend(report, routed, True, 1000, {probe.SHAPE_TCP: True, probe.SHAPE_PIPELINE: True}, None, [])
    assert report.settings["flow_layout"] == "single"
    assert report.settings["max_shunts"] == (1000 - 2 * len(routed.ports)) // 6
