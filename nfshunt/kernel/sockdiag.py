"""Which local user owns the other end of a TCP connection on this host (sock_diag).

On the loopback every local user's connection comes from 127.0.0.1: an address names no
one. The kernel knows whose socket the other end is: one SOCK_DIAG_BY_FAMILY request for
that exact socket (no dump; no privilege needed, as for `ss -e`) answers its owner's uid.
Used by the IDS API to hold each local user to its own share of connections and failed
logins (ids/api.py). pyroute2's DiagSocket only dumps every socket of a family (its
signature marked work in progress), so the one request is made here.
"""
from __future__ import annotations

import socket
import struct
import threading

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
NLMSG_HDR = struct.Struct("=IHHII")
# inet_diag_req_v2: family, protocol, ext, pad, states; then inet_diag_sockid: sport, dport
# (big-endian), src and dst (16 bytes each), interface, cookie (two words: none given).
REQUEST = struct.Struct("=BBBBI")
SOCKID = struct.Struct("!HH16s16s")
SOCKID_TAIL = struct.Struct("=III")
NO_COOKIE = 0xFFFFFFFF
UID_OFFSET = 4 + SOCKID.size + SOCKID_TAIL.size + 12  # in inet_diag_msg, after expires, rqueue, wqueue
ANSWER_SECONDS = 0.5

_OWN = threading.local()


def _address(family: int, text: str) -> bytes:
    return socket.inet_pton(family, text).ljust(16, b"\0")


def owner(peer: tuple[str, int], local: tuple[str, int]) -> int | None:
    """The uid owning this host's TCP socket `peer` that is connected to `local`; None if
    there is none (the other end is another host's) or the kernel did not say."""
    family = socket.AF_INET6 if ":" in peer[0] else socket.AF_INET
    body = (REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
            + SOCKID.pack(peer[1], local[1], _address(family, peer[0]), _address(family, local[0]))
            + SOCKID_TAIL.pack(0, NO_COOKIE, NO_COOKIE))
    sock = getattr(_OWN, "sock", None)
    if sock is None:
        sock = _OWN.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
        sock.settimeout(ANSWER_SECONDS)
        _OWN.seq = 0
    _OWN.seq = _OWN.seq % 0xFFFFFFFF + 1
    try:
        sock.send(NLMSG_HDR.pack(NLMSG_HDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, _OWN.seq, 0) + body)
        while True:
            data = sock.recv(65536)
            length, kind, _flags, seq, _pid = NLMSG_HDR.unpack_from(data)
            if seq != _OWN.seq:
                continue  # an earlier request's, late
            if kind == NLMSG_ERROR or length < NLMSG_HDR.size + UID_OFFSET + 4:
                return None
            return int(struct.unpack_from("=I", data, NLMSG_HDR.size + UID_OFFSET)[0])
    except OSError:
        _OWN.sock = None
        sock.close()
        return None
