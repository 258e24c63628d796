"""ConntrackWorker: a thread that deletes, updates and re-creates entries (batched,
acknowledged) and dumps the table, so that none of it ever blocks the OpenFlow event loop.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from nfshunt.records.markcodec import DECISION_MASK
from nfshunt.records.model import TCP_CLOSING, ConnEvent, EntryCounts, EventKind, FlowTuple, NatRange

from .codec import (
    CROSSED_PLUMBING,
    NETLINK_NETFILTER,
    delete_message,
    destroyed_entries,
    liberal_message,
    mark_update_message,
    netlink_acks,
    parse_counts,
    parse_fast,
    restore_message,
    timeout_message,
)
from .table import clear_marks, entry_of, raw_dump

LOG = logging.getLogger("nfshunt.conntrack")
FAILURE_LOG_INTERVAL = 10.0  # seconds between two tracebacks of the worker's failures


# The worker's requests. Deletes, liberal marks and restores go in lists (a turn's worth
# in one netlink write); a clear, a callback, a dump and the stop (None) go on their own.
#
# An entry's id does not name it for good. The kernel checks it on a delete only; an update
# (liberal, timeout, mark) changes whatever entry holds the tuple. And the id is a hash of
# the entry's memory and tuple: an entry re-created on the tuple (a client reusing its port
# reopens a TIME_WAIT or CLOSE entry) mostly gets the old one's memory, so its id (measured
# on 6.18: 20 of 20 reopens). docs/behaviour.md says what each request risks from that.
@dataclass(frozen=True, slots=True)
class Delete:
    family: int
    orig: FlowTuple
    ct_id: int | None  # with an id the kernel refuses another entry (not a re-created one: see above)
    echo: bool = False  # its last counters go to `on_counted` (the kernel echoes the destroy event)


@dataclass(frozen=True, slots=True)
class Liberal:
    family: int
    orig: FlowTuple
    ct_id: int  # not checked (see above): a lookup first would cost ~40 us a TCP shunt


@dataclass(frozen=True, slots=True)
class Expire:
    family: int
    orig: FlowTuple
    ct_id: int
    timeout: int

    def meant_for(self, entry: ConnEvent | None) -> bool:
        """Whether `entry`, the one holding the tuple now, is still the closing entry this
        was asked for. One re-created on the tuple has the same id as often as not (see
        above) but begins in an opening state; given the short timeout, a new connection
        idle for it would lose its entry (behind a strict firewall, the connection)."""
        return entry is not None and entry.ct_id == self.ct_id and entry.tcp_state in TCP_CLOSING


@dataclass(frozen=True, slots=True)
class Undecide:
    family: int
    orig: FlowTuple
    ct_id: int  # not checked (an update): a NAT pair's kept entry, the one on its tuple


@dataclass(frozen=True, slots=True)
class Refresh:
    family: int
    orig: FlowTuple
    ct_id: int  # not checked (an update): a NAT pair's kept entry, the one on its tuple
    timeout: int


@dataclass(frozen=True, slots=True)
class Restore:
    family: int
    orig: FlowTuple
    reply: FlowTuple
    tcp_state: int
    timeout: int
    closer_is_reply: bool
    mark: int
    done: Callable[[], None]  # runs after the kernel answered, whatever it answered
    # A NAT pair's translations: the kept entry is updated (no create); only if it is gone
    # (ENOENT) is it created with them, its reply the original reversed (`create`; F13/F14).
    nat: tuple[NatRange, ...] = ()
    create: bool = False

    def message(self, seq: int) -> bytes:
        if not self.nat:
            return restore_message(self.family, self.orig, self.reply, self.tcp_state, self.timeout,
                                   self.closer_is_reply, self.mark, seq)
        if not self.create:  # (the reply tuple is not read on an update)
            return restore_message(self.family, self.orig, self.reply, self.tcp_state, self.timeout,
                                   self.closer_is_reply, self.mark, seq, create=False)
        return restore_message(self.family, self.orig, self.orig.reversed(), self.tcp_state, self.timeout,
                               self.closer_is_reply, self.mark, seq, nat=self.nat)


@dataclass(frozen=True, slots=True)
class ClearMarks:
    mask: int
    done: Callable[[int, int, str | None], None]


@dataclass(frozen=True, slots=True)
class Call:
    callback: Callable[[], None]


@dataclass(frozen=True, slots=True)
class LookUp:
    orig: FlowTuple
    done: Callable[[ConnEvent | None, str | None], None]  # (the entry or None, why it failed)


@dataclass(frozen=True, slots=True)
class Dump:
    pass


Request = Delete | Liberal | Expire | Refresh | Undecide | Restore  # batched: one netlink message each
_DUMP = Dump()


class ConntrackWorker:
    """Deletes and dumps on a thread of their own; results come back through callbacks."""

    def __init__(self, on_dump: Callable[[list[ConnEvent]], None],
                 on_malformed: Callable[[str], None], batch: int = 256,
                 on_failed: Callable[[], None] = lambda: None):
        self.on_dump = on_dump
        self.on_malformed = on_malformed
        self.on_failed = on_failed
        self._failure_logged = -FAILURE_LOG_INTERVAL
        # A counted delete's entry as the kernel destroyed it (its tuple, id, counters):
        # the pair's accounting record takes the slow path's share from it. Worker thread.
        self.on_counted: Callable[[FlowTuple, int, EntryCounts], None] | None = None
        self.batch = batch
        self.q: queue.Queue = queue.Queue()  # lists of requests; dump, clear and stop on their own
        self._local = threading.local()
        self._seq = 0
        self.deleted = 0
        self.delete_missing = 0
        self.restored = 0
        self.stale = 0  # expires not sent: the tuple's entry is no longer the one asked for
        self._retry: list[Request] = []  # NAT restores whose kept entry was gone (Restore.nat)
        self._dump_lock = threading.Lock()
        self._dump_queued = False
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.bind((0, 0))
        self.sock.settimeout(2.0)
        self._thread = threading.Thread(target=self._run, name="conntrack-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.q.put(None)
        self._thread.join(timeout=5)
        self.sock.close()

    def _put(self, item: Request) -> None:
        held = getattr(self._local, "held", None)
        if held is not None:
            held.append(item)
        else:
            self.q.put([item])

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Deletes, liberal marks and restores asked for on this thread inside go to the
        worker together when it ends: one wake-up and one netlink write for an event-loop
        turn's worth, not one a shunt (each wake-up took the GIL from the event loop)."""
        if getattr(self._local, "held", None) is not None:  # nested: the outer one hands over
            yield
            return
        held: list[Request] = []
        self._local.held = held
        try:
            yield
        finally:
            self._local.held = None
            if held:
                self.q.put(held)

    def delete(self, family: int, orig: FlowTuple, ct_id: int | None, counted: bool = False) -> None:
        """Delete an entry; `counted` (a shunt's own entry, accounting on): its last
        counters go to `on_counted`."""
        self._put(Delete(family, orig, ct_id, counted and self.on_counted is not None))

    def restore(self, family: int, orig: FlowTuple, reply: FlowTuple, tcp_state: int, timeout: int,
                closer_is_reply: bool, mark: int, done: Callable[[], None], nat: tuple[NatRange, ...] = ()) -> None:
        """Create a TCP entry in the given state (see core: teardown, re-evaluation, idle
        shunts), or bring the entry that exists to it (one kept until the slow path drained,
        or one a straggler re-created); `done` runs after the kernel answered, whatever it
        answered. A NAT pair's entry (`nat`) is updated if it exists, else created with its
        translations (Restore.nat)."""
        self._put(Restore(family, orig, reply, tcp_state, timeout, closer_is_reply, mark, done, nat))

    def liberal(self, family: int, orig: FlowTuple, ct_id: int) -> None:
        """Stop window tracking of a TCP entry (both directions BE_LIBERAL): while a switch
        applies a pair's flows one direction at a time, the firewall sees acknowledgements
        of data that took the fast path, which it would otherwise call INVALID. Whatever
        entry holds the tuple when it is sent gets it (see Liberal)."""
        self._put(Liberal(family, orig, ct_id))

    def expire(self, family: int, orig: FlowTuple, ct_id: int, timeout: int) -> None:
        """Give an existing closing entry `timeout` seconds (its traffic renews it as usual);
        not sent if the tuple's entry is no longer that one (Expire.meant_for)."""
        self._put(Expire(family, orig, ct_id, timeout))

    def refresh(self, family: int, orig: FlowTuple, ct_id: int, timeout: int) -> None:
        """Give a NAT pair's kept entry `timeout` seconds (core/nat.py), whatever its state."""
        self._put(Refresh(family, orig, ct_id, timeout))

    def clear_decision(self, family: int, orig: FlowTuple, ct_id: int) -> None:
        """Clear the decision bits of one entry (a UDP NAT pair's kept one): its next
        packet is judged by the policy again."""
        self._put(Undecide(family, orig, ct_id))

    def clear_marks(self, mask: int, done: Callable[[int, int, str | None], None]) -> None:
        """Clear the `mask` bits of every entry that has any of them; `done(cleared,
        failed, error)` runs on this thread once the kernel has answered."""
        self.q.put(ClearMarks(mask, done))

    def look_up(self, orig: FlowTuple, done: Callable[[ConnEvent | None, str | None], None]) -> None:
        """The entry whose original tuple is `orig` now (an adopted NAT pair's kept one);
        `done(entry or None, None)` runs on this thread, `done(None, why)` if the kernel could
        not be asked. Queued on its own: before a dump asked after it."""
        self.q.put(LookUp(orig, done))

    def after(self, callback: Callable[[], None]) -> None:
        """Run `callback` on this thread once every request queued before it is answered."""
        self.q.put(Call(callback))

    def dump(self) -> None:
        """Ask for a dump; requests made while one is already queued share it (a burst of
        lost events must not queue a dump per loss, ahead of the deletes)."""
        with self._dump_lock:
            if self._dump_queued:
                return
            self._dump_queued = True
        self.q.put(_DUMP)

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            try:
                self._serve(item)
            except Exception:
                # Whatever one request meets, the thread goes on: were it to end, every delete
                # and hand-back queued after it would wait for ever, and no shunt would be
                # taken down.
                self._failed("conntrack worker: a request failed; the worker goes on")

    def _serve(self, item: object) -> None:
        match item:
            case list():  # deletes, liberal marks and restores
                self._requests(item)
            case Dump():
                with self._dump_lock:
                    self._dump_queued = False  # losses from now on need a dump of their own
                self._dump()
            case Call(callback):
                callback()
            case LookUp(orig, done):
                self._look_up(orig, done)
            case ClearMarks(mask, done):
                try:
                    cleared, failed = clear_marks(mask, self.on_malformed)
                except OSError as exc:
                    done(0, 0, str(exc))
                except Exception as exc:
                    # What waits for the answer must have one whatever happened (a re-evaluation
                    # acts on no decision of the policy's until the clearing is done); the
                    # failure is still counted and logged (_run).
                    done(0, 0, f"internal error: {type(exc).__name__}: {exc}")
                    raise
                else:
                    done(cleared, failed, None)

    def _failed(self, what: str) -> None:
        """Counted (the controller's internal errors) and logged with its traceback, at most
        one line every FAILURE_LOG_INTERVAL (observe's RateLimitedLog is a layer above kernel/)."""
        self.on_failed()
        now = time.monotonic()
        if now - self._failure_logged >= FAILURE_LOG_INTERVAL:
            self._failure_logged = now
            LOG.exception(what)

    def _requests(self, batch: list[Request]) -> None:
        """Requests queued together, and those queued meanwhile, in netlink writes of at
        most `batch` messages (their acknowledgements must fit the socket's buffer)."""
        while len(batch) < self.batch:
            try:
                nxt = self.q.get_nowait()
            except queue.Empty:
                break
            if not isinstance(nxt, list):
                self.q.put(nxt)  # a dump, a clear or the stop: after this batch
                break
            batch.extend(nxt)
        for at in range(0, len(batch), self.batch):
            part = batch[at:at + self.batch]
            self._retry = []
            try:
                self._send_batch(part)
                if self._retry:  # NAT entries found gone: created with their NAT, before `done`
                    self._send_batch(self._retry)
            except OSError as exc:
                LOG.error("conntrack update failed: %s", exc)
            except Exception:  # (its restores' flows must still go: their callbacks below)
                self._failed("conntrack update failed")
            for item in part:
                if isinstance(item, Restore):
                    try:
                        item.done()
                    except Exception:
                        self._failed("restore callback failed")

    def _send_batch(self, batch: list[Request]) -> None:
        out = bytearray()
        pending: dict[int, Request] = {}
        echoes = False
        for item in batch:
            if isinstance(item, Expire) and not self._meant(item):
                continue
            self._seq = (self._seq + 1) & 0xFFFFFFFF
            if isinstance(item, Delete):
                out += delete_message(item.family, item.orig, item.ct_id, self._seq, item.echo)
                echoes = echoes or item.echo
            elif isinstance(item, Liberal):
                out += liberal_message(item.family, item.orig, item.ct_id, self._seq)
            elif isinstance(item, Undecide):
                out += mark_update_message(item.family, item.orig, item.ct_id, 0, DECISION_MASK, self._seq)
            elif isinstance(item, (Expire, Refresh)):
                out += timeout_message(item.family, item.orig, item.ct_id, item.timeout, self._seq)
            else:
                out += item.message(self._seq)
            pending[self._seq] = item
        self.sock.send(bytes(out))
        deadline = time.monotonic() + 2.0
        while pending and time.monotonic() < deadline:
            try:
                data = self.sock.recv(1 << 16)
            except socket.timeout:
                break
            if echoes:
                self._counted(data)
            for seq, code in netlink_acks(data):
                if seq in pending:
                    self._account(pending.pop(seq), -code)
        if pending:
            LOG.warning("%d conntrack requests unacknowledged", len(pending))

    @staticmethod
    def _look_up(orig: FlowTuple, done: Callable[[ConnEvent | None, str | None], None]) -> None:
        try:
            entry = entry_of(orig)
        except OSError as exc:  # (a timeout too)
            LOG.warning("conntrack entry %s not looked up: %s", orig, exc)
            done(None, str(exc) or type(exc).__name__)
            return
        done(entry, None)

    def _meant(self, item: Expire) -> bool:
        """An expire goes only to the entry it was asked for, looked up first: one lookup
        an expire, which only a take-down of a pair whose entry closed on the firewall asks."""
        try:
            entry = entry_of(item.orig)
        except OSError as exc:  # (a timeout too) the entry keeps its closing state's timeout
            LOG.warning("conntrack entry %s kept its timeout: not looked up: %s", item.orig, exc)
            return False
        if item.meant_for(entry):
            return True
        if entry is not None:
            self.stale += 1
            LOG.info("conntrack entry %s kept its timeout: not the closing entry %d asked for (id %d, state %s)",
                     item.orig, item.ct_id, entry.ct_id, entry.tcp_state)
        return False

    def _counted(self, data: bytes) -> None:
        """Deleted entries the kernel echoed (a delete with NLM_F_ECHO): their last counters."""
        report = self.on_counted
        for offset, length in destroyed_entries(data):
            try:
                entry = parse_fast(data, offset, length, EventKind.DESTROY, 0.0)
                counts = parse_counts(data, offset, length)
            except Exception as exc:  # a strange message is counted and skipped
                self.on_malformed(f"delete echo: {type(exc).__name__}: {exc}")
                continue
            if report is not None:
                report(entry.orig, entry.ct_id, counts)

    def _account(self, item: Request, err: int) -> None:
        if isinstance(item, Delete):
            if err == 0:
                self.deleted += 1
                if LOG.isEnabledFor(logging.DEBUG):  # benchmarks time the deletion from this
                    t = item.orig
                    LOG.debug("conntrack entry %s deleted", t, extra={"fields": {
                        "event": "ct_deleted", "ct_id": item.ct_id, "src": t.src, "sport": t.sport, "dport": t.dport}})
            elif err == errno.ENOENT:
                self.delete_missing += 1  # already gone: nothing to free
            else:
                LOG.warning("conntrack delete refused: %s", errno.errorcode.get(err, err))
        elif isinstance(item, Liberal):
            if err not in (0, errno.ENOENT):  # ENOENT: the connection ended meanwhile
                LOG.warning("conntrack entry %s not made liberal: %s", item.orig, errno.errorcode.get(err, err))
        elif isinstance(item, (Expire, Refresh, Undecide)):
            if err not in (0, errno.ENOENT):  # ENOENT: gone already
                LOG.warning("conntrack entry %s kept its timeout: %s", item.orig, errno.errorcode.get(err, err))
        elif err == 0:
            self.restored += 1
        elif err == errno.ENOENT and item.nat and not item.create:
            self._retry.append(dataclasses.replace(item, create=True))  # the kept NAT entry is gone
        else:
            LOG.warning("conntrack entry for a teardown not created: %s", errno.errorcode.get(err, err))

    def _dump(self) -> None:
        try:  # only entries that crossed the plumbing matter to the core
            events = raw_dump(self.on_malformed, CROSSED_PLUMBING)
        except OSError as exc:
            LOG.error("conntrack dump failed: %s", exc)
            return
        self.on_dump(events)
