"""A fake OpenFlow switch table for unit tests (after Faucet's clib/fakeoftable.py).

It is the datapath: a FlowBuilder and a SendPath take it where they take os-ken's, and
what they write (`send(bytes)`) is parsed back with os-ken's own parser and applied.
OpenFlow 1.3 and 1.0: adds (an identical match and priority replaces), modifies and
deletes (strict or not, cookie+mask, out_port, table), priorities, goto-table and
write-metadata, idle and hard timeouts against an injected `now`, a table-0 size that
answers table-full, barriers. What the switch says back is kept in `replies`, in order
(errors before the barrier that follows them), as records that read like os-ken's
messages. `packet()` answers "what happens to this packet?".

Not modelled: write-actions (taken as apply-actions), groups, meters (accepted), set-field,
buffers, overlapping flows of one priority (the first added wins).
"""
from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass
from typing import Any

from os_ken.ofproto import ofproto_parser, ofproto_protocol

from nfshunt.openflow.stats import FlowEntry
from nfshunt.records.model import OFP13, TCP, FlowTuple

ETH_IPV4, ETH_IPV6 = 0x0800, 0x86DD
VID_PRESENT = 0x1000
TABLE_ALL = 0xFF  # OFPTT_ALL (1.3); 1.0 has one table
Field = tuple[int, int | None]  # value, mask (None: exact)
Match = dict[str, Field]
# OpenFlow 1.0 match fields: name, wildcard bit, name here (the 1.3 OXM's, tcp/udp ports as tp_*)
_OF10_FIELDS = (("in_port", 1 << 0, "in_port"), ("dl_type", 1 << 4, "eth_type"), ("nw_proto", 1 << 5, "ip_proto"),
                ("tp_src", 1 << 6, "tp_src"), ("tp_dst", 1 << 7, "tp_dst"))
_PORT_FIELDS = {"tcp_src": "tp_src", "udp_src": "tp_src", "tcp_dst": "tp_dst", "udp_dst": "tp_dst"}


@dataclass
class Entry:
    table_id: int
    priority: int
    match: Match
    cookie: int
    idle_timeout: int
    hard_timeout: int
    flags: int
    outputs: list[tuple[int, int]]  # (port, max_len) of its output actions, in order
    goto: int | None
    metadata: Field | None  # what it writes: value, mask
    raw: bytes  # the flow-mod's match and instructions/actions, as a flow-stats entry carries them
    added: float
    used: float
    packets: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class BarrierReply:
    xid: int


@dataclass(frozen=True)
class Error:
    """Reads like os-ken's OFPErrorMsg for channel.table_full()."""
    xid: int
    type: int
    code: int
    datapath: Any


@dataclass(frozen=True)
class FlowRemoved:
    cookie: int
    priority: int
    reason: int  # OFPRR_*: 0 idle timeout, 1 hard timeout, 2 delete
    table_id: int
    duration_sec: int
    duration_nsec: int
    packet_count: int
    byte_count: int


@dataclass(frozen=True)
class FlowStatsReply:
    xid: int
    body: list[Any]  # os-ken's OFPFlowStats, or FlowEntry (what NFShunt reads 1.3 with)
    flags: int = 0


@dataclass(frozen=True)
class TableSizeReply:
    xid: int
    max_entries: int


@dataclass(frozen=True)
class PacketIn:
    cookie: int
    table_id: int
    match: dict[str, int]  # in_port, and metadata when the pipeline wrote some (as Open vSwitch sends)
    max_len: int
    data: bytes = b""  # the frame's first max_len bytes


def frame(t: FlowTuple | None, tcp_flags: int = 0, payload: int = 0) -> bytes:
    """The headers of a packet of tuple `t` (untagged Ethernet, IP, TCP or UDP) as the wire
    has them, with `payload` bytes of data after them (zeros)."""
    if t is None:
        return bytes(12) + struct.pack("!H", 0x0806) + bytes(28)
    l4 = struct.pack("!HHIIBBHHH", t.sport, t.dport, 0, 0, 5 << 4, tcp_flags, 1024, 0, 0) if t.proto == TCP \
        else struct.pack("!HHHH", t.sport, t.dport, 8 + payload, 0)
    src, dst = ipaddress.ip_address(t.src).packed, ipaddress.ip_address(t.dst).packed
    if t.family == 4:
        ip = struct.pack("!BBHHHBBH", 0x45, 0, 20 + len(l4) + payload, 0, 0, 64, t.proto, 0) + src + dst
    else:
        ip = struct.pack("!IHBB", 6 << 28, len(l4) + payload, t.proto, 64) + src + dst
    return bytes(12) + struct.pack("!H", ETH_IPV4 if t.family == 4 else ETH_IPV6) + ip + l4 + bytes(payload)


@dataclass(frozen=True)
class Fate:
    """What the switch did with one packet."""
    outputs: tuple[int, ...]
    packet_ins: tuple[PacketIn, ...]
    cookies: tuple[int, ...]  # of the entries it went through, table by table

    @property
    def dropped(self) -> bool:
        return not self.outputs and not self.packet_ins


def _int(value: Any) -> int:
    if isinstance(value, int):
        return value
    try:
        return int(ipaddress.ip_address(value))
    except ValueError:
        return int(str(value).replace(":", ""), 16)  # an Ethernet address


def _field(value: Any) -> Field:
    if isinstance(value, tuple):
        return _int(value[0]), _int(value[1])
    return _int(value), None


class FakeSwitch(ofproto_protocol.ProtocolDesc):
    def __init__(self, version: int = OFP13, table_size: int | None = None, now: float = 0.0,
                 reported_size: int = 1_000_000, stats_body: Any = None):
        super().__init__(version)
        self.table_size = table_size  # entries table 0 holds; None: no limit
        # What it reports table 0 holds (Open vSwitch: 1,000,000, whatever its flow_limit)
        self.reported_size = reported_size
        self.now = now
        self.stats_body = stats_body or (FlowEntry if version == OFP13 else self.ofproto_parser.OFPFlowStats)
        self.entries: list[Entry] = []
        self.replies: list[Any] = []
        self.meter_mods = 0
        self.xid = 0

    # --- the datapath a FlowBuilder and a SendPath use ------------------------------------------

    def set_xid(self, msg: Any) -> int:
        self.xid += 1
        msg.set_xid(self.xid)
        return self.xid

    def send(self, buf: bytes) -> bool:
        at = 0
        while at < len(buf):
            version, msg_type, length, xid = ofproto_parser.header(buf[at:])
            if version != self.ofproto.OFP_VERSION:
                raise ValueError(f"message of version {version} on a {self.ofproto.OFP_VERSION} switch")
            self.receive(msg_type, xid, bytes(buf[at:at + length]))
            at += length
        return True

    def receive(self, msg_type: int, xid: int, buf: bytes) -> None:
        ofp = self.ofproto
        if msg_type == ofp.OFPT_FLOW_MOD:
            msg = ofproto_parser.msg(self, ofp.OFP_VERSION, msg_type, len(buf), xid, bytearray(buf))
            self.flow_mod(msg, buf, xid)
        elif msg_type == ofp.OFPT_BARRIER_REQUEST:
            self.replies.append(BarrierReply(xid))
        elif self.version13 and msg_type == ofp.OFPT_METER_MOD:
            self.meter_mods += 1
        elif msg_type == (ofp.OFPT_MULTIPART_REQUEST if self.version13 else ofp.OFPT_STATS_REQUEST):
            self.stats_request(xid, buf)
        else:
            raise NotImplementedError(f"message type {msg_type}")

    @property
    def version13(self) -> bool:
        return self.ofproto.OFP_VERSION == OFP13

    # --- flow-mods --------------------------------------------------------------------------------

    def flow_mod(self, msg: Any, buf: bytes, xid: int) -> None:
        ofp = self.ofproto
        if msg.command == ofp.OFPFC_ADD:
            self.add(self.entry(msg, buf), xid)
        elif msg.command in (ofp.OFPFC_DELETE, ofp.OFPFC_DELETE_STRICT):
            strict = msg.command == ofp.OFPFC_DELETE_STRICT
            for e in self.select(msg, strict, out_port=msg.out_port):
                self.remove(e, ofp.OFPRR_DELETE)
        elif msg.command in (ofp.OFPFC_MODIFY, ofp.OFPFC_MODIFY_STRICT):
            new = self.entry(msg, buf)
            for e in self.select(msg, msg.command == ofp.OFPFC_MODIFY_STRICT):
                e.outputs, e.goto, e.metadata, e.raw = new.outputs, new.goto, new.metadata, new.raw
        else:
            raise NotImplementedError(f"flow-mod command {msg.command}")

    def entry(self, msg: Any, buf: bytes) -> Entry:
        match = self.match_of(msg)
        if self.version13:
            actions: list[Any] = []
            goto = metadata = None
            for inst in msg.instructions:
                actions += getattr(inst, "actions", [])
                if hasattr(inst, "metadata"):
                    metadata = (inst.metadata, inst.metadata_mask)
                goto = getattr(inst, "table_id", goto)
            raw, table_id = buf[48:], msg.table_id  # after ofp_flow_mod's fixed part
        else:
            actions, goto, metadata = msg.actions, None, None
            raw, table_id = buf[8:48] + buf[72:], 0  # its match, then its actions
        outputs = [(a.port, getattr(a, "max_len", 0)) for a in actions if hasattr(a, "port")]
        return Entry(table_id, msg.priority, match, msg.cookie, msg.idle_timeout, msg.hard_timeout, msg.flags,
                     outputs, goto, metadata, raw, self.now, self.now)

    def match_of(self, msg: Any) -> Match:
        """A flow-mod's match in the 1.3 names (untagged is vlan_vid 0 in both versions)."""
        m = msg.match
        if self.version13:
            return {_PORT_FIELDS.get(k, k): _field(v) for k, v in m.items()}
        wc = m.wildcards
        out: Match = {name: (getattr(m, attr), None) for attr, bit, name in _OF10_FIELDS if not wc & bit}
        if not wc & (1 << 1):
            out["vlan_vid"] = (0 if m.dl_vlan == 0xFFFF else VID_PRESENT | m.dl_vlan, None)
        for attr, shift, name in (("nw_src", 8, "ipv4_src"), ("nw_dst", 14, "ipv4_dst")):
            bits = min((wc >> shift) & 0x3F, 32)  # low bits wildcarded
            if bits < 32:
                out[name] = (getattr(m, attr), None if bits == 0 else (0xFFFFFFFF << bits) & 0xFFFFFFFF)
        return out

    def add(self, new: Entry, xid: int) -> None:
        ofp = self.ofproto
        same = [e for e in self.entries
                if (e.table_id, e.priority, e.match) == (new.table_id, new.priority, new.match)]
        if same:
            self.entries.remove(same[0])  # replaced, counters and all
        elif new.table_id == 0 and self.table_size is not None and len(self.table(0)) >= self.table_size:
            code = ofp.OFPFMFC_TABLE_FULL if self.version13 else ofp.OFPFMFC_ALL_TABLES_FULL
            self.replies.append(Error(xid, ofp.OFPET_FLOW_MOD_FAILED, code, self))
            return
        self.entries.append(new)

    def select(self, msg: Any, strict: bool, out_port: int | None = None) -> list[Entry]:
        """The entries a modify or delete (or a stats request) names."""
        ofp = self.ofproto
        match = self.match_of(msg)
        any_port = ofp.OFPP_ANY if self.version13 else ofp.OFPP_NONE
        table = getattr(msg, "table_id", 0) if self.version13 else 0
        mask = getattr(msg, "cookie_mask", 0)
        out = []
        for e in self.entries:
            if table != TABLE_ALL and e.table_id != table:
                continue
            if mask and e.cookie & mask != msg.cookie & mask:
                continue
            if out_port is not None and out_port != any_port and out_port not in [p for p, _ in e.outputs]:
                continue
            if strict and (e.priority != msg.priority or e.match != match):
                continue
            if not strict and not all(self.covers(f, v, e.match.get(f)) for f, v in match.items()):
                continue
            out.append(e)
        return out

    @staticmethod
    def covers(name: str, want: Field, have: Field | None) -> bool:
        """A loose match's field takes in an entry's (the entry is at least as specific)."""
        if have is None:
            return False
        (v, m), (hv, hm) = want, have
        if m is None:
            return hm is None and hv == v
        return (hm is None or hm & m == m) and hv & m == v & m

    def remove(self, e: Entry, reason: int) -> None:
        self.entries.remove(e)
        if e.flags & self.ofproto.OFPFF_SEND_FLOW_REM:
            age = self.now - e.added
            self.replies.append(FlowRemoved(e.cookie, e.priority, reason, e.table_id, int(age),
                                            int(age % 1 * 1e9), e.packets, e.bytes))

    def expire(self, now: float) -> None:
        """Time passes to `now`: idle and hard timeouts fire (flow-removed in `replies`)."""
        self.now = now
        ofp = self.ofproto
        for e in list(self.entries):
            if e.hard_timeout and now - e.added >= e.hard_timeout:
                self.remove(e, ofp.OFPRR_HARD_TIMEOUT)
            elif e.idle_timeout and now - e.used >= e.idle_timeout:
                self.remove(e, ofp.OFPRR_IDLE_TIMEOUT)

    def table(self, table_id: int) -> list[Entry]:
        return [e for e in self.entries if e.table_id == table_id]

    def take_replies(self) -> list[Any]:
        out, self.replies = self.replies, []
        return out

    # --- requests ---------------------------------------------------------------------------------

    def stats_request(self, xid: int, buf: bytes) -> None:
        ofp = self.ofproto
        kind = struct.unpack_from("!H", buf, 8)[0]
        if kind in (getattr(ofp, "OFPMP_TABLE_FEATURES", -1), getattr(ofp, "OFPST_TABLE", -1)):
            self.replies.append(TableSizeReply(xid, self.reported_size))
            return
        if kind != (ofp.OFPMP_FLOW if self.version13 else ofp.OFPST_FLOW):
            return  # meter stats and others: not answered
        if self.version13:  # ofp_flow_stats_request after the multipart header, then an empty match
            table, out_port, _group, cookie, mask = struct.unpack_from("!B3xII4xQQ", buf, 16)
            match_all = struct.unpack_from("!H", buf, 16 + 32 + 2)[0] == 4
        else:  # 1.0: the match (all wildcarded: OFPFW_ALL), table, out_port; no cookie filter
            (table, out_port), cookie, mask = struct.unpack_from("!BxH", buf, 12 + 40), 0, 0
            match_all = struct.unpack_from("!I", buf, 12)[0] & 0x3FFFFF == 0x3FFFFF
        if not match_all:
            raise NotImplementedError("a flow-stats request with a match")
        any_port = ofp.OFPP_ANY if self.version13 else ofp.OFPP_NONE
        body = [self.stats_body.parser(self.stats_entry(e), 0) for e in self.entries
                if table in (TABLE_ALL, e.table_id) and e.cookie & mask == cookie & mask
                and (out_port == any_port or out_port in [p for p, _ in e.outputs])]
        self.replies.append(FlowStatsReply(xid, body))

    def stats_entry(self, e: Entry) -> bytes:
        """The flow-stats entry a switch reports for `e`, in bytes."""
        age = self.now - e.added
        sec, nsec = int(age), int(age % 1 * 1e9)
        if self.version13:
            return struct.pack("!HBxIIHHHH4xQQQ", 48 + len(e.raw), e.table_id, sec, nsec, e.priority,
                               e.idle_timeout, e.hard_timeout, e.flags, e.cookie, e.packets, e.bytes) + e.raw
        match, actions = e.raw[:40], e.raw[40:]
        return (struct.pack("!HBx", 88 + len(actions), 0) + match
                + struct.pack("!IIHHH6xQQQ", sec, nsec, e.priority, e.idle_timeout, e.hard_timeout, e.cookie,
                              e.packets, e.bytes) + actions)

    # --- what happens to a packet -----------------------------------------------------------------

    def packet(self, in_port: int, t: FlowTuple | None = None, tcp_flags: int = 0, vlan: int | None = None,
               size: int = 100, payload: int = 0) -> Fate:
        """Send one packet in at `in_port` (an IP packet of tuple `t` with `payload` bytes of
        data, else a non-IP frame): the ports it leaves by and the packet-ins it makes (also
        put in `replies`, with the packet's first bytes)."""
        pkt = {"in_port": in_port, "vlan_vid": 0 if vlan is None else VID_PRESENT | vlan, "metadata": 0}
        if t is not None:
            pkt.update(eth_type=ETH_IPV4 if t.family == 4 else ETH_IPV6, ip_proto=t.proto,
                       tp_src=t.sport, tp_dst=t.dport, tcp_flags=tcp_flags if t.proto == TCP else 0)
            pkt[f"ipv{t.family}_src"], pkt[f"ipv{t.family}_dst"] = _int(t.src), _int(t.dst)
        else:
            pkt["eth_type"] = 0x0806
        outputs: list[int] = []
        packet_ins: list[PacketIn] = []
        seen: list[int] = []
        table: int | None = 0
        while table is not None:
            e = self.lookup(table, pkt)
            if e is None:
                break  # a table miss: dropped (no table-miss flow in 1.3)
            e.packets, e.bytes, e.used = e.packets + 1, e.bytes + size, self.now
            seen.append(e.cookie)
            for port, max_len in e.outputs:
                if port == self.ofproto.OFPP_CONTROLLER:
                    fields = {"in_port": in_port, **({"metadata": pkt["metadata"]} if pkt["metadata"] else {})}
                    packet_ins.append(PacketIn(e.cookie, e.table_id, fields, max_len,
                                               frame(t, tcp_flags, payload)[:max_len]))
                else:
                    outputs.append(port)
            if e.metadata is not None:
                value, mask = e.metadata
                pkt["metadata"] = (pkt["metadata"] & ~mask) | (value & mask)
            table = e.goto
        self.replies.extend(packet_ins)
        return Fate(tuple(outputs), tuple(packet_ins), tuple(seen))

    def lookup(self, table: int, pkt: dict[str, int]) -> Entry | None:
        best: Entry | None = None
        for e in self.entries:
            if e.table_id != table or (best is not None and e.priority <= best.priority):
                continue
            if all(f in pkt and (pkt[f] == v if m is None else pkt[f] & m == v & m) for f, (v, m) in e.match.items()):
                best = e
        return best
