"""Routed shunts (docs/design/routed.md slice 2, `experimental_routed`): a connection through
the routing firewall is shunted with the rewrite the router does, its next hops read from the
firewall's own route and neighbour tables. On the real testbed: once the pair is on the switch,
the frames h2 receives carry the router's egress MAC as source, h2's MAC as destination and a
TTL one lower than h1 sent (64), and the firewall forwards (almost) none of them."""
from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from tests.beds import Bed

pytestmark = [pytest.mark.integration, pytest.mark.testbed]

TESTBED = Bed(mode="routed", config={"experimental_routed": True, "flow_layout": "single"})
SHUNT = 5201
FRAME = re.compile(r"^\S+ (\S+) > (\S+), ethertype IPv4 \(0x0800\), length \d+: \(tos \S+, ttl (\d+),")


def _mac(tb, node, intf: str) -> str:
    return json.loads(tb.run(node, "ip", "-j", "link", "show", intf))[0]["address"]


def _forwarded(tb) -> int:
    """Datagrams the firewall's kernel routed (Ip ForwDatagrams of its namespace)."""
    head, values = [line.split() for line in tb.run(tb.fw, "cat", "/proc/net/snmp").splitlines()[:2]]
    return int(values[head.index("ForwDatagrams")])


def _pair_packets(tb) -> int:
    return sum(int(f["n_packets"]) for f in tb.conn_flows(SHUNT) if "dec_ttl" in f["actions"])


def test_a_shunted_transfer_reaches_h2_with_the_router_s_macs_and_a_ttl_one_lower(tb):
    router, h2 = _mac(tb, tb.fw, "fw-eth1"), _mac(tb, tb.h2, "h2-eth0")
    srv, cli = tb.start_transfer(SHUNT, 4)
    try:
        flows = tb.wait_for(lambda: [f for f in tb.conn_flows(SHUNT) if "dec_ttl" in f["actions"]], 10,
                            "the routed shunt's flows")
        assert all(f"set_field:{router}->eth_src" in f["actions"] for f in flows
                   if f.get("in_port") == "1" and "CONTROLLER" not in f["actions"]), flows
        time.sleep(0.3)  # (what the firewall still had queued drains)
        forwarded0 = _forwarded(tb)
        cap = tb.h2.popen(["timeout", "5", "tcpdump", "-l", "-nn", "-e", "-v", "-c", "300", "-i", "h2-eth0",
                           "tcp", "and", "src", "host", tb.h1_ip, "and", "dst", "port", str(SHUNT)],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        out, _ = cap.communicate(timeout=10)
        forwarded = _forwarded(tb) - forwarded0
        frames = [m.groups() for m in map(FRAME.match, out.splitlines()) if m]
        # The switch's counters trail its datapath: polled (the pair carried what h2 got).
        tb.wait_for(lambda: _pair_packets(tb) >= len(frames), 5, "the pair's counters to count the frames")
    finally:
        result = tb.finish_transfer(srv, cli)
    assert "error" not in result, result
    assert len(frames) >= 100, out[-2000:]
    assert set(frames) == {(router, h2, "63")}, set(frames)
    assert forwarded < len(frames) / 10, f"the firewall routed {forwarded} datagrams while h2 got {len(frames)}"
