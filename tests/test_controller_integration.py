"""The controller on real parts: Open vSwitch (fail mode secure), a Linux bridge with the
NFSHUNT iptables plumbing, conntrack and iperf3, for OpenFlow 1.0 and 1.3."""
import json
import subprocess
import time

import pytest

from nfshunt.records import markcodec
from tests.beds import Bed, running
from tests.helpers import wait_listening

pytestmark = [pytest.mark.integration, pytest.mark.testbed, pytest.mark.third_bed]


@pytest.fixture(scope="module", params=["1.0", "1.3"])
def tb(request, integration_ready):
    with running(Bed(of_version=request.param, config={"default_shunt_timeout": 3, "default_block_timeout": 3})) as bed:
        yield bed
    if request.node.session.testsfailed:
        print(bed.controller_output()[-4000:])


def server(tb, port, udp=False):
    return tb.h2.popen(["iperf3", "-s", "-1", "-p", str(port)], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)


def client(tb, port, seconds, udp=False, v6=False, **kw):
    from nfshunt_testbed.bed import H2_IP, H2_IP6
    args = ["iperf3", "-c", H2_IP6 if v6 else H2_IP, "-p", str(port), "-t", str(seconds), "-J"]
    if udp:
        args += ["-u", "-b", "100M"]
    wait_listening(tb, tb.h2, port)
    return tb.h1.popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def counters(flows):
    return sorted(int(f["n_packets"]) for f in flows)


def flow_keys(flows):
    """Which flows these are, without their counters."""
    return {(f["cookie"], f.get("priority"), f.get("tp_src") or f.get("tcp_src"), f.get("tp_dst") or f.get("tcp_dst"),
             f.get("in_port")) for f in flows}


def entries_to(tb, port, proto=6):
    return [e for e in tb.conntrack() if e["dport"] == port and e["proto"] == proto]


def clean(tb, port):
    """The previous test's flows for this port gone: taken down by an operator flush rather
    than left to idle out (3 s after their connections' last packet)."""
    tb.control({"cmd": "flush", "reason": "the previous test's leftovers"})
    tb.wait_for(lambda: not tb.conn_flows(port), 15, f"flows of port {port} to go")


@pytest.mark.parametrize("udp", [False, True], ids=["tcp", "udp"])
def test_shunted_connection_bypasses_the_firewall(tb, udp):
    clean(tb, 5201)
    srv = server(tb, 5201)
    # The window below needs 5000 packets after the flows landed: TCP (unpaced) carries them
    # in a quarter of a second, UDP at 100 Mbit/s in 0.6 s.
    cli = client(tb, 5201, 3 if udp else 2, udp=udp)
    try:
        flows = tb.wait_for(lambda: [f for f in tb.conn_flows(5201)
                                     if (("udp" in f) if udp else ("tcp" in f))], 10, "shunt flows")
        assert len(flows) in (2, 4)  # iperf3's data connection, and its control one over TCP
        # To the peer fast port; a TCP shunt in the pipeline layout (OpenFlow 1.3 on Open
        # vSwitch) goes on to table 1, which outputs to the group its metadata names.
        assert all(f["actions"] in ("output:1", "output:3") or
                   (not udp and tb.of_version == "1.3" and f["actions"].startswith("write_metadata:")
                    and f["actions"].endswith(",goto_table:1")) for f in flows), flows
        assert all(int(f["cookie"], 16) >> 48 == 0x4E02 for f in flows)
        # A fixed wait: the packets queued on the slow path before the flows landed must have
        # drained before the window opens (their absence is what is measured next).
        time.sleep(0.5)
        slow0, c0 = tb.slow_path_packets(), counters(flows)

        def fast_counters():
            return counters([f for f in tb.conn_flows(5201) if (("udp" in f) if udp else ("tcp" in f))])
        # The window closes once the shunt carried 5000 packets more: the bridge may carry
        # fewer than 50 meanwhile.
        tb.wait_for(lambda: fast_counters()[-1] > c0[-1] + 5000, 5, "shunt flow counters to grow")
        slow1 = tb.slow_path_packets()
        assert slow1 - slow0 < 50, f"slow path kept carrying the connection: {slow1 - slow0} packets"
        proto = 17 if udp else 6
        tb.wait_for(lambda: not [e for e in entries_to(tb, 5201, proto) if e["state"] not in (7, 8)], 3,
                    "the shunted connection's conntrack entries to be deleted")
    finally:
        out, _ = cli.communicate(timeout=30)
        srv.wait(timeout=10)
    result = json.loads(out)
    assert "error" not in result, result.get("error")


def test_blocked_connection_stalls_with_drop_flows(tb):
    clean(tb, 5202)
    srv = server(tb, 5202)
    cli = client(tb, 5202, 2)
    try:
        flows = tb.wait_for(lambda: tb.conn_flows(5202), 10, "block flows")
        assert len(flows) in (2, 4) and all(f["actions"] == "drop" for f in flows)
        assert all(int(f["cookie"], 16) >> 48 == 0x4E03 for f in flows)
        # iperf3's data connection may open while the control one's flows are on their way;
        # until its own drop flows land it crosses the firewall like any accepted connection.
        # The window starts once every connection's entry has given way to its flows; if a
        # connection opens meanwhile (its first packets cross the firewall before its own drop
        # flows land), the window is measured again, over connections that all have flows.
        for _ in range(3):
            tb.wait_for(lambda: not entries_to(tb, 5202), 10, "every blocked entry replaced by drop flows")
            before = tb.conn_flows(5202)
            slow0, dropped0 = tb.slow_path_packets(), sum(counters(before))
            tb.wait_for(lambda d=dropped0: sum(counters(tb.conn_flows(5202))) > d, 10,
                        "retransmissions dropped by the switch")
            slow1, after = tb.slow_path_packets(), tb.conn_flows(5202)
            if flow_keys(after) == flow_keys(before):
                break
        assert slow1 - slow0 < 20
        try:  # the transfer cannot carry its data: it stalls, or iperf3 gives up with an error,
            # or (once the idle control connection's drop flows time out and its last exchange
            # is judged again, crossing the firewall until the new flows land) it ends with
            # little more than what crossed before the first drop flows (an open path: ~300 MB)
            out, _ = cli.communicate(timeout=3)  # an open path ends the 2 s transfer by then
            result = json.loads(out) if out.strip() else {"error": "no output"}
            assert "error" in result or result["end"]["sum_received"]["bytes"] < 10_000_000, \
                f"a blocked transfer carried its data: {result['end']['sum_received']}"
        except subprocess.TimeoutExpired:
            pass
    finally:
        cli.kill()
        srv.kill()
        cli.communicate()
        srv.wait()


def test_ignored_connection_stays_on_the_slow_path(tb):
    srv = server(tb, 5203)
    slow0 = tb.slow_path_packets()
    cli = client(tb, 5203, 1)
    out, _ = cli.communicate(timeout=30)
    srv.wait(timeout=10)
    sent = json.loads(out)["end"]["sum_sent"]["bytes"]
    assert tb.conn_flows(5203) == []
    assert tb.slow_path_packets() - slow0 > sent / 9000  # every segment crossed the bridge
    marks = [markcodec.decode(e["mark"]) for e in entries_to(tb, 5203)]
    assert marks and all((m.ingress, m.egress, m.action) == (1, 2, 0) for m in marks)


def test_ipv6_tcp(tb):
    clean(tb, 5201)
    srv = server(tb, 5201)
    cli = client(tb, 5201, 2, v6=True)
    try:
        if tb.of_version == "1.3":
            flows = tb.wait_for(lambda: [f for f in tb.conn_flows(5201) if "tcp6" in f], 10, "IPv6 shunt flows")
            assert len(flows) in (2, 4)
        else:
            tb.wait_for(lambda: "ipv6 needs openflow 1.3" in tb.controller_output(), 10,
                        "the controller to log why IPv6 stays on the slow path")
            assert tb.conn_flows(5201) == []
    finally:  # the transfer had only to run while it was looked at: not waited out (~1.5 s)
        cli.kill()
        srv.kill()
        cli.communicate()
        srv.wait()


def test_resumed_connection_is_shunted_again(tb):
    """A connection idle past the shunt timeout comes back through the slow path as a new
    conntrack entry (loose pickup) and is shunted again."""
    from nfshunt_testbed.bed import H2_IP, PYTHON
    clean(tb, 5201)
    srv = tb.h2.popen([PYTHON, "-c", ECHO_SERVER], stdout=subprocess.PIPE, text=True)
    wait_listening(tb, tb.h2, 5201)
    cli = tb.h1.popen([PYTHON, "-c", PAUSING_CLIENT, H2_IP], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                      text=True)
    try:
        tb.wait_for(lambda: tb.conn_flows(5201), 10, "first shunt")
        tb.wait_for(lambda: not tb.conn_flows(5201), 15, "the idle shunt to time out")
        cli.stdin.write("go\n")
        cli.stdin.flush()
        # (The kernel may give the new entry the old one's id, so cookies can repeat.)
        tb.wait_for(lambda: tb.conn_flows(5201), 10, "the resumed connection's shunt")
        assert cli.stdout.readline().strip() == "ok"
    finally:
        cli.kill()
        srv.kill()
        cli.wait()
        srv.wait()


ECHO_SERVER = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5201)); s.listen(1)
c, _ = s.accept()
while True:
    d = c.recv(65536)
    if not d: break
    c.sendall(d)
"""

PAUSING_CLIENT = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 5201))
for _ in range(10):
    s.sendall(b"x" * 1000); s.recv(65536); time.sleep(0.05)
sys.stdin.readline()
for _ in range(10):
    s.sendall(b"y" * 1000); s.recv(65536); time.sleep(0.05)
print("ok", flush=True)
"""
