# ruff: noqa: E501, E701, E702, B007  (throw-away experiment scripts of docs/design/routed.md, kept as run)
# OFPT_SET_ASYNC (OF1.3) enabling packet-ins for NO_MATCH, ACTION and INVALID_TTL (master/equal role), serialised by os-ken.
from os_ken.ofproto import ofproto_v1_3 as ofp
from os_ken.ofproto import ofproto_v1_3_parser as p


class DP:  # os-ken needs only these to serialise
    ofproto, ofproto_parser = ofp, p
m = p.OFPSetAsync(DP(), packet_in_mask=[(1 << ofp.OFPR_NO_MATCH) | (1 << ofp.OFPR_ACTION) | (1 << ofp.OFPR_INVALID_TTL), 0],
                  port_status_mask=[0, 0], flow_removed_mask=[0, 0])
m.set_xid(7); m.serialize(); print(m.buf.hex())
