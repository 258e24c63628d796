"""Static shunts on the real testbed: a declared UDP stream goes fast port to fast port
from its first frame (the firewall sees none of its frames), an operator's block of its
tuple wins, and a reload changes only what changed."""
from __future__ import annotations

import json
import os
import sys

import pytest

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORT, CPORT = 34964, 40000
FRAMES = 300
STREAM = {"name": "plc-cycle", "protocol": "udp", "src": "10.0.0.1", "dst": "10.0.0.2", "dst_port": PORT,
          "fast_ports": [1, 3]}
STATIC_KIND = 0x4E06

# A cyclic stream: FRAMES datagrams 1 ms apart from CPORT to the echo; prints how many went and
# how many echoes came back (the reverse direction: PORT -> CPORT).
SENDER = """
import json, socket, sys, time
dst, port, cport, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", cport))
s.setblocking(False)
got = 0
start = time.monotonic()
for i in range(n):
    s.sendto(i.to_bytes(4, "big") * 128, (dst, port))
    while time.monotonic() < start + (i + 1) * 0.001:
        try:
            s.recv(2048); got += 1
        except BlockingIOError:
            pass
s.settimeout(0.5)
try:
    while got < n:
        s.recv(2048); got += 1
except socket.timeout:
    pass
print(json.dumps({"sent": n, "echoed": got}))
"""
ECHO = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
while True:
    data, peer = s.recvfrom(2048)
    s.sendto(data, peer)
"""


@pytest.fixture(scope="module")
def tb(integration_ready):
    from nfshunt_testbed import Testbed
    bed = Testbed(mode="nfshunt", of_version="1.3", config={"static_shunts": [STREAM]})
    with bed:
        bed.wait_for_controller()
        # Neighbours known beforehand: no ARP crosses the slow path, so every frame it
        # counts would be the stream's.
        pairs = ((bed.h1, "h1-eth0", bed.h2), (bed.h2, "h2-eth0", bed.h1))
        for node, intf, peer in pairs:
            bed.run(node, "ip", "neigh", "replace", peer.IP(), "lladdr", peer.MAC(), "dev", intf, "nud", "permanent")
        try:
            yield bed
        finally:
            for node, intf, peer in pairs:
                bed.run(node, "ip", "neigh", "del", peer.IP(), "dev", intf, check=False)


def static_flows(tb):
    return [f for f in tb.flows() if int(f["cookie"], 16) >> 48 == STATIC_KIND]


def slow_counters():
    out = {}
    for port in (2, 4):  # the switch's slow ports: towards the firewall's bridge
        with open(f"/sys/class/net/s1-eth{port}/statistics/tx_packets") as fh:
            out[port] = int(fh.read())
    return out


def cycle(tb, frames=FRAMES):
    out = tb.run(tb.h1, sys.executable, "-c", SENDER, tb.h2.IP(), str(PORT), str(CPORT), str(frames), timeout=60)
    return json.loads(out)


def test_every_frame_of_a_static_stream_goes_fast_including_the_first(tb):
    flows = static_flows(tb)
    assert sorted((f["in_port"], f["actions"]) for f in flows) == [("1", "output:3"), ("3", "output:1")]
    assert all(f.get("idle_timeout") is None and f["priority"] == "33050" for f in flows)
    assert all(f["n_packets"] == "0" for f in flows)  # nothing sent yet: the next frame is the stream's first
    echo = tb.spawn(tb.h2, sys.executable, "-c", ECHO, str(PORT), stdout=-1)
    assert echo.stdout.readline().strip() == "ready"
    before = slow_counters()
    result = cycle(tb)
    assert result == {"sent": FRAMES, "echoed": FRAMES}
    after = tb.wait_for(lambda: (lambda now: now if all(int(f["n_packets"]) == FRAMES for f in now) else None)(
        static_flows(tb)), 5, "the static flows' counters to show every frame")
    assert {f["in_port"]: int(f["n_packets"]) for f in after} == {"1": FRAMES, "3": FRAMES}
    assert slow_counters() == before, "a frame of the static stream crossed the firewall"
    assert not [e for e in tb.conntrack() if PORT in (e["sport"], e["dport"])]
    status = tb.control({"cmd": "status"})
    rows = tb.wait_for(lambda: [r for r in tb.control({"cmd": "status"})["static_shunts"]
                                if r["packets"] == FRAMES], 5, "status to show the static counters")
    assert {r["direction"] for r in rows} == {"original", "reply"} and status["shunts"] == 0

    # An operator's block of the stream's tuple wins over it, until unshunt lifts it.
    tb.nfshunt("block", "--socket", tb.firewalls[0].control_socket, f"udp 10.0.0.1:{CPORT} -> 10.0.0.2:{PORT}")
    tb.wait_for(lambda: len(static_flows(tb)) == 4, 5, "the block's drop flows")
    assert cycle(tb, 50)["echoed"] == 0
    assert slow_counters() == before
    tb.nfshunt("unshunt", "--socket", tb.firewalls[0].control_socket, f"udp 10.0.0.1:{CPORT} -> 10.0.0.2:{PORT}")
    tb.wait_for(lambda: len(static_flows(tb)) == 2, 5, "the block's drop flows to go")
    assert cycle(tb, 50) == {"sent": 50, "echoed": 50}
    echo.kill()
    echo.wait()
