"""The flow builder: core commands -> os-ken OpenFlow 1.0 / 1.3 messages, and back.

Pure functions of a protocol description (a connected Datapath, or os-ken's
ProtocolDesc in tests); nothing here sends anything.
"""
from __future__ import annotations

from typing import Any

from nfshunt.config.settings import Config
from nfshunt.config.static import StaticFlow
from nfshunt.config.switch import PortGroup, SwitchConfig
from nfshunt.core.address_flows import AddressFlow
from nfshunt.core.connection import Action, Conn
from nfshunt.core.layout import catches_teardown, goes_to_pipeline, pair_entries
from nfshunt.records import cookies
from nfshunt.records.model import OFP10, TCP, FlowTuple

from .basics import ETH_IPV4, OFPVID_PRESENT, FlowBasics
from .reads import (
    ALL_ONES_64,
    ETH_IPV6,
    META_CONN_MASK,
    META_GROUP_MASK,
    META_GROUP_SHIFT,
    OFP13_VID_NONE,
)
from .templates import Templates, with_hard

TCP_FIN, TCP_RST = 0x01, 0x04
TEARDOWN_HEADERS = 128  # bytes of a caught FIN/RST sent to the controller: Ethernet, IP, TCP
REMOVED_REASONS = {0: "idle timeout", 1: "hard timeout", 2: "delete", 3: "group delete"}

# The pipeline layout (flow_layout): a TCP shunt's two flows in table 0 write the
# connection into the metadata and go on to table 1, where per port group one flow outputs
# and four catch FIN and RST (IPv4, IPv6: tcp_flags needs the protocol) for the controller.
# 2 entries a shunt instead of 6; the packet-in's metadata names the connection.
# Metadata bits 48-63 name the egress port group, bits 0-47 the connection as its flows'
# cookies do: conntrack id, direction, slot (META_GROUP_SHIFT, META_CONN_MASK: flowreads.py).
PIPELINE_TABLE = 1


def pipeline_metadata(group: int, cookie: int) -> int:
    """What a pair's table-0 flow (with this cookie) writes for table 1."""
    return ((group + 1) << META_GROUP_SHIFT) | (cookie & META_CONN_MASK)


def metadata_teardown(metadata: int) -> tuple[int, bool]:
    """(pair key, reply direction) a table-1 catcher's packet-in carries."""
    parsed = cookies.parse(cookies.make(cookies.Kind.SHUNT) | (metadata & META_CONN_MASK))
    assert parsed is not None
    return parsed.key, parsed.reply


def idle_timeout(cfg: Config, conn: Conn) -> int:
    """The idle timeout a pair's flows get: its IDS rule's, else the config's default for its action."""
    if conn.idle_timeout is not None:
        return conn.idle_timeout
    return cfg.default_shunt_timeout if conn.action is Action.SHUNT else cfg.default_block_timeout


OFPR_INVALID_TTL = 2  # OpenFlow 1.3's packet-in reason for a frame dec_ttl found expiring


def invalid_ttl_packet_ins(dp: Any) -> Any:
    """OpenFlow 1.3 OFPT_SET_ASYNC: as master, packet-ins for no match, an action and an
    expiring TTL (off by default in Open vSwitch: the frame is dropped unheard), all port
    status and flow-removed reasons; nothing as slave (the defaults otherwise). OF1.3 has no
    set-config flag for it (OFPC_INVALID_TTL_TO_CONTROLLER is 1.1-1.2's)."""
    p = dp.ofproto_parser
    return p.OFPSetAsync(dp, packet_in_mask=[0b111, 0], port_status_mask=[0b111, 0b111],
                         flow_removed_mask=[0b1111, 0])


def packet_out(dp: Any, port: int, data: bytes) -> Any:
    """A frame the controller hands on, whole, out of `port`."""
    p, ofp = dp.ofproto_parser, dp.ofproto
    return p.OFPPacketOut(dp, buffer_id=ofp.OFP_NO_BUFFER, in_port=ofp.OFPP_CONTROLLER,
                          actions=[p.OFPActionOutput(port)], data=data)


def routed_actions(p: Any, conn: Conn, reply: bool) -> tuple[Any, ...]:
    """A routed shunt's rewrite of one direction, as its router's (docs/design/routed.md):
    TTL / hop limit - 1 first (an expiring frame then reaches the controller as it arrived),
    the egress interface's MAC as source, the next hop's as destination. None bridged."""
    if conn.hops is None:
        return ()
    hop = conn.hops[reply]
    return (p.OFPActionDecNwTtl(), p.OFPActionSetField(eth_src=hop.eth_src), p.OFPActionSetField(eth_dst=hop.eth_dst),
            *nat_actions(p, conn, reply))


def static_rewrite(p: Any, flow: StaticFlow) -> tuple[Any, ...]:
    """A static flow's router's rewrite through a routing firewall (its `via`'s next hop, as
    routed_actions does a pair's); none bridged, none for a block's drop."""
    hop = flow.hop
    if hop is None or flow.out_port is None:
        return ()
    return (p.OFPActionDecNwTtl(), p.OFPActionSetField(eth_src=hop.eth_src), p.OFPActionSetField(eth_dst=hop.eth_dst))


def nat_actions(p: Any, conn: Conn, reply: bool) -> tuple[Any, ...]:
    """A NAT pair's translation of one direction (records.model.nat_rewrite), after the
    router's rewrite: set_field on the addresses and ports that change (Open vSwitch fixes
    the checksums). The reverse flow matches the reply tuple as it arrives (F15)."""
    if conn.nat is None:
        return ()
    rw, t = conn.nat[reply], conn.orig
    ip = "ipv4" if t.family == 4 else "ipv6"
    l4 = "tcp" if t.proto == TCP else "udp"
    fields = ((f"{ip}_src", rw.src), (f"{l4}_src", rw.sport), (f"{ip}_dst", rw.dst), (f"{l4}_dst", rw.dport))
    return tuple(p.OFPActionSetField(**{name: value}) for name, value in fields if value is not None)


def direction_tags(conn: Conn, reply: bool) -> tuple[int, int]:
    """(tag in, tag out) of a direction's frames: each side's VLAN for the connection's zone
    (admission shunts only a zone both groups carry), or a routed one's interfaces'
    (Conn.tags); (0, 0) untagged."""
    tags = conn.tags
    if tags is None:
        raise ValueError(f"zone {conn.orig.zone} is not carried by both port groups of {conn.describe()}")
    vid_in, vid_out = tags
    return (vid_out, vid_in) if reply else (vid_in, vid_out)


class FlowBuilder(FlowBasics):
    """The messages that change the switch's table; the ones that ask it something and
    read its answers are SwitchReads' (flowreads.py)."""

    def __init__(self, dp: Any, cfg: Config, pipeline: bool = False, switch: SwitchConfig | None = None):
        """switch: which of cfg.switches it builds for (the first by default)."""
        self.dp = dp
        self.ofp = dp.ofproto
        self.parser = dp.ofproto_parser
        self.version = self.ofp.OFP_VERSION
        self.cfg = cfg  # the controller's keys
        self.switch = cfg.switches[0] if switch is None else switch  # the switch's own
        self.pipeline = pipeline and self.version != OFP10
        self._group = {g: i for i, g in enumerate(self.switch.ports)}
        self.templates = Templates()
        self.templated = True  # off: every message from os-ken (tests compare the two)

    def _templated(self, key: tuple, build: Any, family: int, cookie: int, t: FlowTuple,
                   meta: Any = None, ports: tuple[bool, bool] = (True, True), hard: int = 0,
                   fresh: bool = False) -> Any:
        """The message for (cookie, tuple) from the cached template of its shape; `meta`
        (cookie -> metadata) for a flow that carries the connection into table 1; `hard`, a
        pair's hard timeout, patched in (one template serves every value). `fresh` (a NAT
        pair's: its set_fields are its own) builds it each time."""
        if not self.templated or fresh:
            return with_hard(build(cookie, t), hard)
        return self.templates.flow(key, build, family, cookie, t, meta, ports, hard)


    # --- flow-mods ----------------------------------------------------------------------


    def _add(self, match: Any, out_port: int | None, cookie: int, priority: int,
             idle: int, notify: bool, retag: list[Any] | None = None, rewrite: tuple[Any, ...] = ()) -> Any:
        p, ofp = self.parser, self.ofp
        flags = ofp.OFPFF_SEND_FLOW_REM if notify else 0
        actions = [] if out_port is None else [*rewrite, *(retag or ()), p.OFPActionOutput(out_port)]
        if self.version == OFP10:
            return p.OFPFlowMod(self.dp, match=match, cookie=cookie, command=ofp.OFPFC_ADD,
                                idle_timeout=idle, priority=priority, flags=flags, actions=actions)
        inst = [p.OFPInstructionActions(ofp.OFPIT_APPLY_ACTIONS, actions)] if actions else []
        return p.OFPFlowMod(self.dp, cookie=cookie, command=ofp.OFPFC_ADD, idle_timeout=idle,
                            priority=priority, flags=flags, match=match, instructions=inst)

    def _delete(self, match: Any, priority: int, cookie: int) -> Any:
        p, ofp = self.parser, self.ofp
        if self.version == OFP10:
            return p.OFPFlowMod(self.dp, match=match, command=ofp.OFPFC_DELETE_STRICT,
                                priority=priority, out_port=ofp.OFPP_NONE)
        return p.OFPFlowMod(self.dp, cookie=cookie, cookie_mask=ALL_ONES_64,
                            command=ofp.OFPFC_DELETE_STRICT, priority=priority,
                            out_port=ofp.OFPP_ANY, out_group=ofp.OFPG_ANY, match=match)

    def defaults(self, groups: tuple[PortGroup, ...]) -> list[Any]:
        """Low-priority fast<->slow patching: everything crosses the firewall. A trunk's
        group patches only its configured tags (the tag kept), and one priority below a
        drop per port counts every other frame (other VLANs, VLAN 0, 4095, untagged when
        not carried): only what the firewall bridges into a zone reaches it."""
        cookie = cookies.make(cookies.Kind.DEFAULT)
        prio = self.cfg.default_priority
        out = []
        for g in groups:
            if not g.trunk:
                out.append(self._add(self.match(g.fast), g.slow, cookie, prio, 0, False))
                out.append(self._add(self.match(g.slow), g.fast, cookie, prio, 0, False))
                continue
            for vid in sorted(g.zone_of_vid):
                for a, b in ((g.fast, g.slow), (g.slow, g.fast)):
                    out.append(self._add(self._vlan_match(a, vid), b, cookie, prio, 0, False))
            index = self._group[g]
            out.extend(self._add(self.match(port), None, cookies.make(cookies.Kind.VLAN_DROP, index, slow), prio - 1,
                                 0, False) for slow, port in ((False, g.fast), (True, g.slow)))
        return out


    def _direction(self, conn: Conn, reply: bool) -> tuple[int, FlowTuple, int]:
        """(in_port, tuple, output port); a router on a stick's outputs to OFPP_IN_PORT."""
        if reply:
            in_port, t, out = conn.egress.fast, conn.reply, conn.ingress.fast
        else:
            in_port, t, out = conn.ingress.fast, conn.orig, conn.egress.fast
        return in_port, t, self.ofp.OFPP_IN_PORT if out == in_port else out

    def _priority(self, conn: Conn) -> int:
        return self.cfg.shunt_priority if conn.action is Action.SHUNT else self.cfg.block_priority

    def catchers_of_its_own(self, conn: Conn) -> bool:
        """A TCP shunt of the single-table layout: four catchers beside its two flows."""
        return not self.pipeline and catches_teardown(self.version, self.cfg, conn)

    def install_cost(self, conn: Conn) -> int:
        """Flow-mods install() writes for this connection (what pacing counts)."""
        return pair_entries(self.version, self.cfg, conn, self.pipeline)

    def install(self, conn: Conn) -> list[Any]:
        """The two exact-match flows of a shunt (output to the peer fast port) or a block
        (no actions: the switch drops); for a TCP shunt on OpenFlow 1.3, FIN and RST
        catchers one priority above, which forward the packet and tell the controller."""
        shunt = conn.action is Action.SHUNT
        idle = idle_timeout(self.cfg, conn)
        out = []
        prio = self._priority(conn)
        if goes_to_pipeline(self.version, self.cfg, conn.action, conn.orig.proto, self.pipeline):
            for reply in (False, True):
                in_port, t, _ = self._direction(conn, reply)
                group = self._group[conn.ingress if reply else conn.egress]

                def meta(cookie: int, group: int = group) -> int:
                    return pipeline_metadata(group, cookie)

                vids = direction_tags(conn, reply)
                rewrite = routed_actions(self.parser, conn, reply)

                def build_goto(cookie: int, tt: FlowTuple, in_port: int = in_port, meta: Any = meta,
                               vids: tuple[int, int] = vids, rewrite: tuple[Any, ...] = rewrite) -> Any:
                    return self._goto(self.match(in_port, tt, vid=vids[0]), meta(cookie), cookie, prio, idle,
                                      [*rewrite, *self.retag(*vids)])
                out.append(self._templated(("goto", t.family, in_port, group, reply, prio, idle, vids,
                                            conn.hops[reply] if rewrite and conn.hops else ()), build_goto,
                                           t.family, conn.cookie(reply), t, meta, hard=conn.hard_timeout,
                                           fresh=conn.nat is not None))
            return out
        for reply in (False, True):
            in_port, t, peer = self._direction(conn, reply)
            out_port = peer if shunt else None
            vids = direction_tags(conn, reply)
            rewrite = routed_actions(self.parser, conn, reply) if shunt else ()

            def build(cookie: int, tt: FlowTuple, in_port: int = in_port, out_port: int | None = out_port,
                      vids: tuple[int, int] = vids, rewrite: tuple[Any, ...] = rewrite) -> Any:
                return self._add(self.match(in_port, tt, vid=vids[0]), out_port, cookie, prio, idle, True,
                                 self.retag(*vids), rewrite)
            out.append(self._templated(("add", t.family, t.proto, in_port, out_port, prio, idle, vids,
                                        conn.hops[reply] if rewrite and conn.hops else ()), build,
                                       t.family, conn.cookie(reply), t, hard=conn.hard_timeout,
                                       fresh=conn.nat is not None))
        if self.catchers_of_its_own(conn):
            out.extend(self._catchers(conn))
        return out

    def static_add(self, flow: StaticFlow) -> Any:
        """A static shunt's flow (OpenFlow 1.3, config.py checks): its prefixes masked,
        an omitted port any, its tag (untagged frames only, or its VLAN's) and priority if
        it names one, retagged as the firewall's bridge would; no idle timeout, no
        flow-removed. Templated by shape as a pair's flows are (a reload of 1,000 streams
        writes 2,000); an address-less one (a VLAN priority's every frame) built whole."""
        sport, dport = flow.src_port is not None, flow.dst_port is not None
        tag: dict[str, Any] = {"vlan_vid": OFPVID_PRESENT | flow.vid_in if flow.vid_in else OFP13_VID_NONE}
        if flow.pcp is not None:
            tag["vlan_pcp"] = flow.pcp
        retag = self.retag(flow.vid_in, flow.vid_out) if flow.out_port is not None else []
        rewrite = static_rewrite(self.parser, flow)

        def finish(fields: dict[str, Any], cookie: int) -> Any:
            msg = self._add(self.parser.OFPMatch(**fields), flow.out_port, cookie, flow.priority, 0, False, retag,
                            rewrite)
            msg.hard_timeout = flow.hard_timeout
            return msg
        if flow.src is None or flow.dst is None or flow.proto is None:
            return finish({"in_port": flow.in_port, **tag}, flow.cookie)
        t = FlowTuple(flow.src.version, flow.proto, str(flow.src.network_address),
                      str(flow.dst.network_address), flow.src_port or 0, flow.dst_port or 0)
        src, dst = flow.src, flow.dst

        def build(cookie: int, tt: FlowTuple) -> Any:
            fields: dict[str, Any] = {"in_port": flow.in_port, **tag, "ip_proto": tt.proto,
                                      "eth_type": ETH_IPV4 if tt.family == 4 else ETH_IPV6}
            for side, address, net in (("src", tt.src, src), ("dst", tt.dst, dst)):
                full = net.prefixlen == net.max_prefixlen
                fields[f"ipv{tt.family}_{side}"] = address if full else (address, str(net.netmask))
            l4 = "tcp" if tt.proto == TCP else "udp"
            for side, port, given in (("src", tt.sport, sport), ("dst", tt.dport, dport)):
                if given:
                    fields[f"{l4}_{side}"] = port
            return finish(fields, cookie)
        shape: tuple[Any, ...] = ("static", t.family, t.proto, flow.in_port, flow.out_port, src.prefixlen,
                                  dst.prefixlen, sport, dport, flow.priority, flow.hard_timeout)
        if flow.vid_in or flow.vid_out or flow.pcp is not None:  # (an untagged one's key as before)
            shape += (flow.vid_in, flow.vid_out, flow.pcp)
        # (a routed one's MACs are its own: built whole, as a NAT pair's)
        return self._templated(shape, build, t.family, flow.cookie, t, ports=(sport, dport), fresh=bool(rewrite))

    def address_block_add(self, flow: AddressFlow, now: float) -> Any:
        """An address block's drop (OpenFlow 1.3): any port, any IP protocol, the prefix
        as source or destination; the hard timeout ends it on time, its flow-removed
        reports the counters."""
        p, ofp = self.parser, self.ofp
        net = flow.net
        side = "dst" if flow.to else "src"
        address = str(net.network_address)
        value = address if net.prefixlen == net.max_prefixlen else (address, str(net.netmask))
        eth_type = ETH_IPV4 if net.version == 4 else ETH_IPV6
        match = p.OFPMatch(**{"eth_type": eth_type, f"ipv{net.version}_{side}": value})
        return p.OFPFlowMod(self.dp, cookie=flow.cookie, command=ofp.OFPFC_ADD, hard_timeout=flow.hard_timeout(now),
                            priority=flow.priority, flags=ofp.OFPFF_SEND_FLOW_REM, match=match, instructions=[])

    def static_stats_request(self) -> Any:
        """The counters of every static flow (by cookie kind, on the switch)."""
        p, ofp = self.parser, self.ofp
        return p.OFPFlowStatsRequest(self.dp, 0, 0, ofp.OFPP_ANY, ofp.OFPG_ANY, cookies.make(cookies.Kind.STATIC),
                                     cookies.OWNED_MASK | cookies.KIND_MASK, p.OFPMatch())

    def _goto(self, match: Any, metadata: int, cookie: int, priority: int, idle: int,
              apply: list[Any] | None = None, modify: bool = False) -> Any:
        """A pair's table-0 flow of the pipeline layout; `apply` (a routed pair's rewrite, a retag)
        before table 1 outputs and catches; `modify`: replaced in place (a routed pair's new MAC)."""
        p, ofp = self.parser, self.ofp
        inst = [p.OFPInstructionWriteMetadata(metadata, META_GROUP_MASK | META_CONN_MASK),
                p.OFPInstructionGotoTable(PIPELINE_TABLE)]
        if apply:
            inst.insert(0, p.OFPInstructionActions(ofp.OFPIT_APPLY_ACTIONS, apply))
        return p.OFPFlowMod(self.dp, cookie=cookie, command=ofp.OFPFC_MODIFY_STRICT if modify else ofp.OFPFC_ADD,
                            idle_timeout=idle, priority=priority, flags=ofp.OFPFF_SEND_FLOW_REM, match=match,
                            instructions=inst)

    def pipeline_flows(self, groups: tuple[PortGroup, ...]) -> list[Any]:
        """Table 1 of the pipeline layout: per port group, the output of every TCP shunt
        whose egress it is, and above it FIN and RST catchers that output and send the
        headers to the controller (the metadata in the packet-in names the connection)."""
        p, ofp = self.parser, self.ofp
        out = []
        for i, g in enumerate(groups):
            meta = ((i + 1) << META_GROUP_SHIFT, META_GROUP_MASK)
            forward = [p.OFPInstructionActions(ofp.OFPIT_APPLY_ACTIONS, [p.OFPActionOutput(g.fast)])]
            out.append(p.OFPFlowMod(self.dp, table_id=PIPELINE_TABLE, cookie=cookies.make_pipeline(i),
                                    command=ofp.OFPFC_ADD, priority=1, match=p.OFPMatch(metadata=meta),
                                    instructions=forward))
            catch = [p.OFPInstructionActions(ofp.OFPIT_APPLY_ACTIONS, [
                p.OFPActionOutput(g.fast), p.OFPActionOutput(ofp.OFPP_CONTROLLER, TEARDOWN_HEADERS)])]
            for rst, bit in ((False, TCP_FIN), (True, TCP_RST)):
                for eth_type in (ETH_IPV4, ETH_IPV6):
                    match = p.OFPMatch(metadata=meta, eth_type=eth_type, ip_proto=TCP, tcp_flags=(bit, bit))
                    out.append(p.OFPFlowMod(self.dp, table_id=PIPELINE_TABLE,
                                            cookie=cookies.make_pipeline(i, True, rst), command=ofp.OFPFC_ADD,
                                            priority=2, match=match, instructions=catch))
        return out

    def _catchers(self, conn: Conn) -> list[Any]:
        p, ofp = self.parser, self.ofp
        # The switch forwards the FIN/RST itself and sends only its headers to the
        # controller: the close never depends on re-injecting a packet (a large FIN segment
        # cannot always be carried by packet-out). No timeout (FINs are rare, an idle
        # timeout would expire under a live shunt): they go with the pair, and reconcile
        # deletes any a dead controller left behind. A pair's hard timeout is theirs too.
        out = []
        prio = self._priority(conn) + 1
        for reply in (False, True):
            in_port, t, peer = self._direction(conn, reply)
            vids = direction_tags(conn, reply)
            actions = self._forward_and_tell(peer, vids, routed_actions(p, conn, reply))
            inst = [p.OFPInstructionActions(ofp.OFPIT_APPLY_ACTIONS, actions)]
            for rst, bit in ((False, TCP_FIN), (True, TCP_RST)):
                def build(cookie: int, tt: FlowTuple, in_port: int = in_port, bit: int = bit,
                          inst: list[Any] = inst, vid: int = vids[0]) -> Any:
                    return p.OFPFlowMod(self.dp, cookie=cookie, command=ofp.OFPFC_ADD, priority=prio,
                                        match=self.match(in_port, tt, tcp_flags=(bit, bit), vid=vid),
                                        instructions=inst)
                out.append(self._templated(("catch", t.family, in_port, peer, bit, prio, vids, conn.hops), build,
                                           t.family, cookies.make_teardown(conn.key, reply, rst), t,
                                           hard=conn.hard_timeout, fresh=conn.nat is not None))
        return out

    def _forward_and_tell(self, peer: int, vids: tuple[int, int], rewrite: tuple[Any, ...] = ()) -> list[Any]:
        """Output to the peer and the headers to the controller; with a retag (or a routed
        rewrite) the controller's copy goes first, so the packet-in shows the frame as it arrived."""
        p, ofp = self.parser, self.ofp
        tell = p.OFPActionOutput(ofp.OFPP_CONTROLLER, TEARDOWN_HEADERS)
        retag = self.retag(*vids)
        if retag or rewrite:
            return [tell, *rewrite, *retag, p.OFPActionOutput(peer)]
        return [p.OFPActionOutput(peer), tell]

    def watch(self, conn: Conn) -> list[Any]:
        """A caught close on watch (core/close_watch.py): the pair's two flows changed in
        place (same match, priority and cookie: no entry more) to send each packet to the
        peer (an RST's grace) or to the bridge port of its side, as the defaults would, and
        its headers to the controller. Handed back, its own catchers go (the firewall sees
        a FIN or RST now); `install` puts the pair back as it was."""
        p, ofp = self.parser, self.ofp
        forwarding = conn.watch is not None and conn.watch.forwarding
        out = []
        for reply in (False, True):
            in_port, t, peer = self._direction(conn, reply)
            vids = direction_tags(conn, reply)
            # To its own side's slow link the frame keeps its tag: that link carries the fast port's.
            actions = self._forward_and_tell(peer if forwarding else (conn.egress if reply else conn.ingress).slow,
                                             vids if forwarding else (0, 0),
                                             routed_actions(p, conn, reply) if forwarding else ())
            out.append(p.OFPFlowMod(self.dp, cookie=conn.cookie(reply), command=ofp.OFPFC_MODIFY_STRICT,
                                    idle_timeout=idle_timeout(self.cfg, conn), priority=self._priority(conn),
                                    flags=ofp.OFPFF_SEND_FLOW_REM, match=self.match(in_port, t, vid=vids[0]),
                                    instructions=[p.OFPInstructionActions(ofp.OFPIT_APPLY_ACTIONS, actions)]))
        if self.catchers_of_its_own(conn) and not forwarding:
            out.extend(self._delete_cookie(cookies.make_teardown(conn.key, reply, rst))
                       for reply in (False, True) for rst in (False, True))
        return out

    def remove(self, conn: Conn, directions: tuple[bool, ...]) -> list[Any]:
        out = []
        prio = self._priority(conn)
        for reply in directions:
            in_port, t, _ = self._direction(conn, reply)
            vid = direction_tags(conn, reply)[0]

            def build(cookie: int, tt: FlowTuple, in_port: int = in_port, vid: int = vid) -> Any:
                return self._delete(self.match(in_port, tt, vid=vid), prio, cookie)
            out.append(self._templated(("del", t.family, t.proto, in_port, prio, vid), build, t.family,
                                       conn.cookie(reply), t))
        if self.catchers_of_its_own(conn):
            # One exact-cookie delete per catcher: Open vSwitch finds those through its
            # cookie index, where a masked cookie would make it scan the whole table.
            for reply in (False, True):
                for rst in (False, True):
                    out.append(self._delete_cookie(cookies.make_teardown(conn.key, reply, rst)))
        return out




