"""The firewall pair on VLAN trunks (issue 37 item 6): the pair testbed (mode "ha") with both
firewalls on mode vlan's trunks (Bed(vlan=True): each firewall a bridge per VLAN over its own
sub-interfaces, fw-eth0.100 ... and fw2-eth0.100 ...), strict (INVALID dropped, no loose
pickup). The same tuple in VLANs 100 and 200 at once, shunted in 100 and left on the
firewall in 200 by a policy by sub-interface; the master dies:
- the backup's controller adopts the VLAN 100 pair as it is (reconcile's exact check: tag,
  retag; the same cookies carry it on) and the transfer does not stall;
- conntrackd carried VLAN 200's entry in zone 200, committed there at the takeover: its
  transfer carries on through the new master, which without loose pickup drops every
  packet of a connection it does not track in that zone."""
from __future__ import annotations

import re
import time

import pytest

from tests.beds import Bed
from tests.test_vlan import pair

# on the first testbed, as test_ha: the pair failed 3 of 4 runs on the third (docs/testing.md)
pytestmark = [pytest.mark.integration, pytest.mark.testbed]

TESTBED = Bed(mode="ha", vlan=True, config={"default_shunt_timeout": 60})
SHUNT, CPORT = 5201, 41020
# 5201 shunted in VLAN 100 only (either firewall's sub-interfaces); the rest stays on the firewall
POLICY = "".join(f"-A NFSHUNT_POLICY -m physdev --physdev-in {fw}-eth{side}.100 -m conntrack --ctstate ESTABLISHED "
                 f"--ctproto tcp --ctorigdstport {SHUNT} -g NFSHUNT_SHUNT\n"
                 for fw in ("fw", "fw2") for side in (0, 1)) + \
    "-A NFSHUNT_POLICY -m conntrack --ctstate ESTABLISHED -g NFSHUNT_IGNORE\n"


def _external_cache(tb, fw):
    """The lines of a firewall's conntrackd external cache (the other host's entries)."""
    return tb.run(tb.node(fw), "conntrackd", "-C", f"{fw.workdir}/conntrackd.conf", "-e", check=False).splitlines()


def _rx_200(tb, fw):
    """Packets a firewall received on its VLAN 200 sub-interfaces."""
    return sum(tb.intf_packets(tb.node(fw), f"{fw.name}-eth{side}.200")[0] for side in (0, 1))


def test_a_vlan_100_shunt_survives_the_masters_failure_and_vlan_200_of_the_same_tuple_stays_apart(tb, tmp_path):
    from nfshunt_testbed.bed import STEADY_RATE
    fw, _ = tb.wait_for_elected(10)
    fw2 = tb.other(fw)
    policy = tmp_path / "policy.rules"
    policy.write_text(POLICY)
    for each in tb.firewalls:
        tb.nfshunt("iptables", "apply", "--config", each.config_path, "--policy", str(policy), fw=each)
    tb.strict_firewalls()
    h1, h2, h3, h4 = (tb.host(n) for n in ("h1", "h2", "h3", "h4"))
    # Both run until stopped, 4 s after the failure (VLAN 200's bound is 3 s): a fixed 10 s ran on
    # idle after a quick failover.
    transfers = [tb.start_transfer(SHUNT, 60, cport=CPORT, src=h1, server=h2, bitrate=STEADY_RATE),
                 tb.start_transfer(SHUNT, 60, cport=CPORT, src=h3, server=h4, bitrate=STEADY_RATE)]
    try:
        tb.wait_for(lambda: len(pair(tb, 100, CPORT)) >= 2, 10, "VLAN 100's shunt")
        cookies = {f["cookie"] for f in pair(tb, 100, CPORT)}
        # VLAN 200's entry (on the firewall: not shunted) on the backup, in its zone
        tb.wait_for(lambda: [line for line in _external_cache(tb, fw2) if f"sport={CPORT}" in line
                             and "zone=200" in line], 5, "conntrackd to carry VLAN 200's entry to the backup")
        assert not pair(tb, 200, CPORT)
        on_fw2 = _rx_200(tb, fw2)
        failed_at = time.monotonic()
        tb.fail_firewall(fw)
        tb.wait_for(lambda: tb.defaults_point_to(fw2), 10, f"{fw2.name} to take the switch over")
        # adopted, not re-installed: the same flows carry VLAN 100's connection on
        assert {f["cookie"] for f in pair(tb, 100, CPORT)} == cookies
        assert not pair(tb, 200, CPORT)  # the new master keeps VLAN 200's connection apart, on the firewall
        tb.watch_until(failed_at + 4.0)
        results = [tb.stop_transfer(*t) for t in transfers]
    finally:
        for t in transfers:
            for proc in t:
                proc.kill()
    stalls = [tb.longest_stall(r) if "error" not in r else None for r in results]
    print(f"\nlongest stall: VLAN 100 (shunted) {stalls[0]} s, VLAN 200 (firewall) {stalls[1]} s")
    for result in results:
        assert "error" not in result, result
    assert stalls[0] < 1.0, "the adopted VLAN 100 shunt stalled"
    assert stalls[1] < 3.0, "VLAN 200 did not resume through the new master within 3 s"
    after = tb.controller_output(fw2).split("master of switch")[-1]
    assert re.search(r"reconciled with switch \w+ \([^)]*\): \d+ NFShunt flows read, [1-9]\d* pairs held, "
                     r"0 re-installed", after), "the new master did not adopt the VLAN 100 pair"
    assert [e for e in tb.conntrack_zone(200, fw=fw2) if e.get("sport") == str(CPORT)]
    assert _rx_200(tb, fw2) - on_fw2 > 1000  # VLAN 200 went on through the new master
