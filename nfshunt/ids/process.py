"""The IDS API served from a process of its own, its calls answered by the controller.

The controller is one Python process, and one lock (the GIL) runs its Python. In it, the
API's threads (HTTP, tokens, JSON, rules: ~0.25 ms of CPU a request) took 36 % of a core
at 1,000 requests a second, beside the event loop and the conntrack threads (bench ids).
Here the API (api.IdsApi) runs in a child process, and only its `RuleBackend` calls cross
to the controller:

  controller (ApiProcess)                     child (child_main)
    binds the listening socket  ------------>  serves HTTP on it (IdsApi), as an
    reads the token file        ------------>  unprivileged user with no capability
    BackendServer: checks each request         and a seccomp filter (confine.py);
      (frames.request_of), runs it on the      RemoteBackend: submit, remove, rules,
      real IdsBackend (an add is answered      rule, tokens; refusals counted and
      from the event loop as the switch        records logged through the controller
      confirms it, no thread waiting)  <-----  (one log, one set of counters)

The child is a privilege boundary: it parses what anyone sends, so the controller treats
what it says as requests (frames.py: plain JSON frames, versioned and bounded, every
field checked; no pickle, no conntrack entry: the controller looks the connection up
itself, on its event loop). A frame that is not one is counted (`ids_api_bad_frames`),
changes nothing, and ends that child; it is started again.

They talk over a socketpair. The listening socket stays open in the controller, so a
child that dies is started again (after RESTART_DELAY) on the same socket without losing
a connection waiting in its backlog; the child ends when the controller's end closes (a
stop, or the controller killed) and, should that not reach it, at its parent's death
(PR_SET_PDEATHSIG, SIGKILL). It ignores SIGTERM and SIGINT: a stop reaches it through the
controller (a service manager's SIGTERM to every process of the service, taken first by
the child, was logged as a crash and the child started again in the middle of a stop).
"""
from __future__ import annotations

import ctypes
import heapq
import itertools
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol

from nfshunt.config.ids import IdsConfig
from nfshunt.observe.logs import RateLimitedLog

from . import frames, tokens
from .api import REQUEST_SECONDS, IdsApi, listen
from .calls import Outcome, Page, Reject, RuleBackend, RuleView
from .confine import confine
from .frames import Channel, FrameError
from .loop import BUSY
from .rules import Kind, Network, Rule

LOG = logging.getLogger("nfshunt")
RESTART_DELAY = 1.0  # seconds before a child that died is started again
STOP_WAIT = 3.0  # seconds a stopping child has to end before it is killed
START_WAIT = 10.0  # seconds a child has to say it serves
CALL_MARGIN = 5.0  # seconds a call waits for the controller beyond the call's own limit
DEADLINE_STEP = 0.1  # seconds: how late an unanswered add may be answered pending
CALLS_SPARE = 8  # calls beyond one per API connection the controller queues (the token reader's, late ones)
SEND_SECONDS = 1  # an answer the child does not take within this ends the child
LOG_BURST = 100  # the child's records of one logger and level logged every 10 s at most (the rest counted)
CHILD = "import sys; from nfshunt.ids.process import child_main; sys.exit(child_main(sys.argv[1:]))"
OK, TIMEOUT, FAILED = 0, 1, 2  # how the controller ended a call: the API answers 200s, 504, 500


# --- the child ---------------------------------------------------------------------------------


class _Call:
    __slots__ = ("done", "how", "value")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.how = FAILED
        self.value: Any = None


class RemoteBackend:
    """The child's RuleBackend: each call sent to the controller and its answer waited for
    (TimeoutError past the call's limit and CALL_MARGIN, as the in-process backend's). The
    controller looks the connection's entry up itself, on its event loop."""

    def __init__(self, channel: Channel, answer_timeout: float):
        self.channel = channel
        self.answer_timeout = answer_timeout
        self._calls: dict[int, _Call] = {}
        self._seq = itertools.count(1)

    def _call(self, fields: dict[str, Any], limit: float) -> Any:
        seq = next(self._seq)
        call = self._calls[seq] = _Call()
        try:
            self.channel.send({**fields, "seq": seq})
            if not call.done.wait(limit + CALL_MARGIN):
                raise TimeoutError("the controller did not answer in time")
        finally:
            self._calls.pop(seq, None)
        if call.how == TIMEOUT:
            raise TimeoutError(call.value)
        if call.how != OK:
            raise RuntimeError(f"the controller failed the call: {call.value}")
        return call.value

    def answers(self) -> None:
        """Read the controller's answers until its end closes (then return)."""
        while (message := self.channel.receive()) is not None:
            call = self._calls.get(message.get("seq", 0)) if message["op"] == "answer" else None
            if call is not None:  # else its caller gave up
                call.how, call.value = message["done"], message["value"]
                call.done.set()

    def submit(self, rule: Rule, timeout: float) -> Outcome:
        raw = rule.to_json()
        del raw["expires"]
        return frames.outcome_of(self._call({"op": "submit", "rule": raw, "timeout": timeout}, timeout))

    def remove(self, source: str, rule_id: str) -> Outcome:
        return frames.outcome_of(self._call({"op": "remove", "source": source, "id": rule_id}, self.answer_timeout))

    def rules(self, source: str | None, kind: Kind | None, address: Network | None, after: int,
              limit: int) -> Page:
        return frames.page_of(self._call({"op": "rules", "source": source, "kind": None if kind is None else kind.value,
                                          "address": None if address is None else str(address), "after": after,
                                          "limit": limit}, self.answer_timeout))

    def rule(self, source: str, rule_id: str) -> RuleView | None:
        got = self._call({"op": "rule", "source": source, "id": rule_id}, self.answer_timeout)
        return None if got is None else frames.view_of(got)

    def tokens(self) -> tuple[tokens.Signature, list[tokens.Token]]:
        """The token file as the controller reads it (it changed, says its stat)."""
        return frames.tokens_of(self._call({"op": "tokens"}, self.answer_timeout))

    def count(self, why: Reject) -> None:
        self.channel.send({"op": "count", "reason": why.value})


class _Forward(logging.Handler):
    """The child's log records, sent to the controller to be logged there."""

    def __init__(self, channel: Channel):
        super().__init__()
        self.channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        try:
            exc = logging.Formatter().formatException(record.exc_info) if record.exc_info else None
            self.channel.send({"op": "log", "name": record.name, "level": record.levelno,
                               "message": record.getMessage()[:frames.LOG_TEXT], "exc": exc and exc[:frames.LOG_TEXT]})
        except Exception:  # the controller is gone: nobody to tell
            pass


def _die_with_parent() -> None:
    """SIGKILL when the controller dies, however it dies (Linux's PR_SET_PDEATHSIG; set again
    by confine() after the change of user, which clears it)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def child_main(argv: list[str]) -> int:
    """The child (CHILD): its arguments are the channel's and the listening socket's fds.
    It takes its setup, loads what only root may read (TLS), confines itself, then serves."""
    _die_with_parent()
    # A Ctrl-C, or a service manager's SIGTERM to every process of the service, reaches the
    # controller too, which stops us: a child that died of it first was logged as a crash
    # and started again in the middle of a normal stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    channel = Channel(socket.socket(fileno=int(argv[0])), frames.MAX_ANSWER)
    listening = socket.socket(fileno=int(argv[1]))
    setup = channel.receive()
    if setup is None:
        return 0
    cfg = frames.config_of(setup["config"])
    root = logging.getLogger()
    root.handlers[:] = [_Forward(channel)]
    root.setLevel(logging.WARNING)
    logging.getLogger("nfshunt").setLevel(setup["log_level"])
    backend = RemoteBackend(channel, cfg.answer_timeout)
    given = None
    if cfg.token_file:
        given = tokens.Tokens(cfg.token_file, load=backend.tokens)
        given.take(*frames.tokens_of(setup["tokens"]))
    try:
        api = IdsApi(cfg, backend, count=backend.count, request_seconds=setup["request_seconds"],
                     listening=listening, tokens=given)  # (the TLS files read here, as root)
        confined = confine(cfg.user)
        api.start()
    except Exception as exc:  # a TLS file unreadable, a user it cannot take: the controller says so and stops
        channel.send({"op": "serving", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    LOG.info("the IDS API's process serves as %s (uid %d) with no capability; seccomp filter: %s", confined.user,
             confined.uid, confined.seccomp)
    channel.send({"op": "serving", "error": None})
    try:
        backend.answers()
    except (OSError, ValueError):
        pass
    os._exit(0)  # the handler threads are daemons; nothing of theirs is worth waiting for


# --- the controller ----------------------------------------------------------------------------


Reply = Callable[[Outcome | Exception], None]
SubmitAsync = Callable[[Rule, float, Reply], "Pending | None"]  # None: no room in the event loop's queue
ENCODE: dict[str, Callable[[Any], Any]] = {
    "submit": frames.outcome_json, "remove": frames.outcome_json,
    "rules": frames.page_json,
    "rule": lambda view: None if view is None else frames.view_json(view),
    "tokens": lambda read: frames.tokens_json(*read)}


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
    """The controller's end: the child's requests, each checked (frames.request_of), run on
    the real backend. An add is answered from the event loop the moment the switch
    confirms it (submit: IdsBackend.submit_async), with no thread of ours waiting for it;
    the rarer calls each wait on a thread of a pool. Nothing waits on the reader: a call
    with no room (in the event loop's queue of calls, or the pool's) is answered busy at
    once and counted (`busy`, by op), and the frames behind it (counts, logs, the next
    calls) are taken at once. Refusals are counted and records logged as they come (`logs`: at most
    LOG_BURST of a logger and level every 10 s, the rest counted; ApiProcess's, kept across
    its children). A frame that is not one (`bad_frame`: counted, logged) ends the child,
    having changed nothing."""

    def __init__(self, channel: Channel, cfg: IdsConfig, backend: RuleBackend, count: Callable[[Reject], None],
                 submit: SubmitAsync, bad_frame: Callable[[str], None], workers: int,
                 wall: Callable[[], float] = time.time, logs: RateLimitedLog | None = None,
                 busy: Callable[[str], None] = lambda op: None):
        self.channel = channel
        self.cfg = cfg
        self.backend = backend
        self.count = count
        self.submit = submit
        self.bad_frame = bad_frame
        self.busy = busy
        self.wall = wall
        self.logs = logs if logs is not None else RateLimitedLog(LOG, burst=LOG_BURST)
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="nfshunt-ids-call")
        # Each of the child's threads waits for its call's answer: at most one each, unless
        # calls outlive the child's wait. More is a child that floods (compromised): it is
        # answered busy at once, not queued without end in the controller's memory.
        self.calls = threading.BoundedSemaphore(cfg.max_connections + CALLS_SPARE)
        self.deadlines = Deadlines()
        # An answer is written on the event loop: a child that stops reading fails the
        # write after SEND_SECONDS (and is started again) instead of stalling the loop.
        channel.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("@ll", SEND_SECONDS, 0))

    def serve(self, on_serving: Callable[[str | None], None]) -> None:
        """Take the child's messages until its end closes, or it sends what is not a
        request of this format (then return)."""
        try:
            while True:
                try:
                    message = self.channel.receive()
                except FrameError as exc:
                    self.bad_frame(str(exc))
                    return
                except (OSError, ValueError):  # its end is gone, or ours closed (a stop)
                    return
                if message is None:
                    return
                try:
                    self._take(message, on_serving)
                except Exception as exc:  # a FrameError, or whatever else a hostile frame made a check raise
                    self.bad_frame(str(exc) if isinstance(exc, FrameError) else f"{type(exc).__name__}: {exc}")
                    return
        finally:
            self.deadlines.stop()
            self.pool.shutdown(wait=False, cancel_futures=True)
            on_serving("its process ended before it served")  # (unheard if it had said it serves)

    def _take(self, message: dict[str, Any], on_serving: Callable[[str | None], None]) -> None:
        op = message["op"]
        if op == "count":
            self.count(frames.count_of(message))
        elif op == "log":
            # limited here, not by the child: what it says of itself is not to be trusted
            record = frames.log_of(message)
            held = self.logs.allow(f"{record.name} {record.levelno}")
            if held is not None:
                record.msg += self.logs.note(held)
                logging.getLogger(record.name).handle(record)
        elif op == "serving":
            on_serving(frames.serving_of(message))
        else:
            op, seq, args = frames.request_of(message, self.wall(), self.cfg)
            if op == "submit":
                rule, timeout = args
                pending = self.submit(rule, timeout, lambda result: self._answer(op, seq, result))
                if pending is None:  # (the event loop's queue of calls is full: never waited for here)
                    self._busy(op, seq, BUSY)
                else:
                    self.deadlines.watch(pending)
            elif self.calls.acquire(blocking=False):
                self.pool.submit(self._run, op, seq, args)
            else:
                self._busy(op, seq, "the controller is busy with the API's earlier calls (nothing was done)")

    def _busy(self, op: str, seq: int, why: str) -> None:
        """A call answered busy at once, nothing done (the API's 504, `unanswered`), counted."""
        self.busy(op)
        self._answer(op, seq, TimeoutError(why))

    def _run(self, op: str, seq: int, args: tuple[Any, ...]) -> None:
        try:
            if op == "tokens":
                assert self.cfg.token_file is not None
                value: Any = tokens.read(self.cfg.token_file)
            else:
                value = getattr(self.backend, op)(*args)
        except Exception as exc:
            value = exc
        finally:
            self.calls.release()
        self._answer(op, seq, value)

    def _answer(self, op: str, seq: int, result: Any) -> None:
        if isinstance(result, TimeoutError):
            answer = {"op": "answer", "seq": seq, "done": TIMEOUT, "value": str(result)}
        elif isinstance(result, Exception):
            LOG.error("IDS API call failed", exc_info=result)
            answer = {"op": "answer", "seq": seq, "done": FAILED, "value": f"{type(result).__name__}: {result}"}
        else:
            answer = {"op": "answer", "seq": seq, "done": OK, "value": ENCODE[op](result)}
        try:
            self.channel.send(answer)
        except OSError as exc:  # gone, or not reading: a new child asks again
            LOG.error("cannot answer the IDS API process (%s): it is started again", exc)
            self.channel.close()


class ApiProcess:
    """The IDS API's child process, from the controller: `start` binds the API's address
    here (an address in use fails the controller's start, as before) and starts the child,
    waiting until it serves; a child that dies is started again; `stop` ends it.
    submit: the backend's add, answered when it is done (IdsBackend.submit_async)."""

    def __init__(self, cfg: IdsConfig, backend: RuleBackend, submit: SubmitAsync,
                 count: Callable[[Reject], None], restarted: Callable[[], None] = lambda: None,
                 request_seconds: float = REQUEST_SECONDS, bad_frame: Callable[[], None] = lambda: None,
                 busy: Callable[[str], None] = lambda op: None):
        self.cfg = cfg
        self.backend = backend
        self.submit = submit
        self.count = count
        self.restarted = restarted
        self.counted_bad_frame = bad_frame
        self.busy = busy  # a call answered busy, by op (BackendServer)
        self._rlog = RateLimitedLog(LOG)
        self._child_logs = RateLimitedLog(LOG, burst=LOG_BURST)
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
        self._channel = Channel(ours, frames.MAX_REQUEST)
        read = tokens.read(self.cfg.token_file) if self.cfg.token_file else (None, [])
        self._channel.send({"op": "setup", "config": frames.config_json(self.cfg), "tokens": frames.tokens_json(*read),
                            "log_level": logging.getLogger("nfshunt").getEffectiveLevel(),
                            "request_seconds": self.request_seconds})
        event, said = self._serving = (threading.Event(), [])

        def serving(error: str | None) -> None:
            said.append(error)
            event.set()
        server = BackendServer(self._channel, self.cfg, self.backend, self.count, self.submit, self._bad_frame,
                               workers=self.cfg.max_connections + 4, logs=self._child_logs, busy=self.busy)
        self._server_thread = threading.Thread(target=server.serve, args=(serving,), name="nfshunt-ids-calls",
                                               daemon=True)
        self._server_thread.start()

    def _bad_frame(self, why: str) -> None:
        self.counted_bad_frame()
        held = self._rlog.allow("ids-frame")
        if held is not None:
            LOG.error("the IDS API process sent what is not a request (%s): nothing was done, and it is started "
                      "again%s", why, f" ({held} more since the last report)" if held else "")

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
