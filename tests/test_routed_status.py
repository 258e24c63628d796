"""What `status` and `explain` say of a routing firewall's pairs (docs/design/routed.md 5.9):
each routed row's next hops, and each switch's pairs by next hop (the pairs a neighbour's loss
would hand back). A bridged switch's status is unchanged."""
from __future__ import annotations

import os

os.environ.setdefault("OSKEN_HUB_TYPE", "native")

from nfshunt.records.model import TCP, FlowTuple, NextHop  # noqa: E402
from tests.helpers import event  # noqa: E402
from tests.support.rig import Rig, shunted  # noqa: E402
from tests.test_routed import FW0, FW1, GOOD, H1_MAC, H2_MAC  # noqa: E402
from tests.test_routed_adopt import _rig, _shunted  # noqa: E402

GW = "02:00:00:00:0a:01"  # a router behind fw-eth1 that 10.0.9.9 is reached through


def test_status_names_each_routed_pairs_next_hops_and_counts_the_pairs_by_next_hop():
    answers = {**GOOD, "10.0.0.2": NextHop("fw-eth1", FW1, H2_MAC, "10.0.0.2"),
               "10.0.0.1": NextHop("fw-eth0", FW0, H1_MAC, "10.0.0.1"),
               "10.0.9.9": NextHop("fw-eth1", FW1, GW, "10.0.0.254")}
    rig = _rig(answers)
    for sport in (41000, 41001):
        _shunted(rig, event(sport=sport, received=100.0))
    far = event(sport=41002, ct_id=9, received=100.0)
    far.orig = FlowTuple(4, TCP, "10.0.0.1", "10.0.9.9", 41002, 5201)  # beyond a router on fw-eth1's side
    far.reply = far.orig.reversed()
    _shunted(rig, far)
    st = rig.control({"cmd": "status"})
    rows = {r["tuple"]: r for r in st["connections"]}
    row = rows["tcp 10.0.0.1:41000 -> 10.0.0.2:5201"]
    assert row["next_hops"] == [{"interface": "fw-eth1", "neighbour": "10.0.0.2", "mac": H2_MAC},
                                {"interface": "fw-eth0", "neighbour": "10.0.0.1", "mac": H1_MAC}]
    (sw,) = st["switches"]
    assert rows["tcp 10.0.0.1:41002 -> 10.0.9.9:5201"]["next_hops"][0] == {
        "interface": "fw-eth1", "neighbour": "10.0.0.254", "mac": GW}
    assert sw["next_hops"] == [
        {"interface": "fw-eth0", "neighbour": "10.0.0.1", "mac": H1_MAC, "pairs": 3, "static_flows": 0},
        {"interface": "fw-eth1", "neighbour": "10.0.0.2", "mac": H2_MAC, "pairs": 2, "static_flows": 0},
        {"interface": "fw-eth1", "neighbour": "10.0.0.254", "mac": GW, "pairs": 1, "static_flows": 0}]


def test_explain_shows_a_routed_pairs_next_hops():
    from nfshunt.app import explain as ex
    rig = _rig()
    conn = _shunted(rig, event(sport=41010, received=100.0))
    got = ex.pair_json(conn, rig.now)
    assert got["next_hops"] == [{"interface": "fw-eth1", "neighbour": "", "mac": H2_MAC},
                                {"interface": "fw-eth0", "neighbour": "", "mac": H1_MAC}]


def test_a_bridged_status_has_no_next_hops():
    rig = Rig()
    shunted(rig, sport=41020)
    st = rig.control({"cmd": "status"})
    assert "next_hops" not in st["switches"][0] and "next_hops" not in st["connections"][0]
