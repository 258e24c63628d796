"""The switch's side of the config: port groups, the OpenFlow listener's versions and TLS,
the keys each entry of `switches` may set, and what one switch's keys must agree on."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from nfshunt.records import markcodec
from nfshunt.records.model import OPENFLOW_VERSIONS

from . import validate as v
from .validate import ConfigError


@dataclass(frozen=True)
class Vlan:
    """One VLAN a port group's trunk carries: its id on this side (the fast port and the slow
    link carry the same id), the conntrack zone the firewall bridges it in (a VLAN of another
    group with the same zone is the other side of that bridge: ids may differ, translated),
    and the firewall's sub-interface that serves it. A routing firewall's VLAN (physdevin set)
    is an interface of its own instead: the mark names it by its physdevin, and its zone is the
    router's (0: both directions of a routed connection must meet one entry, whatever VLANs
    they cross; docs/design/routed.md 9)."""
    id: int
    zone: int
    bridge_port: str | None = None
    physdevin: int | None = None  # routed: its number in the mark's port fields
    interface: str | None = None  # routed: the router's sub-interface for it


@dataclass(frozen=True)
class PortGroup:
    fast: int
    slow: int
    physdevin: int
    bridge_port: str | None = None
    interface: str | None = None  # routed mode (forwarding "routed"): the router's interface, not a bridge port
    vlans: tuple[Vlan, ...] = ()
    # The zone untagged frames of this side are bridged in (0: the firewall's own bridge,
    # today's); None: this side carries no untagged frames (dropped and counted).
    untagged: int | None = 0
    # zone -> the VLAN id this side carries it on (0: untagged), and back.
    vid_of_zone: dict[int, int] = field(init=False, compare=False, repr=False)
    zone_of_vid: dict[int, int] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        vids = {vlan.zone: vlan.id for vlan in self.vlans if vlan.physdevin is None}
        if self.untagged is not None:
            vids[self.untagged] = 0
        object.__setattr__(self, "vid_of_zone", vids)
        # (A routed VLAN's frames are in the router's zone, 0, and its tag is its side's:
        # RoutedSide, not vid_of_zone, which would need one tag per zone.)
        object.__setattr__(self, "zone_of_vid", {**{vid: zone for zone, vid in vids.items()},
                                                 **{v.id: 0 for v in self.vlans if v.physdevin is not None}})

    @property
    def routed_vlans(self) -> bool:
        """Its VLANs are a routing firewall's interfaces (each with a physdevin), not bridged zones."""
        return any(vlan.physdevin is not None for vlan in self.vlans)

    @property
    def trunk(self) -> bool:
        """Not today's untagged-only group: its defaults patch each tag, and drop the rest."""
        return bool(self.vlans) or self.untagged != 0

    @property
    def default_flows(self) -> int:
        """Table-0 entries of its defaults: both ways per carried tag, and a drop per port on a trunk."""
        return 2 * len(self.zone_of_vid) + 2 if self.trunk else 2


@dataclass(frozen=True)
class RoutedSide:
    """One interface of a routing firewall behind a port group: the group's own (its untagged
    frames, the group's physdevin) or one VLAN's sub-interface (the VLAN's). The mark's port
    fields name it; a routed connection's frames on that side carry its tag (0: untagged)."""
    physdevin: int
    group: PortGroup
    vid: int
    interface: str | None
    zone: int  # the conntrack zone its frames are routed in


def routed_sides(ports: tuple[PortGroup, ...]) -> dict[int, RoutedSide]:
    """Every routed interface behind the groups, by physdevin."""
    sides = {}
    for g in ports:
        if g.untagged is not None:
            sides[g.physdevin] = RoutedSide(g.physdevin, g, 0, g.interface, g.untagged)
        for vlan in g.vlans:
            if vlan.physdevin is not None:
                sides[vlan.physdevin] = RoutedSide(vlan.physdevin, g, vlan.id, vlan.interface, 0)
    return sides


@dataclass(frozen=True)
class TLSConfig:
    private_key: str
    certificate: str
    ca_certificate: str | None = None


def _subif(key: str, parent: str | None, vid: int) -> str | None:
    """A VLAN's default sub-interface name: its group's bridge_port (or routed interface), a dot, the id."""
    return None if parent is None else v.ifname(key, f"{parent}.{vid}")


def _named(key: str, vlan: Vlan, group: dict[str, Any]) -> Vlan:
    """A VLAN with its sub-interface's default name filled in (none without its group's)."""
    if vlan.physdevin is not None:
        if vlan.interface is not None:
            return vlan
        return dataclasses.replace(vlan, interface=_subif(f"{key}.interface", group.get("interface"), vlan.id))
    if vlan.bridge_port is not None:
        return vlan
    return dataclasses.replace(vlan, bridge_port=_subif(f"{key}.bridge_port", group.get("bridge_port"), vlan.id))


_QINQ = ("stacked tags (QinQ) are not supported: OpenFlow 1.3 matches the outer tag only, and a Linux bridge "
         "forwards the inner tag unjudged")


def vlan_id(key: str, value: Any) -> int:
    if isinstance(value, list):
        raise ConfigError(key, _QINQ)
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        raise ConfigError(key, "VLAN 0 is the 802.1p priority tag, not a VLAN; priority-tagged frames are dropped "
                          "and counted. To shunt untagged traffic set \"untagged\": true")
    if isinstance(value, int) and not isinstance(value, bool) and not 1 <= value <= 4094:
        raise ConfigError(key, f"{value} is reserved by IEEE 802.1Q; VLAN ids are 1-4094" if value == 4095
                          else f"{value} is not a VLAN id; VLAN ids are 1-4094")
    return v.integer(1, 4094)(key, value)


def _zone(key: str, value: Any) -> int:
    if value == 0 and not isinstance(value, bool):
        raise ConfigError(key, "zone 0 is the untagged frames'; give 1-65535")
    return v.integer(1, 65535)(key, value)


VLAN = v.Table("ports[].vlans[]", "A VLAN of a port group's trunk, when it needs more than its id.", {
    "id": v.Key(v.Check(vlan_id, "integer", "1-4094"), "The VLAN id on this side (its fast port and slow link)."),
    "zone": v.Key(v.Check(_zone, "integer", "1-65535"), "The conntrack zone the firewall bridges it in: the "
                  "same zone on another port group is the other side of the bridge (a translated VLAN when the "
                  "ids differ); each once in a group.", default="the id"),
    "bridge_port": v.Key(v.ifname, "The firewall's sub-interface that serves it, for `nfshunt iptables`; each "
                         "once, across all switches.", default="the group's `bridge_port`, a dot, the id"),
    "physdevin": v.Key(v.integer(1, markcodec.MAX_PORT), "With `forwarding` `routed` (required there): this "
                       "VLAN's routed sub-interface is an interface of its own to the firewall, named by this "
                       "number in the mark's port fields; each once, across all switches (no `zone`: a router "
                       "routes its VLANs in one zone)."),
    "interface": v.Key(v.ifname, "With `forwarding` `routed`: the firewall's routed sub-interface for this VLAN, "
                       "for `nfshunt iptables`; each once.", default="the group's `interface`, a dot, the id"),
}, required=("id",), record=Vlan)

_ROUTED_KEYS = ("physdevin", "interface")
_BRIDGED_KEYS = ("zone", "bridge_port")


def _vlan(key: str, value: Any) -> Vlan:
    """One entry of `vlans` (its sub-interface None: the group's default)."""
    if isinstance(value, dict) and "tpid" in value:
        raise ConfigError(f"{key}.tpid", _QINQ)
    if not isinstance(value, dict):
        vid = vlan_id(key, value)
        return Vlan(vid, vid)
    given = VLAN.read(key, value)
    routed, bridged = ([k for k in keys if k in given] for keys in (_ROUTED_KEYS, _BRIDGED_KEYS))
    if routed and bridged:
        raise ConfigError(f"{key}.{bridged[0]}", f"a routed VLAN ({routed[0]} given) has no {bridged[0]}: a "
                          "router routes all its VLANs in one conntrack zone and has no bridge; give "
                          "\"physdevin\" and \"interface\" (routed) or \"zone\" and \"bridge_port\" (bridged)")
    if routed and "physdevin" not in given:
        raise ConfigError(f"{key}.physdevin", "required with interface: a routed VLAN is an interface of its own, "
                          "named in the mark by its own number (1-15); a bridged VLAN names its bridge_port")
    if routed:
        return Vlan(given["id"], 0, physdevin=given["physdevin"], interface=given.get("interface"))
    return Vlan(given["id"], given.get("zone", given["id"]), given.get("bridge_port"))


@v.takes("list", "VLAN ids 1-4094, or objects `{\"id\", \"zone\" (1-65535), \"bridge_port\"}` (bridged) or "
         "`{\"id\", \"physdevin\", \"interface\"}` (routed); each id and zone once")
def vlan_list(key: str, value: Any) -> tuple[Vlan, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(key, "expected a non-empty list of VLAN ids (or leave `vlans` out: untagged only)")
    out = []
    seen: dict[int, int] = {}
    for i, raw in enumerate(value):
        vlan = _vlan(f"{key}[{i}]", raw)
        if vlan.id in seen:
            raise ConfigError(f"{key}[{i}]", f"VLAN {vlan.id} is already listed as vlans[{seen[vlan.id]}]")
        seen[vlan.id] = i
        out.append(vlan)
    return tuple(out)


@v.takes("boolean or object", "`true`, `false`, or `{\"zone\": N}` (1-65535)")
def untagged(key: str, value: Any) -> int | None:
    if isinstance(value, dict):
        v.check_names(key, value, ("zone",), ("zone",))
        return _zone(f"{key}.zone", value["zone"])
    return 0 if v.boolean(key, value) else None


PORT_GROUP = v.Table("ports[]", "A port group: one external port of the switch, the switch port cabled to the "
                     "firewall bridge's port that serves it, and that bridge port's number in the mark.", {
    "fast": v.Key(v.integer(1, 0xFFFFFF00), "The switch's external port (OpenFlow port number)."),
    "slow": v.Key(v.integer(1, 0xFFFFFF00), "The switch port cabled to the firewall bridge's port that serves "
                  "`fast`; not the same as `fast`."),
    "physdevin": v.Key(v.integer(1, markcodec.MAX_PORT), "The bridge port's number in the connection mark's "
                       "ingress and egress fields; each once, across all switches."),
    "bridge_port": v.Key(v.ifname, "The bridge port's interface name, for `nfshunt iptables` (its physdev "
                         "rules); each once, across all switches."),
    "interface": v.Key(v.ifname, "With `forwarding` `routed`, in place of `bridge_port`: the firewall's routed "
                       "interface cabled to `slow`, for `nfshunt iptables` (its -i/-o rules); each once, across "
                       "all switches."),
    "vlans": v.Key(vlan_list, "The VLANs this side's trunk carries "
                   "(`fast` and the slow link alike), each an id or `{\"id\", \"zone\", \"bridge_port\"}`: the "
                   "conntrack zone the firewall bridges it in (default: the id; the same zone on another group "
                   "is the other side of that VLAN's bridge, its id may differ) and its sub-interface (default: "
                   "`bridge_port.id`). Frames of other VLANs are dropped and counted. With `forwarding` `routed` "
                   "each is `{\"id\", \"physdevin\", \"interface\"}`: an interface of the router's own."),
    "untagged": v.Key(untagged, "Whether untagged frames of this side are carried: `true` (bridged untagged, "
                      "zone 0), `false` (dropped and counted), or `{\"zone\": N}` (bridged into VLAN zone N "
                      "on the other side).", default="true without `vlans`, false with"),
}, required=("fast", "slow", "physdevin"), record=PortGroup)


def port_group(key: str, value: Any) -> PortGroup:
    values = PORT_GROUP.read(key, value)
    vlans: tuple[Vlan, ...] = tuple(_named(f"{key}.vlans[{i}]", vlan, values)
                                    for i, vlan in enumerate(values.pop("vlans", ())))
    routed = [vlan.physdevin is not None for vlan in vlans]
    if any(routed) and not all(routed):
        i = routed.index(False)
        raise ConfigError(f"{key}.vlans[{i}]", "the other VLANs of this trunk are routed (each names its "
                          "physdevin): give this one a physdevin of its own too")
    values.setdefault("untagged", None if vlans else 0)
    group = PortGroup(**values, vlans=vlans)
    if group.bridge_port is not None and group.interface is not None:
        raise ConfigError(f"{key}.interface", "a port group names the firewall's bridge port (bridged) or its "
                          "routed interface (routed), not both")
    if group.fast == group.slow:
        raise ConfigError(f"{key}.slow", f"the same switch port {group.slow} as 'fast'")
    zones: dict[int, str] = {} if group.untagged is None else {group.untagged: "the untagged frames'"}
    for i, vlan in enumerate(vlans):
        if vlan.physdevin is not None:
            if group.untagged not in (None, 0):
                raise ConfigError(f"{key}.untagged", "a routed trunk's untagged frames are routed in the "
                                  "router's one zone with its VLANs: `true` or `false`, not a zone")
            continue
        if vlan.zone in zones:
            raise ConfigError(f"{key}.vlans[{i}].zone", f"zone {vlan.zone} is already {zones[vlan.zone]} on this "
                              "port group; a zone may name one VLAN per trunk, or the controller cannot tell "
                              "which tag to put back")
        zones[vlan.zone] = f"VLAN {vlan.id}'s"
    return group


FORWARDING = ("bridged", "routed")


@v.takes("list of objects", "port groups (`ports[]`), at least one; each switch port once")
def ports(key: str, value: Any) -> tuple[PortGroup, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(key, "expected a non-empty list of port groups")
    groups = tuple(port_group(f"{key}[{i}]", g) for i, g in enumerate(value))
    unique_bridge_ports([(f"{key}[{i}]", g) for i, g in enumerate(groups)])
    seen: dict[tuple[str, Any], int] = {}
    for i, g in enumerate(groups):
        for attr in ("fast", "slow"):
            port = getattr(g, attr)
            if ("switch", port) in seen:
                raise ConfigError(f"{key}[{i}].{attr}",
                                  f"switch port {port} is already used by {key}[{seen[('switch', port)]}]; to "
                                  "carry several VLANs on one switch port list them in one group's \"vlans\"")
            seen[("switch", port)] = i
    return groups


def unique_bridge_ports(groups: list[tuple[str, PortGroup]]) -> None:
    """physdevin and bridge_port name the firewall's bridge ports: each once, whichever
    switch its group is on (groups: each with the key path it was read from)."""
    seen: dict[tuple[str, Any], str] = {}
    for path, g in groups:
        named = [(f"{path}.{attr}", attr, getattr(g, attr)) for attr in ("physdevin", "bridge_port", "interface")]
        named += [(f"{path}.vlans[{i}].{attr}", attr, getattr(vlan, attr)) for i, vlan in enumerate(g.vlans)
                  for attr in ("physdevin", "bridge_port", "interface")]
        for at, attr, value in named:
            if value is not None and (attr, value) in seen:
                raise ConfigError(at, f"{value!r} is already used by {seen[(attr, value)]}")
            seen[(attr, value)] = path


@v.takes("list of strings", "OpenFlow versions, each once: " + ", ".join(f"`{n}`" for n in OPENFLOW_VERSIONS))
def versions(key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(key, "expected a non-empty list such as [\"1.0\", \"1.3\"]")
    for i, version in enumerate(value):
        v.choice(tuple(OPENFLOW_VERSIONS))(f"{key}[{i}]", version)
    if len(set(value)) != len(value):
        raise ConfigError(key, "lists a version twice")
    return tuple(value)


TLS = v.Table("tls", "The OpenFlow listener's TLS.", {
    "private_key": v.Key(v.existing_file, "The controller's private key (PEM)."),
    "certificate": v.Key(v.existing_file, "The controller's certificate (PEM), which the switch checks."),
    "ca_certificate": v.Key(v.existing_file, "A CA the switch's certificate must be signed by; without it the "
                            "switch's certificate is not verified (check-config warns)."),
}, required=("private_key", "certificate"), record=TLSConfig)


@v.takes("object or null", "see `tls`; null: plain TCP")
def tls(key: str, value: Any) -> TLSConfig | None:
    if value is None:
        return None
    return TLSConfig(**TLS.read(key, value))


# What each entry of `switches` may set; the other keys are the controller's. At the top
# level the same keys are the one switch's, or every switch's default.
PER_SWITCH: dict[str, v.Key] = {
    "datapath_id": v.Key(v.dpid, "Serve only the switch of this datapath id (others are refused at the "
                         "handshake); unset, the first switch to connect is served (check-config warns).",
                         default="null (any)"),
    "ports": v.Key(ports, "The switch's port groups (`ports[]`).", default="required, unless `switches` is "
                   "given"),
    "switch_addresses": v.Key(v.networks, "Addresses or networks the switch may connect from; a connection "
                              "from elsewhere is closed before the OpenFlow handshake. Empty: any (check-config "
                              "warns when there is no TLS either)."),
    "packet_in_rate": v.Key(v.integer(0, 1_000_000), "OpenFlow 1.3: packet-ins a second the switch may send "
                            "(its controller meter, set at every connect); 0: not limited."),
    "flow_mod_rate": v.Key(v.integer(0, 10_000_000), "Flow-mods a second the switch is sent; installs beyond it "
                           "queue, their connections stay on the slow path meanwhile. Removals never wait. "
                           "0: not limited."),
    "install_queue": v.Key(v.integer(1, 1_000_000), "Installs that may wait for `flow_mod_rate`; beyond it they "
                           "wait for room as for a full table (counted, never lost)."),
    "max_shunts": v.Key(v.integer(0, 10_000_000), "Most shunt and block pairs on the switch at once: shunts "
                        "beyond it wait on the slow path, a block evicts the newest shunt. 0: derived from the "
                        "table size the switch reports at connect (what fits after the defaults)."),
    "flow_layout": v.Key(v.choice(("auto", "single", "pipeline")), "Where a TCP shunt's FIN/RST catchers "
                         "live: `single` (4 a connection beside its 2 flows in table 0), `pipeline` (OpenFlow 1.3: "
                         "shared catchers per port group in table 1), `auto` (pipeline when the switch reports at "
                         "least 2 tables, single with `experimental_routed`)."),
    "confirm": v.Key(v.choice(("barrier", "counters", "delay")), "When a shunt's conntrack entry may go: at the "
                     "barrier reply (`barrier`: Open vSwitch), once its flows' packet counters rose (`counters`: "
                     "hardware; OpenFlow 1.3 only), or `confirm_delay` after the barrier (`delay`); then `drain`."),
    "confirm_delay": v.Key(v.number(0, 10), "Seconds after the barrier reply, for `confirm` `delay`."),
    "drain": v.Key(v.number(0, 5), "Seconds more before the entry goes, for packets still queued on the slow path."),
    "forwarding": v.Key(v.choice(FORWARDING), "How the firewall forwards between the port groups: `bridged` (a "
                        "transparent bridge, `bridge_port`s) or `routed` (it routes between its interfaces, "
                        "`interface`s; OpenFlow 1.3). Routed connections are shunted only with `experimental_routed`; "
                        "without it each is left on the firewall and counted (docs/routed.md). The same for "
                        "every switch."),
    "experimental_routed": v.Key(v.boolean, "With `forwarding` `routed`: shunt routed connections with the "
                                 "router's rewrite (source MAC of its egress interface, the next hop's MAC "
                                 "from its neighbour table, TTL - 1; an expiring TTL handed to the firewall) "
                                 "and a NAT'd one with the firewall's translation too (addresses and ports, "
                                 "its conntrack entry kept), following the firewall's route and neighbour "
                                 "tables (a new MAC rewrites the pairs in place; a failed neighbour, a moved, "
                                 "lost or blackholed route hands them back; a neighbour flapping is held down "
                                 "30 s). A restart or reconnect adopts the routed pairs it reads back whose "
                                 "next hops the tables still give (a changed MAC rewritten in place, the "
                                 "others handed back), a NAT pair while its entry has the same tuples (or, "
                                 "made anew by a pair's takeover, the same decision). Experimental "
                                 "(docs/design/routed.md); `flow_layout` `auto` is `single` with it, "
                                 "`pipeline` when asked."),
}


@dataclass(frozen=True)
class SwitchConfig:
    """One served switch's own keys (PER_SWITCH): the top level's when the config names one
    switch, else an entry of `switches` (the top level's value where the entry says nothing).
    The controller's keys are settings.Config's: each key has one place to be read from."""
    ports: tuple[PortGroup, ...]
    datapath_id: int | None = None
    switch_addresses: tuple[str, ...] = ()
    packet_in_rate: int = 1000
    flow_mod_rate: int = 0
    install_queue: int = 10000
    max_shunts: int = 0
    # Where a TCP shunt's FIN/RST catchers live: "single" (4 per connection beside its 2
    # flows in table 0), "pipeline" (OpenFlow 1.3: table 0's flows go on to table 1, where 5
    # shared flows per port group catch and output), "auto" (pipeline if the switch has 2 tables).
    flow_layout: str = "auto"
    # When a shunt's conntrack entry may go (the switch forwards on its flows): "barrier"
    # (the barrier reply, right for Open vSwitch), "counters" (its flows' packet counters
    # rose) or "delay" (confirm_delay after the barrier); then `drain` more for packets
    # still queued on the slow path.
    confirm: str = "barrier"
    confirm_delay: float = 0.5
    drain: float = 0.05
    forwarding: str = "bridged"  # "bridged" | "routed" (FORWARDING): how the firewall forwards between the groups
    experimental_routed: bool = False  # routed shunts, NAT too (docs/design/routed.md slices 2, 4), not refusals
    at: str = field(default="", compare=False)  # where its keys are in the config: "" or "switches[i]."
    by_physdevin: dict[int, PortGroup] = field(init=False, compare=False, repr=False)
    # Routed: each interface of the firewall by the physdevin the mark names it by, and by
    # (fast port, tag) as a flow read back names it; empty when bridged.
    sides: dict[int, RoutedSide] = field(init=False, compare=False, repr=False)
    side_at: dict[tuple[int, int], RoutedSide] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        sides = routed_sides(self.ports) if self.forwarding == "routed" else {}
        object.__setattr__(self, "sides", sides)
        object.__setattr__(self, "side_at", {(s.group.fast, s.vid): s for s in sides.values()})
        object.__setattr__(self, "by_physdevin", {**{s.physdevin: s.group for s in sides.values()},
                                                  **{g.physdevin: g for g in self.ports}})


@v.takes("string or integer", "a datapath id: up to 16 hex digits (0x optional), up to 8 colon-separated bytes, "
         "or an integer")
def _datapath_id(key: str, value: Any) -> int:
    dpid = v.dpid(key, value)
    if dpid is None:
        raise ConfigError(key, "each of several switches needs its datapath id")
    return dpid


SWITCH = v.Table("switches[]", "One of several switches this controller serves, all cabled to the same firewall "
                 "bridge.", {
                     **PER_SWITCH,
                     "datapath_id": v.Key(_datapath_id, "This switch's datapath id; each once."),
                 }, required=("datapath_id", "ports"), inherits="the top-level key's value", record=SwitchConfig)


@v.takes("list of objects", "switches (`switches[]`), at least one; each datapath id once")
def switches(key: str, value: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(key, "expected a non-empty list of switches ({\"datapath_id\": ..., \"ports\": [...]})")
    entries = tuple(SWITCH.read(f"{key}[{i}]", entry) for i, entry in enumerate(value))
    seen: dict[int, str] = {}
    for i, entry in enumerate(entries):
        dpid = entry["datapath_id"]
        if dpid in seen:
            raise ConfigError(f"{key}[{i}].datapath_id", f"{dpid:016x} is already used by {seen[dpid]}")
        seen[dpid] = f"{key}[{i}]"
    unique_bridge_ports([(f"{key}[{i}].ports[{j}]", g) for i, entry in enumerate(entries)
                         for j, g in enumerate(entry["ports"])])
    return entries


def check(sw: SwitchConfig, openflow_versions: tuple[str, ...], tcp_teardown: bool) -> None:
    """What one switch's keys must agree on, with the controller's OpenFlow versions and
    TCP teardown (its key paths under sw.at)."""
    prefix = sw.at
    forwarding_check(sw, openflow_versions)
    _check_vlans(sw, openflow_versions)
    if sw.confirm == "counters" and "1.0" in openflow_versions:
        raise ConfigError(f"{prefix}confirm", "counters needs OpenFlow 1.3 (flow stats by cookie): set "
                          "openflow_versions to [\"1.3\"], or use delay")
    if sw.flow_layout == "pipeline":
        if "1.3" not in openflow_versions:
            raise ConfigError(f"{prefix}flow_layout", "pipeline needs OpenFlow 1.3 (goto-table): add \"1.3\" to "
                              "openflow_versions, or use single")
        if not tcp_teardown:
            raise ConfigError(f"{prefix}flow_layout", "pipeline holds the TCP teardown catchers, and tcp_teardown "
                              "is false: use single or auto")


def forwarding_check(sw: SwitchConfig, openflow_versions: tuple[str, ...]) -> None:
    """A routed switch's groups name interfaces, a bridged one's bridge ports; routed needs
    OpenFlow 1.3 (dec_ttl, set_field, invalid-TTL packet-ins: docs/design/routed.md)."""
    routed = sw.forwarding == "routed"
    for i, g in enumerate(sw.ports):
        if routed and g.vlans and not g.routed_vlans:
            raise ConfigError(f"{sw.at}ports[{i}].vlans[0]", "a routing firewall's VLAN is an interface of its own: "
                              "give each {\"id\", \"physdevin\", \"interface\"} (docs/routed.md, \"VLAN trunks\")")
        for j, vlan in enumerate(g.vlans):
            if routed and vlan.interface is None:
                raise ConfigError(f"{sw.at}ports[{i}].vlans[{j}].interface", "required: the firewall's routed "
                                  f"sub-interface for VLAN {vlan.id} (or give the group's \"interface\": it is "
                                  "that, a dot, the id)")
        if not routed and g.routed_vlans:
            i_vlan = next(j for j, vlan in enumerate(g.vlans) if vlan.physdevin is not None)
            raise ConfigError(f"{sw.at}ports[{i}].vlans[{i_vlan}].physdevin", "names a routed VLAN, and this "
                              "switch's forwarding is bridged: a bridged VLAN shares its group's physdevin and is "
                              "told apart by its zone; set \"forwarding\": \"routed\", or leave physdevin out")
        if routed and g.bridge_port is not None:
            raise ConfigError(f"{sw.at}ports[{i}].bridge_port", "a routing firewall has no bridge: name its routed "
                              "interface in \"interface\"")
        if not routed and g.interface is not None:
            raise ConfigError(f"{sw.at}ports[{i}].interface", "names a routed interface, and this switch's "
                              "forwarding is bridged: set \"forwarding\": \"routed\", or name the bridge port in "
                              "\"bridge_port\"")
    if sw.experimental_routed and not routed:
        raise ConfigError(f"{sw.at}experimental_routed", "shunts through a routing firewall: needs \"forwarding\": "
                          "\"routed\"")
    if routed and "1.0" in openflow_versions:
        raise ConfigError(f"{sw.at}forwarding", "routed needs OpenFlow 1.3 (dec_ttl, set_field, invalid-TTL "
                          "packet-ins): set openflow_versions to [\"1.3\"]")
def _check_vlans(sw: SwitchConfig, openflow_versions: tuple[str, ...]) -> None:
    """A zone carried with a different tag on two groups (translated, or pushed/popped) needs
    OpenFlow 1.3's set_field and push_vlan."""
    if "1.0" not in openflow_versions:
        return
    tags: dict[int, int] = {}
    for i, g in enumerate(sw.ports):
        for zone, vid in g.vid_of_zone.items():
            if tags.setdefault(zone, vid) != vid:
                at = f"{sw.at}ports[{i}]." + ("untagged" if vid == 0 else
                                              f"vlans[{[vlan.id for vlan in g.vlans].index(vid)}]")
                raise ConfigError(at, f"zone {zone} is VLAN {tags[zone] or 'untagged'} on another port group and "
                                  f"{vid or 'untagged'} here: translating VLANs needs OpenFlow 1.3 (set_field, "
                                  "push_vlan): set openflow_versions to [\"1.3\"]")


def vlan_warnings(sw: SwitchConfig) -> list[str]:
    """Zones on one port group only: bridged to nothing the switch serves, never shunted."""
    out = []
    for i, g in enumerate(sw.ports):
        for j, vlan in enumerate(g.vlans):
            if vlan.physdevin is not None:
                continue  # (a routed VLAN is routed to any other interface)
            if not any(vlan.zone in other.vid_of_zone for other in sw.ports if other is not g):
                out.append(f"{sw.at}ports[{i}].vlans[{j}]: zone {vlan.zone} is on no other port group: a VLAN "
                           "bridged to nothing is never shunted")
    return out
