"""ConntrackListener: a thread that reads NEW/UPDATE/DESTROY events from a multicast
netlink socket with a large receive buffer (filtered in the kernel: event_filter) and hands
them over in batches. When the kernel reports ENOBUFS (events were dropped), it says so, so
the owner can resync from a dump.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import select
import socket
import struct
import threading
import time
from typing import Callable

from nfshunt.records.model import ConnEvent

from . import held
from .codec import (
    BPF_INSN,
    NETLINK_NETFILTER,
    NFNLGRP_CONNTRACK_DESTROY,
    NFNLGRP_CONNTRACK_NEW,
    NFNLGRP_CONNTRACK_UPDATE,
    SO_ATTACH_FILTER,
    SO_RCVBUFFORCE,
    event_filter,
    parse_datagram,
)

LOG = logging.getLogger("nfshunt.conntrack")

def attach_filter(sock: socket.socket, program: list[tuple[int, int, int, int]]) -> None:
    code = b"".join(BPF_INSN.pack(*ins) for ins in program)
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("HL", len(program), ctypes.addressof(buf))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)


LOSS_REPORT_MAX = 1.0  # seconds a loss may wait for the event queue to drain before a dump
# Events read from the socket and handed to the event loop at once. A turn's flow-mods go
# out in one write, and the loop waits while the switch takes them: with 1,000, a status
# read during a 100,000 burst waited up to 1.7 s (median 0.7); with 250, up to 0.7 s
# (median 0.26), for 5-10 % less burst speed (bench/results/2026-11-23/coalesce-d/).
COALESCE_MAX = 250
WAKE = 0.5  # seconds the listener waits for an event before it looks whether stop() was asked


class ConntrackListener:
    def __init__(self, rcvbuf: int, on_events: Callable[[list[ConnEvent]], None],
                 on_overflow: Callable[[], None], on_malformed: Callable[[str], None]):
        self.rcvbuf = rcvbuf
        self.on_events = on_events
        self.on_overflow = on_overflow
        self.on_malformed = on_malformed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.sock = self._open()  # opened up front so a failure is reported at start-up

    def _open(self) -> socket.socket:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, self.rcvbuf)
        except PermissionError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
        try:
            attach_filter(sock, event_filter())
        except OSError as exc:  # the parser still copes; it just reads everything
            LOG.warning("cannot filter conntrack events in the kernel: %s", exc)
        sock.bind((0, NFNLGRP_CONNTRACK_NEW | NFNLGRP_CONNTRACK_UPDATE | NFNLGRP_CONNTRACK_DESTROY))
        return sock  # blocking: the waits are select()'s (WAKE), each read MSG_DONTWAIT

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="conntrack-listener", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self.sock.close()

    def _run(self) -> None:
        buf = bytearray(1 << 18)
        view = memoryview(buf)
        receiver = held.Receiver(buf)
        lost_since: float | None = None  # an ENOBUFS not yet answered by a dump request
        while not self._stop.is_set():
            if lost_since is not None:
                lost_since = self._report_loss(lost_since)
            try:
                if not select.select([self.sock], [], [], WAKE)[0]:
                    continue
                n = self.sock.recv_into(buf, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:  # (woken for nothing)
                continue
            except ValueError:  # closed by stop()
                return
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    if lost_since is None:
                        lost_since = time.monotonic()
                    continue
                if self._stop.is_set():
                    return
                LOG.error("conntrack netlink socket failed: %s; reopening", exc)
                time.sleep(0.5)
                try:
                    self.sock.close()
                    self.sock = self._open()
                except OSError as exc2:
                    LOG.error("cannot reopen conntrack socket: %s", exc2)
                self.on_overflow()  # events may have been missed meanwhile
                continue
            events = parse_datagram(bytes(view[:n]), time.monotonic(), self.on_malformed)
            if self._coalesce(events, receiver, view):
                lost_since = lost_since or time.monotonic()
            if events:
                self.on_events(events)

    def _coalesce(self, events: list[ConnEvent], receiver: held.Receiver, view: memoryview) -> bool:
        """Add what else is queued (up to COALESCE_MAX events) to one hand-over: under a
        burst the event loop takes them in one turn and one write to the switch, not a
        turn each (bursts of 10,000 ran 2-3 times faster); at low load the queue is empty
        and nothing waits. True if the kernel reported a loss."""
        while len(events) < COALESCE_MAX:
            # One read a datagram until the queue is empty: a select() before each, and the
            # poll() Python makes before a read on a socket with a timeout, were three system
            # calls a datagram (the listener was the burst's largest cost: 17 % of the
            # controller's samples at 20,000 entries, bench/results/2026-11-27). Each read
            # keeps the interpreter's lock (kernel/held.py): the thread does not wait for the
            # event loop to let go of it for every datagram of the batch.
            try:
                n = receiver.recv_into(self.sock.fileno())
            except BlockingIOError:
                return False
            except OSError as exc:  # the main loop deals with the rest
                return exc.errno == errno.ENOBUFS
            events.extend(parse_datagram(bytes(view[:n]), time.monotonic(), self.on_malformed))
        return False

    def _report_loss(self, since: float) -> float | None:
        """Ask for a dump once the socket's queue is empty; returns when to ask again.

        The kernel reports ENOBUFS once per congestion: events it drops after that, until
        the queue has been read empty, are dropped without a word. A dump started earlier
        can miss an entry whose event is dropped in that window, and nothing would ever
        ask again (a burst left 1-16 of 30,000 entries unshunted). So the dump is asked
        for when the queue is empty (every drop from then on is reported again), or after
        LOSS_REPORT_MAX under a storm that never lets it drain, and then once more when
        it does."""
        readable, _, _ = select.select([self.sock], [], [], 0)
        now = time.monotonic()
        if not readable:
            self.on_overflow()
            return None
        if now - since >= LOSS_REPORT_MAX:
            self.on_overflow()
            return now
        return since
