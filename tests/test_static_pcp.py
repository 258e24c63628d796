"""Static shunts of VLAN trunks (issue 37 item 5, design section 5.3): an entry may name its
source side's VLAN and a priority (PCP), with or without addresses ("every frame of VLAN 30
with priority 6 takes the fast path"); its flows match the tag (and priority) and leave with
the destination side's tag as the firewall's bridge would put it, PCP kept. An untagged
entry's cookie and flow are what they were."""
from __future__ import annotations

import os
from typing import Any

import pytest

os.environ.setdefault("OSKEN_HUB_TYPE", "native")

from nfshunt.config.settings import ConfigError  # noqa: E402
from nfshunt.core.static_table import StaticTable  # noqa: E402
from nfshunt.records import cookies  # noqa: E402
from nfshunt.records.model import OFP13, UDP, FlowTuple, SwitchFlow, retag_ops  # noqa: E402
from tests.helpers import config  # noqa: E402
from tests.support.rig import FAST_A, FAST_B, SLOW_A, Rig  # noqa: E402

TRUNKS = [
    {"fast": 1, "slow": 2, "physdevin": 1, "bridge_port": "fw-eth0", "vlans": [100, 200, 30]},
    {"fast": 3, "slow": 4, "physdevin": 2, "bridge_port": "fw-eth1",
     "vlans": [100, 200, {"id": 301, "zone": 30}]},
]
CELL = {"name": "cell-30-prio-6", "vlan": 30, "pcp": 6, "fast_ports": [1, 3]}
STREAM = {"name": "plc", "protocol": "udp", "src": "10.0.0.1", "dst": "10.0.0.2", "dst_port": 34964,
          "fast_ports": [1, 3]}


def trunk_config(*entries: dict, ports: list = TRUNKS, **kw: Any) -> Any:
    return config(ports=ports, openflow_versions=["1.3"], static_shunts=list(entries),
                  **kw)


def refused(*entries: dict, **kw: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        trunk_config(*entries, **kw)
    return info.value


def flows(cfg: Any) -> list:
    return sorted(StaticTable(cfg, cfg.switches[0]).flows.values(), key=lambda f: f.reply)


def test_an_address_less_vlan_priority_entry_makes_a_flow_a_direction_retagged():
    fwd, rev = flows(trunk_config(CELL))
    assert (fwd.in_port, fwd.out_port, fwd.vid_in, fwd.vid_out, fwd.zone, fwd.pcp) == (1, 3, 30, 301, 30, 6)
    assert (rev.in_port, rev.out_port, rev.vid_in, rev.vid_out, rev.pcp) == (3, 1, 301, 30, 6)
    assert fwd.src is None and fwd.describe() == "any vlan 30 pcp 6 port 1 -> 3"
    assert fwd.covers(FlowTuple(4, UDP, "10.9.9.9", "10.8.8.8", 1, 2, 30))
    assert not fwd.covers(FlowTuple(4, UDP, "10.9.9.9", "10.8.8.8", 1, 2, 100))


def test_an_untagged_entry_keeps_its_cookie_and_a_tagged_one_gets_another():
    untagged = flows(config(openflow_versions=["1.3"], static_shunts=[STREAM]))
    assert [f.cookie & 0xFFFFFFFF for f in untagged] == [0xFC9B639A] * 2  # main's, for this entry
    tagged = flows(trunk_config({**STREAM, "vlan": 100}))
    assert {f.cookie for f in tagged}.isdisjoint({f.cookie for f in untagged})
    assert {f.cookie for f in flows(trunk_config({**STREAM, "vlan": 100, "pcp": 5}))}.isdisjoint(
        {f.cookie for f in tagged})


@pytest.mark.parametrize("entry, key, problem", [
    ({**STREAM, "vlan": 100, "pcp": 8}, "static_shunts[0].pcp", "outside 0-7"),
    ({**STREAM, "pcp": 6}, "static_shunts[0].pcp", "a priority needs a tag: give \"vlan\""),
    ({"vlan": 30, "fast_ports": [1, 3]}, "static_shunts[0].protocol", "required key is missing"),
    ({"vlan": 30, "pcp": 6, "protocol": "udp", "fast_ports": [1, 3]}, "static_shunts[0].src",
     "give protocol, src and dst, or none of them"),
    ({**CELL, "dst_port": 5}, "static_shunts[0].dst_port", "a port needs a protocol and addresses"),
    ({**CELL, "vlan": 4095}, "static_shunts[0].vlan", "reserved by IEEE 802.1Q"),
    ({**CELL, "vlan": 999}, "static_shunts[0].vlan", "VLAN 999 is not carried by the port group of fast port 1"),
    ({**STREAM, "fast_ports": [1, 3]}, "static_shunts[0].fast_ports[0]", "carries no untagged frames"),
])
def test_a_bad_vlan_entry_is_refused_naming_its_key_and_the_fix(entry, key, problem):
    error = refused(entry)
    assert error.key == key and problem in error.problem, (error.key, error.problem)


def test_a_vlan_the_destination_side_does_not_carry_is_refused():
    ports = [TRUNKS[0], {**TRUNKS[1], "vlans": [100, 200]}]
    error = refused(CELL, ports=ports)
    assert error.key == "static_shunts[0].vlan"
    assert error.problem.startswith("VLAN 30 (zone 30) is not carried by the port group of fast port 3")


@pytest.mark.parametrize("a, b, overlap", [
    (CELL, {**STREAM, "vlan": 30}, True),  # every frame of the VLAN and priority takes in a stream of it
    (CELL, {**STREAM, "vlan": 30, "pcp": 6}, True),
    (CELL, {**STREAM, "vlan": 30, "pcp": 5}, False),  # another priority: no frame matches both
    (CELL, {**STREAM, "vlan": 100}, False),  # another VLAN
    (CELL, {**CELL, "name": "again"}, True),
    (CELL, {**CELL, "name": "other", "pcp": 5}, False),
    ({**STREAM, "vlan": 100}, {**STREAM, "vlan": 100, "name": "b", "pcp": 3}, True),
    ({**STREAM, "vlan": 100, "pcp": 2}, {**STREAM, "vlan": 100, "name": "b", "pcp": 3}, False),
    ({**STREAM, "vlan": 100}, {**STREAM, "vlan": 200, "name": "b"}, False),
])
def test_overlaps_count_the_vlan_and_the_priority(a, b, overlap):
    for first, second in ((a, b), (b, a)):
        if overlap:
            assert "a frame would match both" in refused(first, second).problem
        else:
            trunk_config(first, second)


def _trunk_rig(*entries: dict, **kw: Any) -> Rig:
    return Rig(OFP13, ports=TRUNKS, openflow_versions=["1.3"], static_shunts=list(entries),
               **kw)


def test_on_the_switch_vlan_30_priority_6_goes_fast_retagged_priority_kept_and_5_to_the_firewall():
    rig = _trunk_rig(CELL)
    t = FlowTuple(4, UDP, "10.0.3.1", "10.0.3.2", 40000, 9000)
    there = rig.switch.packet(FAST_A, t, vlan=30, pcp=6)
    back = rig.switch.packet(FAST_B, t.reversed(), vlan=301, pcp=6)
    assert (there.outputs, there.tags, there.pcps) == ((FAST_B,), (301,), (6,))
    assert (back.outputs, back.tags, back.pcps) == ((FAST_A,), (30,), (6,))
    assert rig.switch.packet(FAST_A, t, vlan=30, pcp=5).outputs == (SLOW_A,)
    assert rig.switch.packet(FAST_A, t, vlan=100, pcp=6).outputs == (SLOW_A,)
    # A new controller finds them right: one flow a cookie, carrying the same frames.
    again = _trunk_rig(CELL, switch=rig.switch, now=rig.now + 1)
    assert sorted(e.cookie for e in again.flows(cookies.Kind.STATIC)) == sorted(again.core.static.flows)
    assert again.switch.packet(FAST_A, t, vlan=30, pcp=6).tags == (301,)


def _read(flow: Any, **kw: Any) -> SwitchFlow:
    """A static flow as the switch reports it back, exactly right unless `kw` says otherwise."""
    right = {"cookie": flow.cookie, "priority": flow.priority, "in_port": flow.in_port, "match": None,
             "out_port": flow.out_port, "vlan": 0x1000 | flow.vid_in if flow.vid_in else 0, "pcp": flow.pcp,
             "retag": retag_ops(flow.vid_in, flow.vid_out), "exact": False}
    return SwitchFlow(**{**right, **kw})


@pytest.mark.parametrize("wrong", [{"vlan": 0x1000 | 100}, {"vlan": 0}, {"pcp": 5}, {"pcp": None}, {"retag": ()},
                                   {"retag": retag_ops(30, 100)}], ids=str)
def test_reconcile_keeps_a_right_tagged_flow_and_writes_again_one_of_another_tag_priority_or_retag(wrong):
    cfg = trunk_config(CELL)
    table = StaticTable(cfg, cfg.switches[0])
    fwd, rev = flows(cfg)
    assert table.reconcile([_read(fwd), _read(rev)]) == ([], [])
    _, out = table.reconcile([_read(fwd, **wrong), _read(rev)])
    assert [type(c).__name__ for c in out] == ["RemoveStatic", "InstallStatic"]
    assert out[0].reason == "not as configured" and out[1].flows == (fwd,)


def test_an_untagged_entry_read_back_as_before_is_right():
    cfg = config(openflow_versions=["1.3"], static_shunts=[STREAM])
    table = StaticTable(cfg, cfg.switches[0])
    assert table.reconcile([_read(f) for f in flows(cfg)]) == ([], [])
