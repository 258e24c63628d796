"""Flows read back from a VLAN trunk's switch (issue 37, design section 5.2): a pair's tag
names its zone through its in_port's group, and a reconcile adopts a pair only when its tag
and its retag are exactly what this version builds; any other pair under our cookie (a tag
the port does not carry, a retag this version would not write, an action it never writes)
goes as not of our shape. An untagged config reconciles as before."""
from __future__ import annotations

import logging
import os
from typing import Any

import pytest

os.environ.setdefault("OSKEN_HUB_TYPE", "native")

from nfshunt.core.connection import State  # noqa: E402
from nfshunt.records import cookies  # noqa: E402
from nfshunt.records.model import OFP10, OFP13, UDP, FlowTuple  # noqa: E402
from tests.support import fakeswitch as fs  # noqa: E402
from tests.support.rig import FAST_A, FAST_B, SLOW_A, Rig, fast, shunted  # noqa: E402

TRUNKS = [
    {"fast": 1, "slow": 2, "physdevin": 1, "bridge_port": "fw-eth0", "vlans": [100, 200, 30]},
    {"fast": 3, "slow": 4, "physdevin": 2, "bridge_port": "fw-eth1",
     "vlans": [100, 200, {"id": 301, "zone": 30}]},
]
PLAIN = [{**g, "vlans": [100, 200]} for g in TRUNKS]  # no translation: OpenFlow 1.0 may serve it
SHAPE = "not exactly the shape of a pair this version installs"
LAYOUTS = [pytest.param(OFP13, False, TRUNKS, id="single"), pytest.param(OFP13, True, TRUNKS, id="pipeline"),
           pytest.param(OFP10, False, PLAIN, id="openflow1.0")]


def vlan_rig(version: int = OFP13, pipeline: bool = False, ports: list = TRUNKS, **kw: Any) -> Rig:
    versions = ["1.0"] if version == OFP10 else ["1.3"]
    return Rig(version, pipeline, ports=ports, openflow_versions=versions, **kw)


def _wire(msg: Any) -> bytes:
    msg.set_xid(999)
    msg.serialize()
    return bytes(msg.buf)


def _tags(rig: Rig, conn: Any) -> tuple[Any, Any]:
    """The tags each direction's frames arrive with (None: untagged)."""
    return (conn.ingress.vid_of_zone[conn.orig.zone] or None, conn.egress.vid_of_zone[conn.orig.zone] or None)


def tagged_fast(rig: Rig, conn: Any) -> bool:
    """Both directions take the fast path in their VLAN, each leaving with the tag of its side."""
    a, b = _tags(rig, conn)
    there = rig.packet(conn.ingress.fast, conn.orig, vlan=a)
    back = rig.packet(conn.egress.fast, conn.reply, vlan=b)
    return (there.outputs, there.tags, back.outputs, back.tags) == ((conn.egress.fast,), (b,), (conn.ingress.fast,),
                                                                   (a,))


@pytest.mark.parametrize("version, pipeline, ports", LAYOUTS)
def test_a_new_controller_adopts_exact_vlan_pairs_same_tuple_in_two_vlans_and_a_translated_one(version, pipeline,
                                                                                               ports):
    first = vlan_rig(version, pipeline, ports)
    zones = (100, 200, 30) if ports is TRUNKS else (100, 200)
    proto = UDP if version == OFP10 else 6
    conns = [shunted(first, zone=zone, ct_id=11 + i, proto=proto) for i, zone in enumerate(zones)]
    assert len({c.orig._replace(zone=0) for c in conns}) == 1  # one 5-tuple, in two or three VLANs
    pairs = sorted(id(e) for e in first.flows(cookies.Kind.SHUNT))
    again = vlan_rig(version, pipeline, ports, switch=first.switch, now=first.now + 1)
    core = again.core
    assert core.reconciled
    adopted = {c.ct_id: c for c in core.by_key.values()}
    assert {k: (c.orig.zone, c.adopted, c.state) for k, c in adopted.items()} == {
        11 + i: (zone, True, State.LIVE) for i, zone in enumerate(zones)}
    assert sorted(id(e) for e in again.flows(cookies.Kind.SHUNT)) == pairs  # kept, not sent again
    assert all(tagged_fast(again, c) for c in adopted.values())


@pytest.mark.parametrize("version, pipeline, ports", LAYOUTS)
def test_a_reconnect_keeps_the_vlan_pairs_it_finds_as_installed(version, pipeline, ports):
    rig = vlan_rig(version, pipeline, ports)
    proto = UDP if version == OFP10 else 6
    conns = [shunted(rig, zone=zone, ct_id=11 + i, proto=proto) for i, zone in enumerate((100, 200))]
    pairs = sorted(id(e) for e in rig.flows(cookies.Kind.SHUNT))
    rig.reconnect(rig.switch)
    assert sorted(id(e) for e in rig.flows(cookies.Kind.SHUNT)) == pairs
    assert all(c.state is State.LIVE for c in conns) and rig.worker.restores == []
    assert all(tagged_fast(rig, c) for c in conns)


def _pair(rig: Rig, t: FlowTuple, ct_id: int, vids: tuple[int, int], retag: tuple[list, list]) -> list[Any]:
    """A shunt pair's two flows under a pair's cookie, as a test writes them: each direction
    matching tag vids[i] and doing retag[i] before its output."""
    fb = rig.s.fb
    out = []
    for reply, (in_port, tt, peer) in enumerate(((FAST_A, t, FAST_B), (FAST_B, t.reversed(), FAST_A))):
        out.append(fb._add(fb.match(in_port, tt, vid=vids[reply]), peer, cookies.make(cookies.Kind.SHUNT, ct_id,
                                                                                          bool(reply)),
                           33000, 60, True, retag[reply]))
    return out


def _odd_pairs(rig: Rig) -> dict[int, list[Any]]:
    """By conntrack id: a zone-100 tuple's pair matching VLAN 999 (carried by no group), one
    matching VLAN 100 that leaves tagged 200 (this version keeps a same-VLAN tag), and a
    translated 30/301 pair that leaves untranslated."""
    p = rig.s.fb.parser
    t = FlowTuple(4, 6, "10.0.0.1", "10.0.0.2", 40000, 5201)
    return {21: _pair(rig, t._replace(sport=41000), 21, (999, 999), ([], [])),
            22: _pair(rig, t._replace(sport=42000), 22, (100, 100),
                      ([p.OFPActionSetField(vlan_vid=0x1000 | 200)], [])),
            23: _pair(rig, t._replace(sport=43000), 23, (30, 301), ([], []))}


@pytest.mark.parametrize("pipeline", [False, True], ids=["single", "pipeline"])
def test_a_pair_of_a_wrong_tag_or_retag_is_deleted_as_not_our_shape(pipeline, caplog):
    first = vlan_rig(OFP13, pipeline)
    good = shunted(first, zone=100)
    odd = _odd_pairs(first)
    for msgs in odd.values():
        for msg in msgs:
            first.switch.send(_wire(msg))
    caplog.set_level(logging.INFO, logger="nfshunt")
    again = vlan_rig(OFP13, pipeline, switch=first.switch, now=first.now + 1)
    assert {c.ct_id for c in again.core.by_key.values()} == {good.ct_id}
    on_switch = {cookies.parse(e.cookie).key for e in again.flows(cookies.Kind.SHUNT)}  # type: ignore[union-attr]
    assert on_switch == {good.ct_id}
    for ct_id in odd:
        for reply in (False, True):
            cookie = cookies.make(cookies.Kind.SHUNT, ct_id, reply)
            assert f"cookie=0x{cookie:016x}: {SHAPE}" in caplog.text
    # The VLAN 999 frames meet the port's drop, the others the firewall.
    t = FlowTuple(4, 6, "10.0.0.1", "10.0.0.2", 41000, 5201)
    assert again.packet(FAST_A, t, vlan=999).dropped
    assert again.packet(FAST_A, t._replace(sport=42000), vlan=100).outputs == (SLOW_A,)
    assert tagged_fast(again, again.core.find(tuple_=good.orig))


@pytest.mark.parametrize("trunk", [False, True], ids=["untagged", "trunk"])
def test_a_pair_under_our_cookie_with_an_action_this_version_never_writes_is_not_adopted(trunk, caplog):
    """A set_field of another field before the output (here the destination address): the
    flow's match is exactly a pair's, and before the read-back saw actions it was adopted."""
    first = vlan_rig() if trunk else Rig(OFP13)
    p = first.s.fb.parser
    vid = 100 if trunk else 0
    t = FlowTuple(4, 6, "10.0.0.1", "10.0.0.2", 41000, 5201)
    rewrite = [p.OFPActionSetField(ipv4_dst="10.0.0.9")]
    for msg in _pair(first, t, 21, (vid, vid), (rewrite, [])):
        first.switch.send(_wire(msg))
    caplog.set_level(logging.INFO, logger="nfshunt")
    again = (vlan_rig(switch=first.switch, now=first.now + 1) if trunk
             else Rig(OFP13, switch=first.switch, now=first.now + 1))
    assert not again.core.by_key and again.flows(cookies.Kind.SHUNT) == []
    assert f"cookie=0x{cookies.make(cookies.Kind.SHUNT, 21):016x}: {SHAPE}" in caplog.text


def test_an_untagged_config_adopts_and_keeps_its_pairs_as_before():
    first = Rig(OFP13)
    conn = shunted(first)
    pairs = sorted(id(e) for e in first.flows(cookies.Kind.SHUNT))
    again = Rig(OFP13, switch=first.switch, now=first.now + 1)
    (adopted,) = again.core.by_key.values()
    assert adopted.orig == conn.orig and adopted.orig.zone == 0 and adopted.adopted
    assert sorted(id(e) for e in again.flows(cookies.Kind.SHUNT)) == pairs and fast(again, adopted)


def test_a_stale_vlan_default_and_drop_go_and_the_configs_stay():
    """A trunk whose config dropped VLAN 200 and whose drop moved: the switch's VLAN 200
    defaults and a drop on a port no group has go (delete_flows_on_startup); the rest stays."""
    first = vlan_rig(delete_flows_on_startup=True)
    first.switch.send(_wire(first.s.fb._add(first.s.fb.match(9), None, cookies.make(cookies.Kind.VLAN_DROP, 5), 99,
                                            0, False)))
    fewer = [{**g, "vlans": [v for v in g["vlans"] if v != 200]} for g in TRUNKS]
    again = vlan_rig(ports=fewer, switch=first.switch, now=first.now + 1, delete_flows_on_startup=True)
    t = FlowTuple(4, 6, "10.0.0.1", "10.0.0.2", 41000, 5201)
    assert again.packet(FAST_A, t, vlan=200).dropped and again.packet(FAST_A, t, vlan=100).outputs == (SLOW_A,)
    drops = again.flows(cookies.Kind.VLAN_DROP)
    assert sorted(e.match["in_port"][0] for e in drops) == [1, 2, 3, 4]
    defaults = again.flows(cookies.Kind.DEFAULT)
    assert sorted((e.match["in_port"][0], e.match["vlan_vid"][0] & 0xFFF) for e in defaults) == sorted(
        (port, vid) for port in (1, 2, 3, 4) for vid in ((100, 30) if port < 3 else (100, 301)))


def test_vlan_drops_count_apart_from_the_slow_path():
    """A trunk's drops are their own kind (not defaults): what they drop never counts as
    bytes handed to the firewall."""
    rig = vlan_rig()
    t = FlowTuple(4, 17, "10.0.0.1", "10.0.0.2", 41000, 5201)
    assert rig.packet(FAST_A, t, vlan=999).dropped
    (drop,) = [e for e in rig.flows(cookies.Kind.VLAN_DROP) if e.match["in_port"][0] == FAST_A]
    assert drop.packets == 1 and cookies.parse(drop.cookie) == (cookies.Kind.VLAN_DROP, 0, False)
    assert all(e.outputs for e in rig.flows(cookies.Kind.DEFAULT))


def test_a_fresh_switch_gets_each_vlan_pair_back_with_its_tag():
    rig = vlan_rig()
    conn = shunted(rig, zone=30)
    rig.reconnect(fs.FakeSwitch(OFP13, now=rig.now))
    assert conn.state is State.LIVE and tagged_fast(rig, conn)
