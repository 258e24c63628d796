"""OpenFlow 1.3 flow-stats entries and flow-removed messages read straight from the bytes.

os-ken turns every entry into an OFPMatch of OXM objects and a tree of instruction and
action objects: reconciling 100,000 pairs (200,000 entries) took 19 s of the event loop.
NFShunt needs a handful of fields, and FlowEntry reads just those (`channel` installs it as
the flow-stats body class). `FlowBuilder.parse_stats` turns either kind into the same
SwitchFlow; tests/test_flowstats.py holds the two equal on every shape NFShunt installs and
on foreign flows.

Flow-removed messages come two a pair whenever a shunt idles out or is taken down; os-ken's
parse of each one's match (~20 µs) was most of their cost, and NFShunt reads none of it:
`flow_removed` reads the fixed part only (match None), tested equal to os-ken's.
"""
from __future__ import annotations

import struct
from typing import Any

from nfshunt.records.model import VID_PRESENT, FlowRewrite, Retag, Rewrite, TagOp, address_text

_ENTRY = struct.Struct("!HBxIIHHHH4xQQQ")  # ofp_flow_stats up to its match
_REMOVED = struct.Struct("!QHBBIIHHQQ")  # ofp_flow_removed after the header, up to its match
_HEADER_SIZE = 8
_TLV = struct.Struct("!HH")  # instruction or action: type, length
_U32 = struct.Struct("!I")
_U64 = struct.Struct("!Q")
OXM_BASIC = 0x8000
# OXM basic fields NFShunt reads: name, value size
_FIELDS = {0: ("in_port", 4), 2: ("metadata", 8), 5: ("eth_type", 2), 6: ("vlan_vid", 2), 7: ("vlan_pcp", 1),
           10: ("ip_proto", 1),
           11: ("ipv4_src", 4), 12: ("ipv4_dst", 4), 13: ("tcp_src", 2), 14: ("tcp_dst", 2),
           15: ("udp_src", 2), 16: ("udp_dst", 2), 26: ("ipv6_src", 16), 27: ("ipv6_dst", 16)}
IT_GOTO_TABLE, IT_WRITE_METADATA, IT_WRITE_ACTIONS, IT_APPLY_ACTIONS = 1, 2, 3, 4
AT_OUTPUT, AT_PUSH_VLAN, AT_POP_VLAN, AT_DEC_NW_TTL, AT_SET_FIELD = 0, 17, 18, 24, 25
OXM_VLAN_VID = OXM_BASIC << 16 | 6 << 9 | 2  # set_field's field: vlan_vid, 2 bytes, no mask
# A routed pair's rewrite (openflow/flows.routed_actions): dec_ttl, then set_field on the MACs
# and a NAT's addresses and ports. Each field by its OXM field number and size, named as its
# step in `routed_rewrite` (the OXM names as os-ken's set_field has them, for its parse).
REWRITE_FIELDS = {"eth_dst": (3, 6), "eth_src": (4, 6), "ipv4_src": (11, 4), "ipv4_dst": (12, 4),
                  "tcp_src": (13, 2), "tcp_dst": (14, 2), "udp_src": (15, 2), "udp_dst": (16, 2),
                  "ipv6_src": (26, 16), "ipv6_dst": (27, 16)}
_REWRITE_HEADERS = {OXM_BASIC << 16 | field << 9 | width: name for name, (field, width) in REWRITE_FIELDS.items()}
DEC_TTL = "dec_ttl"
# A NAT's set_fields after the MACs, in this order, each at most once (records.model.Rewrite).
_NAT_STEPS = {"ipv4_src": "src", "ipv6_src": "src", "tcp_src": "sport", "udp_src": "sport",
              "ipv4_dst": "dst", "ipv6_dst": "dst", "tcp_dst": "dport", "udp_dst": "dport"}
_NAT_ORDER = ("src", "sport", "dst", "dport")
PORT_CONTROLLER = 0xFFFFFFFD
OTHER = "other"  # a key of FlowEntry.fields: a field NFShunt does not install (or a masked one) was there


class FlowEntry:
    """One ofp_flow_stats entry: counters, cookie, priority, the match fields NFShunt uses
    (a masked one reads as absent: never an exact match), the output ports of its actions
    in order, goto-table, the metadata it writes, what its actions do to the 802.1Q tag
    (`retag`), a routed pair's rewrite (`rewrite`) and whether it does anything else
    (`foreign`: never a flow of ours)."""

    __slots__ = ("length", "table_id", "duration_sec", "duration_nsec", "priority", "hard_timeout", "cookie",
                 "packet_count", "byte_count", "fields", "outs", "goto", "metadata", "retag", "rewrite", "foreign")
    length: int
    table_id: int
    duration_sec: int
    duration_nsec: int
    priority: int
    hard_timeout: int
    cookie: int
    packet_count: int
    byte_count: int
    fields: dict[str, Any]
    outs: list[int]
    goto: bool
    metadata: int | None
    retag: Retag
    rewrite: FlowRewrite | None
    foreign: bool

    @classmethod
    def parser(cls, buf: Any, offset: int) -> "FlowEntry":
        e = cls()
        (e.length, e.table_id, e.duration_sec, e.duration_nsec, e.priority, _idle, e.hard_timeout, _flags, e.cookie,
         e.packet_count, e.byte_count) = _ENTRY.unpack_from(buf, offset)
        end = offset + e.length
        at = offset + _ENTRY.size
        if e.length < _ENTRY.size + 8 or end > len(buf):
            raise ValueError(f"flow stats entry of length {e.length}")
        match_type, match_len = _TLV.unpack_from(buf, at)
        if match_type != 1 or match_len < 4 or at + match_len > end:
            raise ValueError(f"flow stats match of type {match_type}, length {match_len}")
        e.fields = _oxm_fields(buf, at + 4, at + match_len)
        at += (match_len + 7) // 8 * 8
        e.outs, e.goto, e.metadata, e.retag, e.rewrite, e.foreign = [], False, None, (), None, False
        while at < end:
            itype, ilen = _TLV.unpack_from(buf, at)
            if ilen < 8 or at + ilen > end:
                raise ValueError(f"instruction of length {ilen}")
            if itype == IT_GOTO_TABLE:
                e.goto = True
            elif itype == IT_WRITE_METADATA:
                e.metadata = _U64.unpack_from(buf, at + 8)[0]
            elif itype in (IT_WRITE_ACTIONS, IT_APPLY_ACTIONS):
                retag, steps, foreign = _actions(buf, at + 8, at + ilen, e.outs)
                e.retag += retag
                if steps:
                    rewrite = routed_rewrite(steps)
                    foreign = foreign or rewrite is None or e.rewrite is not None  # (one list of actions rewrites)
                    e.rewrite = rewrite
                e.foreign |= foreign or itype == IT_WRITE_ACTIONS  # (NFShunt applies, never writes)
            else:  # a meter, clear-actions, an experimenter's: not a flow NFShunt installs
                e.foreign = True
            at += ilen
        return e


# The whole OXM header (class, field << 1, length) of each field NFShunt reads, exact and of
# its right size: one dict lookup a field instead of splitting the header apart.
_HEADERS = {OXM_BASIC << 16 | field << 9 | width: (name, name.startswith(("ipv4", "ipv6")))
            for field, (name, width) in _FIELDS.items()}


def _oxm_fields(buf: Any, at: int, end: int) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    while at + 4 <= end:
        header = _U32.unpack_from(buf, at)[0]
        value_at = at + 4
        at = value_at + (header & 0xFF)
        if at > end:
            raise ValueError("OXM field past the end of the match")
        known = _HEADERS.get(header)
        if known is None:
            _other_field(header)
            fields[OTHER] = True  # the match has more than NFShunt's fields: not a pair of ours
            continue
        name, address = known
        if address:
            fields[name] = address_text(bytes(buf[value_at:at]))  # shared with the listener's tuples
        else:
            fields[name] = int.from_bytes(buf[value_at:at], "big")
    return fields


def _other_field(header: int) -> None:
    """A field NFShunt does not read, or a masked one (never an exact match): skipped; one
    it reads but of the wrong size is a malformed entry."""
    if header >> 16 != OXM_BASIC or header & 0x100:
        return
    known = _FIELDS.get((header >> 9) & 0x7F)
    if known is not None:
        raise ValueError(f"OXM {known[0]} of {header & 0xFF} bytes")


Step = tuple[str, Any]  # a rewrite's action read back: (DEC_TTL, None) or (set_field's OXM name, its value)


def routed_rewrite(steps: list[Step]) -> FlowRewrite | None:
    """A flow's rewrite steps as this version writes them (dec_ttl, eth_src, eth_dst, then a
    NAT's set_fields in Rewrite's order, each once), or None: any other (never a flow of ours)."""
    if len(steps) < 3 or steps[0][0] != DEC_TTL or steps[1][0] != "eth_src" or steps[2][0] != "eth_dst":
        return None
    nat: dict[str, Any] = {}
    last = -1
    for name, value in steps[3:]:
        step = _NAT_STEPS.get(name)
        if step is None or _NAT_ORDER.index(step) <= last:
            return None
        last = _NAT_ORDER.index(step)
        nat[step] = value
    return FlowRewrite(str(steps[1][1]).lower(), str(steps[2][1]).lower(), Rewrite(**nat))


def _set_field(buf: Any, at: int, alen: int) -> Step | None:
    """A set_field of a routed rewrite's field, as its step; None: another field."""
    header = _U32.unpack_from(buf, at + 4)[0]
    name = _REWRITE_HEADERS.get(header)
    if name is None or 8 + (header & 0xFF) > alen:
        return None
    value = bytes(buf[at + 8:at + 8 + (header & 0xFF)])
    if name.startswith("eth"):
        return name, ":".join(f"{b:02x}" for b in value)
    if name.startswith("ipv"):
        return name, address_text(value)
    return name, int.from_bytes(value, "big")


def _actions(buf: Any, at: int, end: int, outs: list[int]) -> tuple[Retag, list[Step], bool]:
    """An action list: its output ports appended to `outs` in order; (what it does to the
    tag, a routed pair's rewrite steps, whether it does anything NFShunt never writes: another
    action or field, a tag set or a rewrite after the frame has left by a port other than the
    controller, a rewrite after a retag)."""
    retag: list[tuple[TagOp, int]] = []
    steps: list[Step] = []
    foreign = False
    left = False  # a copy went out by a port (not the controller's): a retag after it changes nothing of that
    while at + 4 <= end:
        atype, alen = _TLV.unpack_from(buf, at)
        if alen < 8 or at + alen > end:
            raise ValueError(f"action of length {alen}")
        if atype == AT_OUTPUT:
            port = _U32.unpack_from(buf, at + 4)[0]
            outs.append(port)
            left = left or port != PORT_CONTROLLER
        elif atype == AT_PUSH_VLAN:
            retag.append((TagOp.PUSH, _TLV.unpack_from(buf, at + 4)[0]))
            foreign |= left
        elif atype == AT_POP_VLAN:
            retag.append((TagOp.POP, 0))
            foreign |= left
        elif atype == AT_SET_FIELD and alen >= 16 and _U32.unpack_from(buf, at + 4)[0] == OXM_VLAN_VID:
            vid = _TLV.unpack_from(buf, at + 8)[0]
            retag.append((TagOp.SET_VID, vid & 0xFFF))
            foreign |= left or not vid & VID_PRESENT
        elif atype == AT_DEC_NW_TTL:
            steps.append((DEC_TTL, None))
            foreign |= left or bool(retag)
        elif atype == AT_SET_FIELD and alen >= 16 and (step := _set_field(buf, at, alen)) is not None:
            steps.append(step)
            foreign |= left or bool(retag)
        else:
            foreign = True
        at += alen
    return tuple(retag), steps, foreign


def flow_removed(datapath: Any, version: int, msg_type: int, msg_len: int, xid: int, buf: Any) -> Any:
    """os-ken's OFPFlowRemoved with every field but the match (None); os-ken's message
    parser signature, installed in its table by `channel`. A short message raises, and
    os-ken counts and drops it as any malformed message."""
    if msg_len < _HEADER_SIZE + _REMOVED.size or len(buf) < msg_len:
        raise ValueError(f"flow-removed of {msg_len} bytes")
    msg = datapath.ofproto_parser.OFPFlowRemoved(datapath)
    msg.set_headers(version, msg_type, msg_len, xid)
    msg.set_buf(buf)
    (msg.cookie, msg.priority, msg.reason, msg.table_id, msg.duration_sec, msg.duration_nsec, msg.idle_timeout,
     msg.hard_timeout, msg.packet_count, msg.byte_count) = _REMOVED.unpack_from(buf, _HEADER_SIZE)
    return msg
