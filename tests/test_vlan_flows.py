"""VLAN trunks on the switch (issue 37, design section 5): a zoned connection's pair matches
only its VLAN's frames and puts back the tag the firewall's bridge would, each configured VLAN
is patched to the firewall, every other tag is dropped and counted, and an untagged config
writes the very bytes it wrote before (golden, captured from main's code)."""
from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("OSKEN_HUB_TYPE", "native")
from os_ken.ofproto import ofproto_protocol  # noqa: E402

from nfshunt.core import admission as adm  # noqa: E402
from nfshunt.core import core as c  # noqa: E402
from nfshunt.core.connection import State  # noqa: E402
from nfshunt.openflow.flows import FlowBuilder  # noqa: E402
from nfshunt.records import cookies  # noqa: E402
from nfshunt.records.model import OFP10, OFP13, UDP  # noqa: E402
from nfshunt.records.segment import FIN, parse_segment  # noqa: E402
from tests.helpers import config, event  # noqa: E402
from tests.support import fakeswitch as fs  # noqa: E402
from tests.support.rig import FAST_A, FAST_B, SLOW_A, SLOW_B, Rig  # noqa: E402

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "untagged-flows.json")
TRUNKS = [
    {"fast": 1, "slow": 2, "physdevin": 1, "bridge_port": "fw-eth0", "vlans": [100, 200, 30]},
    {"fast": 3, "slow": 4, "physdevin": 2, "bridge_port": "fw-eth1",
     "vlans": [100, 200, {"id": 301, "zone": 30}]},
]
PLAIN = [{**g, "vlans": [100, 200]} for g in TRUNKS]  # no translation: OpenFlow 1.0 may serve it
VLAN_LAYOUTS = [pytest.param(OFP13, False, TRUNKS, id="single"), pytest.param(OFP13, True, TRUNKS, id="pipeline"),
                pytest.param(OFP10, False, PLAIN, id="openflow1.0")]


def vlan_rig(version=OFP13, pipeline=False, ports=TRUNKS):
    versions = ["1.0"] if version == OFP10 else ["1.3"]
    return Rig(version, pipeline, ports=ports, openflow_versions=versions)


@pytest.mark.parametrize("version, pipeline, ports", VLAN_LAYOUTS)
def test_a_zone_100_pair_takes_only_vlan_100_frames_and_keeps_their_tag(version, pipeline, ports):
    rig = vlan_rig(version, pipeline, ports)
    conn = rig.event(zone=100, proto=UDP)
    assert conn is not None
    there = rig.packet(FAST_A, conn.orig, vlan=100)
    back = rig.packet(FAST_B, conn.reply, vlan=100)
    assert (there.outputs, there.tags, back.outputs, back.tags) == ((FAST_B,), (100,), (FAST_A,), (100,))
    # The same tuple in VLAN 200 is another network's: the default takes it to the firewall, tag kept.
    other = rig.packet(FAST_A, conn.orig, vlan=200)
    assert (other.outputs, other.tags) == ((SLOW_A,), (200,))
    assert [cookies.parse(k).kind for k in other.cookies] == [cookies.Kind.DEFAULT]  # type: ignore[union-attr]
    # Untagged frames are not carried by these trunks: dropped, counted on the drop flow.
    untagged = rig.packet(FAST_A, conn.orig)
    assert untagged.dropped


@pytest.mark.parametrize("pipeline", [False, True], ids=["single", "pipeline"])
def test_counters_confirm_a_vlan_pair_by_its_own_tags_frames_only(pipeline):
    """Behind a switch that may lag (`confirm: counters`), a VLAN 100 pair's entry stays until
    the pair itself has counted a frame each way: the same tuple's frames in VLAN 200 go to
    the firewall by the trunk's default and confirm nothing."""
    rig = Rig(OFP13, pipeline, ports=TRUNKS, openflow_versions=["1.3"], confirm="counters")
    conn = rig.event(zone=100)
    for vlan, port, t in ((200, FAST_A, conn.orig), (200, FAST_B, conn.reply)):
        assert rig.packet(port, t, vlan=vlan).outputs in ((SLOW_A,), (SLOW_B,))
    for _ in range(3):
        rig.advance(0.05)  # read and read again: only the other VLAN's frames so far
    assert conn.state is State.DRAINING and rig.worker.deleted == []
    assert rig.packet(FAST_A, conn.orig, vlan=100).outputs == (FAST_B,)
    assert rig.packet(FAST_B, conn.reply, vlan=100).outputs == (FAST_A,)
    rig.advance(0.05)
    rig.advance(rig.core.switch.drain)
    assert conn.state is State.LIVE and rig.worker.deleted == [(conn.orig, conn.ct_id)]


@pytest.mark.parametrize("pipeline", [False, True], ids=["single", "pipeline"])
def test_a_translated_pair_rewrites_30_to_301_and_back(pipeline):
    rig = vlan_rig(OFP13, pipeline)
    conn = rig.event(zone=30)
    there = rig.packet(FAST_A, conn.orig, vlan=30)
    back = rig.packet(FAST_B, conn.reply, vlan=301)
    assert (there.outputs, there.tags, back.outputs, back.tags) == ((FAST_B,), (301,), (FAST_A,), (30,))
    assert rig.packet(FAST_A, conn.orig, vlan=301).outputs == ()  # 301 is not this side's VLAN


def test_untagged_to_a_vlan_pushes_and_back_pops():
    ports = [{"fast": 1, "slow": 2, "physdevin": 1, "untagged": {"zone": 30}},
             {"fast": 3, "slow": 4, "physdevin": 2, "vlans": [{"id": 301, "zone": 30}]}]
    rig = vlan_rig(ports=ports)
    conn = rig.event(zone=30, proto=UDP)
    there, back = rig.packet(FAST_A, conn.orig), rig.packet(FAST_B, conn.reply, vlan=301)
    assert (there.outputs, there.tags, back.outputs, back.tags) == ((FAST_B,), (301,), (FAST_A,), (None,))


@pytest.mark.parametrize("version, pipeline, ports", VLAN_LAYOUTS)
def test_each_configured_vlan_goes_to_the_firewall_and_every_other_tag_is_dropped_and_counted(version, pipeline,
                                                                                              ports):
    rig = vlan_rig(version, pipeline, ports)
    t = event().orig
    for vid in (100, 200):
        assert rig.packet(FAST_A, t, vlan=vid).outputs == (SLOW_A,)
        assert rig.packet(SLOW_B, t.reversed(), vlan=vid).outputs == (FAST_B,)
    for vid in (999, 0, 4095, None):
        assert rig.packet(FAST_A, t, vlan=vid).dropped, vid
    drops = rig.flows(cookies.Kind.VLAN_DROP)
    assert sorted(e.match["in_port"][0] for e in drops) == [1, 2, 3, 4]
    assert next(e for e in drops if e.match["in_port"][0] == FAST_A).packets == 4


def test_a_zone_a_side_does_not_carry_is_never_shunted():
    rig = vlan_rig()
    for zone in (0, 500):
        assert rig.event(zone=zone, ct_id=9 + zone) is None
    assert rig.counters.flat()[f"ignored:{adm.R_VLAN}"] == 2
    core = c.Core(config(ports=TRUNKS, openflow_versions=["1.3"]))
    core.switch_connected(OFP13)
    core.reconcile([], 0)
    assert core.dry_run(event(zone=7)).reason == adm.R_VLAN


@pytest.mark.parametrize("pipeline", [False, True], ids=["single", "pipeline"])
def test_a_tagged_fin_is_caught_as_it_arrived_and_ends_the_shunt(pipeline):
    rig = vlan_rig(OFP13, pipeline)
    conn = rig.event(zone=30)
    rig.advance(rig.core.switch.drain)
    first = rig.packet(FAST_A, conn.orig, tcp_flags=FIN | 0x10, vlan=30)
    assert first.outputs == (FAST_B,) and first.tags == (301,) and len(first.packet_ins) == 1
    assert parse_segment(first.packet_ins[0].data).flags == FIN | 0x10
    rig.packet(FAST_B, conn.reply, tcp_flags=FIN, vlan=301)
    assert len(rig.worker.restores) == 1  # both FINs heard: the connection handed back closing


def test_a_segment_behind_one_802_1q_tag_is_read():
    t = event().orig
    assert parse_segment(fs.frame(t, FIN, 10, vlan=100)) == parse_segment(fs.frame(t, FIN, 10))
    assert parse_segment(fs.frame(t, FIN, 10, vlan=100)).payload == 10


def golden_flows() -> dict[str, list[str]]:
    """Every flow-mod of a zone-0 pair (TCP, UDP, block; install, remove, watch), the
    defaults and table 1, per version, layout and family, from templates and from os-ken."""
    def conn_for(**kw):
        core = c.Core(config())
        core.switch_connected(OFP13)
        core.reconcile([], 0)
        return core.conntrack_event(event(**kw))[0].conn

    def raw(msg):
        msg.set_xid(0)
        msg.serialize()
        return bytes(msg.buf).hex()
    out = {}
    for version, pipeline, templated in [(v, p, t) for v in (OFP10, OFP13) for p in (False, True)
                                         for t in (True, False) if not (p and v == OFP10)]:
        fb = FlowBuilder(ofproto_protocol.ProtocolDesc(version), config(), pipeline=pipeline)
        fb.templated = templated
        name = f"v{version}-{'pipeline' if pipeline else 'single'}-{'tpl' if templated else 'osken'}"
        for fam in (4, 6) if version == OFP13 else (4,):
            conn = conn_for(family=fam)
            out[f"{name}-{fam}-install"] = [raw(m) for m in fb.install(conn)]
            out[f"{name}-{fam}-udp"] = [raw(m) for m in fb.install(conn_for(family=fam, proto=UDP))]
            out[f"{name}-{fam}-block"] = [raw(m) for m in fb.install(conn_for(family=fam, action=2))]
            out[f"{name}-{fam}-remove"] = [raw(m) for m in fb.remove(conn, (False, True))]
            if version == OFP13:
                out[f"{name}-{fam}-watch"] = [raw(m) for m in fb.watch(conn)]
        out[f"{name}-defaults"] = [raw(m) for m in fb.defaults(fb.switch.ports)]
        if pipeline:
            out[f"{name}-pipeline"] = [raw(m) for m in fb.pipeline_flows(fb.switch.ports)]
    return out


def test_an_untagged_config_writes_the_bytes_it_wrote_before_vlans():
    with open(GOLDEN) as fh:
        assert golden_flows() == json.load(fh)
