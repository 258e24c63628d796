"""The checks every config key is made of: each value checked and converted, or a
ConfigError naming the key and what is wrong. Shared by every module of the config (one
per object: settings, switch, ids, pair, static) and by the IDS rules' own checks.
"""
from __future__ import annotations

import ipaddress
import os
import re
from typing import Any, Callable, Iterable


class ConfigError(ValueError):
    """A config problem, with the dotted key path it concerns."""

    def __init__(self, key: str, problem: str):
        self.key = key
        self.problem = problem
        super().__init__(f"config key '{key}': {problem}" if key else problem)


def type_name(value: Any) -> str:
    return {bool: "boolean", int: "integer", str: "string", list: "list",
            dict: "object", float: "number", type(None): "null"}.get(type(value), type(value).__name__)


def boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, f"expected true or false, got {type_name(value)} {value!r}")
    return value


def integer(lo: int, hi: int) -> Callable[[str, Any], int]:
    def check(key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {type_name(value)} {value!r}")
        if not lo <= value <= hi:
            raise ConfigError(key, f"{value} is outside {lo}-{hi}")
        return value
    return check


def string(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(key, f"expected a non-empty string, got {type_name(value)} {value!r}")
    return value


def choice(choices: tuple[str, ...]) -> Callable[[str, Any], str]:
    def check(key: str, value: Any) -> str:
        if value not in choices:
            raise ConfigError(key, f"{value!r} is not one of {', '.join(choices)}")
        return value
    return check


# Letters, digits, '_', '.', '-': what every tool accepts. Linux allows more, but '+' is
# an iptables wildcard, '!' its negation, ':' an alias separator.
# (Linux itself refuses '/', whitespace, '.' and '..', and more than 15 bytes.)
_IFNAME = re.compile(r"[A-Za-z0-9_.-]{1,15}", re.ASCII)


def ifname(key: str, value: Any) -> str:
    value = string(key, value)
    if not _IFNAME.fullmatch(value) or value in (".", ".."):
        raise ConfigError(key, f"{value!r} is not a valid interface name (1-15 of A-Z a-z 0-9 _ . -)")
    return value


def number(lo: float, hi: float) -> Callable[[str, Any], float]:
    def check(key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {type_name(value)} {value!r}")
        if not lo <= value <= hi:
            raise ConfigError(key, f"{value} is outside {lo:g}-{hi:g}")
        return float(value)
    return check


def networks(key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ConfigError(key, f"expected a list of addresses or networks, got {type_name(value)}")
    out = []
    for i, v in enumerate(value):
        v = string(f"{key}[{i}]", v)
        try:
            ipaddress.ip_network(v, strict=False)
        except ValueError:
            raise ConfigError(f"{key}[{i}]", f"{v!r} is not an IP address or network") from None
        out.append(v)
    return tuple(out)


def address(key: str, value: Any) -> str:
    value = string(key, value)
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ConfigError(key, f"{value!r} is not an IP address") from None
    return value


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


def existing_file(key: str, value: Any) -> str:
    value = path(key, value)
    if not os.path.isfile(value):
        raise ConfigError(key, f"file {value!r} does not exist")
    return value


def optional(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    def optional(key: str, value: Any) -> Any:
        return None if value is None else check(key, value)
    return optional


def log_path(key: str, value: Any) -> str:
    value = path(key, value)
    if not os.path.isabs(value) or value.endswith("/") or os.path.isdir(value):
        raise ConfigError(key, f"{value!r} must be an absolute path of a file (its directory is created)")
    return value


def dir_path(key: str, value: Any) -> str:
    value = path(key, value)
    if not os.path.isabs(value) or (os.path.exists(value) and not os.path.isdir(value)):
        raise ConfigError(key, f"{value!r} must be an absolute path of a directory (created if missing)")
    return value


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


def read_object(key: str, value: Any, fields: dict[str, Callable[[str, Any], Any]],
            required: tuple[str, ...] = ()) -> dict[str, Any]:
    check_names(key, value, fields, required)
    prefix = f"{key}." if key else ""
    return {name: fields[name](f"{prefix}{name}", raw) for name, raw in value.items()}
