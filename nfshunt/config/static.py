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
from typing import Any, Protocol

from nfshunt.records import cookies
from nfshunt.records.model import TCP, UDP, FlowTuple

from . import validate as v
from .switch import SwitchConfig
from .validate import ConfigError

PROTOCOLS = {"udp": UDP, "tcp": TCP}
# The widest prefix an entry may name without raising `static_shunt_max_prefix`: any host
# inside it may send on the stream, past the firewall. /24: one cell's subnet; /64: one IPv6
# subnet, the smallest routed unit. A stream between two controllers is /32 (/128).
DEFAULT_MAX_PREFIX = {4: 24, 6: 64}
DEFAULT_PRIORITY = 33050  # above reactive shunts (33000) and their catchers (33001), below blocks (33100)
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class StaticShunt:
    """One engineered stream, as configured (src and dst: networks; a host is /32 or /128)."""
    protocol: int
    src: Network
    dst: Network
    fast_ports: tuple[int, int]  # the fast ports of the source's and the destination's port groups
    src_port: int | None = None  # None: any
    dst_port: int | None = None
    both_directions: bool = True
    name: str | None = None
    datapath_id: int | None = None  # with several switches whose fast ports both fit: which one

    def on(self, switch: SwitchConfig) -> bool:
        """This entry's flows go on that switch."""
        return set(self.fast_ports) <= {g.fast for g in switch.ports} and (
            self.datapath_id is None or self.datapath_id == switch.datapath_id)

    @property
    def label(self) -> str:
        return self.name or describe(self.protocol, self.src, self.dst, self.src_port, self.dst_port)


@dataclass(frozen=True)
class StaticFlow:
    """One direction of a static shunt: the flow it puts in table 0."""
    shunt: StaticShunt
    reply: bool
    in_port: int
    out_port: int | None  # None: drop (an operator's block of a tuple inside the stream)
    src: Network
    dst: Network
    src_port: int | None
    dst_port: int | None
    priority: int
    cookie: int
    hard_timeout: int = 0  # a block's lifetime (the operator's pin); a static shunt never times out

    @property
    def family(self) -> int:
        return self.src.version

    def describe(self) -> str:
        return describe(self.shunt.protocol, self.src, self.dst, self.src_port, self.dst_port) + \
            (f" port {self.in_port} -> {self.out_port}" if self.out_port is not None else f" port {self.in_port} drop")

    def covers(self, t: FlowTuple) -> bool:
        """A packet of this tuple arriving on in_port would take this flow."""
        return (t.proto == self.shunt.protocol and t.family == self.family
                and ipaddress.ip_address(t.src) in self.src and ipaddress.ip_address(t.dst) in self.dst
                and _meet(self.src_port, t.sport) and _meet(self.dst_port, t.dport))

    def block(self, t: FlowTuple, priority: int, lifetime: int) -> "StaticFlow":
        """This flow's exact drop for tuple t, above it (an operator's block wins)."""
        key = zlib.crc32(repr(("block", self.in_port, t)).encode())
        net = ipaddress.ip_network
        return StaticFlow(self.shunt, self.reply, self.in_port, None, net(t.src), net(t.dst), t.sport, t.dport,
                          priority, cookies.make(cookies.Kind.STATIC, key, self.reply), lifetime)

    def overlaps(self, other: "StaticFlow") -> bool:
        """Some frame could match both (same in_port and protocol): the switch would pick one.
        The definition the config check's index (`_Seen`) is held equal to."""
        return (self.in_port == other.in_port and self.shunt.protocol == other.shunt.protocol
                and self.family == other.family and self.src.overlaps(other.src)
                and self.dst.overlaps(other.dst)
                and _meet(self.src_port, other.src_port) and _meet(self.dst_port, other.dst_port))


def _meet(a: int | None, b: int | None) -> bool:
    """Two port matches share a port (None: any)."""
    return a is None or b is None or a == b


def describe(proto: int, src: Network, dst: Network, sport: int | None, dport: int | None) -> str:
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


@v.takes("string", "an address or a prefix, host bits zero")
def _network(key: str, value: Any) -> Network:
    value = v.string(key, value)
    try:
        return ipaddress.ip_network(value, strict=True)
    except ValueError as exc:
        raise ConfigError(key, f"{value!r} is not an address or prefix (host bits must be zero): {exc}") from None


@v.takes("list of 2 integers", "two different switch ports, 1-4294967040")
def _port_pair(key: str, value: Any) -> tuple[int, int]:
    if not isinstance(value, list) or len(value) != 2:
        raise ConfigError(key, "expected [source side fast port, destination side fast port]")
    a, b = (v.integer(1, 0xFFFFFF00)(f"{key}[{i}]", port) for i, port in enumerate(value))
    if a == b:
        raise ConfigError(f"{key}[1]", f"the same port {b} as the source side: a stream crosses two port groups")
    return a, b


ENTRY = v.Table("static_shunts[]", "One engineered stream on the fast path from its first frame, outside the "
                "firewall (which never sees, tracks, logs or polices its frames): keep it as narrow as the stream.", {
    "name": v.Key(v.string, "The stream's name in logs, status and metrics; each once.", default="none (a "
                  "description of the match)"),
    "protocol": v.Key(v.choice(tuple(PROTOCOLS)), "The stream's IP protocol."),
    "src": v.Key(_network, "The source host (or network: every host in it may then send on the stream); no "
                 "wider than `static_shunt_max_prefix`."),
    "dst": v.Key(_network, "The destination host or network, of the source's family."),
    "src_port": v.Key(v.integer(1, 65535), "The source port.", default="any"),
    "dst_port": v.Key(v.integer(1, 65535), "The destination port; give it at least.", default="any"),
    "fast_ports": v.Key(_port_pair, "The fast ports of the source's and the destination's port groups, on one "
                        "switch."),
    "both_directions": v.Key(v.boolean, "Add the reverse flow too (destination to source, ports swapped); false "
                             "for a stream that flows one way."),
    "datapath_id": v.Key(v.dpid, "The switch, when several switches have both fast ports.", default="the one "
                         "switch with both fast ports"),
}, required=("protocol", "src", "dst", "fast_ports"), record=StaticShunt)


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
        entry["protocol"] = PROTOCOLS[entry["protocol"]]
        shunt = StaticShunt(**entry)
        if shunt.src.version != shunt.dst.version:
            raise ConfigError(f"{at}.dst", f"{shunt.dst} is IPv{shunt.dst.version}, src {shunt.src} "
                              f"IPv{shunt.src.version}: one family a stream")
        if shunt.name is not None:
            if shunt.name in names:
                raise ConfigError(f"{at}.name", f"{shunt.name!r} is already used by {key}[{names[shunt.name]}]")
            names[shunt.name] = i
        out.append(shunt)
    return tuple(out)


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
        untagged = {g.fast for sw in cfg.switches for g in sw.ports if g.untagged == 0}
        for j, port in enumerate(shunt.fast_ports):
            if port not in untagged:
                raise ConfigError(f"{at}.fast_ports[{j}]", f"port {port}'s group carries no untagged frames (its "
                                  "\"untagged\"), and static shunts of VLAN traffic are not supported yet")
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
        limit = cfg.static_shunt_max_prefix[shunt.src.version]
        for side in ("src", "dst"):
            net = getattr(shunt, side)
            if net.prefixlen < limit:
                raise ConfigError(f"{at}.{side}", f"{net} is wider than /{limit} (static_shunt_max_prefix "
                                  f"ipv{net.version}): every host in it would bypass the firewall")
        for flow in flows_of(shunt, cfg.static_priority, 0):
            hit = seen.overlapping(at, flow)
            if hit is not None:
                other_at, other = hit
                raise ConfigError(at, f"overlaps {other_at} ({other.describe()}): a frame would match both")


class _Seen:
    """The flows checked so far, indexed so that finding one a new flow overlaps costs a
    few dict lookups, whatever the addresses (a scan of the flows between the same two
    hosts made 1,000 entries of one host pair take 1.3 s and 2,000 take 9 s).

    Two flows overlap when their in_port, protocol and family are the same, their source
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

    def overlapping(self, at: str, flow: StaticFlow) -> tuple[str, StaticFlow] | None:
        """An earlier flow this one overlaps (the first added of those found), or None;
        the flow is kept either way."""
        bits = _Bits(at, flow)
        mine = bits.shape
        if mine not in self.flows:
            self._new_shape(mine)
        found = None
        for theirs in self.flows:
            hit = self.index[(theirs, mine)].get(bits.key(theirs))
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
    __slots__ = ("at", "flow", "shape", "group", "width", "src", "dst", "sport", "dport")

    def __init__(self, at: str, flow: StaticFlow):
        self.at, self.flow = at, flow
        self.shape = (flow.src.prefixlen, flow.dst.prefixlen, flow.src_port is None, flow.dst_port is None)
        self.group = (flow.in_port, flow.shunt.protocol, flow.family)
        self.width = flow.src.max_prefixlen
        self.src, self.dst = int(flow.src.network_address), int(flow.dst.network_address)
        self.sport, self.dport = flow.src_port, flow.dst_port

    def key(self, other: "_Shape") -> tuple[Any, ...]:
        """What must be equal for this flow and one of shape `other` to overlap: in_port,
        protocol and family; each prefix's leading bits, as many as the shorter prefix
        has; each port where both flows name one."""
        mine = self.shape
        return (self.group, self.src >> (self.width - min(mine[0], other[0])),
                self.dst >> (self.width - min(mine[1], other[1])),
                None if mine[2] or other[2] else self.sport, None if mine[3] or other[3] else self.dport)


# --- flows ---------------------------------------------------------------------------------

def flows_of(shunt: StaticShunt, priority: int, key: int) -> list[StaticFlow]:
    a, b = shunt.fast_ports
    out = [StaticFlow(shunt, False, a, b, shunt.src, shunt.dst, shunt.src_port, shunt.dst_port, priority,
                      cookies.make(cookies.Kind.STATIC, key, False))]
    if shunt.both_directions:
        out.append(StaticFlow(shunt, True, b, a, shunt.dst, shunt.src, shunt.dst_port, shunt.src_port, priority,
                              cookies.make(cookies.Kind.STATIC, key, True)))
    return out


def _key(shunt: StaticShunt, priority: int) -> int:
    """A stable 32-bit name for what the entry puts on the switch (not its name or place
    in the list): an unchanged entry keeps its cookie across reloads and restarts."""
    text = repr((shunt.protocol, str(shunt.src), str(shunt.dst), shunt.src_port, shunt.dst_port, shunt.fast_ports,
                 shunt.both_directions, priority))
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
        out.update((f.cookie, f) for f in flows_of(shunt, cfg.static_priority, key))
    return out
