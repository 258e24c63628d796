"""The IDS API served from a process of its own, its calls answered by the controller.

The controller is one Python process, and one lock (the GIL) runs its Python. In it, the
API's threads (HTTP, tokens, JSON, rules, the conntrack lookup: ~0.25 ms of CPU a request)
took 36 % of a core at 1,000 requests a second, beside the event loop and the conntrack
threads (bench ids). Here the API (ids_api.IdsApi, unchanged) runs in a child process,
and only its `RuleBackend` calls cross to the controller:

  controller (ApiProcess)                     child (ids_process.child_main)
    binds the listening socket  ------------>  serves HTTP on it (IdsApi)
    BackendServer: runs each call  <---------  RemoteBackend: submit (entry looked up
      on the real IdsBackend; an add is          here), remove, rules, rule; refusals
      answered from the event loop as the        counted and records logged through the
      switch confirms it, no thread waiting)     controller: one log, one set of counters

They talk over a socketpair: frames of a 4-byte length and a pickle. Pickle is safe here:
only the controller and the child it started hold the pair's ends (no address, no name),
and both run this code. The listening socket stays open in the controller, so a child that
dies is started again (after RESTART_DELAY) on the same socket without losing a connection
waiting in its backlog; the child ends when the controller's end closes (a stop, or the
controller killed) and, should that not reach it, at its parent's death (PR_SET_PDEATHSIG). It
ignores SIGTERM and SIGINT: a stop reaches it through the controller.
"""
from __future__ import annotations

import ctypes
import enum
import heapq
import itertools
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from nfshunt.config.settings import IdsConfig
from nfshunt.records.model import ConnEvent, FlowTuple

from .api import REQUEST_SECONDS, IdsApi, Outcome, Reject, RuleBackend, RuleView, listen
from .rules import Kind, Network, Rule

LOG = logging.getLogger("nfshunt")
HEADER = struct.Struct("!I")
MAX_FRAME = 256 * 1024 * 1024  # a list of every rule (100,000: ~30 MB) fits; more is a broken peer
RESTART_DELAY = 1.0  # seconds before a child that died is started again
STOP_WAIT = 3.0  # seconds a stopping child has to end before it is killed
START_WAIT = 10.0  # seconds a child has to say it serves
CALL_MARGIN = 5.0  # seconds a call waits for the controller beyond the call's own limit
DEADLINE_STEP = 0.1  # seconds: how late an unanswered add may be answered pending
SEND_SECONDS = 1  # an answer the child does not take within this ends the child
# The child's program: child_main imported, not run as __main__ (whose classes would pickle
# under another name than the controller's).
CHILD = "import sys; from nfshunt.ids.process import child_main; sys.exit(child_main(sys.argv[1:]))"


class Op(enum.IntEnum):
    SUBMIT = 1  # child -> controller, answered: (rule, entry, timeout) -> Outcome
    REMOVE = 2  # (source, id) -> Outcome
    RULES = 3  # (source, kind, address) -> list[RuleView]
    RULE = 4  # (source, id) -> RuleView | None
    COUNT = 5  # child -> controller, not answered: a refusal's Reject
    LOG = 6  # child -> controller, not answered: a log record's (name, level, message, exception text)
    SERVING = 7  # child -> controller, once: it serves (or the error that kept it from it)
    ANSWER = 8  # controller -> child: (seq, Done, the value or the error's text)


class Done(enum.IntEnum):
    """How the controller ended a call."""
    OK = 0
    TIMEOUT = 1  # the backend's TimeoutError: the API answers 504, as in one process
    FAILED = 2  # any other error (logged by the controller): the API answers 500


@dataclass(frozen=True)
class Setup:
    """What the controller sends its child first."""
    cfg: IdsConfig
    log_level: int  # the controller's "nfshunt" logger's level: records below it are not sent
    request_seconds: float = REQUEST_SECONDS


class Channel:
    """Framed pickles over a connected stream socket, sent from any thread."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._reader = sock.makefile("rb")
        self._send_lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.sock.sendall(HEADER.pack(len(data)) + data)

    def receive(self) -> tuple[Any, ...] | None:
        """The next message; None at the peer's end (EOF). ValueError: not a frame."""
        head = self._reader.read(HEADER.size)
        if len(head) < HEADER.size:
            return None
        (length,) = HEADER.unpack(head)
        if length > MAX_FRAME:
            raise ValueError(f"a frame of {length} bytes (at most {MAX_FRAME})")
        data = self._reader.read(length)
        if len(data) < length:
            return None
        message = pickle.loads(data)
        if not isinstance(message, tuple) or not message:
            raise ValueError("a frame that is not a message")
        return message

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._reader.close()
        self.sock.close()


# --- the child ---------------------------------------------------------------------------------


class _Call:
    __slots__ = ("done", "how", "value")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.how = Done.FAILED
        self.value: Any = None


class RemoteBackend:
    """The child's RuleBackend: each call sent to the controller and its answer waited for
    (TimeoutError past the call's limit and CALL_MARGIN, as the in-process backend's). A
    submit's conntrack entry is looked up here, off the controller's lock."""

    def __init__(self, channel: Channel, lookup: Callable[[FlowTuple], ConnEvent | None], answer_timeout: float):
        self.channel = channel
        self.lookup = lookup
        self.answer_timeout = answer_timeout
        self._calls: dict[int, _Call] = {}
        self._seq = itertools.count(1)

    def _call(self, op: Op, args: tuple[Any, ...], limit: float) -> Any:
        seq = next(self._seq)
        call = self._calls[seq] = _Call()
        try:
            self.channel.send((int(op), seq, args))
            if not call.done.wait(limit + CALL_MARGIN):
                raise TimeoutError("the controller did not answer in time")
        finally:
            self._calls.pop(seq, None)
        if call.how is Done.TIMEOUT:
            raise TimeoutError(call.value)
        if call.how is not Done.OK:
            raise RuntimeError(f"the controller failed the call: {call.value}")
        return call.value

    def answers(self) -> None:
        """Read the controller's answers until its end closes (then return)."""
        while (message := self.channel.receive()) is not None:
            op, seq, how, value = message
            call = self._calls.get(seq) if op == Op.ANSWER else None
            if call is not None:  # else its caller gave up
                call.how, call.value = Done(how), value
                call.done.set()

    def submit(self, rule: Rule, timeout: float) -> Outcome:
        entry = None
        if rule.connection is not None:
            try:
                entry = self.lookup(rule.connection)
            except OSError as exc:
                LOG.warning("conntrack lookup of %s failed: %s", rule.connection, exc)
        return self._call(Op.SUBMIT, (rule, entry, timeout), timeout)  # type: ignore[no-any-return]

    def remove(self, source: str, rule_id: str) -> Outcome:
        return self._call(Op.REMOVE, (source, rule_id), self.answer_timeout)  # type: ignore[no-any-return]

    def rules(self, source: str | None, kind: Kind | None, address: Network | None) -> list[RuleView]:
        return self._call(Op.RULES, (source, kind, address), self.answer_timeout)  # type: ignore[no-any-return]

    def rule(self, source: str, rule_id: str) -> RuleView | None:
        return self._call(Op.RULE, (source, rule_id), self.answer_timeout)  # type: ignore[no-any-return]

    def count(self, why: Reject) -> None:
        self.channel.send((int(Op.COUNT), why.value))


class _Forward(logging.Handler):
    """The child's log records, sent to the controller to be logged there."""

    def __init__(self, channel: Channel):
        super().__init__()
        self.channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        try:
            exc = logging.Formatter().formatException(record.exc_info) if record.exc_info else None
            self.channel.send((int(Op.LOG), record.name, record.levelno, record.getMessage(), exc))
        except Exception:  # the controller is gone: nobody to tell
            pass


def _die_with_parent() -> None:
    """SIGKILL when the controller dies, however it dies (Linux's PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def child_main(argv: list[str]) -> int:
    """The child (CHILD): its arguments are the channel's and the listening socket's fds."""
    _die_with_parent()
    # A Ctrl-C, or a service manager's SIGTERM to every process of the service, reaches the
    # controller too, which stops us: a child that died of it first was logged as a crash
    # and started again in the middle of a normal stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    channel = Channel(socket.socket(fileno=int(argv[0])))
    listening = socket.socket(fileno=int(argv[1]))
    first = channel.receive()
    if first is None:
        return 0
    setup: Setup = first[0]
    root = logging.getLogger()
    root.handlers[:] = [_Forward(channel)]
    root.setLevel(logging.WARNING)
    logging.getLogger("nfshunt").setLevel(setup.log_level)
    from nfshunt.kernel import conntrack
    backend = RemoteBackend(channel, conntrack.lookup, setup.cfg.answer_timeout)
    try:
        api = IdsApi(setup.cfg, backend, count=backend.count, request_seconds=setup.request_seconds,
                     listening=listening)
        api.start()
    except Exception as exc:  # a TLS file unreadable, say: the controller says so and stops
        channel.send((int(Op.SERVING), f"{type(exc).__name__}: {exc}"))
        return 1
    channel.send((int(Op.SERVING), None))
    try:
        backend.answers()
    except (OSError, ValueError):
        pass
    os._exit(0)  # the handler threads are daemons; nothing of theirs is worth waiting for


# --- the controller ----------------------------------------------------------------------------


Reply = Callable[[Outcome | Exception], None]
SubmitAsync = Callable[[Rule, ConnEvent | None, float, Reply], "Pending"]


class Pending(Protocol):
    """An add on its way (ids_backend.Submitted): answered once, `expire`d at its deadline."""
    deadline: float

    def expire(self) -> None: ...


class Deadlines:
    """Adds not answered by their deadline are expired (ADDED pending, or 504 if the event
    loop never took them), looked at every DEADLINE_STEP on a thread of its own."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Pending]] = []
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="nfshunt-ids-deadlines", daemon=True).start()

    def watch(self, pending: Pending) -> None:
        with self._lock:
            heapq.heappush(self._heap, (pending.deadline, next(self._seq), pending))

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(DEADLINE_STEP):
            now = time.monotonic()
            due = []
            with self._lock:
                while self._heap and self._heap[0][0] <= now:
                    due.append(heapq.heappop(self._heap)[2])
            for pending in due:
                pending.expire()  # a no-op for one answered already


class BackendServer:
    """The controller's end: the child's calls run on the real backend. An add is answered
    from the event loop the moment the switch confirms it (submit: IdsBackend.submit_async),
    with no thread of ours waiting for it; the rarer calls each wait on a thread of a pool.
    Refusals are counted and records logged as they come."""

    def __init__(self, channel: Channel, backend: RuleBackend, count: Callable[[Reject], None],
                 submit: SubmitAsync, workers: int):
        self.channel = channel
        self.backend = backend
        self.count = count
        self.submit = submit
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="nfshunt-ids-call")
        self.deadlines = Deadlines()
        # An answer is written on the event loop: a child that stops reading fails the
        # write after SEND_SECONDS (and is started again) instead of stalling the loop.
        channel.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("@ll", SEND_SECONDS, 0))

    def serve(self, on_serving: Callable[[str | None], None]) -> None:
        """Take the child's messages until its end closes (then return)."""
        try:
            while (message := self.channel.receive()) is not None:
                op = message[0]
                if op == Op.SUBMIT:
                    seq, (rule, entry, timeout) = message[1], message[2]
                    self.deadlines.watch(self.submit(rule, entry, timeout,
                                                     lambda result, seq=seq: self._answer(seq, result)))
                elif op == Op.COUNT:
                    self.count(Reject(message[1]))
                elif op == Op.LOG:
                    _, name, level, text, exc = message
                    record = logging.makeLogRecord({"name": name, "levelno": level,
                                                    "levelname": logging.getLevelName(level), "msg": text,
                                                    "exc_text": exc})
                    logging.getLogger(name).handle(record)
                elif op == Op.SERVING:
                    on_serving(message[1])
                elif op in (Op.REMOVE, Op.RULES, Op.RULE):
                    self.pool.submit(self._run, Op(op), message[1], message[2])
                else:
                    raise ValueError(f"an unknown message {op!r}")
        except Exception as exc:  # unpickling raises what its input makes it raise
            LOG.error("the IDS API process sent what cannot be read (%s: %s): it is started again",
                      type(exc).__name__, exc)
        finally:
            self.deadlines.stop()
            self.pool.shutdown(wait=False, cancel_futures=True)
            on_serving("its process ended before it served")  # (unheard if it had said it serves)

    def _run(self, op: Op, seq: int, args: tuple[Any, ...]) -> None:
        try:
            if op is Op.REMOVE:
                value: Any = self.backend.remove(*args)
            elif op is Op.RULES:
                value = self.backend.rules(*args)
            else:
                value = self.backend.rule(*args)
        except Exception as exc:
            value = exc
        self._answer(seq, value)

    def _answer(self, seq: int, result: Any) -> None:
        if isinstance(result, TimeoutError):
            answer: tuple[Any, ...] = (int(Op.ANSWER), seq, int(Done.TIMEOUT), str(result))
        elif isinstance(result, Exception):
            LOG.error("IDS API call failed", exc_info=result)
            answer = (int(Op.ANSWER), seq, int(Done.FAILED), f"{type(result).__name__}: {result}")
        else:
            answer = (int(Op.ANSWER), seq, int(Done.OK), result)
        try:
            self.channel.send(answer)
        except OSError as exc:  # gone, or not reading: a new child asks again
            LOG.error("cannot answer the IDS API process (%s): it is started again", exc)
            self.channel.close()


class ApiProcess:
    """The IDS API's child process, from the controller: `start` binds the API's address
    here (an address in use fails the controller's start, as before) and starts the child,
    waiting until it serves; a child that dies is started again; `stop` ends it.
    submit: the backend's add with the child's looked-up entry (IdsBackend.submit_async)."""

    def __init__(self, cfg: IdsConfig, backend: RuleBackend, submit: SubmitAsync,
                 count: Callable[[Reject], None], restarted: Callable[[], None] = lambda: None,
                 request_seconds: float = REQUEST_SECONDS):
        self.cfg = cfg
        self.backend = backend
        self.submit = submit
        self.count = count
        self.restarted = restarted
        self.request_seconds = request_seconds
        self._listening: socket.socket | None = None
        self._child: subprocess.Popen[bytes] | None = None
        self._channel: Channel | None = None
        self._thread: threading.Thread | None = None  # starts a child that died again
        self._server_thread: threading.Thread | None = None  # the current child's BackendServer
        self._stopping = threading.Event()
        self._serving: tuple[threading.Event, list[str | None]] = (threading.Event(), [])

    @property
    def address(self) -> tuple[str, int]:
        assert self._listening is not None
        host, port = self._listening.getsockname()[:2]
        return str(host), int(port)

    @property
    def pid(self) -> int | None:
        return None if self._child is None else self._child.pid

    def start(self) -> None:
        self._listening = listen(self.cfg)
        self._spawn()
        error = self._await_serving()
        if error is not None:
            self.stop()
            raise RuntimeError(f"the IDS API could not start: {error}")
        self._thread = threading.Thread(target=self._watch, name="nfshunt-ids-process", daemon=True)
        self._thread.start()

    def _spawn(self) -> None:
        assert self._listening is not None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-c", CHILD, str(theirs.fileno()), str(self._listening.fileno())],
                pass_fds=(theirs.fileno(), self._listening.fileno()), stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            theirs.close()
        self._channel = Channel(ours)
        self._channel.send((Setup(self.cfg, logging.getLogger("nfshunt").getEffectiveLevel(), self.request_seconds),))
        event, said = self._serving = (threading.Event(), [])

        def serving(error: str | None) -> None:
            said.append(error)
            event.set()
        server = BackendServer(self._channel, self.backend, self.count, self.submit,
                               workers=self.cfg.max_connections + 4)
        self._server_thread = threading.Thread(target=server.serve, args=(serving,), name="nfshunt-ids-calls",
                                               daemon=True)
        self._server_thread.start()

    def _await_serving(self) -> str | None:
        event, said = self._serving
        if not event.wait(START_WAIT):
            return f"its process did not start serving within {START_WAIT:.0f} s"
        return said[0]

    def _watch(self) -> None:
        """Start a child that died again, until stopped."""
        while not self._stopping.is_set():
            assert self._server_thread is not None
            self._server_thread.join()  # its channel closed: the child ended (or broke the protocol)
            if self._stopping.is_set():
                return
            status = self._end_child()
            LOG.error("the IDS API process ended (%s): starting it again in %.0f s", status, RESTART_DELAY)
            self.restarted()
            if self._stopping.wait(RESTART_DELAY):
                return
            self._spawn()
            error = self._await_serving()
            if error is not None:
                LOG.error("the IDS API process could not start again: %s", error)

    def _end_child(self) -> str:
        """Close our end and reap the child (killed if it does not end in STOP_WAIT)."""
        if self._channel is not None:
            self._channel.close()
        child = self._child
        if child is None:
            return "not started"
        try:
            code = child.wait(STOP_WAIT)
        except subprocess.TimeoutExpired:
            child.kill()
            code = child.wait()
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"

    def stop(self) -> None:
        self._stopping.set()
        self._end_child()
        if self._thread is not None:
            self._thread.join(STOP_WAIT + 1)
        if self._listening is not None:
            self._listening.close()
            self._listening = None
