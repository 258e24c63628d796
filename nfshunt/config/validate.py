"""The checks every config key is made of: each value checked and converted, or a
ConfigError naming the key and what is wrong. Shared by every module of the config (one
per object: settings, switch, ids, pair, static) and by the IDS rules' own checks.

Each object's keys are a Table: per key its Check (which also says, in words, what it
takes) and its help text. The parser reads an object through its Table and the key
reference (reference.py, docs/config-keys.md) prints the same Tables, so the two agree.
"""
from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterable, TypeVar

from nfshunt.records.model import ScopeIdError, parse_network

T = TypeVar("T")


class ConfigError(ValueError):
    """A config problem, with the dotted key path it concerns."""

    def __init__(self, key: str, problem: str):
        self.key = key
        self.problem = problem
        super().__init__(f"config key '{key}': {problem}" if key else problem)


class Check(Generic[T]):
    """One key's check (the raw JSON value to its typed value, or a ConfigError naming the
    key) and what it takes, in words: its JSON type and the values allowed."""
    __slots__ = ("fn", "kind", "allowed")

    def __init__(self, fn: Callable[[str, Any], T], kind: str, allowed: str = ""):
        self.fn, self.kind, self.allowed = fn, kind, allowed

    def __call__(self, key: str, value: Any) -> T:
        return self.fn(key, value)


def takes(kind: str, allowed: str = "") -> Callable[[Callable[[str, Any], T]], Check[T]]:
    """A parser function made a Check (a decorator): `kind` its JSON type, `allowed` what it accepts."""
    def wrap(fn: Callable[[str, Any], T]) -> Check[T]:
        return Check(fn, kind, allowed)
    return wrap


@dataclass(frozen=True)
class Key:
    """A key of a config object: its check and what it means (the key reference's text)."""
    check: Check[Any]
    help: str
    default: str | None = None  # the default in words, where the record's own is not the config's form


@dataclass(frozen=True)
class Table:
    """One config object's keys, read by the parser and printed by the key reference."""
    where: str  # the object's place in the config, as the reference names it ("" the top level, "ids.tls")
    about: str  # what the object is, one sentence
    keys: dict[str, Key]
    required: tuple[str, ...] = ()
    record: type | None = None  # the dataclass its values become: its field defaults are the keys' defaults
    also: tuple[type, ...] = ()  # other dataclasses some of its keys go to (the top level's per-switch keys)
    inherits: str = ""  # where an omitted key's value comes from, when not from the record

    def read(self, key: str, value: Any) -> dict[str, Any]:
        """The object at `key`: every name a known key, the required ones there, each value checked."""
        check_names(key, value, self.keys, self.required)
        prefix = f"{key}." if key else ""
        return {name: self.keys[name].check(f"{prefix}{name}", raw) for name, raw in value.items()}


def family_map(by_family: dict[int, int]) -> str:
    """{4: 24, 6: 64} as the config writes it ({"ipv4": 24, "ipv6": 64}), for a default in words."""
    return "{" + ", ".join(f'"ipv{family}": {n}' for family, n in sorted(by_family.items())) + "}"


def type_name(value: Any) -> str:
    return {bool: "boolean", int: "integer", str: "string", list: "list",
            dict: "object", float: "number", type(None): "null"}.get(type(value), type(value).__name__)


@takes("boolean")
def boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, f"expected true or false, got {type_name(value)} {value!r}")
    return value


def integer(lo: int, hi: int) -> Check[int]:
    def check(key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {type_name(value)} {value!r}")
        if not lo <= value <= hi:
            raise ConfigError(key, f"{value} is outside {lo}-{hi}")
        return value
    return Check(check, "integer", f"{lo}-{hi}")


@takes("string", "not empty")
def string(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(key, f"expected a non-empty string, got {type_name(value)} {value!r}")
    return value


def choice(choices: tuple[str, ...]) -> Check[str]:
    def check(key: str, value: Any) -> str:
        if value not in choices:
            raise ConfigError(key, f"{value!r} is not one of {', '.join(choices)}")
        return value
    return Check(check, "string", "one of " + ", ".join(f"`{c}`" for c in choices))


# Letters, digits, '_', '.', '-': what every tool accepts. Linux allows more, but '+' is
# an iptables wildcard, '!' its negation, ':' an alias separator.
# (Linux itself refuses '/', whitespace, '.' and '..', and more than 15 bytes.)
_IFNAME = re.compile(r"[A-Za-z0-9_.-]{1,15}", re.ASCII)


@takes("string", "an interface name: 1-15 of A-Z a-z 0-9 _ . -")
def ifname(key: str, value: Any) -> str:
    value = string(key, value)
    if not _IFNAME.fullmatch(value) or value in (".", ".."):
        raise ConfigError(key, f"{value!r} is not a valid interface name (1-15 of A-Z a-z 0-9 _ . -)")
    return value


def number(lo: float, hi: float) -> Check[float]:
    def check(key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {type_name(value)} {value!r}")
        if not lo <= value <= hi:
            raise ConfigError(key, f"{value} is outside {lo:g}-{hi:g}")
        return float(value)
    return Check(check, "number", f"{lo:g}-{hi:g}")


@takes("list of strings", "IP addresses or networks (no IPv6 scope id)")
def networks(key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ConfigError(key, f"expected a list of addresses or networks, got {type_name(value)}")
    out = []
    for i, v in enumerate(value):
        v = string(f"{key}[{i}]", v)
        parsed(f"{key}[{i}]", lambda text: parse_network(text, strict=False), v,
               f"{v!r} is not an IP address or network")
        out.append(v)
    return tuple(out)


def parsed(key: str, parser: Callable[[str], T], text: str, problem: str,
           error: Callable[[str, str], Exception] = ConfigError) -> T:
    """parser(text) (records.model's parse_address or parse_network), its refusal
    `error(key, ...)`: a scope id's own reason, else problem. Shared by the config and the
    IDS API's request bodies."""
    try:
        return parser(text)
    except ScopeIdError as exc:
        raise error(key, str(exc)) from None
    except ValueError:
        raise error(key, problem) from None


@takes("string", "an IP address")
def address(key: str, value: Any) -> str:
    """A listener's address (a scope id allowed: binding a link-local address needs one)."""
    value = string(key, value)
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ConfigError(key, f"{value!r} is not an IP address") from None
    return value


@takes("string", "a file name (no NUL byte, UTF-8)")
def path(key: str, value: Any) -> str:
    """A file name the kernel can take: no NUL (it would cut the name), UTF-8 encodable."""
    value = string(key, value)
    if "\0" in value:
        raise ConfigError(key, f"{value!r} contains a NUL byte")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(key, f"{value!r} is not UTF-8 text (a lone surrogate)") from None
    return value


@takes("string", "the name of a file that exists")
def existing_file(key: str, value: Any) -> str:
    value = path(key, value)
    if not os.path.isfile(value):
        raise ConfigError(key, f"file {value!r} does not exist")
    return value


def optional(check: Check[T]) -> Check[T | None]:
    def optional(key: str, value: Any) -> T | None:
        return None if value is None else check(key, value)
    return Check(optional, f"{check.kind} or null", check.allowed)


@takes("string", "an absolute file path (its directory is created)")
def log_path(key: str, value: Any) -> str:
    value = path(key, value)
    if not os.path.isabs(value) or value.endswith("/") or os.path.isdir(value):
        raise ConfigError(key, f"{value!r} must be an absolute path of a file (its directory is created)")
    return value


@takes("string", "an absolute directory path (created if missing)")
def dir_path(key: str, value: Any) -> str:
    value = path(key, value)
    if not os.path.isabs(value) or (os.path.exists(value) and not os.path.isdir(value)):
        raise ConfigError(key, f"{value!r} must be an absolute path of a directory (created if missing)")
    return value


@takes("string or null", "an absolute file path of at most 107 bytes; null: none")
def socket_path(key: str, value: Any) -> str | None:
    if value is None:
        return None
    value = path(key, value)
    if not os.path.isabs(value) or value.endswith("/") or len(value.encode()) > 107:
        raise ConfigError(key, f"{value!r} must be an absolute file path of at most 107 bytes (or null: no socket)")
    if os.path.isdir(value):
        raise ConfigError(key, f"{value!r} is a directory")
    return value


# ASCII only: int(..., 16) alone would also take other scripts' digits, '_', signs and spaces.
_DPID = re.compile(r"(?:0[xX])?[0-9a-fA-F]{1,16}|[0-9a-fA-F]{1,2}(?::[0-9a-fA-F]{1,2}){1,7}", re.ASCII)


@takes("string, integer or null", "a datapath id: up to 16 hex digits (0x optional), up to 8 "
       "colon-separated bytes, or an integer; null: any")
def dpid(key: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, str):
        if not _DPID.fullmatch(value):
            raise ConfigError(key, f"{value!r} is not a hexadecimal datapath id (up to 16 hex digits, "
                              "0x-prefixed or not, or up to 8 colon-separated bytes)")
        value = int(value.replace(":", ""), 16)
    return integer(0, 2**64 - 1)(key, value)


def check_names(key: str, value: Any, allowed: Iterable[str], required: Iterable[str],
                error: Callable[[str, str], Exception] = ConfigError, noun: str = "key") -> dict[str, Any]:
    """`value` is an object whose names are all `allowed` and include every `required` one;
    else `error(path, problem)`. Shared by the config and the IDS API's request bodies."""
    if not isinstance(value, dict):
        raise error(key, f"expected an object, got {type_name(value)}")
    allowed = tuple(allowed)
    prefix = f"{key}." if key else ""
    for name in value:
        if name not in allowed:
            raise error(f"{prefix}{name}", f"unknown {noun} (allowed: " + ", ".join(sorted(allowed)) + ")")
    for name in required:
        if name not in value:
            raise error(f"{prefix}{name}", f"required {noun} is missing")
    return value
