"""Routed shunts in the pipeline flow layout on the real switch (flow_layout "pipeline",
asked for: `auto` stays single in routed mode): the table-0 flows apply the router's rewrite
and go on to table 1, which outputs and catches the close. The frames h2 receives carry the
router's MAC and TTL 63, and the transfer's end takes the shunt down through table 1's catchers."""
from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.beds import Bed

pytestmark = [pytest.mark.integration, pytest.mark.testbed, pytest.mark.second_bed]

TESTBED = Bed(mode="routed", config={"experimental_routed": True, "flow_layout": "pipeline"})
SHUNT = 5201
FRAME = re.compile(r"^\S+ (\S+) > (\S+), ethertype IPv4 \(0x0800\), length \d+: \(tos \S+, ttl (\d+),")


def _routed(tb) -> list[dict[str, str]]:
    """The routed pairs' table-0 flows (the router's rewrite in them)."""
    return [f for f in tb.conn_flows(SHUNT) if "dec_ttl" in f["actions"]]


def _mac(tb, node, intf: str) -> str:
    return json.loads(tb.run(node, "ip", "-j", "link", "show", intf))[0]["address"]


def test_a_pipeline_routed_shunt_rewrites_in_table_0_and_ends_with_its_connection(tb):
    from nfshunt_testbed.traffic import STEADY_RATE
    router, h2 = _mac(tb, tb.fw, "fw-eth1"), _mac(tb, tb.h2, "h2-eth0")
    srv, cli = tb.start_transfer(SHUNT, 60, bitrate=STEADY_RATE)
    try:
        # (iperf3's control and data connections: two pairs, a table-0 flow each way)
        flows = tb.wait_for(lambda: _routed(tb) if len(_routed(tb)) == 4 else None, 10, "the routed shunts' flows")
        cap = tb.h2.popen(["timeout", "5", "tcpdump", "-l", "-nn", "-e", "-v", "-c", "200", "-i", "h2-eth0",
                           "tcp", "and", "src", "host", tb.h1_ip, "and", "dst", "port", str(SHUNT)],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        out, _ = cap.communicate(timeout=10)
        frames = [m.groups() for m in map(FRAME.match, out.splitlines()) if m]
        # The switch carried them (the slow path would deliver the same rewrite): its counters trail its datapath.
        tb.wait_for(lambda: sum(int(f["n_packets"]) for f in _routed(tb) if f.get("in_port") == "1") >= len(frames), 5,
                    "the pairs' counters to count the frames")
    finally:
        result = tb.stop_transfer(srv, cli)
    assert "error" not in result, result
    assert "pipeline flow layout: TCP shunts go on to table 1" in tb.controller_output(since_start=True)
    # Each direction: one table-0 flow (no catchers of its own), the rewrite, then table 1.
    assert all("goto_table:1" in f["actions"] and "CONTROLLER" not in f["actions"] for f in flows), flows
    assert len(frames) >= 100, out[-2000:]
    assert set(frames) == {(router, h2, "63")}, set(frames)
    # iperf3's end closes both connections: table 1's catchers tell the controller, which ends the shunts.
    tb.wait_for(lambda: not tb.conn_flows(SHUNT), 10, "the shunts to end with their connections")
    counters = tb.control({"cmd": "status", "connections": False})["counters"]
    assert counters.get("teardowns", 0) >= 1, counters
