"""Port groups' VLAN keys (issue 37, design section 6.1): what a trunk carries, each bad
input refused with the key and what to fix."""
from __future__ import annotations

import pytest

from nfshunt.config.settings import ConfigError, from_dict
from nfshunt.config.switch import Vlan

TRUNKS = [
    {"fast": 1, "slow": 2, "physdevin": 1, "bridge_port": "eth0", "vlans": [100, 200, 30]},
    {"fast": 3, "slow": 4, "physdevin": 2, "bridge_port": "eth1",
     "vlans": [100, 200, {"id": 301, "zone": 30, "bridge_port": "eth1.301"}]},
]


def config(ports=None, **kw):
    return {"ports": TRUNKS if ports is None else ports, "mark_actions": {"1": "shunt"},
            "openflow_versions": ["1.3"], **kw}


def group(**kw):
    return config([{"fast": 1, "slow": 2, "physdevin": 1, "bridge_port": "eth0", **kw},
                   {"fast": 3, "slow": 4, "physdevin": 2, "bridge_port": "eth1", "vlans": [100]}])


def refused(raw) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        from_dict(raw)
    return info.value


def test_trunks_read_with_zones_sub_interfaces_and_their_maps():
    a, b = from_dict(config()).switches[0].ports
    assert a.vlans == (Vlan(100, 100, "eth0.100"), Vlan(200, 200, "eth0.200"), Vlan(30, 30, "eth0.30"))
    assert b.vlans[2] == Vlan(301, 30, "eth1.301")
    assert a.untagged is None and b.untagged is None  # a trunk carries no untagged frames unless told
    assert a.vid_of_zone == {100: 100, 200: 200, 30: 30} and b.vid_of_zone == {100: 100, 200: 200, 30: 301}
    assert b.zone_of_vid == {100: 100, 200: 200, 301: 30}


def test_an_untagged_config_reads_as_before():
    (a, _) = from_dict({"ports": [{"fast": 1, "slow": 2, "physdevin": 1}, {"fast": 3, "slow": 4, "physdevin": 2}],
                        "mark_actions": {"1": "shunt"}}).switches[0].ports
    assert a.vlans == () and a.untagged == 0 and a.vid_of_zone == {0: 0}


def test_untagged_frames_may_join_a_vlan_zone_or_stay_untagged_beside_vlans():
    assert from_dict(group(untagged={"zone": 100}, vlans=[200])).switches[0].ports[0].vid_of_zone == \
        {200: 200, 100: 0}
    assert from_dict(group(untagged=True)).switches[0].ports[0].vid_of_zone[0] == 0


def test_trunks_need_no_flag():
    """Proven on the testbed (tests/test_vlan.py, the pair's VLAN case), VLAN trunks are a
    config like any other: no experimental key (a config naming one is refused as unknown)."""
    assert from_dict(config()).switches[0].ports[1].vid_of_zone == {100: 100, 200: 200, 30: 301}
    assert from_dict(group(untagged=False)).switches[0].ports[0].untagged is None
    with pytest.raises(ConfigError, match="experimental_vlans"):
        from_dict(config(experimental_vlans=True))


@pytest.mark.parametrize("vlans, key, problem", [
    ([0], "ports[0].vlans[0]", "VLAN 0 is the 802.1p priority tag, not a VLAN; priority-tagged frames are "
     "dropped and counted. To shunt untagged traffic set \"untagged\": true"),
    ([100, 4095], "ports[0].vlans[1]", "4095 is reserved by IEEE 802.1Q; VLAN ids are 1-4094"),
    ([5000], "ports[0].vlans[0]", "5000 is not a VLAN id; VLAN ids are 1-4094"),
    ([-1], "ports[0].vlans[0]", "-1 is not a VLAN id; VLAN ids are 1-4094"),
    ([{"id": 0}], "ports[0].vlans[0].id", "VLAN 0 is the 802.1p priority tag"),
    ([100, 200, 30, 100], "ports[0].vlans[3]", "VLAN 100 is already listed as vlans[0]"),
    ([30, {"id": 301, "zone": 30}], "ports[0].vlans[1].zone", "zone 30 is already VLAN 30's on this port group; "
     "a zone may name one VLAN per trunk, or the controller cannot tell which tag to put back"),
    ([{"id": 5, "zone": 0}], "ports[0].vlans[0].zone", "zone 0 is the untagged frames'; give 1-65535"),
    ([{"id": 5, "zone": 70000}], "ports[0].vlans[0].zone", "70000 is outside 1-65535"),
    ([[300, 100]], "ports[0].vlans[0]", "stacked tags (QinQ) are not supported"),
    ([{"id": [300, 100]}], "ports[0].vlans[0].id", "stacked tags (QinQ) are not supported"),
    ([{"id": 100, "tpid": "0x88a8"}], "ports[0].vlans[0].tpid", "stacked tags (QinQ) are not supported"),
    ([], "ports[0].vlans", "expected a non-empty list"),
    ([True], "ports[0].vlans[0]", "integer"),
])
def test_a_bad_vlan_says_what_to_fix(vlans, key, problem):
    error = refused(group(vlans=vlans))
    assert error.key == key
    assert problem in error.problem, error.problem


def test_a_zone_colliding_with_the_untagged_frames_is_refused():
    error = refused(group(vlans=[100], untagged={"zone": 100}))
    assert error.key == "ports[0].vlans[0].zone"
    assert "zone 100 is already the untagged frames' on this port group" in error.problem


def test_a_vlan_s_zone_colliding_with_another_s_id_is_refused():
    error = refused(group(vlans=[{"id": 7, "zone": 8}, 8]))
    assert (error.key, error.problem.split(";")[0]) == ("ports[0].vlans[1].zone",
                                                       "zone 8 is already VLAN 7's on this port group")


def test_one_switch_port_in_two_groups_says_to_list_the_vlans_in_one():
    error = refused(config([{"fast": 1, "slow": 2, "physdevin": 1, "vlans": [100]},
                            {"fast": 1, "slow": 4, "physdevin": 2, "vlans": [200]}]))
    assert error.key == "ports[1].fast"
    assert error.problem.endswith("to carry several VLANs on one switch port list them in one group's \"vlans\"")


def test_a_sub_interface_is_named_once():
    error = refused(config([{"fast": 1, "slow": 2, "physdevin": 1, "bridge_port": "eth0", "vlans": [100]},
                            {"fast": 3, "slow": 4, "physdevin": 2, "bridge_port": "eth1",
                             "vlans": [{"id": 100, "bridge_port": "eth0.100"}]}]))
    assert (error.key, error.problem) == ("ports[1].vlans[0].bridge_port", "'eth0.100' is already used by ports[0]")


def test_a_default_sub_interface_name_too_long_is_refused():
    error = refused(group(bridge_port="enp0s31f6abcde", vlans=[100]))
    assert error.key == "ports[0].vlans[0].bridge_port"


def test_translating_needs_openflow_1_3():
    error = refused(config(openflow_versions=["1.0", "1.3"]))
    assert error.key == "ports[1].vlans[2]"
    assert "translating VLANs needs OpenFlow 1.3 (set_field, push_vlan)" in error.problem
    error = refused({**group(untagged={"zone": 100}, vlans=[200]), "openflow_versions": ["1.0"]})
    assert "translating VLANs needs OpenFlow 1.3" in error.problem
    plain = config([{**g, "vlans": [100, 200]} for g in TRUNKS], openflow_versions=["1.0"])
    assert from_dict(plain).switches[0].ports[1].vid_of_zone == {100: 100, 200: 200}  # plain dl_vlan matching


def test_a_zone_on_one_group_only_is_warned_about():
    cfg = from_dict(group(vlans=[100, 999]))
    assert "ports[0].vlans[1]: zone 999 is on no other port group: a VLAN bridged to nothing is never shunted" \
        in cfg.security_warnings()


def test_a_static_shunt_on_a_trunk_without_untagged_frames_is_refused():
    raw = config(static_shunts=[{"protocol": "udp", "src": "10.0.0.1", "dst": "10.0.0.2", "dst_port": 9,
                                 "fast_ports": [1, 3]}])
    error = refused(raw)
    assert error.key == "static_shunts[0].fast_ports[0]" and "carries no untagged frames" in error.problem
