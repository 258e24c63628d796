"""`nfshunt probe-switch`'s routed shapes (issue 38 item 3), run when the probed switch's
`forwarding` is `routed`: what a routing firewall's shunts need of the switch, each
installed as the controller builds it, then a probe frame sent through it by packet-out into
the table and read back from a packet-in (the flow ends in output to the controller in
place of the peer port, so no frame leaves the switch):

1. the router's rewrite (openflow/flows.routed_actions: dec_ttl first, set_field eth_src and
   eth_dst): the frame must come back with the next hop's MACs and its TTL one lower;
2. NAT's set_fields on the addresses and the TCP/UDP ports (flows.nat_actions), with the
   checksums still right;
3. invalid-TTL packet-ins: with the controller's OFPT_SET_ASYNC, a TTL-1 frame through the
   dec_ttl flow must reach the controller as a packet-in of reason INVALID_TTL carrying the
   flow's cookie and the frame as it arrived;
4. the router's rewrite of an IPv6 pair: the frame must come back with the next hop's MACs
   and its hop limit one lower, and one of hop limit 1 as an INVALID_TTL packet-in, as in 3;
5. a first fragment (MF set, offset 0: the UDP header inside) of a datagram to a shunted
   tuple: it must miss the flow that matches the tuple's ports and come back by a flow that
   matches its addresses alone (a switch that matched a first fragment's ports would shunt it
   while the firewall waits to reassemble the rest: the datagram lost);
6. with routed VLANs in the config (docs/routed.md, "VLAN trunks"): the rewrite and the retag
   in one flow, from one of its interfaces' tags to another's (a pair built as the controller
   builds it between them): the frame must come back with the next hop's MACs, its TTL one
   lower and the egress interface's tag.

Without 1, 3 or 5 (or 6, with routed VLANs) routed mode is refused (the probe exits 1); without 2, NAT connections stay
on the firewall; without 4, IPv6 connections (a refused flow leaves its connection on the
firewall, counted; a wrong one must be kept there by policy). Every flow here carries a
probe cookie (probe.PROBE_FLOWS), removed with the rest.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import queue
import time
from dataclasses import dataclass
from typing import Any

from os_ken.lib.packet import ethernet, ipv4, ipv6, packet, packet_utils, tcp, udp, vlan
from os_ken.lib.packet.ether_types import ETH_TYPE_8021Q

from nfshunt.config.switch import RoutedSide
from nfshunt.core.connection import Action, Conn
from nfshunt.openflow.flows import OFPR_INVALID_TTL, invalid_ttl_packet_ins, routed_actions
from nfshunt.probe import FRAME_COOKIES, PROBE_DST, SHAPE_ID, Prober, Report
from nfshunt.records.model import TCP, UDP, VID_PRESENT, FlowTuple, NextHop, nat_rewrite

SHAPE_BASE = 8  # conntrack ids SHAPE_ID + 8... of its pairs (after the shapes' own)
FRAME_WAIT = 3.0  # seconds a probe frame is sent again until its packet-in comes
HOPS = (NextHop("probe-b", "02:00:5e:00:53:b1", "02:00:5e:00:53:b2"),  # RFC 7042 documentation MACs
        NextHop("probe-a", "02:00:5e:00:53:a1", "02:00:5e:00:53:a2"))
NAT_TO = "203.0.113.7"  # TEST-NET-3: the translating router's address, and the port it gives
NAT_PORT = 61000
NAT_SERVER, NAT_SERVER_PORT = "203.0.113.9", 80  # where the DNAT sends the pair (all four fields change)
SENT_SRC, SENT_DST = "02:00:00:00:00:01", "02:00:00:00:00:02"
SRC6, DST6 = "2001:db8::1", "2001:db8::fe"  # the IPv6 documentation prefix

REWRITE = "routed shunt: dec_ttl, set_field eth_src/eth_dst, output"
NAT = "NAT set_field ipv4_src/ipv4_dst, tcp/udp ports"
INVALID_TTL = "invalid-TTL packet-in (set_async INVALID_TTL; a TTL-1 frame through dec_ttl)"
IPV6 = "IPv6 routed shunt: dec_ttl (hop limit; 1: a packet-in), set_field eth_src/eth_dst, output"
TRUNK = "routed shunt between VLANs: dec_ttl, set_field eth_src/eth_dst, retag, output"
FRAGMENT = "a first fragment misses a shunt's ports (its datagram stays whole on the firewall)"
WHY = {REWRITE: "a shunted frame would leave without the router's rewrite (the next hop's MAC, the TTL one lower)",
       INVALID_TTL: "a frame whose TTL expires on a shunt would not reach the firewall, which must answer it with "
                    "ICMP time exceeded (traceroute through a shunted connection would not show the router)",
       FRAGMENT: "a fragmented datagram's first fragment would take the shunt while the firewall waits for it to "
                 "reassemble the rest (the datagram lost)",
       TRUNK: "a frame shunted between two of the router's VLANs would leave without the router's rewrite or with "
              "the wrong tag"}


class Support(enum.Enum):
    SUPPORTED = "supported"
    REFUSED = "refused"
    WRONG = "accepted but wrong"


@dataclass(frozen=True)
class Finding:
    support: Support
    detail: str = ""

    def __str__(self) -> str:
        return self.support.value + (f": {self.detail}" if self.detail else "")


@dataclass(frozen=True)
class Expect:
    """What a probe frame must look like when its flow has sent it to the controller."""
    eth_src: str
    eth_dst: str
    ttl: int
    src: str
    dst: str
    sport: int
    dport: int
    vid: int = 0  # its VLAN tag's id (0: untagged)


def frame(proto: int, sport: int, ttl: int, family: int = 4, vid: int = 0) -> bytes:
    """A probe frame to probe.PROBE_DST (TEST-NET-2) or DST6, UDP or TCP, checksums filled
    (`ttl`: IPv6's hop limit), tagged with `vid` if not 0."""
    pkt = packet.Packet()
    ethertype = 0x0800 if family == 4 else 0x86DD
    if vid:
        pkt.add_protocol(ethernet.ethernet(dst=SENT_DST, src=SENT_SRC, ethertype=ETH_TYPE_8021Q))
        pkt.add_protocol(vlan.vlan(vid=vid, ethertype=ethertype))
    else:
        pkt.add_protocol(ethernet.ethernet(dst=SENT_DST, src=SENT_SRC, ethertype=ethertype))
    pkt.add_protocol(ipv4.ipv4(src="198.51.100.1", dst=PROBE_DST, proto=proto, ttl=ttl) if family == 4 else
                     ipv6.ipv6(src=SRC6, dst=DST6, nxt=proto, hop_limit=ttl))
    pkt.add_protocol(udp.udp(src_port=sport, dst_port=9) if proto == UDP else
                     tcp.tcp(src_port=sport, dst_port=9, seq=1, bits=tcp.TCP_ACK, window_size=1024))
    pkt.add_protocol(b"nfshunt probe")
    pkt.serialize()
    return bytes(pkt.data)


def problem(got: bytes, want: Expect) -> str | None:
    """What is wrong with the frame `got` as a flow's output (None: it is as expected),
    its IPv4 and TCP/UDP checksums included (a switch that rewrites without fixing them
    hands the host frames it drops); an IPv6 frame's hop limit stands for the TTL."""
    pkt = packet.Packet(got)
    eth, ip4, ip6 = pkt.get_protocol(ethernet.ethernet), pkt.get_protocol(ipv4.ipv4), pkt.get_protocol(ipv6.ipv6)
    l4 = pkt.get_protocol(udp.udp) or pkt.get_protocol(tcp.tcp)
    if eth is None or (ip4 is None and ip6 is None) or l4 is None:
        return "came back not an IP TCP/UDP frame"
    wrong = []
    tag = pkt.get_protocol(vlan.vlan)
    l2 = 18 if tag is not None else 14
    if ip4 is not None:
        ttl, proto, start, end = ip4.ttl, ip4.proto, l2 + ip4.header_length * 4, l2 + ip4.total_length
        if packet_utils.checksum(got[l2:start]) != 0:
            wrong.append("IPv4 header checksum wrong")
    else:
        ttl, proto, start = ip6.hop_limit, ip6.nxt, l2 + 40
        end = start + ip6.payload_length
    ip = ip4 if ip4 is not None else ip6
    seen = Expect(eth.src, eth.dst, ttl, ip.src, ip.dst, l4.src_port, l4.dst_port, tag.vid if tag is not None else 0)
    wrong[:0] = [f"{name} {getattr(seen, name)} (want {getattr(want, name)})"
                 for name in (f.name for f in dataclasses.fields(Expect)) if getattr(seen, name) != getattr(want, name)]
    if len(got) >= end and packet_utils.checksum_ip(ip, end - start, got[start:end]) != 0:
        wrong.append(f"{'UDP' if proto == UDP else 'TCP'} checksum wrong")
    return "came back with " + ", ".join(wrong) if wrong else None


def verdict(report: Report, found: dict[str, Finding]) -> None:
    """The routed recommendation: routed mode refused (report.ok False: the probe exits 1)
    without the router's rewrite or invalid-TTL packet-ins, each reason said; NAT's
    set_fields refused only keep NAT connections on the firewall. (NAT is said only when
    routed mode stands: its flows begin with the router's rewrite.)"""
    missing = [name for name in (REWRITE, INVALID_TTL, FRAGMENT, TRUNK)
               if name in found and found[name].support is not Support.SUPPORTED]
    if missing:
        report.ok = False
        report.settings["experimental_routed"] = False
        report.say("routed mode: refused on this switch: " + "; ".join(f"{WHY[name]} ({name}: {found[name]})"
                                                                      for name in missing))
        return
    report.say("routed mode: supported (the router's rewrite, invalid-TTL packet-ins" +
               (", fragments kept off" if FRAGMENT in found else "") +
               (", between the config's VLANs)" if TRUNK in found else ")"))
    nat = found[NAT]
    if nat.support is Support.SUPPORTED:
        report.say("NAT shunts: supported (addresses and ports rewritten, checksums fixed)")
    elif nat.support is Support.REFUSED:
        report.say(f"NAT shunts: not supported ({nat}): the switch refuses a translated connection's flows, so NAT "
                   "connections stay on the firewall (each refusal counted in nfshunt_openflow_errors_total and "
                   "logged refused-flow); not a reason to refuse routed mode")
    else:  # the switch takes the flows and translates wrongly: nothing keeps NAT connections off it
        report.say(f"NAT shunts: WRONG ({nat}): the switch accepts a translated connection's flows and rewrites "
                   "its frames wrongly, and no setting of NFShunt's keeps NAT connections on the firewall: keep "
                   "them there by policy (do not shunt translated connections) or do not translate on this switch")
    v6 = found[IPV6]
    if v6.support is Support.SUPPORTED:
        report.say("IPv6 routed shunts: supported (the hop limit one lower, the next hop's MACs, an expiring one to "
                   "the firewall)")
    elif v6.support is Support.REFUSED:
        report.say(f"IPv6 routed shunts: not supported ({v6}): the switch refuses an IPv6 pair's flows, so IPv6 "
                   "connections stay on the firewall (each refusal counted in nfshunt_openflow_errors_total and "
                   "logged refused-flow); not a reason to refuse routed mode")
    else:
        report.say(f"IPv6 routed shunts: WRONG ({v6}): the switch accepts an IPv6 pair's flows and forwards its "
                   "frames wrongly, and no setting of NFShunt's keeps IPv6 connections on the firewall: keep them "
                   "there by policy (do not shunt IPv6 connections)")


def _conns(prober: Prober, proto: int, n: int) -> tuple[Conn, Conn]:
    """A routed pair over the probed switch's first and last port groups, and one translated
    both ways (source and destination, addresses and ports)."""
    a, b = prober.switch.ports[0], prober.switch.ports[-1]
    t = FlowTuple(4, proto, "198.51.100.1", "198.51.100.2", 40200 + n, 9)
    routed = Conn(t, t.reversed(), SHAPE_ID + SHAPE_BASE + 2 * n, Action.SHUNT, a, b, 0.0, hops=HOPS)
    reply = FlowTuple(4, proto, NAT_SERVER, NAT_TO, NAT_SERVER_PORT, NAT_PORT)  # SNAT and DNAT, ports both
    translated = Conn(t, reply, routed.ct_id + 1, Action.SHUNT, a, b, 0.0, hops=HOPS)
    translated.nat = nat_rewrite(t, reply)
    return routed, translated


def _conn6(prober: Prober, n: int) -> Conn:
    """A routed IPv6 UDP pair over the probed switch's first and last port groups."""
    t = FlowTuple(6, UDP, SRC6, DST6, 40200 + n, 9)
    return Conn(t, t.reversed(), SHAPE_ID + SHAPE_BASE + 2 * n, Action.SHUNT, prober.switch.ports[0],
                prober.switch.ports[-1], 0.0, hops=HOPS)


def _packet_in(prober: Prober, data: bytes, cookie: int | tuple[int, ...]) -> Any:
    """The packet-in of the flow of `cookie` (or of any of several) for `data` sent into the
    table (again every 0.1 s: a switch may apply a flow late), None if none came within FRAME_WAIT."""
    cookies = cookie if isinstance(cookie, tuple) else (cookie,)
    p, ofp = prober.p, prober.ofp
    frames: queue.Queue[Any] = prober.app.frames
    deadline = next_send = time.monotonic()
    deadline += FRAME_WAIT
    while time.monotonic() < deadline:
        if time.monotonic() >= next_send:
            prober.send([p.OFPPacketOut(prober.dp, buffer_id=ofp.OFP_NO_BUFFER, in_port=ofp.OFPP_CONTROLLER,
                                        actions=[p.OFPActionOutput(ofp.OFPP_TABLE)], data=data)])
            next_send += 0.1
        try:
            msg = frames.get(timeout=0.02)
        except queue.Empty:
            continue
        if msg.cookie in cookies:
            return msg
    return None


def _frame_flow(prober: Prober, n: int, proto: int, sport: int, actions: tuple[Any, ...],
                family: int = 4, vid: int = 0) -> tuple[int, str | None]:
    """A flow matching the probe frame of `sport` (tagged `vid`, if not 0), doing `actions`
    then output to the controller (the whole frame): its cookie, and why the switch refused
    it (None: added)."""
    p, ofp = prober.p, prober.ofp
    cookie = FRAME_COOKIES | n
    l4 = {"udp_src": sport} if proto == UDP else {"tcp_src": sport}
    ip = {"eth_type": 0x0800, "ipv4_dst": PROBE_DST} if family == 4 else {"eth_type": 0x86DD, "ipv6_dst": DST6}
    tag = {"vlan_vid": VID_PRESENT | vid} if vid else {}
    match = p.OFPMatch(ip_proto=proto, **tag, **ip, **l4)
    xids = prober.send([p.OFPFlowMod(prober.dp, cookie=cookie, command=ofp.OFPFC_ADD, priority=65535, match=match,
                                     instructions=[p.OFPInstructionActions(ofp.OFPIT_APPLY_ACTIONS, [
                                         *actions, p.OFPActionOutput(ofp.OFPP_CONTROLLER, ofp.OFPCML_NO_BUFFER)])])])
    prober.barrier()
    return cookie, prober.refused(xids)


def _through(prober: Prober, n: int, conn: Conn, want_nat: bool) -> Finding:
    """The original direction's actions of `conn` on a probe frame, as it comes back."""
    sport, family = 40300 + n, conn.orig.family
    cookie, refused = _frame_flow(prober, n, conn.orig.proto, sport, routed_actions(prober.p, conn, False), family)
    if refused is not None:
        return Finding(Support.REFUSED, f"its probe flow {refused}")
    msg = _packet_in(prober, frame(conn.orig.proto, sport, 64, family), cookie)
    if msg is None:
        return Finding(Support.WRONG, f"the probe frame never came back within {FRAME_WAIT:.0f} s")
    hop = HOPS[0]
    want = Expect(hop.eth_src, hop.eth_dst, 63, *(("198.51.100.1", PROBE_DST) if family == 4 else (SRC6, DST6)),
                  sport, 9)
    if want_nat:
        want = dataclasses.replace(want, src=NAT_TO, dst=NAT_SERVER, sport=NAT_PORT, dport=NAT_SERVER_PORT)
    wrong = problem(bytes(msg.data), want)
    return Finding(Support.WRONG, wrong) if wrong else Finding(Support.SUPPORTED)


def _installed(prober: Prober, conn: Conn) -> str | None:
    """The pair's flows as the controller installs them: why not (None: accepted, read back)."""
    msgs = prober.fb.install(conn)
    return prober.shape_problem(msgs, functools.partial(prober.fb.pair_stats_request, conn, catchers=True), len(msgs),
                                prober.fb.remove(conn, (False, True)))


def _not_installed(what: str, why: str) -> Finding:
    """A pair the switch would not take as installed (`why`: _installed's answer)."""
    return Finding(Support.WRONG if why.startswith("accepted") else Support.REFUSED, f"{what} {why}")


def rewrite_and_nat(prober: Prober) -> dict[str, Finding]:
    """Shapes 1, 2 and 4: the pairs installed (a TCP one with its catchers, a UDP one; an
    IPv6 UDP one), then a probe frame through their actions."""
    found: dict[str, Finding] = {}
    for name, nat in ((REWRITE, False), (NAT, True)):
        finding = Finding(Support.SUPPORTED)
        for n, proto in enumerate((TCP, UDP)):
            conn = _conns(prober, proto, 2 * n + nat)[nat]
            why = _installed(prober, conn)
            if why is not None:
                finding = _not_installed(f"{'TCP' if proto == TCP else 'UDP'} pair", why)
                break
            finding = _through(prober, 2 * n + nat, conn, nat)
            if finding.support is not Support.SUPPORTED:
                finding = Finding(finding.support, f"{'TCP' if proto == TCP else 'UDP'}: {finding.detail}")
                break
        found[name] = finding
    v6 = _conn6(prober, 6)
    why = _installed(prober, v6)
    found[IPV6] = _not_installed("UDP pair", why) if why is not None else _through(prober, 6, v6, False)
    return found


def trunk_sides(prober: Prober) -> tuple[RoutedSide, RoutedSide] | None:
    """Two of the config's routed interfaces, a tagged one first (a routed VLAN's), the other
    of another tag where there is one; None without routed VLANs."""
    sides = list(prober.configured.sides.values())
    a = next((s for s in sides if s.vid), None)
    if a is None:
        return None
    others = [s for s in sides if s is not a]
    b = next((s for s in others if s.vid != a.vid and s.group is not a.group), None) or \
        next((s for s in others if s.vid != a.vid), None) or next(iter(others), None)  # (a tag kept, at least)
    return None if b is None else (a, b)


def trunk(prober: Prober, sides: tuple[RoutedSide, RoutedSide]) -> Finding:
    """Shape 5: a pair between two routed interfaces of different tags installed as the
    controller does (its catchers too), then a frame of the first's tag through its
    original direction's actions (the router's rewrite, the retag): the next hop's MACs, the
    TTL one lower, the second's tag."""
    a, b = sides
    t = FlowTuple(4, UDP, "198.51.100.1", PROBE_DST, 40210, 9)
    conn = Conn(t, t.reversed(), SHAPE_ID + SHAPE_BASE + 10, Action.SHUNT, a.group, b.group, 0.0, hops=HOPS,
                sides=sides)
    why = _installed(prober, conn)
    if why is not None:
        return _not_installed(f"UDP pair (VLAN {a.vid} to {b.vid or 'untagged'})", why)
    sport = 40310
    actions = (*routed_actions(prober.p, conn, False), *prober.fb.retag(a.vid, b.vid))
    cookie, refused = _frame_flow(prober, 10, UDP, sport, actions, vid=a.vid)
    if refused is not None:
        return Finding(Support.REFUSED, f"its probe flow {refused}")
    msg = _packet_in(prober, frame(UDP, sport, 64, vid=a.vid), cookie)
    if msg is None:
        return Finding(Support.WRONG, f"the probe frame never came back within {FRAME_WAIT:.0f} s")
    want = Expect(HOPS[0].eth_src, HOPS[0].eth_dst, 63, "198.51.100.1", PROBE_DST, sport, 9, b.vid)
    wrong = problem(bytes(msg.data), want)
    return Finding(Support.WRONG, wrong) if wrong else Finding(Support.SUPPORTED)


def fragment(sport: int) -> bytes:
    """A first fragment of a UDP datagram to probe.PROBE_DST: more fragments set, offset 0,
    the UDP header inside (its length the whole datagram's, 2,000 bytes)."""
    pkt = packet.Packet()
    pkt.add_protocol(ethernet.ethernet(dst=SENT_DST, src=SENT_SRC, ethertype=0x0800))
    pkt.add_protocol(ipv4.ipv4(src="198.51.100.1", dst=PROBE_DST, proto=UDP, ttl=64, flags=0b001, offset=0))
    pkt.add_protocol(udp.udp(src_port=sport, dst_port=9, total_length=2000, csum=0))
    pkt.add_protocol(b"\0" * 64)
    pkt.serialize()
    return bytes(pkt.data)


def first_fragment(prober: Prober) -> Finding:
    """Shape 5: two flows to the controller, one matching the probe's UDP ports (a shunt's
    match) and one below it matching its addresses alone; a first fragment sent through the
    table must come back by the second."""
    sport = 40320
    by_ports, refused = _frame_flow(prober, 11, UDP, sport, ())
    if refused is not None:
        return Finding(Support.REFUSED, f"its probe flow {refused}")
    p, ofp = prober.p, prober.ofp
    by_addresses = FRAME_COOKIES | 12
    xids = prober.send([p.OFPFlowMod(prober.dp, cookie=by_addresses, command=ofp.OFPFC_ADD, priority=65534,
                                     match=p.OFPMatch(eth_type=0x0800, ipv4_dst=PROBE_DST),
                                     instructions=[p.OFPInstructionActions(ofp.OFPIT_APPLY_ACTIONS, [
                                         p.OFPActionOutput(ofp.OFPP_CONTROLLER, ofp.OFPCML_NO_BUFFER)])])])
    prober.barrier()
    refused = prober.refused(xids)
    if refused is not None:
        return Finding(Support.REFUSED, f"its address flow {refused}")
    msg = _packet_in(prober, fragment(sport), (by_ports, by_addresses))
    if msg is None:
        return Finding(Support.WRONG, f"the first fragment never came back within {FRAME_WAIT:.0f} s")
    if msg.cookie == by_ports:
        return Finding(Support.WRONG, "the first fragment matched the UDP ports: the switch would shunt it")
    return Finding(Support.SUPPORTED)


def invalid_ttl(prober: Prober, family: int = 4) -> Finding:
    """Shape 3: the controller's set_async, then a TTL-1 frame through a dec_ttl flow must
    come back as an INVALID_TTL packet-in with the flow's cookie and the frame as it came.
    `family` 6: an IPv6 frame of hop limit 1 (the set_async sent for IPv4 already)."""
    if family == 4:
        xids = prober.send([invalid_ttl_packet_ins(prober.dp)])
        prober.barrier()
        refused = prober.refused(xids)
        if refused is not None:
            return Finding(Support.REFUSED, f"set_async {refused}")
    routed = _conns(prober, UDP, 0)[0] if family == 4 else _conn6(prober, 7)
    n, sport = (8, 40399) if family == 4 else (9, 40398)
    cookie, refused = _frame_flow(prober, n, UDP, sport, routed_actions(prober.p, routed, False), family)
    if refused is not None:
        return Finding(Support.REFUSED, f"its dec_ttl flow {refused}")
    sent = frame(UDP, sport, 1, family)
    msg = _packet_in(prober, sent, cookie)
    if msg is None:
        return Finding(Support.WRONG, f"no packet-in within {FRAME_WAIT:.0f} s: the switch dropped the expiring frame")
    if msg.reason != OFPR_INVALID_TTL:
        got = packet.Packet(bytes(msg.data))
        ttl = ip.ttl if (ip := got.get_protocol(ipv4.ipv4)) is not None else \
            ip6.hop_limit if (ip6 := got.get_protocol(ipv6.ipv6)) is not None else "?"
        return Finding(Support.WRONG, f"packet-in reason {msg.reason}, not INVALID_TTL ({OFPR_INVALID_TTL}): the "
                                      f"switch forwarded the expiring frame on (TTL {ttl}) instead of stopping it")
    if bytes(msg.data)[:len(sent)] != sent:
        return Finding(Support.WRONG, "the packet-in's frame is not the frame as it arrived (rewritten before the "
                                      "TTL check): the firewall would get it with the next hop's MACs")
    return Finding(Support.SUPPORTED)


def probe(prober: Prober, report: Report) -> None:
    """probe-switch's routed part (probe.run's extra): the shapes and the verdict, for a
    switch whose `forwarding` is `routed` only."""
    if prober.switch.forwarding == "routed":
        verdict(report, routed_shapes(prober, report))


def routed_shapes(prober: Prober, report: Report) -> dict[str, Finding]:
    """The three routed shapes, each reported; their flows removed."""
    # (one trunk whose VLANs the firewall routes between: a router on a stick, its pairs in and out of one port)
    if not prober.of13 or (len(prober.switch.ports) < 2 and len(prober.configured.sides) < 2):
        found = {name: Finding(Support.REFUSED, "not probed: needs OpenFlow 1.3 and two port groups")
                 for name in (REWRITE, NAT, INVALID_TTL, IPV6)}
    else:
        try:
            found = rewrite_and_nat(prober)
            found[INVALID_TTL] = invalid_ttl(prober)
            found[FRAGMENT] = first_fragment(prober)
            sides = trunk_sides(prober)
            if sides is not None:
                found[TRUNK] = trunk(prober, sides)
            if found[IPV6].support is Support.SUPPORTED and found[INVALID_TTL].support is Support.SUPPORTED:
                expiring = invalid_ttl(prober, 6)  # an IPv6 hop limit expiring on a shunt, too
                if expiring.support is not Support.SUPPORTED:
                    found[IPV6] = Finding(expiring.support, f"hop limit 1: {expiring.detail}")
        finally:
            prober.delete_probe_flows()
    report.say("routed shapes (installed as the controller does, a probe frame sent through each):")
    for name, finding in found.items():
        mark = "ok  " if finding.support is Support.SUPPORTED else ("no  " if name in (NAT, IPV6) else "FAIL")
        report.say(f"  {mark} {name}: {finding}")
    return found
