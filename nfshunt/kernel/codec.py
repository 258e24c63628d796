"""Ctnetlink messages packed and parsed, and the event filter's program: pure, no sockets.

The fast parser (`parse_fast`, `parse_datagram`) reads only the attributes the core needs
(pyroute2's general decoder, `parse_entry`, is kept as the reference it is tested equal to);
the builders make the requests the worker and the table functions send.
"""
from __future__ import annotations

import socket
import struct
from typing import Any, Callable, Iterator

from pyroute2.netlink import NLM_F_ACK, NLM_F_REQUEST
from pyroute2.netlink.nfnetlink import NFNL_SUBSYS_CTNETLINK
from pyroute2.netlink.nfnetlink.nfctsocket import IPCTNL_MSG_CT_DELETE, IPCTNL_MSG_CT_NEW, nfct_msg

from nfshunt.records import markcodec
from nfshunt.records.model import ConnEvent, EntryCounts, EventKind, FlowTuple, NatRange, NatSide, address_text

NETLINK_NETFILTER = 12
SO_RCVBUFFORCE = 33
NFNLGRP_CONNTRACK_NEW, NFNLGRP_CONNTRACK_UPDATE, NFNLGRP_CONNTRACK_DESTROY = 1, 2, 4
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_CREATE = 0x400
IP_CT_TCP_FLAG_CLOSE_INIT, IP_CT_TCP_FLAG_BE_LIBERAL = 0x04, 0x08
NLMSG_HDR = struct.Struct("=IHHII")
FAMILY: dict[int, int] = {socket.AF_INET: 4, socket.AF_INET6: 6}
AF = {4: socket.AF_INET, 6: socket.AF_INET6}

class MalformedEvent(ValueError):
    pass


def parse_entry(msg: nfct_msg, kind: EventKind, received: float) -> ConnEvent:
    """Reduce a decoded ctnetlink message to a ConnEvent; MalformedEvent if it lacks parts."""
    family = FAMILY.get(msg["nfgen_family"])
    if family is None:
        raise MalformedEvent(f"address family {msg['nfgen_family']}")
    zone = msg.get_attr("CTA_ZONE") or 0
    orig = _tuple(msg.get_attr("CTA_TUPLE_ORIG"), family, zone)
    reply = _tuple(msg.get_attr("CTA_TUPLE_REPLY"), family, zone)
    ct_id = msg.get_attr("CTA_ID")
    if orig is None or reply is None or ct_id is None:
        raise MalformedEvent("missing tuple or id")
    state = msg.get_nested("CTA_PROTOINFO", "CTA_PROTOINFO_TCP", "CTA_PROTOINFO_TCP_STATE")
    return ConnEvent(kind, ct_id, orig, reply, msg.get_attr("CTA_MARK") or 0, state, received)


def _tuple(nla: Any, family: int, zone: int) -> FlowTuple | None:
    if nla is None:
        return None
    if any(attr[0] == "UNKNOWN" and attr[1]["header"]["type"] & NLA_TYPE_MASK == CTA_TUPLE_ZONE
           for attr in nla["attrs"]):  # (pyroute2's tuple does not name it)
        raise MalformedEvent(DIRECTIONAL_ZONE)
    ip = nla.get_attr("CTA_TUPLE_IP")
    proto = nla.get_attr("CTA_TUPLE_PROTO")
    if ip is None or proto is None:
        return None
    v = "V4" if family == 4 else "V6"
    src, dst = ip.get_attr(f"CTA_IP_{v}_SRC"), ip.get_attr(f"CTA_IP_{v}_DST")
    num = proto.get_attr("CTA_PROTO_NUM")
    if src is None or dst is None or num is None:
        return None
    return FlowTuple(family, num, src, dst, proto.get_attr("CTA_PROTO_SRC_PORT") or 0,
                     proto.get_attr("CTA_PROTO_DST_PORT") or 0, zone)


# ctnetlink attribute numbers (include/uapi/linux/netfilter/nfnetlink_conntrack.h).
CTA_TUPLE_ORIG, CTA_TUPLE_REPLY, CTA_PROTOINFO, CTA_TIMEOUT, CTA_MARK, CTA_ID, CTA_MARK_MASK = 1, 2, 4, 7, 8, 12, 21
CTA_ZONE = 18  # be16; the kernel sends it only for a zone other than 0
CTA_TUPLE_IP, CTA_TUPLE_PROTO, CTA_TUPLE_ZONE = 1, 2, 3
# A zone of one direction only (`-j CT --zone-orig/--zone-reply`): its two tuples would be
# looked up in different zones, which no pair of switch flows can stand for.
DIRECTIONAL_ZONE = "directional conntrack zone (CTA_TUPLE_ZONE): not supported"
CTA_IP_V4_SRC, CTA_IP_V4_DST, CTA_IP_V6_SRC, CTA_IP_V6_DST = 1, 2, 3, 4
CTA_PROTO_NUM, CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT = 1, 2, 3
CTA_PROTOINFO_TCP, CTA_PROTOINFO_TCP_STATE = 1, 1
CTA_PROTOINFO_TCP_FLAGS_ORIGINAL, CTA_PROTOINFO_TCP_FLAGS_REPLY = 4, 5
NLA_TYPE_MASK = 0x3FFF  # without the nested / byte-order flags
NLA_HDR = struct.Struct("=HH")
BE16 = struct.Struct("!H")
BE32 = struct.Struct("!I")


def _attrs(data: bytes, start: int, end: int) -> dict[int, tuple[int, int]]:
    """Attribute type -> (payload start, payload end) for the attributes in data[start:end]."""
    out: dict[int, tuple[int, int]] = {}
    while start + 4 <= end:
        length, atype = NLA_HDR.unpack_from(data, start)
        if length < 4 or start + length > end:
            raise MalformedEvent(f"bad attribute length {length}")
        out[atype & NLA_TYPE_MASK] = (start + 4, start + length)
        start += (length + 3) & ~3
    return out


# Every port number as one shared int: a shunt keeps its ports for its life, and an int
# made per event costs 32 B (2.5 MB once, against 6 MB at 100,000 shunts).
_PORTS = tuple(range(65536))
# One int object a mark value, for the same reason: a policy gives many connections the same
# few marks (32 B a shunt: 3 MB at 100,000, bench/results/2026-11-28/README.md). Bounded like the addresses.
MARKS_MAX = 4096
_MARKS: dict[int, int] = {}


def shared_mark(value: int) -> int:
    """`value`, as the one int object every event with that mark holds while the cache does."""
    mark = _MARKS.get(value)
    if mark is None:
        if len(_MARKS) >= MARKS_MAX:
            _MARKS.clear()
        mark = _MARKS[value] = value
    return mark


def _fast_tuple(data: bytes, span: tuple[int, int] | None, family: int, zone: int) -> FlowTuple:
    if span is None:
        raise MalformedEvent("missing tuple")
    t = _attrs(data, *span)
    if CTA_TUPLE_ZONE in t:
        raise MalformedEvent(DIRECTIONAL_ZONE)
    ip, proto = t.get(CTA_TUPLE_IP), t.get(CTA_TUPLE_PROTO)
    if ip is None or proto is None:
        raise MalformedEvent("tuple without addresses or protocol")
    a = _attrs(data, *ip)
    if family == 4:
        src, dst, size = a.get(CTA_IP_V4_SRC), a.get(CTA_IP_V4_DST), 4
    else:
        src, dst, size = a.get(CTA_IP_V6_SRC), a.get(CTA_IP_V6_DST), 16
    if src is None or dst is None or src[1] - src[0] != size or dst[1] - dst[0] != size:
        raise MalformedEvent("tuple addresses missing or of the wrong size")
    p = _attrs(data, *proto)
    num = p.get(CTA_PROTO_NUM)
    if num is None or num[1] <= num[0]:
        raise MalformedEvent("tuple without protocol number")
    sp, dp = p.get(CTA_PROTO_SRC_PORT), p.get(CTA_PROTO_DST_PORT)
    return FlowTuple(family, data[num[0]],
                     address_text(data[src[0]:src[1]]), address_text(data[dst[0]:dst[1]]),
                     _PORTS[BE16.unpack_from(data, sp[0])[0]] if sp and sp[1] - sp[0] >= 2 else 0,
                     _PORTS[BE16.unpack_from(data, dp[0])[0]] if dp and dp[1] - dp[0] >= 2 else 0, zone)


def parse_fast(data: bytes, offset: int, length: int, kind: EventKind, received: float) -> ConnEvent:
    """One ctnetlink message (at data[offset:offset+length]) to a ConnEvent, reading only the
    attributes the core needs. pyroute2's general decoder costs ~180 us a message; this
    one a small fraction of that, and the listener reads every conntrack event there is."""
    if length < NLMSG_HDR.size + 4:
        raise MalformedEvent("message shorter than its headers")
    family = FAMILY.get(data[offset + NLMSG_HDR.size])
    if family is None:
        raise MalformedEvent(f"address family {data[offset + NLMSG_HDR.size]}")
    top = _attrs(data, offset + NLMSG_HDR.size + 4, offset + length)
    ct_id = top.get(CTA_ID)
    if ct_id is None or ct_id[1] - ct_id[0] != 4:
        raise MalformedEvent("missing id")
    mark = top.get(CTA_MARK)
    state = None
    info = top.get(CTA_PROTOINFO)
    if info is not None:
        tcp = _attrs(data, *info).get(CTA_PROTOINFO_TCP)
        if tcp is not None:
            st = _attrs(data, *tcp).get(CTA_PROTOINFO_TCP_STATE)
            if st is not None and st[1] > st[0]:
                state = data[st[0]]
    zone = top.get(CTA_ZONE)  # (sent only for a zone other than 0; as a shared int, like the ports)
    zone_id = _PORTS[BE16.unpack_from(data, zone[0])[0]] if zone is not None and zone[1] - zone[0] >= 2 else 0
    orig = _fast_tuple(data, top.get(CTA_TUPLE_ORIG), family, zone_id)
    reply = _fast_tuple(data, top.get(CTA_TUPLE_REPLY), family, zone_id)
    return ConnEvent(kind, BE32.unpack_from(data, ct_id[0])[0], orig, _mirrored(orig, reply),
                     shared_mark(BE32.unpack_from(data, mark[0])[0]) if mark and mark[1] - mark[0] == 4 else 0,
                     state, received)


# Beyond what the core needs (explain, top, the accounting records): counters, timestamps.
CTA_COUNTERS_ORIG, CTA_COUNTERS_REPLY, CTA_TIMESTAMP = 9, 10, 20
CTA_COUNTERS_PACKETS, CTA_COUNTERS_BYTES = 1, 2
CTA_TIMESTAMP_START, CTA_TIMESTAMP_STOP = 1, 2
BE64 = struct.Struct("!Q")


def _be(data: bytes, span: tuple[int, int] | None, fmt: struct.Struct) -> int | None:
    return fmt.unpack_from(data, span[0])[0] if span is not None and span[1] - span[0] >= fmt.size else None


def parse_counts(data: bytes, offset: int, length: int) -> EntryCounts:
    """The counters, zone, timeout and timestamps of one ctnetlink entry message (a dump's
    part, a lookup's answer, a delete's echo): what the kernel sends of them, no more."""
    top = _attrs(data, offset + NLMSG_HDR.size + 4, offset + length)
    counted: list[tuple[int | None, int | None]] = []
    for atype in (CTA_COUNTERS_ORIG, CTA_COUNTERS_REPLY):
        span = top.get(atype)
        inner = _attrs(data, *span) if span is not None else {}
        counted.append((_be(data, inner.get(CTA_COUNTERS_PACKETS), BE64),
                        _be(data, inner.get(CTA_COUNTERS_BYTES), BE64)))
    (op, ob), (rp, rb) = counted
    stamp = top.get(CTA_TIMESTAMP)
    stamps = _attrs(data, *stamp) if stamp is not None else {}
    return EntryCounts(packets=(op, rp) if op is not None and rp is not None else None,
                       bytes=(ob, rb) if ob is not None and rb is not None else None,
                       zone=_be(data, top.get(CTA_ZONE), BE16) or 0, timeout=_be(data, top.get(CTA_TIMEOUT), BE32),
                       start_ns=_be(data, stamps.get(CTA_TIMESTAMP_START), BE64),
                       stop_ns=_be(data, stamps.get(CTA_TIMESTAMP_STOP), BE64))


def _mirrored(orig: FlowTuple, reply: FlowTuple) -> FlowTuple:
    """The reply tuple; without NAT, made of the original's own address objects (an event
    waiting for room keeps both; a pair keeps no mirror at all: connection.Conn.reply)."""
    mirror = orig.reversed()
    return mirror if reply == mirror else reply


def parse_datagram(data: bytes, received: float,
                   on_malformed: Callable[[str], None]) -> list[ConnEvent]:
    """Every conntrack event in one netlink datagram; malformed parts are reported and
    skipped, never raised."""
    events: list[ConnEvent] = []
    offset = 0
    while offset + NLMSG_HDR.size <= len(data):
        length, mtype, flags, _seq, _pid = NLMSG_HDR.unpack_from(data, offset)
        if length < NLMSG_HDR.size or offset + length > len(data):
            on_malformed(f"bad netlink length {length}")
            break
        start = offset
        offset += (length + 3) & ~3
        if mtype >> 8 != NFNL_SUBSYS_CTNETLINK:
            continue
        sub = mtype & 0xFF
        if sub == IPCTNL_MSG_CT_NEW:
            kind = EventKind.NEW if flags & NLM_F_CREATE else EventKind.UPDATE
        elif sub == IPCTNL_MSG_CT_DELETE:
            kind = EventKind.DESTROY
        else:
            continue
        try:
            events.append(parse_fast(data, start, length, kind, received))
        except Exception as exc:  # a strange message is counted and skipped
            on_malformed(f"{type(exc).__name__}: {exc}")
    return events


def netlink_acks(data: bytes) -> Iterator[tuple[int, int]]:
    """(sequence number, error code; 0: success) of each NLMSG_ERROR in a datagram."""
    offset = 0
    while offset + NLMSG_HDR.size <= len(data):
        length, mtype, _flags, seq, _pid = NLMSG_HDR.unpack_from(data, offset)
        if length < NLMSG_HDR.size:
            return
        if mtype == NLMSG_ERROR and offset + NLMSG_HDR.size + 4 <= len(data):
            yield seq, struct.unpack_from("=i", data, offset + NLMSG_HDR.size)[0]
        offset += (length + 3) & ~3


NLA_F_NESTED = 0x8000
CTA_PROTO_NUM_ATTR = struct.Struct("=HHB3x")
CTA_PORT_ATTR = struct.Struct("=HHH2x")
TCP_FLAGS = struct.Struct("=BB")  # struct nf_ct_tcp_flags: the flags, the mask of those set
LIBERAL_FLAGS = TCP_FLAGS.pack(IP_CT_TCP_FLAG_BE_LIBERAL, IP_CT_TCP_FLAG_BE_LIBERAL)
CLOSER_FLAGS = TCP_FLAGS.pack(IP_CT_TCP_FLAG_BE_LIBERAL | IP_CT_TCP_FLAG_CLOSE_INIT,
                              IP_CT_TCP_FLAG_BE_LIBERAL | IP_CT_TCP_FLAG_CLOSE_INIT)


def nla(atype: int, payload: bytes) -> bytes:
    return NLA_HDR.pack(4 + len(payload), atype) + payload + b"\0" * (-len(payload) & 3)


def zone_attr(t: FlowTuple) -> bytes:
    """CTA_ZONE naming t's zone, for a request about one entry: without it the kernel looks
    in zone 0 only (ENOENT, or worse a zone-0 twin changed, or a restore made in zone 0).
    Nothing for zone 0, so those requests stay byte for byte what they were."""
    return nla(CTA_ZONE, BE16.pack(t.zone)) if t.zone else b""


def tuple_attr(atype: int, t: FlowTuple, nested: int = NLA_F_NESTED) -> bytes:
    af = socket.AF_INET if t.family == 4 else socket.AF_INET6
    src_t, dst_t = (CTA_IP_V4_SRC, CTA_IP_V4_DST) if t.family == 4 else (CTA_IP_V6_SRC, CTA_IP_V6_DST)
    ip = nla(src_t, socket.inet_pton(af, t.src)) + nla(dst_t, socket.inet_pton(af, t.dst))
    proto = (CTA_PROTO_NUM_ATTR.pack(5, CTA_PROTO_NUM, t.proto)
             + CTA_PORT_ATTR.pack(6, CTA_PROTO_SRC_PORT, socket.htons(t.sport))
             + CTA_PORT_ATTR.pack(6, CTA_PROTO_DST_PORT, socket.htons(t.dport)))
    return nla(atype | nested, nla(CTA_TUPLE_IP | nested, ip) + nla(CTA_TUPLE_PROTO | nested, proto))


NLM_F_ECHO = 0x08
IPCTNL_MSG_CT_GET = 1


def delete_message(family: int, t: FlowTuple, ct_id: int | None, seq: int, echo: bool = False) -> bytes:
    """IPCTNL_MSG_CT_DELETE for a tuple (and id: the kernel refuses an entry with another
    id, ENOENT; but one re-created on the tuple mostly has the same id), packed by hand:
    pyroute2's encoder costs ~100 us a message and deletes run at the shunt rate. With
    `echo` the kernel also sends the requester the entry's destroy event (its last counters)."""
    body = struct.pack("=BBH", AF[family], 0, 0) + tuple_attr(CTA_TUPLE_ORIG, t)
    if ct_id is not None:
        body += nla(CTA_ID, BE32.pack(ct_id))
    body += zone_attr(t)
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE,
                          NLM_F_REQUEST | NLM_F_ACK | (NLM_F_ECHO if echo else 0), seq, 0) + body


def get_message(t: FlowTuple, seq: int) -> bytes:
    """IPCTNL_MSG_CT_GET of the one entry whose original tuple is t (a lookup)."""
    body = struct.pack("=BBH", AF[t.family], 0, 0) + tuple_attr(CTA_TUPLE_ORIG, t) + zone_attr(t)
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET,
                          NLM_F_REQUEST, seq, 0) + body


def destroyed_entries(data: bytes) -> Iterator[tuple[int, int]]:
    """(offset, length) of each IPCTNL_MSG_CT_DELETE message in a datagram (a delete's echo)."""
    offset = 0
    kind = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE
    while offset + NLMSG_HDR.size <= len(data):
        length, mtype = NLMSG_HDR.unpack_from(data, offset)[:2]
        if length < NLMSG_HDR.size or offset + length > len(data):
            return
        if mtype == kind:
            yield offset, length
        offset += (length + 3) & ~3


def mark_update_message(family: int, t: FlowTuple, ct_id: int, mark: int, mask: int, seq: int) -> bytes:
    """IPCTNL_MSG_CT_NEW without NLM_F_CREATE: change the mark of the entry that holds the
    tuple now, only the bits in `mask` (the kernel keeps the others: new = (old & ~mask) ^
    mark). The kernel ignores CTA_ID on an update, as on the two below."""
    body = (struct.pack("=BBH", AF[family], 0, 0) + tuple_attr(CTA_TUPLE_ORIG, t) + nla(CTA_ID, BE32.pack(ct_id))
            + nla(CTA_MARK, BE32.pack(mark & mask)) + nla(CTA_MARK_MASK, BE32.pack(mask)) + zone_attr(t))
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW,
                          NLM_F_REQUEST | NLM_F_ACK, seq, 0) + body


def liberal_message(family: int, t: FlowTuple, ct_id: int, seq: int) -> bytes:
    """IPCTNL_MSG_CT_NEW without NLM_F_CREATE: set BE_LIBERAL on both directions of the TCP
    entry that holds the tuple now, whatever its id (struct nf_ct_tcp_flags: the flag and a
    mask of only that bit). Packed by hand: one goes with every TCP shunt."""
    tcp = nla(CTA_PROTOINFO_TCP_FLAGS_ORIGINAL, LIBERAL_FLAGS) + nla(CTA_PROTOINFO_TCP_FLAGS_REPLY, LIBERAL_FLAGS)
    body = (struct.pack("=BBH", AF[family], 0, 0) + tuple_attr(CTA_TUPLE_ORIG, t) + nla(CTA_ID, BE32.pack(ct_id))
            + nla(CTA_PROTOINFO | NLA_F_NESTED, nla(CTA_PROTOINFO_TCP | NLA_F_NESTED, tcp)) + zone_attr(t))
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW,
                          NLM_F_REQUEST | NLM_F_ACK, seq, 0) + body


def timeout_message(family: int, t: FlowTuple, ct_id: int, timeout: int, seq: int) -> bytes:
    """IPCTNL_MSG_CT_NEW without NLM_F_CREATE: give the entry that holds the tuple now,
    whatever its id (the worker looks it up first: Expire.meant_for), `timeout` seconds;
    its state, mark and flags stay. Packed by hand like its neighbours."""
    body = (struct.pack("=BBH", AF[family], 0, 0) + tuple_attr(CTA_TUPLE_ORIG, t) + nla(CTA_ID, BE32.pack(ct_id))
            + nla(CTA_TIMEOUT, BE32.pack(timeout)) + zone_attr(t))
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW,
                          NLM_F_REQUEST | NLM_F_ACK, seq, 0) + body


CTA_NAT_SRC, CTA_NAT_DST = 6, 13
CTA_NAT_V4_MINIP, CTA_NAT_V4_MAXIP, CTA_NAT_PROTO, CTA_NAT_V6_MINIP, CTA_NAT_V6_MAXIP = 1, 2, 3, 4, 5
CTA_PROTONAT_PORT_MIN, CTA_PROTONAT_PORT_MAX = 1, 2


def nat_attr(r: NatRange, family: int) -> bytes:
    """CTA_NAT_SRC or CTA_NAT_DST: the one address and port the entry translates to
    (docs/design/routed.md F14; nested as conntrack-tools sends it)."""
    af = socket.AF_INET if family == 4 else socket.AF_INET6
    lo, hi = (CTA_NAT_V4_MINIP, CTA_NAT_V4_MAXIP) if family == 4 else (CTA_NAT_V6_MINIP, CTA_NAT_V6_MAXIP)
    ip = socket.inet_pton(af, r.address)
    port = BE16.pack(r.port)
    proto = nla(CTA_NAT_PROTO | NLA_F_NESTED, nla(CTA_PROTONAT_PORT_MIN, port) + nla(CTA_PROTONAT_PORT_MAX, port))
    atype = CTA_NAT_SRC if r.side is NatSide.SRC else CTA_NAT_DST
    return nla(atype | NLA_F_NESTED, nla(lo, ip) + nla(hi, ip) + proto)


def restore_message(family: int, orig: FlowTuple, reply: FlowTuple, tcp_state: int, timeout: int,
                    closer_is_reply: bool, mark: int, seq: int, nat: tuple[NatRange, ...] = (),
                    create: bool = True) -> bytes:
    """IPCTNL_MSG_CT_NEW with NLM_F_CREATE and without EXCL (an existing entry is brought to
    the state instead): a TCP entry with both tuples, its timeout, mark and state, both
    directions BE_LIBERAL and the closing one's CLOSE_INIT. No status bits: EBUSY on create
    on 6.x kernels. Packed by hand: pyroute2's encoder cost ~230 us a message, and one goes
    with every idled-out TCP shunt's hand-back. Byte for byte what that encoder sent (nests
    without NLA_F_NESTED, attributes in its order; tests/test_conntrack_parse.py holds it).
    A NAT entry's re-creation carries its translations (`nat`: CTA_NAT_SRC/DST after the
    rest; the kernel refuses them on an existing entry, EOPNOTSUPP); without `create` it only
    updates an existing entry (ENOENT if none)."""
    tcp = (nla(CTA_PROTOINFO_TCP_STATE, bytes((tcp_state,)))
           + nla(CTA_PROTOINFO_TCP_FLAGS_ORIGINAL, LIBERAL_FLAGS if closer_is_reply else CLOSER_FLAGS)
           + nla(CTA_PROTOINFO_TCP_FLAGS_REPLY, CLOSER_FLAGS if closer_is_reply else LIBERAL_FLAGS))
    body = (struct.pack("=BBH", AF[family], 0, 0) + tuple_attr(CTA_TUPLE_ORIG, orig, 0)
            + tuple_attr(CTA_TUPLE_REPLY, reply, 0) + nla(CTA_TIMEOUT, BE32.pack(timeout))
            + nla(CTA_MARK, BE32.pack(mark)) + nla(CTA_PROTOINFO, nla(CTA_PROTOINFO_TCP, tcp)) + zone_attr(orig))
    body += b"".join(nat_attr(r, family) for r in nat)
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW,
                          NLM_F_REQUEST | NLM_F_ACK | (NLM_F_CREATE if create else 0), seq, 0) + body


# A classic BPF program for the event socket: pass a message only if its CTA_MARK has the
# ingress flag (the entry crossed the bridge plumbing; every decided mark has it too);
# everything else (the firewall host's own connections, routed traffic) is dropped in the
# kernel, before it can fill the receive buffer. SKF_AD_NLATTR finds an attribute by type.
BPF_INSN = struct.Struct("=HBBI")
SO_ATTACH_FILTER = 26
SKF_AD_NLATTR = 0xFFFFF000 + 12
NLMSG_ATTRS = NLMSG_HDR.size + 4  # nlmsghdr + nfgenmsg
# Dump filter (mark value, mask): the entries the event filter lets through.
CROSSED_PLUMBING = (markcodec.FLAG_INGRESS, markcodec.FLAG_INGRESS)


def event_filter(flags: int = markcodec.FLAG_INGRESS) -> list[tuple[int, int, int, int]]:
    return [
        (0x00, 0, 0, NLMSG_ATTRS),    # A = offset of the first attribute
        (0x01, 0, 0, CTA_MARK),       # X = CTA_MARK
        (0x20, 0, 0, SKF_AD_NLATTR),  # A = offset of the CTA_MARK attribute, 0 if none
        (0x15, 5, 0, 0),              # none (a zero mark is left out): drop
        (0x07, 0, 0, 0),              # X = A
        (0x40, 0, 0, 4),              # A = the mark (big endian, after the 4-byte header)
        (0x54, 0, 0, flags),          # A &= flags
        (0x15, 1, 0, 0),              # no flag: drop
        (0x06, 0, 0, 0xFFFFFFFF),     # pass the whole message
        (0x06, 0, 0, 0),              # drop
    ]

NLM_F_DUMP = 0x300
