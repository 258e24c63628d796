"""NAT shunts through a routing firewall (docs/design/routed.md, slice 4): the rewrite an
entry's tuples define, the flows' set_fields, the kept entry (never deleted at confirmation,
its timeout refreshed), and its take-down: the kept entry updated, or re-created WITH its NAT."""
import errno
import queue

import pytest

from nfshunt.core import admission as adm
from nfshunt.core import nat
from nfshunt.core.commands import DeleteConntrack, Installed, InstallFlows, RefreshConntrack, RestoreConntrack
from nfshunt.core.connection import State
from nfshunt.kernel import codec
from nfshunt.records.model import (
    OFP13,
    TCP,
    UDP,
    ConnEvent,
    EventKind,
    FlowTuple,
    NatRange,
    NatSide,
    NextHop,
    Rewrite,
    nat_ranges,
    nat_rewrite,
)
from tests.helpers import config, event
from tests.test_routed import FW0, FW1, H1_MAC, H2_MAC, connected, experimental, routed

# The design's measured tuples: masquerade (F11) and DNAT with port translation (F12).
SNAT_ORIG = FlowTuple(4, TCP, "10.0.1.1", "10.0.2.1", 41103, 7000)
SNAT_REPLY = FlowTuple(4, TCP, "10.0.2.1", "10.0.2.254", 7000, 50000)
DNAT_ORIG = FlowTuple(4, TCP, "10.0.2.1", "10.0.2.254", 41104, 7000)
DNAT_REPLY = FlowTuple(4, TCP, "10.0.1.1", "10.0.2.1", 7007, 41104)
HOPS = {"10.0.2.1": NextHop("fw-eth1", FW1, H2_MAC), "10.0.1.1": NextHop("fw-eth0", FW0, H1_MAC)}


def test_nat_rewrite_of_a_masquerade_gives_the_firewall_s_address_and_port_and_back():
    fwd, rev = nat_rewrite(SNAT_ORIG, SNAT_REPLY)
    assert fwd == Rewrite(src="10.0.2.254", sport=50000)
    assert rev == Rewrite(dst="10.0.1.1", dport=41103)
    assert nat_ranges(SNAT_ORIG, SNAT_REPLY) == (NatRange(NatSide.SRC, "10.0.2.254", 50000),)


def test_nat_rewrite_of_a_dnat_with_port_translation_and_of_both_and_of_none():
    fwd, rev = nat_rewrite(DNAT_ORIG, DNAT_REPLY)
    assert fwd == Rewrite(dst="10.0.1.1", dport=7007)
    assert rev == Rewrite(src="10.0.2.254", sport=7000)
    assert nat_ranges(DNAT_ORIG, DNAT_REPLY) == (NatRange(NatSide.DST, "10.0.1.1", 7007),)
    both = FlowTuple(4, UDP, "10.0.1.1", "10.0.2.254", 5000, 53)
    reply = FlowTuple(4, UDP, "10.0.2.9", "10.0.2.254", 53, 61000)
    assert nat_rewrite(both, reply) == (Rewrite(src="10.0.2.254", sport=61000, dst="10.0.2.9"),
                                        Rewrite(src="10.0.2.254", dst="10.0.1.1", dport=5000))
    assert [r.side for r in nat_ranges(both, reply)] == [NatSide.SRC, NatSide.DST]
    assert nat_rewrite(SNAT_ORIG, SNAT_ORIG.reversed()) == (Rewrite(), Rewrite())
    assert nat_ranges(SNAT_ORIG, SNAT_ORIG.reversed()) == ()


def nat_event(orig=SNAT_ORIG, reply=SNAT_REPLY, ct_id=7, received=100.0):
    ev = event(ct_id=ct_id, received=received, proto=orig.proto, state=3 if orig.proto == TCP else None)
    return ConnEvent(EventKind.UPDATE, ct_id, orig, reply, ev.mark, ev.tcp_state, received)


def nat_installed(orig=SNAT_ORIG, reply=SNAT_REPLY, **overrides):
    core = connected(experimental(**overrides))
    ev = nat_event(orig, reply)
    core.conntrack_event(ev)
    out = core.next_hops_known(HOPS, ev, 100.0)
    (install,) = [x for x in out if isinstance(x, InstallFlows)]
    return core, install.conn


def test_a_nat_entry_is_refused_bridged_and_by_routed_without_the_flag_and_shunted_with_it():
    for cfg, reason in ((config(), adm.R_NAT), (routed(), adm.R_ROUTED)):
        out = connected(cfg).conntrack_event(nat_event())
        assert [(type(x).__name__, x.reason) for x in out] == [("Ignored", reason)]
    core, conn = nat_installed()
    assert conn.nat == nat_rewrite(SNAT_ORIG, SNAT_REPLY)
    assert conn.hops == (HOPS["10.0.2.1"], HOPS["10.0.1.1"])


def _actions(fb, conn):
    """(in_port, match, action names and values) of each flow-mod of an install."""
    out = []
    for msg in fb.install(conn):
        msg.serialize()
        acts = list(msg.instructions[0].actions)
        if getattr(acts[0], "port", None) == fb.ofp.OFPP_CONTROLLER:  # a catcher's copy as it arrived
            acts = acts[1:]
        fields = [(a.key, a.value) if type(a).__name__ == "OFPActionSetField" else type(a).__name__ for a in acts]
        out.append((msg.match["in_port"], dict(msg.match.items()), fields))
    return out


@pytest.mark.parametrize("templated", [False, True])
def test_a_nat_pair_s_flows_translate_after_dec_ttl_and_the_macs_and_the_reverse_matches_the_reply(templated):
    from os_ken.ofproto import ofproto_protocol

    from nfshunt.openflow.flows import FlowBuilder
    _, conn = nat_installed()
    fb = FlowBuilder(ofproto_protocol.ProtocolDesc(OFP13), experimental())
    fb.templated = templated
    flows = _actions(fb, conn)
    assert len(flows) == 6  # 2 flows, 4 catchers
    for in_port, match, fields in flows:
        if in_port == 1:  # h1's side: the original, leaving as the firewall's address and port
            assert (match["ipv4_src"], match["ipv4_dst"], match["tcp_src"]) == ("10.0.1.1", "10.0.2.1", 41103)
            assert fields == ["OFPActionDecNwTtl", ("eth_src", FW1), ("eth_dst", H2_MAC),
                              ("ipv4_src", "10.0.2.254"), ("tcp_src", 50000), "OFPActionOutput"]
        else:  # the reply as it arrives: to the firewall's own address and port
            assert (match["ipv4_src"], match["ipv4_dst"], match["tcp_dst"]) == ("10.0.2.1", "10.0.2.254", 50000)
            assert fields == ["OFPActionDecNwTtl", ("eth_src", FW0), ("eth_dst", H1_MAC),
                              ("ipv4_dst", "10.0.1.1"), ("tcp_dst", 41103), "OFPActionOutput"]
    # Another NAT pair through the same hops gets its own translation, not a template's.
    other = FlowTuple(4, TCP, "10.0.1.1", "10.0.2.1", 41200, 7000)
    _, conn2 = nat_installed(other, FlowTuple(4, TCP, "10.0.2.1", "10.0.2.254", 7000, 50001))
    assert ("tcp_src", 50001) in [f for _, m, fs in _actions(fb, conn2) if m["in_port"] == 1 for f in fs]


def test_a_dnat_pair_s_flows_rewrite_the_destination_forward_and_the_source_back():
    from os_ken.ofproto import ofproto_protocol

    from nfshunt.openflow.flows import FlowBuilder
    hops = {"10.0.1.1": NextHop("fw-eth0", FW0, H1_MAC), "10.0.2.1": NextHop("fw-eth1", FW1, H2_MAC)}
    core = connected(experimental())
    ev = ConnEvent(EventKind.UPDATE, 9, DNAT_ORIG, DNAT_REPLY, event(ingress=2, egress=1).mark, 3, 100.0)
    core.conntrack_event(ev)
    (install,) = [x for x in core.next_hops_known(hops, ev, 100.0) if isinstance(x, InstallFlows)]
    fb = FlowBuilder(ofproto_protocol.ProtocolDesc(OFP13), experimental())
    flows = {in_port: fields for in_port, _, fields in _actions(fb, install.conn)}
    assert flows[3][3:5] == [("ipv4_dst", "10.0.1.1"), ("tcp_dst", 7007)]
    assert flows[1][3:5] == [("ipv4_src", "10.0.2.254"), ("tcp_src", 7000)]


def test_a_confirmed_nat_pair_keeps_its_entry_and_a_plain_routed_one_does_not():
    """The entry holds the translated port (nf_nat looks only at the table for a free one)
    and its take-down updates it: confirmation does not delete it, nor does a later sweep."""
    core, conn = nat_installed()
    out = core.flows_confirmed(conn, 100.1)
    assert [type(x) for x in out] == [Installed]
    assert conn.state is State.LIVE and not conn.entry_deleted
    later = [x for t in (100.2, 101.5, 105.0) for x in core.tick(t)]
    assert not any(isinstance(x, DeleteConntrack) for x in later)
    plain = connected(experimental())
    ev = event()
    plain.conntrack_event(ev)
    (install,) = plain.next_hops_known({"10.0.0.2": HOPS["10.0.2.1"], "10.0.0.1": HOPS["10.0.1.1"]}, ev, 100.0)
    plain.flows_confirmed(install.conn, 100.1)
    assert plain.entry_due(install.conn, 100.2) == [DeleteConntrack(4, ev.orig, 7, counted=True)]


def test_a_nat_pair_s_kept_entry_is_given_time_ahead_of_its_flows_while_it_lives():
    core, conn = nat_installed()
    core.flows_confirmed(conn, 100.1)
    idle = core.cfg.default_shunt_timeout
    (refresh,) = [x for x in core.tick(101.0) if isinstance(x, RefreshConntrack)]
    assert (refresh.orig, refresh.ct_id, refresh.timeout) == (SNAT_ORIG, 7, nat.LIFE_IN_IDLE_TIMEOUTS * idle)
    assert not [x for x in core.tick(101.0 + idle / 2 - 0.1) if isinstance(x, RefreshConntrack)]
    assert [x for x in core.tick(101.0 + idle / 2) if isinstance(x, RefreshConntrack)]
    core.remove(conn, "unshunt", 120.0)
    assert not [x for x in core.tick(200.0) if isinstance(x, RefreshConntrack)]


def test_a_nat_pair_s_take_down_restores_its_entry_with_its_nat_and_a_plain_one_without():
    core, conn = nat_installed()
    core.flows_confirmed(conn, 100.1)
    out = core.remove(conn, "unshunt", 101.0)
    (restore,) = [x for x in out if isinstance(x, RestoreConntrack)]
    assert restore.nat == (NatRange(NatSide.SRC, "10.0.2.254", 50000),)
    assert (restore.orig, restore.reply) == (SNAT_ORIG, SNAT_REPLY)
    assert restore.mark & 0x10000000 == 0  # the decision cleared: the policy judges its next packet
    plain = connected(experimental())
    ev = event()
    plain.conntrack_event(ev)
    (install,) = plain.next_hops_known({"10.0.0.2": HOPS["10.0.2.1"], "10.0.0.1": HOPS["10.0.1.1"]}, ev, 100.0)
    plain.flows_confirmed(install.conn, 100.1)
    plain.tick(100.2)
    (restore,) = [x for x in plain.remove(install.conn, "unshunt", 101.0) if isinstance(x, RestoreConntrack)]
    assert restore.nat == ()


def test_a_udp_nat_pair_s_take_down_clears_the_decision_on_its_kept_entry_and_a_plain_udp_one_nothing():
    from nfshunt.core.commands import ClearDecision, RemoveFlows
    orig = FlowTuple(4, UDP, "10.0.1.1", "10.0.2.1", 41103, 5201)
    core, conn = nat_installed(orig, FlowTuple(4, UDP, "10.0.2.1", "10.0.2.254", 5201, 41103))
    core.flows_confirmed(conn, 100.1)
    out = core.remove(conn, "unshunt", 101.0)
    assert [type(x) for x in out] == [ClearDecision, RemoveFlows]
    assert (out[0].orig, out[0].ct_id) == (orig, 7)
    plain = connected(experimental())
    ev = event(proto=UDP, state=None)
    plain.conntrack_event(ev)
    (install,) = plain.next_hops_known({"10.0.0.2": HOPS["10.0.2.1"], "10.0.0.1": HOPS["10.0.1.1"]}, ev, 100.0)
    plain.flows_confirmed(install.conn, 100.1)
    plain.entry_due(install.conn, 100.2)
    assert [type(x) for x in plain.remove(install.conn, "unshunt", 101.0)] == [RemoveFlows]



UDP_ORIG = FlowTuple(4, UDP, "10.0.1.1", "10.0.2.1", 41103, 5201)
UDP_REPLY = FlowTuple(4, UDP, "10.0.2.1", "10.0.2.254", 5201, 41103)


@pytest.mark.parametrize("proto", [TCP, UDP])
def test_a_nat_pair_whose_kept_entry_is_destroyed_is_taken_down_and_a_tcp_one_gets_it_back_with_its_nat(proto):
    """Its translated tuple is free in the kernel again (an admin's flush or delete, a timeout):
    nf_nat may give it to another host, whose replies the pair's reply flow would carry to
    this pair's host, past the firewall. The DESTROY takes the pair down."""
    from nfshunt.core.commands import ClearDecision, Ignored, RemoveFlows
    orig, reply = (SNAT_ORIG, SNAT_REPLY) if proto == TCP else (UDP_ORIG, UDP_REPLY)
    core, conn = nat_installed(orig, reply)
    core.flows_confirmed(conn, 100.1)
    out = core.conntrack_event(ConnEvent(EventKind.DESTROY, 7, orig, reply, conn.mark, None, 101.0))
    assert conn.state is State.TAKING_DOWN and conn.remove_reason == nat.R_NAT_ENTRY_GONE
    if proto == TCP:
        (restore, ignored) = out
        assert isinstance(restore, RestoreConntrack) and restore.nat == (NatRange(NatSide.SRC, "10.0.2.254", 50000),)
    else:
        assert [type(x) for x in out] == [ClearDecision, RemoveFlows, Ignored]
    assert out[-1].reason == adm.R_DESTROY


def test_only_the_destroy_of_the_entry_a_nat_pair_keeps_takes_it_down():
    core, conn = nat_installed()
    other = ConnEvent(EventKind.DESTROY, 8, SNAT_ORIG, SNAT_REPLY, conn.mark, None, 100.05)  # another id's
    assert [x.reason for x in core.conntrack_event(other)] == [adm.R_DESTROY]
    out = core.conntrack_event(ConnEvent(EventKind.DESTROY, 7, SNAT_ORIG, SNAT_REPLY, conn.mark, None, 100.06))
    assert conn.state is State.PENDING and conn.remove_reason == nat.R_NAT_ENTRY_GONE  # once the switch confirms
    assert [x.reason for x in out] == [adm.R_DESTROY]
    assert [type(x) for x in core.flows_confirmed(conn, 100.1)] == [RestoreConntrack]
    plain = connected(experimental())  # a plain routed pair's entry goes at confirmation: its DESTROY is ours
    ev = event()
    plain.conntrack_event(ev)
    (install,) = plain.next_hops_known({"10.0.0.2": HOPS["10.0.2.1"], "10.0.0.1": HOPS["10.0.1.1"]}, ev, 100.0)
    plain.flows_confirmed(install.conn, 100.1)
    plain.entry_due(install.conn, 100.2)
    plain.conntrack_event(ConnEvent(EventKind.DESTROY, 7, ev.orig, ev.reply, ev.mark, 3, 100.3))
    assert install.conn.state is State.LIVE


def test_a_translation_onto_a_held_pair_s_reply_tuple_stays_on_the_firewall():
    """A plain routed pair's entry goes at its drain, so nf_nat sees no clash when a port
    forward gives another connection that pair's reply tuple: installed, its reply flow (same
    match, same priority) would replace the held pair's, and the table would name it by both."""
    core = connected(experimental())
    plain = nat_event(FlowTuple(4, UDP, "10.0.1.1", "10.0.2.1", 5000, 53), FlowTuple(4, UDP, "10.0.2.1", "10.0.1.1",
                                                                                    53, 5000))
    core.conntrack_event(plain)
    (install,) = [x for x in core.next_hops_known(HOPS, plain, 100.0) if isinstance(x, InstallFlows)]
    held = install.conn
    core.flows_confirmed(held, 100.1)
    core.entry_due(held, 100.2)
    forwarded = nat_event(FlowTuple(4, UDP, "10.0.1.1", "10.0.2.254", 5000, 5353), plain.reply, ct_id=9,
                          received=101.0)
    out = core.conntrack_event(forwarded) + core.next_hops_known(HOPS, forwarded, 101.0)
    assert not [x for x in out if isinstance(x, InstallFlows)]
    assert adm.R_REPLY_HELD in [getattr(x, "reason", None) for x in out]
    assert core.conns.by_tuple(plain.reply) is held and held.state is State.LIVE

# --- the codec and the worker -----------------------------------------------------------------

def _attrs(raw):
    """Top-level attributes of a ctnetlink message: {type without flags: (flags, payload)}."""
    import struct
    out, at = {}, 20
    while at + 4 <= len(raw):
        length, atype = struct.unpack_from("=HH", raw, at)
        out[atype & 0x3FFF] = (atype & 0xC000, raw[at + 4:at + length])
        at += (length + 3) & ~3
    return out


@pytest.mark.parametrize("family,orig,ranges", [
    (4, SNAT_ORIG, (NatRange(NatSide.SRC, "10.0.2.254", 50000),)),
    (4, DNAT_ORIG, (NatRange(NatSide.DST, "10.0.1.1", 7007),)),
    (6, FlowTuple(6, TCP, "fd01::1", "fd02::1", 41103, 7000), (NatRange(NatSide.SRC, "fd02::fe", 50000),
                                                               NatRange(NatSide.DST, "fd02::9", 7007))),
])
def test_the_restore_message_carries_cta_nat_after_today_s_bytes_and_without_nat_is_today_s(family, orig, ranges):
    import socket
    import struct
    args = (family, orig, orig.reversed(), 3, 120, False, 0x41234, 9)
    today = codec.restore_message(*args)
    assert codec.restore_message(*args, nat=()) == today
    with_nat = codec.restore_message(*args, nat=ranges)
    assert with_nat[20:len(today)] == today[20:]  # today's attributes, then the NAT ones
    assert struct.unpack_from("=I", with_nat)[0] == len(with_nat)
    attrs = _attrs(with_nat)
    af = socket.AF_INET if family == 4 else socket.AF_INET6
    for r in ranges:
        flags, payload = attrs[codec.CTA_NAT_SRC if r.side is NatSide.SRC else codec.CTA_NAT_DST]
        assert flags == codec.NLA_F_NESTED
        inner = _attrs(b"\0" * 20 + payload)
        lo, hi = (1, 2) if family == 4 else (4, 5)
        assert inner[lo][1] == inner[hi][1] == socket.inet_pton(af, r.address)
        ports = _attrs(b"\0" * 20 + inner[codec.CTA_NAT_PROTO][1])
        assert ports[1][1][:2] == ports[2][1][:2] == struct.pack("!H", r.port)
    # Without create: an update of the kept entry (no NLM_F_CREATE), else byte for byte today's.
    update = codec.restore_message(*args, create=False)
    assert struct.unpack_from("=H", update, 6)[0] == struct.unpack_from("=H", today, 6)[0] & ~0x400
    assert update[8:] == today[8:]


def test_the_worker_updates_a_kept_nat_entry_and_creates_it_with_its_nat_only_when_gone():
    from nfshunt.kernel import worker as w
    sent = []

    class Sock:
        def send(self, data):
            sent.append(data)

        def recv(self, _n):
            import struct
            acks = b""
            for msg in sent[-1:]:
                seq = struct.unpack_from("=I", msg, 8)[0]
                created = struct.unpack_from("=H", msg, 6)[0] & 0x400
                code = 0 if created else -errno.ENOENT  # the kept entry is gone
                acks += struct.pack("=IHHII", 36, 2, 0, seq, 0) + struct.pack("=i", code) + msg[:16]
            return acks

    wk = w.ConntrackWorker.__new__(w.ConntrackWorker)
    wk.sock, wk._seq, wk.batch, wk.restored, wk._retry = Sock(), 0, 256, 0, []
    wk.on_counted, wk.q = None, queue.Queue()
    done = []
    ranges = (NatRange(NatSide.SRC, "10.0.2.254", 50000),)
    wk._requests([w.Restore(4, SNAT_ORIG, SNAT_REPLY, 3, 120, False, 0x41234, lambda: done.append(1), ranges)])
    first, second = sent
    assert struct_flags(first) & 0x400 == 0 and codec.CTA_NAT_SRC not in _attrs(first)
    assert struct_flags(second) & 0x400 and codec.CTA_NAT_SRC in _attrs(second)
    reply = _attrs(second)[codec.CTA_TUPLE_REPLY][1]
    assert reply == codec.tuple_attr(codec.CTA_TUPLE_REPLY, SNAT_ORIG.reversed(), 0)[4:]  # the original reversed
    assert done == [1] and wk.restored == 1


def test_the_worker_clears_one_kept_entry_s_decision_and_leaves_the_admin_s_bits():
    import struct

    from nfshunt.kernel import worker as w
    from nfshunt.records.markcodec import DECISION_MASK
    sent = []

    class Sock:
        def send(self, data):
            sent.append(data)

        def recv(self, _n):
            seq = struct.unpack_from("=I", sent[-1], 8)[0]
            return struct.pack("=IHHII", 36, 2, 0, seq, 0) + struct.pack("=i", 0) + sent[-1][:16]

    wk = w.ConntrackWorker.__new__(w.ConntrackWorker)
    wk.sock, wk._seq, wk.batch, wk.restored, wk._retry = Sock(), 0, 256, 0, []
    wk.on_counted, wk.q = None, queue.Queue()
    wk._requests([w.Undecide(4, SNAT_ORIG, 7)])
    (msg,) = sent
    assert msg[:4] == codec.mark_update_message(4, SNAT_ORIG, 7, 0, DECISION_MASK, 1)[:4]
    assert msg[8:] == codec.mark_update_message(4, SNAT_ORIG, 7, 0, DECISION_MASK, 1)[8:]
    assert struct.unpack("!I", _attrs(msg)[21][1])[0] == DECISION_MASK  # CTA_MARK_MASK: only the decision


def struct_flags(msg):
    import struct
    return struct.unpack_from("=H", msg, 6)[0]
