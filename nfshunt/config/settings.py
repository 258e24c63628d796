"""Typed configuration: the original nfshunt.json plus NFShunt's newer keys.

Every problem is reported as a ConfigError naming the key path and what is wrong,
before anything touches iptables or the switch. Unknown keys are errors: a typo in a
firewall component's config must not silently fall back to a default.

Here: the whole config (Config), its top-level keys and what they must agree on; each
object's own keys and checks are in its module (switch, ids, pair, static).
"""
from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

from nfshunt.records import markcodec
from nfshunt.records.model import OPENFLOW_VERSIONS, Action

from . import ids as ids_config
from . import jsonfile, pair, static, switch
from . import validate as v
from .ids import IDS_STATE_FILE, IdsConfig
from .pair import PairConfig
from .switch import PER_SWITCH, PortGroup, SwitchConfig, TLSConfig
from .validate import ConfigError

ACTIONS = tuple(a.value for a in Action)  # ("ignore", "shunt", "block")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")


DEFAULT_CONTROL_SOCKET = "/run/nfshunt/nfshunt.sock"
# A config is a few KB, but 10,000 static shunts written one key a line take 2.1 MB and
# 100,000 about 21 MB: room for that, not for a wrong file read whole into memory.
MAX_CONFIG_BYTES = 32 << 20


@dataclass(frozen=True)
class Config:
    """The controller's keys. Each served switch's own keys (ports, datapath id, pacing,
    layout, confirmation) are its SwitchConfig in `switches`, never read from here."""
    # Every switch this controller serves, in the config's order: one (the top level's
    # per-switch keys) unless the config lists several in `switches`.
    switches: tuple[SwitchConfig, ...]
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
    echo_interval: float = 0.4
    echo_misses: int = 3
    max_block_share: float = 0.5
    default_priority: int = 100
    shunt_priority: int = 33000
    block_priority: int = 33100
    # The kernel charges ~1.3 KB a queued event and doubles this (SO_RCVBUFFORCE): 128 MiB
    # holds a 100,000-entry burst and its deletes' events, taken only while events wait.
    # A smaller buffer overflows, and each overflow costs a dump of the whole table.
    netlink_rcvbuf: int = 128 * 1024 * 1024
    tcp_teardown: bool = True
    rst_grace: float = 0.5
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
    # Engineered streams on the fast path from their first frame (static.py).
    static_shunts: tuple[static.StaticShunt, ...] = ()
    static_shunt_max_prefix: dict[int, int] = field(default_factory=lambda: {4: 24, 6: 64})
    static_priority: int = 33050
    ids: IdsConfig | None = None  # the IDS request API; None: off

    @property
    def all_port_groups(self) -> tuple[PortGroup, ...]:
        """Every switch's port groups: the firewall bridge's ports (the iptables plumbing)."""
        return tuple(g for sw in self.switches for g in sw.ports)

    def zone_refused(self, zone: int) -> str | None:
        """Why a connection named in `zone` can be no pair of this controller's (an operator's
        or an IDS's tuple), or None. Zone 0 is the untagged frames': on trunks that carry
        none, a tuple given without its VLAN would pin or shunt nothing, and say it did."""
        if zone or any(0 in g.zone_of_vid.values() for g in self.all_port_groups):  # (a routed VLAN's too)
            return None
        return "this controller serves VLANs only (no port group carries untagged frames): name the " \
               "connection's vlan (or zone)"

    def zone_of_vlan(self, vid: int) -> int:
        """The conntrack zone a VLAN id names (an operator's or an IDS's `vlan`): the one its
        groups bridge it in; ValueError saying what to give when no group carries it, or
        groups carry it in different zones."""
        if isinstance(vid, bool) or not isinstance(vid, int) or not 1 <= vid <= 4094:
            raise ValueError(f"VLAN {vid!r} is not a VLAN id (1-4094)")
        where = {(f"{sw.at}ports[{i}]", g.zone_of_vid[vid]) for sw in self.switches for i, g in enumerate(sw.ports)
                 if vid in g.zone_of_vid}
        zones = sorted({zone for _, zone in where})
        if not zones:
            raise ValueError(f"VLAN {vid} is carried by no port group: give a VLAN of the config's \"vlans\"")
        if len(zones) > 1:
            named = " and ".join(f"zone {zone} on {at}" for at, zone in sorted(where, key=lambda w: (w[1], w[0])))
            raise ValueError(f"VLAN {vid} is {named}: name the zone")
        return zones[0]

    @property
    def ofp_versions(self) -> list[int]:
        return sorted(OPENFLOW_VERSIONS[version] for version in self.openflow_versions)

    def security_warnings(self) -> list[str]:
        """What makes the OpenFlow port trust more than the switch (check-config, start-up)."""
        out = []
        loopback = ipaddress.ip_address(self.listen_address).is_loopback
        if self.tls is None and not loopback:
            out.append(f"the OpenFlow listener on {self.listen_address} has no TLS: any host that reaches "
                       f"port {self.listen_port} can pose as the switch; set 'tls' (with ca_certificate)")
            if not all(sw.switch_addresses for sw in self.switches):
                out.append("no 'switch_addresses': connections are accepted from any address")
        if self.tls is not None and self.tls.ca_certificate is None:
            out.append("tls has no ca_certificate: the switch's certificate is not verified")
        if any(sw.datapath_id is None for sw in self.switches):  # one switch (several each name theirs)
            out.append("no 'datapath_id': the first switch to connect is served")
        for sw in self.switches:  # (not security: what else check-config and start-up warn about)
            out.extend(switch.vlan_warnings(sw))
        return out

    def action_for(self, number: int) -> Action | None:
        return self.mark_actions.get(number)


@v.takes("object", "action numbers `0`-`15` (decimal strings, no leading zero) to " +
         ", ".join(f"`{a}`" for a in ACTIONS))
def _mark_actions(key: str, value: Any) -> dict[int, Action]:
    if not isinstance(value, dict) or not value:
        raise ConfigError(key, "expected a non-empty object mapping numbers to actions")
    result: dict[int, Action] = {}
    for number, action in value.items():
        sub = f"{key}.{number}"
        if not (isinstance(number, str) and re.fullmatch(r"0|[1-9][0-9]?", number, re.ASCII)
                and int(number) <= markcodec.NIBBLE):
            raise ConfigError(sub, f"{number!r} is not an action number 0-15 (decimal, no leading zero)")
        result[int(number)] = Action(v.choice(ACTIONS)(sub, action))  # an enum from here on
    return result


K = v.Key
TOP_LEVEL: dict[str, v.Key] = {
    "mark_actions": K(_mark_actions, "What each action number in the connection mark (bits 16-19) means, "
                      "such as `{\"0\": \"ignore\", \"1\": \"shunt\", \"2\": \"block\"}`."),
    "delete_flows_on_startup": K(v.boolean, "At a switch's connect, delete NFShunt's flows nothing accounts for "
                                 "(half pairs, port groups no longer configured); complete pairs are adopted."),
    "delete_flows_on_shutdown": K(v.boolean, "At a stop, remove the shunt and block flows (the default flows stay, "
                                  "so traffic keeps crossing the firewall); false: they stay and the next start "
                                  "adopts them (hitless restarts; a pair needs false)."),
    "default_shunt_timeout": K(v.integer(1, 65535), "Idle timeout in seconds of a shunt's flows."),
    "default_block_timeout": K(v.integer(1, 65535), "Idle timeout in seconds of a block's flows."),
    "default_no_shunting": K(v.boolean, "Install the default fast-to-slow flows of every port group, so that "
                             "everything crosses the firewall unless shunted; false only for a switch that keeps "
                             "its own forwarding."),
    "delete_foreign_flows_on_startup": K(v.boolean, "At a switch's connect, also delete every flow that is not "
                                         "NFShunt's."),
    "openflow_versions": K(switch.versions, "The OpenFlow versions offered to the switch; IPv6, `counters`, "
                           "`pipeline`, static shunts and a pair need 1.3."),
    "listen_address": K(v.address, "The OpenFlow listener's address."),
    "listen_port": K(v.integer(1, 65535), "The OpenFlow listener's port."),
    "tls": K(switch.tls, "The OpenFlow listener's TLS (`tls`); without it a listener on a non-loopback address "
             "lets any host that reaches it pose as the switch (check-config warns)."),
    "echo_interval": K(v.number(0.1, 60), "Seconds between echo requests to the switch."),
    "echo_misses": K(v.integer(1, 100), "Unanswered echoes after which the switch's connection is dead (noticed "
                     "within (misses + 1) x interval)."),
    "max_block_share": K(v.number(0, 1), "Blocks may evict shunts only while they hold less than this share of "
                         "the switch's budget; beyond it they wait like shunts."),
    "default_priority": K(v.integer(1, 65535), "The default flows' priority; lower than `shunt_priority` and "
                          "`block_priority`."),
    "shunt_priority": K(v.integer(1, 65534), "A shunt's flows' priority (its TCP catchers sit one above)."),
    "block_priority": K(v.integer(1, 65534), "A block's flows' priority."),
    "netlink_rcvbuf": K(v.integer(4096, 1 << 30), "The conntrack event socket's buffer in bytes (SO_RCVBUFFORCE; "
                        "the kernel doubles it, about 1.3 KB a waiting event); an overflow costs a dump of the "
                        "whole table."),
    "tcp_teardown": K(v.boolean, "OpenFlow 1.3: a FIN or RST of a shunted TCP connection removes its shunt at once "
                      "(else the idle timeout does)."),
    "rst_grace": K(v.number(0, 5), "Seconds a TCP shunt goes on forwarding after its RST is caught (an aborted "
                   "transfer's tail) before it is handed back to the firewall; 0: at once."),
    "control_socket": K(v.socket_path, "The root-only Unix socket of `nfshunt status`, `reload`, `flush`, "
                        "`unshunt`, `block`."),
    "metrics_address": K(v.optional(v.address), "The Prometheus endpoint's address; null: no endpoint."),
    "metrics_port": K(v.integer(1, 65535), "The Prometheus endpoint's port."),
    "audit_log": K(v.optional(v.log_path), "A file that gets one JSON line per removed shunt or block; null: "
                   "none."),
    "accounting_log": K(v.optional(v.log_path), "A file that gets one accounting record (JSON line, schema "
                        "`nfshunt.accounting/1`) per pair that leaves the switch; null: none."),
    "state_dir": K(v.dir_path, "Where the controller keeps what must outlive it: the fingerprint of the policy "
                   "the switch's pairs were decided under, operator pins, the IDS rules."),
    "log_level": K(v.choice(LOG_LEVELS), "`DEBUG` also logs every ignored event with its reason."),
    "log_format": K(v.choice(LOG_FORMATS), "`json`: one JSON object a log line."),
    "bridge": K(v.ifname, "The firewall bridge's name (informational)."),
    "pair": K(pair.parse, "One controller of an active-backup firewall pair (`pair`)."),
    "static_shunts": K(static.parse, "Engineered streams on the fast path from their first frame "
                       "(`static_shunts[]`)."),
    "static_shunt_max_prefix": K(static.max_prefix, "The widest prefix a static shunt may name "
                                 "(`static_shunt_max_prefix`).", default=v.family_map(static.DEFAULT_MAX_PREFIX)),
    "static_priority": K(v.integer(1, 65534), "Static shunts' flows' priority: above `shunt_priority` + 1 "
                         "(the TCP catchers), below `block_priority` (an operator's block wins)."),
    "ids": K(ids_config.parse, "The IDS request API (`ids`)."),
    **PER_SWITCH,  # at the top level: the one switch's, or every switch's default
}
TABLE = v.Table("", "The controller's keys; the per-switch ones (see `switches[]`) are the one switch's, or "
                "every switch's default.", {**TOP_LEVEL, "switches": K(switch.switches, "Several switches served "
                "by this controller, instead of `ports` and `datapath_id` (`switches[]`).", default="none: one "
                "switch, the top level's")}, required=("mark_actions",), record=Config, also=(SwitchConfig,))


def from_dict(raw: Any) -> Config:
    values = TABLE.read("", raw)
    entries = values.pop("switches", None)
    top = {name: values.pop(name) for name in PER_SWITCH if name in values}  # the one switch's, or the default
    if entries is None and "ports" not in top:
        raise ConfigError("ports", "required key is missing (or list several switches in 'switches')")
    if entries is not None:
        for name in ("ports", "datapath_id"):
            if name in top:
                raise ConfigError(name, "goes into each entry of 'switches' when several are listed")
    ids = values.get("ids")
    if ids is not None and not ids.state_file:
        values["ids"] = dataclasses.replace(ids, state_file=os.path.join(values.get("state_dir", Config.state_dir),
                                                                         IDS_STATE_FILE))
    if entries is None:
        cfg = Config(switches=(SwitchConfig(**top),), **values)
        _check(cfg, cfg.switches[0])
        return cfg
    if values.get("pair") is not None:
        pair.check_switches(len(entries))
    cfg = Config(switches=tuple(SwitchConfig(**{**top, **entry}, at=f"switches[{i}].")
                                for i, entry in enumerate(entries)), **values)
    for sw in cfg.switches:
        switch.check(sw, cfg.openflow_versions, cfg.tcp_teardown)
        if sw.forwarding != cfg.switches[0].forwarding:  # one firewall, one iptables plumbing
            raise ConfigError(f"{sw.at}forwarding", f"{sw.forwarding}, and switches[0] is "
                              f"{cfg.switches[0].forwarding}: one firewall routes or bridges for all its switches")
    _check(cfg, SwitchConfig(**{**top, "ports": ()}))
    return cfg


def _check(cfg: Config, top: SwitchConfig) -> None:
    """What the top-level keys must agree on, and each object's checks against the rest
    (top: the top level's per-switch keys, the one switch or every switch's default)."""
    if cfg.default_priority >= min(cfg.shunt_priority, cfg.block_priority):
        raise ConfigError("default_priority", "must be lower than shunt_priority and block_priority,"
                          " or shunts would never win over the slow path")
    if not cfg.default_no_shunting and cfg.delete_flows_on_startup and cfg.delete_foreign_flows_on_startup:
        raise ConfigError("default_no_shunting", "false only makes sense when the switch keeps its"
                          " pre-programmed forwarding; delete_foreign_flows_on_startup would wipe it")
    switch.check(top, cfg.openflow_versions, cfg.tcp_teardown)
    static.check(cfg)
    if cfg.ids is not None:
        others = [("listen_port", cfg.listen_address, cfg.listen_port)]
        if cfg.metrics_address is not None:
            others.append(("metrics_port", cfg.metrics_address, cfg.metrics_port))
        ids_config.check_port_free(cfg.ids, others)
    if cfg.pair is not None:
        pair.check(cfg)


def load(path: str) -> Config:
    """Only a regular file of at most MAX_CONFIG_BYTES is read (a FIFO would hang)."""
    try:
        raw = jsonfile.read(path, MAX_CONFIG_BYTES)
    except jsonfile.JsonInputError as exc:
        raise ConfigError(exc.key, exc.problem) from None
    return from_dict(raw)


def log_level(cfg: Config) -> int:
    return getattr(logging, cfg.log_level)
