"""The switch channel: who may be the switch, how a dead connection is noticed, and the
one send path (flow-mods batched behind one barrier, errors matched to their batch).

os-ken's Datapath ends a connection by killing its send and echo threads and joining
them; on the native-thread hub a kill does nothing, so the join waited for ever on a
sender blocked on its empty queue: the DEAD state was never reported and a switch that
came back was refused as a second switch (issue 11.1). ChannelDatapath wakes its sender
instead, and refuses peers the config does not allow before they say anything.
"""
from __future__ import annotations

import collections
import contextlib
import fcntl
import ipaddress
import logging
import socket
import ssl
import struct
import termios
import threading
import time
from typing import Any, Callable

from os_ken.base import app_manager  # noqa: F401  (os-ken's import order: before its controller)
from os_ken.controller import controller as osken_controller
from os_ken.controller.handler import DEAD_DISPATCHER
from os_ken.lib import hub

from nfshunt.core.connection import Conn
from nfshunt.kernel import held
from nfshunt.observe.logs import RateLimitedLog
from nfshunt.records.model import OFP10

from .flows import FlowBuilder
from .inflight import Barrier, Batch, ChangeWatch, InFlight
from .stats import FlowEntry, flow_removed

LOG = logging.getLogger("nfshunt.channel")
TCPI_BYTES_ACKED = 120  # offset in struct tcp_info (include/uapi/linux/tcp.h); bytes_received follows
TCPI_BYTES = struct.Struct("=QQ")
SEND_CHUNK = 256 * 1024  # bytes a write to the switch gets the socket timeout for
# Installs behind one barrier at most: a burst confirms as the switch goes, and a switch
# answering barriers is seen to progress (one barrier behind 93,000 pairs went 16 s
# unanswered and the whole burst was rolled back).
BATCH_PAIRS = 1000


Admit = Callable[[tuple[str, int]], str | None]  # the peer's address -> None to admit, or why not
Failed = Callable[[tuple[str, int], Exception], None]  # a connection failed on what the peer sent


def _admit_any(address: tuple[str, int]) -> str | None:
    return None


def _ignore_failure(address: tuple[str, int], exc: Exception) -> None:
    return None


class ChannelDatapath(osken_controller.Datapath):
    """os-ken's Datapath with an admission check and an end that does not hang."""
    send_q: Any  # os-ken's send queue; None once the send loop ended

    def __init__(self, sock: Any, address: tuple[str, int], admit: Admit = _admit_any,
                 failed: Failed = _ignore_failure):
        # Buffers queued for the send thread and not yet all written (see send()).
        self._order = threading.Lock()
        self._unsent = 0
        # Only a plain TCP socket's bytes may be written to its descriptor: TLS frames its own.
        self._writes_now = isinstance(sock, socket.socket) and not isinstance(sock, ssl.SSLSocket)
        super().__init__(sock, address)
        self._admit = admit
        self._failed = failed

    def serve(self) -> None:
        refusal = self._admit(self.address)
        if refusal is not None:
            self.is_active = False
            try:
                self.socket.close()
            except OSError:
                pass
            return
        hub.spawn(self._send_loop)
        self.send_msg(self.ofproto_parser.OFPHello(self))
        hub.spawn(self._echo_request_loop)
        try:
            self._recv_loop()
        finally:
            self.is_active = False
            self._wake_sender()

    def _send_loop(self) -> None:
        """os-ken's send loop, writing each buffer in chunks. Python gives one sendall the
        socket timeout (5 s) in total: a batch of 100,000 pairs (14 MB) to a switch
        applying ~6,000 pairs a second outlasted it, the write stopped mid-message, and the
        switch dropped the connection on the broken stream."""
        try:
            while self.state != DEAD_DISPATCHER:
                buf, close_socket = self.send_q.get()
                self._send_q_sem.release()
                view = memoryview(buf)
                for at in range(0, len(view), SEND_CHUNK):
                    self._write(view[at:at + SEND_CHUNK])
                if close_socket:
                    break
                with self._order:
                    self._unsent -= 1
        except OSError as exc:  # socket.timeout included
            LOG.warning("sending to the switch at %s failed: %s; closing the connection",
                        self.address[0], "it took nothing for the socket timeout" if isinstance(exc, TimeoutError)
                        else exc)
        finally:
            q, self.send_q = self.send_q, None  # no new sends; release everyone waiting on one
            try:
                while q.get(block=False):
                    self._send_q_sem.release()
            except hub.QueueEmpty:
                pass
            self._close_write()

    def _write(self, data: memoryview) -> None:
        """All of data. A switch that takes nothing for the socket timeout (5 s) is waited
        for while the echo loop still finds it working (its replies arrive): under a burst of
        30,000 pairs on a loaded machine Open vSwitch read nothing for 5 s while it applied
        what it had, and the connection was dropped with every pending shunt. The echo loop
        is the one judge of a switch's life; without echoes a silent 5 s ends it as before."""
        while data:
            try:
                data = data[self.socket.send(data):]
            except TimeoutError:
                if self.state == DEAD_DISPATCHER or self.max_unreplied_echo_requests < 0:
                    raise
                LOG.warning("the switch at %s took nothing for the socket timeout; it still works by its "
                            "echoes: waiting", self.address[0])

    def send(self, buf: bytes, close_socket: bool = False) -> bool:
        """`buf` written at once by the calling thread when nothing waits to be sent before
        it, else queued for the send thread. Handing every buffer to the send thread cost a
        shunt a thread hand-over on its way to the switch: 0.28 ms median, 2.85 ms p90 on the
        testbed (bench/results/2026-11-27). The write never blocks (the socket's descriptor
        is non-blocking: os-ken gives it a timeout); what the socket does not take at once
        is queued, and while anything is queued everything after it is too, so the switch
        gets the bytes in the order they were sent. Over TLS every buffer goes to the send
        thread, as before."""
        if not close_socket and self._writes_now and self._write_now(buf):
            return True
        with self._order:
            self._unsent += 1
        if super().send(buf, close_socket):
            return True
        with self._order:  # (the connection is ending: discarded, as os-ken does)
            self._unsent -= 1
        return False

    def _write_now(self, buf: bytes) -> bool:
        """True: `buf` is the switch's (written, or its rest queued first in line)."""
        with self._order:
            q = self.send_q
            if self._unsent or q is None or self.socket.gettimeout() is None:  # (None: a blocking descriptor)
                return False
            try:
                # (the interpreter's lock kept: letting go of it for a microsecond's write made
                # the loop wait for it behind another thread, up to 5 ms: kernel/held.py)
                written = held.send(self.socket.fileno(), buf)
            except BlockingIOError:
                written = 0
            except (OSError, ValueError):  # failed or closed: the send thread meets it and ends the connection
                return False
            if written == len(buf):
                return True
            # Room in the queue: nothing of ours is in it. (Were it full, waiting here is safe:
            # the send thread makes room before it needs the lock we hold.)
            self._send_q_sem.acquire()
            self._unsent += 1
            q.put((buf[written:], False))
            return True

    def _queue_echo(self, buf: bytes) -> bool:
        """An echo request queued without waiting: with the queue full behind a switch that
        reads nothing, waiting for room would stop the echo loop from judging it."""
        q = self.send_q
        if q is None or not self._send_q_sem.acquire(blocking=False):
            return False
        with self._order:
            self._unsent += 1
        q.put((buf, False))
        return True

    def _echo_request_loop(self) -> None:
        """os-ken's liveness check, except that a switch shown to be working is alive,
        answered echo or not. An echo waits behind everything sent before it, both ways:
        under a burst a healthy switch went 1.2 s without answering (behind 30,000
        flow-mods it was still applying, or behind 60,000 flow-removed the controller was
        still reading), was dropped, and every pair was sent again. Working means, since
        the last echo: its TCP delivered bytes to us (a barrier reply, a flow-removed), or,
        with flow-mods waiting for it, acknowledged more of them (a hung switch process
        stops reading, so the acknowledgements stop). A switch that vanished does neither,
        and the unanswered echoes end the connection as before."""
        if self.max_unreplied_echo_requests < 0:  # (os-ken reads 0 as no echoes: `echo_misses: 1`
            return                                # then turned the check off instead of ending at one miss)
        backlog, seen = False, self._tcp_counts()
        while self.send_q and len(self.unreplied_echo_requests) <= self.max_unreplied_echo_requests:
            now = self._tcp_counts()
            # A backlog at either end of the turn: a switch that reads as fast as we write can
            # have acknowledged every byte the moment one end is looked at, the sender blocked
            # on its next write (a unit test's switch, 64 KB read every 5 ms, went 0.4 s with
            # 2.6 MB acknowledged and the queue empty at both looks before, and was given up).
            outq = self._ioctl(termios.TIOCOUTQ)
            if now[1] > seen[1] or self.unread() or ((backlog or outq > 0) and now[0] > seen[0]):
                self.unreplied_echo_requests.clear()
            backlog, seen = outq > 0, now
            echo = self.ofproto_parser.OFPEchoRequest(self)
            xid = self.set_xid(echo)
            echo.serialize()
            # Not queued (the queue is full): the turn counts as unanswered all the same,
            # unless the switch shows it is working through the backlog.
            self.unreplied_echo_requests.append(xid if self._queue_echo(echo.buf) else -1)
            hub.sleep(self.echo_request_interval)
        if self.send_q:  # not ended by the other side or a failed write
            LOG.warning("the switch at %s answered no echo for %.1f s and sent or took nothing meanwhile; "
                        "closing the connection", self.address[0],
                        len(self.unreplied_echo_requests) * self.echo_request_interval)
        self.close()

    def unread(self) -> int:
        """Bytes from the switch waiting in the socket's receive queue."""
        return self._ioctl(termios.FIONREAD)

    def _tcp_counts(self) -> tuple[int, int]:
        """(bytes the switch acknowledged, bytes received from it): tcp_info's
        tcpi_bytes_acked and tcpi_bytes_received (Linux 4.1+); zeros if unavailable."""
        try:
            info = self.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        except (OSError, ValueError):
            return 0, 0
        return TCPI_BYTES.unpack_from(info, TCPI_BYTES_ACKED) if len(info) >= TCPI_BYTES_ACKED + 16 else (0, 0)

    def _ioctl(self, request: int) -> int:
        try:
            return struct.unpack("i", fcntl.ioctl(self.socket.fileno(), request, b"\0\0\0\0"))[0]
        except (OSError, ValueError):  # closed meanwhile
            return 0

    def _wake_sender(self) -> None:
        """Unblock the send thread so it exits (native threads cannot be killed): an empty
        write to the closed socket fails, and the send loop ends on the error."""
        q = self.send_q
        if q is not None and self._send_q_sem.acquire(blocking=False):
            try:
                q.put_nowait((b"", True))
            except Exception:
                self._send_q_sem.release()


class TableSize:
    """Table features with only the fixed part read (table id, max_entries): os-ken reads
    every property of every table, about a second for Open vSwitch's 254 tables on the
    thread that also reads echo and barrier replies. NFShunt needs table 0's size only."""

    _FIXED = struct.Struct("!HB5x32sQQII")  # ofp_table_features up to its properties

    def __init__(self, length: int, table_id: int, max_entries: int):
        self.length = length
        self.table_id = table_id
        self.max_entries = max_entries

    @classmethod
    def parser(cls, buf: Any, offset: int) -> "TableSize":
        length, table_id, _name, _match, _write, _config, max_entries = cls._FIXED.unpack_from(buf, offset)
        if length < cls._FIXED.size:
            raise ValueError(f"table features entry of length {length}")
        return cls(length, table_id, max_entries)


class _ParseErrors(logging.Filter):
    """os-ken logs each message it cannot parse with a traceback and a hex dump, and drops
    it: a peer could fill the log. Each is counted (`failed`) and at most one in 10 s is
    logged."""

    def __init__(self, failed: Failed) -> None:
        super().__init__()
        self._limit = RateLimitedLog(LOG)
        self._failed = failed

    def filter(self, record: logging.LogRecord) -> bool:
        self._failed(("?", 0), ValueError("an OpenFlow message os-ken could not parse"))
        held = self._limit.allow("parse")
        if held is None:
            return False
        if held:
            record.msg = f"{record.msg} ({held} more like this since the last report)"
        return True


def install_connection_factory(admit: Admit = _admit_any, failed: Failed = _ignore_failure) -> None:
    """os-ken's listener takes its connection factory by name from its module when it
    starts; this one serves each connection with ChannelDatapath, asking `admit` first and
    telling `failed` of what the peer broke. (Rebinding its Datapath name instead would
    break that class's own super() calls.) os-ken's parse errors are counted through
    `failed` too. Table features replies are read with TableSize, flow stats with
    FlowEntry, flow-removed without its match: os-ken keeps its parsers in module tables,
    so these are set for the process, whose one os-ken application is NFShunt's."""
    def connection(sock: Any, address: tuple[str, int]) -> None:
        with contextlib.closing(ChannelDatapath(sock, address, admit, failed)) as dp:
            try:
                dp.serve()
            except Exception as exc:  # a malformed message from the peer: this connection ends
                failed(address, exc)
    osken_controller.datapath_connection_factory = connection
    parse_log = logging.getLogger("os_ken.ofproto.ofproto_parser")
    for old in [f for f in parse_log.filters if isinstance(f, _ParseErrors)]:
        parse_log.removeFilter(old)
    parse_log.addFilter(_ParseErrors(failed))
    from os_ken.ofproto import ofproto_v1_3, ofproto_v1_3_parser
    ofproto_v1_3_parser.OFPTableFeaturesStatsReply.cls_stats_body_cls = TableSize
    ofproto_v1_3_parser.OFPFlowStatsReply.cls_stats_body_cls = FlowEntry
    ofproto_v1_3_parser._MSG_PARSERS[ofproto_v1_3.OFPT_FLOW_REMOVED] = flow_removed


def address_allowed(address: str, allowed: tuple[str, ...]) -> bool:
    if not allowed:
        return True
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in ipaddress.ip_network(a, strict=False) for a in allowed)


class Pacer:
    """A token bucket of flow-mods a second (a hardware switch takes hundreds to a few
    thousand). Removals and defaults always go out and may overdraw it: installs wait."""

    def __init__(self, rate: float, now: float):
        self.rate = rate
        self.burst = max(8.0, rate / 10)  # a tenth of a second's worth at once
        self.tokens = self.burst
        self.stamp = now

    def refill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now


class SendPath:
    """Messages of one event-loop turn, concatenated and written once, with a barrier when
    an install needs confirming (registered in flight with its batch: inflight.py), and,
    with a flow-mod rate, the queue of installs waiting for their turn (their connections
    stay on the slow path meanwhile, conntrack entries kept)."""

    def __init__(self, dp: Any, fb: FlowBuilder, inflight: InFlight, rate: float = 0, queue_max: int = 0,
                 wanted: Callable[[Conn], bool] = lambda conn: True, clock: Callable[[], float] = time.monotonic):
        self.dp = dp
        self.fb = fb
        self.inflight = inflight
        self.clock = clock  # the event loop's (monotonic): when a barrier was asked
        self.pacer = Pacer(rate, clock()) if rate else None
        self.queue_max = queue_max
        self.wanted = wanted  # a queued install the core no longer wants is dropped, not sent
        self.queued: collections.deque[Conn] = collections.deque()
        self.out: list[Any] = []
        self._conns: list[Conn] = []  # installs waiting for the next barrier
        self._xids: dict[int, Conn] = {}  # their flow-mods' xids
        self.hold = 0  # > 0: turns held together (Dispatcher.held), written once when they end

    def queue(self, msgs: list[Any]) -> None:
        self.out.extend(msgs)
        if self.pacer is not None:
            self.pacer.tokens -= len(msgs)

    def queue_watched(self, msgs: list[Any], whats: list[Callable[[], str]], watch: ChangeWatch | None) -> None:
        """Queue flow-mods of a change whose every one must be confirmed: their xids go to
        `watch` (with what says what each does), which the barrier of this turn's flush answers."""
        if watch is not None:
            for msg, what in zip(msgs, whats, strict=True):
                watch.xids[self.dp.set_xid(msg)] = what
        self.queue(msgs)

    def install(self, conn: Conn) -> bool:
        """Send (or, paced, queue) a pair's flow-mods; False: the queue is full."""
        if self.pacer is not None:
            if len(self.queued) >= self.queue_max:
                return False
            self.queued.append(conn)
            return True
        self._send_install(conn)
        return True

    def release(self, now: float) -> list[Conn]:
        """Queued installs the bucket has room for go out; returns those dropped because the
        core no longer wants them (taken down or forgotten while they waited)."""
        if self.pacer is None or not self.queued:
            return []
        self.pacer.refill(now)
        dropped = []
        while self.queued:
            conn = self.queued[0]
            if not self.wanted(conn):
                dropped.append(self.queued.popleft())
                continue
            cost = self.fb.install_cost(conn)
            if self.pacer.tokens < cost:
                break
            self.queued.popleft()
            self.pacer.tokens -= cost
            self._send_install(conn)
        return dropped

    def _send_install(self, conn: Conn) -> None:
        dp = self.dp
        for msg in self.fb.install(conn):
            self.out.append(msg)
            self._xids[dp.set_xid(msg)] = conn
        self._conns.append(conn)
        if len(self._conns) >= BATCH_PAIRS:
            self._close_batch()

    def _close_batch(self, waiter: threading.Event | None = None) -> None:
        """A barrier behind what is queued; the installs since the last one are its batch."""
        barrier = self.fb.barrier()
        xid = self.dp.set_xid(barrier)
        self.out.append(barrier)
        batch = None
        if self._conns:
            batch = Batch(self._conns, self._xids)
            self._conns, self._xids = [], {}
        self.inflight.ask(xid, Barrier(self.clock(), batch, waiter))

    def error(self, xid: int, reason: str, table_full: bool) -> Conn | None:
        """An error message: the install it concerns (recorded as failed in its batch), if
        any. Only sent batches can draw errors, and few are in flight."""
        for _, barrier in self.inflight.of(Barrier):
            batch = barrier.batch
            if batch is not None and (conn := batch.xids.get(xid)) is not None:
                batch.failed[id(conn)] = (reason, table_full)
                return conn
        return None

    def refused_change(self, xid: int, reason: str) -> str | None:
        """An error for a flow-mod of a watched change (recorded in its ChangeWatch): what
        that flow-mod did; None if it was none of theirs."""
        for _, barrier in self.inflight.of(Barrier):
            if (what := barrier.refused(xid, reason)) is not None:
                return what
        return None

    def pending(self) -> int:
        """Installs sent and not yet confirmed, and installs waiting for their turn."""
        return sum(len(b.batch.conns) for _, b in self.inflight.of(Barrier) if b.batch is not None) \
            + len(self._conns) + len(self.queued)

    def flush(self, waiter: threading.Event | None = None) -> None:
        """The turn's messages behind a barrier (if an install or `waiter` needs one),
        written now, or by `write` once the turns held together end (`hold`)."""
        if self._conns or waiter is not None:
            self._close_batch(waiter)
        if not self.hold:
            self.write()

    def write(self) -> None:
        dp = self.dp
        if not self.out:
            return
        buf = bytearray()
        for msg in self.out:
            if msg.xid is None:
                dp.set_xid(msg)
            msg.serialize()
            buf += msg.buf
        self.out.clear()
        dp.send(bytes(buf))


def table_full(msg: Any) -> bool:
    ofp = msg.datapath.ofproto
    if ofp.OFP_VERSION == OFP10:
        return msg.type == ofp.OFPET_FLOW_MOD_FAILED and msg.code == ofp.OFPFMFC_ALL_TABLES_FULL
    return msg.type == ofp.OFPET_FLOW_MOD_FAILED and msg.code == ofp.OFPFMFC_TABLE_FULL
