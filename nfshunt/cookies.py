"""The 64-bit OpenFlow cookie that marks a flow as NFShunt's and names its connection.

    bits 56-63  0x4E ('N'): owned by NFShunt
    bits 48-55  kind: 1 default slow-path flow, 2 shunt, 3 block, 4 TCP teardown catcher,
                5 the pipeline layout's table-1 flow of a port group
    bit  33     teardown catchers: 0 FIN, 1 RST
    bit  32     direction: 0 original, 1 reply; table-1 flows: 1 catcher (FIN or RST by bit 33)
    bits 0-31   conntrack id of the connection (0 for defaults; table-1 flows: port group index)
"""
from __future__ import annotations

import enum

MAGIC = 0x4E
OWNED_MASK = 0xFF << 56
OWNED_VALUE = MAGIC << 56


class Kind(enum.IntEnum):
    DEFAULT = 1
    SHUNT = 2
    BLOCK = 3
    TEARDOWN = 4
    PIPELINE = 5


_KINDS = {int(kind): kind for kind in Kind}  # Kind(x) costs a microsecond; a reconcile reads 200,000

RST_BIT = 1 << 33
DIRECTION_BIT = 1 << 32


def make(kind: Kind, ct_id: int = 0, reply: bool = False) -> int:
    return OWNED_VALUE | (int(kind) << 48) | (int(reply) << 32) | (ct_id & 0xFFFFFFFF)


def make_teardown(ct_id: int, reply: bool, rst: bool) -> int:
    return make(Kind.TEARDOWN, ct_id, reply) | (RST_BIT if rst else 0)


def make_pipeline(group: int, catcher: bool = False, rst: bool = False) -> int:
    """A table-1 flow of the pipeline layout: port group `group`'s output, or its FIN/RST catcher."""
    return make(Kind.PIPELINE, group, catcher) | (RST_BIT if rst else 0)


def is_rst(cookie: int) -> bool:
    return bool(cookie & RST_BIT)


def owned(cookie: int) -> bool:
    return cookie & OWNED_MASK == OWNED_VALUE


def parse(cookie: int) -> tuple[Kind, int, bool] | None:
    """(kind, conntrack id, reply direction) for an NFShunt cookie, else None."""
    if not owned(cookie):
        return None
    kind = _KINDS.get((cookie >> 48) & 0xFF)
    if kind is None:
        return None
    return kind, cookie & 0xFFFFFFFF, bool((cookie >> 32) & 1)
