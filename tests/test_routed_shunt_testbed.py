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

pytestmark = [pytest.mark.integration, pytest.mark.testbed, pytest.mark.second_bed]

TESTBED = Bed(mode="routed", config={"experimental_routed": True})  # (flow_layout auto: single in routed mode)
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
    from nfshunt_testbed.traffic import STEADY_RATE
    router, h2 = _mac(tb, tb.fw, "fw-eth1"), _mac(tb, tb.h2, "h2-eth0")
    srv, cli = tb.start_transfer(SHUNT, 60, bitrate=STEADY_RATE)  # (paced: its frames are counted, not its rate)
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
        result = tb.stop_transfer(srv, cli)
    assert "error" not in result, result
    assert "flow_layout auto: routed shunts, so the single-table layout" in tb.controller_output(since_start=True)
    assert len(frames) >= 100, out[-2000:]
    assert set(frames) == {(router, h2, "63")}, set(frames)
    assert forwarded < len(frames) / 10, f"the firewall routed {forwarded} datagrams while h2 got {len(frames)}"


# A UDP stream h1:47000 -> h2:5201 (h2 echoes), which the policy shunts; on "probe" one
# datagram with TTL 1, and the ICMP error it brings back read from the socket's error queue
# (IP_RECVERR, as traceroute's UDP probes): {"origin", "type", "code", "offender"} or {}.
PROBE = r"""
import json, select, socket, struct, sys, time
SOL_IP, IP_RECVERR, MSG_ERRQUEUE = 0, 11, 0x2000
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", 47000)); s.connect((sys.argv[1], 5201)); s.setblocking(False)
s.setsockopt(SOL_IP, IP_RECVERR, 1)
print("ready", flush=True)
deadline = None
while deadline is None or time.monotonic() < deadline:
    try:
        s.send(b"stream")
    except OSError:
        pass  # (an earlier datagram's error, reported on the next send: read below)
    try:
        data, anc, _, _ = s.recvmsg(512, 512, MSG_ERRQUEUE)
        for level, kind, raw in anc:
            if level == SOL_IP and kind == IP_RECVERR:
                _errno, origin, icmp_type, code = struct.unpack_from("=IBBB", raw)
                offender = socket.inet_ntoa(raw[16 + 4:16 + 8])
                if deadline is not None:  # (before the probe: a port unreachable while h2's echo starts)
                    print(json.dumps({"origin": origin, "type": icmp_type, "code": code, "offender": offender}),
                          flush=True)
                    sys.exit(0)
    except BlockingIOError:
        pass
    try:
        while s.recv(512):
            pass
    except OSError:
        pass
    if deadline is None and select.select([sys.stdin], [], [], 0)[0] and sys.stdin.readline().strip() == "probe":
        s.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, 1)
        s.send(b"probe")
        s.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, 64)
        deadline = time.monotonic() + 3
    time.sleep(0.02)
print("{}", flush=True)
"""
ECHO = r"""
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", 5201))
while True:
    data, peer = s.recvfrom(2048); s.sendto(data, peer)
"""


def test_a_shunted_datagram_whose_ttl_expires_is_answered_by_the_firewall_as_a_router(tb):
    """The traceroute rule: the switch's dec_ttl finds the TTL expiring and sends the frame
    to the controller (OpenFlow 1.3 set_async: invalid-TTL packet-ins), which hands it to
    the firewall; the firewall answers ICMP time exceeded from its own address on h1's side."""
    answer = ttl_expired_answer(tb)
    assert answer == {"origin": 2, "type": 11, "code": 0, "offender": "10.0.1.254"}, answer  # ICMP, time exceeded
    counters = tb.control({"cmd": "status", "connections": False})["counters"]
    assert counters.get("packet_in:ttl expired", 0) >= 1, counters


def ttl_expired_answer(tb) -> dict:
    """h1's shunted UDP stream to h2's echo, then one datagram of TTL 1 through its shunt: the
    ICMP error that came back (PROBE's line), {} if none."""
    from nfshunt_testbed.bed import PYTHON
    echo = tb.spawn(tb.h2, PYTHON, "-c", ECHO)
    tb.wait_for(lambda: tb.run(tb.h2, "ss", "-Hlun", "sport", "=", f":{SHUNT}", check=False).strip(), 5,
                "h2's echo to listen", interval=0.05)
    probe = tb.h1.popen([PYTHON, "-c", PROBE, tb.h2_ip], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert probe.stdout.readline().strip() == "ready"
        tb.wait_for(lambda: [f for f in tb.conn_flows(SHUNT) if "dec_ttl" in f["actions"] and "udp" in f], 10,
                    "the UDP stream's routed shunt")
        probe.stdin.write("probe\n")
        probe.stdin.flush()
        return json.loads(probe.stdout.readline())
    finally:
        probe.kill()
        probe.communicate()
        echo.kill()
