"""What the switch cannot judge stays with the firewall (issue 11.7), on the real testbed:
a VLAN-tagged frame with a shunted connection's 5-tuple is not forwarded by its shunt
flows, and a NAT'd conntrack entry is never shunted."""
from __future__ import annotations

import pytest

from tests.beds import Bed
from tests.test_overload import FLOOD
from tests.test_teardown_close import _pair

pytestmark = [pytest.mark.integration, pytest.mark.testbed, pytest.mark.third_bed]
SHUNT = 5201

# FLOOD's frame with an 802.1Q tag (VLAN 100) between the MAC addresses and the EtherType.
TAGGED = FLOOD.replace('frame = mac(dmac) + mac(smac) + b"\\x08\\x00" + ip + tcp',
                       'frame = mac(dmac) + mac(smac) + b"\\x81\\x00\\x00\\x64" + b"\\x08\\x00" + ip + tcp')


TESTBED = Bed(config={"default_shunt_timeout": 60})


def _packets(flows, in_port):
    return sum(int(f["n_packets"]) for f in flows if f.get("in_port") == str(in_port))


def test_tagged_frames_with_a_shunted_tuple_are_not_forwarded_by_the_shunt(tb):
    from nfshunt_testbed.bed import H1_IP, H2_IP, PYTHON
    assert TAGGED != FLOOD
    srv = tb.conn_server(SHUNT)
    conns, _ = tb.open_conns(SHUNT, 1, cport_base=49001)
    try:
        tb.wait_for(lambda: len(_pair(tb, 49001)) == 2, 10, "the shunt")
        defaults = [f for f in tb.flows() if f.get("cookie") == "0x4e01000000000000"]
        shunt0, default0 = _packets(_pair(tb, 49001), 1), _packets(defaults, 1)
        n = 500
        tb.run(tb.h1, PYTHON, "-c", TAGGED, "h1-eth0", tb.h1.MAC(), tb.h2.MAC(), H1_IP, H2_IP, "49001",
               str(SHUNT), str(n))
        def to_firewall():
            defaults = [f for f in tb.flows() if f.get("cookie") == "0x4e01000000000000"]
            return _packets(defaults, 1) - default0
        # Every tagged frame goes to the slow path (flow counters lag the datapath: polled).
        tb.wait_for(lambda: to_firewall() >= n, 5, "the tagged frames counted on the default flow")
        shunted = _packets(_pair(tb, 49001), 1) - shunt0
        print(f"\n{n} tagged frames: {to_firewall()} to the firewall, {shunted} on the shunt "
              f"(the connection's own echoes)")
        assert shunted < 50
    finally:
        conns.kill()
        srv.kill()


def test_a_nat_entry_is_not_shunted(tb):
    from nfshunt_testbed.bed import H1_IP, H2_IP
    mark = len(tb.controller_output())
    # A decided shunt mark on an entry whose reply does not mirror its original (DNAT to
    # 192.0.2.9): the switch cannot rewrite addresses, so it must stay on the firewall.
    tb.run(tb.fw, "conntrack", "-I", "-p", "tcp", "-s", H1_IP, "-d", H2_IP, "--sport", "50001", "--dport",
           str(SHUNT), "-r", "192.0.2.9", "-q", H1_IP, "--reply-port-src", str(SHUNT), "--reply-port-dst", "50001",
           "--state", "ESTABLISHED", "-t", "60", "--mark", str(0x71210000))
    try:
        tb.wait_for(lambda: "nat: reply tuple is not the original reversed" in tb.controller_output()[mark:], 5,
                    "the NAT entry ignored with its reason")
        assert not [f for f in tb.flows() if "50001" in (f.get("tp_src"), f.get("tp_dst"))]
        st = tb.control({"cmd": "status", "connections": False})
        assert st["counters"].get("ignored:nat: reply tuple is not the original reversed", 0) >= 1
    finally:
        tb.run(tb.fw, "conntrack", "-D", "-p", "tcp", "--sport", "50001", check=False)
