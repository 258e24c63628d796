"""The testbed's routed mode (docs/design/routed.md, slice 1): the firewall routes between h1's
10.0.1.0/24 (fd01::/64) and h2's 10.0.2.0/24 (fd02::/64), each side's gateway on its switch
port, through the same policy chain. Until routed shunts exist the controller hears each
decision and leaves the connection on the firewall, counted with its reason: a shunt built
as a bridge's would hand h2 frames addressed to the router's MAC with the TTL unchanged."""
from __future__ import annotations

import re

import pytest

from nfshunt.core.admission import R_ROUTED
from nfshunt.records import markcodec
from tests.beds import Bed

pytestmark = [pytest.mark.integration, pytest.mark.testbed]

TESTBED = Bed(mode="routed")
SHUNT = 5201
REFUSED = f"ignored:{R_ROUTED}"


def _refused(tb) -> int:
    return tb.control({"cmd": "status", "connections": False})["counters"].get(REFUSED, 0)


@pytest.mark.parametrize("ping,dst", [(("ping",), "h2_ip"), (("ping", "-6"), "h2_ip6")])
def test_the_firewall_routes_between_the_subnets(tb, ping, dst):
    """One hop: the reply's TTL (hop limit) is h2's 64 less the router's one."""
    out = tb.run(tb.h1, *ping, "-c", "1", "-W", "2", getattr(tb, dst))
    assert re.search(r"\bttl=63\b", out), out


def test_a_transfer_crosses_the_routing_firewall_whole_and_its_shunt_is_refused_and_counted(tb):
    refused0, slow0 = _refused(tb), tb.slow_path_packets()
    result = tb.iperf(SHUNT, 2)
    assert "error" not in result, result
    received = result["end"]["sum_received"]["bytes"]
    assert received > 1_000_000
    assert tb.conn_flows(SHUNT) == []  # nothing shunted: every segment went through the router
    assert tb.slow_path_packets() - slow0 > received / 1500
    # The policy decided (the routed plumbing marked the entry by interface, -i/-o), and
    # the controller heard it and refused to shunt it.
    tb.wait_for(lambda: _refused(tb) > refused0, 5, "the controller to count the routed refusal")
    marks = [markcodec.decode(e["mark"]) for e in tb.conntrack() if e.get("dport") == SHUNT]
    assert any((m.ingress, m.egress, m.action) == (1, 2, 1) for m in marks), marks
