"""Static shunts: engineered streams put on the fast path before their first frame.

A static shunt (config `static_shunts`) is a stateless switch ACL outside the stateful
firewall: every frame matching it goes fast port to fast port, from the moment the switch
connects, and the firewall never sees one (it cannot track, log or police them). That is
the trade for cyclic control traffic whose deadlines a CPU-based firewall's delay and
jitter would break; keep each entry as narrow as the stream it is for.

Here: the config records and their checks, and the flows each entry makes (one a
direction, in table 0 between reactive shunts and blocks, no idle timeout). One switch's
table of them, as the core keeps it, is static_table.py. Pure.
"""
from __future__ import annotations

import ipaddress
import zlib
from dataclasses import dataclass
from typing import Any, Protocol, cast

from nfshunt.records import cookies
from nfshunt.records.model import (
    TCP,
    UDP,
    FlowTuple,
    Network,
    NextHop,
    parse_address,
    parse_network,
)

from . import validate as v
from .switch import RoutedSide, SwitchConfig, vlan_id
from .validate import ConfigError

PROTOCOLS = {"udp": UDP, "tcp": TCP}
VIA_TABLE = "table"  # `via`: follow the firewall's route to the destination, as a reactive pair does
# The widest prefix an entry may name without raising `static_shunt_max_prefix`: any host
# inside it may send on the stream, past the firewall. /24: one cell's subnet; /64: one IPv6
# subnet, the smallest routed unit. A stream between two controllers is /32 (/128).
DEFAULT_MAX_PREFIX = {4: 24, 6: 64}
DEFAULT_PRIORITY = 33050  # above reactive shunts (33000) and their catchers (33001), below blocks (33100)


@dataclass(frozen=True)
class StaticShunt:
    """One engineered stream, as configured (src and dst: networks; a host is /32 or /128).
    An entry with a VLAN priority (`pcp`) may name no protocol and no addresses: every frame
    of its VLAN with that priority (protocol, src and dst None)."""
    protocol: int | None
    src: Network | None
    dst: Network | None
    fast_ports: tuple[int, int]  # the fast ports of the source's and the destination's port groups
    src_port: int | None = None  # None: any
    dst_port: int | None = None
    both_directions: bool = True
    name: str | None = None
    datapath_id: int | None = None  # with several switches whose fast ports both fit: which one
    vlan: int | None = None  # the source side's VLAN id (None: untagged); the other side's: its zone's there
    pcp: int | None = None  # the 802.1p priority (0-7) its frames carry (None: any)
    # A routing firewall's (forwarding "routed"): the next hop towards dst, an address on the
    # destination side's subnet, or VIA_TABLE (the firewall's route to dst, as a reactive pair's).
    via: str | None = None
    # A routing firewall's trunk (routed VLANs): the destination side's VLAN id, where its group
    # has several routed interfaces (None: its only one).
    vlan_out: int | None = None

    def on(self, switch: SwitchConfig) -> bool:
        """This entry's flows go on that switch."""
        return set(self.fast_ports) <= {g.fast for g in switch.ports} and (
            self.datapath_id is None or self.datapath_id == switch.datapath_id)

    @property
    def label(self) -> str:
        return self.name or describe(self.protocol, self.src, self.dst, self.src_port, self.dst_port) + \
            _tag_text(self.vlan, self.pcp)


@dataclass(frozen=True)
class StaticFlow:
    """One direction of a static shunt: the flow it puts in table 0."""
    shunt: StaticShunt
    reply: bool
    in_port: int
    out_port: int | None  # None: drop (an operator's block of a tuple inside the stream)
    src: Network | None  # None: any address (an entry by VLAN priority alone)
    dst: Network | None
    src_port: int | None
    dst_port: int | None
    priority: int
    cookie: int
    hard_timeout: int = 0  # a block's lifetime (the operator's pin); a static shunt never times out
    # The tag its frames arrive with and leave with (0: untagged), as the firewall's bridge of
    # its zone would put it back (the VLAN's zone on each side: a translated VLAN's differ).
    vid_in: int = 0
    vid_out: int = 0
    zone: int = 0
    pcp: int | None = None
    block_proto: int | None = None  # a block's: its tuple's protocol (the shunt may name none)
    # Through a routing firewall: the address whose next hop this direction leaves by (the
    # entry's `via`, or the destination host's with "table"); None bridged. Installed only
    # with `hop` (core/static_table asks the firewall's tables), which it rewrites to.
    via: str | None = None
    hop: NextHop | None = None

    @property
    def family(self) -> int | None:
        return None if self.src is None else self.src.version

    @property
    def proto(self) -> int | None:
        return self.shunt.protocol if self.block_proto is None else self.block_proto

    def describe(self) -> str:
        return describe(self.proto, self.src, self.dst, self.src_port, self.dst_port) + \
            _tag_text(self.vid_in or None, self.pcp) + \
            (f" port {self.in_port} -> {self.out_port}" if self.out_port is not None else
             f" port {self.in_port} drop") + (f" via {self.via}" if self.via is not None else "")

    def covers(self, t: FlowTuple) -> bool:
        """A packet of this tuple arriving on in_port would take this flow (if it carries the
        flow's priority: a connection's tuple names none)."""
        if t.zone != self.zone:
            return False
        if self.src is None or self.dst is None:
            return t.proto in (TCP, UDP)  # every frame of the VLAN with its priority
        return (t.proto == self.proto and t.family == self.family
                and ipaddress.ip_address(t.src) in self.src and ipaddress.ip_address(t.dst) in self.dst
                and _meet(self.src_port, t.sport) and _meet(self.dst_port, t.dport))

    def block(self, t: FlowTuple, priority: int, lifetime: int) -> "StaticFlow":
        """This flow's exact drop for tuple t (in its VLAN, whatever the priority), above it
        (an operator's block wins)."""
        key = zlib.crc32(repr(("block", self.in_port, t)).encode())
        net = ipaddress.ip_network
        return StaticFlow(self.shunt, self.reply, self.in_port, None, net(t.src), net(t.dst), t.sport, t.dport,
                          priority, cookies.make(cookies.Kind.STATIC, key, self.reply), lifetime,
                          self.vid_in, self.vid_in, self.zone, None, t.proto)

    def overlaps(self, other: "StaticFlow") -> bool:
        """Some frame could match both (same in_port, tag and protocol, priorities that meet;
        an address-less one: any of its tag and priority): the switch would pick one. The
        definition the config check's index (`_Seen`) is held equal to."""
        if (self.in_port, self.vid_in) != (other.in_port, other.vid_in) or not _meet(self.pcp, other.pcp):
            return False
        if self.src is None or other.src is None or self.dst is None or other.dst is None:
            return True
        return (self.proto == other.proto and self.family == other.family and self.src.overlaps(other.src)
                and self.dst.overlaps(other.dst)
                and _meet(self.src_port, other.src_port) and _meet(self.dst_port, other.dst_port))


def _meet(a: int | None, b: int | None) -> bool:
    """Two port (or priority) matches share a value (None: any)."""
    return a is None or b is None or a == b


def _tag_text(vlan: int | None, pcp: int | None) -> str:
    """' vlan 30 pcp 6' of an entry or flow that names them ('' untagged, any priority)."""
    return (f" vlan {vlan}" if vlan else "") + (f" pcp {pcp}" if pcp is not None else "")


def describe(proto: int | None, src: Network | None, dst: Network | None, sport: int | None,
             dport: int | None) -> str:
    if proto is None or src is None or dst is None:
        return "any"  # (an address-less entry: its VLAN and priority follow)
    name = "tcp" if proto == TCP else "udp"
    return f"{name} {src}:{'*' if sport is None else sport} -> {dst}:{'*' if dport is None else dport}"


# --- config --------------------------------------------------------------------------------

class Entries(Protocol):
    """What the static flows read of the controller's config (settings.Config: a protocol,
    so that this module needs nothing of settings, which imports it)."""
    @property
    def static_shunts(self) -> tuple[StaticShunt, ...]: ...
    @property
    def static_priority(self) -> int: ...


class Scope(Entries, Protocol):
    """What check() reads of the whole config (settings.Config)."""
    @property
    def switches(self) -> tuple[SwitchConfig, ...]: ...
    @property
    def openflow_versions(self) -> tuple[str, ...]: ...
    @property
    def shunt_priority(self) -> int: ...
    @property
    def block_priority(self) -> int: ...
    @property
    def static_shunt_max_prefix(self) -> dict[int, int]: ...


@v.takes("string", "an address or a prefix, host bits zero (no IPv6 scope id)")
def _network(key: str, value: Any) -> Network:
    value = v.string(key, value)
    return v.parsed(key, parse_network, value, f"{value!r} is not an address or prefix (host bits must be zero)")


@v.takes("list of 2 integers", "two different switch ports, 1-4294967040")
def _port_pair(key: str, value: Any) -> tuple[int, int]:
    if not isinstance(value, list) or len(value) != 2:
        raise ConfigError(key, "expected [source side fast port, destination side fast port]")
    a, b = (v.integer(1, 0xFFFFFF00)(f"{key}[{i}]", port) for i, port in enumerate(value))
    if a == b:
        raise ConfigError(f"{key}[1]", f"the same port {b} as the source side: a stream crosses two port groups")
    return a, b


@v.takes("string", "an IPv4 or IPv6 address (no scope id), or `table`")
def _via(key: str, value: Any) -> str:
    value = v.string(key, value)
    if value == VIA_TABLE:
        return value
    return str(v.parsed(key, parse_address, value, f"{value!r} is neither an address (the next hop towards dst) "
                        "nor \"table\" (follow the firewall's route to dst)"))


_ANY = "required (with `pcp`: all three or none)"
ENTRY = v.Table("static_shunts[]", "One engineered stream on the fast path from its first frame, outside the "
                "firewall (which never sees, tracks, logs or polices its frames): keep it as narrow as the stream.", {
    "name": v.Key(v.string, "The stream's name in logs, status and metrics; each once.", default="none (a "
                  "description of the match)"),
    "protocol": v.Key(v.choice(tuple(PROTOCOLS)), "The stream's IP protocol.", default=_ANY),
    "src": v.Key(_network, "The source host (or network: every host in it may then send on the stream); no "
                 "wider than `static_shunt_max_prefix`.", default=_ANY),
    "dst": v.Key(_network, "The destination host or network, of the source's family.", default=_ANY),
    "src_port": v.Key(v.integer(1, 65535), "The source port.", default="any"),
    "dst_port": v.Key(v.integer(1, 65535), "The destination port; give it at least.", default="any"),
    "fast_ports": v.Key(_port_pair, "The fast ports of the source's and the destination's port groups, on one "
                        "switch."),
    "both_directions": v.Key(v.boolean, "Add the reverse flow too (destination to source, ports swapped); false "
                             "for a stream that flows one way."),
    "datapath_id": v.Key(v.dpid, "The switch, when several switches have both fast ports.", default="the one "
                         "switch with both fast ports"),
    "vlan": v.Key(v.Check(vlan_id, "integer", "1-4094"), "The VLAN "
                  "id of the source side's frames (its port group's `vlans`); they leave with the tag of the same "
                  "zone on the destination's group, as the firewall's bridge would put it (routed: `vlan_out`'s).",
                  default="untagged"),
    "pcp": v.Key(v.integer(0, 7), "The VLAN priority (802.1p PCP) of the stream's frames, kept as "
                 "it came; needs `vlan`. With it, `protocol`, `src` and `dst` may all be left out: every frame of "
                 "the VLAN with that priority (the industrial case).", default="any"),
    "via": v.Key(_via, "Routing firewalls only (`forwarding` `routed`; then required): the next hop towards "
                 "`dst`, an address on the destination side's subnet, or `table`: the firewall's own route and "
                 "neighbour tables, followed (`dst`, and `src` with `both_directions`, then one host each). The "
                 "flows do the router's rewrite (TTL one lower, the egress interface's and the next hop's MACs); "
                 "the reverse direction always follows the table to `src`.", default="none (bridged)"),
    "vlan_out": v.Key(v.Check(vlan_id, "integer", "1-4094"), "Routing firewalls on trunks only (routed VLANs): "
                      "the VLAN id of the destination side's routed interface the stream leaves by (its next hop "
                      "must be there; the reverse direction comes in by it).", default="the destination group's "
                      "one routed interface"),
}, required=("fast_ports",), record=StaticShunt)
_ADDRESSED = ("protocol", "src", "dst")  # required, unless an entry names a priority: then all or none


@v.takes("list of objects", "streams (`static_shunts[]`); no two overlap; needs OpenFlow 1.3 only")
def parse(key: str, value: Any) -> tuple[StaticShunt, ...]:
    """`static_shunts`: each entry's own keys (what needs the rest of the config: check())."""
    if not isinstance(value, list):
        raise ConfigError(key, "expected a list of streams ({\"protocol\": \"udp\", \"src\": ..., \"dst\": ..., "
                          "\"fast_ports\": [a, b]})")
    out = []
    names: dict[str, int] = {}
    for i, raw in enumerate(value):
        at = f"{key}[{i}]"
        entry = ENTRY.read(at, raw)
        _addressed(at, entry)
        entry["protocol"] = PROTOCOLS.get(entry.get("protocol", ""))
        shunt = StaticShunt(**{"src": None, "dst": None, **entry})
        if shunt.src is None or shunt.dst is None:
            pass
        elif shunt.src.version != shunt.dst.version:
            raise ConfigError(f"{at}.dst", f"{shunt.dst} is IPv{shunt.dst.version}, src {shunt.src} "
                              f"IPv{shunt.src.version}: one family a stream")
        _routed_entry(at, shunt)
        if shunt.name is not None:
            if shunt.name in names:
                raise ConfigError(f"{at}.name", f"{shunt.name!r} is already used by {key}[{names[shunt.name]}]")
            names[shunt.name] = i
        out.append(shunt)
    return tuple(out)


def _routed_entry(at: str, shunt: StaticShunt) -> None:
    """What `via` needs of the entry itself: a destination to route (an entry by VLAN priority
    alone has none), an address of its family, one host wherever the table picks the next hop
    (a subnet's hosts each have their own MAC: one flow cannot rewrite to all of them)."""
    if shunt.via is None:
        return
    if shunt.src is None or shunt.dst is None:
        raise ConfigError(f"{at}.via", "an entry by VLAN priority alone has no destination to route: give "
                          "protocol, src and dst")
    if shunt.via != VIA_TABLE and ipaddress.ip_address(shunt.via).version != shunt.dst.version:
        raise ConfigError(f"{at}.via", f"{shunt.via} is not of dst {shunt.dst}'s family (IPv{shunt.dst.version})")
    sides = (["dst"] if shunt.via == VIA_TABLE else []) + (["src"] if shunt.both_directions else [])
    for side in sides:
        net = getattr(shunt, side)
        if net.prefixlen != net.max_prefixlen:
            raise ConfigError(f"{at}.{side}", f"{net} is a prefix, and the next hop towards {side} follows the "
                              "firewall's table: name one host (each host of a subnet has its own MAC)" +
                              (", or both_directions false" if side == "src" else ""))


def _addressed(at: str, entry: dict[str, Any]) -> None:
    """protocol, src and dst given; or, with a VLAN priority, all of them left out (and the
    ports, which need a protocol); a priority needs its VLAN."""
    if "pcp" in entry and "vlan" not in entry:
        raise ConfigError(f"{at}.pcp", "a priority needs a tag: give \"vlan\"")
    given = [name for name in _ADDRESSED if name in entry]
    if "pcp" not in entry or given:
        for name in _ADDRESSED:
            if name not in entry:
                raise ConfigError(f"{at}.{name}", "required key is missing" + (
                    "" if "pcp" not in entry else f" (with {', '.join(given)}: give protocol, src and dst, or "
                    "none of them for every frame of the VLAN and priority)"))
        return
    for name in ("src_port", "dst_port"):
        if name in entry:
            raise ConfigError(f"{at}.{name}", "a port needs a protocol and addresses: give protocol, src and dst")


MAX_PREFIX = v.Table("static_shunt_max_prefix", "The widest `src` or `dst` prefix a static shunt may name, by "
                     "family: every host inside it may send on the stream, past the firewall.", {
    "ipv4": v.Key(v.integer(0, 32), "The shortest IPv4 prefix length (24: one subnet).",
                  default=str(DEFAULT_MAX_PREFIX[4])),
    "ipv6": v.Key(v.integer(0, 128), "The shortest IPv6 prefix length (64: one subnet).",
                  default=str(DEFAULT_MAX_PREFIX[6])),
})


@v.takes("object", "see `static_shunt_max_prefix`")
def max_prefix(key: str, value: Any) -> dict[int, int]:
    """`static_shunt_max_prefix`: {"ipv4": 24, "ipv6": 64}, the widest prefix an entry may name."""
    given = MAX_PREFIX.read(key, value)
    return {4: given.get("ipv4", DEFAULT_MAX_PREFIX[4]), 6: given.get("ipv6", DEFAULT_MAX_PREFIX[6])}


def check(cfg: Scope) -> None:
    """What an entry must agree on with the rest of the config: its ports, the prefix
    limit, the priorities, the OpenFlow version; and no two entries' flows overlap."""
    shunts = cfg.static_shunts
    if not shunts:
        return
    if cfg.openflow_versions != ("1.3",):
        raise ConfigError("static_shunts", "static shunts need OpenFlow 1.3 (prefixes, IPv6, flows found by "
                          "cookie): set openflow_versions to [\"1.3\"]")
    if not cfg.shunt_priority + 1 < cfg.static_priority < cfg.block_priority:
        raise ConfigError("static_priority", f"{cfg.static_priority} must be above shunt_priority + 1 "
                          f"({cfg.shunt_priority + 1}: the TCP catchers) and below block_priority "
                          f"({cfg.block_priority}): an operator's block must still win")
    groups = [{g.fast for g in sw.ports} for sw in cfg.switches]
    dpids = {sw.datapath_id for sw in cfg.switches}
    seen = _Seen()
    for i, shunt in enumerate(shunts):
        at = f"static_shunts[{i}]"
        for j, port in enumerate(shunt.fast_ports):
            if not any(port in fast for fast in groups):
                raise ConfigError(f"{at}.fast_ports[{j}]", f"{port} is not the fast port of a configured port group")
        if not any(set(shunt.fast_ports) <= fast for fast in groups):
            raise ConfigError(f"{at}.fast_ports", "both ports must be on the same switch")
        if shunt.datapath_id is not None and shunt.datapath_id not in dpids:
            raise ConfigError(f"{at}.datapath_id", f"{shunt.datapath_id:016x} is not a served switch")
        served = [sw.datapath_id for sw in cfg.switches if shunt.on(sw)]
        if not served:
            raise ConfigError(f"{at}.fast_ports", "not the fast ports of that switch")
        if len(served) > 1:
            raise ConfigError(f"{at}.datapath_id", "the fast ports are on several switches: name the one "
                              "(a stream declared for one must not bypass the firewall on another)")
        sw = next(sw for sw in cfg.switches if shunt.on(sw))
        _check_via(at, shunt, sw)
        tags = _check_tags(at, shunt, sw)
        for side in ("src", "dst"):
            net = getattr(shunt, side)
            limit = cfg.static_shunt_max_prefix[net.version] if net is not None else 0
            if net is not None and net.prefixlen < limit:
                raise ConfigError(f"{at}.{side}", f"{net} is wider than /{limit} (static_shunt_max_prefix "
                                  f"ipv{net.version}): every host in it would bypass the firewall")
        for flow in flows_of(shunt, cfg.static_priority, 0, tags):
            hit = seen.overlapping(at, flow)
            if hit is not None:
                other_at, other = hit
                raise ConfigError(at, f"overlaps {other_at} ({other.describe()}): a frame would match both")


def _check_via(at: str, shunt: StaticShunt, switch: SwitchConfig) -> None:
    """`via` with a routing firewall's switch, and only there: a bridged entry's flows forward
    frames as they came; a routed one's without the router's rewrite would hand the receiver
    frames addressed to the firewall's MAC, with the TTL the firewall never lowered."""
    routed = switch.forwarding == "routed"
    if shunt.via is not None and not routed:
        raise ConfigError(f"{at}.via", "names a next hop, and this switch's forwarding is bridged: a bridging "
                          "firewall has no next hop (leave via out, or set forwarding \"routed\")")
    if shunt.vlan_out is not None and not routed:
        raise ConfigError(f"{at}.vlan_out", "names a routed VLAN, and this switch's forwarding is bridged: a "
                          "bridged stream leaves with its zone's tag (leave vlan_out out)")
    if routed and shunt.via is None:
        raise ConfigError(f"{at}.via", "required with forwarding \"routed\": the stream's frames must leave with "
                          "the router's rewrite; give the next hop towards dst (an address on its side's subnet) "
                          "or \"table\" (the firewall's route to dst)")
    if routed and not switch.experimental_routed:
        raise ConfigError(f"{at}.via", "shunts through a routing firewall, static ones too, need "
                          f"{switch.at}experimental_routed true")


def tags_of(shunt: StaticShunt, switch: SwitchConfig) -> tuple[int, int, int] | None:
    """(source side's tag, destination side's tag, zone) of an entry on its switch (0:
    untagged); None if a side does not carry it (check() refuses such an entry)."""
    if switch.sides:
        sides = routed_sides_of(shunt, switch)
        return None if sides is None else (sides[0].vid, sides[1].vid, 0)
    groups = {g.fast: g for g in switch.ports}
    a, b = (groups.get(port) for port in shunt.fast_ports)
    if a is None or b is None:
        return None
    zone = a.zone_of_vid.get(shunt.vlan or 0)
    if zone is None or zone not in b.vid_of_zone:
        return None
    return shunt.vlan or 0, b.vid_of_zone[zone], zone


def routed_sides_of(shunt: StaticShunt, switch: SwitchConfig) -> tuple[RoutedSide, RoutedSide] | None:
    """A routed entry's interfaces: the source side's by `vlan`, the destination side's by
    `vlan_out` or, without it, its group's only one; None if either is not there."""
    a = switch.side_at.get((shunt.fast_ports[0], shunt.vlan or 0))
    if shunt.vlan_out is not None:
        b = switch.side_at.get((shunt.fast_ports[1], shunt.vlan_out))
    else:
        there = [side for (fast, _), side in switch.side_at.items() if fast == shunt.fast_ports[1]]
        b = there[0] if len(there) == 1 else None
    return None if a is None or b is None else (a, b)


def _check_tags(at: str, shunt: StaticShunt, switch: SwitchConfig) -> tuple[int, int, int]:
    """The entry's tags (tags_of), or the error that says which side does not carry them."""
    tags = tags_of(shunt, switch)
    if tags is not None:
        return tags
    if switch.sides:
        _routed_tags_error(at, shunt, switch)
    groups = {g.fast: g for g in switch.ports}
    a, b = (groups[port] for port in shunt.fast_ports)
    zone = a.zone_of_vid.get(shunt.vlan or 0)
    if zone is None and shunt.vlan is None:
        raise ConfigError(f"{at}.fast_ports[0]", f"port {a.fast}'s group carries no untagged frames (its "
                          "\"untagged\"): name the stream's VLAN (\"vlan\")")
    if zone is None:
        raise ConfigError(f"{at}.vlan", f"VLAN {shunt.vlan} is not carried by the port group of fast port {a.fast}")
    what = f"VLAN {shunt.vlan}" if shunt.vlan else "untagged frames"
    raise ConfigError(f"{at}.vlan" if shunt.vlan else f"{at}.fast_ports[1]",
                      f"{what} (zone {zone}) is not carried by the port group of fast port {b.fast}: the firewall "
                      "bridges the zone to no VLAN there" if zone else
                      f"{what} are not carried by the port group of fast port {b.fast} (its \"untagged\")")


def _routed_tags_error(at: str, shunt: StaticShunt, switch: SwitchConfig) -> None:
    """Which of a routed entry's interfaces is not there, and what to give."""
    a, b = shunt.fast_ports
    if (a, shunt.vlan or 0) not in switch.side_at:
        what = f"VLAN {shunt.vlan} is" if shunt.vlan else "untagged frames are"
        raise ConfigError(f"{at}.vlan" if shunt.vlan else f"{at}.fast_ports[0]", f"{what} not a routed interface "
                          f"of port {a}'s group (its \"vlans\" and \"untagged\")")
    there = sorted(vid for (fast, vid) in switch.side_at if fast == b)
    if shunt.vlan_out is not None:
        raise ConfigError(f"{at}.vlan_out", f"VLAN {shunt.vlan_out} is not a routed interface of port {b}'s group "
                          f"(it routes {', '.join(str(v or 'untagged') for v in there) or 'nothing'})")
    raise ConfigError(f"{at}.vlan_out", f"port {b}'s group routes {len(there)} interfaces "
                      f"({', '.join(str(v or 'untagged') for v in there)}): name the one the stream leaves by")


class _Seen:
    """The flows checked so far, indexed so that finding one a new flow overlaps costs a
    few dict lookups, whatever the addresses (a scan of the flows between the same two
    hosts made 1,000 entries of one host pair take 1.3 s and 2,000 take 9 s).

    Two flows overlap when their in_port, tag, protocol and family are the same, their
    priorities meet (equal, or either any), their source
    prefixes nest, their destination prefixes nest and each port matches (equal, or either
    one any). Prefixes nest exactly when they agree on the bits of the shorter one. So a
    flow's "shape" (source and destination prefix lengths, whether each port is any) and
    another shape say which bits and ports must agree: `_Bits.key`. Flows of shape S are
    kept by their key for each shape T met so far; a new flow of shape T looks its own key
    up once per shape S: a hit is a flow it overlaps, no hit means none. Each lookup and
    each insertion is one dict operation per shape in use, and configs use a handful (host
    to host with ports, a subnet to a host ...)."""

    def __init__(self) -> None:
        self.flows: dict[_Shape, list[_Bits]] = {}
        self.index: dict[tuple[_Shape, _Shape], dict[tuple[Any, ...], _Bits]] = {}
        # By (in_port, tag): every flow so far, and the address-less ones (a VLAN priority's
        # every frame), which overlap anything of their port, tag and priority: a scan, few.
        self.by_port: dict[tuple[int, int], list[tuple[str, StaticFlow]]] = {}
        self.wild: dict[tuple[int, int], list[tuple[str, StaticFlow]]] = {}

    def overlapping(self, at: str, flow: StaticFlow) -> tuple[str, StaticFlow] | None:
        """An earlier flow this one overlaps (the first added of those found), or None;
        the flow is kept either way."""
        port = (flow.in_port, flow.vid_in)
        found = next(((a, f) for a, f in (self.by_port if flow.src is None else self.wild).get(port, ())
                      if _meet(f.pcp, flow.pcp)), None)
        self.by_port.setdefault(port, []).append((at, flow))
        if flow.src is None:
            self.wild.setdefault(port, []).append((at, flow))
            return found
        bits = _Bits(at, flow)
        mine = bits.shape
        if mine not in self.flows:
            self._new_shape(mine)
        # A priority meets its own and any; any meets every one.
        pcps = (flow.pcp, None) if flow.pcp is not None else (None, *range(8))
        for theirs in self.flows:
            if found is not None:
                break
            for pcp in pcps:
                hit = self.index[(theirs, mine)].get(bits.key(theirs, pcp))
                if hit is not None:
                    found = hit.at, hit.flow
                    break
        self.flows[mine].append(bits)
        for other in self.flows:
            self.index[(mine, other)].setdefault(bits.key(other), bits)
        return found

    def _new_shape(self, shape: "_Shape") -> None:
        self.flows[shape] = []
        for theirs, flows in self.flows.items():
            self.index[(theirs, shape)] = {}
            self.index[(shape, theirs)] = {}
            table = self.index[(theirs, shape)]
            for bits in flows:
                table.setdefault(bits.key(shape), bits)


_Shape = tuple[int, int, bool, bool]  # source and destination prefix lengths; source and destination port any


class _Bits:
    """A flow as the overlap index reads it (its addresses as integers, read once)."""
    __slots__ = ("at", "flow", "shape", "group", "pcp", "width", "src", "dst", "sport", "dport")

    def __init__(self, at: str, flow: StaticFlow):
        self.at, self.flow = at, flow
        src, dst = cast(Network, flow.src), cast(Network, flow.dst)  # (an address-less flow is a wild one)
        self.shape = (src.prefixlen, dst.prefixlen, flow.src_port is None, flow.dst_port is None)
        self.group = (flow.in_port, flow.vid_in, flow.proto, flow.family)
        self.pcp = flow.pcp
        self.width = src.max_prefixlen
        self.src, self.dst = int(src.network_address), int(dst.network_address)
        self.sport, self.dport = flow.src_port, flow.dst_port

    def key(self, other: "_Shape", pcp: Any = "own") -> tuple[Any, ...]:
        """What must be equal for this flow and one of shape `other` (and priority `pcp`:
        by default this flow's) to overlap: in_port, tag, protocol and family; each prefix's
        leading bits, as many as the shorter prefix has; each port where both flows name one."""
        mine = self.shape
        return (self.group, self.pcp if pcp == "own" else pcp, self.src >> (self.width - min(mine[0], other[0])),
                self.dst >> (self.width - min(mine[1], other[1])),
                None if mine[2] or other[2] else self.sport, None if mine[3] or other[3] else self.dport)


# --- flows ---------------------------------------------------------------------------------

def flows_of(shunt: StaticShunt, priority: int, key: int,
             tags: tuple[int, int, int] = (0, 0, 0)) -> list[StaticFlow]:
    """An entry's flows; tags: (source side's tag, destination side's, zone), tags_of's."""
    a, b = shunt.fast_ports
    va, vb, zone = tags
    via, back = _vias(shunt)
    out = [StaticFlow(shunt, False, a, b, shunt.src, shunt.dst, shunt.src_port, shunt.dst_port, priority,
                      cookies.make(cookies.Kind.STATIC, key, False), 0, va, vb, zone, shunt.pcp, via=via)]
    if shunt.both_directions:
        out.append(StaticFlow(shunt, True, b, a, shunt.dst, shunt.src, shunt.dst_port, shunt.src_port, priority,
                              cookies.make(cookies.Kind.STATIC, key, True), 0, vb, va, zone, shunt.pcp, via=back))
    return out


def _vias(shunt: StaticShunt) -> tuple[str | None, str | None]:
    """The addresses whose next hops the two directions leave by: the entry's `via` (or, with
    "table", the destination host) forward; the source host back. None, None bridged."""
    if shunt.via is None or shunt.src is None or shunt.dst is None:
        return None, None
    forward = str(shunt.dst.network_address) if shunt.via == VIA_TABLE else shunt.via
    return forward, str(shunt.src.network_address)


def _key(shunt: StaticShunt, priority: int) -> int:
    """A stable 32-bit name for what the entry puts on the switch (not its name or place
    in the list): an unchanged entry keeps its cookie across reloads and restarts."""
    fields: tuple[Any, ...] = (shunt.protocol, str(shunt.src), str(shunt.dst), shunt.src_port, shunt.dst_port,
                               shunt.fast_ports, shunt.both_directions, priority)
    if shunt.vlan is not None or shunt.pcp is not None:  # (only then: an untagged entry keeps its cookie)
        fields += (("vlan", shunt.vlan), ("pcp", shunt.pcp))
    if shunt.via is not None:  # (likewise: a bridged entry's cookie as before)
        fields += (("via", shunt.via),)
    if shunt.vlan_out is not None:
        fields += (("vlan_out", shunt.vlan_out),)
    text = repr(fields)
    return zlib.crc32(text.encode())


def switch_flows(cfg: Entries, switch: SwitchConfig) -> dict[int, StaticFlow]:
    """Every static flow of one switch (the entries on its ports), by cookie."""
    out: dict[int, StaticFlow] = {}
    keys: set[int] = set()
    for shunt in sorted((s for s in cfg.static_shunts if s.on(switch)), key=repr):
        key = _key(shunt, cfg.static_priority)
        while key in keys:  # two entries of one hash (1 in 2^32 a pair): the later one probes on
            key = (key + 1) & 0xFFFFFFFF
        keys.add(key)
        out.update((f.cookie, f) for f in flows_of(shunt, cfg.static_priority, key,
                                                   tags_of(shunt, switch) or (0, 0, 0)))
    return out
