"""Routed shunts in the pipeline flow layout (flow_layout "pipeline"; `auto` stays single in
routed mode): a TCP shunt's two table-0 flows apply the router's rewrite (dec_ttl, the MACs,
a NAT's set_fields) and go on to table 1, whose flows output (and catch FIN and RST) for
every shunt of a port group: 2 entries a shunt instead of 6. On the rig: installed, read back
and adopted after a restart, rewritten in place for a neighbour's new MAC (still going on to
table 1), and a NAT pair translated. On the testbed: tests/test_routed_pipeline_testbed.py."""
from __future__ import annotations

import dataclasses

from nfshunt.records import cookies
from nfshunt.records.model import OFP13, FlowRewrite, Rewrite
from tests.helpers import event
from tests.support.rig import Rig, fast
from tests.test_routed import FW0, FW1, GOOD, H1_MAC, H2_MAC
from tests.test_routed_adopt import H2, MASQ_REPLY, NEW_MAC, ROUTED, FakeFollower, _nat_event, _pair_flows, _shunted

PIPELINE = {**ROUTED, "flow_layout": "pipeline"}


def _rig(answers=None, switch=None, now=100.0) -> Rig:
    rig = Rig(OFP13, switch=switch, now=now, connect=False, **PIPELINE)
    rig.dispatcher.tables.follower = FakeFollower(dict(GOOD if answers is None else answers))
    rig.connect(rig.switch)
    assert rig.sw.session.fb.pipeline
    return rig


def _rewrites(rig) -> dict[int, tuple[bool, FlowRewrite | None]]:
    """cookie -> (goes on to table 1, the rewrite) of each shunt flow on the switch."""
    return {f.cookie: (f.goto, f.rewrite) for f in _pair_flows(rig)}


def test_a_routed_tcp_shunt_takes_two_entries_its_rewrite_in_table_0_and_its_output_in_table_1():
    rig = _rig()
    conn = _shunted(rig, event(received=rig.now))
    assert conn.entries == 2
    assert _rewrites(rig) == {conn.cookie(False): (True, FlowRewrite(FW1, H2_MAC)),
                              conn.cookie(True): (True, FlowRewrite(FW0, H1_MAC))}
    assert fast(rig, conn)


def test_a_restart_adopts_a_routed_pipeline_pair_and_a_new_mac_rewrites_it_in_place_still_going_to_table_1():
    first = _rig()
    conn = _shunted(first, event(received=first.now))
    entries = {e.cookie: e.added for e in first.flows(cookies.Kind.SHUNT)}
    again = _rig(switch=first.switch, now=first.now + 1)
    adopted = again.core.find(tuple_=conn.orig)
    assert adopted is not None and adopted.adopted and adopted.hops == (GOOD[H2], GOOD["10.0.0.1"])
    assert {e.cookie: e.added for e in again.flows(cookies.Kind.SHUNT)} == entries  # not installed again
    again.run(again.core.tables_changed({H2: dataclasses.replace(GOOD[H2], eth_dst=NEW_MAC)}, again.now))
    assert _rewrites(again)[conn.cookie(False)] == (True, FlowRewrite(FW1, NEW_MAC))
    assert {e.cookie: e.added for e in again.flows(cookies.Kind.SHUNT)} == entries  # modified, not added
    assert fast(again, adopted) and again.counters.flat().get("routed_rewrites") == 1


def test_a_nat_pair_in_the_pipeline_layout_translates_in_table_0():
    rig = _rig()
    conn = _shunted(rig, _nat_event(received=rig.now))
    assert conn.reply == MASQ_REPLY and conn.nat is not None
    for reply in (False, True):
        goto, rewrite = _rewrites(rig)[conn.cookie(reply)]
        assert goto and rewrite is not None and rewrite.nat == conn.nat[reply] != Rewrite()
    assert fast(rig, conn)
