"""Static shunts on the real testbed: a declared UDP stream goes fast port to fast port
from its first frame (the firewall sees none of its frames), an operator's block of its
tuple wins, and a reload changes only what changed."""
from __future__ import annotations

import json
import os
import sys

import pytest

from tests.beds import Bed, running

pytestmark = [pytest.mark.integration, pytest.mark.testbed]

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
sent, rtt = [], []
def take(data):
    rtt.append(time.monotonic() - sent[int.from_bytes(data[:4], "big")])
start = time.monotonic()
for i in range(n):
    sent.append(time.monotonic())
    s.sendto(i.to_bytes(4, "big") * 128, (dst, port))
    while time.monotonic() < start + (i + 1) * 0.001:
        try:
            take(s.recv(2048))
        except BlockingIOError:
            pass
s.settimeout(0.5)
try:
    while len(rtt) < n:
        take(s.recv(2048))
except socket.timeout:
    pass
print(json.dumps({"sent": n, "echoed": len(rtt), "max_rtt_ms": round(max(rtt, default=0) * 1000, 3)}))
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
    with running(Bed(config={"static_shunts": [STREAM]})) as bed:
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


WATCH = "0x5741"  # the test's own flows' cookie


@pytest.fixture
def slow_path_watch(tb):
    """The stream's frames that take the slow path: flows of the test's own that do what the
    default flows do (to the firewall) for the stream's tuple only, one priority above them,
    so the firewall path's counter is the stream's alone (the slow ports' counters also count
    the hosts' own chatter)."""
    for in_port, slow, side in ((1, 2, "tp_dst"), (3, 4, "tp_src")):
        tb.ofctl("add-flow", f"cookie={WATCH},priority=101,udp,in_port={in_port},{side}={PORT},actions=output:{slow}")
    try:
        yield lambda: sum(int(f["n_packets"]) for f in tb.flows() if f["cookie"] == WATCH)
    finally:
        tb.ofctl("del-flows", f"cookie={WATCH}/-1")


def cycle(tb, frames=FRAMES):
    out = tb.run(tb.h1, sys.executable, "-c", SENDER, tb.h2.IP(), str(PORT), str(CPORT), str(frames), timeout=60)
    return json.loads(out)


def test_every_frame_of_a_static_stream_goes_fast_including_the_first(tb, slow_path_watch):
    flows = static_flows(tb)
    assert sorted((f["in_port"], f["actions"]) for f in flows) == [("1", "output:3"), ("3", "output:1")]
    assert all(f.get("idle_timeout") is None and f["priority"] == "33050" for f in flows)
    assert all(f["n_packets"] == "0" for f in flows)  # nothing sent yet: the next frame is the stream's first
    echo = tb.spawn(tb.h2, sys.executable, "-c", ECHO, str(PORT), stdout=-1)
    assert echo.stdout.readline().strip() == "ready"
    result = cycle(tb)
    assert (result["sent"], result["echoed"]) == (FRAMES, FRAMES)
    after = tb.wait_for(lambda: (lambda now: now if all(int(f["n_packets"]) == FRAMES for f in now) else None)(
        static_flows(tb)), 5, "the static flows' counters to show every frame")
    assert {f["in_port"]: int(f["n_packets"]) for f in after} == {"1": FRAMES, "3": FRAMES}
    assert slow_path_watch() == 0, "a frame of the static stream crossed the firewall"
    assert not [e for e in tb.conntrack() if PORT in (e["sport"], e["dport"])]
    status = tb.control({"cmd": "status"})
    rows = tb.wait_for(lambda: [r for r in tb.control({"cmd": "status", "static": True})["static_shunts"]
                                if r["packets"] == FRAMES], 5, "status to show the static counters")
    assert {r["direction"] for r in rows} == {"original", "reply"} and status["shunts"] == 0

    # An operator's block of the stream's tuple wins over it, until unshunt lifts it.
    tb.nfshunt("block", "--socket", tb.firewalls[0].control_socket, f"udp 10.0.0.1:{CPORT} -> 10.0.0.2:{PORT}")
    tb.wait_for(lambda: len(static_flows(tb)) == 4, 5, "the block's drop flows")
    assert cycle(tb, 50)["echoed"] == 0  # the block drops both directions
    assert slow_path_watch() == 0
    tb.nfshunt("unshunt", "--socket", tb.firewalls[0].control_socket, f"udp 10.0.0.1:{CPORT} -> 10.0.0.2:{PORT}")
    tb.wait_for(lambda: len(static_flows(tb)) == 2, 5, "the block's drop flows to go")
    assert cycle(tb, 50)["echoed"] == 50
    echo.kill()
    echo.wait()


def write_config(tb, **overrides):
    cfg = {**tb.nfshunt_config(), **overrides}
    with open(tb.config_path, "w") as fh:
        json.dump(cfg, fh, indent=2)


def test_a_reload_adds_and_removes_streams_without_touching_a_running_one(tb):
    import signal
    import subprocess
    second = {**STREAM, "name": "drive", "dst_port": PORT + 1}
    echo = tb.spawn(tb.h2, sys.executable, "-c", ECHO, str(PORT), stdout=-1)
    assert echo.stdout.readline().strip() == "ready"
    frames = 4000  # 4 s of a 1 ms cycle, running across both reloads
    sender = tb.spawn(tb.h1, sys.executable, "-c", SENDER, tb.h2.IP(), str(PORT), str(CPORT), str(frames),
                      stdout=subprocess.PIPE)
    tb.wait_for(lambda: all(int(f["n_packets"]) > 0 for f in static_flows(tb)), 5, "the stream to run")
    before = {f["cookie"]: f for f in static_flows(tb)}
    socket_arg = ("--socket", tb.firewalls[0].control_socket)

    # A config that fails validation changes nothing, and the CLI says why and exits non-zero.
    write_config(tb, static_shunts=[STREAM, {**second, "src": "10.0.0.0/8"}], listen_port=7000)
    proc = tb.node(tb.firewalls[0]).popen([sys.executable, "-m", "nfshunt", "reload", *socket_arg],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "static_shunts[1].src" in err and "nothing changed" in err
    assert {f["cookie"] for f in static_flows(tb)} == set(before)

    # A good one: the new stream's flows are added, confirmed by the switch; the running one's
    # are not touched (their duration and counters go on: no delete and add).
    write_config(tb, static_shunts=[STREAM, second], listen_port=7000)
    reply = tb.control({"cmd": "reload"})
    assert reply["ok"] and reply["confirmed"] and reply["static"] == {"added": 2, "removed": 0, "flows": 4}
    assert "listen_port" in reply["kept"] and reply["changed"] == ["static_shunts"]
    after = {f["cookie"]: f for f in static_flows(tb)}
    assert set(before) < set(after) and len(after) == 4
    for cookie, flow in before.items():
        assert float(after[cookie]["duration"].rstrip("s")) >= float(flow["duration"].rstrip("s"))
        assert int(after[cookie]["n_packets"]) >= int(flow["n_packets"])

    # SIGHUP: the same reload; the second stream goes again, the first is still not touched.
    write_config(tb, static_shunts=[STREAM])
    tb.firewalls[0].controller.send_signal(signal.SIGHUP)
    tb.wait_for(lambda: len(static_flows(tb)) == 2, 5, "the SIGHUP reload to remove the second stream")
    last = {f["cookie"]: f for f in static_flows(tb)}
    assert set(last) == set(before)
    for cookie, flow in after.items():
        if cookie in last:
            assert float(last[cookie]["duration"].rstrip("s")) >= float(flow["duration"].rstrip("s"))
    result = json.loads(sender.communicate(timeout=30)[0])
    echo.kill()
    echo.wait()
    print("cyclic stream across two reloads:", result)
    assert (result["sent"], result["echoed"]) == (frames, frames)  # no frame lost
    write_config(tb)


def _reload_cli(tb):
    """`nfshunt reload` on the firewall, as an operator runs it: (exit code, what it printed)."""
    import subprocess
    proc = tb.node(tb.firewalls[0]).popen([sys.executable, "-m", "nfshunt", "reload", "--socket",
                                           tb.firewalls[0].control_socket], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, cwd=REPO)
    out, err = proc.communicate(timeout=30)
    return proc.returncode, out + err


def _limit_table0(room):
    """Table 0 refuses adds beyond what it holds now plus `room` (None: no limit)."""
    import subprocess
    if room is None:
        subprocess.run(["ovs-vsctl", "--if-exists", "clear", "Bridge", "s1", "flow_tables"], check=True)
        return
    held = subprocess.run(["ovs-ofctl", "-O", "OpenFlow13", "dump-flows", "s1", "table=0"], check=True,
                          capture_output=True, text=True).stdout.count("cookie=")
    subprocess.run(["ovs-vsctl", "--", "--id=@ft", "create", "Flow_Table", f"flow_limit={held + room}",
                    "overflow_policy=refuse", "--", "set", "Bridge", "s1", "flow_tables:0=@ft"], check=True)


def test_a_reload_is_confirmed_only_when_every_flow_mod_is_in_the_switch(tb):
    """Table full (room for 1 of a new stream's 2 flows): the reload says which flow the
    switch refused and exits 4, where it said "confirmed" with 3 of 4 static flows on the
    switch. The switch away: pending, exit 3, where it said "confirmed by the switch in ~0 ms";
    the flows go in when it is back."""
    import subprocess

    from tests.test_failsafe import _controller_targets, _restore_reconnect_backoff
    second = {**STREAM, "name": "drive", "dst_port": PORT + 1}
    third = {**STREAM, "name": "press", "dst_port": PORT + 2}
    try:
        _limit_table0(1)
        write_config(tb, static_shunts=[STREAM, second])
        code, said = _reload_cli(tb)
        assert code == 4, said
        assert "FAILED: 1 of 2 flow-mods refused" in said and "static flow drive (" in said and "table full" in said
        assert "NOT confirmed" in said and len(static_flows(tb)) == 3
    finally:
        _limit_table0(None)
    controller = _controller_targets()
    subprocess.run(["ovs-vsctl", "del-controller", "s1"], check=True)
    try:
        tb.wait_for(lambda: not tb.control({"cmd": "status", "connections": False})["switch"]["connected"], 5,
                    "the controller to see the switch go")
        write_config(tb, static_shunts=[STREAM, third])
        code, said = _reload_cli(tb)
        assert code == 3, said
        assert "PENDING" in said and "not connected" in said and "NOT confirmed" in said
    finally:
        subprocess.run(["ovs-vsctl", "set-controller", "s1", *controller], check=True)
    tb.wait_for(lambda: {f["tp_dst"] for f in static_flows(tb) if f["in_port"] == "1"} == {str(PORT), str(PORT + 2)},
                20, "the pending stream's flows once the switch is back (and the removed one's gone)")
    _restore_reconnect_backoff()
    write_config(tb)
    code, said = _reload_cli(tb)
    assert code == 0 and "confirmed: every flow-mod of the change is in the switch" in said, said
    assert len(static_flows(tb)) == 2
