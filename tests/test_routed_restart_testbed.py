"""A controller restart through a routing firewall (docs/design/routed.md 5.6, 5.7;
`experimental_routed`): the restarted controller reads the routed pairs back from the switch
and adopts them (the same flows: same cookies, not re-installed) once the firewall's tables
give the next hops their flows carry, and a NAT pair once its kept conntrack entry is found
with the same tuples. The shunted transfer carries on through the restart without a stall over
1 s (the masquerade bed's case: tests/test_routed_nat_restart_testbed.py). What changed on the firewall while the
controller was away is followed: h2's new MAC rewrites the adopted pair in place, a blackhole
route to h2 hands it back alive. The controllers stop without taking their pairs down
(delete_flows_on_shutdown false, as a crash leaves them)."""
from __future__ import annotations

import json
import time

import pytest

from tests.beds import Bed

pytestmark = [pytest.mark.integration, pytest.mark.testbed, pytest.mark.second_bed]

SHUNT = 5201
KEEP = {"experimental_routed": True, "flow_layout": "single", "default_shunt_timeout": 30,
        "delete_flows_on_shutdown": False}
FW_OUTSIDE = "10.0.2.254"  # the masquerade bed's fw-eth1: the address h1's connections leave with
NEW_MAC = "02:00:00:00:02:98"
TESTBED = Bed(mode="routed", config=KEEP)


def _pair_flows(tb, cport: int) -> list[dict[str, str]]:
    """The routed pair's own flows (not its catchers: the router's rewrite) of the transfer whose
    data connection is from h1's port `cport` (a previous case's pairs may still be on the switch)."""
    return [f for f in tb.conn_flows(cport) if "dec_ttl" in f["actions"] and "CONTROLLER" not in f["actions"]]


def _transfer(tb, cport: int):
    """A paced transfer (its stalls are measured) that runs until the test stops it."""
    from nfshunt_testbed.traffic import STEADY_RATE
    srv, cli = tb.start_transfer(SHUNT, 60, cport=cport, bitrate=STEADY_RATE)
    flows = tb.wait_for(lambda: (lambda fs: fs if len(fs) == 2 else [])(_pair_flows(tb, cport)), 10,
                        "the data connection's routed pair")
    return srv, cli, {f["cookie"] for f in flows}


def _age(flows: list[dict[str, str]]) -> float:
    return min(float(f["duration"].rstrip("s")) for f in flows)


def restart_keeps_the_pairs(tb, nat: bool, cport: int) -> None:
    srv, cli, before = _transfer(tb, cport)
    try:
        if nat:
            flows = _pair_flows(tb, cport)
            assert all(f"set_field:{FW_OUTSIDE}->ip_src" in f["actions"] or "->ip_dst" in f["actions"]
                       for f in flows), flows
        tb.wait_for(lambda: _age(_pair_flows(tb, cport)) > 1.0, 5, "the pair to be over 1 s old")
        tb.restart_controller()
        restarted = time.monotonic()
        tb.wait_for_controller()
        # The adoption's checks (the tables' answer, a NAT pair's entry) come right after the
        # reconcile: a pair they hand back goes within a second.
        time.sleep(1.5)
        st = tb.control({"cmd": "status"})
        after = _pair_flows(tb, cport)
        age = _age(after) if after else 0.0
        waited = time.monotonic() - restarted
        entries = tb.run(tb.fw, "conntrack", "-L", "-p", "tcp", "--dport", str(SHUNT), check=False)
        tb.watch_until(time.monotonic() + 2.0)  # (a stall from the adoption on shows in these 2 s)
    finally:
        result = tb.stop_transfer(srv, cli)
    assert "error" not in result, result.get("error")
    assert {f["cookie"] for f in after} == before, (before, after, tb.controller_output(since_start=True)[-3000:])
    assert age > waited, f"re-installed: {age:.1f} s old, {waited:.1f} s after the restart"
    adopted = {c["ct_id"] for c in st["connections"] if c["action"] == "shunt"}
    assert {int(c, 16) & 0xFFFFFFFF for c in before} <= adopted
    assert not [k for k in st["counters"] if k.startswith(("removed:", "reconcile_deleted"))], st["counters"]
    if nat:  # the kept entries, still the firewall's translation
        assert entries.count(f"dst={FW_OUTSIDE}") >= 2, entries
    print(f"\npair adopted: {len(before)} flows {age:.1f} s old; longest stall {tb.longest_stall(result):.1f} s")
    assert tb.longest_stall(result) <= 1.0, result["server_output_json"]["intervals"]


def test_a_routed_shunted_transfer_survives_a_controller_restart_with_its_pairs_adopted(tb):
    restart_keeps_the_pairs(tb, nat=False, cport=47301)


def _counters(tb) -> dict[str, int]:
    return tb.control({"cmd": "status", "connections": False})["counters"]


def _fw_knows(tb, mac: str) -> bool:
    return mac in tb.run(tb.fw, "ip", "neigh", "show", "10.0.2.1", "dev", "fw-eth1")


def _h2_takes(tb, mac: str) -> None:
    """h2 takes `mac` and tells the firewall with its next ARP (its cache flushed)."""
    tb.run(tb.h2, "ip", "link", "set", "h2-eth0", "address", mac)
    tb.run(tb.h2, "ip", "neigh", "flush", "dev", "h2-eth0")
    tb.run(tb.h2, "ping", "-c", "1", "-W", "2", "10.0.2.254", check=False)
    tb.wait_for(lambda: _fw_knows(tb, mac), 5, f"the firewall to know h2 at {mac}")


def test_h2_s_new_mac_while_the_controller_was_away_rewrites_the_adopted_pair_in_place(tb):
    old = json.loads(tb.run(tb.h2, "ip", "-j", "link", "show", "h2-eth0"))[0]["address"]
    srv, cli, before = _transfer(tb, 47303)
    try:
        tb.stop_controller()
        _h2_takes(tb, NEW_MAC)  # (the pairs send to h2's old MAC meanwhile: that stalls the transfer)
        changed = time.monotonic()
        tb.restart_controller()
        tb.wait_for_controller()
        rewritten = tb.wait_for(lambda: [f for f in _pair_flows(tb, 47303)
                                         if f"set_field:{NEW_MAC}->eth_dst" in f["actions"]],
                                5, "the adopted pair's flow to h2 to carry h2's new MAC")
        followed = time.monotonic() - changed
        after = {f["cookie"] for f in _pair_flows(tb, 47303)}
        counted = _counters(tb)
        tb.watch_until(time.monotonic() + 1.0)  # (alive on the rewritten pair)
    finally:
        result = tb.stop_transfer(srv, cli)
        _h2_takes(tb, old)
    assert "error" not in result, result.get("error")
    assert after == before and len(rewritten) == 1, (before, after)  # the same flows, rewritten in place
    assert counted.get("routed_rewrites", 0) >= 1 and not [k for k in counted if k.startswith("removed:")], counted
    print(f"\nadopted pairs to h2's new MAC {followed:.1f} s after it changed (the restart's time); "
          f"longest stall {tb.longest_stall(result):.1f} s")


def test_a_blackhole_route_to_h2_made_while_the_controller_was_away_hands_the_adopted_pair_back_alive(tb):
    reason = "routed: blackhole route to the destination"
    srv, cli, before = _transfer(tb, 47304)
    try:
        tb.stop_controller()
        tb.run(tb.fw, "ip", "route", "add", "blackhole", "10.0.2.1/32")
        try:
            tb.restart_controller()
            tb.wait_for_controller()
            tb.wait_for(lambda: not before & {f["cookie"] for f in tb.conn_flows(47304)}, 5, "the pair handed back")
            removed = tb.wait_for(lambda: _counters(tb).get(f"removed:shunt:{reason}", 0), 5,
                                  "the take-downs counted by their reason")
            time.sleep(0.5)
            assert not _pair_flows(tb, 47304)  # nothing shunted while the firewall's tables say no
        finally:
            tb.run(tb.fw, "ip", "route", "del", "blackhole", "10.0.2.1/32")
        # Alive on the firewall, the connection is judged again by the policy and shunted again
        # (its entry re-created mostly has its old id: the same cookies then).
        again = tb.wait_for(lambda: _pair_flows(tb, 47304), 10, "the connection shunted again")
    finally:
        result = tb.stop_transfer(srv, cli)
    assert "error" not in result, result.get("error")  # alive: handed back, not dropped
    assert removed >= 1 and again, removed  # (a previous case's pairs to h2 may be on the switch still)
