"""FlowEntry (flow-stats entries read straight from the bytes) against os-ken's parser:
every shape NFShunt installs, and foreign flows, read back as the same SwitchFlow."""
import os
import struct
from types import SimpleNamespace

import pytest

os.environ.setdefault("OSKEN_HUB_TYPE", "native")
from os_ken.ofproto import ofproto_parser, ofproto_protocol, ofproto_v1_3_parser  # noqa: E402

from nfshunt.core import core as c  # noqa: E402
from nfshunt.openflow.flows import FlowBuilder  # noqa: E402
from nfshunt.openflow.stats import OTHER, FlowEntry  # noqa: E402
from nfshunt.records.model import UDP, TagOp  # noqa: E402
from tests.helpers import config, event  # noqa: E402
from tests.test_flows import conn_for  # noqa: E402

DP = ofproto_protocol.ProtocolDesc(c.OFP13)
P = DP.ofproto_parser
OFP = DP.ofproto
FLOW_MOD_FIXED = 48  # ofp_flow_mod before its match


def _entry(mod, packets=7, nbytes=7000, dur=(3, 500)):
    """The flow-stats entry a switch would report for this flow-mod."""
    mod.set_xid(1)
    mod.serialize()
    rest = bytes(mod.buf[FLOW_MOD_FIXED:])  # match (padded) and instructions
    fixed = struct.pack("!HBxIIHHHH4xQQQ", 48 + len(rest), mod.table_id, dur[0], dur[1], mod.priority,
                        mod.idle_timeout, mod.hard_timeout, mod.flags, mod.cookie, packets, nbytes)
    return fixed + rest


def _reply(entries):
    body = b"".join(entries)
    head = struct.pack("!BBHI", OFP.OFP_VERSION, OFP.OFPT_MULTIPART_REPLY, 16 + len(body), 99)
    return head + struct.pack("!HH4x", OFP.OFPMP_FLOW, 0) + body


def _parse(buf, body_cls):
    cls = ofproto_v1_3_parser.OFPFlowStatsReply
    saved = cls.cls_stats_body_cls
    cls.cls_stats_body_cls = body_cls
    try:
        version, msg_type, msg_len, xid = ofproto_parser.header(buf)
        msg = ofproto_parser.msg(DP, version, msg_type, msg_len, xid, bytearray(buf))
        return None if msg is None else msg.body  # None: os-ken dropped it (logged, and counted by NFShunt)
    finally:
        cls.cls_stats_body_cls = saved


def _shapes():
    single = FlowBuilder(DP, config())
    pipeline = FlowBuilder(DP, config(), pipeline=True)
    for fb in (single, pipeline):
        fb.templated = False
    mods = []
    for kw in (dict(), dict(proto=UDP), dict(action=2), dict(family=6), dict(family=6, proto=UDP),
               dict(sport=1, dport=65535, ct_id=2**32 - 1), dict(ingress=2, egress=1)):
        conn = conn_for(**kw)
        mods += single.install(conn) + pipeline.install(conn)
    mods += single.defaults(config().switches[0].ports) + pipeline.pipeline_flows(config().switches[0].ports)
    foreign = [
        P.OFPFlowMod(DP, cookie=0x1234, priority=5, match=P.OFPMatch(eth_type=0x0806),
                     instructions=[P.OFPInstructionActions(OFP.OFPIT_APPLY_ACTIONS,
                                                           [P.OFPActionOutput(OFP.OFPP_CONTROLLER, 65535)])]),
        P.OFPFlowMod(DP, cookie=0x4E02000000000005, priority=9, table_id=3,
                     match=P.OFPMatch(in_port=1, eth_type=0x0800, ip_proto=6, vlan_vid=0x1000 | 7, tcp_src=1, tcp_dst=2,
                                      ipv4_src="10.1.1.1", ipv4_dst="10.2.2.2"),
                     instructions=[P.OFPInstructionActions(OFP.OFPIT_WRITE_ACTIONS, [
                         P.OFPActionSetField(eth_dst="00:00:00:00:00:01"), P.OFPActionOutput(4),
                         P.OFPActionOutput(5)]), P.OFPInstructionMeter(1)]),
        P.OFPFlowMod(DP, cookie=0x4E02000000000006, priority=1, match=P.OFPMatch()),
    ]
    return mods + foreign


def test_flow_entries_read_as_os_ken_reads_them():
    mods = _shapes()
    buf = _reply([_entry(m, packets=i, nbytes=i * 100, dur=(i, i * 1000)) for i, m in enumerate(mods)])
    fb = FlowBuilder(DP, config())
    lib = [fb.parse_stats(s) for s in _parse(buf, ofproto_v1_3_parser.OFPFlowStats)]
    lean = [fb.parse_stats(s) for s in _parse(buf, FlowEntry)]
    assert len(lean) == len(mods) > 40
    assert lean == lib
    assert any(f.goto for f in lean) and any(f.match is not None and f.match.family == 6 for f in lean)
    raw = _parse(buf, FlowEntry)
    assert [(e.cookie, e.packet_count, e.byte_count, e.table_id) for e in raw] == \
        [(m.cookie, i, i * 100, m.table_id) for i, m in enumerate(mods)]


def test_a_masked_address_is_never_read_as_an_exact_match():
    # os-ken hands such a field over as (value, mask), and the tuple built from it fails;
    # FlowEntry reads it as absent: not an NFShunt pair.
    mod = P.OFPFlowMod(DP, cookie=0x4E02000000000007, priority=9,
                       match=P.OFPMatch(in_port=1, eth_type=0x0800, ip_proto=17, ipv4_src=("10.0.0.0", "255.0.0.0"),
                                        ipv4_dst="10.0.0.2", udp_src=1, udp_dst=2),
                       instructions=[])
    (entry,) = _parse(_reply([_entry(mod)]), FlowEntry)
    flow = FlowBuilder(DP, config()).parse_stats(entry)
    assert flow.match is None and flow.in_port == 1 and flow.out_port is None


def _with_match(oxms):
    """A flow-stats entry whose match holds these raw OXM fields, with no instructions."""
    match = struct.pack("!HH", 1, 4 + len(oxms)) + oxms
    match += bytes(-len(match) % 8)
    return struct.pack("!HBxIIHHHH4xQQQ", 48 + len(match), 0, 1, 0, 9, 0, 0, 0, 0x4E02000000000007, 1, 1) + match


def _oxm(oclass, field, value, hasmask=0):
    return struct.pack("!HBB", oclass, field << 1 | hasmask, len(value)) + value


def test_only_basic_class_fields_are_read_whatever_their_number():
    # Field 11 is ipv4_src only in the basic class (0x8000); an NXM or experimenter field
    # of that number and size is another field, skipped.
    entry = FlowEntry.parser(_with_match(_oxm(0x0001, 11, bytes([10, 0, 0, 1])) + _oxm(0x8000, 12, bytes([10, 0, 0, 2]))
                                         + _oxm(0x8000, 0, struct.pack("!I", 3))), 0)
    # ... and marks the entry as holding a field NFShunt does not install (never adopted).
    assert entry.fields == {"ipv4_dst": "10.0.0.2", "in_port": 3, OTHER: True}


def test_a_field_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="OXM udp_src of 4 bytes"):
        FlowEntry.parser(_with_match(_oxm(0x8000, 15, struct.pack("!I", 5201))), 0)
    # A masked field of its own size is skipped, not refused (and never an exact match).
    assert FlowEntry.parser(_with_match(_oxm(0x8000, 11, bytes(8), hasmask=1)), 0).fields == {OTHER: True}


@pytest.mark.parametrize("cut", [1, 8, 20, 47])
def test_a_truncated_or_zero_length_entry_is_refused_not_looped_on(cut):
    good = _entry(FlowBuilder(DP, config()).defaults(config().switches[0].ports)[0])
    assert _parse(_reply([good[:-cut]]), FlowEntry) is None  # the reply is dropped whole
    zero = bytearray(good)
    zero[0:2] = b"\x00\x00"
    with pytest.raises(ValueError):
        FlowEntry.parser(bytes(zero), 0)


def _removed(mod, reason, packets=7, nbytes=7000, dur=(3, 500)):
    """The flow-removed message a switch would send for this flow-mod."""
    mod.set_xid(1)
    mod.serialize()
    rest = bytes(mod.buf[FLOW_MOD_FIXED:])
    match = rest[:(struct.unpack_from("!HH", rest)[1] + 7) // 8 * 8]
    body = struct.pack("!QHBBIIHHQQ", mod.cookie, mod.priority, reason, mod.table_id, dur[0], dur[1],
                       mod.idle_timeout, mod.hard_timeout, packets, nbytes) + match
    return struct.pack("!BBHI", OFP.OFP_VERSION, OFP.OFPT_FLOW_REMOVED, 8 + len(body), 42) + body


@pytest.mark.parametrize("reason", [0, 1, 2, 5])
def test_flow_removed_reads_every_field_but_the_match_as_os_ken_does(reason):
    from nfshunt.openflow.stats import flow_removed
    for mod in _shapes():
        buf = bytearray(_removed(mod, reason, packets=2**40 + 3, nbytes=2**50 + 9, dur=(86400, 999_999_999)))
        version, msg_type, msg_len, xid = ofproto_parser.header(buf)
        ours = flow_removed(DP, version, msg_type, msg_len, xid, buf)
        theirs = ofproto_v1_3_parser.OFPFlowRemoved.parser(DP, version, msg_type, msg_len, xid, buf)  # os-ken's own
        assert type(ours) is type(theirs)
        for field in ("version", "msg_type", "msg_len", "xid", "cookie", "priority", "reason", "table_id",
                      "duration_sec", "duration_nsec", "idle_timeout", "hard_timeout", "packet_count",
                      "byte_count"):
            assert getattr(ours, field) == getattr(theirs, field), field
        assert ours.match is None


def test_a_short_flow_removed_is_refused():
    from nfshunt.openflow.stats import flow_removed
    buf = bytearray(_removed(_shapes()[0], 0))[:40]
    with pytest.raises(ValueError, match="flow-removed of 40 bytes"):
        flow_removed(DP, OFP.OFP_VERSION, OFP.OFPT_FLOW_REMOVED, 40, 1, buf)


def test_the_channel_installs_the_fast_flow_removed_parser():
    from nfshunt.openflow.channel import install_connection_factory
    from nfshunt.openflow.stats import flow_removed
    install_connection_factory()
    assert ofproto_v1_3_parser._MSG_PARSERS[OFP.OFPT_FLOW_REMOVED] is flow_removed


def test_only_pairs_of_exactly_the_installed_shape_read_as_exact():
    """Issue 26.6: an older release's pair (no VLAN match), one with a field more, and a
    goto that writes another pair's metadata are not pairs this version adopts; every
    pair flow it installs is, in both layouts, read either way."""
    fb = FlowBuilder(DP, config())
    pipe = FlowBuilder(DP, config(), pipeline=True)
    pipe.templated = fb.templated = False
    conn = conn_for()
    ours = fb.install(conn)[:2] + pipe.install(conn)[:2]
    fields = dict(in_port=1, eth_type=0x0800, ip_proto=6, ipv4_src="10.0.0.1", ipv4_dst="10.0.0.2", tcp_src=40000,
                  tcp_dst=5201)
    out = [P.OFPInstructionActions(OFP.OFPIT_APPLY_ACTIONS, [P.OFPActionOutput(3)])]
    no_vlan = P.OFPFlowMod(DP, cookie=conn.cookie(False), priority=33000, match=P.OFPMatch(**fields), instructions=out)
    extra = P.OFPFlowMod(DP, cookie=conn.cookie(False), priority=33000, instructions=out,
                         match=P.OFPMatch(**fields, vlan_vid=0, ip_dscp=1))
    goto = pipe.install(conn)[0]
    other_meta = P.OFPFlowMod(DP, cookie=goto.cookie, priority=goto.priority, match=goto.match, instructions=[
        P.OFPInstructionWriteMetadata(goto.instructions[0].metadata ^ 1, 0xFFFFFFFFFFFFFFFF),
        P.OFPInstructionGotoTable(1)])
    buf = _reply([_entry(m) for m in (*ours, no_vlan, extra, other_meta)])
    for body in (FlowEntry, ofproto_v1_3_parser.OFPFlowStats):
        flows = [fb.parse_stats(s) for s in _parse(buf, body)]
        assert [f.exact for f in flows] == [True] * 4 + [False] * 3, body


TRUNKS = [{"fast": 1, "slow": 2, "physdevin": 1, "vlans": [100, 30], "untagged": {"zone": 7}},
          {"fast": 3, "slow": 4, "physdevin": 2, "vlans": [100, {"id": 301, "zone": 30}, {"id": 70, "zone": 7}]},
          {"fast": 5, "slow": 6, "physdevin": 3, "vlans": [{"id": 900, "zone": 30}]}]


def _trunk_conn(**kw):
    core = c.Core(config(ports=TRUNKS, openflow_versions=["1.3"]))
    core.switch_connected(c.OFP13)
    core.reconcile([], 0)
    return core.conntrack_event(event(**kw))[0].conn


def _vlan_shapes():
    """Every pair shape a trunk config installs (same tag, translated, pushed, popped; each
    layout; on watch), its defaults and drops; then pairs under our cookie that do to the tag
    what this version never writes."""
    cfg = config(ports=TRUNKS, openflow_versions=["1.3"])
    ours = []
    for pipeline in (False, True):
        fb = FlowBuilder(DP, cfg, pipeline=pipeline)
        fb.templated = False
        for kw in (dict(zone=100), dict(zone=30, proto=UDP), dict(zone=7), dict(zone=7, ingress=2, egress=1),
                   dict(zone=30, ingress=3, egress=2, family=6), dict(zone=100, action=2)):
            conn = _trunk_conn(**kw)
            ours += fb.install(conn)
            if not pipeline and conn.action.value == "shunt":
                conn.watch = SimpleNamespace(forwarding=True, rst=True)
                ours += fb.watch(conn)
        ours += fb.defaults(cfg.switches[0].ports)
    t = _trunk_conn(zone=30).orig
    match = FlowBuilder(DP, cfg).match(1, t, vid=30)
    odd = [[P.OFPActionOutput(3), P.OFPActionSetField(vlan_vid=0x1000 | 301)],  # retagged after it left
           [P.OFPActionSetField(vlan_vid=301), P.OFPActionOutput(3)],  # no OFPVID_PRESENT
           [P.OFPActionSetField(vlan_pcp=6), P.OFPActionSetField(vlan_vid=0x1000 | 301), P.OFPActionOutput(3)],
           [P.OFPActionPushVlan(0x88A8), P.OFPActionSetField(vlan_vid=0x1000 | 301), P.OFPActionOutput(3)],
           [P.OFPActionSetField(vlan_vid=0x1000 | 100), P.OFPActionOutput(3)],  # the wrong id
           [P.OFPActionOutput(3)]]  # not translated
    foreign = [P.OFPFlowMod(DP, cookie=0x4E02000000000009, priority=33000, match=match,
                            instructions=[P.OFPInstructionActions(OFP.OFPIT_APPLY_ACTIONS, actions)])
               for actions in odd]
    return ours, foreign


def test_vlan_shapes_read_as_os_ken_reads_them_exact_when_ours_and_in_their_zone():
    ours, foreign = _vlan_shapes()
    mods = ours + foreign
    buf = _reply([_entry(m) for m in mods])
    fb = FlowBuilder(DP, config(ports=TRUNKS, openflow_versions=["1.3"]))
    lib = [fb.parse_stats(s) for s in _parse(buf, ofproto_v1_3_parser.OFPFlowStats)]
    lean = [fb.parse_stats(s) for s in _parse(buf, FlowEntry)]
    assert lean == lib
    pairs = [f for f in lean[:len(ours)] if f.cookie >> 48 in (0x4E02, 0x4E03)]
    assert len(pairs) > 20 and all(f.exact and f.match.zone for f in pairs)
    assert {f.retag for f in pairs} >= {(), ((TagOp.SET_VID, 301),), ((TagOp.SET_VID, 30),), ((TagOp.POP, 0),),
                                        ((TagOp.PUSH, 0x8100), (TagOp.SET_VID, 70)), ((TagOp.SET_VID, 900),)}
    assert {f.vlan for f in pairs} >= {0, 0x1064, 0x101E, 0x112D}
    assert [f.exact for f in lean[len(ours):]] == [False] * len(foreign)
    assert all(f.match.zone == 30 for f in lean[len(ours):])
