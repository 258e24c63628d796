"""Templated flow-mods: a message built by os-ken once per shape, then copied with a
connection's cookie, addresses, ports, metadata and hard timeout patched in (a few
microseconds instead of the ~60 us os-ken takes to build and serialise each). The flow
builder (flows.py) asks for them; nothing here sends anything.
"""
from __future__ import annotations

import ipaddress
import socket
import struct
from typing import Any, Callable

from nfshunt.records.model import FlowTuple

from .reads import META_CONN_MASK, META_GROUP_MASK

HARD_TIMEOUT_AT = {1: 60, 4: 28}  # a flow-mod's hard_timeout, bytes in: OpenFlow 1.0 (after the match), 1.3


def with_hard(msg: Any, hard: int) -> Any:
    """An os-ken flow-mod given a pair's hard timeout (0: none)."""
    if hard:
        msg.hard_timeout = hard
    return msg


# Sentinels for templated flow-mods: byte patterns that occur once in a message.
_S_COOKIE = 0x4EA5C3E1D2B49687
_S4 = ("10.201.202.203", "10.204.205.206")
_S6 = ("fd5a:5b5c:5d5e:5f60:6162:6364:6566:6768", "fd7a:7b7c:7d7e:7f80:8182:8384:8586:8788")
_S_PORTS = (0xE9EA, 0xEBEC)


class PatchedMsg:
    """A serialised flow-mod from a template with this connection's fields patched in.

    Built by os-ken once per shape (version, family, protocol, ports, actions, priority,
    flags ...), then copied and patched: a few microseconds instead of the ~60 us os-ken
    takes to build and serialise each message. Quacks like an os-ken message for the send
    path (xid, set_xid, serialize, buf)."""

    __slots__ = ("buf", "xid")

    def __init__(self, buf: bytearray):
        self.buf = buf
        self.xid: int | None = None

    def set_xid(self, xid: int) -> None:
        self.xid = xid

    def serialize(self) -> None:
        struct.pack_into("!I", self.buf, 4, self.xid or 0)


class _Template:
    __slots__ = ("buf", "cookie_at", "src_at", "dst_at", "sport_at", "dport_at", "family", "meta_at", "meta_group",
                 "hard_at")

    def __init__(self, msg: Any, family: int, meta: int | None = None, ports: tuple[bool, bool] = (True, True)):
        msg.set_xid(0)
        msg.serialize()
        self.buf = bytes(msg.buf)
        self.family = family
        self.hard_at = HARD_TIMEOUT_AT[msg.version]  # a flow-mod's fixed header field (0 in the template)
        s_src, s_dst = _S4 if family == 4 else _S6
        self.cookie_at = self._once(struct.pack("!Q", _S_COOKIE))
        self.src_at = self._once(ipaddress.ip_address(s_src).packed)
        self.dst_at = self._once(ipaddress.ip_address(s_dst).packed)
        # A static shunt's flow may match any port (ports: which the message has).
        self.sport_at = self._once(struct.pack("!H", _S_PORTS[0])) if ports[0] else None
        self.dport_at = self._once(struct.pack("!H", _S_PORTS[1])) if ports[1] else None
        # The metadata names the connection as the cookie does (META_CONN_MASK).
        self.meta_at = None if meta is None else self._once(struct.pack("!Q", meta))
        self.meta_group = 0 if meta is None else meta & META_GROUP_MASK  # the shape's port group, kept

    def _once(self, pattern: bytes) -> int:
        at = self.buf.find(pattern)
        if at < 0 or self.buf.find(pattern, at + 1) >= 0:
            raise ValueError("template field not found exactly once")
        return at

    def make(self, cookie: int, t: FlowTuple, hard: int = 0) -> PatchedMsg:
        b = bytearray(self.buf)
        struct.pack_into("!Q", b, self.cookie_at, cookie)
        if hard:
            struct.pack_into("!H", b, self.hard_at, hard)
        if self.meta_at is not None:
            struct.pack_into("!Q", b, self.meta_at, self.meta_group | (cookie & META_CONN_MASK))
        af, size = (socket.AF_INET, 4) if self.family == 4 else (socket.AF_INET6, 16)
        # inet_pton: a fraction of ipaddress's cost, and the listener's own text form
        b[self.src_at:self.src_at + size] = socket.inet_pton(af, t.src)
        b[self.dst_at:self.dst_at + size] = socket.inet_pton(af, t.dst)
        if self.sport_at is not None:
            struct.pack_into("!H", b, self.sport_at, t.sport)
        if self.dport_at is not None:
            struct.pack_into("!H", b, self.dport_at, t.dport)
        return PatchedMsg(b)


class Templates:
    """One builder's templates by shape, and its exact-cookie delete's."""

    def __init__(self) -> None:
        self._templates: dict[tuple, _Template | None] = {}
        self._cookie_delete: tuple[bytes, int] | None = None

    def flow(self, key: tuple, build: Callable[[int, FlowTuple], Any], family: int, cookie: int, t: FlowTuple,
             meta: Callable[[int], int] | None = None, ports: tuple[bool, bool] = (True, True), hard: int = 0) -> Any:
        """The message for (cookie, tuple) from the template of its shape (`key`), made by
        `build` from sentinels the first time; a shape whose fields cannot be located is
        built each time."""
        try:
            tpl = self._templates[key]  # (one lookup on the hot path)
        except KeyError:
            s_src, s_dst = _S4 if family == 4 else _S6
            sentinel = FlowTuple(family, t.proto, s_src, s_dst, *_S_PORTS)
            try:
                tpl = _Template(build(_S_COOKIE, sentinel), family, None if meta is None else meta(_S_COOKIE), ports)
            except ValueError:
                tpl = None
            self._templates[key] = tpl
        if tpl is None:
            return with_hard(build(cookie, t), hard)
        return tpl.make(cookie, t, hard)

    def cookie_delete(self, cookie: int, build: Callable[[int], Any]) -> Any:
        """A delete by exact cookie (`build` makes it with the cookie given)."""
        if self._cookie_delete is None:
            msg = build(_S_COOKIE)
            msg.set_xid(0)
            msg.serialize()
            buf = bytes(msg.buf)
            self._cookie_delete = (buf, buf.find(struct.pack("!Q", _S_COOKIE)))
        buf, at = self._cookie_delete
        b = bytearray(buf)
        struct.pack_into("!Q", b, at, cookie)
        return PatchedMsg(b)
