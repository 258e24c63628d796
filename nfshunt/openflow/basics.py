"""The flow builder's basics: the match of a connection's frames (its tag included), the
retag of a VLAN translated by the firewall's bridge, and the deletes of what the switch
holds. FlowBuilder (flows.py) is one; nothing here sends anything."""
from __future__ import annotations

from typing import Any

from nfshunt.records import cookies
from nfshunt.records.model import OFP10, TCP, VID_PRESENT, FlowTuple, SwitchFlow, TagOp, retag_ops

from .reads import ALL_ONES_64, ETH_IPV6, OFP10_VLAN_NONE, OFP13_VID_NONE, SwitchReads
from .templates import Templates

ETH_IPV4 = 0x0800
ETH_8021Q = 0x8100
OFPVID_PRESENT = VID_PRESENT


class FlowBasics(SwitchReads):
    """Matches, retags and deletes; the builder that mixes it in sets templates and templated too."""

    templates: Templates
    templated: bool

    def match(self, in_port: int, t: FlowTuple | None = None, tcp_flags: tuple[int, int] | None = None,
              vid: int = 0) -> Any:
        p = self.parser
        if t is None:
            return p.OFPMatch(in_port=in_port)
        # The frames of the tag the firewall judged this connection under (vid; 0: untagged
        # only): the same 5-tuple under another tag is another network's.
        if self.version == OFP10:
            if t.family != 4:
                raise ValueError("OpenFlow 1.0 cannot match IPv6")
            return p.OFPMatch(in_port=in_port, dl_vlan=vid or OFP10_VLAN_NONE, dl_type=ETH_IPV4, nw_proto=t.proto,
                              nw_src=t.src, nw_dst=t.dst, tp_src=t.sport, tp_dst=t.dport)
        fields: dict[str, Any] = {"in_port": in_port, "vlan_vid": OFPVID_PRESENT | vid if vid else OFP13_VID_NONE,
                                  "ip_proto": t.proto}
        if t.family == 4:
            fields.update(eth_type=ETH_IPV4, ipv4_src=t.src, ipv4_dst=t.dst)
        else:
            fields.update(eth_type=ETH_IPV6, ipv6_src=t.src, ipv6_dst=t.dst)
        l4 = "tcp" if t.proto == TCP else "udp"
        fields[f"{l4}_src"] = t.sport
        fields[f"{l4}_dst"] = t.dport
        if tcp_flags is not None:
            fields["tcp_flags"] = tcp_flags  # ONF extension field in 1.3; Open vSwitch has it
        return p.OFPMatch(**fields)

    def retag(self, vid_in: int, vid_out: int) -> list[Any]:
        """The actions that make a frame of tag vid_in leave with vid_out (0: untagged), as
        the firewall's bridge between the two sub-interfaces would: none when they agree
        (records/model.retag_ops, which a reconcile compares what it reads back with)."""
        p = self.parser
        out = []
        for op, value in retag_ops(vid_in, vid_out):
            if self.version == OFP10:  # (1.0 set_vlan_vid tags an untagged frame itself: no push)
                if op is TagOp.POP:
                    out.append(p.OFPActionStripVlan())
                elif op is TagOp.SET_VID:
                    out.append(p.OFPActionVlanVid(value))
            elif op is TagOp.PUSH:
                out.append(p.OFPActionPushVlan(value))  # its PCP 0, as the bridge's
            elif op is TagOp.POP:
                out.append(p.OFPActionPopVlan())
            else:
                out.append(p.OFPActionSetField(vlan_vid=OFPVID_PRESENT | value))
        return out

    def _vlan_match(self, in_port: int, vid: int) -> Any:
        """Frames of one tag (0: untagged) from in_port."""
        if self.version == OFP10:
            return self.parser.OFPMatch(in_port=in_port, dl_vlan=vid or OFP10_VLAN_NONE)
        return self.parser.OFPMatch(in_port=in_port, vlan_vid=OFPVID_PRESENT | vid if vid else OFP13_VID_NONE)

    def _delete_cookie(self, cookie: int) -> Any:
        if not self.templated:
            return self.delete_by_cookie(cookie, ALL_ONES_64)
        return self.templates.cookie_delete(cookie, lambda c: self.delete_by_cookie(c, ALL_ONES_64))

    def delete_by_cookie(self, cookie: int, mask: int) -> Any:
        p, ofp = self.parser, self.ofp
        return p.OFPFlowMod(self.dp, cookie=cookie, cookie_mask=mask, command=ofp.OFPFC_DELETE,
                            table_id=ofp.OFPTT_ALL, out_port=ofp.OFPP_ANY, out_group=ofp.OFPG_ANY,
                            match=p.OFPMatch())

    def delete_switch_flow(self, flow: SwitchFlow) -> Any:
        """A flow read back from the switch, whatever fields its match has (an older
        NFShunt's, another tool's): by its exact cookie in 1.3; in 1.0, which cannot
        filter by cookie, by a loose match on its tuple. A default flow goes by its port:
        every default has the same cookie (a pair's takeover removes only the peer's)."""
        p, ofp = self.parser, self.ofp
        parsed = cookies.parse(flow.cookie)
        if parsed is not None and parsed.kind is cookies.Kind.DEFAULT and flow.in_port is not None \
                and flow.match is None:
            # (a trunk's default names its tag: a strict delete must too)
            match = self.match(flow.in_port) if flow.vlan is None else self._vlan_match(flow.in_port, flow.vlan & 0xFFF)
            if self.version == OFP10:
                return p.OFPFlowMod(self.dp, match=match, command=ofp.OFPFC_DELETE_STRICT,
                                    priority=flow.priority, out_port=ofp.OFPP_NONE)
            return p.OFPFlowMod(self.dp, cookie=flow.cookie, cookie_mask=ALL_ONES_64, command=ofp.OFPFC_DELETE_STRICT,
                                table_id=0, priority=flow.priority, out_port=ofp.OFPP_ANY, out_group=ofp.OFPG_ANY,
                                match=match)
        if self.version != OFP10:
            return self.delete_by_cookie(flow.cookie, ALL_ONES_64)
        t = flow.match
        if t is None:
            # Strict, by port and priority: a loose delete on the port alone would take the
            # port's default and every pair from it too (1.0 cannot filter by cookie).
            return p.OFPFlowMod(self.dp, match=p.OFPMatch(in_port=flow.in_port or 0), command=ofp.OFPFC_DELETE_STRICT,
                                priority=flow.priority, out_port=ofp.OFPP_NONE)
        tag = {}  # on a trunk, the flow's own tag: the same tuple in another VLAN is another pair's
        if flow.vlan is not None and self._tags().trunked:
            tag["dl_vlan"] = flow.vlan & 0xFFF if flow.vlan else OFP10_VLAN_NONE
        match = p.OFPMatch(in_port=flow.in_port or 0, dl_type=ETH_IPV4, nw_proto=t.proto, nw_src=t.src, nw_dst=t.dst,
                           tp_src=t.sport, tp_dst=t.dport, **tag)
        return p.OFPFlowMod(self.dp, match=match, command=ofp.OFPFC_DELETE, out_port=ofp.OFPP_NONE)

    def delete_all(self) -> Any:
        p, ofp = self.parser, self.ofp
        if self.version == OFP10:
            return p.OFPFlowMod(self.dp, match=p.OFPMatch(), command=ofp.OFPFC_DELETE,
                                out_port=ofp.OFPP_NONE)
        return p.OFPFlowMod(self.dp, command=ofp.OFPFC_DELETE, table_id=ofp.OFPTT_ALL,
                            out_port=ofp.OFPP_ANY, out_group=ofp.OFPG_ANY, match=p.OFPMatch())
