"""A pair of routing firewalls on VLAN trunks (docs/routed.md "VLAN trunks", "A firewall pair"):
the testbed's `ha` mode with routed=True and vlan=True. Each firewall routes between the
hosts' VLANs with addresses of its own on each sub-interface; keepalived holds the gateways
(fw-eth0.100's, fw-eth1.200's, fw-eth0.300's) on the active one. When it dies, the new master
adopts the routed VLAN shunts by their tags and rewrites them with its own sub-interfaces'
MACs in place; the hosts on each VLAN learn its MAC from its tagged announcements. The waits
read the switch and the logs, never a controller's status (asking would wake it)."""
from __future__ import annotations

import re
import time

import pytest

from tests.test_failsafe import longest_stall
from tests.test_routed_ha import LONG, WATCH_SLOW, _mac, _routed_flows, assert_carried_on, fail_over

pytestmark = [pytest.mark.integration, pytest.mark.testbed]

SHUNT, IGNORE = 5201, 5203


def _sources(tb, port: int) -> set[tuple[str, str, str]]:
    """(in_port, matched tag, the source MAC its flow writes) of every pair's flows."""
    out = set()
    for f in _routed_flows(tb, port):
        m = re.search(r"set_field:([0-9a-f:]{17})->eth_src", f["actions"])
        out.add((f["in_port"], f.get("dl_vlan", ""), m.group(1) if m else ""))
    return out


def test_a_takeover_keeps_the_routed_vlan_shunts_rewritten_with_the_new_masters_sub_interface_macs(
        integration_ready):
    from nfshunt_testbed.bed import STEADY_RATE
    from tests.beds import Bed, running
    with running(Bed(mode="ha", routed=True, vlan=True,
                     config={"experimental_routed": True, "default_shunt_timeout": 60})) as tb:
        fw, _ = tb.wait_for_elected(10)
        fw2 = tb.other(fw)

        def macs(f) -> set[tuple[str, str, str]]:  # forward in by FAST1 on 100 leaves by fw-eth1.200, and back
            return {("1", "100", _mac(tb, tb.node(f), f"{f.name}-eth1.200")),
                    ("3", "200", _mac(tb, tb.node(f), f"{f.name}-eth0.100"))}
        old, new = macs(fw), macs(fw2)
        s_srv, s_cli = tb.start_transfer(SHUNT, LONG, bitrate=STEADY_RATE)
        i_srv, i_cli = tb.start_transfer(IGNORE, LONG, bitrate=STEADY_RATE)
        try:
            tb.wait_for(lambda: len(_routed_flows(tb, SHUNT)) == 4 and _sources(tb, SHUNT) == old, 10,
                        f"the two routed VLAN shunts with {fw.name}'s MACs")
            cookies = {f["cookie"] for f in tb.conn_flows(SHUNT)}
            time.sleep(2)  # both transfers under way, conntrackd has the ignored one on fw2
            failed_at, took_over, _ = fail_over(tb, fw, lambda: _sources(tb, SHUNT) == new)
            assert {f["cookie"] for f in tb.conn_flows(SHUNT)} == cookies  # adopted, rewritten in place
            tb.watch_until(failed_at + WATCH_SLOW)
            # h3's gateway (VLAN 300, the third keepalived holds) moved too: h1 -> h3 through fw2's
            # router on a stick, h3 answering by its gateway's new MAC.
            assert " 0% packet loss" in tb.run(tb.h1, "ping", "-c", "1", "-W", "2", "10.0.3.1", check=False)
        finally:
            shunted = tb.stop_transfer(s_srv, s_cli)
            ignored = tb.stop_transfer(i_srv, i_cli)
        print(f"{fw2.name} had the switch {took_over:.2f} s after {fw.name} died; longest stall: shunted "
              f"{longest_stall(shunted):.1f} s, slow path {longest_stall(ignored):.1f} s")
        assert_carried_on(shunted, ignored, took_over, fw2.name)
        counters = tb.control({"cmd": "status", "connections": False}, fw=fw2)["counters"]
        assert counters.get("routed_announcements", 0) >= 3, counters  # (one a gateway at least, tagged)
        assert not [k for k in counters if k.startswith("removed:shunt:routed")], counters
