"""Several switches served by one controller (issue 13.5), on the real testbed: two Open
vSwitch bridges cabled to one firewall bridge. A connection's flows go to the switch whose
port groups it crossed; one that crosses both switches stays on the firewall; a switch
that goes away leaves the other one's shunts alone and is reconciled when it returns."""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.beds import Bed

pytestmark = [pytest.mark.integration, pytest.mark.testbed, pytest.mark.second_bed]
SHUNT = 5201
N = 3


TESTBED = Bed(mode="two-switch", config={"default_shunt_timeout": 60})


def _client_ports(flows: list[dict[str, str]]) -> set[int]:
    """The client ports of a switch's shunt flows (the side that is not the server's)."""
    ports = set()
    for f in flows:
        for key in ("tp_src", "tp_dst", "tcp_src", "tcp_dst"):
            if key in f and int(f[key]) != SHUNT:
                ports.add(int(f[key]))
    return ports


def _close(*procs: subprocess.Popen) -> None:
    for proc in procs:
        proc.stdin.write("close\n")
        proc.stdin.flush()


def test_each_connection_is_shunted_on_the_switch_it_crossed(tb):
    from nfshunt_testbed.bed import H2_IP, H4_IP
    h3, h4 = tb.hosts[2], tb.hosts[3]
    servers = [tb.conn_server(SHUNT), tb.conn_server(SHUNT, node=h4)]
    procs = []
    try:
        on_s1, _ = tb.open_conns(SHUNT, N, cport_base=41001, dst=H2_IP)
        on_s2, _ = tb.open_conns(SHUNT, N, cport_base=42001, dst=H4_IP, src=h3)
        crossing, _ = tb.open_conns(SHUNT, 2, cport_base=43001, dst=H4_IP)  # h1 (s1) -> h4 (s2)
        procs = [on_s1, on_s2, crossing]
        tb.wait_for(lambda: len(tb.conn_flows(SHUNT, "s1")) == 2 * N and len(tb.conn_flows(SHUNT, "s2")) == 2 * N,
                    15, f"{N} shunts on each switch", interval=0.2)
        assert _client_ports(tb.conn_flows(SHUNT, "s1")) == {41001 + i for i in range(N)}
        assert _client_ports(tb.conn_flows(SHUNT, "s2")) == {42001 + i for i in range(N)}
        st = json.loads(tb.nfshunt("status", "--json", "--socket", tb.firewalls[0].control_socket))
        by_dpid = {sw["datapath_id"]: sw for sw in st["switches"]}
        assert set(by_dpid) == {"00000000000000a1", "00000000000000a2"}
        assert all(sw["connected"] and sw["shunts"] == N for sw in by_dpid.values()), by_dpid
        assert st["shunts"] == 2 * N
        # The crossing connections have no fast path: they stay on the firewall, said why.
        assert st["counters"].get("ignored:crosses two switches", 0) >= 2, st["counters"]
        crossing_conns = [c for c in st["connections"] if c["sport"] in (43001, 43002)]
        assert crossing_conns == []
        assert {c["datapath_id"] for c in st["connections"] if c["sport"] in range(41001, 41001 + N)} == \
            {"00000000000000a1"}
        text = tb.nfshunt("status", "--socket", tb.firewalls[0].control_socket)
        assert "switch 00000000000000a1: connected dpid 00000000000000a1" in text
        assert "switch 00000000000000a2: connected dpid 00000000000000a2" in text and f"shunts {N}" in text
        # Clean closes end the shunts on both switches through their own catchers.
        _close(*procs)
        tb.wait_for(lambda: not tb.conn_flows(SHUNT, "s1") and not tb.conn_flows(SHUNT, "s2"), 10,
                    "every shunt gone from both switches", interval=0.2)
        for proc, n in zip(procs, (N, N, 2), strict=True):  # the peer's FIN came back on every connection
            assert proc.stdout.readline().split()[:3] == ["closed", str(n), "0"]
    finally:
        for proc in procs + servers:
            proc.kill()


def test_a_switch_that_goes_away_leaves_the_other_ones_shunts_alone(tb):
    from nfshunt_testbed.bed import H2_IP, H4_IP
    h3, h4 = tb.hosts[2], tb.hosts[3]
    servers = [tb.conn_server(SHUNT), tb.conn_server(SHUNT, node=h4)]
    procs = []
    target = subprocess.run(["ovs-vsctl", "get-controller", "s2"], check=True, capture_output=True,
                            text=True).stdout.split()
    try:
        on_s1, _ = tb.open_conns(SHUNT, N, cport_base=44001, dst=H2_IP)
        on_s2, _ = tb.open_conns(SHUNT, N, cport_base=45001, dst=H4_IP, src=h3)
        procs = [on_s1, on_s2]
        tb.wait_for(lambda: len(tb.conn_flows(SHUNT, "s1")) == 2 * N and len(tb.conn_flows(SHUNT, "s2")) == 2 * N,
                    15, f"{N} shunts on each switch", interval=0.2)
        s1_before = tb.conn_flows(SHUNT, "s1")
        log_at = len(tb.controller_output())
        subprocess.run(["ovs-vsctl", "del-controller", "s2"], check=True)
        # Watched in the log, not asked for: a status request would wake the event loop.
        tb.wait_for(lambda: "switch 00000000000000a2 disconnected" in tb.controller_output()[log_at:], 10,
                    "the controller to notice s2 is gone")
        st = tb.control({"cmd": "status", "connections": False})
        a1, a2 = st["switches"]
        assert a1["connected"] and a1["shunts"] == N
        assert not a2["connected"]
        assert [f["cookie"] for f in tb.conn_flows(SHUNT, "s1")] == [f["cookie"] for f in s1_before]
        log_at = len(tb.controller_output())
        subprocess.run(["ovs-vsctl", "set-controller", "s2", *target], check=True)
        tb.wait_for(lambda: "reconciled with switch 00000000000000a2" in tb.controller_output()[log_at:], 20,
                    "s2 back and reconciled")
        st = tb.control({"cmd": "status", "connections": False})
        assert [sw["shunts"] for sw in st["switches"]] == [N, N]  # s2's pairs held (its flows stayed: fail secure)
        assert len(tb.conn_flows(SHUNT, "s2")) == 2 * N
        _close(*procs)
        tb.wait_for(lambda: not tb.conn_flows(SHUNT, "s1") and not tb.conn_flows(SHUNT, "s2"), 10,
                    "every shunt gone from both switches", interval=0.2)
    finally:
        subprocess.run(["ovs-vsctl", "set-controller", "s2", *target], capture_output=True)
        for proc in procs + servers:
            proc.kill()
