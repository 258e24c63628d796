"""The conntrack table asked directly, each call on a socket of its own: a whole dump
(optionally filtered by mark), the marks cleared for a new policy, one entry looked up.
"""
from __future__ import annotations

import errno
import logging
import socket
import struct
import threading
import time
from typing import Callable, Iterable, TypeVar

from pyroute2.netlink import NLM_F_REQUEST
from pyroute2.netlink.nfnetlink import NFNL_SUBSYS_CTNETLINK

from nfshunt.records.model import ConnEvent, EntryCounts, EventKind, FlowTuple

from . import held
from .codec import (
    BE32,
    CROSSED_PLUMBING,
    CTA_MARK,
    CTA_MARK_MASK,
    IPCTNL_MSG_CT_GET,
    NETLINK_NETFILTER,
    NLM_F_DUMP,
    NLMSG_DONE,
    NLMSG_ERROR,
    NLMSG_HDR,
    SO_RCVBUFFORCE,
    MalformedEvent,
    get_message,
    mark_update_message,
    netlink_acks,
    nla,
    parse_counts,
    parse_fast,
)

LOG = logging.getLogger("nfshunt.conntrack")

def raw_dump(on_malformed: Callable[[str], None], mark: tuple[int, int] | None = None) -> list[ConnEvent]:
    """The whole conntrack table (IPv4 and IPv6) over a socket of its own, parsed with the
    fast parser: pyroute2's decoder would need ~18 s for 100,000 entries. With `mark`
    (value, mask) the kernel sends only entries whose mark & mask equals value."""
    return _dump(on_malformed, mark, lambda data, offset, length, now: parse_fast(data, offset, length,
                                                                                 EventKind.DUMP, now))


def dump_counted(on_malformed: Callable[[str], None],
                 mark: tuple[int, int] | None = CROSSED_PLUMBING) -> list[tuple[ConnEvent, EntryCounts]]:
    """A dump (by default of the entries that crossed the bridge plumbing) with each entry's
    counters (`nfshunt top`; conntrack counts bytes only with nf_conntrack_acct=1)."""
    return _dump(on_malformed, mark, lambda data, offset, length, now: (
        parse_fast(data, offset, length, EventKind.DUMP, now), parse_counts(data, offset, length)))


T = TypeVar("T")


def _dump(on_malformed: Callable[[str], None], mark: tuple[int, int] | None,
          parse: Callable[[bytes, int, int, float], T]) -> list[T]:
    now = time.monotonic()
    events: list[T] = []
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    try:
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
        except PermissionError:
            pass
        sock.bind((0, 0))
        sock.settimeout(10)
        req = struct.pack("=BBH", socket.AF_UNSPEC, 0, 0)
        if mark is not None:
            req += nla(CTA_MARK, BE32.pack(mark[0])) + nla(CTA_MARK_MASK, BE32.pack(mark[1]))
        sock.send(NLMSG_HDR.pack(NLMSG_HDR.size + len(req), (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET,
                                 NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + req)
        while True:
            data = sock.recv(1 << 20)
            offset = 0
            while offset + NLMSG_HDR.size <= len(data):
                length, mtype, _flags, _seq, _pid = NLMSG_HDR.unpack_from(data, offset)
                if length < NLMSG_HDR.size or offset + length > len(data):
                    raise OSError("conntrack dump: bad netlink length")
                if mtype == NLMSG_DONE:
                    return events
                if mtype == NLMSG_ERROR:
                    (code,) = struct.unpack_from("=i", data, offset + NLMSG_HDR.size)
                    if code:
                        raise OSError(-code, f"conntrack dump refused: {errno.errorcode.get(-code, code)}")
                elif mtype >> 8 == NFNL_SUBSYS_CTNETLINK:
                    try:
                        events.append(parse(data, offset, length, now))
                    except Exception as exc:
                        on_malformed(f"dump: {type(exc).__name__}: {exc}")
                offset += (length + 3) & ~3
    finally:
        sock.close()


def clear_marks(mask: int, on_malformed: Callable[[str], None] | None = None,
                batch: int = 256) -> tuple[int, int]:
    """Clear the `mask` bits of every entry's mark (a new policy: each entry's next packet
    is judged again). Dumps the entries that have the ingress flag, then updates them in
    acknowledged batches. Returns (cleared, failed); an entry gone meanwhile is neither, and
    one re-created on its tuple meanwhile is cleared too (the kernel checks no id on an
    update): harmless, it is judged again like every other."""
    report = on_malformed or (lambda what: LOG.warning("skipped malformed entry: %s", what))
    entries = [e for e in raw_dump(report, CROSSED_PLUMBING) if e.mark & mask]
    cleared = failed = 0
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    try:
        sock.bind((0, 0))
        sock.settimeout(2.0)
        for start in range(0, len(entries), batch):
            chunk = entries[start:start + batch]
            msgs = b"".join(mark_update_message(e.orig.family, e.orig, e.ct_id, 0, mask, i + 1)
                            for i, e in enumerate(chunk))
            sock.send(msgs)
            waiting = set(range(1, len(chunk) + 1))
            while waiting:
                data = sock.recv(1 << 16)
                for seq, code in netlink_acks(data):
                    if seq in waiting:
                        waiting.discard(seq)
                        if code == 0:
                            cleared += 1
                        elif -code != errno.ENOENT:
                            failed += 1
    finally:
        sock.close()
    return cleared, failed


LOOKUP_SECONDS = 1.0  # for the kernel's answer to one lookup request


class RefusedAnswer(OSError):
    """A lookup whose answer the codec refuses (an entry with a one-direction zone): a
    failed lookup, as a timeout is, for every caller. A MalformedEvent let through killed
    the conntrack worker's thread, and every delete and hand-back after it waited for ever."""


def _parsed(found: tuple[bytes, int, int]) -> ConnEvent:
    try:
        return parse_fast(*found, EventKind.DUMP, time.monotonic())
    except MalformedEvent as exc:
        raise RefusedAnswer(f"conntrack lookup: the kernel's answer was refused: {exc}") from None


def _lookup_socket() -> socket.socket:
    """A blocking socket whose receive times out in the kernel (SO_RCVTIMEO): with a
    Python timeout every send and receive is a poll and the call, each letting go of the
    GIL, which 16 API threads and the event loop contend for."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    try:
        sock.bind((0, 0))
        seconds = int(LOOKUP_SECONDS)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                        struct.pack("@ll", seconds, int((LOOKUP_SECONDS - seconds) * 1e6)))
    except BaseException:
        sock.close()
        raise
    return sock


class _Lookups:
    """One thread's lookup socket and its sequence numbers. Kept for the thread's life: a
    socket opened, bound and closed for every lookup was ~15 % of the IDS API's threads'
    time at 1,000 requests a second. Closed when the thread ends (threading.local drops
    it), or when a lookup on it fails."""

    def __init__(self) -> None:
        self.sock = _lookup_socket()
        self.seq = 0
        # (a test's stand-in for the socket has no descriptor: its own send and recv)
        self._receiver = held.Receiver(bytearray(1 << 16)) if isinstance(self.sock, socket.socket) else None

    def _send(self, request: bytes) -> None:
        """The request sent keeping the interpreter's lock (the event loop's: kernel/held.py)."""
        if self._receiver is not None:
            held.sendall(self.sock, request)
        else:
            self.sock.send(request)

    def _received(self) -> bytes:
        """The next datagram: at once if it is there (the kernel answers within the send's
        own system call), else waited for (SO_RCVTIMEO)."""
        if self._receiver is not None:
            try:
                n = self._receiver.recv_into(self.sock.fileno())
                return bytes(self._receiver.buf[:n])
            except BlockingIOError:
                pass
        return self.sock.recv(1 << 16)

    def __del__(self) -> None:
        self.sock.close()

    def ask(self, t: FlowTuple) -> ConnEvent | None:
        """The entry whose original tuple is `t`, or None (the kernel's error: none)."""
        found = self.ask_raw(t)
        return None if found is None else _parsed(found)

    def ask_raw(self, t: FlowTuple) -> tuple[bytes, int, int] | None:
        """The kernel's answer for the entry whose original tuple is `t`, as (datagram,
        offset, length), or None (the kernel's error: none). Only the answer carrying this
        request's sequence number is taken: anything else on the socket is an earlier
        request's, late."""
        self.seq = self.seq % 0xFFFFFFFF + 1
        self._send(get_message(t, self.seq))
        deadline = time.monotonic() + LOOKUP_SECONDS
        while True:
            try:
                data = self._received()
            except BlockingIOError:  # SO_RCVTIMEO passed
                raise TimeoutError("conntrack lookup: no answer") from None
            offset = 0
            while offset + NLMSG_HDR.size <= len(data):
                length, mtype, _flags, seq, _pid = NLMSG_HDR.unpack_from(data, offset)
                if length < NLMSG_HDR.size or offset + length > len(data):
                    raise OSError("conntrack lookup: bad netlink length")
                if seq == self.seq:
                    if mtype >> 8 == NFNL_SUBSYS_CTNETLINK:
                        return data, offset, length
                    return None
                offset += (length + 3) & ~3
            if time.monotonic() >= deadline:  # late answers only, for the whole wait
                raise TimeoutError("conntrack lookup: no answer")


_LOOKUPS = threading.local()


def _asked(ask: Callable[[_Lookups], T]) -> T:
    """`ask` on the calling thread's lookup socket (opened on first use). After any error
    the socket is dropped, and with it any answer still to come: the next lookup opens
    another."""
    own: _Lookups | None = getattr(_LOOKUPS, "own", None)
    if own is None:
        own = _LOOKUPS.own = _Lookups()
    try:
        return ask(own)
    except BaseException:
        _LOOKUPS.own = None
        own.sock.close()
        raise


def lookup(t: FlowTuple) -> ConnEvent | None:
    """The live conntrack entry of a connection named by either direction's tuple (an IDS
    names it as it saw it), or None; one request each way on the calling thread's own
    socket (the IDS API's threads call it, never the event loop)."""
    return _asked(lambda own: own.ask(t) or own.ask(t.reversed()))


def entry_of(orig: FlowTuple) -> ConnEvent | None:
    """The entry whose original tuple is exactly `orig` now, or None: one request on the
    calling thread's socket (the conntrack worker checks an update's entry with it)."""
    return _asked(lambda own: own.ask(orig))


def lookup_counted(t: FlowTuple) -> tuple[ConnEvent, EntryCounts] | None:
    """`lookup` with the entry's counters, zone and timestamps (nfshunt explain; its own
    socket, as lookup's, for the calling thread)."""
    found = _asked(lambda own: own.ask_raw(t) or own.ask_raw(t.reversed()))
    if found is None:
        return None
    return _parsed(found), parse_counts(*found)


ACCT_SYSCTL = "/proc/sys/net/netfilter/nf_conntrack_acct"
TIMESTAMP_SYSCTL = "/proc/sys/net/netfilter/nf_conntrack_timestamp"


def sysctl_on(path: str) -> bool | None:
    """A 0/1 sysctl of this network namespace (procfs shows the reader's); None: missing."""
    try:
        with open(path) as fh:
            return fh.read().strip() == "1"
    except OSError:
        return None


def dump_entries() -> Iterable[ConnEvent]:
    """A one-off synchronous dump (tests, status tools)."""
    return raw_dump(lambda what: LOG.warning("skipped malformed entry: %s", what))
