"""A routing firewall on VLAN trunks (docs/design/routed.md 9): each VLAN is a routed
sub-interface of its own, named in the mark by its physdevin; a shunt's flows match the tag of
the interface its frames arrive on and leave with the tag of the one the router sends them out
of (the router's rewrite first); two VLANs of one trunk (a router on a stick) output to
OFPP_IN_PORT. Driven on the fake switch (tests/support): a frame's fate, port and tag."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("OSKEN_HUB_TYPE", "native")

from nfshunt import iptables, routed_checks  # noqa: E402
from nfshunt.config.settings import ConfigError, from_dict  # noqa: E402
from nfshunt.core import admission as adm  # noqa: E402
from nfshunt.core import routing  # noqa: E402
from nfshunt.core.connection import REEVALUATE, State  # noqa: E402
from nfshunt.observe.accounting import conn_fields  # noqa: E402
from nfshunt.records import cookies, markcodec  # noqa: E402
from nfshunt.records.model import TCP, ConnEvent, EventKind, FlowTuple, NextHop  # noqa: E402
from tests.helpers import BASE, config  # noqa: E402
from tests.support.rig import Rig  # noqa: E402
from tests.test_routed_adopt import routed_rig  # noqa: E402

FW0, FW3, FW1 = "02:00:00:00:fe:00", "02:00:00:00:fe:03", "02:00:00:00:fe:01"
H1_MAC, H2_MAC, H3_MAC = "02:00:00:00:00:01", "02:00:00:00:00:02", "02:00:00:00:00:03"
H1, H2, H3 = "10.0.1.1", "10.0.2.1", "10.0.3.1"
TRUNK, OTHER = 1, 3  # fast ports: h1 (VLAN 100) and h3 (VLAN 300) behind TRUNK, h2 (VLAN 200) behind OTHER
V100, V200, V300 = 3, 4, 5  # the sub-interfaces' physdevins
PORTS = [{"fast": TRUNK, "slow": 2, "physdevin": 1, "untagged": False,
          "vlans": [{"id": 100, "physdevin": V100, "interface": "fw-eth0.100"},
                    {"id": 300, "physdevin": V300, "interface": "fw-eth0.300"}]},
         {"fast": OTHER, "slow": 4, "physdevin": 2, "interface": "fw-eth1", "vlans": [{"id": 200, "physdevin": V200}]}]
ROUTED = dict(forwarding="routed", ports=PORTS, openflow_versions=["1.3"], experimental_routed=True,
              flow_layout="single")
TABLES = {H1: NextHop("fw-eth0.100", FW0, H1_MAC), H2: NextHop("fw-eth1.200", FW1, H2_MAC),
          H3: NextHop("fw-eth0.300", FW3, H3_MAC)}


def _event(src: str, dst: str, ingress: int, egress: int, action: int = 1, now: float = 100.0) -> ConnEvent:
    orig = FlowTuple(4, TCP, src, dst, 40000, 5201)
    return ConnEvent(EventKind.UPDATE, 7, orig, orig.reversed(), markcodec.encode(ingress, egress, action), 3, now)


def _rig(tables=None, switch=None, now=100.0) -> Rig:
    return routed_rig(TABLES if tables is None else tables, switch, now, **ROUTED)


def _installed(rig: Rig, ev: ConnEvent):
    rig.events([ev])
    conn = rig.core.find(tuple_=ev.orig)
    assert conn is not None, rig.counters.flat()
    rig.advance(rig.core.switch.drain)
    assert conn.state is State.LIVE
    return conn


def _path(rig: Rig, in_port: int, t: FlowTuple, vlan: int | None) -> tuple[tuple[int, ...], tuple[int | None, ...]]:
    fate = rig.packet(in_port, t, vlan=vlan)
    return fate.outputs, fate.tags


def test_a_config_names_each_routed_vlan_and_the_plumbing_marks_each_sub_interface_by_its_own_number():
    cfg = config(**ROUTED)
    sw = cfg.switches[0]
    assert {p: (s.group.fast, s.vid, s.interface, s.zone) for p, s in sw.sides.items()} == {
        V100: (TRUNK, 100, "fw-eth0.100", 0), V300: (TRUNK, 300, "fw-eth0.300", 0),
        V200: (OTHER, 200, "fw-eth1.200", 0)}  # (the trunks carry no untagged frames: no side for 1, 2)
    assert routed_checks.interfaces(cfg) == [(V100, "fw-eth0.100"), (V300, "fw-eth0.300"), (V200, "fw-eth1.200")]
    text = "\n".join(iptables.routed_rules(cfg))
    assert f"-A NFSHUNT_PRE_PD_IN -i fw-eth0.300 -j MARK --set-xmark " \
           f"{iptables.xmark(markcodec.ingress_xmark(V300))}" in text
    assert f"-A NFSHUNT_POST_PD_OUT -o fw-eth1.200 -j MARK --set-xmark " \
           f"{iptables.xmark(markcodec.egress_xmark(V200))}" in text
    assert "fw-eth0 " not in text and "fw-eth1 " not in text  # (the parents carry nothing routed)


@pytest.mark.parametrize("vlan,key,words", [
    ({"id": 100, "physdevin": V100, "zone": 5}, "ports[0].vlans[0].zone", "one conntrack zone"),
    ({"id": 100, "physdevin": 2, "interface": "x.100"}, "ports[1].physdevin", "already used by ports[0]"),
    ({"id": 100, "physdevin": V100}, "ports[0].vlans[0].interface", "required"),
    ({"id": 100, "physdevin": V100, "interface": "fw-eth1.200"}, "ports[1].vlans[0].interface", "already used"),
    ({"id": 100, "interface": "fw-eth0.100"}, "ports[0].vlans[0].physdevin", "required with interface"),
])
def test_a_routed_vlan_that_cannot_work_is_refused_with_its_key(vlan, key, words):
    ports = [{**PORTS[0], "vlans": [vlan]}, PORTS[1]]
    with pytest.raises(ConfigError) as err:
        from_dict({**BASE, **ROUTED, "ports": ports})
    assert err.value.key == key and words in str(err.value), str(err.value)


def test_a_bridged_switch_refuses_a_routed_vlan_and_a_mixed_trunk_is_refused():
    bridged = [{"fast": 1, "slow": 2, "physdevin": 1, "bridge_port": "br-a", "vlans": [{"id": 100, "physdevin": 3}]},
               {"fast": 3, "slow": 4, "physdevin": 2, "bridge_port": "br-b"}]
    with pytest.raises(ConfigError) as err:
        from_dict({**BASE, "ports": bridged})
    assert err.value.key == "ports[0].vlans[0].physdevin" and "bridged" in str(err.value)
    mixed = [{**PORTS[0], "vlans": [{"id": 100, "physdevin": V100, "interface": "a.100"}, 300]}, PORTS[1]]
    with pytest.raises(ConfigError) as err:
        from_dict({**BASE, **ROUTED, "ports": mixed})
    assert err.value.key == "ports[0].vlans[1]" and "physdevin of its own" in str(err.value)


def test_a_shunt_between_two_trunks_matches_each_side_s_tag_and_retags_after_the_router_s_rewrite():
    rig = _rig()
    conn = _installed(rig, _event(H1, H2, V100, V200))
    assert conn.hops == (TABLES[H2], TABLES[H1]) and conn.tags == (100, 200)
    assert _path(rig, TRUNK, conn.orig, 100) == ((OTHER,), (200,))
    assert _path(rig, OTHER, conn.reply, 200) == ((TRUNK,), (100,))
    # The same tuple on another VLAN of the trunk, or untagged: not this pair's (the trunk's
    # defaults hand VLAN 300 to the firewall, and drop what the trunk does not carry).
    assert _path(rig, TRUNK, conn.orig, 300) == ((2,), (300,))
    assert _path(rig, TRUNK, conn.orig, None)[0] == ()
    fields = conn_fields(conn, "shunt")
    assert (fields["ingress"], fields["egress"], fields["vlan_in"], fields["vlan_out"]) == (V100, V200, 100, 200)
    # Its hand-back mark names the sub-interfaces (an adopted pair's is made from them).
    conn.mark = 0  # (as an adopted pair's: not known)
    mark = markcodec.decode(conn.handback_mark(REEVALUATE))
    assert (mark.ingress, mark.egress) == (V100, V200)


def test_a_router_on_a_stick_outputs_to_the_port_the_frame_came_in_by_with_the_other_vlan_s_tag():
    rig = _rig()
    conn = _installed(rig, _event(H1, H3, V100, V300))
    assert conn.ingress is conn.egress and conn.tags == (100, 300)
    assert _path(rig, TRUNK, conn.orig, 100) == ((TRUNK,), (300,))  # OFPP_IN_PORT (fake switch as OpenFlow)
    assert _path(rig, TRUNK, conn.reply, 300) == ((TRUNK,), (100,))
    outs = {port for e in rig.flows(cookies.Kind.SHUNT) for port, _ in e.outputs}
    assert outs == {rig.switch.ofproto.OFPP_IN_PORT}  # (an output to TRUNK itself would be dropped)


def test_a_route_that_leaves_by_another_vlan_than_the_mark_named_stays_on_the_firewall():
    rig = _rig({**TABLES, H2: NextHop("fw-eth0.300", FW3, H2_MAC)})  # (the router would send it back out)
    ev = _event(H1, H2, V100, V200)
    rig.events([ev])
    assert rig.core.find(tuple_=ev.orig) is None
    assert rig.core.dry_run(ev).reason == routing.R_HOP_ELSEWHERE


def test_a_block_drops_only_its_own_vlan_s_frames():
    rig = _rig()
    conn = _installed(rig, _event(H1, H2, V100, V200, action=2))
    assert conn.hops is None and conn.tags == (100, 200)
    assert _path(rig, TRUNK, conn.orig, 100)[0] == ()  # dropped in the switch
    assert _path(rig, OTHER, conn.reply, 200)[0] == ()
    assert _path(rig, TRUNK, conn.orig, 300)[0] == (2,)  # VLAN 300's: the firewall's to judge


def test_a_mark_naming_the_trunk_s_own_number_or_one_interface_twice_is_not_shunted():
    rig = _rig()
    for ingress, egress, reason in ((1, V200, adm.R_UNKNOWN_PORT), (V100, V100, adm.R_SAME_PORT)):
        ev = _event(H1, H2, ingress, egress)
        assert rig.core.dry_run(ev).reason == reason


def test_a_restarted_controller_adopts_routed_vlan_pairs_a_stick_s_too_and_a_foreign_tag_s_not():
    first = _rig()
    across = _installed(first, _event(H1, H2, V100, V200))
    stick_ev = _event(H1, H3, V100, V300)
    stick_ev.ct_id = 8
    stick = _installed(first, stick_ev)
    entries = {e.cookie: e.added for e in first.flows(cookies.Kind.SHUNT)}
    again = _rig(switch=first.switch, now=first.now + 1)
    for conn in (across, stick):
        adopted = again.core.find(tuple_=conn.orig)
        assert adopted is not None and adopted.adopted and adopted.sides == conn.sides, conn
        assert adopted.hops == conn.hops
    assert {e.cookie: e.added for e in again.flows(cookies.Kind.SHUNT)} == entries  # not re-installed
    assert _path(again, TRUNK, stick.orig, 100) == ((TRUNK,), (300,))


def test_the_pipeline_layout_leaves_a_router_on_a_stick_on_the_firewall_and_shunts_the_rest():
    rig = routed_rig(TABLES, **{**ROUTED, "flow_layout": "pipeline"})
    ev = _event(H1, H3, V100, V300)
    assert rig.core.dry_run(ev).reason == adm.R_STICK_PIPELINE
    conn = _installed(rig, _event(H1, H2, V100, V200))
    assert _path(rig, TRUNK, conn.orig, 100) == ((OTHER,), (200,))
    # A UDP shunt and a block stay in table 0, whose output to OFPP_IN_PORT works: shunted.
    udp = FlowTuple(4, 17, H1, H3, 40001, 5201)
    ev = ConnEvent(EventKind.UPDATE, 9, udp, udp.reversed(), markcodec.encode(V100, V300, 1), None, rig.now)
    stick = _installed(rig, ev)
    assert _path(rig, TRUNK, stick.orig, 100) == ((TRUNK,), (300,))


def test_a_new_master_tells_each_vlan_s_hosts_its_mac_in_frames_tagged_with_that_vlan(tmp_path):
    from os_ken.lib.packet import arp, ethernet, packet, vlan

    from nfshunt.kernel.routes import Interface
    from tests.test_role_link import pair_rig
    from tests.test_routed_pair import Follower
    interfaces = {"fw-eth0.100": Interface(FW0, ("10.0.1.254",)), "fw-eth0.300": Interface(FW3, ("10.0.3.254",)),
                  "fw-eth1.200": Interface(FW1, ("10.0.2.254",))}
    rig = pair_rig(tmp_path, role="master", connect=False,
                   **{k: v for k, v in ROUTED.items() if k not in ("openflow_versions", "flow_layout")})
    rig.dispatcher.tables.follower = Follower(interfaces)
    rig.connect(rig.switch)
    assert rig.sw.roles.granted == "master"
    sent = []
    for port, frame in rig.switch.packet_outs:
        pkt = packet.Packet(frame)
        tag = pkt.get_protocol(vlan.vlan)
        sent.append((port, tag.vid if tag else None, pkt.get_protocol(ethernet.ethernet).src,
                     pkt.get_protocol(arp.arp).src_ip))
    assert sorted(sent) == [(TRUNK, 100, FW0, "10.0.1.254"), (TRUNK, 300, FW3, "10.0.3.254"),
                            (OTHER, 200, FW1, "10.0.2.254")]


# --- static shunts over routed VLANs -------------------------------------------------------------

STREAM = {"name": "plc", "protocol": "udp", "src": H1, "dst": H2, "dst_port": 34964, "fast_ports": [TRUNK, OTHER],
          "vlan": 100, "via": "table"}


def test_a_static_stream_names_its_source_vlan_and_the_destination_s_one_routed_interface_is_taken():
    from nfshunt.config.static import tags_of
    cfg = from_dict({**BASE, **ROUTED, "static_shunts": [STREAM]})
    assert tags_of(cfg.static_shunts[0], cfg.switches[0]) == (100, 200, 0)
    back = {**STREAM, "src": H2, "dst": H1, "fast_ports": [OTHER, TRUNK], "vlan": 200}
    with pytest.raises(ConfigError) as err:  # (port 1's group routes VLANs 100 and 300)
        from_dict({**BASE, **ROUTED, "static_shunts": [back]})
    assert err.value.key == "static_shunts[0].vlan_out" and "name the one the stream leaves by" in str(err.value)
    cfg = from_dict({**BASE, **ROUTED, "static_shunts": [{**back, "vlan_out": 300}]})
    assert tags_of(cfg.static_shunts[0], cfg.switches[0]) == (200, 300, 0)
    for entry, key, words in (({**STREAM, "vlan": 200}, "static_shunts[0].vlan", "not a routed interface"),
                              ({**back, "vlan_out": 200}, "static_shunts[0].vlan_out", "routes 100, 300")):
        with pytest.raises(ConfigError) as err:
            from_dict({**BASE, **ROUTED, "static_shunts": [entry]})
        assert err.value.key == key and words in str(err.value), str(err.value)


def test_a_static_stream_over_routed_vlans_goes_with_the_router_s_rewrite_and_each_side_s_tag():
    rig = routed_rig(TABLES, **{**ROUTED, "static_shunts": [STREAM]})
    fwd = FlowTuple(4, 17, H1, H2, 40000, 34964)
    assert _path(rig, TRUNK, fwd, 100) == ((OTHER,), (200,))
    assert _path(rig, OTHER, fwd.reversed(), 200) == ((TRUNK,), (100,))
    assert _path(rig, TRUNK, fwd, 300)[0] == (2,)  # another VLAN's frames: the firewall's


def test_a_static_stream_whose_route_leaves_by_another_vlan_is_withheld_and_crosses_the_firewall():
    rig = routed_rig({**TABLES, H2: NextHop("fw-eth0.300", FW3, H2_MAC)}, **{**ROUTED, "static_shunts": [STREAM]})
    fwd = FlowTuple(4, 17, H1, H2, 40000, 34964)
    assert _path(rig, TRUNK, fwd, 100) == ((2,), (100,))
    assert rig.counters.flat().get(f"static_flows:withheld:{routing.R_HOP_ELSEWHERE}") == 1, rig.counters.flat()


def test_a_pair_whose_flows_retag_otherwise_than_its_interfaces_is_not_adopted():
    """Read back after a restart: a forward flow that leaves with another tag than the
    interface its reverse flow comes in by names (an older release's, a foreign writer's) is
    not a pair of this config's: not adopted (its flows go as orphans)."""
    from nfshunt.core.routed_adoption import flow_sides
    from nfshunt.records.model import SwitchFlow, TagOp
    sw = config(**ROUTED).switches[0]
    t = FlowTuple(4, TCP, H1, H2, 40000, 5201)
    fwd = SwitchFlow(1, 1, TRUNK, t, OTHER, vlan=0x1000 | 100, retag=((TagOp.SET_VID, 200),))
    rev = SwitchFlow(2, 1, OTHER, t.reversed(), TRUNK, vlan=0x1000 | 200, retag=((TagOp.SET_VID, 100),))
    assert flow_sides(sw, fwd, rev) == (sw.sides[V100], sw.sides[V200])
    assert flow_sides(sw, fwd._replace(retag=((TagOp.SET_VID, 300),)), rev) is None
    assert flow_sides(sw, fwd, rev._replace(vlan=0x1000 | 300)) is None  # (VLAN 300 is not behind OTHER)
