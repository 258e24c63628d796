"""The switch's side of the config: port groups, the OpenFlow listener's versions and TLS,
the keys each entry of `switches` may set, and what one switch's keys must agree on."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nfshunt.records import markcodec
from nfshunt.records.model import OPENFLOW_VERSIONS

from . import validate as v
from .validate import ConfigError


@dataclass(frozen=True)
class PortGroup:
    fast: int
    slow: int
    physdevin: int
    bridge_port: str | None = None
    interface: str | None = None  # routed mode (forwarding "routed"): the router's interface, not a bridge port


@dataclass(frozen=True)
class TLSConfig:
    private_key: str
    certificate: str
    ca_certificate: str | None = None


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
}, required=("fast", "slow", "physdevin"), record=PortGroup)


def port_group(key: str, value: Any) -> PortGroup:
    group = PortGroup(**PORT_GROUP.read(key, value))
    if group.bridge_port is not None and group.interface is not None:
        raise ConfigError(f"{key}.interface", "a port group names the firewall's bridge port (bridged) or its "
                          "routed interface (routed), not both")
    if group.fast == group.slow:
        raise ConfigError(f"{key}.slow", f"the same switch port {group.slow} as 'fast'")
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
                                  f"switch port {port} is already used by {key}[{seen[('switch', port)]}]")
            seen[("switch", port)] = i
    return groups


def unique_bridge_ports(groups: list[tuple[str, PortGroup]]) -> None:
    """physdevin and bridge_port name the firewall's bridge ports: each once, whichever
    switch its group is on (groups: each with the key path it was read from)."""
    seen: dict[tuple[str, Any], str] = {}
    for path, g in groups:
        for attr in ("physdevin", "bridge_port", "interface"):
            value = getattr(g, attr)
            if value is not None and (attr, value) in seen:
                raise ConfigError(f"{path}.{attr}", f"{value!r} is already used by {seen[(attr, value)]}")
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
                         "least 2 tables)."),
    "confirm": v.Key(v.choice(("barrier", "counters", "delay")), "When a shunt's conntrack entry may go: at the "
                     "barrier reply (`barrier`: Open vSwitch), once its flows' packet counters rose (`counters`: "
                     "hardware; OpenFlow 1.3 only), or `confirm_delay` after the barrier (`delay`); then `drain`."),
    "confirm_delay": v.Key(v.number(0, 10), "Seconds after the barrier reply, for `confirm` `delay`."),
    "drain": v.Key(v.number(0, 5), "Seconds more before the entry goes, for packets still queued on the slow path."),
    "forwarding": v.Key(v.choice(FORWARDING), "How the firewall forwards between the port groups: `bridged` (a "
                        "transparent bridge, `bridge_port`s) or `routed` (it routes between its interfaces, "
                        "`interface`s; OpenFlow 1.3). Routed connections are not shunted yet: each is left on the "
                        "firewall and counted (docs/design/routed.md). The same for every switch."),
    "experimental_routed": v.Key(v.boolean, "With `forwarding` `routed`: shunt routed connections (not NAT) with "
                                 "the router's rewrite (source MAC of its egress interface, the next hop's MAC "
                                 "from its neighbour table, TTL - 1). Experimental: TTL expiry, table changes "
                                 "and NAT are not handled yet (docs/design/routed.md); needs `flow_layout` "
                                 "`single`."),
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
    experimental_routed: bool = False  # routed shunts (docs/design/routed.md slice 2), not only counted refusals
    at: str = field(default="", compare=False)  # where its keys are in the config: "" or "switches[i]."
    by_physdevin: dict[int, PortGroup] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_physdevin", {g.physdevin: g for g in self.ports})


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
    if sw.experimental_routed and sw.flow_layout != "single":
        raise ConfigError(f"{sw.at}experimental_routed", "routed shunts are built in the single flow layout only: "
                          "set flow_layout to single")
    if routed and "1.0" in openflow_versions:
        raise ConfigError(f"{sw.at}forwarding", "routed needs OpenFlow 1.3 (dec_ttl, set_field, invalid-TTL "
                          "packet-ins): set openflow_versions to [\"1.3\"]")
