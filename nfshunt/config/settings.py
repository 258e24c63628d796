"""Typed configuration: the original nfshunt.json plus NFShunt's newer keys.

Every problem is reported as a ConfigError naming the key path and what is wrong,
before anything touches iptables or the switch. Unknown keys are errors: a typo in a
firewall component's config must not silently fall back to a default.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any, Callable

from nfshunt.records import markcodec
from nfshunt.records.model import OPENFLOW_VERSIONS, Action

from . import jsonfile, static
from .validate import (
    ConfigError,
    _address,
    _bool,
    _choice,
    _dir_path,
    _dpid,
    _file,
    _ifname,
    _int,
    _log_path,
    _networks,
    _number,
    _object,
    _optional,
    _path,
    _socket_path,
    _str,
    _type_name,
)

ACTIONS = tuple(a.value for a in Action)  # ("ignore", "shunt", "block")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")


DEFAULT_CONTROL_SOCKET = "/run/nfshunt/nfshunt.sock"
MAX_CONFIG_BYTES = 1 << 20  # a config is a few KB; more is a wrong file
MAX_IDS_EXPIRE = 30 * 86400  # the longest hard expiry of an IDS rule: a month


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


@dataclass(frozen=True)
class PairConfig:
    """One controller of an active-backup firewall pair (see nfshunt/roles.py)."""
    state_file: str  # the role and generation this controller last took (survives restarts)
    start_role: str = "backup"  # the role before the state file exists
    role_check_interval: float = 1.0  # seconds between a master's role queries (on the 1 s tick)
    # keepalived's VRRP instances whose state changes move this controller (nfshunt-notify-fifo
    # asks for them); the others (a gateway address's, say) are not NFShunt's
    vrrp_instances: tuple[str, ...] = ("NFSHUNT",)


@dataclass(frozen=True)
class IdsTLS:
    """The IDS API's TLS: its certificate and key; client_ca: client certificates it
    accepts (then a client is named by its certificate's common name)."""
    certificate: str
    private_key: str
    client_ca: str | None = None


@dataclass(frozen=True)
class MayShunt:
    """Which connections an IDS may shunt (`ids.may_shunt`): one whose server (the end it
    was opened to: its conntrack entry's original destination) is inside one of the
    prefixes and, when ports are listed, listens on a port inside one of the port ranges
    (ids/rules.serves). Empty (the default): none."""
    prefixes: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    ports: tuple[tuple[int, int], ...] = ()  # inclusive ranges; empty: any port


IDS_STATE_FILE = "ids-rules.json"  # under state_dir unless ids.state_file names another


@dataclass(frozen=True)
class IdsConfig:
    """The IDS request API (ids_api.py), off unless the config has an `ids` section."""
    listen_address: str = "127.0.0.1"
    listen_port: int = 9754
    token_file: str | None = None  # "<client> <token>" lines (or one bare token: client "ids"), mode 0600
    tls: IdsTLS | None = None
    may_shunt: MayShunt = MayShunt()
    max_rules: int = 10000  # active IDS rules, all clients together; more: `error: full`
    rate_limit: int = 2000  # requests a second of one authenticated client (a second's worth may come at once)
    rate_limit_unauthenticated: int = 20  # failed logins a second of one client (an address; a local user)
    max_body_bytes: int = 16384  # a rule's body is ~300 bytes
    max_prefix: dict[int, int] = field(default_factory=lambda: {4: 16, 6: 48})  # widest address block
    max_connections: int = 64  # open at once; each holds one thread (a slow client holds only its own)
    max_connections_per_client: int = 16  # of them, open at once from one client (an address; a local user)
    answer_timeout: float = 5.0  # seconds an add may wait for the switch before it is answered pending
    default_expire: int = 3600  # for SciPass's bodies, which name no expiry
    state_file: str = ""  # set from state_dir when not configured
    user: str = "nfshunt-ids"  # the API's process runs as this user, with no capability (ids/confine.py)
    shared_whitelists: bool = False  # a whitelist exempts from every client's blocks (else its own client's)


@dataclass(frozen=True)
class Config:
    ports: tuple[PortGroup, ...]
    mark_actions: dict[int, Action]
    delete_flows_on_startup: bool = True
    delete_flows_on_shutdown: bool = True
    default_shunt_timeout: int = 10
    default_block_timeout: int = 10
    default_no_shunting: bool = True
    delete_foreign_flows_on_startup: bool = False
    openflow_versions: tuple[str, ...] = ("1.0", "1.3")
    listen_address: str = "0.0.0.0"
    listen_port: int = 6653
    tls: TLSConfig | None = None
    datapath_id: int | None = None
    switch_addresses: tuple[str, ...] = ()
    echo_interval: float = 0.4
    echo_misses: int = 3
    packet_in_rate: int = 1000
    flow_mod_rate: int = 0
    install_queue: int = 10000
    max_block_share: float = 0.5
    default_priority: int = 100
    shunt_priority: int = 33000
    block_priority: int = 33100
    max_shunts: int = 0
    # The kernel charges ~1.3 KB a queued event and doubles this (SO_RCVBUFFORCE): 128 MiB
    # holds a 100,000-entry burst and its deletes' events, taken only while events wait.
    # A smaller buffer overflows, and each overflow costs a dump of the whole table.
    netlink_rcvbuf: int = 128 * 1024 * 1024
    tcp_teardown: bool = True
    # Where a TCP shunt's FIN/RST catchers live: "single" (4 per connection beside its 2
    # flows in table 0), "pipeline" (OpenFlow 1.3: table 0's flows go on to table 1, where 5
    # shared flows per port group catch and output), "auto" (pipeline if the switch has 2 tables).
    flow_layout: str = "auto"
    rst_grace: float = 0.5
    # When a shunt's conntrack entry may go (the switch forwards on its flows): "barrier"
    # (the barrier reply, right for Open vSwitch), "counters" (its flows' packet counters
    # rose) or "delay" (confirm_delay after the barrier); then `drain` more for packets
    # still queued on the slow path.
    confirm: str = "barrier"
    confirm_delay: float = 0.5
    drain: float = 0.05
    control_socket: str | None = DEFAULT_CONTROL_SOCKET
    metrics_address: str | None = None
    metrics_port: int = 9753
    audit_log: str | None = None
    accounting_log: str | None = None  # a record (JSON line) for each pair that leaves the switch (flowrecords.py)
    # Where the controller keeps what must outlive it: the fingerprint of the policy the
    # switch's pairs were decided under (policy_state.py).
    state_dir: str = "/var/lib/nfshunt"
    log_level: str = "INFO"
    log_format: str = "text"
    bridge: str | None = None
    pair: PairConfig | None = None
    # Several switches (`switches`): one Config per switch, each with that switch's
    # datapath_id, ports and overrides; `ports` above then holds every switch's groups
    # (the firewall's bridge ports, for the iptables plumbing). Empty: one switch, this one.
    switches: tuple["Config", ...] = ()
    # Engineered streams on the fast path from their first frame (static.py).
    static_shunts: tuple[static.StaticShunt, ...] = ()
    static_shunt_max_prefix: dict[int, int] = field(default_factory=lambda: {4: 24, 6: 64})
    static_priority: int = 33050
    ids: IdsConfig | None = None  # the IDS request API; None: off
    by_physdevin: dict[int, PortGroup] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self.by_physdevin.update({p.physdevin: p for p in self.ports})

    @property
    def served(self) -> tuple["Config", ...]:
        """The config of each switch this controller serves (itself when there is one)."""
        return self.switches or (self,)

    @property
    def ofp_versions(self) -> list[int]:
        return sorted(OPENFLOW_VERSIONS[v] for v in self.openflow_versions)

    def security_warnings(self) -> list[str]:
        """What makes the OpenFlow port trust more than the switch (check-config, start-up)."""
        out = []
        loopback = ipaddress.ip_address(self.listen_address).is_loopback
        if self.tls is None and not loopback:
            out.append(f"the OpenFlow listener on {self.listen_address} has no TLS: any host that reaches "
                       f"port {self.listen_port} can pose as the switch; set 'tls' (with ca_certificate)")
            if not all(sw.switch_addresses for sw in self.served):
                out.append("no 'switch_addresses': connections are accepted from any address")
        if self.tls is not None and self.tls.ca_certificate is None:
            out.append("tls has no ca_certificate: the switch's certificate is not verified")
        if self.datapath_id is None and not self.switches:
            out.append("no 'datapath_id': the first switch to connect is served")
        return out

    def action_for(self, number: int) -> Action | None:
        return self.mark_actions.get(number)


def _port_group(key: str, value: Any) -> PortGroup:
    fields = {"fast": _int(1, 0xFFFFFF00), "slow": _int(1, 0xFFFFFF00),
              "physdevin": _int(1, markcodec.MAX_PORT), "bridge_port": _ifname}
    group = PortGroup(**_object(key, value, fields, required=("fast", "slow", "physdevin")))
    if group.fast == group.slow:
        raise ConfigError(f"{key}.slow", f"the same switch port {group.slow} as 'fast'")
    return group


def _ports(key: str, value: Any) -> tuple[PortGroup, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(key, "expected a non-empty list of port groups")
    groups = tuple(_port_group(f"{key}[{i}]", v) for i, v in enumerate(value))
    _unique_bridge_ports([(f"{key}[{i}]", g) for i, g in enumerate(groups)])
    seen: dict[tuple[str, Any], int] = {}
    for i, g in enumerate(groups):
        for attr in ("fast", "slow"):
            v = getattr(g, attr)
            if ("switch", v) in seen:
                raise ConfigError(f"{key}[{i}].{attr}",
                                  f"switch port {v} is already used by {key}[{seen[('switch', v)]}]")
            seen[("switch", v)] = i
    return groups


def _unique_bridge_ports(groups: list[tuple[str, PortGroup]]) -> None:
    """physdevin and bridge_port name the firewall's bridge ports: each once, whichever
    switch its group is on (groups: each with the key path it was read from)."""
    seen: dict[tuple[str, Any], str] = {}
    for path, g in groups:
        for attr in ("physdevin", "bridge_port"):
            v = getattr(g, attr)
            if v is not None and (attr, v) in seen:
                raise ConfigError(f"{path}.{attr}", f"{v!r} is already used by {seen[(attr, v)]}")
            seen[(attr, v)] = path


def _mark_actions(key: str, value: Any) -> dict[int, Action]:
    if not isinstance(value, dict) or not value:
        raise ConfigError(key, "expected a non-empty object mapping numbers to actions")
    result: dict[int, Action] = {}
    for number, action in value.items():
        sub = f"{key}.{number}"
        if not (isinstance(number, str) and re.fullmatch(r"0|[1-9][0-9]?", number, re.ASCII)
                and int(number) <= markcodec.NIBBLE):
            raise ConfigError(sub, f"{number!r} is not an action number 0-15 (decimal, no leading zero)")
        result[int(number)] = Action(_choice(ACTIONS)(sub, action))  # an enum from here on
    return result


def _versions(key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(key, "expected a non-empty list such as [\"1.0\", \"1.3\"]")
    for i, v in enumerate(value):
        _choice(tuple(OPENFLOW_VERSIONS))(f"{key}[{i}]", v)
    if len(set(value)) != len(value):
        raise ConfigError(key, "lists a version twice")
    return tuple(value)


def _tls(key: str, value: Any) -> TLSConfig | None:
    if value is None:
        return None
    fields: dict[str, Callable[[str, Any], Any]] = {"private_key": _file, "certificate": _file,
                                                    "ca_certificate": _file}
    return TLSConfig(**_object(key, value, fields, required=("private_key", "certificate")))


def _pair(key: str, value: Any) -> PairConfig | None:
    if value is None:
        return None
    fields = {"state_file": _log_path, "start_role": _choice(("backup", "master")),
              "role_check_interval": _number(1, 60), "vrrp_instances": _vrrp_instances}
    return PairConfig(**_object(key, value, fields, required=("state_file",)))


# keepalived's instance names as its notify FIFO writes them (INSTANCE "NAME" STATE PRIORITY)
# and nfshunt-notify-fifo reads them: one word, nothing a shell or the quotes would change.
_VRRP_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}", re.ASCII)


def _vrrp_instances(key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(key, "expected a non-empty list of keepalived VRRP instance names, such as [\"NFSHUNT\"]")
    for i, name in enumerate(value):
        if not isinstance(name, str) or not _VRRP_NAME.fullmatch(name):
            raise ConfigError(f"{key}[{i}]", f"{name!r} is not a VRRP instance name as keepalived's notify FIFO "
                              "writes it (1-64 letters, digits, '_', '.', '-'; the name after vrrp_instance)")
    if len(set(value)) != len(value):
        raise ConfigError(key, "names an instance twice")
    return tuple(value)


def _ids_tls(key: str, value: Any) -> IdsTLS | None:
    if value is None:
        return None
    fields: dict[str, Callable[[str, Any], Any]] = {"certificate": _file, "private_key": _file, "client_ca": _file}
    return IdsTLS(**_object(key, value, fields, required=("certificate", "private_key")))


def _port_range(key: str, value: Any) -> tuple[int, int]:
    """5201, or "50000-51000"."""
    if isinstance(value, str):
        m = re.fullmatch(r"([0-9]{1,5})-([0-9]{1,5})", value, re.ASCII)
        if not m:
            raise ConfigError(key, f"{value!r} is not a port or a range \"low-high\"")
        lo, hi = (_int(1, 65535)(key, int(g)) for g in m.groups())
        if lo > hi:
            raise ConfigError(key, f"{value!r}: the low end is above the high end")
        return lo, hi
    port = _int(1, 65535)(key, value)
    return port, port


def _may_shunt(key: str, value: Any) -> MayShunt:
    def prefixes(k: str, v: Any) -> tuple[Any, ...]:
        return tuple(ipaddress.ip_network(n, strict=False) for n in _networks(k, v))

    def ports(k: str, v: Any) -> tuple[tuple[int, int], ...]:
        if not isinstance(v, list):
            raise ConfigError(k, f"expected a list of ports or ranges, got {_type_name(v)}")
        return tuple(_port_range(f"{k}[{i}]", p) for i, p in enumerate(v))
    return MayShunt(**_object(key, value, {"prefixes": prefixes, "ports": ports}))


def _ids_max_prefix(key: str, value: Any) -> dict[int, int]:
    given = _object(key, value, {"ipv4": _int(0, 32), "ipv6": _int(0, 128)})
    default = IdsConfig().max_prefix
    return {4: given.get("ipv4", default[4]), 6: given.get("ipv6", default[6])}


def _token_file(key: str, value: Any) -> str:
    """A token file readable by its owner only: a token others can read is no secret."""
    value = _path(key, value)
    try:
        st = os.stat(value)
    except OSError as exc:
        raise ConfigError(key, f"cannot read {value!r}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(key, f"{value!r} is not a regular file")
    if st.st_mode & 0o077:
        raise ConfigError(key, f"{value!r} is mode {stat.S_IMODE(st.st_mode):04o}: it must be 0600 "
                          "(readable by its owner only)")
    return value


def _user(key: str, value: Any) -> str:
    """A user name (not root: the API's process must keep no privilege)."""
    value = _str(key, value)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}", value, re.ASCII):
        raise ConfigError(key, f"{value[:40]!r} is not a user name")
    if value == "root":
        raise ConfigError(key, "root: the IDS API's process parses what anyone sends and must run unprivileged")
    return value


def _ids(key: str, value: Any) -> IdsConfig | None:
    if value is None:
        return None
    fields = {"listen_address": _address, "listen_port": _int(1, 65535), "token_file": _token_file,
              "tls": _ids_tls, "may_shunt": _may_shunt, "max_rules": _int(1, 1_000_000),
              "rate_limit": _int(1, 1_000_000), "max_body_bytes": _int(1024, 1 << 20),
              "max_prefix": _ids_max_prefix, "max_connections": _int(1, 10_000),
              "answer_timeout": _number(0.1, 60), "default_expire": _int(1, MAX_IDS_EXPIRE),
              "state_file": _log_path, "user": _user, "rate_limit_unauthenticated": _int(1, 1_000_000),
              "max_connections_per_client": _int(1, 10_000), "shared_whitelists": _bool}
    ids = IdsConfig(**_object(key, value, fields))
    if "max_connections_per_client" in value and ids.max_connections_per_client > ids.max_connections:
        raise ConfigError(f"{key}.max_connections_per_client", f"{ids.max_connections_per_client} is over "
                          f"{key}.max_connections ({ids.max_connections})")
    if ids.tls is None and not ipaddress.ip_address(ids.listen_address).is_loopback:
        raise ConfigError(f"{key}.listen_address", f"{ids.listen_address} is not a loopback address: the "
                          f"API then needs TLS ({key}.tls), or rules and tokens cross the network in clear")
    if ids.token_file is None and (ids.tls is None or ids.tls.client_ca is None):
        raise ConfigError(f"{key}.token_file", "required: every request is authenticated, by a bearer token "
                          f"from this file or by a client certificate ({key}.tls.client_ca)")
    return ids


def _ids_port_free(cfg: Config) -> None:
    """The IDS API's port is not one the controller's other listeners bind on the same address."""
    assert cfg.ids is not None
    ids = ipaddress.ip_address(cfg.ids.listen_address)
    others = [("listen_port", cfg.listen_address, cfg.listen_port)]
    if cfg.metrics_address is not None:
        others.append(("metrics_port", cfg.metrics_address, cfg.metrics_port))
    for key, address, port in others:
        other = ipaddress.ip_address(address)
        if port == cfg.ids.listen_port and other.version == ids.version and (
                other == ids or other.is_unspecified or ids.is_unspecified):
            raise ConfigError("ids.listen_port", f"{port} is also '{key}' on {address}: one listener a port")


TOP_LEVEL: dict[str, Callable[[str, Any], Any]] = {
    "ports": _ports,
    "mark_actions": _mark_actions,
    "delete_flows_on_startup": _bool,
    "delete_flows_on_shutdown": _bool,
    "default_shunt_timeout": _int(1, 65535),
    "default_block_timeout": _int(1, 65535),
    "default_no_shunting": _bool,
    "delete_foreign_flows_on_startup": _bool,
    "openflow_versions": _versions,
    "listen_address": _address,
    "listen_port": _int(1, 65535),
    "tls": _tls,
    "datapath_id": _dpid,
    "switch_addresses": _networks,
    "echo_interval": _number(0.1, 60),
    "echo_misses": _int(1, 100),
    "packet_in_rate": _int(0, 1_000_000),
    "flow_mod_rate": _int(0, 10_000_000),
    "install_queue": _int(1, 1_000_000),
    "max_block_share": _number(0, 1),
    "default_priority": _int(1, 65535),
    "shunt_priority": _int(1, 65534),  # TCP teardown catchers sit one above
    "block_priority": _int(1, 65534),
    "max_shunts": _int(0, 10_000_000),
    "netlink_rcvbuf": _int(4096, 1 << 30),
    "tcp_teardown": _bool,
    "flow_layout": _choice(("auto", "single", "pipeline")),
    "rst_grace": _number(0, 5),
    "confirm": _choice(("barrier", "counters", "delay")),
    "confirm_delay": _number(0, 10),
    "drain": _number(0, 5),
    "control_socket": _socket_path,
    "metrics_address": _optional(_address),
    "metrics_port": _int(1, 65535),
    "audit_log": _optional(_log_path),
    "accounting_log": _optional(_log_path),
    "state_dir": _dir_path,
    "log_level": _choice(LOG_LEVELS),
    "log_format": _choice(LOG_FORMATS),
    "bridge": _ifname,
    "pair": _pair,
    "static_shunts": static.parse,
    "static_shunt_max_prefix": static.max_prefix,
    "static_priority": _int(1, 65534),
    "ids": _ids,
}


# What each entry of `switches` may set; the other keys are the controller's (or, at the
# top level, every switch's default).
PER_SWITCH: dict[str, Callable[[str, Any], Any]] = {
    key: TOP_LEVEL[key] for key in ("datapath_id", "ports", "switch_addresses", "packet_in_rate", "flow_mod_rate",
                                    "install_queue", "max_shunts", "flow_layout", "confirm", "confirm_delay",
                                    "drain")}


def _switches(key: str, value: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(key, "expected a non-empty list of switches ({\"datapath_id\": ..., \"ports\": [...]})")
    entries = tuple(_object(f"{key}[{i}]", v, PER_SWITCH, required=("datapath_id", "ports"))
                    for i, v in enumerate(value))
    seen: dict[int, str] = {}
    for i, entry in enumerate(entries):
        dpid = entry["datapath_id"]
        if dpid is None:
            raise ConfigError(f"{key}[{i}].datapath_id", "each of several switches needs its datapath id")
        if dpid in seen:
            raise ConfigError(f"{key}[{i}].datapath_id", f"{dpid:016x} is already used by {seen[dpid]}")
        seen[dpid] = f"{key}[{i}]"
    _unique_bridge_ports([(f"{key}[{i}].ports[{j}]", g) for i, entry in enumerate(entries)
                          for j, g in enumerate(entry["ports"])])
    return entries


def _check(cfg: Config, prefix: str = "") -> None:
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


def from_dict(raw: Any) -> Config:
    values = _object("", raw, {**TOP_LEVEL, "switches": _switches}, required=("mark_actions",))
    switches = values.pop("switches", None)
    if switches is None and "ports" not in values:
        raise ConfigError("ports", "required key is missing (or list several switches in 'switches')")
    if switches is not None:
        for name in ("ports", "datapath_id"):
            if name in values:
                raise ConfigError(name, "goes into each entry of 'switches' when several are listed")
        values["ports"] = tuple(g for entry in switches for g in entry["ports"])
    ids = values.get("ids")
    if ids is not None and not ids.state_file:
        values["ids"] = dataclasses.replace(ids, state_file=os.path.join(values.get("state_dir", Config.state_dir),
                                                                         IDS_STATE_FILE))
    cfg = Config(**values)
    if switches is not None:
        if cfg.pair is not None and len(switches) > 1:
            raise ConfigError("pair", "a firewall pair serves one switch (several in 'switches' are not supported "
                              "with 'pair' yet): run one controller pair per switch")
        served = []
        for i, entry in enumerate(switches):
            one = dataclasses.replace(cfg, by_physdevin={}, **entry)
            _check(one, f"switches[{i}].")
            served.append(one)
        cfg = dataclasses.replace(cfg, by_physdevin={}, switches=tuple(served))
    if cfg.default_priority >= min(cfg.shunt_priority, cfg.block_priority):
        raise ConfigError("default_priority", "must be lower than shunt_priority and block_priority,"
                          " or shunts would never win over the slow path")
    if not cfg.default_no_shunting and cfg.delete_flows_on_startup and cfg.delete_foreign_flows_on_startup:
        raise ConfigError("default_no_shunting", "false only makes sense when the switch keeps its"
                          " pre-programmed forwarding; delete_foreign_flows_on_startup would wipe it")
    _check(cfg)
    static.check(cfg)
    if cfg.ids is not None:
        _ids_port_free(cfg)
    if cfg.pair is not None:
        if cfg.openflow_versions != ("1.3",):
            raise ConfigError("pair", "controller roles need OpenFlow 1.3 only: set openflow_versions to [\"1.3\"]")
        if cfg.delete_foreign_flows_on_startup:
            raise ConfigError("delete_foreign_flows_on_startup", "must be false in a pair: a takeover would wipe "
                              "the shunts the other controller installed")
        if not cfg.default_no_shunting:
            raise ConfigError("default_no_shunting", "must be true in a pair: a takeover points the default "
                              "flows at this firewall")
        if cfg.delete_flows_on_shutdown:
            raise ConfigError("delete_flows_on_shutdown", "must be false in a pair: the other controller adopts "
                              "the shunts and blocks when this one stops")
    return cfg


def load(path: str) -> Config:
    """Only a regular file of at most MAX_CONFIG_BYTES is read (a FIFO would hang)."""
    try:
        raw = jsonfile.read(path, MAX_CONFIG_BYTES)
    except jsonfile.JsonInputError as exc:
        raise ConfigError(exc.key, exc.problem) from None
    return from_dict(raw)


def log_level(cfg: Config) -> int:
    return getattr(logging, cfg.log_level)
