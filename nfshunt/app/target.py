"""What an explain request names, parsed: a tuple, a conntrack id or a pair's cookie. Apart
from the controller's side of explain (app/explain.py), so that `nfshunt explain` checks its
argument before it asks without importing the controller (0.7 s of imports for each run of
the command, measured with -X importtime)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nfshunt.records import cookies
from nfshunt.records.model import FlowTuple

from .control import parse_tuple

MAX_TARGET = 256  # characters: a tuple with two IPv6 addresses fits in 110
USAGE = ("give a tuple ('tcp 10.0.0.1:40000 -> 10.0.0.2:5201', IPv6 in brackets, ' zone N' after it for an "
         "entry in conntrack zone N), a conntrack id (a decimal number) or a pair's cookie (0x followed by 16 hex "
         "digits)")


@dataclass(frozen=True)
class Target:
    """What the operator named: a tuple, a conntrack id, or a cookie (a pair's key)."""
    text: str
    tuple: FlowTuple | None = None
    ct_id: int | None = None
    key: int | None = None  # a cookie's pair key (conntrack id and slot)
    kind: cookies.Kind | None = None  # a cookie's kind


def parse_target(raw: Any) -> Target:
    """The target of an explain request; ValueError saying what is wrong and what to give."""
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError(f"nothing to explain: {USAGE}")
    text = raw.strip()
    if len(text) > MAX_TARGET:
        raise ValueError(f"target too long ({len(text)} characters, at most {MAX_TARGET}): {USAGE}")
    if text.isascii() and text.isdigit():
        ct_id = int(text)
        if not 0 < ct_id < 1 << 32:
            raise ValueError(f"conntrack id {text} out of range (1 to 4294967295)")
        return Target(text, ct_id=ct_id)
    if text.lower().startswith("0x") and text.isascii():
        try:
            cookie = int(text, 16)
        except ValueError:
            raise ValueError(f"not a cookie: {text!r}: {USAGE}") from None
        parsed = cookies.parse(cookie) if cookie < 1 << 64 else None
        if parsed is None:
            raise ValueError(f"cookie {text} is not NFShunt's (its top byte is 0x4e and its kind 1-8)")
        return Target(text, ct_id=parsed.key & 0xFFFFFFFF, key=parsed.key, kind=parsed.kind)
    try:
        return Target(text, tuple=parse_tuple(text))
    except ValueError as exc:
        raise ValueError(f"{exc}: {USAGE}") from None
