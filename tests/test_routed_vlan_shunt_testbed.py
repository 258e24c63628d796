"""Shunts through a routing firewall on VLAN trunks (docs/routed.md, "VLAN trunks"), on the
testbed's mode "routed" with vlan=True and experimental_routed: a connection is shunted with the
router's rewrite and the egress VLAN's tag, between the trunks to the other fast port (h1 on
VLAN 100 -> h2 on VLAN 200), and on one trunk back out of the port it came in by (a router on a
stick: h1 -> h3 on VLAN 300, OFPP_IN_PORT). The slow path of the same bed:
tests/test_routed_vlan_testbed.py."""
from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.beds import Bed
from tests.test_routed_shunt_testbed import FRAME, _forwarded, ttl_expired_answer
from tests.test_static_routed_testbed import stream_at_h2
from tests.test_static_testbed import FRAMES

pytestmark = [pytest.mark.integration, pytest.mark.testbed, pytest.mark.second_bed]

STATIC_PORT, STATIC_CPORT = 34964, 40000
# h1 (VLAN 100) -> h2: h2's group routes one interface (VLAN 200), so vlan_out is left out.
STREAM = {"name": "plc-vlan", "protocol": "udp", "src": "10.0.1.1", "dst": "10.0.2.1", "dst_port": STATIC_PORT,
          "fast_ports": [1, 3], "vlan": 100, "via": "table"}
TESTBED = Bed(mode="routed", vlan=True, config={"experimental_routed": True, "static_shunts": [STREAM]})
SHUNT = 5201
H3_IP = "10.0.3.1"


def _mac(tb, node, intf: str) -> str:
    return json.loads(tb.run(node, "ip", "-j", "link", "show", intf))[0]["address"]


def _routed_pair(tb, dst: str, vids: tuple[int, int], ports: tuple[int, int]) -> list[dict[str, str]] | None:
    """The data connection's two rewriting flows to and from `dst` (in by ports[0] on vids[0],
    in by ports[1] on vids[1]) once its forward flow has carried the transfer, or None.
    (iperf3's control connection to the same port is a pair of its own, of a few packets; an
    earlier transfer's pair to another host may still be there, idle.)"""
    flows = [f for f in tb.conn_flows(SHUNT) if "dec_ttl" in f["actions"]]
    pair = []
    for vid, port, side in zip(vids, ports, ("nw_dst", "nw_src"), strict=True):
        found = [f for f in flows if f.get("in_port") == str(port) and f.get("dl_vlan") == str(vid)
                 and f.get(side) == dst]
        if not found:
            return None
        pair.append(max(found, key=lambda f: int(f.get("n_packets", "0"))))
    return pair if int(pair[0].get("n_packets", "0")) > 100 else None


def _retags(flow: dict[str, str], vid: int) -> bool:
    return f"mod_vlan_vid:{vid}" in flow["actions"] or f"set_field:{0x1000 | vid}->vlan_vid" in flow["actions"]


def _shunted(tb, server, dst: str, vids: tuple[int, int], ports: tuple[int, int]) -> list[dict[str, str]]:
    """An iperf3 transfer h1 -> server (about 2 s); its routed pair, polled while it runs."""
    from nfshunt_testbed.traffic import STEADY_RATE
    srv, cli = tb.start_transfer(SHUNT, 2, server=server, dst=dst, bitrate=STEADY_RATE)
    try:
        pair = tb.wait_for(lambda: _routed_pair(tb, dst, vids, ports), 10, f"the routed shunt of VLANs {vids}")
    finally:
        result = tb.finish_transfer(srv, cli)
    assert "error" not in result, result
    return pair


def test_a_transfer_is_shunted_between_the_trunks_and_on_one_trunk(tb):
    from nfshunt_testbed.bed import FAST1, FAST2
    h3 = tb.host("h3")
    mac = {name: _mac(tb, node, name) for node, name in (
        (tb.h1, "h1-eth0"), (tb.h2, "h2-eth0"), (h3, "h3-eth0"),
        (tb.fw, "fw-eth0.100"), (tb.fw, "fw-eth1.200"), (tb.fw, "fw-eth0.300"))}
    # Between the trunks: VLAN 100 in by FAST1 leaves FAST2 in VLAN 200, and back.
    fwd, rev = _shunted(tb, tb.h2, tb.h2_ip, (100, 200), (FAST1, FAST2))
    assert _retags(fwd, 200) and f"output:{FAST2}" in fwd["actions"], fwd
    assert _retags(rev, 100) and f"output:{FAST1}" in rev["actions"], rev
    for flow, src, dst in ((fwd, "fw-eth1.200", "h2-eth0"), (rev, "fw-eth0.100", "h1-eth0")):
        assert f"set_field:{mac[src]}->eth_src" in flow["actions"], flow
        assert f"set_field:{mac[dst]}->eth_dst" in flow["actions"], flow
    # A router on a stick: VLAN 100 in by FAST1 leaves by the same port in VLAN 300, and back.
    fwd, rev = _shunted(tb, h3, H3_IP, (100, 300), (FAST1, FAST1))
    assert _retags(fwd, 300) and "IN_PORT" in fwd["actions"], fwd
    assert _retags(rev, 100) and "IN_PORT" in rev["actions"], rev
    for flow, src, dst in ((fwd, "fw-eth0.300", "h3-eth0"), (rev, "fw-eth0.100", "h1-eth0")):
        assert f"set_field:{mac[src]}->eth_src" in flow["actions"], flow
        assert f"set_field:{mac[dst]}->eth_dst" in flow["actions"], flow


@pytest.mark.parametrize("host", ["h2", "h3"])  # across the trunks; on one trunk (the stick)
def test_a_shunted_transfer_s_frames_reach_the_host_with_the_router_s_macs_and_a_ttl_one_lower(tb, host):
    """Read at the receiving host (its access switch took the VLAN's tag off): every data frame
    of the shunted transfer has the router's sub-interface's MAC as source, the host's as
    destination, TTL 63; the firewall's kernel routed next to none of them."""
    from nfshunt_testbed.traffic import STEADY_RATE
    node = tb.host(host)
    dst_ip, router = (tb.h2_ip, "fw-eth1.200") if host == "h2" else (H3_IP, "fw-eth0.300")
    router_mac, host_mac = _mac(tb, tb.fw, router), _mac(tb, node, f"{host}-eth0")
    srv, cli = tb.start_transfer(SHUNT, 60, server=node, dst=dst_ip, bitrate=STEADY_RATE)
    try:
        tb.wait_for(lambda: [f for f in tb.conn_flows(SHUNT) if "dec_ttl" in f["actions"]], 10,
                    "the routed shunt's flows")
        tb.wait_for(lambda: _quiet(tb), 5, "the firewall to route nothing of the transfer for 0.2 s")
        forwarded0 = _forwarded(tb)
        cap = node.popen(["timeout", "5", "tcpdump", "-l", "-nn", "-e", "-v", "-c", "300", "-i", f"{host}-eth0",
                          "tcp", "and", "src", "host", tb.h1_ip, "and", "dst", "port", str(SHUNT)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        out, _ = cap.communicate(timeout=10)
        forwarded = _forwarded(tb) - forwarded0
    finally:
        result = tb.stop_transfer(srv, cli)
    assert "error" not in result, result
    frames = [m.groups() for m in map(FRAME.match, out.splitlines()) if m]
    assert len(frames) >= 100, out[-2000:]
    assert set(frames) == {(router_mac, host_mac, "63")}, set(frames)
    assert forwarded < len(frames) / 10, f"the firewall routed {forwarded} datagrams while {host} got {len(frames)}"


def _quiet(tb) -> bool:
    """The firewall routed nothing for 0.2 s (what it had queued when the flows went in is out)."""
    before = _forwarded(tb)
    time.sleep(0.2)
    return _forwarded(tb) == before


def test_a_shunted_datagram_whose_ttl_expires_on_a_trunk_is_answered_by_the_vlan_s_gateway(tb):
    """The traceroute rule through a VLAN: the expiring frame reaches the controller as it
    arrived (tagged 100) and goes to the firewall by the trunk's slow port, where fw-eth0.100
    answers ICMP time exceeded from its own address."""
    assert ttl_expired_answer(tb) == {"origin": 2, "type": 11, "code": 0, "offender": "10.0.1.254"}


def test_a_static_stream_over_routed_vlans_reaches_h2_retagged_with_the_router_s_rewrite(tb):
    """A static stream (no conntrack event) from VLAN 100 to VLAN 200: its flows match h1's
    tag, do the router's rewrite and put h2's VLAN's tag on; every datagram is echoed back by
    the reverse flow, and h2 gets each with fw-eth1.200's MAC and TTL 63."""
    router, h2 = _mac(tb, tb.fw, "fw-eth1.200"), _mac(tb, tb.h2, "h2-eth0")

    def flows():
        found = [f for f in tb.flows() if int(f["cookie"], 16) >> 48 == 0x4E06 and "dec_ttl" in f["actions"]]
        return found if len(found) == 2 else None
    forward = next(f for f in tb.wait_for(flows, 10, "the static stream's routed flows") if f["in_port"] == "1")
    assert forward.get("dl_vlan") == "100" and _retags(forward, 200), forward
    assert f"set_field:{router}->eth_src" in forward["actions"] and f"set_field:{h2}->eth_dst" in forward["actions"]
    result, frames, _ = stream_at_h2(tb, STATIC_PORT, STATIC_CPORT)
    assert (result["sent"], result["echoed"]) == (FRAMES, FRAMES), result
    assert len(frames) == FRAMES and set(frames) == {(router, h2, "63")}, set(frames)
