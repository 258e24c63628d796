"""The conntrack side over netlink (ctnetlink messages packed and parsed here, no CLI, no shell).

ConntrackListener: a thread that reads NEW/UPDATE/DESTROY events from a multicast
netlink socket with a large receive buffer and hands them over in batches. When the
kernel reports ENOBUFS (events were dropped), it says so, so the owner can resync
from a dump.

ConntrackWorker: a thread that deletes, updates and re-creates entries (batched,
acknowledged) and dumps the table, so that none of it ever blocks the OpenFlow event loop.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import queue
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from pyroute2.netlink import NLM_F_ACK, NLM_F_REQUEST
from pyroute2.netlink.nfnetlink import NFNL_SUBSYS_CTNETLINK
from pyroute2.netlink.nfnetlink.nfctsocket import IPCTNL_MSG_CT_DELETE, IPCTNL_MSG_CT_NEW, nfct_msg

from nfshunt.records import markcodec
from nfshunt.records.model import ConnEvent, EventKind, FlowTuple, address_text

LOG = logging.getLogger("nfshunt.conntrack")

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
    orig = _tuple(msg.get_attr("CTA_TUPLE_ORIG"), family)
    reply = _tuple(msg.get_attr("CTA_TUPLE_REPLY"), family)
    ct_id = msg.get_attr("CTA_ID")
    if orig is None or reply is None or ct_id is None:
        raise MalformedEvent("missing tuple or id")
    state = msg.get_nested("CTA_PROTOINFO", "CTA_PROTOINFO_TCP", "CTA_PROTOINFO_TCP_STATE")
    return ConnEvent(kind, ct_id, orig, reply, msg.get_attr("CTA_MARK") or 0, state, received)


def _tuple(nla: Any, family: int) -> FlowTuple | None:
    if nla is None:
        return None
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
                     proto.get_attr("CTA_PROTO_DST_PORT") or 0)


# ctnetlink attribute numbers (include/uapi/linux/netfilter/nfnetlink_conntrack.h).
CTA_TUPLE_ORIG, CTA_TUPLE_REPLY, CTA_PROTOINFO, CTA_TIMEOUT, CTA_MARK, CTA_ID, CTA_MARK_MASK = 1, 2, 4, 7, 8, 12, 21
CTA_TUPLE_IP, CTA_TUPLE_PROTO = 1, 2
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


def _fast_tuple(data: bytes, span: tuple[int, int] | None, family: int) -> FlowTuple:
    if span is None:
        raise MalformedEvent("missing tuple")
    t = _attrs(data, *span)
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
                     _PORTS[BE16.unpack_from(data, dp[0])[0]] if dp and dp[1] - dp[0] >= 2 else 0)


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
    orig = _fast_tuple(data, top.get(CTA_TUPLE_ORIG), family)
    reply = _fast_tuple(data, top.get(CTA_TUPLE_REPLY), family)
    return ConnEvent(kind, BE32.unpack_from(data, ct_id[0])[0], orig, _mirrored(orig, reply),
                     BE32.unpack_from(data, mark[0])[0] if mark and mark[1] - mark[0] == 4 else 0,
                     state, received)


def _mirrored(orig: FlowTuple, reply: FlowTuple) -> FlowTuple:
    """The reply tuple; without NAT, made of the original's own address objects: a shunt
    keeps both tuples for its life, and sharing the addresses saves 128 B a shunt."""
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


def _nla(atype: int, payload: bytes) -> bytes:
    return NLA_HDR.pack(4 + len(payload), atype) + payload + b"\0" * (-len(payload) & 3)


def tuple_attr(atype: int, t: FlowTuple, nested: int = NLA_F_NESTED) -> bytes:
    af = socket.AF_INET if t.family == 4 else socket.AF_INET6
    src_t, dst_t = (CTA_IP_V4_SRC, CTA_IP_V4_DST) if t.family == 4 else (CTA_IP_V6_SRC, CTA_IP_V6_DST)
    ip = _nla(src_t, socket.inet_pton(af, t.src)) + _nla(dst_t, socket.inet_pton(af, t.dst))
    proto = (CTA_PROTO_NUM_ATTR.pack(5, CTA_PROTO_NUM, t.proto)
             + CTA_PORT_ATTR.pack(6, CTA_PROTO_SRC_PORT, socket.htons(t.sport))
             + CTA_PORT_ATTR.pack(6, CTA_PROTO_DST_PORT, socket.htons(t.dport)))
    return _nla(atype | nested, _nla(CTA_TUPLE_IP | nested, ip) + _nla(CTA_TUPLE_PROTO | nested, proto))


def delete_message(family: int, t: FlowTuple, ct_id: int | None, seq: int) -> bytes:
    """IPCTNL_MSG_CT_DELETE for a tuple (and id: only that entry), packed by hand: pyroute2's
    encoder costs ~100 us a message and deletes run at the shunt rate."""
    body = struct.pack("=BBH", AF[family], 0, 0) + tuple_attr(CTA_TUPLE_ORIG, t)
    if ct_id is not None:
        body += _nla(CTA_ID, BE32.pack(ct_id))
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE,
                          NLM_F_REQUEST | NLM_F_ACK, seq, 0) + body


def mark_update_message(family: int, t: FlowTuple, ct_id: int, mark: int, mask: int, seq: int) -> bytes:
    """IPCTNL_MSG_CT_NEW without NLM_F_CREATE: change an existing entry's mark, only the
    bits in `mask` (the kernel keeps the others: new = (old & ~mask) ^ mark)."""
    body = (struct.pack("=BBH", AF[family], 0, 0) + tuple_attr(CTA_TUPLE_ORIG, t) + _nla(CTA_ID, BE32.pack(ct_id))
            + _nla(CTA_MARK, BE32.pack(mark & mask)) + _nla(CTA_MARK_MASK, BE32.pack(mask)))
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW,
                          NLM_F_REQUEST | NLM_F_ACK, seq, 0) + body


def liberal_message(family: int, t: FlowTuple, ct_id: int, seq: int) -> bytes:
    """IPCTNL_MSG_CT_NEW without NLM_F_CREATE: set BE_LIBERAL on both directions of an
    existing TCP entry (struct nf_ct_tcp_flags: the flag and a mask of only that bit).
    Packed by hand: one goes with every TCP shunt."""
    tcp = _nla(CTA_PROTOINFO_TCP_FLAGS_ORIGINAL, LIBERAL_FLAGS) + _nla(CTA_PROTOINFO_TCP_FLAGS_REPLY, LIBERAL_FLAGS)
    body = (struct.pack("=BBH", AF[family], 0, 0) + tuple_attr(CTA_TUPLE_ORIG, t) + _nla(CTA_ID, BE32.pack(ct_id))
            + _nla(CTA_PROTOINFO | NLA_F_NESTED, _nla(CTA_PROTOINFO_TCP | NLA_F_NESTED, tcp)))
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW,
                          NLM_F_REQUEST | NLM_F_ACK, seq, 0) + body


def timeout_message(family: int, t: FlowTuple, ct_id: int, timeout: int, seq: int) -> bytes:
    """IPCTNL_MSG_CT_NEW without NLM_F_CREATE: give an existing entry (that id only)
    `timeout` seconds; its state, mark and flags stay. Packed by hand like its neighbours."""
    body = (struct.pack("=BBH", AF[family], 0, 0) + tuple_attr(CTA_TUPLE_ORIG, t) + _nla(CTA_ID, BE32.pack(ct_id))
            + _nla(CTA_TIMEOUT, BE32.pack(timeout)))
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW,
                          NLM_F_REQUEST | NLM_F_ACK, seq, 0) + body


def restore_message(family: int, orig: FlowTuple, reply: FlowTuple, tcp_state: int, timeout: int,
                    closer_is_reply: bool, mark: int, seq: int) -> bytes:
    """IPCTNL_MSG_CT_NEW with NLM_F_CREATE and without EXCL (an existing entry is brought to
    the state instead): a TCP entry with both tuples, its timeout, mark and state, both
    directions BE_LIBERAL and the closing one's CLOSE_INIT. No status bits: EBUSY on create
    on 6.x kernels. Packed by hand: pyroute2's encoder cost ~230 us a message, and one goes
    with every idled-out TCP shunt's hand-back. Byte for byte what that encoder sent (nests
    without NLA_F_NESTED, attributes in its order; tests/test_conntrack_parse.py holds it)."""
    tcp = (_nla(CTA_PROTOINFO_TCP_STATE, bytes((tcp_state,)))
           + _nla(CTA_PROTOINFO_TCP_FLAGS_ORIGINAL, LIBERAL_FLAGS if closer_is_reply else CLOSER_FLAGS)
           + _nla(CTA_PROTOINFO_TCP_FLAGS_REPLY, CLOSER_FLAGS if closer_is_reply else LIBERAL_FLAGS))
    body = (struct.pack("=BBH", AF[family], 0, 0) + tuple_attr(CTA_TUPLE_ORIG, orig, 0)
            + tuple_attr(CTA_TUPLE_REPLY, reply, 0) + _nla(CTA_TIMEOUT, BE32.pack(timeout))
            + _nla(CTA_MARK, BE32.pack(mark)) + _nla(CTA_PROTOINFO, _nla(CTA_PROTOINFO_TCP, tcp)))
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW,
                          NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE, seq, 0) + body


# A classic BPF program for the event socket: pass a message only if its CTA_MARK has the
# ingress flag (the entry crossed the bridge plumbing; every decided mark has it too);
# everything else (the firewall host's own connections, routed traffic) is dropped in the
# kernel, before it can fill the receive buffer. SKF_AD_NLATTR finds an attribute by type.
_BPF = struct.Struct("=HBBI")
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


def attach_filter(sock: socket.socket, program: list[tuple[int, int, int, int]]) -> None:
    code = b"".join(_BPF.pack(*ins) for ins in program)
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("HL", len(program), ctypes.addressof(buf))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)


LOSS_REPORT_MAX = 1.0  # seconds a loss may wait for the event queue to drain before a dump
# Events read from the socket and handed to the event loop at once. A turn's flow-mods go
# out in one write, and the loop waits while the switch takes them: with 1,000, a status
# read during a 100,000 burst waited up to 1.7 s (median 0.7); with 250, up to 0.7 s
# (median 0.26), for 5-10 % less burst speed (bench/results/2026-11-23/coalesce-d/).
COALESCE_MAX = 250


class ConntrackListener:
    def __init__(self, rcvbuf: int, on_events: Callable[[list[ConnEvent]], None],
                 on_overflow: Callable[[], None], on_malformed: Callable[[str], None]):
        self.rcvbuf = rcvbuf
        self.on_events = on_events
        self.on_overflow = on_overflow
        self.on_malformed = on_malformed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.sock = self._open()  # opened up front so a failure is reported at start-up

    def _open(self) -> socket.socket:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, self.rcvbuf)
        except PermissionError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
        try:
            attach_filter(sock, event_filter())
        except OSError as exc:  # the parser still copes; it just reads everything
            LOG.warning("cannot filter conntrack events in the kernel: %s", exc)
        sock.bind((0, NFNLGRP_CONNTRACK_NEW | NFNLGRP_CONNTRACK_UPDATE | NFNLGRP_CONNTRACK_DESTROY))
        sock.settimeout(0.5)  # wake up to notice stop()
        return sock

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="conntrack-listener", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self.sock.close()

    def _run(self) -> None:
        buf = bytearray(1 << 18)
        view = memoryview(buf)
        lost_since: float | None = None  # an ENOBUFS not yet answered by a dump request
        while not self._stop.is_set():
            if lost_since is not None:
                lost_since = self._report_loss(lost_since)
            try:
                n = self.sock.recv_into(buf)
            except socket.timeout:
                continue
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    if lost_since is None:
                        lost_since = time.monotonic()
                    continue
                if self._stop.is_set():
                    return
                LOG.error("conntrack netlink socket failed: %s; reopening", exc)
                time.sleep(0.5)
                try:
                    self.sock.close()
                    self.sock = self._open()
                except OSError as exc2:
                    LOG.error("cannot reopen conntrack socket: %s", exc2)
                self.on_overflow()  # events may have been missed meanwhile
                continue
            events = parse_datagram(bytes(view[:n]), time.monotonic(), self.on_malformed)
            if self._coalesce(events, buf, view):
                lost_since = lost_since or time.monotonic()
            if events:
                self.on_events(events)

    def _coalesce(self, events: list[ConnEvent], buf: bytearray, view: memoryview) -> bool:
        """Add what else is queued (up to COALESCE_MAX events) to one hand-over: under a
        burst the event loop takes them in one turn and one write to the switch, not a
        turn each (bursts of 10,000 ran 2-3 times faster); at low load the queue is empty
        and nothing waits. True if the kernel reported a loss."""
        while len(events) < COALESCE_MAX and select.select([self.sock], [], [], 0)[0]:
            try:
                n = self.sock.recv_into(buf)
            except OSError as exc:  # socket.timeout included: the main loop deals with the rest
                return exc.errno == errno.ENOBUFS
            events.extend(parse_datagram(bytes(view[:n]), time.monotonic(), self.on_malformed))
        return False

    def _report_loss(self, since: float) -> float | None:
        """Ask for a dump once the socket's queue is empty; returns when to ask again.

        The kernel reports ENOBUFS once per congestion: events it drops after that, until
        the queue has been read empty, are dropped without a word. A dump started earlier
        can miss an entry whose event is dropped in that window, and nothing would ever
        ask again (a burst left 1-16 of 30,000 entries unshunted). So the dump is asked
        for when the queue is empty (every drop from then on is reported again), or after
        LOSS_REPORT_MAX under a storm that never lets it drain, and then once more when
        it does."""
        readable, _, _ = select.select([self.sock], [], [], 0)
        now = time.monotonic()
        if not readable:
            self.on_overflow()
            return None
        if now - since >= LOSS_REPORT_MAX:
            self.on_overflow()
            return now
        return since


# The worker's requests. Deletes, liberal marks and restores go in lists (a turn's worth
# in one netlink write); a clear, a callback, a dump and the stop (None) go on their own.
@dataclass(frozen=True, slots=True)
class Delete:
    family: int
    orig: FlowTuple
    ct_id: int | None  # with an id the kernel deletes only that entry


@dataclass(frozen=True, slots=True)
class Liberal:
    family: int
    orig: FlowTuple
    ct_id: int


@dataclass(frozen=True, slots=True)
class Expire:
    family: int
    orig: FlowTuple
    ct_id: int
    timeout: int


@dataclass(frozen=True, slots=True)
class Restore:
    family: int
    orig: FlowTuple
    reply: FlowTuple
    tcp_state: int
    timeout: int
    closer_is_reply: bool
    mark: int
    done: Callable[[], None]  # runs after the kernel answered, whatever it answered


@dataclass(frozen=True, slots=True)
class ClearMarks:
    mask: int
    done: Callable[[int, int, str | None], None]


@dataclass(frozen=True, slots=True)
class Call:
    callback: Callable[[], None]


@dataclass(frozen=True, slots=True)
class Dump:
    pass


Request = Delete | Liberal | Expire | Restore  # batched: one netlink message each
_DUMP = Dump()


class ConntrackWorker:
    """Deletes and dumps on a thread of their own; results come back through callbacks."""

    def __init__(self, on_dump: Callable[[list[ConnEvent]], None],
                 on_malformed: Callable[[str], None], batch: int = 256):
        self.on_dump = on_dump
        self.on_malformed = on_malformed
        self.batch = batch
        self.q: queue.Queue = queue.Queue()  # lists of requests; dump, clear and stop on their own
        self._local = threading.local()
        self._seq = 0
        self.deleted = 0
        self.delete_missing = 0
        self.restored = 0
        self._dump_lock = threading.Lock()
        self._dump_queued = False
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.bind((0, 0))
        self.sock.settimeout(2.0)
        self._thread = threading.Thread(target=self._run, name="conntrack-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.q.put(None)
        self._thread.join(timeout=5)
        self.sock.close()

    def _put(self, item: Request) -> None:
        held = getattr(self._local, "held", None)
        if held is not None:
            held.append(item)
        else:
            self.q.put([item])

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Deletes, liberal marks and restores asked for on this thread inside go to the
        worker together when it ends: one wake-up and one netlink write for an event-loop
        turn's worth, not one a shunt (each wake-up took the GIL from the event loop)."""
        if getattr(self._local, "held", None) is not None:  # nested: the outer one hands over
            yield
            return
        held: list[Request] = []
        self._local.held = held
        try:
            yield
        finally:
            self._local.held = None
            if held:
                self.q.put(held)

    def delete(self, family: int, orig: FlowTuple, ct_id: int | None) -> None:
        self._put(Delete(family, orig, ct_id))

    def restore(self, family: int, orig: FlowTuple, reply: FlowTuple, tcp_state: int, timeout: int,
                closer_is_reply: bool, mark: int, done: Callable[[], None]) -> None:
        """Create a TCP entry in the given state (see core: teardown, re-evaluation, idle
        shunts), or bring the entry that exists to it (one kept until the slow path drained,
        or one a straggler re-created); `done` runs after the kernel answered, whatever it
        answered."""
        self._put(Restore(family, orig, reply, tcp_state, timeout, closer_is_reply, mark, done))

    def liberal(self, family: int, orig: FlowTuple, ct_id: int) -> None:
        """Stop window tracking of a TCP entry (both directions BE_LIBERAL): while a switch
        applies a pair's flows one direction at a time, the firewall sees acknowledgements
        of data that took the fast path, which it would otherwise call INVALID."""
        self._put(Liberal(family, orig, ct_id))

    def expire(self, family: int, orig: FlowTuple, ct_id: int, timeout: int) -> None:
        """Give an existing entry `timeout` seconds (its traffic renews it as usual)."""
        self._put(Expire(family, orig, ct_id, timeout))

    def clear_marks(self, mask: int, done: Callable[[int, int, str | None], None]) -> None:
        """Clear the `mask` bits of every entry that has any of them; `done(cleared,
        failed, error)` runs on this thread once the kernel has answered."""
        self.q.put(ClearMarks(mask, done))

    def after(self, callback: Callable[[], None]) -> None:
        """Run `callback` on this thread once every request queued before it is answered."""
        self.q.put(Call(callback))

    def dump(self) -> None:
        """Ask for a dump; requests made while one is already queued share it (a burst of
        lost events must not queue a dump per loss, ahead of the deletes)."""
        with self._dump_lock:
            if self._dump_queued:
                return
            self._dump_queued = True
        self.q.put(_DUMP)

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            match item:
                case list():  # deletes, liberal marks and restores
                    self._requests(item)
                case Dump():
                    with self._dump_lock:
                        self._dump_queued = False  # losses from now on need a dump of their own
                    self._dump()
                case Call(callback):
                    callback()
                case ClearMarks(mask, done):
                    try:
                        cleared, failed = clear_marks(mask, self.on_malformed)
                    except OSError as exc:
                        done(0, 0, str(exc))
                    else:
                        done(cleared, failed, None)

    def _requests(self, batch: list[Request]) -> None:
        """Requests queued together, and those queued meanwhile, in netlink writes of at
        most `batch` messages (their acknowledgements must fit the socket's buffer)."""
        while len(batch) < self.batch:
            try:
                nxt = self.q.get_nowait()
            except queue.Empty:
                break
            if not isinstance(nxt, list):
                self.q.put(nxt)  # a dump, a clear or the stop: after this batch
                break
            batch.extend(nxt)
        for at in range(0, len(batch), self.batch):
            part = batch[at:at + self.batch]
            try:
                self._send_batch(part)
            except OSError as exc:
                LOG.error("conntrack update failed: %s", exc)
            for item in part:
                if isinstance(item, Restore):
                    try:
                        item.done()
                    except Exception:
                        LOG.exception("restore callback failed")

    def _send_batch(self, batch: list[Request]) -> None:
        out = bytearray()
        pending: dict[int, Request] = {}
        for item in batch:
            self._seq = (self._seq + 1) & 0xFFFFFFFF
            if isinstance(item, Delete):
                out += delete_message(item.family, item.orig, item.ct_id, self._seq)
            elif isinstance(item, Liberal):
                out += liberal_message(item.family, item.orig, item.ct_id, self._seq)
            elif isinstance(item, Expire):
                out += timeout_message(item.family, item.orig, item.ct_id, item.timeout, self._seq)
            else:
                out += restore_message(item.family, item.orig, item.reply, item.tcp_state, item.timeout,
                                       item.closer_is_reply, item.mark, self._seq)
            pending[self._seq] = item
        self.sock.send(bytes(out))
        deadline = time.monotonic() + 2.0
        while pending and time.monotonic() < deadline:
            try:
                data = self.sock.recv(1 << 16)
            except socket.timeout:
                break
            for seq, code in netlink_acks(data):
                if seq in pending:
                    self._account(pending.pop(seq), -code)
        if pending:
            LOG.warning("%d conntrack requests unacknowledged", len(pending))

    def _account(self, item: Request, err: int) -> None:
        if isinstance(item, Delete):
            if err == 0:
                self.deleted += 1
                if LOG.isEnabledFor(logging.DEBUG):  # benchmarks time the deletion from this
                    t = item.orig
                    LOG.debug("conntrack entry %s deleted", t, extra={"fields": {
                        "event": "ct_deleted", "ct_id": item.ct_id, "src": t.src, "sport": t.sport, "dport": t.dport}})
            elif err == errno.ENOENT:
                self.delete_missing += 1  # already gone: nothing to free
            else:
                LOG.warning("conntrack delete refused: %s", errno.errorcode.get(err, err))
        elif isinstance(item, Liberal):
            if err not in (0, errno.ENOENT):  # ENOENT: the connection ended meanwhile
                LOG.warning("conntrack entry %s not made liberal: %s", item.orig, errno.errorcode.get(err, err))
        elif isinstance(item, Expire):
            if err not in (0, errno.ENOENT):  # ENOENT: gone already
                LOG.warning("conntrack entry %s kept its timeout: %s", item.orig, errno.errorcode.get(err, err))
        elif err == 0:
            self.restored += 1
        else:
            LOG.warning("conntrack entry for a teardown not created: %s", errno.errorcode.get(err, err))

    def _dump(self) -> None:
        try:  # only entries that crossed the plumbing matter to the core
            events = raw_dump(self.on_malformed, CROSSED_PLUMBING)
        except OSError as exc:
            LOG.error("conntrack dump failed: %s", exc)
            return
        self.on_dump(events)


IPCTNL_MSG_CT_GET = 1
NLM_F_DUMP = 0x300


def raw_dump(on_malformed: Callable[[str], None], mark: tuple[int, int] | None = None) -> list[ConnEvent]:
    """The whole conntrack table (IPv4 and IPv6) over a socket of its own, parsed with the
    fast parser: pyroute2's decoder would need ~18 s for 100,000 entries. With `mark`
    (value, mask) the kernel sends only entries whose mark & mask equals value."""
    now = time.monotonic()
    events: list[ConnEvent] = []
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    try:
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
        except PermissionError:
            pass
        sock.bind((0, 0))
        sock.settimeout(10)
        req = struct.pack("=BBH", socket.AF_UNSPEC, 0, 0)
        if mark is not None:
            req += _nla(CTA_MARK, BE32.pack(mark[0])) + _nla(CTA_MARK_MASK, BE32.pack(mark[1]))
        sock.send(NLMSG_HDR.pack(NLMSG_HDR.size + len(req), (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET,
                                 NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + req)
        while True:
            data = sock.recv(1 << 20)
            offset = 0
            while offset + NLMSG_HDR.size <= len(data):
                length, mtype, _flags, _seq, _pid = NLMSG_HDR.unpack_from(data, offset)
                if length < NLMSG_HDR.size or offset + length > len(data):
                    raise OSError("conntrack dump: bad netlink length")
                if mtype == NLMSG_DONE:
                    return events
                if mtype == NLMSG_ERROR:
                    (code,) = struct.unpack_from("=i", data, offset + NLMSG_HDR.size)
                    if code:
                        raise OSError(-code, f"conntrack dump refused: {errno.errorcode.get(-code, code)}")
                elif mtype >> 8 == NFNL_SUBSYS_CTNETLINK:
                    try:
                        events.append(parse_fast(data, offset, length, EventKind.DUMP, now))
                    except Exception as exc:
                        on_malformed(f"dump: {type(exc).__name__}: {exc}")
                offset += (length + 3) & ~3
    finally:
        sock.close()


def clear_marks(mask: int, on_malformed: Callable[[str], None] | None = None,
                batch: int = 256) -> tuple[int, int]:
    """Clear the `mask` bits of every entry's mark (a new policy: each entry's next packet
    is judged again). Dumps the entries that have the ingress flag, then updates them in
    acknowledged batches. Returns (cleared, failed); an entry gone meanwhile is neither."""
    report = on_malformed or (lambda what: LOG.warning("skipped malformed entry: %s", what))
    entries = [e for e in raw_dump(report, CROSSED_PLUMBING) if e.mark & mask]
    cleared = failed = 0
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    try:
        sock.bind((0, 0))
        sock.settimeout(2.0)
        for start in range(0, len(entries), batch):
            chunk = entries[start:start + batch]
            msgs = b"".join(mark_update_message(e.orig.family, e.orig, e.ct_id, 0, mask, i + 1)
                            for i, e in enumerate(chunk))
            sock.send(msgs)
            waiting = set(range(1, len(chunk) + 1))
            while waiting:
                data = sock.recv(1 << 16)
                for seq, code in netlink_acks(data):
                    if seq in waiting:
                        waiting.discard(seq)
                        if code == 0:
                            cleared += 1
                        elif -code != errno.ENOENT:
                            failed += 1
    finally:
        sock.close()
    return cleared, failed


LOOKUP_SECONDS = 1.0  # for the kernel's answer to one lookup request


def _lookup_socket() -> socket.socket:
    """A blocking socket whose receive times out in the kernel (SO_RCVTIMEO): with a
    Python timeout every send and receive is a poll and the call, each letting go of the
    GIL, which 16 API threads and the event loop contend for."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    try:
        sock.bind((0, 0))
        seconds = int(LOOKUP_SECONDS)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                        struct.pack("@ll", seconds, int((LOOKUP_SECONDS - seconds) * 1e6)))
    except BaseException:
        sock.close()
        raise
    return sock


class _Lookups:
    """One thread's lookup socket and its sequence numbers. Kept for the thread's life: a
    socket opened, bound and closed for every lookup was ~15 % of the IDS API's threads'
    time at 1,000 requests a second. Closed when the thread ends (threading.local drops
    it), or when a lookup on it fails."""

    def __init__(self) -> None:
        self.sock = _lookup_socket()
        self.seq = 0

    def __del__(self) -> None:
        self.sock.close()

    def ask(self, t: FlowTuple) -> ConnEvent | None:
        """The entry whose original tuple is `t`, or None (the kernel's error: none).
        Only the answer carrying this request's sequence number is taken: anything else
        on the socket is an earlier request's, late."""
        self.seq = self.seq % 0xFFFFFFFF + 1
        body = struct.pack("=BBH", AF[t.family], 0, 0) + tuple_attr(CTA_TUPLE_ORIG, t)
        self.sock.send(NLMSG_HDR.pack(NLMSG_HDR.size + len(body), (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET,
                                      NLM_F_REQUEST, self.seq, 0) + body)
        deadline = time.monotonic() + LOOKUP_SECONDS
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except BlockingIOError:  # SO_RCVTIMEO passed
                raise TimeoutError("conntrack lookup: no answer") from None
            offset = 0
            while offset + NLMSG_HDR.size <= len(data):
                length, mtype, _flags, seq, _pid = NLMSG_HDR.unpack_from(data, offset)
                if length < NLMSG_HDR.size or offset + length > len(data):
                    raise OSError("conntrack lookup: bad netlink length")
                if seq == self.seq:
                    if mtype >> 8 == NFNL_SUBSYS_CTNETLINK:
                        return parse_fast(data, offset, length, EventKind.DUMP, time.monotonic())
                    return None
                offset += (length + 3) & ~3
            if time.monotonic() >= deadline:  # late answers only, for the whole wait
                raise TimeoutError("conntrack lookup: no answer")


_LOOKUPS = threading.local()


def lookup(t: FlowTuple) -> ConnEvent | None:
    """The live conntrack entry of a connection named by either direction's tuple (an IDS
    names it as it saw it), or None; one request each way on the calling thread's own
    socket (the IDS API's threads call it, never the event loop). After any error the
    socket is dropped, and with it any answer still to come: the next lookup opens another."""
    own: _Lookups | None = getattr(_LOOKUPS, "own", None)
    if own is None:
        own = _LOOKUPS.own = _Lookups()
    try:
        entry = own.ask(t)
        return entry if entry is not None else own.ask(t.reversed())
    except BaseException:
        _LOOKUPS.own = None
        own.sock.close()
        raise


def dump_entries() -> Iterable[ConnEvent]:
    """A one-off synchronous dump (tests, status tools)."""
    return raw_dump(lambda what: LOG.warning("skipped malformed entry: %s", what))
