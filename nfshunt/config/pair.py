"""The `pair` section: one controller of an active-backup firewall pair (core/roles), its
keepalived VRRP instances, and what the rest of the config must be for a pair."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

from . import validate as v
from .validate import ConfigError


@dataclass(frozen=True)
class PairConfig:
    """One controller of an active-backup firewall pair (see nfshunt/roles.py)."""
    state_file: str  # the role and generation this controller last took (survives restarts)
    start_role: str = "backup"  # the role before the state file exists
    role_check_interval: float = 1.0  # seconds between a master's role queries (on the 1 s tick)
    # keepalived's VRRP instances whose state changes move this controller (nfshunt-notify-fifo
    # asks for them); the others (a gateway address's, say) are not NFShunt's
    vrrp_instances: tuple[str, ...] = ("NFSHUNT",)


# keepalived's instance names as its notify FIFO writes them (INSTANCE "NAME" STATE PRIORITY)
# and nfshunt-notify-fifo reads them: one word, nothing a shell or the quotes would change.
VRRP_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}", re.ASCII)


@v.takes("list of strings", "keepalived VRRP instance names (1-64 of A-Z a-z 0-9 _ . -), each once")
def vrrp_instances(key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(key, "expected a non-empty list of keepalived VRRP instance names, such as [\"NFSHUNT\"]")
    for i, name in enumerate(value):
        if not isinstance(name, str) or not VRRP_NAME.fullmatch(name):
            raise ConfigError(f"{key}[{i}]", f"{name!r} is not a VRRP instance name as keepalived's notify FIFO "
                              "writes it (1-64 letters, digits, '_', '.', '-'; the name after vrrp_instance)")
    if len(set(value)) != len(value):
        raise ConfigError(key, "names an instance twice")
    return tuple(value)


PAIR = v.Table("pair", "This controller is one of an active-backup firewall pair (keepalived moves the role). "
               "Needs `openflow_versions` [\"1.3\"], `delete_flows_on_shutdown` false, "
               "`delete_foreign_flows_on_startup` false, `default_no_shunting` true and one switch.", {
    "state_file": v.Key(v.log_path, "Where the role and generation this controller last took are kept across "
                        "restarts (a takeover asked for while it was down waits here)."),
    "start_role": v.Key(v.choice(("backup", "master")), "The role before the state file exists."),
    "role_check_interval": v.Key(v.number(1, 60), "Seconds between a master's role queries to the switch."),
    "vrrp_instances": v.Key(vrrp_instances, "The keepalived VRRP instances whose state changes move this "
                            "controller; others (a gateway address's, say) are not NFShunt's."),
}, required=("state_file",), record=PairConfig)


@v.takes("object or null", "see `pair`; null: a lone controller")
def parse(key: str, value: Any) -> PairConfig | None:
    if value is None:
        return None
    return PairConfig(**PAIR.read(key, value))


def check_switches(switches: int) -> None:
    """A pair serves one switch (switches: how many the config lists)."""
    if switches > 1:
        raise ConfigError("pair", "a firewall pair serves one switch (several in 'switches' are not supported "
                          "with 'pair' yet): run one controller pair per switch")


class PairedKeys(Protocol):
    """What check() reads of the whole config (settings.Config)."""
    @property
    def openflow_versions(self) -> tuple[str, ...]: ...
    @property
    def delete_foreign_flows_on_startup(self) -> bool: ...
    @property
    def default_no_shunting(self) -> bool: ...
    @property
    def delete_flows_on_shutdown(self) -> bool: ...


def check(cfg: PairedKeys) -> None:
    """What the controller's other keys must be when it is one of a pair."""
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
