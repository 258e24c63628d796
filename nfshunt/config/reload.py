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
from typing import Any

from .settings import Config

# Keys a running controller takes from a reloaded config.
LIVE = ("default_shunt_timeout", "default_block_timeout", "rst_grace", "drain", "confirm_delay", "max_block_share",
        "packet_in_rate", "log_level", "static_shunts", "static_shunt_max_prefix", "static_priority")
# Not compared: derived from the others.
_DERIVED = ("by_physdevin", "switches")


@dataclass(frozen=True)
class Plan:
    """What a reload does: the config to run with (the running one with the new values
    of the live keys), which live keys change, which other keys differ and are kept."""
    config: Config
    changed: tuple[str, ...]
    kept: tuple[str, ...]


def _differs(old: Config, new: Config, prefix: str = "") -> list[str]:
    return [prefix + f.name for f in dataclasses.fields(Config)
            if f.name not in _DERIVED and getattr(old, f.name) != getattr(new, f.name)]


def plan(running: Config, new: Config) -> Plan:
    differs = _differs(running, new)
    if len(running.served) != len(new.served):
        differs.append("switches")
    else:
        for i, (old_sw, new_sw) in enumerate(zip(running.served, new.served, strict=True)):
            if running.switches:
                differs.extend(d for d in _differs(old_sw, new_sw, f"switches[{i}].") if d not in differs)
    changed = tuple(d for d in dict.fromkeys(differs) if d.rsplit(".", 1)[-1] in LIVE)
    kept = tuple(d for d in dict.fromkeys(differs) if d.rsplit(".", 1)[-1] not in LIVE)
    if "switches" in kept:  # another list of switches: no switch's config can be matched up
        return Plan(running, (), kept)

    def live(old: Config, src: Config, **more: Any) -> Config:
        return dataclasses.replace(old, by_physdevin={}, **{k: getattr(src, k) for k in LIVE}, **more)
    if running.switches:
        served = tuple(live(o, n) for o, n in zip(running.switches, new.switches, strict=True))
        return Plan(live(running, new, switches=served), changed, kept)
    return Plan(live(running, new), changed, kept)
