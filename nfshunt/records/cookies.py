"""The 64-bit OpenFlow cookie that marks a flow as NFShunt's and names its connection.

    bits 56-63  0x4E ('N'): owned by NFShunt
    bits 48-55  kind: 1 default slow-path flow, 2 shunt, 3 block, 4 TCP teardown catcher,
                5 the pipeline layout's table-1 flow of a port group, 6 static shunt,
                7 an IDS's address block (ids_backend.py: one flow a direction), 8 a VLAN
                trunk's drop of the tags its port group does not carry (one a port)
    bits 36-47  slot: tells apart live connections whose conntrack ids collide (ids are a
                32-bit hash: about n^2/2^33 of n live entries share one; 1 in a 100,000
                burst). The first pair of an id has slot 0, a second one slot 1 ...
    bits 34-35  a pair's authority (shunts and blocks): 0 the policy, 1 an IDS's rule, 2 an
                operator's pin (3: none this version writes). Read back by a reconcile after
                a restart or a takeover, which keeps a pair only while it can name what
                decided it (reconcile.py). Not part of the pair's key.
    bit  33     teardown catchers: 0 FIN, 1 RST
    bit  32     direction: 0 original, 1 reply; table-1 flows: 1 catcher (FIN or RST by bit 33);
                VLAN drops: 1 the slow port's
    bits 0-31   conntrack id of the connection (0 for defaults; table-1 flows and VLAN drops: port group index;
                static shunts: a hash of the entry's fields, static.py; address blocks:
                a hash of the prefix, address_blocks.py)
"""
from __future__ import annotations

import enum
from typing import NamedTuple, Protocol, TypeVar

MAGIC = 0x4E
OWNED_MASK = 0xFF << 56
OWNED_VALUE = MAGIC << 56
KIND_MASK = 0xFF << 48


class Kind(enum.IntEnum):
    DEFAULT = 1
    SHUNT = 2
    BLOCK = 3
    TEARDOWN = 4
    PIPELINE = 5
    STATIC = 6
    ADDRESS_BLOCK = 7
    VLAN_DROP = 8


class Authority(enum.IntEnum):
    """What decided a pair: its cookie says, so a controller that adopts it knows."""
    POLICY = 0  # the firewall's policy (the mark), or an IDS or operator that agreed with it
    IDS = 1  # an IDS's rule changed the policy's decision (ids/): bounded by the rule's expiry
    OPERATOR = 2  # an operator's pin (a block): bounded by the pin's lifetime
    UNKNOWN = 3  # not written by this version: never named, so never kept as a shunt


_KINDS = {int(kind): kind for kind in Kind}  # Kind(x) costs a microsecond; a reconcile reads 200,000

AUTHORITY_SHIFT = 34
AUTHORITY_MASK = 3 << AUTHORITY_SHIFT
RST_BIT = 1 << 33
DIRECTION_BIT = 1 << 32
SLOT_SHIFT = 36
SLOTS = 1 << 12
# A pair's key: its conntrack id and its slot (bits 32-43), as one int.
KEY_SLOT_SHIFT = 32


def key(ct_id: int, slot: int = 0) -> int:
    """(Slot 0's key is the id's own int object: no 32 B int a pair for the table's key.)"""
    return ct_id if not slot else slot << KEY_SLOT_SHIFT | ct_id


def make(kind: Kind, pair_key: int = 0, reply: bool = False, authority: Authority = Authority.POLICY) -> int:
    """A cookie naming `pair_key` (a conntrack id and its slot; a port group for table-1 flows).
    `kind`, `reply` and `authority` shift as the ints they are (no int() calls: two a flow-mod)."""
    return (OWNED_VALUE | kind << 48 | ((pair_key >> KEY_SLOT_SHIFT) % SLOTS) << SLOT_SHIFT
            | authority << AUTHORITY_SHIFT | reply << 32 | (pair_key & 0xFFFFFFFF))


def authority(cookie: int) -> Authority:
    """A pair's authority as its cookie names it."""
    return Authority((cookie & AUTHORITY_MASK) >> AUTHORITY_SHIFT)


def make_teardown(pair_key: int, reply: bool, rst: bool) -> int:
    return make(Kind.TEARDOWN, pair_key, reply) | (RST_BIT if rst else 0)


def make_pipeline(group: int, catcher: bool = False, rst: bool = False) -> int:
    """A table-1 flow of the pipeline layout: port group `group`'s output, or its FIN/RST catcher."""
    return make(Kind.PIPELINE, group, catcher) | (RST_BIT if rst else 0)


def is_rst(cookie: int) -> bool:
    return bool(cookie & RST_BIT)


def owned(cookie: int) -> bool:
    return cookie & OWNED_MASK == OWNED_VALUE


class Cookied(Protocol):
    @property
    def cookie(self) -> int: ...


F = TypeVar("F", bound=Cookied)


def split(flows: list[F], kind: Kind) -> tuple[list[F], list[F]]:
    """The flows whose cookie is NFShunt's of `kind` (parse(cookie).kind is kind), and the
    others, each in order. A reconcile sets three kinds apart in 200,000 flows: the test is
    on the cookie's top 16 bits (no parse), a comprehension a side, and when none is of the
    kind (as usual) the others are a plain copy."""
    bits = MAGIC << 8 | kind
    ours = [f for f in flows if f.cookie >> 48 == bits]
    return ours, [f for f in flows if f.cookie >> 48 != bits] if ours else list(flows)


class Parsed(NamedTuple):
    """An NFShunt cookie read back (a tuple: a reconcile parses 200,000)."""
    kind: Kind
    key: int  # the pair's key (conntrack id and slot); table-1 flows: the port group
    reply: bool  # reply direction; table-1 flows: a catcher


_new_parsed = tuple.__new__  # Parsed(...) goes through a Python-level __new__: 140 ns against 85


def parse(cookie: int) -> Parsed | None:
    """(kind, pair key, reply direction) for an NFShunt cookie, else None."""
    if cookie & OWNED_MASK != OWNED_VALUE:  # owned() and key() written out: a reconcile parses 200,000
        return None
    kind = _KINDS.get((cookie >> 48) & 0xFF)
    if kind is None:
        return None
    pair_key = (cookie >> SLOT_SHIFT) % SLOTS << KEY_SLOT_SHIFT | cookie & 0xFFFFFFFF
    return _new_parsed(Parsed, (kind, pair_key, bool((cookie >> 32) & 1)))
