"""A controller restart through a routing firewall (docs/design/routed.md 5.6, 5.7;
`experimental_routed`): the restarted controller reads the routed pairs back from the switch
and adopts them (the same flows: same cookies, not re-installed) once the firewall's tables
give the next hops their flows carry, and a NAT pair once its kept conntrack entry is found
with the same tuples. The shunted transfer carries on through the restart without a stall over
1 s, on the routed bed and on the masquerade bed behind a strict firewall (there, a NAT
connection without its translated entry is dead). The controllers stop without taking their
pairs down (delete_flows_on_shutdown false, as a crash leaves them)."""
from __future__ import annotations

import time

import pytest

from tests.beds import Bed, Strict, running

pytestmark = [pytest.mark.integration, pytest.mark.testbed]

SHUNT = 5201
KEEP = {"experimental_routed": True, "flow_layout": "single", "default_shunt_timeout": 30,
        "delete_flows_on_shutdown": False}
FW_OUTSIDE = "10.0.2.254"  # the masquerade bed's fw-eth1: the address h1's connections leave with


def _pair_flows(tb) -> list[dict[str, str]]:
    """The routed pairs' own flows on port 5201 (not their catchers): the router's rewrite."""
    return [f for f in tb.conn_flows(SHUNT) if "dec_ttl" in f["actions"] and "CONTROLLER" not in f["actions"]]


def _age(flows: list[dict[str, str]]) -> float:
    return min(float(f["duration"].rstrip("s")) for f in flows)


def _restart_keeps_the_pairs(tb, nat: bool) -> None:
    # 10 s: the restart and the checks take about 5 s, and the pairs must still be there.
    srv, cli = tb.start_transfer(SHUNT, 10)
    try:
        ours = (lambda f: f"set_field:{FW_OUTSIDE}->ip_src" in f["actions"] or "->ip_dst" in f["actions"]) if nat \
            else (lambda f: True)
        flows = tb.wait_for(lambda: (lambda fs: fs if len(fs) >= 4 and all(map(ours, fs)) else [])(_pair_flows(tb)),
                            10, "both connections' routed pairs")
        before = {f["cookie"] for f in flows}
        tb.wait_for(lambda: _age(_pair_flows(tb)) > 1.0, 5, "the pairs to be over 1 s old")
        tb.restart_controller()
        restarted = time.monotonic()
        tb.wait_for_controller()
        # The adoption's checks (the tables' answer, a NAT pair's entry) come right after the
        # reconcile: a pair they hand back goes within a second.
        time.sleep(1.5)
        st = tb.control({"cmd": "status"})
        after = _pair_flows(tb)
        age = _age(after) if after else 0.0
        waited = time.monotonic() - restarted
        entries = tb.run(tb.fw, "conntrack", "-L", "-p", "tcp", "--dport", str(SHUNT), check=False)
    finally:
        result = tb.finish_transfer(srv, cli)
    assert "error" not in result, result.get("error")
    assert {f["cookie"] for f in after} == before, (before, after, tb.controller_output(since_start=True)[-3000:])
    assert age > waited, f"re-installed: {age:.1f} s old, {waited:.1f} s after the restart"
    adopted = {c["ct_id"] for c in st["connections"] if c["action"] == "shunt"}
    assert {int(c, 16) & 0xFFFFFFFF for c in before} <= adopted
    assert not [k for k in st["counters"] if k.startswith(("removed:", "reconcile_deleted"))], st["counters"]
    if nat:  # the kept entries, still the firewall's translation
        assert entries.count(f"dst={FW_OUTSIDE}") >= 2, entries
    print(f"\npairs adopted: {len(before)} flows {age:.1f} s old; longest stall {tb.longest_stall(result):.1f} s")
    assert tb.longest_stall(result) <= 1.0, result["server_output_json"]["intervals"]


def test_a_routed_shunted_transfer_survives_a_controller_restart_with_its_pairs_adopted():
    with running(Bed(mode="routed", config=KEEP)) as tb:
        _restart_keeps_the_pairs(tb, nat=False)


def test_a_masqueraded_transfer_survives_a_controller_restart_with_its_nat_pairs_adopted():
    with running(Bed(mode="routed", nat="masquerade", strict=Strict.FULL, config=KEEP)) as tb:
        _restart_keeps_the_pairs(tb, nat=True)
