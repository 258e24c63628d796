"""`nfshunt probe-switch` against the routed testbed's Open vSwitch (issue 38 item 3): each
routed shape (the router's rewrite, NAT's set_fields, invalid-TTL packet-ins, an IPv6 pair's
rewrite) installed as
the controller does and a probe frame sent through it, all supported, and the switch's flows
left as the probe found them."""
from __future__ import annotations

import pytest

from nfshunt import probe_routed
from tests.beds import Bed, running
from tests.test_probe import _probe

pytestmark = [pytest.mark.integration, pytest.mark.testbed, pytest.mark.second_bed]


def test_probe_switch_finds_open_vswitch_does_every_routed_shape(integration_ready):
    with running(Bed(mode="routed")) as tb:
        out, settings = _probe(tb)
    print(out)
    for shape in (probe_routed.REWRITE, probe_routed.NAT, probe_routed.INVALID_TTL, probe_routed.IPV6,
                  probe_routed.FRAGMENT):
        assert f"  ok   {shape}: supported" in out, shape
    assert "routed mode: supported (the router's rewrite, invalid-TTL packet-ins, fragments kept off)" in out
    assert "NAT shunts: supported (addresses and ports rewritten, checksums fixed)" in out
    assert "IPv6 routed shunts: supported (the hop limit one lower, the next hop's MACs, an expiring one to the " \
           "firewall)" in out
    assert "experimental_routed" not in settings and "FAIL" not in out


def test_probe_switch_finds_open_vswitch_does_the_rewrite_and_retag_between_routed_vlans(integration_ready):
    """Shape 5 on the routed trunks' config (h1's VLAN 100 to h2's 200)."""
    with running(Bed(mode="routed", vlan=True)) as tb:
        out, settings = _probe(tb)
    print(out)
    assert f"  ok   {probe_routed.TRUNK}: supported" in out
    assert f"  ok   {probe_routed.FRAGMENT}: supported" in out
    assert "routed mode: supported (the router's rewrite, invalid-TTL packet-ins, fragments kept off, between the " \
           "config's VLANs)" in out
    assert "experimental_routed" not in settings and "FAIL" not in out
