"""A routed pair's flows rewritten in place (docs/design/routed.md 5.4): its next hop's MAC
changed, the pair carries on with the new one, no gap, no removal."""
from __future__ import annotations

from typing import Any

from nfshunt.core.connection import Conn
from nfshunt.core.layout import goes_to_pipeline
from nfshunt.records import cookies

from .flows import TCP_FIN, TCP_RST, FlowBuilder, direction_tags, idle_timeout, pipeline_metadata, routed_actions


def rewrite(fb: FlowBuilder, conn: Conn) -> list[Any]:
    """A routed pair whose next hop changed its MAC (core/tables.py): its two flows and
    their catchers modified in place (OFPFC_MODIFY_STRICT: same match, priority and
    cookie, the counters kept, the actions replaced), so no frame finds a gap. A pair on
    watch is changed as its watch has it."""
    if conn.watch is not None:
        return fb.watch(conn)
    p, ofp = fb.parser, fb.ofp
    out = []
    prio = fb._priority(conn)
    for reply in (False, True):
        in_port, t, peer = fb._direction(conn, reply)
        vids = direction_tags(conn, reply)
        if goes_to_pipeline(fb.version, fb.cfg, conn.action, conn.orig.proto, fb.pipeline):
            group = fb._group[conn.ingress if reply else conn.egress]  # (its table-0 flow: the rewrite, then table 1)
            out.append(fb._goto(fb.match(in_port, t, vid=vids[0]), pipeline_metadata(group, conn.cookie(reply)),
                                conn.cookie(reply), prio, idle_timeout(fb.cfg, conn),
                                [*routed_actions(p, conn, reply), *fb.retag(*vids)], modify=True))
            continue
        actions = [*routed_actions(p, conn, reply), *fb.retag(*vids), p.OFPActionOutput(peer)]
        out.append(p.OFPFlowMod(fb.dp, cookie=conn.cookie(reply), command=ofp.OFPFC_MODIFY_STRICT,
                                idle_timeout=idle_timeout(fb.cfg, conn), priority=prio,
                                flags=ofp.OFPFF_SEND_FLOW_REM, match=fb.match(in_port, t, vid=vids[0]),
                                instructions=[p.OFPInstructionActions(ofp.OFPIT_APPLY_ACTIONS, actions)]))
        if fb.catchers_of_its_own(conn):
            inst = [p.OFPInstructionActions(ofp.OFPIT_APPLY_ACTIONS,
                                            fb._forward_and_tell(peer, vids, routed_actions(p, conn, reply)))]
            for rst, bit in ((False, TCP_FIN), (True, TCP_RST)):
                out.append(p.OFPFlowMod(fb.dp, cookie=cookies.make_teardown(conn.key, reply, rst),
                                        command=ofp.OFPFC_MODIFY_STRICT, priority=prio + 1,
                                        match=fb.match(in_port, t, tcp_flags=(bit, bit), vid=vids[0]),
                                        instructions=inst))
    return out
