"""Plain data shared by the listener, the decision core and the switch side."""
from __future__ import annotations

import enum
import ipaddress
import socket
from dataclasses import dataclass
from typing import Any, NamedTuple

TCP = 6
UDP = 17

OFP10 = 0x01  # OpenFlow wire versions
OFP13 = 0x04
OPENFLOW_VERSIONS = {"1.0": OFP10, "1.3": OFP13}  # as the config and the operator name them


class Action(enum.StrEnum):
    """What the policy (or an operator) decided for a connection; the config's
    mark_actions names them by their values."""
    IGNORE = "ignore"
    SHUNT = "shunt"
    BLOCK = "block"


def openflow_label(version: int) -> str:
    """The name ("1.0", "1.3") of a negotiated OpenFlow version."""
    return "1.0" if version == OFP10 else "1.3"

# Conntrack TCP states (include/uapi/linux/netfilter/nf_conntrack_tcp.h).
TCP_STATES = ("NONE", "SYN_SENT", "SYN_RECV", "ESTABLISHED", "FIN_WAIT", "CLOSE_WAIT",
              "LAST_ACK", "TIME_WAIT", "CLOSE", "SYN_SENT2")
TCP_CLOSING = frozenset({4, 5, 6, 7, 8})
TCP_ENDED = frozenset({7, 8})  # TIME_WAIT, CLOSE: the connection is over (a SYN starts a new entry)


Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class ScopeIdError(ValueError):
    """An IPv6 address with a scope id ("fe80::1%eth0"). ipaddress takes one, but a flow's
    match, a conntrack tuple and inet_pton have no interface in an address (os-ken cannot
    build the match): no address a rule, match or flow is made of may carry one (only a
    listener's, config.validate.address: binding a link-local address needs it)."""


def parse_address(text: str) -> Address:
    """The one parse of a given address: ipaddress's, without a scope id (ScopeIdError);
    ValueError: not an address."""
    address = ipaddress.ip_address(text)
    _unscoped(text, address)
    return address


def parse_network(text: str, strict: bool = True) -> Network:
    """The one parse of a given address or prefix (strict: host bits zero): ipaddress's,
    without a scope id (ScopeIdError); ValueError: not an address or prefix."""
    net = ipaddress.ip_network(text, strict=strict)
    _unscoped(text, net.network_address)
    return net


def _unscoped(text: str, address: Address) -> None:
    if isinstance(address, ipaddress.IPv6Address) and address.scope_id is not None:
        raise ScopeIdError(f"{text!r:.60} has an IPv6 scope id (%{address.scope_id:.20}): an address here names "
                           "no interface, leave it out")


def canonical_address(text: str) -> str:
    """The text form the conntrack listener produces (inet_ntop), so tuples from the
    listener, the switch and the control socket compare equal (Python's ipaddress writes
    IPv4-mapped IPv6 addresses differently)."""
    af = socket.AF_INET6 if ":" in text else socket.AF_INET
    return socket.inet_ntop(af, socket.inet_pton(af, text))


# One text object per address: connections share their hosts (many clients to a few
# servers), and every shunt keeps two address strings for its life (64 B each for IPv4).
# Bounded: past ADDRESSES_MAX distinct addresses it starts afresh, so a flood of sources
# costs no more than that.
ADDRESSES_MAX = 8192
_ADDRESS_TEXT: dict[bytes, str] = {}


def address_text(raw: bytes) -> str:
    """inet_ntop of a packed address, 4 bytes (IPv4) or 16 (IPv6); the same str object
    for the same address while the cache holds it (and no inet_ntop call)."""
    text = _ADDRESS_TEXT.get(raw)
    if text is None:
        if len(raw) not in (4, 16):
            raise ValueError(f"a packed address of {len(raw)} bytes")
        if len(_ADDRESS_TEXT) >= ADDRESSES_MAX:
            _ADDRESS_TEXT.clear()
        text = _ADDRESS_TEXT[raw] = socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)
    return text


class EventKind(enum.Enum):
    NEW = "new"
    UPDATE = "update"
    DESTROY = "destroy"
    DUMP = "dump"  # an entry read by a resync dump rather than heard as an event


_new_tuple = tuple.__new__


class FlowTuple(NamedTuple):
    """One direction of a connection: what the switch matches on. A named tuple: made
    for every event and looked up in several tables per shunt, and a tuple's hash and
    equality run in C (a frozen dataclass's in Python).

    `zone` is the conntrack zone (0-65535) of the entry the tuple belongs to: the same
    addresses and ports in two zones (two VLANs' firewall bridges) are two connections.
    Zone 0 (no zone, untagged) prints and reprs exactly as the 6-field tuple did."""

    family: int  # 4 or 6
    proto: int
    src: str
    dst: str
    sport: int
    dport: int
    zone: int = 0

    def __str__(self) -> str:
        name = {TCP: "tcp", UDP: "udp"}.get(self.proto, str(self.proto))
        if self.family == 6:
            text = f"{name} [{self.src}]:{self.sport} -> [{self.dst}]:{self.dport}"
        else:
            text = f"{name} {self.src}:{self.sport} -> {self.dst}:{self.dport}"
        return f"{text} zone {self.zone}" if self.zone else text

    def __repr__(self) -> str:
        # Stable ids hash a repr (ids/rules.scipass_id, config/static block cookies), kept
        # in state files and installed cookies: a zone-0 tuple's is the 6-field form's.
        text = (f"FlowTuple(family={self.family!r}, proto={self.proto!r}, src={self.src!r}, dst={self.dst!r}, "
                f"sport={self.sport!r}, dport={self.dport!r}")
        return f"{text}, zone={self.zone!r})" if self.zone else f"{text})"

    def reversed(self) -> "FlowTuple":
        # tuple.__new__ skips the named tuple's Python-level __new__: half the time, and a
        # pair's reply is made this way each time it is asked for (core/connection.Conn.reply).
        family, proto, src, dst, sport, dport, zone = self
        return _new_tuple(FlowTuple, (family, proto, dst, src, dport, sport, zone))

    def mirrors(self, reply: "FlowTuple") -> bool:
        """`reply` is this tuple reversed: an entry's reply when nothing translated it (no NAT)."""
        return reply == self.reversed()


@dataclass(slots=True)
class ConnEvent:
    """A conntrack event (or dumped entry) reduced to what the core needs (not frozen:
    one is made per event, and a frozen dataclass costs three times as much to build)."""

    kind: EventKind
    ct_id: int
    orig: FlowTuple
    reply: FlowTuple
    mark: int
    tcp_state: int | None
    received: float  # time.monotonic() when read from netlink


class SwitchFlow(NamedTuple):
    """A flow read back from the switch (flow stats), as the core needs it. A named tuple:
    a reconcile makes 200,000 of them, 0.1 s faster than as a frozen dataclass."""

    cookie: int
    priority: int
    in_port: int | None
    match: FlowTuple | None
    out_port: int | None  # None: no output action (drop); pipeline layout: the port table 1 outputs to
    packets: int = 0
    bytes: int = 0
    duration: float = 0.0
    goto: bool = False  # goes on to table 1 (the pipeline layout's TCP shunts)
    # The match is exactly the shape this version installs for a pair (every field exact,
    # untagged, nothing more) and a goto writes this pair's metadata: only such flows are
    # adopted; an older release's, a wildcarded or a foreign one carrying our cookie is not.
    exact: bool = True
    hard_timeout: int = 0  # seconds from its install (0: none); `duration` of them have passed
    # The match's tag as OpenFlow 1.3 writes it (None: not matched, any; 0: untagged;
    # OFPVID_PRESENT | id; 1.0's dl_vlan read the same way), and what the actions do to it.
    vlan: int | None = None
    retag: Retag = ()
    pcp: int | None = None  # the match's VLAN priority (static shunts'); None: any
    # A routed pair's flow's rewrite before its output (dec_ttl, the MACs, a NAT's set_fields;
    # docs/design/routed.md 5.7); None: a bridge's flow, which does none of it.
    rewrite: FlowRewrite | None = None


VID_PRESENT = 0x1000  # OpenFlow 1.3 vlan_vid: a tag is there, its id in the low 12 bits (OFPVID_PRESENT)
VID_MASK = 0xFFF  # a tag's id, without VID_PRESENT


class TagOp(enum.IntEnum):
    """An action on a frame's 802.1Q tag, as a flow read back holds it (OpenFlow 1.3's
    action types; 1.0's set_vlan_vid and strip_vlan read as SET_VID and POP)."""
    PUSH = 17  # a new outer tag, id 0 and PCP 0 until set
    POP = 18
    SET_VID = 25  # set_field vlan_vid: the id (without OFPVID_PRESENT)


Retag = tuple[tuple[TagOp, int], ...]  # (op, value) in the order the actions apply them


def retag_ops(vid_in: int, vid_out: int) -> Retag:
    """What a pair's flow does to a frame of tag vid_in (0: untagged) so that it leaves
    with vid_out, as the firewall's bridge between the two sub-interfaces would: nothing
    when they agree. The one definition the flow builder writes and a reconcile compares."""
    if vid_in == vid_out:
        return ()
    if not vid_out:
        return ((TagOp.POP, 0),)
    push: Retag = ((TagOp.PUSH, 0x8100),) if not vid_in else ()
    return (*push, (TagOp.SET_VID, vid_out))


@dataclass(frozen=True, slots=True)
class EntryCounts:
    """What the kernel counts for a conntrack entry beyond what the core needs (explain, top
    and the accounting records read it; never the event path). Packets and bytes by
    direction (original, reply) exist only with net.netfilter.nf_conntrack_acct=1 (None
    otherwise); the start and stop (wall clock, ns) only with nf_conntrack_timestamp=1;
    the zone is 0 unless the firewall's raw table sets one (`-j CT --zone`)."""

    packets: tuple[int, int] | None = None
    bytes: tuple[int, int] | None = None
    zone: int = 0
    timeout: int | None = None  # seconds the entry has left
    start_ns: int | None = None
    stop_ns: int | None = None


@dataclass(frozen=True, slots=True)
class NextHop:
    """Where a routing firewall sends a destination (its route and neighbour tables): out of
    `ifname`, from that interface's MAC to the next hop's. A routed shunt's flow does that
    rewrite, and takes the TTL one lower (docs/design/routed.md). `neighbour`: whose MAC
    eth_dst is (the gateway, or the destination itself on a connected route; "" unknown),
    what a flapping neighbour is held down by."""
    ifname: str
    eth_src: str
    eth_dst: str
    neighbour: str = ""


@dataclass(frozen=True, slots=True)
class Rewrite:
    """What a NAT shunt's flow changes in one direction's packets (docs/design/routed.md,
    5.2), as OpenFlow set_fields after the router's rewrite: None leaves a field as it came."""
    src: str | None = None
    sport: int | None = None
    dst: str | None = None
    dport: int | None = None


class FlowRewrite(NamedTuple):
    """What a routed pair's flow read back does to a frame before its output, in the order
    this version writes it (openflow/flows.routed_actions): the TTL / hop limit one lower,
    the egress interface's MAC as source, the next hop's as destination, then a NAT's
    translation (`nat`: empty without one)."""
    eth_src: str
    eth_dst: str
    nat: Rewrite = Rewrite()


def _rewrite(arrives: FlowTuple, leaves: FlowTuple) -> Rewrite:
    def changed(a: Any, b: Any) -> Any:
        return None if a == b else b
    return Rewrite(changed(arrives.src, leaves.src), changed(arrives.sport, leaves.sport),
                   changed(arrives.dst, leaves.dst), changed(arrives.dport, leaves.dport))


def nat_rewrite(orig: FlowTuple, reply: FlowTuple) -> tuple[Rewrite, Rewrite]:
    """The (forward, reverse) rewrite a conntrack entry's tuples define: original packets
    arrive as `orig` and leave as the reply reversed (F11: masquerade gives them the
    firewall's address and port), reply packets arrive as `reply` and leave as the original
    reversed. Two empty Rewrites for an entry without NAT."""
    return _rewrite(orig, reply.reversed()), _rewrite(reply, orig.reversed())


class NatSide(enum.Enum):
    """Which of conntrack's NAT a range is: CTA_NAT_SRC (SNAT, masquerade) or CTA_NAT_DST."""
    SRC = "src"
    DST = "dst"


@dataclass(frozen=True, slots=True)
class NatRange:
    """One translation of an entry, as ctnetlink re-creates it (CTA_NAT_SRC / CTA_NAT_DST
    with one address and one port): the connection keeps the address and port it had."""
    side: NatSide
    address: str
    port: int


def nat_ranges(orig: FlowTuple, reply: FlowTuple) -> tuple[NatRange, ...]:
    """The translations behind an entry's tuples (design 5.6): the reply addressed to
    another than the original's source is SNAT to (reply.dst, reply.dport); the reply from
    another than the original's destination is DNAT to (reply.src, reply.sport); both, both."""
    out = []
    if (reply.dst, reply.dport) != (orig.src, orig.sport):
        out.append(NatRange(NatSide.SRC, reply.dst, reply.dport))
    if (reply.src, reply.sport) != (orig.dst, orig.dport):
        out.append(NatRange(NatSide.DST, reply.src, reply.sport))
    return tuple(out)
