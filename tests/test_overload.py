"""Outside hosts cannot overload the controller or push shunts off the switch (issue 11.6),
on the real testbed: a FIN flood on a shunted connection is rate-limited by the switch's
controller meter (set up by NFShunt), and another connection still closes promptly. And
what the meter drops is not lost: a burst of honest closes far beyond its burst still
ends every shunt, from the catchers' counters.

The single-table layout: its per-connection catchers say which connections closed. (In the
pipeline layout the catchers are shared, so a shunt that heard one FIN is handed back as
closing after a short look, and a flood's later FINs meet the firewall instead of the meter.)"""
from __future__ import annotations

import subprocess
import time

import pytest

from tests.beds import Bed
from tests.test_teardown_close import _bulk, _pair

pytestmark = [pytest.mark.integration, pytest.mark.testbed]
SHUNT = 5201
RATE = 200

FLOOD = r"""
import socket, struct, sys, time
intf, smac, dmac, src, dst, sport, dport, n = sys.argv[1:9]
def mac(text): return bytes.fromhex(text.replace(":", ""))
def csum(b):
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xFFFF); s += s >> 16
    return ~s & 0xFFFF
ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 40, 0, 0, 64, 6, 0, socket.inet_aton(src), socket.inet_aton(dst))
ip = ip[:10] + struct.pack("!H", csum(ip)) + ip[12:]
tcp = struct.pack("!HHIIBBHHH", int(sport), int(dport), 1, 1, 5 << 4, 0x11, 1024, 0, 0)
frame = mac(dmac) + mac(smac) + b"\x08\x00" + ip + tcp
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind((intf, 0))
t0 = time.monotonic()
for i in range(int(n)):  # paced: 2,000 a second, which the controller could take unmetered
    s.send(frame)
    if i % 20 == 19:
        time.sleep(max(0.0, t0 + (i + 1) / 2000 - time.monotonic()))
print(f"{int(n)} {time.monotonic() - t0:.3f}", flush=True)
"""


TESTBED = Bed(config={"default_shunt_timeout": 60, "packet_in_rate": RATE, "flow_layout": "single"})


def _teardown_packet_ins(tb):
    return tb.control({"cmd": "status", "connections": False})["counters"].get("packet_in:teardown", 0)


def test_a_fin_flood_is_rate_limited_by_the_switch_and_other_closes_still_work(tb):
    from nfshunt_testbed.bed import H1_IP, H2_IP, PYTHON
    srv = tb.conn_server(SHUNT)
    victim, _ = tb.open_conns(SHUNT, 1, cport_base=48001)
    other = _bulk(tb, 48002)
    try:
        tb.wait_for(lambda: len(_pair(tb, 48001)) == 2 and len(_pair(tb, 48002)) == 2, 10, "both shunted")
        meters = subprocess.run(["ovs-ofctl", "-O", "OpenFlow13", "dump-meters", "s1"], capture_output=True,
                                text=True, check=True).stdout
        assert "meter=controller pktps burst" in meters and f"rate={RATE}" in meters, meters
        before = _teardown_packet_ins(tb)
        n = 4000
        out = tb.run(tb.h1, PYTHON, "-c", FLOOD, "h1-eth0", tb.h1.MAC(), tb.h2.MAC(), H1_IP, H2_IP, "48001",
                     str(SHUNT), str(n))
        sent, seconds = int(out.split()[0]), float(out.split()[1])
        time.sleep(0.5)  # packet-ins already metered are still arriving; counted below
        seen = _teardown_packet_ins(tb) - before
        print(f"\n{sent} FIN segments in {seconds:.2f} s; {seen} reached the controller")
        assert seen <= RATE * (seconds + 0.5) + RATE // 10 + 50  # the rate, its burst, and slack for timing
        assert seen < sent / 3
        stats = subprocess.run(["ovs-ofctl", "-O", "OpenFlow13", "meter-stats", "s1"], capture_output=True,
                               text=True, check=True).stdout
        dropped = int(stats.split("packet_count:")[-1].split()[0])  # the drop band's count
        print(f"the switch's controller meter dropped {dropped}")
        assert dropped > sent // 2  # the meter, not some queue, held the rest back
        # Another shunted connection still closes promptly.
        other.stdin.write("close\n")
        other.stdin.flush()
        line = other.stdout.readline().split()
        assert line[0] == "closed" and line[2] == "1" and float(line[1]) < 1.0, line
        tb.wait_for(lambda: not _pair(tb, 48002), 1.0, "the other connection's shunt to go", interval=0.05)
        assert len(_pair(tb, 48001)) == 2  # one direction's FINs alone never end a shunt
    finally:
        victim.kill()
        other.kill()
        srv.kill()


def test_a_burst_of_closes_beyond_the_meter_ends_every_shunt(tb):
    """150 connections close at once: 300 FINs against a meter of 200/s with a burst of 20.
    The packet-ins it drops are found again from the catchers' counters; every shunt ends
    within seconds, not at its 60 s idle timeout. Only the switch is watched meanwhile."""
    n = 150
    srv = tb.conn_server(SHUNT)
    conns, _ = tb.open_conns(SHUNT, n, cport_base=49001)
    try:
        tb.wait_for(lambda: len(tb.conn_flows(SHUNT)) == 2 * n, 20, f"all {n} shunted", interval=0.2)
        before = tb.control({"cmd": "status", "connections": False})["counters"]  # the flood test's are in
        t0 = time.monotonic()
        conns.stdin.write("close\n")
        conns.stdin.flush()
        tb.wait_for(lambda: not tb.conn_flows(SHUNT), 10, "every shunt gone", interval=0.2)
        took = time.monotonic() - t0
        after = tb.control({"cmd": "status", "connections": False})["counters"]
        dropped, ended = (after.get(k, 0) - before.get(k, 0) for k in ("packet_in_dropped", "teardowns_from_counters"))
        print(f"\n{n} closes: every shunt gone after {took:.1f} s; the meter dropped {dropped} packet-ins, "
              f"{ended} shunts ended from their catchers' counters")
        assert dropped > 0 and ended > 0
    finally:
        conns.kill()
        srv.kill()
