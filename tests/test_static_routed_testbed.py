"""A static shunt through the routing firewall (`via`, issue 38 item 5) on the real testbed:
once the firewall's tables give the stream's next hops, its flows do the router's rewrite,
and every frame h2 receives carries the firewall's egress MAC as source, h2's MAC as
destination and a TTL one lower than h1 sent (64), none of them crossing the firewall."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.beds import Bed
from tests.test_static_testbed import ECHO, FRAMES, SENDER

pytestmark = [pytest.mark.integration, pytest.mark.testbed]

PORT, CPORT = 34964, 40000
STATIC_KIND = 0x4E06
STREAM = {"name": "plc-routed", "protocol": "udp", "src": "10.0.1.1", "dst": "10.0.2.1", "dst_port": PORT,
          "fast_ports": [1, 3], "via": "table"}
TESTBED = Bed(mode="routed", config={"experimental_routed": True, "flow_layout": "single", "static_shunts": [STREAM]})
FRAME = re.compile(r"^\S+ (\S+) > (\S+), ethertype IPv4 \(0x0800\), length \d+: \(tos \S+, ttl (\d+),")
WATCH = "0x5742"  # the test's own flows' cookie


def _mac(tb, node, intf: str) -> str:
    return json.loads(tb.run(node, "ip", "-j", "link", "show", intf))[0]["address"]


def _static(tb):
    return [f for f in tb.flows() if int(f["cookie"], 16) >> 48 == STATIC_KIND]


@pytest.fixture
def neighbours(tb):
    """Every neighbour known beforehand (the hosts' gateways, the firewall's hosts): no ARP
    crosses the slow path, so the watch counts only the stream's frames; and the firewall's
    entries, told by the route follower, are what installs the stream's flows."""
    entries = ((tb.h1, "h1-eth0", "10.0.1.254", _mac(tb, tb.fw, "fw-eth0")),
               (tb.h2, "h2-eth0", "10.0.2.254", _mac(tb, tb.fw, "fw-eth1")),
               (tb.fw, "fw-eth0", tb.h1_ip, _mac(tb, tb.h1, "h1-eth0")),
               (tb.fw, "fw-eth1", tb.h2_ip, _mac(tb, tb.h2, "h2-eth0")))
    for node, intf, address, mac in entries:
        tb.run(node, "ip", "neigh", "replace", address, "lladdr", mac, "dev", intf, "nud", "permanent")
    try:
        yield
    finally:
        for node, intf, address, _ in entries:
            tb.run(node, "ip", "neigh", "del", address, "dev", intf, check=False)


@pytest.fixture
def slow_path_watch(tb):
    """The stream's frames that take the slow path (tests/test_static_testbed.py's watch)."""
    for in_port, slow, side in ((1, 2, "tp_dst"), (3, 4, "tp_src")):
        tb.ofctl("add-flow", f"cookie={WATCH},priority=101,udp,in_port={in_port},{side}={PORT},actions=output:{slow}")
    try:
        yield lambda: sum(int(f["n_packets"]) for f in tb.flows() if f["cookie"] == WATCH)
    finally:
        tb.ofctl("del-flows", f"cookie={WATCH}/-1")


def stream_at_h2(tb, port: int = PORT, cport: int = CPORT) -> tuple[dict, list[tuple[str, ...]], str]:
    """FRAMES datagrams h1 -> h2:port, echoed back by h2: the sender's report, and each
    datagram as h2 got it ((source MAC, destination MAC, TTL), tcpdump's text)."""
    echo = tb.spawn(tb.h2, sys.executable, "-c", ECHO, str(port), stdout=subprocess.PIPE)
    cap = None
    try:
        assert echo.stdout.readline().strip() == "ready"
        cap = tb.h2.popen(["timeout", "15", "tcpdump", "-l", "-nn", "-e", "-v", "-c", str(FRAMES), "-i", "h2-eth0",
                           "udp", "and", "dst", "port", str(port)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        tb.wait_for(lambda: "listening" in cap.stderr.readline(), 5, "tcpdump to listen")
        result = json.loads(tb.run(tb.h1, sys.executable, "-c", SENDER, tb.h2_ip, str(port), str(cport),
                                   str(FRAMES), timeout=60))
        out, _ = cap.communicate(timeout=20)
    finally:
        if cap is not None and cap.poll() is None:
            cap.kill()
        echo.kill()
        echo.wait()
    return result, [m.groups() for m in map(FRAME.match, out.splitlines()) if m], out


def test_a_routed_static_stream_reaches_h2_with_the_router_s_macs_and_a_ttl_one_lower(tb, neighbours,
                                                                                    slow_path_watch):
    router, h2 = _mac(tb, tb.fw, "fw-eth1"), _mac(tb, tb.h2, "h2-eth0")
    flows = tb.wait_for(lambda: (lambda fs: fs if len(fs) == 2 and all("dec_ttl" in f["actions"] for f in fs)
                                 else None)(_static(tb)), 10, "the static stream's routed flows")
    forward = next(f for f in flows if f["in_port"] == "1")
    assert f"set_field:{router}->eth_src" in forward["actions"] and f"set_field:{h2}->eth_dst" in forward["actions"]
    rows = {r["direction"]: r for r in tb.control({"cmd": "status", "static": True})["static_shunts"]}
    assert rows["original"]["next_hop"] == {"interface": "fw-eth1", "neighbour": tb.h2_ip, "mac": h2}, rows
    result, frames, out = stream_at_h2(tb)
    assert (result["sent"], result["echoed"]) == (FRAMES, FRAMES), result  # (the echo: the reverse flow's rewrite)
    assert len(frames) == FRAMES, out[-2000:]
    assert set(frames) == {(router, h2, "63")}, set(frames)
    assert slow_path_watch() == 0, "a frame of the static stream crossed the firewall"
