"""The switch's side of the config: port groups, the OpenFlow listener's versions and TLS,
the keys each entry of `switches` may set, and what one switch's keys must agree on."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

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


@dataclass(frozen=True)
class TLSConfig:
    private_key: str
    certificate: str
    ca_certificate: str | None = None


def port_group(key: str, value: Any) -> PortGroup:
    fields = {"fast": v.integer(1, 0xFFFFFF00), "slow": v.integer(1, 0xFFFFFF00),
              "physdevin": v.integer(1, markcodec.MAX_PORT), "bridge_port": v.ifname}
    group = PortGroup(**v.read_object(key, value, fields, required=("fast", "slow", "physdevin")))
    if group.fast == group.slow:
        raise ConfigError(f"{key}.slow", f"the same switch port {group.slow} as 'fast'")
    return group


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
        for attr in ("physdevin", "bridge_port"):
            value = getattr(g, attr)
            if value is not None and (attr, value) in seen:
                raise ConfigError(f"{path}.{attr}", f"{value!r} is already used by {seen[(attr, value)]}")
            seen[(attr, value)] = path


def versions(key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(key, "expected a non-empty list such as [\"1.0\", \"1.3\"]")
    for i, version in enumerate(value):
        v.choice(tuple(OPENFLOW_VERSIONS))(f"{key}[{i}]", version)
    if len(set(value)) != len(value):
        raise ConfigError(key, "lists a version twice")
    return tuple(value)


def tls(key: str, value: Any) -> TLSConfig | None:
    if value is None:
        return None
    fields: dict[str, Callable[[str, Any], Any]] = {"private_key": v.existing_file, "certificate": v.existing_file,
                                                    "ca_certificate": v.existing_file}
    return TLSConfig(**v.read_object(key, value, fields, required=("private_key", "certificate")))


# What each entry of `switches` may set; the other keys are the controller's (or, at the
# top level, every switch's default).
PER_SWITCH: dict[str, Callable[[str, Any], Any]] = {
    "datapath_id": v.dpid,
    "ports": ports,
    "switch_addresses": v.networks,
    "packet_in_rate": v.integer(0, 1_000_000),
    "flow_mod_rate": v.integer(0, 10_000_000),
    "install_queue": v.integer(1, 1_000_000),
    "max_shunts": v.integer(0, 10_000_000),
    "flow_layout": v.choice(("auto", "single", "pipeline")),
    "confirm": v.choice(("barrier", "counters", "delay")),
    "confirm_delay": v.number(0, 10),
    "drain": v.number(0, 5),
}


def switches(key: str, value: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(key, "expected a non-empty list of switches ({\"datapath_id\": ..., \"ports\": [...]})")
    entries = tuple(v.read_object(f"{key}[{i}]", entry, PER_SWITCH, required=("datapath_id", "ports"))
                    for i, entry in enumerate(value))
    seen: dict[int, str] = {}
    for i, entry in enumerate(entries):
        dpid = entry["datapath_id"]
        if dpid is None:
            raise ConfigError(f"{key}[{i}].datapath_id", "each of several switches needs its datapath id")
        if dpid in seen:
            raise ConfigError(f"{key}[{i}].datapath_id", f"{dpid:016x} is already used by {seen[dpid]}")
        seen[dpid] = f"{key}[{i}]"
    unique_bridge_ports([(f"{key}[{i}].ports[{j}]", g) for i, entry in enumerate(entries)
                         for j, g in enumerate(entry["ports"])])
    return entries


class SwitchKeys(Protocol):
    """What check() reads of one switch's config (settings.Config)."""
    @property
    def confirm(self) -> str: ...
    @property
    def flow_layout(self) -> str: ...
    @property
    def openflow_versions(self) -> tuple[str, ...]: ...
    @property
    def tcp_teardown(self) -> bool: ...


def check(cfg: SwitchKeys, prefix: str = "") -> None:
    """What the keys of one switch's config must agree on (prefix: where its keys are)."""
    if cfg.confirm == "counters" and "1.0" in cfg.openflow_versions:
        raise ConfigError(f"{prefix}confirm", "counters needs OpenFlow 1.3 (flow stats by cookie): set "
                          "openflow_versions to [\"1.3\"], or use delay")
    if cfg.flow_layout == "pipeline":
        if "1.3" not in cfg.openflow_versions:
            raise ConfigError(f"{prefix}flow_layout", "pipeline needs OpenFlow 1.3 (goto-table): add \"1.3\" to "
                              "openflow_versions, or use single")
        if not cfg.tcp_teardown:
            raise ConfigError(f"{prefix}flow_layout", "pipeline holds the TCP teardown catchers, and tcp_teardown "
                              "is false: use single or auto")
