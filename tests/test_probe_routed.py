"""`nfshunt probe-switch`'s routed shapes (nfshunt/probe_routed.py; the testbed's run against
Open vSwitch is tests/test_probe_routed_testbed.py): the recommendation for a switch that
refuses dec_ttl, one that drops invalid-TTL packet-ins and one that refuses NAT's
set_fields; the frame check; the invalid-TTL probe against a fake switch's packet-ins."""
from __future__ import annotations

import dataclasses
import queue
from types import SimpleNamespace
from typing import Any

import pytest
from os_ken.lib.packet import ethernet, ipv4, ipv6, packet, udp, vlan

from nfshunt import probe, probe_routed
from nfshunt.probe_routed import INVALID_TTL, IPV6, NAT, REWRITE, Finding, Support
from nfshunt.records.model import TCP, UDP
from tests.support import fakeswitch as fs
from tests.test_probe_shapes import _prober

OK = Finding(Support.SUPPORTED)


def _verdict(found: dict[str, Finding]) -> probe.Report:
    report = probe.Report()
    probe_routed.verdict(report, found)
    return report


def test_a_switch_that_refuses_dec_ttl_is_refused_routed_mode_saying_why():
    report = _verdict({REWRITE: Finding(Support.REFUSED, "TCP pair refused (error type 4 code 3)"),
                       NAT: Finding(Support.REFUSED, "TCP pair refused (error type 4 code 3)"), INVALID_TTL: OK})
    assert not report.ok and report.settings["experimental_routed"] is False
    (line,) = report.lines  # (nothing of NAT: its flows begin with the refused rewrite)
    assert line.startswith("routed mode: refused on this switch: a shunted frame would leave without the router's "
                           "rewrite") and "error type 4 code 3" in line and "time exceeded" not in line


def test_a_switch_that_drops_invalid_ttl_packet_ins_is_refused_routed_mode_saying_why():
    report = _verdict({REWRITE: OK, NAT: OK,
                       INVALID_TTL: Finding(Support.WRONG, "no packet-in within 3 s: the switch dropped the frame")})
    assert not report.ok and report.settings["experimental_routed"] is False
    (line,) = [line for line in report.lines if line.startswith("routed mode:")]
    assert "ICMP time exceeded" in line and "accepted but wrong: no packet-in within 3 s" in line
    assert "router's rewrite (" not in line


def test_a_switch_that_refuses_nat_set_fields_keeps_routed_mode_and_says_nat_stays_on_the_firewall():
    report = _verdict({REWRITE: OK, NAT: Finding(Support.REFUSED, "TCP pair refused (error type 2 code 4)"),
                       INVALID_TTL: OK, IPV6: OK})
    assert report.ok and "experimental_routed" not in report.settings
    assert "routed mode: supported (the router's rewrite, invalid-TTL packet-ins)" in report.lines
    (line,) = [line for line in report.lines if line.startswith("NAT shunts:")]
    assert "refused: TCP pair refused (error type 2 code 4)" in line and "NAT connections stay on the firewall" in line
    assert "not a reason to refuse routed mode" in line


def test_a_switch_that_takes_nat_set_fields_and_rewrites_wrongly_is_warned_of():
    report = _verdict({REWRITE: OK, NAT: Finding(Support.WRONG, "UDP: came back with UDP checksum wrong"),
                       INVALID_TTL: OK, IPV6: OK})
    (line,) = [line for line in report.lines if line.startswith("NAT shunts:")]
    assert line.startswith("NAT shunts: WRONG (accepted but wrong: UDP: came back with UDP checksum wrong)")
    assert "keep them there by policy" in line


def test_a_switch_that_does_all_four_is_recommended_routed_mode():
    report = _verdict({REWRITE: OK, NAT: OK, INVALID_TTL: OK, IPV6: OK})
    assert report.ok and report.settings == {}
    assert report.lines == ["routed mode: supported (the router's rewrite, invalid-TTL packet-ins)",
                            "NAT shunts: supported (addresses and ports rewritten, checksums fixed)",
                            "IPv6 routed shunts: supported (the hop limit one lower, the next hop's MACs, an "
                            "expiring one to the firewall)"]


@pytest.mark.parametrize("support, says", [
    (Support.REFUSED, "IPv6 connections stay on the firewall"),
    (Support.WRONG, "keep them there by policy (do not shunt IPv6 connections)"),
])
def test_a_switch_without_the_ipv6_rewrite_keeps_routed_mode_and_says_what_happens_to_ipv6(support, says):
    report = _verdict({REWRITE: OK, NAT: OK, INVALID_TTL: OK, IPV6: Finding(support, "UDP: came back with ttl 64")})
    assert report.ok and "experimental_routed" not in report.settings
    (line,) = [line for line in report.lines if line.startswith("IPv6 routed shunts:")]
    assert says in line and "came back with ttl 64" in line


def _out(proto: int = UDP, ttl: int = 63, src: str = "02:00:5e:00:53:b1", break_ip: bool = False,
         break_l4: bool = False) -> bytes:
    """The probe frame as a switch doing the router's rewrite sends it on (checksums redone)."""
    pkt = packet.Packet(probe_routed.frame(proto, 40300, 64))
    eth, ip = pkt.get_protocol(ethernet.ethernet), pkt.get_protocol(ipv4.ipv4)
    eth.src, eth.dst, ip.ttl, ip.csum = src, "02:00:5e:00:53:b2", ttl, 0
    for p in pkt.protocols:
        if hasattr(p, "csum") and p is not ip:
            p.csum = 0
    pkt.serialize()
    data = bytearray(pkt.data)
    if break_ip:
        data[24] ^= 0xFF
    if break_l4:
        data[data.index(b"nfshunt probe")] ^= 0xFF  # the payload: its checksum no longer covers it
    return bytes(data)


WANT = probe_routed.Expect("02:00:5e:00:53:b1", "02:00:5e:00:53:b2", 63, "198.51.100.1", probe.PROBE_DST, 40300, 9)


@pytest.mark.parametrize("proto", [UDP, TCP])
def test_the_frame_check_passes_the_router_s_rewrite_and_names_each_thing_wrong(proto):
    assert probe_routed.problem(_out(proto), WANT) is None
    assert probe_routed.problem(_out(proto, ttl=64), WANT) == "came back with ttl 64 (want 63)"
    assert probe_routed.problem(_out(proto, src=probe_routed.SENT_SRC), WANT) == \
        f"came back with eth_src {probe_routed.SENT_SRC} (want 02:00:5e:00:53:b1)"
    assert probe_routed.problem(_out(proto, break_ip=True), WANT) == "came back with IPv4 header checksum wrong"
    assert probe_routed.problem(_out(proto, break_l4=True), WANT) == \
        f"came back with {'UDP' if proto == UDP else 'TCP'} checksum wrong"
    assert probe_routed.problem(b"\x00" * 20, WANT) == "came back not an IP TCP/UDP frame"


def _invalid_ttl(monkeypatch: Any, answer: Any, family: int = 4) -> tuple[Finding, Any]:
    """probe_routed.invalid_ttl against the fake switch, whose packet-outs `answer` turns
    into packet-ins (or none) given the frame sent and the cookie of the flow it went through."""
    monkeypatch.setattr(probe_routed, "FRAME_WAIT", 0.3)
    prober, switch = _prober()
    prober.app.frames = queue.Queue()
    real = switch.receive

    def receive(msg_type: int, xid: int, buf: bytes) -> None:
        if msg_type != switch.ofproto.OFPT_PACKET_OUT:
            return real(msg_type, xid, buf)
        flow = next(e for e in switch.entries if e.cookie & ~0xFF == probe.FRAME_COOKIES)
        got = answer(buf[-len(probe_routed.frame(UDP, 40399, 1, family)):], flow.cookie)  # (the message's tail)
        if got is not None:
            prober.app.frames.put(got)
    switch.receive = receive
    finding = probe_routed.invalid_ttl(prober, family)
    prober.delete_probe_flows()
    assert switch.entries == [] and switch.asked[fs.ASYNC] == (family == 4)  # the set_async once, with IPv4's
    return finding, switch


def test_an_ipv6_frame_of_hop_limit_1_is_checked_as_an_ipv4_one_of_ttl_1(monkeypatch):
    came_back = []

    def answer(data, cookie):
        came_back.append(data)
        return SimpleNamespace(cookie=cookie, reason=2, data=data)
    assert _invalid_ttl(monkeypatch, answer, family=6)[0] == OK
    assert packet.Packet(came_back[0]).get_protocol(ipv6.ipv6).hop_limit == 1
    dropped, _ = _invalid_ttl(monkeypatch, lambda data, cookie: None, family=6)
    assert dropped.support is Support.WRONG and "dropped the expiring frame" in dropped.detail


def test_invalid_ttl_supported_when_the_expiring_frame_comes_back_as_it_arrived_with_the_flow_s_cookie(monkeypatch):
    finding, _ = _invalid_ttl(monkeypatch, lambda data, cookie: SimpleNamespace(cookie=cookie, reason=2, data=data))
    assert finding == OK


def test_a_switch_that_drops_the_expiring_frame_is_accepted_but_wrong(monkeypatch):
    finding, _ = _invalid_ttl(monkeypatch, lambda data, cookie: None)
    assert finding.support is Support.WRONG and "dropped the expiring frame" in finding.detail


def test_a_switch_that_forwards_the_expiring_frame_is_accepted_but_wrong(monkeypatch):
    def forwarded(data: bytes, cookie: int) -> Any:
        pkt = packet.Packet(data)
        pkt.get_protocol(ipv4.ipv4).ttl, pkt.get_protocol(ipv4.ipv4).csum = 0, 0
        pkt.get_protocol(udp.udp).csum = 0
        pkt.serialize()
        return SimpleNamespace(cookie=cookie, reason=1, data=bytes(pkt.data))
    finding, _ = _invalid_ttl(monkeypatch, forwarded)
    assert finding.support is Support.WRONG
    assert finding.detail.startswith("packet-in reason 1, not INVALID_TTL (2)") and "(TTL 0)" in finding.detail


def test_a_switch_that_refuses_dec_ttl_is_refused_the_rewrite_naming_the_error_and_keeps_nothing():
    dec_ttl = b"\x00\x18\x00\x08\x00\x00\x00\x00"  # OFPAT_DEC_NW_TTL as the flow-mod carries it
    prober, switch = _prober(refuse=lambda e: dec_ttl in e.raw)
    found = probe_routed.rewrite_and_nat(prober)
    # (the fake refuses as OFPET_BAD_MATCH / OFPBMC_BAD_FIELD: whatever it says is named)
    assert found[REWRITE] == Finding(Support.REFUSED, "TCP pair refused (error type 4 code 6)")
    assert found[NAT].support is Support.REFUSED  # (its flows begin with dec_ttl too)
    assert found[IPV6] == Finding(Support.REFUSED, "UDP pair refused (error type 4 code 6)")
    prober.delete_probe_flows()
    assert switch.entries == []


def _out6(hop_limit: int = 63, src: str = "02:00:5e:00:53:b1", break_l4: bool = False) -> bytes:
    """The IPv6 probe frame as a switch doing the router's rewrite sends it on."""
    pkt = packet.Packet(probe_routed.frame(UDP, 40306, 64, family=6))
    eth, ip = pkt.get_protocol(ethernet.ethernet), pkt.get_protocol(ipv6.ipv6)
    eth.src, eth.dst, ip.hop_limit = src, "02:00:5e:00:53:b2", hop_limit
    pkt.get_protocol(udp.udp).csum = 0
    pkt.serialize()
    data = bytearray(pkt.data)
    if break_l4:
        data[data.index(b"nfshunt probe")] ^= 0xFF
    return bytes(data)


def test_the_frame_check_reads_an_ipv6_frame_s_hop_limit_and_checksum():
    want = probe_routed.Expect("02:00:5e:00:53:b1", "02:00:5e:00:53:b2", 63, probe_routed.SRC6, probe_routed.DST6,
                               40306, 9)
    assert probe_routed.problem(_out6(), want) is None
    assert probe_routed.problem(_out6(hop_limit=64), want) == "came back with ttl 64 (want 63)"
    assert probe_routed.problem(_out6(break_l4=True), want) == "came back with UDP checksum wrong"
    assert probe_routed.problem(probe_routed.frame(UDP, 40306, 64, family=6), want) == \
        f"came back with eth_src {probe_routed.SENT_SRC} (want 02:00:5e:00:53:b1), eth_dst {probe_routed.SENT_DST} " \
        "(want 02:00:5e:00:53:b2), ttl 64 (want 63)"


def test_the_frame_check_reads_a_tagged_frame_and_names_a_wrong_tag():
    """Shape 5's frame (docs/routed.md, "VLAN trunks"): the tag is checked beside the rest."""
    sent = probe_routed.frame(UDP, 40300, 64, vid=100)
    pkt = packet.Packet(sent)
    eth, tag, ip = pkt.get_protocol(ethernet.ethernet), pkt.get_protocol(vlan.vlan), pkt.get_protocol(ipv4.ipv4)
    eth.src, eth.dst, ip.ttl, ip.csum, tag.vid = "02:00:5e:00:53:b1", "02:00:5e:00:53:b2", 63, 0, 200
    pkt.get_protocol(udp.udp).csum = 0
    pkt.serialize()
    want = dataclasses.replace(WANT, vid=200)
    assert probe_routed.problem(bytes(pkt.data), want) is None
    assert probe_routed.problem(bytes(pkt.data), dataclasses.replace(WANT, vid=300)) == \
        "came back with vid 200 (want 300)"
    assert probe_routed.problem(_out(UDP), want) == "came back with vid 0 (want 200)"


def test_a_trunk_shape_that_fails_refuses_routed_mode_and_one_that_passes_is_said():
    why = probe_routed.WHY[probe_routed.TRUNK]
    report = _verdict({REWRITE: OK, NAT: OK, INVALID_TTL: OK, IPV6: OK,
                       probe_routed.TRUNK: Finding(Support.WRONG, "came back with vid 100 (want 200)")})
    assert not report.ok and report.settings["experimental_routed"] is False
    (line,) = [line for line in report.lines if line.startswith("routed mode:")]
    assert why in line and "vid 100 (want 200)" in line
    report = _verdict({REWRITE: OK, NAT: OK, INVALID_TTL: OK, IPV6: OK, probe_routed.TRUNK: OK})
    assert report.ok and "routed mode: supported (the router's rewrite, invalid-TTL packet-ins, between the " \
                         "config's VLANs)" in report.lines


def test_a_one_trunk_router_on_a_stick_is_probed_not_refused_for_want_of_two_groups(monkeypatch):
    """A single trunk whose VLANs the firewall routes between: its shapes run (their pairs in
    and out of one port), the trunk shape among them; the verdict stands on what they found."""
    from tests.helpers import config
    cfg = config(forwarding="routed", openflow_versions=["1.3"], experimental_routed=True,
                 ports=[{"fast": 1, "slow": 2, "physdevin": 1, "untagged": False,
                         "vlans": [{"id": 100, "physdevin": 3, "interface": "fw-eth0.100"},
                                   {"id": 300, "physdevin": 5, "interface": "fw-eth0.300"}]}])
    fake, _ = _prober()
    prober = probe.Prober(fake.app, fake.dp, cfg, cfg.switches[0])
    ran = []
    monkeypatch.setattr(probe_routed, "rewrite_and_nat", lambda _p: ran.append("rewrite") or
                        {REWRITE: OK, NAT: OK, IPV6: OK})
    monkeypatch.setattr(probe_routed, "invalid_ttl", lambda _p, family=4: ran.append(f"ttl{family}") or OK)
    monkeypatch.setattr(probe_routed, "trunk", lambda _p, sides: ran.append(tuple(s.vid for s in sides)) or OK)
    monkeypatch.setattr(probe_routed, "first_fragment", lambda _p: ran.append("fragment") or OK)
    found = probe_routed.routed_shapes(prober, probe.Report())
    assert ran == ["rewrite", "ttl4", "fragment", (100, 300), "ttl6"] and found[probe_routed.TRUNK] == OK
    report = _verdict(found)
    assert report.ok and "experimental_routed" not in report.settings


@pytest.mark.parametrize("by,support", [("addresses", Support.SUPPORTED), ("ports", Support.WRONG),
                                        (None, Support.WRONG)])
def test_a_first_fragment_must_miss_the_shunt_s_ports_and_come_back_by_its_addresses(monkeypatch, by, support):
    """Shape 5: the switch's packet-in for the first fragment names which probe flow matched it
    (the fake switch does no matching: the test answers as each kind of switch would)."""
    monkeypatch.setattr(probe_routed, "FRAME_WAIT", 0.3)
    prober, switch = _prober()
    prober.app.frames = queue.Queue()
    real = switch.receive
    sent = []

    def receive(msg_type: int, xid: int, buf: bytes) -> None:
        if msg_type != switch.ofproto.OFPT_PACKET_OUT:
            return real(msg_type, xid, buf)
        sent.append(buf[-len(probe_routed.fragment(40320)):])
        flows = {e.cookie & 0xFF: e.cookie for e in switch.entries if e.cookie & ~0xFF == probe.FRAME_COOKIES}
        if by is not None:
            prober.app.frames.put(SimpleNamespace(cookie=flows[11 if by == "ports" else 12], reason=1, data=sent[-1]))
    switch.receive = receive
    finding = probe_routed.first_fragment(prober)
    prober.delete_probe_flows()
    assert finding.support is support, finding
    ip = packet.Packet(sent[0]).get_protocol(ipv4.ipv4)
    assert (ip.flags, ip.offset) == (0b001, 0)  # more fragments, the first
    assert switch.entries == []
