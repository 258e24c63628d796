"""What decided a connection's path: the policy's mark, an operator's pin, an IDS's rule,
or a static shunt. One function answers it for a pair (`of_pair`) and one for a tuple
nobody has paired (`of_tuple`); explain and the accounting records read only these. No I/O.

A pin decides a pair only where it changed the policy's decision (admission.decide): an
operator's block or an IDS's shunt of what the policy left alone; a pin that agrees with
the policy leaves the policy the authority. (When pairs carry their authority themselves,
`Conn.authority`, written into the cookie, `of_pair` reads it; until then it is derived
from the pair's mark and the pin that holds its tuple.)
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from nfshunt.config.settings import Config
from nfshunt.config.static import StaticFlow
from nfshunt.records import markcodec
from nfshunt.records.model import Action

from .connection import Conn
from .pins import Pin


class Authority(enum.StrEnum):
    POLICY = "policy"  # the firewall's policy (NFSHUNT_POLICY's mark)
    IDS = "ids"  # an IDS's rule (source "ids:<client>")
    OPERATOR = "operator"  # an operator's pin (nfshunt unshunt / block)
    STATIC = "static"  # a static shunt: the config, never the firewall
    UNKNOWN = "unknown"  # a pin decided, and it has ended: whose is not known any more
    NONE = "none"  # nothing has decided (the policy has not marked it)


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


def of_pair(conn: Conn, cfg: Config, pin: Pin | None = None) -> Decider:
    """What decided a pair: the pin holding its tuple where the pin's action is the pair's
    and the policy's is not; the policy where the mark asks for what the pair does. A pair
    the policy did not ask for, whose pin has gone: an IDS shunt (operators pin no shunts)
    or UNKNOWN (an operator's or an IDS's block). An adopted pair's mark is not known: the
    policy, as far as this controller can tell."""
    policy = policy_action(cfg, conn.mark) if conn.mark else conn.action
    if policy is conn.action:
        return Decider(Authority.POLICY, None, conn.action)
    if pin is not None and pin.action is conn.action:
        return Decider(Authority.OPERATOR if pin.source is None else Authority.IDS, _pin_source(pin), conn.action)
    if conn.action is Action.SHUNT:
        return Decider(Authority.IDS, None, conn.action)
    return Decider(Authority.UNKNOWN, None, conn.action)


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
