"""The fake switch table itself (tests/support/fakeswitch.py): what it does with flow-mods written by
os-ken, and where it sends packets. Held against what OpenFlow says a switch does, so the
tests of the core that run on it (test_fake_core.py) can be believed."""
import os

import pytest

os.environ.setdefault("OSKEN_HUB_TYPE", "native")
from os_ken.ofproto import ofproto_v1_3_parser as P13  # noqa: E402

from nfshunt.openflow.flows import FlowBuilder  # noqa: E402
from nfshunt.records.model import OFP10, TCP, UDP, FlowTuple  # noqa: E402
from tests.helpers import config  # noqa: E402
from tests.support import fakeswitch as fs  # noqa: E402

T = FlowTuple(4, TCP, "10.0.0.1", "10.0.0.2", 40000, 5201)


def write(switch, *msgs):
    buf = b""
    for m in msgs:
        switch.set_xid(m)
        m.serialize()
        buf += bytes(m.buf)
    switch.send(buf)


def flow(switch, match, out=None, priority=10, cookie=0, table_id=0, idle=0, hard=0, flags=0, inst=()):
    p, ofp = switch.ofproto_parser, switch.ofproto
    acts = [p.OFPInstructionActions(ofp.OFPIT_APPLY_ACTIONS, [p.OFPActionOutput(o) for o in out])] if out else []
    return p.OFPFlowMod(switch, table_id=table_id, cookie=cookie, command=ofp.OFPFC_ADD, idle_timeout=idle,
                        hard_timeout=hard, priority=priority, flags=flags, match=P13.OFPMatch(**match),
                        instructions=acts + list(inst))


def delete(switch, command, match=None, priority=0, cookie=0, mask=0, out_port=None):
    ofp = switch.ofproto
    return switch.ofproto_parser.OFPFlowMod(
        switch, command=command, cookie=cookie, cookie_mask=mask, table_id=ofp.OFPTT_ALL, priority=priority,
        out_port=ofp.OFPP_ANY if out_port is None else out_port, out_group=ofp.OFPG_ANY,
        match=P13.OFPMatch(**(match or {})))


def test_the_highest_priority_match_wins_and_a_miss_drops():
    sw = fs.FakeSwitch()
    write(sw, flow(sw, {"in_port": 1}, [2], priority=1),
          flow(sw, {"in_port": 1, "eth_type": 0x800, "ip_proto": TCP, "tcp_dst": 5201}, [3], priority=5),
          flow(sw, {"in_port": 1, "eth_type": 0x800, "ip_proto": UDP}, [4], priority=9))
    assert sw.packet(1, T).outputs == (3,)
    assert sw.packet(1, T._replace(dport=80)).outputs == (2,)
    assert sw.packet(1, T._replace(proto=UDP)).outputs == (4,)
    assert sw.packet(5, T).dropped
    assert sw.packet(1, T, vlan=7).outputs == (3,)  # vlan_vid not matched: any tag
    write(sw, flow(sw, {"in_port": 1, "vlan_vid": 0}, [6], priority=20))
    assert (sw.packet(1, T).outputs, sw.packet(1, T, vlan=7).outputs) == ((6,), (3,))


def test_an_add_of_the_same_match_and_priority_replaces_and_a_full_table_refuses():
    sw = fs.FakeSwitch(table_size=2)
    write(sw, flow(sw, {"in_port": 1}, [2]), flow(sw, {"in_port": 1}, [3]), flow(sw, {"in_port": 2}, [1]))
    assert len(sw.entries) == 2 and sw.packet(1, T).outputs == (3,)
    refused = flow(sw, {"in_port": 3}, [1])
    write(sw, refused, sw.ofproto_parser.OFPBarrierRequest(sw))
    err, barrier = sw.take_replies()
    assert (err.xid, err.type, err.code) == (refused.xid, sw.ofproto.OFPET_FLOW_MOD_FAILED,
                                             sw.ofproto.OFPFMFC_TABLE_FULL)
    assert (type(barrier).__name__, barrier.xid) == ("OFPBarrierReply", refused.xid + 1) and len(sw.entries) == 2
    write(sw, flow(sw, {"in_port": 3}, [1], table_id=1))  # the size is table 0's
    assert len(sw.entries) == 3


def test_deletes_strict_and_loose_by_cookie_mask_and_out_port_with_flow_removed_when_asked():
    sw = fs.FakeSwitch()
    ofp = sw.ofproto
    rem = ofp.OFPFF_SEND_FLOW_REM
    write(sw, flow(sw, {"in_port": 1}, [2], priority=1, cookie=0x101, flags=rem),
          flow(sw, {"in_port": 1}, [3], priority=2, cookie=0x102, flags=rem),
          flow(sw, {"in_port": 1, "eth_type": 0x800}, [3], priority=3, cookie=0x201),
          flow(sw, {"in_port": 2}, [1], priority=1, cookie=0x202, flags=rem))
    write(sw, delete(sw, ofp.OFPFC_DELETE_STRICT, {"in_port": 1}, priority=3))  # no entry of that priority
    assert len(sw.entries) == 4
    write(sw, delete(sw, ofp.OFPFC_DELETE_STRICT, {"in_port": 1}, priority=2))
    assert sorted(e.cookie for e in sw.entries) == [0x101, 0x201, 0x202]
    assert [(r.cookie, r.reason) for r in sw.take_replies()] == [(0x102, ofp.OFPRR_DELETE)]
    write(sw, delete(sw, ofp.OFPFC_DELETE, cookie=0x200, mask=0xF00))  # any match, by cookie
    assert [e.cookie for e in sw.entries] == [0x101]
    assert [r.cookie for r in sw.take_replies()] == [0x202]  # 0x201 did not ask for flow-removed
    write(sw, delete(sw, ofp.OFPFC_DELETE, {"in_port": 1}, out_port=7))
    assert len(sw.entries) == 1
    write(sw, delete(sw, ofp.OFPFC_DELETE, {"in_port": 1, "eth_type": 0x800}))  # more specific than the entry
    assert len(sw.entries) == 1
    write(sw, delete(sw, ofp.OFPFC_DELETE, {"in_port": 1}, out_port=2))
    assert sw.entries == []


def test_a_modify_changes_the_actions_of_the_entries_it_names_and_keeps_their_cookie():
    sw = fs.FakeSwitch()
    ofp = sw.ofproto
    write(sw, flow(sw, {"in_port": 1}, [2], priority=1, cookie=5), flow(sw, {"in_port": 1}, [2], priority=2, cookie=6))
    strict = flow(sw, {"in_port": 1}, [3], priority=1)
    strict.command = ofp.OFPFC_MODIFY_STRICT
    write(sw, strict)
    assert [(e.cookie, e.outputs) for e in sw.entries] == [(5, [(3, 0xFFE5)]), (6, [(2, 0xFFE5)])]
    loose = flow(sw, {}, [4])
    loose.command = ofp.OFPFC_MODIFY
    write(sw, loose)
    assert [e.outputs for e in sw.entries] == [[(4, 0xFFE5)]] * 2 and sw.packet(1, T).outputs == (4,)


def test_a_modify_s_new_actions_are_what_a_flow_stats_read_reports():
    """A modified entry's instructions are the modify's in what the switch reports (a
    watched close's flows, modified in place, are read back by reconcile and the sweep)."""
    sw = fs.FakeSwitch()
    fb = FlowBuilder(sw, config())
    write(sw, flow(sw, {"in_port": 1}, [2], cookie=0x4E01000000000000, priority=100))
    repoint = flow(sw, {"in_port": 1}, [3], cookie=0x4E01000000000000, priority=100)
    repoint.command = sw.ofproto.OFPFC_MODIFY_STRICT
    write(sw, repoint, fb.owned_flow_stats_request())
    (reply,) = sw.take_replies()
    assert [(f.cookie, f.out_port) for f in map(fb.parse_stats, reply.body)] == [(0x4E01000000000000, 3)]


def test_idle_and_hard_timeouts_run_on_the_injected_clock_and_traffic_refreshes_idle():
    sw = fs.FakeSwitch(now=50.0)
    rem = sw.ofproto.OFPFF_SEND_FLOW_REM
    write(sw, flow(sw, {"in_port": 1}, [2], cookie=1, idle=10, flags=rem),
          flow(sw, {"in_port": 2}, [1], cookie=2, hard=15, flags=rem))
    sw.expire(58.0)
    assert sw.packet(1, T).outputs == (2,) and sw.packet(2, T).outputs == (1,)
    sw.expire(65.0)  # idle 7 s since the packet; hard 15 s since the add
    assert [(r.cookie, r.reason, r.duration_sec, r.packet_count) for r in sw.take_replies()] == \
        [(2, sw.ofproto.OFPRR_HARD_TIMEOUT, 15, 1)]
    sw.expire(68.0)
    assert [(r.cookie, r.reason) for r in sw.take_replies()] == [(1, sw.ofproto.OFPRR_IDLE_TIMEOUT)]


def test_goto_table_carries_written_metadata_and_a_controller_output_makes_a_packet_in():
    sw = fs.FakeSwitch()
    p, ofp = sw.ofproto_parser, sw.ofproto
    write(sw, flow(sw, {"in_port": 1}, priority=5, cookie=7, inst=[
        p.OFPInstructionWriteMetadata(0x0001_0000_0000_002A, 0xFFFF_0000_0000_FFFF), p.OFPInstructionGotoTable(1)]),
        flow(sw, {"metadata": (1 << 48, 0xFFFF << 48)}, [3], table_id=1, priority=1, cookie=8),
        flow(sw, {"metadata": (1 << 48, 0xFFFF << 48), "eth_type": 0x800, "ip_proto": TCP, "tcp_flags": (1, 1)},
             [3, ofp.OFPP_CONTROLLER], table_id=1, priority=2, cookie=9))
    plain = sw.packet(1, T, tcp_flags=0x10)
    assert (plain.outputs, plain.packet_ins, plain.cookies) == ((3,), (), (7, 8))
    fin = sw.packet(1, T, tcp_flags=0x11)
    assert fin.outputs == (3,) and fin.cookies == (7, 9)
    wire = fs.frame(T, 0x11).ljust(100, b"\0")  # the packet's 100 bytes: its headers, padded
    assert fin.packet_ins == (fs.PacketIn(9, 1, {"in_port": 1, "metadata": 0x0001_0000_0000_002A}, 0xFFE5, wire),)
    (msg,) = sw.take_replies()  # the packet-in message, as os-ken reads it: the packet, up to max_len
    assert (msg.cookie, msg.table_id, dict(msg.match.items()), msg.total_len, bytes(msg.data)) == \
        (9, 1, {"in_port": 1, "metadata": 0x0001_0000_0000_002A}, 100, wire)
    assert sw.packet(2, T).dropped  # table miss in table 0


def test_flow_stats_filter_by_cookie_and_read_back_as_nfshunt_reads_them():
    sw = fs.FakeSwitch(now=10.0)
    fb = FlowBuilder(sw, config())
    write(sw, flow(sw, {"in_port": 1}, [2], cookie=0x4E01000000000000, priority=100), flow(sw, {"in_port": 9}, [2]))
    sw.packet(1, T)
    sw.expire(12.5)
    write(sw, fb.owned_flow_stats_request())
    (reply,) = sw.take_replies()
    (only,) = [fb.parse_stats(s) for s in reply.body]
    assert (only.cookie, only.in_port, only.out_port, only.packets, only.duration) == \
        (0x4E01000000000000, 1, 2, 1, pytest.approx(2.5))


def test_openflow10_matches_with_wildcards_and_masked_addresses():
    sw = fs.FakeSwitch(OFP10)
    p, ofp = sw.ofproto_parser, sw.ofproto
    wide = p.OFPMatch(in_port=1, dl_type=0x800, nw_src="10.0.0.0")
    wide.wildcards = (wide.wildcards & ~ofp.OFPFW_NW_SRC_MASK) | (8 << ofp.OFPFW_NW_SRC_SHIFT)  # a /24
    write(sw, p.OFPFlowMod(sw, match=wide, command=ofp.OFPFC_ADD, priority=5, actions=[p.OFPActionOutput(2)]),
          p.OFPFlowMod(sw, match=p.OFPMatch(in_port=1, dl_vlan=0xFFFF), command=ofp.OFPFC_ADD, priority=1,
                       actions=[p.OFPActionOutput(3)]))
    assert sw.packet(1, T).outputs == (2,)
    assert sw.packet(1, T._replace(src="10.0.1.1")).outputs == (3,)
    assert sw.packet(1, T._replace(src="10.0.1.1"), vlan=4).dropped  # 0xFFFF: untagged only


def test_the_offset_check_passes_idempotent_turns_and_catches_one_that_is_not():
    """Faucet's offset check (the rig turns it on): a turn of adds and deletes applied
    again, each message twice, leaves the table as it was; a turn whose effect depends on
    the table it meets does not (a delete by output port before a modify that points every
    flow there: applied again, the delete takes everything), and is caught without changing
    the table the test sees."""
    sw = fs.FakeSwitch()
    sw.offset_check = True
    ofp = sw.ofproto
    write(sw, flow(sw, {"in_port": 1}, [2], cookie=1), flow(sw, {"in_port": 2}, [1], cookie=2),
          delete(sw, ofp.OFPFC_DELETE_STRICT, {"in_port": 2}, priority=10), flow(sw, {"in_port": 3}, [1], cookie=3))
    assert sorted(e.cookie for e in sw.entries) == [1, 3]
    repoint = flow(sw, {}, [2])
    repoint.command = ofp.OFPFC_MODIFY
    with pytest.raises(AssertionError, match="applied twice left another table"):
        write(sw, delete(sw, ofp.OFPFC_DELETE, out_port=2), repoint)
    assert [(e.cookie, e.outputs[0][0]) for e in sw.entries] == [(3, 2)]  # as applied once
