"""Reloading the config without a restart (SIGHUP, `nfshunt reload`): what may change.

The new file is read and validated first; a config that fails changes nothing. Of a valid
one, the keys in LIVE take effect (each is read where it is used, so new pairs and timers
take the new value; pairs on the switch keep the timeouts they were installed with);
static shunts change as the difference only (static.py). Every other key that differs is
reported and keeps its running value until a restart: it shapes a socket, the switch
session, the iptables plumbing or state on the switch (ports, listen address, TLS,
OpenFlow versions, layout, priorities of pairs already installed, the pair, ...).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TypeVar

from .settings import Config
from .switch import SwitchConfig

# Keys a running controller takes from a reloaded config (the controller's, or each switch's).
LIVE = ("default_shunt_timeout", "default_block_timeout", "rst_grace", "drain", "confirm_delay", "max_block_share",
        "packet_in_rate", "log_level", "static_shunts", "static_shunt_max_prefix", "static_priority")


@dataclass(frozen=True)
class Plan:
    """What a reload does: the config to run with (the running one with the new values
    of the live keys), which live keys change, which other keys differ and are kept."""
    config: Config
    changed: tuple[str, ...]
    kept: tuple[str, ...]


_Record = TypeVar("_Record", Config, SwitchConfig)


def _differs(old: _Record, new: _Record, prefix: str = "") -> list[str]:
    """The keys whose values differ (not the switches, compared one by one; nor what is derived)."""
    return [prefix + f.name for f in dataclasses.fields(old)
            if f.compare and f.name != "switches" and getattr(old, f.name) != getattr(new, f.name)]


def _live(old: _Record, src: _Record) -> _Record:
    """`old` with the live keys' values of `src`."""
    return dataclasses.replace(old, **{f.name: getattr(src, f.name) for f in dataclasses.fields(old)
                                       if f.name in LIVE})


def plan(running: Config, new: Config) -> Plan:
    differs = _differs(running, new)
    if len(running.switches) != len(new.switches):
        differs.append("switches")
    else:
        for old_sw, new_sw in zip(running.switches, new.switches, strict=True):
            differs.extend(d for d in _differs(old_sw, new_sw, old_sw.at) if d not in differs)
    changed = tuple(d for d in dict.fromkeys(differs) if d.rsplit(".", 1)[-1] in LIVE)
    kept = tuple(d for d in dict.fromkeys(differs) if d.rsplit(".", 1)[-1] not in LIVE)
    if "switches" in kept:  # another list of switches: no switch's config can be matched up
        return Plan(running, (), kept)
    switches = tuple(_live(o, n) for o, n in zip(running.switches, new.switches, strict=True))
    return Plan(dataclasses.replace(_live(running, new), switches=switches), changed, kept)
