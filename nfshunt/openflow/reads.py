"""What NFShunt asks a switch (meters, flow and table statistics, barriers) and how it
reads the answers back: flow-stats entries as the core's SwitchFlow, matches as tuples.
FlowBuilder (flows.py) is a SwitchReads; nothing here sends anything.
"""
from __future__ import annotations

import ipaddress
from typing import Any

from os_ken.ofproto import ofproto_v1_0

from nfshunt.config.switch import PortGroup, SwitchConfig
from nfshunt.core.connection import Conn
from nfshunt.records import cookies
from nfshunt.records.model import (
    OFP10,
    TCP,
    UDP,
    VID_MASK,
    VID_PRESENT,
    FlowTuple,
    Retag,
    SwitchFlow,
    TagOp,
    canonical_address,
    retag_ops,
)

from .stats import (
    DEC_TTL,
    IT_APPLY_ACTIONS,
    IT_GOTO_TABLE,
    IT_WRITE_METADATA,
    REWRITE_FIELDS,
    FlowEntry,
    Step,
    routed_rewrite,
)

ETH_IPV6 = 0x86DD
ALL_ONES_64 = 0xFFFFFFFFFFFFFFFF
OFP10_VLAN_NONE = 0xFFFF  # OpenFlow 1.0 dl_vlan: frames without an 802.1Q tag
OFP13_VID_NONE = 0x0000  # OpenFlow 1.3 vlan_vid: no VLAN tag (OFPVID_NONE)
META_GROUP_SHIFT = 48  # bits 48-63 of a pipeline shunt's metadata: port group index + 1 (the egress)
META_CONN_MASK = ((1 << META_GROUP_SHIFT) - 1) & ~cookies.RST_BIT
META_GROUP_MASK = ALL_ONES_64 & ~((1 << META_GROUP_SHIFT) - 1)  # the port group's bits
_PORT_FIELDS = {TCP: ("tcp_src", "tcp_dst"), UDP: ("udp_src", "udp_dst")}  # the match's port fields by protocol
_new_flow = tuple.__new__
_NO_ZONES: dict[int | None, int] = {}
# Instructions NFShunt writes: goto-table, write-metadata, apply-actions (stats.FlowEntry alike).
_OUR_INSTRUCTIONS = frozenset((IT_GOTO_TABLE, IT_WRITE_METADATA, IT_APPLY_ACTIONS))


class _Tags:
    """A switch config's tags as flows read back name them: per fast port, each carried tag
    (0 untagged, VID_PRESENT | id) and its zone; each fast port's group; any trunk at all
    (without one, an untagged pair's flows are checked as before VLANs: no retag to compare)."""

    __slots__ = ("switch", "zones", "groups", "trunked", "controller", "in_port_out")

    def __init__(self, switch: SwitchConfig, controller: int, in_port_out: int):
        self.switch = switch
        self.controller = controller  # the controller's port number in this OpenFlow version
        self.in_port_out = in_port_out  # OFPP_IN_PORT in this version
        self.zones: dict[int | None, dict[int | None, int]] = {
            g.fast: {(VID_PRESENT | vid if vid else 0): zone for vid, zone in g.zone_of_vid.items()}
            for g in switch.ports}
        self.groups: dict[int, PortGroup] = {g.fast: g for g in switch.ports}
        self.trunked = any(g.trunk for g in switch.ports)


class SwitchReads:
    """Requests that ask the switch, and the reading of what it answers. The builder that
    mixes it in sets dp, ofp, parser, version and switch (its switch's config)."""

    dp: Any
    ofp: Any
    parser: Any
    version: int
    switch: SwitchConfig

    def controller_meter(self, rate: int) -> list[Any]:
        """The reserved controller meter (OFPM_CONTROLLER) with one drop band: the switch
        sends at most `rate` packet-ins a second. Deleted first, so a reconnect re-sets it."""
        p, ofp = self.parser, self.ofp
        band = p.OFPMeterBandDrop(rate=rate, burst_size=max(1, rate // 10))
        return [p.OFPMeterMod(self.dp, command=ofp.OFPMC_DELETE, flags=0, meter_id=ofp.OFPM_CONTROLLER, bands=[]),
                p.OFPMeterMod(self.dp, command=ofp.OFPMC_ADD, flags=ofp.OFPMF_PKTPS | ofp.OFPMF_BURST,
                              meter_id=ofp.OFPM_CONTROLLER, bands=[band])]

    def controller_meter_stats_request(self) -> Any:
        """The controller meter's counters: its band counts the packet-ins it dropped."""
        return self.parser.OFPMeterStatsRequest(self.dp, 0, self.ofp.OFPM_CONTROLLER)

    def catcher_stats_request(self) -> Any:
        """Every teardown catcher's counters (OpenFlow 1.3: filtered by cookie on the switch)."""
        p, ofp = self.parser, self.ofp
        return p.OFPFlowStatsRequest(self.dp, 0, ofp.OFPTT_ALL, ofp.OFPP_ANY, ofp.OFPG_ANY,
                                     cookies.make(cookies.Kind.TEARDOWN), cookies.OWNED_MASK | cookies.KIND_MASK,
                                     p.OFPMatch())

    def catcher_stats_request_exact(self, cookie: int) -> Any:
        """One catcher's counters, by its exact cookie: the switch finds it through its
        cookie index, however many flows it holds."""
        p, ofp = self.parser, self.ofp
        return p.OFPFlowStatsRequest(self.dp, 0, ofp.OFPTT_ALL, ofp.OFPP_ANY, ofp.OFPG_ANY, cookie, ALL_ONES_64,
                                     p.OFPMatch())

    def cookie_stats_request(self, cookie: int, mask: int) -> Any:
        """Flow stats of the flows whose cookie matches under `mask` (OpenFlow 1.3)."""
        p, ofp = self.parser, self.ofp
        return p.OFPFlowStatsRequest(self.dp, 0, ofp.OFPTT_ALL, ofp.OFPP_ANY, ofp.OFPG_ANY, cookie, mask,
                                     p.OFPMatch())

    def table_size_request(self) -> Any:
        """What reports table 0's max_entries: table features in 1.3 (an empty body asks,
        never sets), table stats in 1.0."""
        if self.version == OFP10:
            return self.parser.OFPTableStatsRequest(self.dp, 0)
        return self.parser.OFPTableFeaturesStatsRequest(self.dp, 0, [])

    def barrier(self) -> Any:
        return self.parser.OFPBarrierRequest(self.dp)

    def owned_flow_stats_request(self) -> Any:
        p, ofp = self.parser, self.ofp
        if self.version == OFP10:
            # OpenFlow 1.0 cannot filter by cookie; the reply is filtered on our side.
            return p.OFPFlowStatsRequest(self.dp, 0, p.OFPMatch(), 0xFF, ofp.OFPP_NONE)
        return p.OFPFlowStatsRequest(self.dp, 0, ofp.OFPTT_ALL, ofp.OFPP_ANY, ofp.OFPG_ANY,
                                     cookies.OWNED_VALUE, cookies.OWNED_MASK, p.OFPMatch())

    def pair_stats_request(self, conn: Conn, catchers: bool = False) -> Any:
        """Flow stats of one pair's two flows (OpenFlow 1.3: by cookie, either direction);
        with `catchers`, its teardown catchers too (any kind, FIN or RST; their cookies name
        no authority)."""
        p, ofp = self.parser, self.ofp
        mask = ALL_ONES_64 & ~cookies.DIRECTION_BIT & ~cookies.AUTHORITY_MASK
        if catchers:
            mask &= ~cookies.RST_BIT & ~cookies.KIND_MASK
        return p.OFPFlowStatsRequest(self.dp, 0, ofp.OFPTT_ALL, ofp.OFPP_ANY, ofp.OFPG_ANY, conn.cookie(False),
                                     mask, p.OFPMatch())

    def more_follows(self, msg: Any) -> bool:
        flag = self.ofp.OFPSF_REPLY_MORE if self.version == OFP10 else self.ofp.OFPMPF_REPLY_MORE
        return bool(msg.flags & flag)

    # --- reading flows back ----------------------------------------------------------------

    def parse_stats(self, stats: Any) -> SwitchFlow:
        """A flow-stats entry (os-ken's, or FlowEntry's straight from the bytes) as the core
        reads it. Exact: the shape of a pair this version installs: every field of a pair's
        match, the tag one its in_port's group carries (the tuple then in that tag's zone),
        and the actions this version writes for its ports and zone (retag included)."""
        goto, metadata = False, None
        tags = getattr(self, "_tags_of", None)  # (written out: a reconcile reads 200,000 flows)
        if tags is None or tags.switch is not self.switch:
            tags = self._tags()
        if isinstance(stats, FlowEntry):
            fields = stats.fields
            vlan = fields.get("vlan_vid")
            zone = tags.zones.get(fields.get("in_port"), _NO_ZONES).get(vlan)
            in_port, t = self._parse_oxm(fields.get, False, zone or 0)  # (inet_ntop text already)
            outs, goto, metadata, retag, rewrite = stats.outs, stats.goto, stats.metadata, stats.retag, stats.rewrite
            pcp = fields.get("vlan_pcp")
            # _exact_oxm without a set built per flow (a reconcile reads 200,000): once the
            # tuple, in_port and tag are read (checked below), the fields hold seven of a
            # pair's eight, so they are one of PAIR_FIELDS exactly when eth_type is the eighth.
            exact = zone is not None and len(fields) == 8 and "eth_type" in fields and not stats.foreign
        else:
            vlan = self._vlan_of(stats.match)
            pcp = None if self.version == OFP10 else stats.match.get("vlan_pcp")
            in_port, t = self.parse_match(stats.match)
            zone = tags.zones.get(in_port, _NO_ZONES).get(vlan)
            exact = zone is not None and self._exact_match(stats.match)
            if self.version == OFP10:
                actions = stats.actions
            else:
                actions = [a for i in stats.instructions for a in getattr(i, "actions", [])]
                goto = any(isinstance(i, self.parser.OFPInstructionGotoTable) for i in stats.instructions)
                metadata = next((i.metadata for i in stats.instructions
                                 if isinstance(i, self.parser.OFPInstructionWriteMetadata)), None)
                exact = exact and all(i.type in _OUR_INSTRUCTIONS for i in stats.instructions)
            outs = [a.port for a in actions if hasattr(a, "port")]
            retag, steps, foreign = self._retag_of(actions)
            rewrite = routed_rewrite(steps) if steps else None
            exact = exact and not foreign and (rewrite is not None or not steps)
        out_port = outs[0] if outs else None
        if out_port == tags.controller and len(outs) > 1:
            out_port = outs[1]  # a retagging catcher or watch: the controller's copy first, then the peer
        if out_port == tags.in_port_out and in_port is not None:
            out_port = in_port  # a router on a stick's (flows.py _direction)
        exact = t is not None and in_port is not None and exact
        if goto:  # the pipeline layout: the port is the one table 1 outputs the group to
            group = (metadata >> META_GROUP_SHIFT) - 1 if metadata is not None else -1
            ports = self.switch.ports
            out_port = ports[group].fast if 0 <= group < len(ports) else None
            # The catchers name the connection by the metadata: it must be this pair's.
            exact = exact and metadata is not None and metadata & META_CONN_MASK == stats.cookie & META_CONN_MASK
        if exact and (zone or retag or tags.trunked):
            exact = self._retag_right(tags, in_port, out_port, zone or 0, retag, vlan)  # type: ignore[arg-type]
        # SwitchFlow's fields in order (its Python-level __new__ skipped, as cookies.parse does)
        return _new_flow(SwitchFlow, (stats.cookie, stats.priority, in_port, t, out_port, stats.packet_count,
                                      stats.byte_count, stats.duration_sec + stats.duration_nsec / 1e9, goto, exact,
                                      stats.hard_timeout, vlan, retag, pcp, rewrite))

    def _tags(self) -> "_Tags":
        """The switch config's tags by fast port, built once per config (a reconcile reads 200,000 flows)."""
        tags = getattr(self, "_tags_of", None)
        if tags is None or tags.switch is not self.switch:
            tags = self._tags_of = _Tags(self.switch, self.ofp.OFPP_CONTROLLER, self.ofp.OFPP_IN_PORT)
        return tags

    @staticmethod
    def _retag_right(tags: "_Tags", in_port: int, out_port: int | None, zone: int, retag: Retag,
                     vlan: int | None) -> bool:
        """A pair's flow does to the tag what this version builds for its ports and zone:
        nothing for a block (no output), the bridge's retag for a shunt (flows.py); a routed
        shunt's from its match's tag to one of an interface behind its output's group."""
        if out_port is None:
            return not retag
        ingress, egress = tags.groups[in_port], tags.groups.get(out_port)
        if egress is None:
            return False
        if tags.switch.sides:
            vid_in = (vlan or 0) & VID_MASK
            return any(retag == retag_ops(vid_in, vid) for (fast, vid) in tags.switch.side_at if fast == out_port)
        if zone not in egress.vid_of_zone:
            return False
        return retag == retag_ops(ingress.vid_of_zone[zone], egress.vid_of_zone[zone])

    def _vlan_of(self, m: Any) -> int | None:
        """An os-ken match's tag as SwitchFlow.vlan has it (1.0's dl_vlan in 1.3's terms)."""
        if self.version == OFP10:
            if m.wildcards & self.ofp.OFPFW_DL_VLAN:
                return None
            return 0 if m.dl_vlan == OFP10_VLAN_NONE else VID_PRESENT | m.dl_vlan
        vlan = m.get("vlan_vid")
        return None if isinstance(vlan, tuple) else vlan  # (a masked tag: any of several, never ours)

    def _retag_of(self, actions: list[Any]) -> tuple[Retag, list[Step], bool]:
        """What os-ken's actions do to the tag, a routed pair's rewrite steps, and whether
        they do anything else (as stats._actions reads the bytes)."""
        p = self.parser
        retag: list[tuple[TagOp, int]] = []
        steps: list[Step] = []
        foreign = left = False
        for a in actions:
            if hasattr(a, "port") and isinstance(a, p.OFPActionOutput):
                left = left or a.port != self.ofp.OFPP_CONTROLLER
                continue
            name = type(a).__name__
            if name == "OFPActionDecNwTtl" or name == "OFPActionSetField" and a.key in REWRITE_FIELDS:
                value = None if name == "OFPActionDecNwTtl" else a.value
                if isinstance(value, str) and a.key.startswith("ipv"):
                    value = canonical_address(value)
                steps.append((DEC_TTL, None) if value is None else (a.key, value))
                foreign = foreign or left or bool(retag)
                continue
            if name == "OFPActionPushVlan":
                retag.append((TagOp.PUSH, a.ethertype))
            elif name in ("OFPActionPopVlan", "OFPActionStripVlan"):
                retag.append((TagOp.POP, 0))
            elif name == "OFPActionVlanVid":
                retag.append((TagOp.SET_VID, a.vlan_vid))
            elif name == "OFPActionSetField" and a.key == "vlan_vid":
                retag.append((TagOp.SET_VID, a.value & VID_MASK))
                foreign = foreign or not a.value & VID_PRESENT
            else:
                foreign = True
                continue
            foreign = foreign or left
        return tuple(retag), steps, foreign

    # The OXM fields of a pair's match, by IP version and transport (see match()).
    PAIR_FIELDS = {frozenset(("in_port", "vlan_vid", "eth_type", "ip_proto", f"ipv{v}_src", f"ipv{v}_dst",
                              f"{l4}_src", f"{l4}_dst")) for v in (4, 6) for l4 in ("tcp", "udp")}
    # OpenFlow 1.0: the fields NFShunt matches are not wildcarded (addresses: no bit of them).
    OFP10_PAIR_FIELDS = (ofproto_v1_0.OFPFW_IN_PORT | ofproto_v1_0.OFPFW_DL_VLAN | ofproto_v1_0.OFPFW_DL_TYPE
                         | ofproto_v1_0.OFPFW_NW_PROTO | ofproto_v1_0.OFPFW_NW_SRC_MASK
                         | ofproto_v1_0.OFPFW_NW_DST_MASK | ofproto_v1_0.OFPFW_TP_SRC | ofproto_v1_0.OFPFW_TP_DST)

    def _exact_match(self, m: Any) -> bool:
        """Every field of a pair's match and nothing more (its tag: parse_stats checks it)."""
        if self.version == OFP10:
            return not m.wildcards & self.OFP10_PAIR_FIELDS
        fields = dict(m.items())
        return not any(isinstance(v, tuple) for v in fields.values()) and frozenset(fields) in self.PAIR_FIELDS

    def parse_match(self, m: Any) -> tuple[int | None, FlowTuple | None]:
        """(in_port, tuple) of an exact NFShunt match (in the zone its in_port's group
        carries its tag in); tuple is None for other matches."""
        if self.version == OFP10:
            in_port = None if m.wildcards & self.ofp.OFPFW_IN_PORT else m.in_port
        else:
            in_port = m.get("in_port")
        zone = self._tags().zones.get(in_port, _NO_ZONES).get(self._vlan_of(m)) or 0
        if self.version == OFP10:
            if m.wildcards & (self.ofp.OFPFW_NW_PROTO | self.ofp.OFPFW_TP_SRC | self.ofp.OFPFW_TP_DST):
                return in_port, None
            return in_port, FlowTuple(4, m.nw_proto, str(ipaddress.IPv4Address(m.nw_src)),
                                      str(ipaddress.IPv4Address(m.nw_dst)), m.tp_src, m.tp_dst, zone)
        return self._parse_oxm(m.get, zone=zone)

    @staticmethod
    def _parse_oxm(get: Any, canonical: bool = True, zone: int = 0) -> tuple[int | None, FlowTuple | None]:
        in_port = get("in_port")
        proto = get("ip_proto")
        if proto not in (TCP, UDP):
            return in_port, None
        if get("eth_type") == ETH_IPV6:
            family, src, dst = 6, get("ipv6_src"), get("ipv6_dst")
        else:
            family, src, dst = 4, get("ipv4_src"), get("ipv4_dst")
        l4_src, l4_dst = _PORT_FIELDS[proto]
        sport, dport = get(l4_src), get(l4_dst)
        if None in (src, dst, sport, dport):
            return in_port, None
        if canonical:
            src, dst = canonical_address(str(src)), canonical_address(str(dst))
        return in_port, FlowTuple(family, proto, src, dst, sport, dport, zone)
