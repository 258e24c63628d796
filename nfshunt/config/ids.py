"""The `ids` section: the IDS request API's listener, its clients' authentication, what an
IDS may shunt, and its limits (served by nfshunt/ids)."""
from __future__ import annotations

import ipaddress
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any

from . import validate as v
from .validate import ConfigError

MAX_IDS_EXPIRE = 30 * 86400  # the longest hard expiry of an IDS rule: a month
IDS_STATE_FILE = "ids-rules.json"  # under state_dir unless ids.state_file names another


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


TLS = v.Table("ids.tls", "The IDS API's TLS.", {
    "certificate": v.Key(v.existing_file, "The API's certificate (PEM)."),
    "private_key": v.Key(v.existing_file, "The API's private key (PEM)."),
    "client_ca": v.Key(v.existing_file, "A CA whose client certificates the API accepts: then a client "
                       "certificate authenticates a request, and its common name names the client."),
}, required=("certificate", "private_key"), record=IdsTLS)


@v.takes("object or null", "see `ids.tls`; null: none")
def tls(key: str, value: Any) -> IdsTLS | None:
    if value is None:
        return None
    return IdsTLS(**TLS.read(key, value))


def port_range(key: str, value: Any) -> tuple[int, int]:
    """5201, or "50000-51000"."""
    if isinstance(value, str):
        m = re.fullmatch(r"([0-9]{1,5})-([0-9]{1,5})", value, re.ASCII)
        if not m:
            raise ConfigError(key, f"{value!r} is not a port or a range \"low-high\"")
        lo, hi = (v.integer(1, 65535)(key, int(g)) for g in m.groups())
        if lo > hi:
            raise ConfigError(key, f"{value!r}: the low end is above the high end")
        return lo, hi
    port = v.integer(1, 65535)(key, value)
    return port, port


@v.takes("list of strings", "IP addresses or networks (no IPv6 scope id)")
def _prefixes(key: str, value: Any) -> tuple[Any, ...]:
    return tuple(ipaddress.ip_network(n, strict=False) for n in v.networks(key, value))


@v.takes("list", "ports (1-65535) or ranges \"low-high\"")
def _ports(key: str, value: Any) -> tuple[tuple[int, int], ...]:
    if not isinstance(value, list):
        raise ConfigError(key, f"expected a list of ports or ranges, got {v.type_name(value)}")
    return tuple(port_range(f"{key}[{i}]", p) for i, p in enumerate(value))


MAY_SHUNT = v.Table("ids.may_shunt", "Which connections an IDS may shunt: one whose server (the end it was "
                    "opened to) is inside one of `prefixes` and, when `ports` are listed, listens on one of them. "
                    "An IDS may block anything; it may shunt nothing outside this.", {
    "prefixes": v.Key(_prefixes, "The servers' networks.", default="[] (none)"),
    "ports": v.Key(_ports, "The servers' ports and port ranges, such as `[5201, \"50000-51000\"]`.",
                   default="[] (any port)"),
}, record=MayShunt)


@v.takes("object", "see `ids.may_shunt`")
def may_shunt(key: str, value: Any) -> MayShunt:
    return MayShunt(**MAY_SHUNT.read(key, value))


MAX_PREFIX = v.Table("ids.max_prefix", "The widest address block an IDS rule may name, by family.", {
    "ipv4": v.Key(v.integer(0, 32), "The shortest IPv4 prefix length.", default=str(IdsConfig().max_prefix[4])),
    "ipv6": v.Key(v.integer(0, 128), "The shortest IPv6 prefix length.", default=str(IdsConfig().max_prefix[6])),
})


@v.takes("object", "see `ids.max_prefix`")
def max_prefix(key: str, value: Any) -> dict[int, int]:
    given = MAX_PREFIX.read(key, value)
    default = IdsConfig().max_prefix
    return {4: given.get("ipv4", default[4]), 6: given.get("ipv6", default[6])}


@v.takes("string", "the name of a regular file of mode 0600")
def token_file(key: str, value: Any) -> str:
    """A token file readable by its owner only: a token others can read is no secret."""
    value = v.path(key, value)
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


@v.takes("string", "a user name, not root")
def user(key: str, value: Any) -> str:
    """A user name (not root: the API's process must keep no privilege)."""
    value = v.string(key, value)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}", value, re.ASCII):
        raise ConfigError(key, f"{value[:40]!r} is not a user name")
    if value == "root":
        raise ConfigError(key, "root: the IDS API's process parses what anyone sends and must run unprivileged")
    return value


IDS = v.Table("ids", "The IDS request API (an HTTP API in a process of its own): off unless the section is "
              "there. A change takes a restart.", {
    "listen_address": v.Key(v.address, "Where the API listens; an address that is not a loopback one needs `tls`."),
    "listen_port": v.Key(v.integer(1, 65535), "The API's port; not one of the controller's other listeners' on "
                         "the same address."),
    "token_file": v.Key(token_file, "Bearer tokens, one `<client> <token>` line each (`<client> <token> admin`: "
                        "may list every client's rules; one bare token: client `ids`), re-read when it changes. "
                        "Required unless `tls.client_ca` authenticates the clients.", default="null (none)"),
    "tls": v.Key(tls, "The API's TLS (`ids.tls`)."),
    "may_shunt": v.Key(may_shunt, "Which connections an IDS may shunt (`ids.may_shunt`).", default="none"),
    "max_rules": v.Key(v.integer(1, 1_000_000), "Active rules, all clients together; more are refused "
                       "(`error: full`), never evicting the policy's shunts."),
    "rate_limit": v.Key(v.integer(1, 1_000_000), "Requests a second of one authenticated client; more are "
                        "answered 429."),
    "rate_limit_unauthenticated": v.Key(v.integer(1, 1_000_000), "Failed authentications a second of one "
                                        "client (an address; on this host, an address and a local user); "
                                        "more are answered 429 and closed."),
    "max_body_bytes": v.Key(v.integer(1024, 1 << 20), "The largest request body (a rule's is about 300 bytes); "
                            "larger is answered 413."),
    "max_prefix": v.Key(max_prefix, "The widest address block a rule may name (`ids.max_prefix`).",
                        default=v.family_map(IdsConfig().max_prefix)),
    "max_connections": v.Key(v.integer(1, 10_000), "Connections open at once (each holds one thread); more are "
                             "closed at once (`busy`)."),
    "max_connections_per_client": v.Key(v.integer(1, 10_000), "Of `max_connections`, open at once from one "
                                        "client (`client_busy`); at most `max_connections`."),
    "answer_timeout": v.Key(v.number(0.1, 60), "Seconds an add may wait for the switch before it is answered "
                            "pending."),
    "default_expire": v.Key(v.integer(1, MAX_IDS_EXPIRE), "A rule's expiry in seconds when its body names none "
                            "(SciPass's bodies)."),
    "state_file": v.Key(v.log_path, "Where the rules are kept across restarts (written atomically, mode 0600).",
                        default=f"`<state_dir>/{IDS_STATE_FILE}`"),
    "user": v.Key(user, "The user the API's process runs as, with no capability."),
    "shared_whitelists": v.Key(v.boolean, "A client's whitelist exempts from every client's blocks (false: "
                               "from its own client's only)."),
}, record=IdsConfig)


@v.takes("object or null", "see `ids`; null: off")
def parse(key: str, value: Any) -> IdsConfig | None:
    """`ids`: the section's own keys (its port against the controller's: check_port_free)."""
    if value is None:
        return None
    ids = IdsConfig(**IDS.read(key, value))
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


def check_port_free(ids: IdsConfig, others: list[tuple[str, str, int]]) -> None:
    """The IDS API's port is not one the controller's other listeners (each: its key,
    address and port) bind on the same address."""
    mine = ipaddress.ip_address(ids.listen_address)
    for key, address, port in others:
        other = ipaddress.ip_address(address)
        if port == ids.listen_port and other.version == mine.version and (
                other == mine or other.is_unspecified or mine.is_unspecified):
            raise ConfigError("ids.listen_port", f"{port} is also '{key}' on {address}: one listener a port")
