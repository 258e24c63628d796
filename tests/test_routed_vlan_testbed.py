"""The routing firewall on VLAN trunks (docs/design/routed.md section 9): the testbed's mode
"routed" with vlan=True puts h1 (VLAN 100, 10.0.1.0/24) and h3 (VLAN 300, 10.0.3.0/24) on
FAST1's trunk and h2 (VLAN 200, 10.0.2.0/24) on FAST2's; the firewall's sub-interfaces
fw-eth0.100, fw-eth0.300 and fw-eth1.200 are their gateways. h1 <-> h3 is a router on a stick:
two VLANs of one trunk, in and out of the same slow port.

Without experimental_routed the controller patches each carried tag fast <-> slow and the
firewall routes every packet (the slow path); with it: tests/test_routed_vlan_shunt_testbed.py."""
from __future__ import annotations

import re

import pytest

from tests.beds import Bed

pytestmark = [pytest.mark.integration, pytest.mark.testbed, pytest.mark.second_bed]

TESTBED = Bed(mode="routed", vlan=True)
SHUNT = 5201
H3_IP, H3_IP6 = "10.0.3.1", "fd03::1"
ONE_HOP = re.compile(r"\bttl=63\b")  # the destination's 64 less the router's one (hop limit alike)


@pytest.mark.parametrize("ping,dst", [(("ping",), "10.0.2.1"), (("ping", "-6"), "fd02::1"),
                                      (("ping",), H3_IP), (("ping", "-6"), H3_IP6)])
def test_the_firewall_routes_between_the_vlans(tb, ping, dst):
    """h1 -> h2 across the trunks, h1 -> h3 on one trunk: one routed hop each way."""
    out = tb.run(tb.h1, *ping, "-c", "1", "-W", "2", dst)
    assert ONE_HOP.search(out), out


def test_h1_s_frames_reach_the_router_tagged_on_vlan_100_and_its_transfer_crosses_it(tb):
    """h1's frames leave s1's slow port tagged with VLAN 100 and come out of the stand-in NIC at
    fw-eth0.100, whose conntrack tracks the connection; without experimental_routed nothing is
    shunted: every segment goes through the router."""
    cap = tb.capture(None, "vf0-eth10", f"vlan 100 and icmp and src host {tb.h1_ip}", count=1)
    tb.run(tb.h1, "ping", "-c", "1", "-W", "2", tb.h2_ip)
    frames = tb.stop_capture(cap, wait=2)
    assert frames and "vlan 100" in frames[0], frames
    rx0, slow0 = tb.intf_packets(tb.fw, "fw-eth0.100")[0], tb.slow_path_packets()
    result = tb.iperf(SHUNT, 1)
    assert "error" not in result, result
    received = result["end"]["sum_received"]["bytes"]
    assert received > 1_000_000
    assert tb.intf_packets(tb.fw, "fw-eth0.100")[0] - rx0 > received / 1500
    assert tb.slow_path_packets() - slow0 > received / 1500
    assert tb.conn_flows(SHUNT) == []
    assert any(e["src"] == tb.h1_ip and e["dst"] == tb.h2_ip and e["dport"] == SHUNT for e in tb.conntrack())


def test_nat_on_the_routed_trunks_is_refused_before_anything_is_built(integration_ready):
    from nfshunt_testbed.bed import Testbed
    with pytest.raises(ValueError, match="nat is not built"):
        Testbed(mode="routed", vlan=True, nat="masquerade")
