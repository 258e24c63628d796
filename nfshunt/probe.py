"""`nfshunt probe-switch`: what an engineer runs first on new hardware.

It takes the controller's place (same listener, TLS, allow-list and datapath pin; the
controller must be stopped), waits for the switch, and reports what NFShunt needs of it:
the OpenFlow version and tables; each flow shape NFShunt installs (a TCP shunt pair with its
FIN/RST catchers, an IPv6 UDP shunt, a block, the packet-in meter, the pipeline layout's two tables, and the
VLAN trunks' shapes: a tag matched and kept, translated, pushed and popped, a priority matched), installed,
read back and removed; the flow-mod rate behind one barrier; and the lag between a barrier
reply and the switch forwarding on the flow before it. The lag is measured with a test
packet sent by packet-out into the table (from the controller port, so before the flow
applies it matches nothing and leaves no port; with the flow, it comes back as a
packet-in). Then it prints the settings it recommends.

Every probe flow carries a cookie of NFShunt's (kind 0xFE: never a pair's) and is removed
before it exits, also on failure; flows already on the switch are left alone.
"""
from __future__ import annotations

import dataclasses
import functools
import ipaddress
import json
import logging
import operator
import os
import queue
import socket
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from os_ken.base import app_manager
from os_ken.controller import ofp_event
from os_ken.controller.handler import MAIN_DISPATCHER, set_ev_cls
from os_ken.lib.packet import ethernet, ipv4, packet, udp

from nfshunt.config.settings import Config
from nfshunt.config.static import StaticFlow, StaticShunt
from nfshunt.config.switch import PortGroup, SwitchConfig, Vlan
from nfshunt.core.connection import Action, Conn
from nfshunt.core.layout import entries_per_pair
from nfshunt.openflow.channel import address_allowed
from nfshunt.openflow.flows import FlowBuilder
from nfshunt.openflow.reads import ALL_ONES_64
from nfshunt.records import cookies
from nfshunt.records.model import OFP10, TCP, UDP, VID_PRESENT, FlowTuple, SwitchFlow, retag_ops

LOG = logging.getLogger("nfshunt")
PROBE_KIND = 0xFE
PROBE_COOKIE = cookies.OWNED_VALUE | (PROBE_KIND << 48)
PROBE_MASK = cookies.OWNED_MASK | cookies.KIND_MASK
SHAPE_ID = 0xFE000000  # conntrack ids of the probe pairs (cookie kind shunt/block)
RATE_ID = 0xFD000000  # ids of the flow-mod rate test's pairs
COST_ID = 0xFC000000  # ids of the VLAN table-cost test's pairs
COST_PAIRS = 100  # pairs of each kind the VLAN table-cost test installs
FRAME_COOKIES = PROBE_COOKIE | 0x300  # the routed shapes' frame flows' (probe_routed), low byte theirs
PROBE_DST = "198.51.100.254"  # TEST-NET-2: the lag probe's packet, UDP to the discard port
# Every flow the probe installs, as cookie/mask: its own, the shapes' and the rate test's pairs.
PROBE_FLOWS = ((PROBE_COOKIE, PROBE_MASK),
               (cookies.OWNED_VALUE | SHAPE_ID, cookies.OWNED_MASK | 0xFF000000),
               (cookies.OWNED_VALUE | RATE_ID, cookies.OWNED_MASK | 0xFF000000),
               (cookies.OWNED_VALUE | COST_ID, cookies.OWNED_MASK | 0xFF000000))
TIMEOUT = 5.0
CLEAN_WAIT = 5.0  # seconds the probe waits for a lagging switch to drop its flows
SHAPE_TCP = "TCP shunt + FIN/RST catchers (tcp_flags)"
SHAPE_TCP10 = "IPv4 TCP shunt"
SHAPE_IPV6 = "IPv6 UDP shunt"
SHAPE_BLOCK = "block (no actions)"
SHAPE_METER = "packet-in meter (OFPM_CONTROLLER; optional)"
SHAPE_PIPELINE = "pipeline layout: TCP shunt to table 1 + shared catchers (optional)"
PIPELINE_PROBE_PRIORITY = 10  # above the controller's table-1 flows (same actions), so neither replaces the other
REQUIRED = (SHAPE_TCP, SHAPE_TCP10, SHAPE_BLOCK)  # without these NFShunt cannot shunt and block
SHAPE_VLAN = "VLAN 100 TCP shunt, tag kept (vlan_vid) + FIN/RST catchers"
SHAPE_VLAN10 = "VLAN 100 IPv4 TCP shunt (dl_vlan)"
SHAPE_VLAN_XLATE = "VLAN 30 <-> 301 UDP shunt (set_field vlan_vid)"
SHAPE_VLAN_PUSH = "untagged <-> VLAN 70 UDP shunt (push_vlan, pop_vlan)"
SHAPE_VLAN_PCP = "VLAN 30 priority 6 static shunt, any address (vlan_pcp)"
VLAN_SHAPES = (SHAPE_VLAN, SHAPE_VLAN10, SHAPE_VLAN_XLATE, SHAPE_VLAN_PUSH, SHAPE_VLAN_PCP)  # optional all


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    ok: bool = True

    def say(self, text: str) -> None:
        self.lines.append(text)
        print(text, flush=True)


class ProbeApp(app_manager.OSKenApp):
    OFP_VERSIONS: list[int] = []

    def __init__(self, *args: Any, nfshunt_config: Config, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.cfg = nfshunt_config
        self.switch: queue.Queue[Any] = queue.Queue()
        self.replies: dict[int, queue.Queue[Any]] = {}
        self.errors: dict[int, Any] = {}
        self.packet_ins: queue.Queue[tuple[float, int]] = queue.Queue()
        self.frames: queue.Queue[Any] = queue.Queue()  # the routed shapes' packet-ins, whole (probe_routed)
        self.lock = threading.Lock()

    @set_ev_cls(ofp_event.EventOFPStateChange, MAIN_DISPATCHER)
    def _connected(self, ev: Any) -> None:
        dp = ev.datapath
        for sw in self.cfg.switches:  # several switches: the first configured one to connect is probed
            if address_allowed(dp.address[0], sw.switch_addresses) and (
                    sw.datapath_id is None or dp.id == sw.datapath_id):
                self.switch.put((dp, sw))
                return
        print(f"probe-switch: ignoring switch {dp.id:016x} from {dp.address[0]} (not a configured one)")
        dp.close()

    def _answer(self, msg: Any) -> None:
        with self.lock:
            q = self.replies.get(msg.xid)
        if q is not None:
            q.put(msg)

    @set_ev_cls([ofp_event.EventOFPBarrierReply, ofp_event.EventOFPFlowStatsReply, ofp_event.EventOFPDescStatsReply,
                 ofp_event.EventOFPTableFeaturesStatsReply, ofp_event.EventOFPTableStatsReply], MAIN_DISPATCHER)
    def _reply(self, ev: Any) -> None:
        self._answer(ev.msg)

    @set_ev_cls(ofp_event.EventOFPErrorMsg, MAIN_DISPATCHER)
    def _error(self, ev: Any) -> None:
        self.errors[ev.msg.xid] = ev.msg

    @set_ev_cls(ofp_event.EventOFPPacketIn, MAIN_DISPATCHER)
    def _packet_in(self, ev: Any) -> None:
        cookie = getattr(ev.msg, "cookie", 0)
        self.packet_ins.put((time.monotonic(), cookie))
        if cookie & ~0xFF == FRAME_COOKIES:
            self.frames.put(ev.msg)


class Prober:
    """Drives one switch connection synchronously from the probe's own thread."""

    def __init__(self, app: ProbeApp, dp: Any, cfg: Config, switch: SwitchConfig):
        self.app, self.dp, self.cfg = app, dp, cfg
        self.configured = switch  # as the config gives it (its trunks: the VLAN and routed VLAN shapes')
        # The untagged shapes' ports: each group's untagged (a trunk of VLANs only carries no
        # untagged pair to build; the VLAN shapes make trunks of their own).
        self.switch = dataclasses.replace(switch, ports=tuple(dataclasses.replace(g, vlans=(), untagged=0)
                                                              for g in switch.ports))
        self.p, self.ofp = dp.ofproto_parser, dp.ofproto
        self.of13 = dp.ofproto.OFP_VERSION != OFP10
        self.fb = FlowBuilder(dp, cfg, switch=self.switch)

    def ask(self, msg: Any, timeout: float = TIMEOUT) -> list[Any]:
        """Send a request; its replies (multipart ones gathered), or [] on an error or silence."""
        q: queue.Queue[Any] = queue.Queue()
        xid = self.dp.set_xid(msg)
        with self.app.lock:
            self.app.replies[xid] = q
        self.dp.send_msg(msg)
        out: list[Any] = []
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and xid not in self.app.errors:
                try:
                    reply = q.get(timeout=0.05)
                except queue.Empty:
                    continue
                out.append(reply)
                if not getattr(reply, "flags", 0) & 1:  # no REPLY_MORE
                    return out
            return [] if xid in self.app.errors else out
        finally:
            with self.app.lock:
                self.app.replies.pop(xid, None)

    def send(self, msgs: list[Any]) -> list[int]:
        """Serialised together, one write (the flow builder's templated messages included)."""
        xids, buf = [], bytearray()
        for msg in msgs:
            xids.append(self.dp.set_xid(msg))
            msg.serialize()
            buf += msg.buf
        self.dp.send(bytes(buf))
        return xids

    def barrier(self) -> float | None:
        """Monotonic time of the barrier reply, None if none came."""
        return time.monotonic() if self.ask(self.p.OFPBarrierRequest(self.dp)) else None

    def refused(self, xids: list[int]) -> str | None:
        for xid in xids:
            err = self.app.errors.get(xid)
            if err is not None:
                return f"refused (error type {err.type} code {err.code})"
        return None

    def delete_probe_flows(self, wait: float = 0.0) -> bool:
        """Delete every flow the probe installed. With `wait`, read the switch until none is
        left (a lagging switch removes them late); False if some stayed that long."""
        if not self.of13:
            self.barrier()
            return True
        self.send([self.fb.delete_by_cookie(cookie, mask) for cookie, mask in PROBE_FLOWS])
        self.barrier()
        p, ofp = self.p, self.ofp
        deadline = time.monotonic() + wait
        while wait:
            left = sum(len(reply.body) for cookie, mask in PROBE_FLOWS for reply in self.ask(p.OFPFlowStatsRequest(
                self.dp, 0, ofp.OFPTT_ALL, ofp.OFPP_ANY, ofp.OFPG_ANY, cookie, mask, p.OFPMatch())))
            if not left:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    # --- the probes ---------------------------------------------------------------------------

    def tables(self, report: Report) -> int | None:
        p = self.p
        desc = self.ask(p.OFPDescStatsRequest(self.dp, 0))
        if desc:
            d = desc[0].body
            report.say(f"switch: {d.mfr_desc} / {d.hw_desc} / {d.sw_desc}")
        if not self.of13:
            stats = self.ask(p.OFPTableStatsRequest(self.dp, 0))
            size = stats[0].body[0].max_entries if stats and stats[0].body else None
            report.say(f"OpenFlow 1.0: one table, {size if size is not None else 'unknown'} entries")
            return size
        features = self.ask(p.OFPTableFeaturesStatsRequest(self.dp, 0))
        tables = [t for reply in features for t in reply.body]
        size = next((t.max_entries for t in tables if t.table_id == 0), None)
        report.say(f"OpenFlow 1.3: {len(tables) or 'unknown (no table features)'} tables, table 0 holds "
                   f"{size if size is not None else 'an unknown number of'} entries")
        return size

    def _conn(self, n: int, proto: int, family: int, action: Action, a: PortGroup, b: PortGroup, base: int) -> Conn:
        net = ipaddress.ip_network("198.51.100.0/24" if family == 4 else "2001:db8::/64")
        t = FlowTuple(family, proto, str(net[1]), str(net[2]), 40000 + n, 9)
        return Conn(t, t.reversed(), base + n, action, a, b, 0.0)

    def shapes(self, report: Report) -> dict[str, bool]:
        """Each shape: installed, read back (as many flows as were sent), removed."""
        groups = self.switch.ports
        if len(groups) < 2:
            report.say("shapes: skipped (one port group: a pair needs two)")
            return {}
        a, b = groups[0], groups[-1]
        tcp = self._conn(0, TCP, 4, Action.SHUNT, a, b, SHAPE_ID)
        block = self._conn(1, UDP, 4, Action.BLOCK, a, b, SHAPE_ID)
        shapes: list[tuple[str, list[Any], Conn | None, list[Any]]]  # name, install, pair, undo
        if self.of13:
            udp6 = self._conn(2, UDP, 6, Action.SHUNT, a, b, SHAPE_ID)
            meter_delete, meter_add = self.fb.controller_meter(self.switch.packet_in_rate or 1000)
            shapes = [(SHAPE_TCP, self.fb.install(tcp), tcp, []),
                      (SHAPE_IPV6, self.fb.install(udp6), udp6, []),
                      (SHAPE_BLOCK, self.fb.install(block), block, []),
                      (SHAPE_METER, [meter_delete, meter_add], None, self.fb.controller_meter(1)[:1]),
                      (SHAPE_PIPELINE, self._pipeline(tcp), tcp, [])]
        else:
            shapes = [(SHAPE_TCP10, self.fb.install(tcp), tcp, []), (SHAPE_BLOCK, self.fb.install(block), block, [])]
        result: dict[str, bool] = {}
        for name, msgs, conn, undo in shapes:
            # (the pipeline's table-1 flows carry the probe's own cookie: not the pair's)
            read = None if conn is None or not self.of13 else \
                functools.partial(self.fb.pair_stats_request, conn, catchers=True)
            if conn is not None:
                undo = self.fb.remove(conn, (False, True))  # the same strict deletes in either layout
            result[name] = self.try_shape(report, name, msgs, read, 2 if name == SHAPE_PIPELINE else len(msgs), undo)
        result.update(vlan_shapes(self, report))
        self.delete_probe_flows()
        return result

    def try_shape(self, report: Report, name: str, msgs: list[Any], read: Callable[[], Any] | None, want: int,
                  undo: list[Any], fb: FlowBuilder | None = None, check: Any = None) -> bool:
        """One shape installed, read back, removed (shape_problem); reported."""
        problem = self.shape_problem(msgs, read, want, undo, fb, check)
        mark = "ok  " if problem is None else ("FAIL" if name in REQUIRED else "no  ")
        report.say(f"  {mark} {name}" + (f": {problem}" if problem else ""))
        return problem is None

    def shape_problem(self, msgs: list[Any], read: Callable[[], Any] | None, want: int, undo: list[Any],
                      fb: FlowBuilder | None = None, check: Any = None) -> str | None:
        """One shape installed, read back with the request `read` makes (a new one each
        read: a message takes one xid; OpenFlow 1.3: `want` flows, each as `fb` parses it
        passing `check`, if given), removed with `undo`: what went wrong, None if nothing."""
        xids = self.send(msgs)
        self.barrier()
        problem = self.refused(xids)
        if problem is None and read is not None and self.of13:
            # A switch that applies flow-mods after its barrier reply shows them late.
            n, deadline = 0, time.monotonic() + 3.0
            while True:
                found = [entry for r in self.ask(read()) for entry in r.body]
                n = len(found)
                if n == want or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            if n != want:
                problem = f"accepted, but {n} of {want} flows read back within 3 s"
            elif check is not None and fb is not None and not all(check(fb.parse_stats(e)) for e in found):
                problem = "accepted, but read back changed (its tag, priority or retag is not what was sent)"
        if undo:
            self.send(undo)
            self.barrier()
        return problem

    def _pipeline(self, conn: Conn) -> list[Any]:
        """The pipeline layout's flows as the controller builds them: the pair going on to
        table 1, and table 1's outputs and catchers (under the probe's cookie)."""
        fb = FlowBuilder(self.dp, self.cfg, pipeline=True, switch=self.switch)
        shared = fb.pipeline_flows(self.switch.ports)
        for msg in shared:
            msg.cookie, msg.priority = PROBE_COOKIE, msg.priority + PIPELINE_PROBE_PRIORITY
        return fb.install(conn) + shared

    def flow_mod_rate(self, report: Report, pairs: int) -> float | None:
        groups = self.switch.ports
        a, b = groups[0], groups[-1]
        if a is b:
            return None
        msgs = [m for i in range(pairs) for m in self.fb.install(self._conn(i, UDP, 4, Action.SHUNT, a, b, RATE_ID))]
        buf = bytearray()
        for m in msgs:  # serialised before the clock starts: the switch's rate, not ours
            self.dp.set_xid(m)
            m.serialize()
            buf += m.buf
        start = time.monotonic()
        self.dp.send(bytes(buf))
        done = self.barrier()
        self.delete_probe_flows()
        if done is None:
            report.say(f"flow-mod rate: no barrier reply within {TIMEOUT:.0f} s for {len(msgs)} flow-mods")
            return None
        rate = len(msgs) / max(done - start, 1e-6)
        report.say(f"flow-mod rate: {len(msgs)} flow-mods behind one barrier in {(done - start) * 1000:.0f} ms: "
                   f"{rate:,.0f}/s")
        return rate

    def _probe_flow(self, cookie: int, sport: int) -> bytes:
        """A flow sending the probe packet of UDP source port `sport` to the controller
        (added, not yet confirmed), and that packet as a packet-out into the table."""
        p, ofp = self.p, self.ofp
        pkt = packet.Packet()
        pkt.add_protocol(ethernet.ethernet(dst="02:00:00:00:00:02", src="02:00:00:00:00:01", ethertype=0x0800))
        pkt.add_protocol(ipv4.ipv4(src="198.51.100.1", dst=PROBE_DST, proto=17))
        pkt.add_protocol(udp.udp(src_port=sport, dst_port=9))
        pkt.serialize()
        out = p.OFPPacketOut(self.dp, buffer_id=ofp.OFP_NO_BUFFER, in_port=ofp.OFPP_CONTROLLER,
                             actions=[p.OFPActionOutput(ofp.OFPP_TABLE)], data=pkt.data)
        self.dp.set_xid(out)
        out.serialize()
        match = p.OFPMatch(eth_type=0x0800, ip_proto=17, ipv4_dst=PROBE_DST, udp_src=sport, udp_dst=9)
        self.send([p.OFPFlowMod(self.dp, cookie=cookie, command=ofp.OFPFC_ADD, priority=65535, match=match,
                                instructions=[p.OFPInstructionActions(ofp.OFPIT_APPLY_ACTIONS, [
                                    p.OFPActionOutput(ofp.OFPP_CONTROLLER, 128)])])])
        return bytes(out.buf)

    def _came_back(self, probe: bytes, cookie: int, deadline: float) -> float | None:
        """When the probe, sent every 2 ms, first came back through the flow of `cookie`."""
        while time.monotonic() < deadline:
            self.dp.send(probe)
            try:
                when, got = self.app.packet_ins.get(timeout=0.002)
            except queue.Empty:
                continue
            if got == cookie:
                return when
        return None

    def round_trip(self, runs: int = 5) -> float | None:
        """The probe's own round trip (packet-out, the switch, packet-in) through a flow in
        place for a while: what the lag's measure takes on a host that is slow to schedule
        the probe, not the switch's (a loaded 2-core machine: 5.4 ms, over the 5 ms bound)."""
        cookie = PROBE_COOKIE | 0x200
        probe = self._probe_flow(cookie, 39999)
        if self.barrier() is None or self._came_back(probe, cookie, time.monotonic() + 3.0) is None:
            return None
        trips = []
        for _ in range(runs):
            time.sleep(0.01)  # the warm-up's probes still in flight come back, and are dropped
            while not self.app.packet_ins.empty():
                self.app.packet_ins.get_nowait()
            sent = time.monotonic()
            self.dp.send(probe)  # one probe a trip: no earlier one's packet-in can answer it
            while (left := sent + 1.0 - time.monotonic()) > 0:
                try:
                    when, got = self.app.packet_ins.get(timeout=left)
                except queue.Empty:
                    break
                if got == cookie:
                    trips.append(when - sent)
                    break
        return statistics.median(trips) if trips else None

    def lag(self, report: Report, runs: int) -> list[float]:
        """Barrier reply to the first packet the new flow forwards, `runs` times, less the
        probe's own round trip through a flow in place."""
        if not self.of13:
            report.say("forwarding lag: skipped (OpenFlow 1.0: packet-ins carry no cookie)")
            return []
        base = self.round_trip()
        # Each run has its own flow (cookie and UDP source port): a packet-in from an earlier
        # run's flow, which a lagging switch removes late, can never be taken for this run's.
        lags: list[float] = []
        for run in range(runs):
            cookie = PROBE_COOKIE | (run + 1)
            probe = self._probe_flow(cookie, 40000 + run)
            t0 = self.barrier()
            if t0 is None:
                break
            seen = self._came_back(probe, cookie, t0 + 3.0)
            if seen is None:
                self.delete_probe_flows()
                report.say("forwarding lag: the probe packet never came back within 3 s (packet-out into the table "
                           "or output to the controller unsupported?)")
                return lags
            lags.append(max(0.0, seen - t0 - (base or 0.0)))
            time.sleep(0.05)
        self.delete_probe_flows()
        if lags:
            own = f"{base * 1000:.1f} ms" if base is not None else "not measured"
            report.say(f"forwarding lag after the barrier reply: median {statistics.median(lags) * 1000:.1f} ms, "
                       f"max {max(lags) * 1000:.1f} ms over {len(lags)} flows (the probe's own round trip, {own}, "
                       "taken off)")
        return lags


def _trunks(a: PortGroup, b: PortGroup) -> tuple[PortGroup, PortGroup]:
    """Two trunks on the probed groups' ports, each VLAN shape's: VLAN 100 on both sides
    (the tag kept), 30 on a's bridged to 301 on b's (translated), a's untagged frames to b's
    VLAN 70 (pushed and popped)."""
    return (PortGroup(a.fast, a.slow, a.physdevin, vlans=(Vlan(100, 100), Vlan(30, 30)), untagged=7),
            PortGroup(b.fast, b.slow, b.physdevin, vlans=(Vlan(100, 100), Vlan(301, 30), Vlan(70, 7)), untagged=None))


def vlan_shapes(prober: Prober, report: Report) -> dict[str, bool]:
    """The VLAN shapes (issue 37), whatever the config's port groups carry (a user asks before
    configuring trunks): each installed, read back exactly (its tag's present bit, its
    retag, its priority), removed."""
    groups = prober.switch.ports
    a, b = _trunks(groups[0], groups[-1])
    fb = FlowBuilder(prober.dp, prober.cfg, switch=dataclasses.replace(prober.switch, ports=(a, b)))

    def conn(n: int, zone: int, proto: int = UDP) -> Conn:
        t = FlowTuple(4, proto, "198.51.100.1", "198.51.100.2", 40100 + n, 9, zone)
        return Conn(t, t.reversed(), SHAPE_ID + 16 + n, Action.SHUNT, a, b, 0.0)
    pairs = [(SHAPE_VLAN, conn(0, 100, TCP)), (SHAPE_VLAN_XLATE, conn(1, 30)), (SHAPE_VLAN_PUSH, conn(2, 7))] \
        if prober.of13 else [(SHAPE_VLAN10, conn(0, 100, TCP))]
    result = {}
    for name, c in pairs:
        def exact(f: SwitchFlow, zone: int = c.orig.zone) -> bool:
            parsed = cookies.parse(f.cookie)
            return parsed is None or parsed.kind is not cookies.Kind.SHUNT or \
                (f.exact and f.match is not None and f.match.zone == zone)
        msgs = fb.install(c)
        read = functools.partial(fb.pair_stats_request, c, catchers=True) if prober.of13 else None  # (1.0 cannot)
        result[name] = prober.try_shape(report, name, msgs, read, len(msgs), fb.remove(c, (False, True)), fb, exact)
    if prober.of13:
        shunt = StaticShunt(None, None, None, (a.fast, b.fast), vlan=30, pcp=6)
        cookie = PROBE_COOKIE | 0x100
        static = StaticFlow(shunt, False, a.fast, b.fast, None, None, None, None, prober.cfg.static_priority, cookie,
                            0, 30, 301, 30, 6)

        def right(f: SwitchFlow) -> bool:
            return (f.vlan, f.pcp, f.retag, f.out_port) == (VID_PRESENT | 30, 6, retag_ops(30, 301), b.fast)
        result[SHAPE_VLAN_PCP] = prober.try_shape(report, SHAPE_VLAN_PCP, [fb.static_add(static)],
                                                  functools.partial(fb.cookie_stats_request, cookie, ALL_ONES_64), 1,
                                                  [fb.delete_by_cookie(cookie, ALL_ONES_64)], fb, right)
        if result[SHAPE_VLAN]:
            vlan_cost(prober, report)
    return result


def _active(prober: Prober) -> int | None:
    """Table 0's active_count (OpenFlow 1.3 table stats), None if the switch does not say."""
    replies = prober.ask(prober.p.OFPTableStatsRequest(prober.dp, 0))
    return next((t.active_count for r in replies for t in r.body if t.table_id == 0), None)


def _settled(prober: Prober, want: Callable[[int], bool]) -> int | None:
    """active_count once `want` holds of it (a switch may apply flow-mods after its barrier
    reply), or as it is after 3 s."""
    deadline = time.monotonic() + 3.0
    while True:
        n = _active(prober)
        if n is None or want(n) or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


def vlan_cost(prober: Prober, report: Report, pairs: int = COST_PAIRS) -> dict[str, int] | None:
    """Table 0's entries for `pairs` untagged UDP pairs, then as many VLAN 100 ones
    (active_count before and after each, design 5.4): OpenFlow cannot see how wide a TCAM
    key a match takes, so this count is all a user gets of a VLAN match's cost."""
    groups = prober.switch.ports
    a, b = _trunks(groups[0], groups[-1])
    tagged = FlowBuilder(prober.dp, prober.cfg, switch=dataclasses.replace(prober.switch, ports=(a, b)))
    prober.delete_probe_flows(wait=3.0)  # (a lagging switch may still hold the shapes' flows: not in the base)
    base = _active(prober)
    if base is None:
        report.say("VLAN table cost: skipped (the switch reports no table stats)")
        return None
    out: dict[str, int] = {}
    for label, fb, ga, gb, zone in (("untagged", prober.fb, groups[0], groups[-1], 0), ("VLAN 100", tagged, a, b, 100)):
        msgs = []
        for i in range(pairs):
            t = FlowTuple(4, UDP, "198.51.100.3", "198.51.100.4", 41000 + i, 9, zone)
            msgs += fb.install(Conn(t, t.reversed(), COST_ID + i, Action.SHUNT, ga, gb, 0.0))
        prober.send(msgs)
        prober.barrier()
        sent = base + len(msgs)
        n = _settled(prober, functools.partial(operator.le, sent))
        out[label] = -1 if n is None else n - base
        prober.send([fb.delete_by_cookie(cookies.OWNED_VALUE | COST_ID, cookies.OWNED_MASK | 0xFF000000)])
        prober.barrier()
        _settled(prober, lambda n: n <= base)
    report.say(f"VLAN table cost: table 0 holds {out['untagged']} more entries for {pairs} untagged UDP pairs, "
               f"{out['VLAN 100']} more for {pairs} VLAN 100 pairs (active_count: OpenFlow cannot see the TCAM "
               "key's width; a switch that spends more on a tag shows it here, or refuses sooner)")
    return out


def recommend(report: Report, switch: SwitchConfig, of13: bool, size: int | None, shapes: dict[str, bool],
              rate: float | None, lags: list[float]) -> None:
    s = report.settings
    vlan = [name for name in VLAN_SHAPES if name in shapes]
    refused = [name for name in vlan if not shapes[name]]
    if refused:
        report.say("VLAN shunts: not supported by this switch (" + "; ".join(refused) + "): leave `vlans` out; "
                   "tagged frames then cross the firewall only")
    elif vlan:
        report.say("VLAN shunts: supported (match, retag, push/pop" + (", priority)" if of13 else ")"))
    s["openflow_versions"] = ["1.3"] if of13 else ["1.0"]
    teardown = shapes.get(SHAPE_TCP, False)
    s["tcp_teardown"] = teardown
    pipeline = teardown and shapes.get(SHAPE_PIPELINE, False)
    # A routing firewall's `auto` is single (switch/peers.py): its table sized as single's, unless asked for.
    pipeline = pipeline and switch.forwarding != "routed"
    if of13:
        s["flow_layout"] = "auto" if pipeline else "single"
    if of13:
        s["packet_in_rate"] = switch.packet_in_rate if shapes.get(SHAPE_METER) else 0
    if rate is not None:
        s["flow_mod_rate"] = 0 if rate > 20000 else max(10, int(rate * 0.8 // 10 * 10))
    if lags:
        worst = max(lags)
        if statistics.median(lags) < 0.005:  # forwards at the barrier (a lone late packet-in is scheduling)
            s["confirm"] = "barrier"
        else:
            s["confirm"] = "counters" if of13 else "delay"
            s["confirm_delay"] = round(max(0.1, worst * 1.5), 1)
    if size is not None:
        s["max_shunts"] = max(0, (size - 2 * len(switch.ports)) // entries_per_pair(teardown, pipeline))
    if not shapes or not all(ok for name, ok in shapes.items() if name in REQUIRED):
        report.ok = False


Extra = Callable[["Prober", Report], None]  # a further probe after the recommendation (probe_routed.probe)


def run(cfg: Config, wait: float, pairs: int, lag_runs: int, extra: tuple[Extra, ...] = ()) -> int:
    """The probe; exits the process (os-ken's listener threads cannot be stopped), also
    when the probe itself fails (its traceback printed): else the process would hang."""
    try:
        code = _run(cfg, wait, pairs, lag_runs, extra)
    except Exception:  # noqa: BLE001 (whatever it was: said, and the process ends)
        traceback.print_exc()
        print("probe-switch: failed (the traceback above); the switch may hold probe flows: delete them by "
              "cookie/mask " + ", ".join(f"0x{c:016x}/0x{m:016x}" for c, m in PROBE_FLOWS), file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _port_free(cfg: Config) -> str | None:
    """Why the probe cannot listen where the switch connects (the controller does), or None."""
    family = socket.AF_INET6 if ":" in cfg.listen_address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((cfg.listen_address, cfg.listen_port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def _run(cfg: Config, wait: float, pairs: int, lag_runs: int, extra: tuple[Extra, ...]) -> int:
    busy = _port_free(cfg)
    if busy is not None:
        print(f"probe-switch: cannot listen on {cfg.listen_address}:{cfg.listen_port}: {busy} (stop the controller "
              "first: the switch must connect to the probe)", file=sys.stderr)
        return 1
    from nfshunt.app import controller
    controller._configure_osken(cfg)
    from os_ken.base.app_manager import AppManager

    from nfshunt.openflow.channel import install_connection_factory
    ProbeApp.OFP_VERSIONS = cfg.ofp_versions
    install_connection_factory()
    manager = AppManager.get_instance()
    manager.load_apps(["nfshunt.probe"])
    try:
        manager.instantiate_apps(nfshunt_config=cfg, **manager.create_contexts())
    except OSError as exc:
        print(f"probe-switch: cannot listen on {cfg.listen_address}:{cfg.listen_port}: {exc.strerror or exc} "
              "(stop the controller first: the switch must connect to the probe)", file=sys.stderr)
        return 1
    app = next(a for a in manager.applications.values() if isinstance(a, ProbeApp))
    print(f"probe-switch: waiting up to {wait:.0f} s for the switch on {cfg.listen_address}:{cfg.listen_port} ...",
          flush=True)
    try:
        dp, switch = app.switch.get(timeout=wait)
    except queue.Empty:
        print("probe-switch: no switch connected (is it pointed at this address, and the controller stopped?)",
              file=sys.stderr)
        return 1
    prober = Prober(app, dp, cfg, switch)
    report = Report()
    report.say(f"switch {dp.id:016x} from {dp.address[0]}, OpenFlow {'1.3' if prober.of13 else '1.0'}")
    try:
        prober.delete_probe_flows()
        size = prober.tables(report)
        report.say("flow shapes NFShunt installs (installed, read back, removed):")
        shapes = prober.shapes(report)
        rate = prober.flow_mod_rate(report, pairs)
        lags = prober.lag(report, lag_runs)
        recommend(report, switch, prober.of13, size, shapes, rate, lags)
        for more in extra:
            more(prober, report)
    finally:
        if not prober.delete_probe_flows(wait=CLEAN_WAIT):
            report.ok = False
            report.say(f"the switch still holds probe flows {CLEAN_WAIT:.0f} s after their delete: delete them by "
                       "cookie/mask " + ", ".join(f"0x{c:016x}/0x{m:016x}" for c, m in PROBE_FLOWS))
    several = len(app.cfg.switches) > 1
    print("recommended settings (merge into the config" + (
        f"; all but openflow_versions and tcp_teardown into the entry of switches for {dp.id:016x}"
        if several else "") + "):")
    print(json.dumps(report.settings, indent=2), flush=True)
    return 0 if report.ok else 1
