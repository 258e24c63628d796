"""A fake OpenFlow switch for unit tests (after Faucet's clib/fakeoftable.py): the flow
table, and the datapath the app serves.

It is the datapath: a FlowBuilder and a SendPath take it where they take os-ken's, and
what they write (`send(bytes)`) is parsed back with os-ken's own parser and applied.
OpenFlow 1.3 and 1.0: adds (an identical match and priority replaces), modifies and
deletes (strict or not, cookie+mask, out_port, table), priorities, goto-table and
write-metadata, idle and hard timeouts against an injected `now`, a table-0 size that
answers table-full, barriers. `packet()` answers "what happens to this packet?".

What the switch says back is written as OpenFlow bytes and read with os-ken's parser (and
the parsers NFShunt installs in it: channel.install_connection_factory), so `replies`
holds, in order, the very messages os-ken hands the app (errors before the barrier that
follows them): barrier replies, errors, flow-removed, packet-ins, multipart replies in parts
of at most `stats_part` entries (flow stats, table features or 1.0 table stats, meter
stats), role replies, and the features reply of a handshake (`features()`). `mute` names
requests it leaves unanswered, `refuse` those it answers with an error.

Not modelled: write-actions (taken as apply-actions), groups, meters (accepted, their drops
set by the test), set-field, buffers, overlapping flows of one priority (the first added
wins), several controllers' roles (one connection: a stale generation is refused).
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import ipaddress
import struct
from dataclasses import dataclass
from typing import Any, Callable

from os_ken.ofproto import ofproto_parser, ofproto_protocol, ofproto_v1_3_parser

from nfshunt.openflow.channel import install_connection_factory
from nfshunt.records.model import OFP13, TCP, FlowTuple

# The process's os-ken parsers as the controller has them (its one app is NFShunt's): flow
# stats read as FlowEntry, table features as TableSize, flow-removed without its match.
install_connection_factory()

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
    request: bytes  # the flow-mod as it came (an error quotes it)
    added: float
    used: float
    packets: int = 0
    bytes: int = 0
    # Its actions in order, as ("out", port, max_len), ("vid", vid), ("push", 0), ("pop", 0):
    # what a packet's tag is at each output.
    ops: tuple[tuple[int | str, ...], ...] = ()


# Requests `mute` and `refuse` name.
BARRIER, FLOWS, TABLE, METER_STATS, METER_SET, ROLE = "barrier", "flows", "table", "meter stats", "meter set", "role"
ASYNC = "set async"  # counted in `asked` only
_HEADER = struct.Struct("!BBHI")
_ROLE = struct.Struct("!I4xQ")
METER, SILENT = "meter", "silent"  # how packet-ins are lost (lose_packet_ins)
NOCHANGE, EQUAL, MASTER, SLAVE = 0, 1, 2, 3  # OpenFlow 1.3 controller roles
UNDEFINED_GENERATION = (1 << 64) - 1  # what Open vSwitch reports before any generation was set


@dataclass(frozen=True)
class PacketIn:
    """A packet-in a packet made (the message itself goes to `replies`)."""
    cookie: int
    table_id: int
    match: dict[str, int]  # in_port, and metadata when the pipeline wrote some (as Open vSwitch sends)
    max_len: int
    data: bytes = b""  # the frame's first max_len bytes (what the message carries)


def _op(action: Any) -> tuple[int | str, ...] | None:
    """An action as Entry.ops has it (None: one the fake switch ignores)."""
    name = type(action).__name__
    if name == "OFPActionOutput":
        return ("out", action.port, getattr(action, "max_len", 0))
    if name == "OFPActionSetField" and action.key == "vlan_vid":
        return ("vid", action.value & 0xFFF)
    if name == "OFPActionVlanVid":
        return ("vid", action.vlan_vid)
    if name == "OFPActionPushVlan":
        return ("push", 0)
    if name in ("OFPActionPopVlan", "OFPActionStripVlan"):
        return ("pop", 0)
    return None


def frame(t: FlowTuple | None, tcp_flags: int = 0, payload: int = 0, vlan: int | None = None, pcp: int = 0,
          seq: int = 0) -> bytes:
    """The headers of a packet of tuple `t` (Ethernet, with an 802.1Q tag of id `vlan` and
    priority `pcp` if given, IP, TCP (sequence number `seq`) or UDP) as the wire has them,
    with `payload` bytes of data after them (zeros)."""
    if vlan is not None:
        untagged = frame(t, tcp_flags, payload, seq=seq)
        return untagged[:12] + struct.pack("!HH", 0x8100, pcp << 13 | vlan) + untagged[12:]
    if t is None:
        return bytes(12) + struct.pack("!H", 0x0806) + bytes(28)
    l4 = struct.pack("!HHIIBBHHH", t.sport, t.dport, seq, 0, 5 << 4, tcp_flags, 1024, 0, 0) if t.proto == TCP \
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
    tags: tuple[int | None, ...] = ()  # the VLAN id each output left with (None: untagged)
    pcps: tuple[int | None, ...] = ()  # and its priority (None: untagged)

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
                 reported_size: int = 1_000_000, n_tables: int | None = None, dpid: int = 1,
                 address: tuple[str, int] = ("127.0.0.1", 50001), stats_part: int = 16):
        super().__init__(version)
        self.table_size = table_size  # entries table 0 holds; None: no limit
        # What it reports table 0 holds (Open vSwitch: 1,000,000, whatever its flow_limit)
        self.reported_size = reported_size
        self.n_tables = n_tables if n_tables is not None else (254 if version == OFP13 else 1)
        self.id = dpid  # the datapath as os-ken's Datapath reads after the handshake
        self.address = address
        self.closed = False  # the app closed the connection (a refused peer)
        self.stats_part = stats_part  # entries a multipart reply part carries at most
        self.now = now
        self.entries: list[Entry] = []
        self.replies: list[Any] = []
        self.meter_mods = 0
        self.meter_drops = 0  # packet-ins the controller meter dropped (its band's count)
        self.generation: int | None = None  # the newest role generation it knows (switch-wide)
        self.role = EQUAL  # this connection's role (a new connection's: EQUAL)
        self.mute: set[str] = set()  # requests left unanswered
        self.refuse: set[str] = set()  # requests answered with an error
        self.offset_check = False  # each turn checked idempotent (check_offset): the rig sets it
        self.asked: collections.Counter[str] = collections.Counter()  # requests by kind (BARRIER, FLOWS, ...)
        # Packet-ins a packet makes are lost: None (none is), METER (the controller meter
        # drops them, counting), SILENT (lost uncounted: Open vSwitch's userspace datapath).
        self.lose_packet_ins: str | None = None
        # A flow-mod add it refuses for what it is, not for room (a match or action it
        # does not support): answered OFPET_BAD_MATCH, nothing added.
        self.refuse_flow: Callable[[Entry], bool] | None = None
        self.packet_outs: list[tuple[int, bytes]] = []  # (output port, frame) of each packet-out
        self.xid = 0

    def close(self) -> None:
        self.closed = True

    def connection(self) -> None:
        """A new connection to it (the rig's handshake): its role is EQUAL again."""
        self.closed = False
        self.role = EQUAL

    def other_master(self, generation: int) -> None:
        """Another controller claimed MASTER with `generation`: this connection is SLAVE now."""
        self.generation = generation
        self.role = SLAVE

    # --- the datapath a FlowBuilder and a SendPath use ------------------------------------------

    def set_xid(self, msg: Any) -> int:
        self.xid += 1
        msg.set_xid(self.xid)
        return self.xid

    def send(self, buf: bytes) -> bool:
        """One turn's messages, written at once: each applied (or answered) in order."""
        msgs = []
        at = 0
        while at < len(buf):
            version, msg_type, length, xid = ofproto_parser.header(buf[at:])
            if version != self.ofproto.OFP_VERSION:
                raise ValueError(f"message of version {version} on a {self.ofproto.OFP_VERSION} switch")
            msgs.append((msg_type, xid, bytes(buf[at:at + length])))
            self.receive(*msgs[-1])
            at += length
        if self.offset_check and any(t == self.ofproto.OFPT_FLOW_MOD for t, _, _ in msgs):  # (else: no table change)
            self.check_offset(msgs)
        return True

    # --- Faucet's offset check ------------------------------------------------------------------

    def check_offset(self, msgs: list[tuple[int, int, bytes]]) -> None:
        """The turn's messages delivered twice, interleaved (each again right after the one
        that follows it: m0 m1 m0 m2 m1 m3 m2 ...; Faucet's valve_test_lib at offset 1 of
        a message) to a copy of the table as the turn left it must leave that table as it
        was: a switch may apply a flow-mod twice (a controller's retry after a reconnect)
        and every flow-mod NFShunt sends must be idempotent in effect. The test sees
        nothing of the copy."""
        twin = copy.copy(self)
        twin.entries = [dataclasses.replace(e) for e in self.entries]
        twin.replies, twin.offset_check, twin.asked = [], False, collections.Counter()
        doubled = [msgs[j] for i in range(-2, len(msgs)) for j in (i, i + 2) if 0 <= j < len(msgs)]
        for msg in doubled:
            twin.receive(*msg)
        twin.replies.clear()  # (they name the twin as their datapath: no cycle left for the collector)
        if twin.state() != self.state():
            kinds = [t for t, _, _ in msgs]
            raise AssertionError(f"a turn's messages (types {kinds}) applied twice left another table:\n"
                                 f"once:  {sorted(map(repr, self.state().elements()))}\n"
                                 f"twice: {sorted(map(repr, twin.state().elements()))}")

    def state(self) -> collections.Counter:
        """What the table holds, counters and times aside."""
        return collections.Counter((e.table_id, e.priority, tuple(sorted(e.match.items())), e.cookie, e.idle_timeout,
                                    e.hard_timeout, e.flags, tuple(e.outputs), e.goto, e.metadata)
                                   for e in self.entries)

    def receive(self, msg_type: int, xid: int, buf: bytes) -> None:
        ofp = self.ofproto
        if msg_type == ofp.OFPT_FLOW_MOD:
            msg = ofproto_parser.msg(self, ofp.OFP_VERSION, msg_type, len(buf), xid, bytearray(buf))
            self.flow_mod(msg, buf, xid)
        elif msg_type == ofp.OFPT_BARRIER_REQUEST:
            self.asked[BARRIER] += 1
            if BARRIER not in self.mute:
                self.reply(ofp.OFPT_BARRIER_REPLY, xid)
        elif self.version13 and msg_type == ofp.OFPT_METER_MOD:
            self.meter_mods += 1
            self.asked[METER_SET] += 1
            if METER_SET in self.refuse:
                self.error(xid, ofp.OFPET_METER_MOD_FAILED, ofp.OFPMMFC_UNKNOWN, buf)
        elif msg_type == (ofp.OFPT_MULTIPART_REQUEST if self.version13 else ofp.OFPT_STATS_REQUEST):
            self.stats_request(xid, buf)
        elif self.version13 and msg_type == ofp.OFPT_ROLE_REQUEST:
            self.role_request(xid, buf)
        elif self.version13 and msg_type == ofp.OFPT_SET_ASYNC:  # (a routed switch's invalid-TTL packet-ins)
            self.asked[ASYNC] += 1
        elif self.version13 and msg_type == ofp.OFPT_PACKET_OUT:  # (os-ken parses none: a switch's message)
            if self.role == SLAVE:
                self.error(xid, ofp.OFPET_BAD_REQUEST, ofp.OFPBRC_IS_SLAVE, buf)
                return
            (actions_len,) = struct.unpack_from("!H", buf, 16)
            at, end, ports = 24, 24 + actions_len, []
            while at < end:
                action = ofproto_v1_3_parser.OFPAction.parser(buf, at)
                ports.append(action.port)
                at += action.len
            self.packet_outs += [(port, bytes(buf[end:])) for port in ports]
        else:
            raise NotImplementedError(f"message type {msg_type}")

    # --- what it says back: bytes, read with os-ken's parser as the app's connection reads them --

    def reply(self, msg_type: int, xid: int, body: bytes = b"") -> Any:
        buf = bytearray(_HEADER.pack(self.ofproto.OFP_VERSION, msg_type, _HEADER.size + len(body), xid) + body)
        msg = ofproto_parser.msg(self, self.ofproto.OFP_VERSION, msg_type, len(buf), xid, buf)
        self.replies.append(msg)
        return msg

    def error(self, xid: int, err_type: int, code: int, request: bytes) -> None:
        self.reply(self.ofproto.OFPT_ERROR, xid, struct.pack("!HH", err_type, code) + request[:64])

    def multipart(self, xid: int, kind: int, entries: list[bytes]) -> None:
        """A multipart (1.0: stats) reply in parts of at most `stats_part` entries."""
        ofp = self.ofproto
        msg_type, more = (ofp.OFPT_MULTIPART_REPLY, ofp.OFPMPF_REPLY_MORE) if self.version13 else \
            (ofp.OFPT_STATS_REPLY, ofp.OFPSF_REPLY_MORE)
        parts = [entries[at:at + self.stats_part] for at in range(0, len(entries), self.stats_part)] or [[]]
        for i, part in enumerate(parts):
            flags = more if i < len(parts) - 1 else 0
            head = struct.pack("!HH4x", kind, flags) if self.version13 else struct.pack("!HH", kind, flags)
            self.reply(msg_type, xid, head + b"".join(part))

    def features(self) -> Any:
        """The features reply of a handshake (os-ken hands it to the app in CONFIG_DISPATCHER)."""
        if self.version13:
            body = struct.pack("!QIBB2xII", self.id, 0, self.n_tables, 0, 0, 0)
        else:
            body = struct.pack("!QIB3xII", self.id, 0, self.n_tables, 0, 0)
        buf = bytearray(_HEADER.pack(self.ofproto.OFP_VERSION, self.ofproto.OFPT_FEATURES_REPLY,
                                     _HEADER.size + len(body), 0) + body)
        return ofproto_parser.msg(self, self.ofproto.OFP_VERSION, self.ofproto.OFPT_FEATURES_REPLY, len(buf), 0, buf)

    def role_request(self, xid: int, buf: bytes) -> None:
        """A role request (OpenFlow 1.3 6.3.6): MASTER or SLAVE with a generation older than
        the newest it knows is refused as stale; NOCHANGE asks; the reply says the role."""
        ofp = self.ofproto
        role, generation = _ROLE.unpack_from(buf, _HEADER.size)
        self.asked[ROLE] += 1
        if ROLE in self.refuse:
            self.error(xid, ofp.OFPET_ROLE_REQUEST_FAILED, ofp.OFPRRFC_UNSUP, buf)
            return
        if role in (MASTER, SLAVE):
            if self.generation is not None and (generation - self.generation) & UNDEFINED_GENERATION >= 1 << 63:
                self.error(xid, ofp.OFPET_ROLE_REQUEST_FAILED, ofp.OFPRRFC_STALE, buf)
                return
            self.generation, self.role = generation, role
        if ROLE not in self.mute:
            generation = UNDEFINED_GENERATION if self.generation is None else self.generation
            self.reply(ofp.OFPT_ROLE_REPLY, xid, _ROLE.pack(self.role, generation))

    @property
    def version13(self) -> bool:
        return self.ofproto.OFP_VERSION == OFP13

    # --- flow-mods --------------------------------------------------------------------------------

    def flow_mod(self, msg: Any, buf: bytes, xid: int) -> None:
        ofp = self.ofproto
        if self.role == SLAVE:  # a slave's state changes are refused
            self.error(xid, ofp.OFPET_BAD_REQUEST, ofp.OFPBRC_IS_SLAVE, buf)
            return
        if msg.command == ofp.OFPFC_ADD:
            self.add(self.entry(msg, buf), xid)
        elif msg.command in (ofp.OFPFC_DELETE, ofp.OFPFC_DELETE_STRICT):
            strict = msg.command == ofp.OFPFC_DELETE_STRICT
            for e in self.select(msg, strict, out_port=msg.out_port):
                self.remove(e, ofp.OFPRR_DELETE)
        elif msg.command in (ofp.OFPFC_MODIFY, ofp.OFPFC_MODIFY_STRICT):
            new = self.entry(msg, buf)
            for e in self.select(msg, msg.command == ofp.OFPFC_MODIFY_STRICT):
                e.outputs, e.goto, e.metadata, e.raw, e.ops = new.outputs, new.goto, new.metadata, new.raw, new.ops
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
        ops = tuple(op for op in map(_op, actions) if op is not None)
        return Entry(table_id, msg.priority, match, msg.cookie, msg.idle_timeout, msg.hard_timeout, msg.flags,
                     outputs, goto, metadata, raw, buf, self.now, self.now, ops=ops)

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
        elif self.refuse_flow is not None and self.refuse_flow(new):
            self.error(xid, ofp.OFPET_BAD_MATCH, ofp.OFPBMC_BAD_FIELD, new.request)
            return
        elif new.table_id == 0 and self.table_size is not None and len(self.table(0)) >= self.table_size:
            code = ofp.OFPFMFC_TABLE_FULL if self.version13 else ofp.OFPFMFC_ALL_TABLES_FULL
            self.error(xid, ofp.OFPET_FLOW_MOD_FAILED, code, new.request)
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
            sec, nsec = int(age), int(age % 1 * 1e9)
            if self.version13:
                match = e.raw[:(struct.unpack_from("!H", e.raw, 2)[0] + 7) // 8 * 8]
                body = struct.pack("!QHBBIIHHQQ", e.cookie, e.priority, reason, e.table_id, sec, nsec,
                                   e.idle_timeout, e.hard_timeout, e.packets, e.bytes) + match
            else:
                body = e.raw[:40] + struct.pack("!QHBxIIH2xQQ", e.cookie, e.priority, reason, sec, nsec,
                                                e.idle_timeout, e.packets, e.bytes)
            self.reply(self.ofproto.OFPT_FLOW_REMOVED, 0, body)

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
            self.asked[TABLE] += 1
            self.table_request(xid, kind, buf)
        elif self.version13 and kind == ofp.OFPMP_METER:
            self.asked[METER_STATS] += 1
            if METER_STATS not in self.mute:  # the controller meter's one band: what it dropped
                self.multipart(xid, kind, [struct.pack("!IH6xIQQIIQQ", ofp.OFPM_CONTROLLER, 56, 0, 0, 0, 0, 0,
                                                       self.meter_drops, 0)])
        elif self.version13 and kind == ofp.OFPMP_TABLE:  # table stats: each table's active_count
            self.multipart(xid, kind, [struct.pack("!B3xIQQ", t, len(self.table(t)), 0, 0)
                                       for t in range(self.n_tables)])
        elif kind == (ofp.OFPMP_FLOW if self.version13 else ofp.OFPST_FLOW):
            self.asked[FLOWS] += 1
            if FLOWS not in self.mute:
                self.flow_stats(xid, kind, buf)
        else:
            raise NotImplementedError(f"stats request of type {kind}")

    def table_request(self, xid: int, kind: int, buf: bytes) -> None:
        """Table 0's size: table features (1.3), table stats (1.0)."""
        ofp = self.ofproto
        if TABLE in self.refuse:
            self.error(xid, ofp.OFPET_BAD_REQUEST, ofp.OFPBRC_BAD_MULTIPART if self.version13 else ofp.OFPBRC_BAD_STAT,
                       buf)
        elif TABLE not in self.mute:
            if self.version13:
                tables = [struct.pack("!HB5x32sQQII", 64, t, b"table%d" % t, 0, 0, 0,
                                      self.reported_size if t == 0 else 1_000_000) for t in range(self.n_tables)]
            else:
                tables = [struct.pack("!B3x32sIIIQQ", 0, b"classifier", 0x3FFFFF, self.reported_size,
                                      len(self.entries), 0, 0)]
            self.multipart(xid, kind, tables)

    def flow_stats(self, xid: int, kind: int, buf: bytes) -> None:
        ofp = self.ofproto
        if self.version13:  # ofp_flow_stats_request after the multipart header, then an empty match
            table, out_port, _group, cookie, mask = struct.unpack_from("!B3xII4xQQ", buf, 16)
            match_all = struct.unpack_from("!H", buf, 16 + 32 + 2)[0] == 4
        else:  # 1.0: the match (all wildcarded: OFPFW_ALL), table, out_port; no cookie filter
            (table, out_port), cookie, mask = struct.unpack_from("!BxH", buf, 12 + 40), 0, 0
            match_all = struct.unpack_from("!I", buf, 12)[0] & 0x3FFFFF == 0x3FFFFF
        if not match_all:
            raise NotImplementedError("a flow-stats request with a match")
        any_port = ofp.OFPP_ANY if self.version13 else ofp.OFPP_NONE
        self.multipart(xid, kind, [self.stats_entry(e) for e in self.entries
                                   if table in (TABLE_ALL, e.table_id) and e.cookie & mask == cookie & mask
                                   and (out_port == any_port or out_port in [p for p, _ in e.outputs])])

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
               size: int = 100, payload: int = 0, pcp: int = 0, seq: int = 0) -> Fate:
        """Send one packet in at `in_port` (an IP packet of tuple `t` with `payload` bytes of
        data, else a non-IP frame): the ports it leaves by and the packet-ins it makes (also
        put in `replies`, with the packet's first bytes). The packet is `size` bytes long, or
        its headers and payload if longer (a shorter frame padded with zeros, as Ethernet's)."""
        wire = frame(t, tcp_flags, payload, vlan, pcp, seq)
        wire += bytes(max(0, size - len(wire)))
        size = len(wire)
        pkt = {"in_port": in_port, "vlan_vid": 0 if vlan is None else VID_PRESENT | vlan, "metadata": 0}
        if vlan is not None:
            pkt["vlan_pcp"] = pcp
        if t is not None:
            pkt.update(eth_type=ETH_IPV4 if t.family == 4 else ETH_IPV6, ip_proto=t.proto,
                       tp_src=t.sport, tp_dst=t.dport, tcp_flags=tcp_flags if t.proto == TCP else 0)
            pkt[f"ipv{t.family}_src"], pkt[f"ipv{t.family}_dst"] = _int(t.src), _int(t.dst)
        else:
            pkt["eth_type"] = 0x0806
        outputs: list[int] = []
        tags: list[int | None] = []
        pcps: list[int | None] = []
        packet_ins: list[PacketIn] = []
        seen: list[int] = []
        table: int | None = 0
        while table is not None:
            e = self.lookup(table, pkt)
            if e is None:
                break  # a table miss: dropped (no table-miss flow in 1.3)
            e.packets, e.bytes, e.used = e.packets + 1, e.bytes + size, self.now
            seen.append(e.cookie)
            for op, *args in e.ops:
                if op != "out":  # a retag: the frame's tag from here on
                    vid = args[0] if op == "vid" else 0  # (a pushed tag's id and priority are 0 until set)
                    pkt["vlan_vid"] = 0 if op == "pop" else VID_PRESENT | vid
                    if op == "pop":
                        pkt.pop("vlan_pcp", None)
                    elif op == "push":
                        pkt["vlan_pcp"] = 0
                    wire = frame(t, tcp_flags, payload, None if op == "pop" else vid, pkt.get("vlan_pcp", 0))
                    wire += bytes(max(0, size - len(wire)))
                    continue
                port, max_len = args
                if port == in_port:
                    continue  # OpenFlow sends nothing back out of the port a frame came in by...
                if port == self.ofproto.OFPP_IN_PORT:
                    port = in_port  # ...unless told so (a router on a stick's)
                if port == self.ofproto.OFPP_CONTROLLER:
                    fields = {"in_port": in_port, **({"metadata": pkt["metadata"]} if pkt["metadata"] else {})}
                    packet_ins.append(PacketIn(e.cookie, e.table_id, fields, max_len, wire[:max_len]))
                    if self.lose_packet_ins is None:
                        self.packet_in(packet_ins[-1], size)
                    elif self.lose_packet_ins == METER:
                        self.meter_drops += 1
                else:
                    outputs.append(port)
                    tags.append(pkt["vlan_vid"] & 0xFFF if pkt["vlan_vid"] else None)
                    pcps.append(pkt.get("vlan_pcp"))
            if e.metadata is not None:
                value, mask = e.metadata
                pkt["metadata"] = (pkt["metadata"] & ~mask) | (value & mask)
            table = e.goto
        return Fate(tuple(outputs), tuple(packet_ins), tuple(seen), tuple(tags), tuple(pcps))

    def packet_in(self, p: PacketIn, size: int) -> None:
        """The packet-in message (OpenFlow 1.3): the packet up to the catcher's max_len."""
        ofp = self.ofproto
        match = bytearray()
        self.ofproto_parser.OFPMatch(**p.match).serialize(match, 0)
        self.reply(ofp.OFPT_PACKET_IN, 0, struct.pack("!IHBBQ", ofp.OFP_NO_BUFFER, size, ofp.OFPR_ACTION, p.table_id,
                                                      p.cookie) + bytes(match) + b"\0\0" + p.data)

    def lookup(self, table: int, pkt: dict[str, int]) -> Entry | None:
        best: Entry | None = None
        for e in self.entries:
            if e.table_id != table or (best is not None and e.priority <= best.priority):
                continue
            if all(f in pkt and (pkt[f] == v if m is None else pkt[f] & m == v & m) for f, (v, m) in e.match.items()):
                best = e
        return best
