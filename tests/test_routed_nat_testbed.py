"""The routed testbed's masquerade variant (docs/design/routed.md, section 6): the routing
firewall translates h1's subnet to its own address on h2's side. The connection's entry then
has a reply tuple that is not the original reversed (F11); without `experimental_routed` it
stays on the firewall, its refusal counted, and the transfer arrives whole (with it, NAT
shunts: tests/test_routed_nat_shunt_testbed.py)."""
from __future__ import annotations

import pytest

from nfshunt.core.admission import R_ROUTED
from tests.beds import Bed

pytestmark = [pytest.mark.integration, pytest.mark.testbed, pytest.mark.third_bed]

TESTBED = Bed(mode="routed", nat="masquerade")
SHUNT = 5201
FW_OUTSIDE = "10.0.2.254"  # fw-eth1: the address h1's connections leave with


def _refused(tb) -> int:
    return tb.control({"cmd": "status", "connections": False})["counters"].get(f"ignored:{R_ROUTED}", 0)


def test_a_masqueraded_transfer_arrives_whole_through_the_firewall_and_its_shunt_is_refused(tb):
    refused0, slow0 = _refused(tb), tb.slow_path_packets()
    result = tb.iperf(SHUNT, 2)
    assert "error" not in result, result
    received = result["end"]["sum_received"]["bytes"]
    assert received > 1_000_000
    assert tb.conn_flows(SHUNT) == [] and tb.slow_path_packets() - slow0 > received / 1500
    tb.wait_for(lambda: _refused(tb) > refused0, 5, "the controller to count the routed refusal")
    # The entry's reply goes to the firewall's own address: what a NAT shunt must rewrite.
    out = tb.run(tb.fw, "conntrack", "-L", "-p", "tcp", "--dport", str(SHUNT), check=False)
    natted = [line for line in out.splitlines() if f"src={tb.h1_ip} " in line and f"dst={FW_OUTSIDE} " in line]
    assert natted, out
