"""What decided a connection's path: the policy's mark, an operator's pin, an IDS's rule,
or a static shunt. One function answers it for a pair (`of_pair`) and one for a tuple
nobody has paired (`of_tuple`); explain and the accounting records read only these. No I/O.

A pin decides a pair only where it changed the policy's decision (admission.decide): an
operator's block or an IDS's shunt of what the policy left alone; a pin that agrees with
the policy leaves the policy the authority. A pair carries its authority (`Conn.authority`,
written into its cookie); this module names it for people, with the two a pair never
carries: a static shunt's and none at all.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from nfshunt.config.settings import Config
from nfshunt.config.static import StaticFlow
from nfshunt.records import cookies, markcodec
from nfshunt.records.model import Action

from .connection import Conn
from .pins import Pin


class Authority(enum.StrEnum):
    POLICY = "policy"  # the firewall's policy (NFSHUNT_POLICY's mark)
    IDS = "ids"  # an IDS's rule (source "ids:<client>")
    OPERATOR = "operator"  # an operator's pin (nfshunt unshunt / block)
    STATIC = "static"  # a static shunt: the config, never the firewall
    UNKNOWN = "unknown"  # an adopted pair whose cookie names no authority (an older release's)
    NONE = "none"  # nothing has decided (the policy has not marked it)


# The authority a pair carries (its cookie's two bits), by name.
_CARRIED = {cookies.Authority.POLICY: Authority.POLICY, cookies.Authority.IDS: Authority.IDS,
            cookies.Authority.OPERATOR: Authority.OPERATOR, cookies.Authority.UNKNOWN: Authority.UNKNOWN}


@dataclass(frozen=True, slots=True)
class Decider:
    authority: Authority
    source: str | None = None  # a pin's: "operator" or "ids:<client>"
    action: Action | None = None  # what it decided


def policy_action(cfg: Config, mark: int) -> Action | None:
    """What the mark's decision asks for (None: undecided, or an action number not mapped)."""
    decided = markcodec.decode(mark).action
    return None if decided is None else cfg.action_for(decided)


def _pin_source(pin: Pin) -> str:
    return pin.source or "operator"


def of_pair(conn: Conn, pin: Pin | None = None) -> Decider:
    """What decided a pair: the authority it carries (admission wrote it, the cookie keeps
    it across an adoption), with the pin's source where a pin decided it."""
    authority = _CARRIED[conn.authority]
    source = _pin_source(pin) if pin is not None and authority in (Authority.IDS, Authority.OPERATOR) else None
    return Decider(authority, source, conn.action)


def of_tuple(cfg: Config, mark: int | None, pin: Pin | None, statics: list[StaticFlow]) -> Decider:
    """What decides a connection no pair carries: a static shunt covering it (the firewall
    never sees it), else a pin (an operator's beats the policy; an IDS's shunt only of
    what the policy left alone, its block always), else the policy's mark, if any."""
    if statics:
        return Decider(Authority.STATIC, statics[0].shunt.label, Action.SHUNT)
    policy = policy_action(cfg, mark) if mark else None
    if pin is not None and (pin.source is None or pin.action is Action.BLOCK or policy in (None, Action.IGNORE)):
        if pin.action is not policy:
            return Decider(Authority.OPERATOR if pin.source is None else Authority.IDS, _pin_source(pin), pin.action)
    if policy is not None:
        return Decider(Authority.POLICY, None, policy)
    return Decider(Authority.NONE)
