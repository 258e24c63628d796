"""The IDS request API: HTTP with JSON bodies, for Zeek's NetControl (zeek/nfshunt.zeek),
SciPass clients and anything that speaks HTTP.

Served by the standard library's http.server (ThreadingHTTPServer), for three reasons: no
new dependency in a firewall component (its version is the interpreter's, patched with
it by the distribution); it runs on its own threads, one a connection, in a process of its
own (ids_process), so the controller never parses HTTP nor waits on a client (it sees only
`RuleBackend` calls); and
the load is small (an IDS sends at most thousands of requests a second, each answered in
milliseconds). What a server that may face a network needs besides is added here:
  - TLS (required for any non-loopback address, config.py), bearer tokens from a 0600 file
    (tokens.py: read again when it changes, so a rotated token is refused from the next
    request on) or TLS client certificates (the certificate's common name names the client);
  - nobody without a token can silence it: a request rate limit per authenticated client
    (429; another's flood takes nothing of it), a tighter one on failed authentications
    per client (a 401 closes its connection), a cap on open connections (each holds one
    thread) and on those of one client (`Peer.who`: an address, and on this host the local
    user owning the socket, which the kernel names), and short deadlines: a connection's
    first request within PREAUTH_SECONDS of its accept, a keep-alive connection's next
    within IDLE_SECONDS, each whole request within REQUEST_SECONDS of its first byte (a
    client that sends one byte a second is cut off, holding only its own thread);
  - a cap on a request's line and headers, HEAD_BYTES, and on its body (413, not read);
  - JSON read by jsonfile (bounded depth and digits, duplicate keys refused), unknown
    fields refused; every refusal is a 4xx (or 5xx) with a reason, and counted (`count`).

Routes (the requester is "ids:<client>"; its ids are its own):
  POST   /v1/rules            add (ids_rules.parse); 201 added, 202 added pending, 200 exists
  GET    /v1/rules            list (?source=ids:x &kind=shunt|block|block_address|whitelist &address=a[/n])
  GET    /v1/rules/<id>       one of the requester's rules, with its state and counters
  DELETE /v1/rules/<id>       remove it (200 with its counters; an expired one answers as it expired)
  PUT    /scipass/flows/good_flow | bad_flow     SciPass's shunt and block, its bodies, {"success": 1}
  DELETE /scipass/flows/good_flow | bad_flow     the delete SciPass lacks (the same body)
  GET    /scipass/flows/get_good_flows | get_bad_flows
"""
from __future__ import annotations

import contextlib
import dataclasses
import email.utils
import http.server
import io
import ipaddress
import json
import logging
import math
import re
import socket
import ssl
import struct
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, cast
from urllib.parse import parse_qs, unquote, urlsplit

from nfshunt.config import jsonfile
from nfshunt.config.ids import IdsConfig
from nfshunt.kernel import sockdiag
from nfshunt.observe.logs import RateLimitedLog

from . import frames
from .calls import Outcome, Page, Reject, Result, RuleBackend
from .frames import FrameError
from .rules import RULE_ID, Kind, Network, Rule, RuleError, parse, parse_scipass, scipass_id, scipass_json
from .tokens import CLIENT_NAME, Tokens

LOG = logging.getLogger("nfshunt")
REQUEST_SECONDS = 10.0  # a whole request (line, headers, body) must arrive within this, from its first byte
PREAUTH_SECONDS = 3.0  # a new connection's first request (its TLS handshake too) within this of its accept
IDLE_SECONDS = 5.0  # a keep-alive connection's next request begins within this of the last answer
PAGE_SIZE = 500  # rules a listing's page has unless ?limit= says fewer or more (at most PAGE_MAX)
LIST_RULES = 20000  # rules a second a client may list (a page of 1,000 is ~10 ms of the controller's CPU)
NEXT_HEADER = "X-Next-After"  # a SciPass list cut at its limit: the ?after= of the rest
WRITE_SECONDS = 10.0  # an answer must be taken within this
# Answers a client may leave unread before a write waits (the kernel doubles it): without
# it, autotuning lets one connection hold up to tcp_wmem's maximum (4 MB here) of them, so
# a client that never reads costs that much a connection and is cut off only once that is
# full, after seconds of answering it (CI: over 10 s on a loaded machine).
SEND_BUFFER = 256 * 1024
HEAD_BYTES = 16384  # a request's line and headers (curl's are ~200 bytes)
RATE_CLIENTS = 10000  # clients whose rate is tracked at once (the oldest forgotten)


STATUS = {Reject.UNAUTHENTICATED: 401, Reject.RATE_LIMITED: 429, Reject.TOO_LARGE: 413, Reject.LENGTH_REQUIRED: 411,
          Reject.FORBIDDEN: 403, Reject.MALFORMED: 400, Reject.INVALID: 400, Reject.NOT_FOUND: 404, Reject.METHOD: 405,
          Reject.DUPLICATE: 409, Reject.REFUSED: 403, Reject.FULL: 503, Reject.UNAVAILABLE: 503,
          Reject.UNANSWERED: 504, Reject.INTERNAL: 500}


class Client(NamedTuple):
    """An authenticated requester: "ids:<client>", and whether its token is an admin's."""
    source: str
    admin: bool


class _Refused(Exception):
    def __init__(self, why: Reject, reason: str):
        super().__init__(reason)
        self.why = why
        self.reason = reason


class RateLimit:
    """A token bucket per client: `rate` a second, a second's worth at once."""

    def __init__(self, rate: int):
        self.rate = rate
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._lock = threading.Lock()

    def charge(self, client: str, cost: int, now: float) -> None:
        """Take `cost` more (work known once done: the bucket may go below zero, and the
        client waits until it has refilled)."""
        with self._lock:
            level, last = self._buckets.pop(client, (float(self.rate), now))
            self._buckets[client] = (min(float(self.rate), level + (now - last) * self.rate) - cost, now)

    def allow(self, client: str, now: float) -> bool:
        with self._lock:
            level, last = self._buckets.pop(client, (float(self.rate), now))
            level = min(float(self.rate), level + (now - last) * self.rate)
            allowed = level >= 1
            self._buckets[client] = (level - 1 if allowed else level, now)
            if len(self._buckets) > RATE_CLIENTS:
                self._buckets.popitem(last=False)
            return allowed


class _DeadlineReader(io.RawIOBase):
    """The socket read so that a request's first byte must come by `idle_until`, the whole
    request then within `request_seconds` of it (and by `cap`: a connection not yet
    authenticated has PREAUTH_SECONDS from its accept), however it trickles; and be at
    most `limit` bytes (past it the client's stream ends here: the headers http.server
    would take, 100 lines of 64 KiB, are not read into memory)."""

    def __init__(self, sock: socket.socket, limit: int, request_seconds: float):
        self.sock = sock
        self.limit = limit
        self.request_seconds = request_seconds
        self.idle_until = self.deadline = self.cap = math.inf
        self.received = 0  # bytes of the current request
        self.carried = 0  # bytes of it read with the last one's (pipelined)
        self.held = False  # a read now takes nothing from the socket (`_buffered`)
        # A plain socket is left blocking and waits in the kernel, its reads bounded by
        # SO_RCVTIMEO and its writes by SO_SNDTIMEO: a socket with a Python timeout polls
        # before every recv and send, two more syscalls and GIL hand-overs a request (and
        # an ioctl for each settimeout). TLS keeps Python's timeouts: the ssl module does
        # not report a kernel timeout as one.
        self.kernel_timeouts = not isinstance(sock, ssl.SSLSocket)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        if self.kernel_timeouts:
            sock.settimeout(None)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(WRITE_SECONDS))

    def readable(self) -> bool:
        return True

    def next_request(self, idle_until: float, cap: float, rfile: io.BufferedReader) -> None:
        self.received = 0
        self.carried = self._buffered(rfile)
        self.idle_until = min(idle_until, cap)
        self.deadline = math.inf  # set by the request's first byte
        self.cap = cap

    def head(self, rfile: io.BufferedReader) -> int:
        """The bytes the request's line and headers took, once parsed: those read, less
        those `rfile` (over this reader) holds past them."""
        return self.carried + self.received - self._buffered(rfile)

    def _buffered(self, rfile: io.BufferedReader) -> int:
        """Bytes `rfile` read and did not give out yet, found without reading on."""
        self.held = True
        try:
            return len(rfile.peek())
        finally:
            self.held = False

    def readinto(self, buf: Any) -> int | None:
        if self.held:
            return None  # (nothing to read yet, as a non-blocking socket would say)
        room = self.limit - self.received
        if room <= 0:
            return 0
        left = (self.idle_until if self.deadline == math.inf else self.deadline) - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        if not self.kernel_timeouts:
            self.sock.settimeout(left)
            n = self.sock.recv_into(memoryview(buf)[:room])
        else:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(left))
            try:
                n = self.sock.recv_into(memoryview(buf)[:room])
            except BlockingIOError:  # SO_RCVTIMEO passed
                raise TimeoutError("the request did not arrive in time") from None
        if n and self.deadline == math.inf:
            self.deadline = min(time.monotonic() + self.request_seconds, self.cap)
        self.received += n
        return n


def _timeval(seconds: float) -> bytes:
    """A struct timeval of `seconds` > 0, at least 1 us (a zero one would mean no limit)."""
    micros = max(1, round(seconds * 1e6))
    return struct.pack("@ll", micros // 1_000_000, micros % 1_000_000)


# A request's head in the strict form every client here sends (curl, Python, Zeek): the line
# "METHOD /path HTTP/1.x", then "Name: value" lines of printable ASCII, all ending in CRLF.
# Such a head is parsed here in ~5 us; http.server's parse (through the email package) took
# ~35 us of a request's ~250 (harness). Anything else (folded or odd lines, bare LF, other
# bytes, "//" paths, other versions, a head not yet buffered) is left to http.server's parse,
# which then does all it did before.
_REQUEST_LINE = re.compile(rb"([A-Z]{1,16}) (/(?!/)[\x21-\x7e]*) (HTTP/1\.[01])\r\n")
_FIELDS = re.compile(rb"(?:[!#$%&'*+.^_`|~0-9A-Za-z-]+:[\t\x20-\x7e]*\r\n){0,64}")
_FIELD = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[\t ]*([\t\x20-\x7e]*)\r\n")


class _Headers:
    """A request's headers, answering `get` as http.server's message does: the first field
    of the name, in any case, its value without its leading blanks (its trailing kept)."""

    __slots__ = ("_first",)

    def __init__(self, fields: list[tuple[bytes, bytes]]):
        self._first: dict[str, str] = {}
        for name, value in fields:
            self._first.setdefault(name.decode("ascii").lower(), value.decode("ascii"))

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._first.get(name.lower(), default)


def _strict_head(line: bytes, peek: Callable[[], bytes]) -> tuple[str, str, str, _Headers, int] | None:
    """The method, path, version and headers of a strict head (`line`, then the header
    block at the start of what `peek` answers), and the bytes of it the head took; None if
    it is not one, or not all buffered yet. `peek` is called only for a strict line: for
    another (HTTP/2.0, say) http.server answers before it reads on."""
    request = _REQUEST_LINE.fullmatch(line)
    if request is None:
        return None
    buffered = peek()
    if buffered.startswith(b"\r\n"):
        return request[1].decode("ascii"), request[2].decode("ascii"), request[3].decode("ascii"), _Headers([]), 2
    # at most a read buffer's worth, its lines far below http.server's limit (64 KiB a line)
    end = buffered.find(b"\r\n\r\n", 0, io.DEFAULT_BUFFER_SIZE) + 2
    if end < 2 or _FIELDS.fullmatch(buffered, 0, end) is None:
        return None
    return (request[1].decode("ascii"), request[2].decode("ascii"), request[3].decode("ascii"),
            _Headers(_FIELD.findall(buffered, 0, end)), end + 2)


_ENCODE = json.JSONEncoder(separators=(",", ":")).encode  # json.dumps makes an encoder a call for these
_date: tuple[int, str] = (0, "")  # the last second's HTTP date and its text


def _http_date() -> str:
    """An answer's Date, as http.server's date_time_string writes it, made once a second."""
    global _date
    second = int(time.time())
    if _date[0] != second:
        _date = (second, email.utils.formatdate(second, usegmt=True))
    return _date[1]


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a busy client needs no connection a request
    # An answer's headers and body are buffered and go out in one write when http.server
    # flushes after the request (or at the connection's end): two writes were two
    # segments on the loopback and two more GIL hand-overs a request (bench `ids`). Nagle's
    # algorithm stays off: an answer over the buffer is still two writes, and the second
    # would wait for the ACK of the first, which a keep-alive client delays by 40 ms.
    wbufsize = io.DEFAULT_BUFFER_SIZE
    disable_nagle_algorithm = True
    server: "_Server"
    server_version = "nfshunt-ids"
    sys_version = ""

    client_address: "Peer"  # (what _Server.process_request passes)
    rfile: io.BufferedReader  # (setup's, which keeps the deadline)
    raw_requestline: bytes  # (http.server's: the request line as read)
    # http.server's email.message.Message, or a strict head's _Headers: the handler asks
    # both only `get`, which they answer alike.
    headers: Any

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the socket's own file: replaced by one that keeps the deadline
        api = self.server.api
        self._reader = _DeadlineReader(self.connection, HEAD_BYTES + api.cfg.max_body_bytes, api.request_seconds)
        self.rfile = io.BufferedReader(self._reader)
        self._authenticated = False  # until then its requests must all come by PREAUTH_SECONDS from its accept
        self._preauth = self.client_address.accepted + api.preauth_seconds

    def handle_one_request(self) -> None:
        now = time.monotonic()
        if self._authenticated:
            self._reader.next_request(now + self.server.api.idle_seconds, math.inf, self.rfile)
        else:
            self._reader.next_request(self._preauth, self._preauth, self.rfile)
        try:
            super().handle_one_request()
        except BlockingIOError as exc:  # SO_SNDTIMEO passed: what http.server does when a write times out
            self.log_error("Request timed out: %r", exc)
            self.server.api.count(Reject.UNREAD)
            self.close_connection = True
        if self.close_connection and self._reader.received and time.monotonic() >= self._reader.deadline:
            self.server.api.count(Reject.TIMEOUT)  # a request begun and not finished in time

    def finish(self) -> None:
        with contextlib.suppress(OSError):  # the last answer's buffered rest: its client cut off (counted) or gone
            super().finish()

    def parse_request(self) -> bool:
        """http.server's parse_request, done here for a strict head (_strict_head)."""
        # peek reads the socket only when nothing is buffered, as http.server's read would
        head = _strict_head(self.raw_requestline, self.rfile.peek)
        if head is None:
            return super().parse_request()
        self.command, self.path, self.request_version, self.headers, used = head
        self.requestline = self.raw_requestline[:-2].decode("ascii")
        self.rfile.read(used)  # the head, from the buffer
        connection = self.headers.get("Connection", "").lower()
        self.close_connection = connection == "close" or (self.request_version == "HTTP/1.0"
                                                          and connection != "keep-alive")
        if self.headers.get("Expect", "").lower() == "100-continue" and self.request_version == "HTTP/1.1":
            return self.handle_expect_100()
        return True

    def handle_expect_100(self) -> bool:
        """The interim 100 Continue goes out now: the client waits for it to send its body."""
        super().handle_expect_100()
        self.wfile.flush()
        return True

    def log_message(self, format: str, *args: Any) -> None:
        LOG.debug("ids api %s: " + format, self.client_address[0], *args)

    # --- answers ------------------------------------------------------------------------------

    def _send(self, status: int, body: Any, close: bool = False, next_after: int | None = None) -> None:
        """The answer, its head made here as http.server's send_response, send_header and
        end_headers would make it, byte for byte, and written with the body at once (they
        cost ~20 us a request, the Date most: bench ids, harness)."""
        data = _ENCODE(body).encode() + b"\n"
        if not self._reader.kernel_timeouts:
            self.connection.settimeout(WRITE_SECONDS)
        self.log_request(status)
        if close:
            self.close_connection = True
        head = b""
        if self.request_version != "HTTP/0.9":  # an HTTP/0.9 answer is its body alone
            phrase = self.responses[status][0] if status in self.responses else ""
            connection = "Connection: close\r\n" if close else ""
            more = "" if next_after is None else f"{NEXT_HEADER}: {next_after}\r\n"  # (a SciPass list: no room in it)
            head = (f"{self.protocol_version} {status} {phrase}\r\nServer: {self.version_string()}\r\n"
                    f"Date: {_http_date()}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                    f"{connection}{more}\r\n").encode("latin-1")
        self.wfile.write(head if self.command == "HEAD" else head + data)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a bad request line or headers, an unknown method), as JSON."""
        why = Reject.METHOD if code == 501 else Reject.MALFORMED
        self.server.api.count(why)
        reason = (message or self.responses.get(code, ("",))[0])[:200]  # it may quote the client's bytes
        self._send(code, {"result": "error", "error": why.value, "reason": reason}, close=True)

    def _refuse(self, why: Reject, reason: str, scipass: bool = False, close: bool = False) -> None:
        self.server.api.count(why)
        body = {"success": 0, "error": reason} if scipass else {"result": "error", "error": why.value,
                                                                "reason": reason}
        self._send(STATUS[why], body, close)

    def _outcome(self, outcome: Outcome, rule_id: str, scipass: bool = False) -> None:
        if outcome.result is Result.ERROR:
            why = outcome.error or Reject.INTERNAL
            if outcome.refusal is None:  # a precedence refusal is counted by its rule where it is decided
                self.server.api.count(why)
            if scipass:
                self._send(STATUS[why], {"success": 0, "error": outcome.reason})
                return
            body: dict[str, Any] = {"result": "error", "id": rule_id, "error": why.value, "reason": outcome.reason}
            if outcome.refusal is not None:
                body["refusal"] = outcome.refusal.value
            self._send(STATUS[why], body)
            return
        if scipass:
            self._send(200, {"success": 1, "result": outcome.result.value, "id": rule_id})
            return
        body = {"result": outcome.result.value, "id": rule_id}
        if outcome.reason:
            body["reason"] = outcome.reason
        if outcome.pending is not None:
            body["pending"] = outcome.pending
        if outcome.view is not None:
            body["rule"] = outcome.view.to_json()
        status = {Result.ADDED: 202 if outcome.pending is not None else 201}.get(outcome.result, 200)
        self._send(status, body)

    # --- the request --------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def do_PUT(self) -> None:
        self._handle()

    def do_DELETE(self) -> None:
        self._handle()

    def _handle(self) -> None:
        scipass = self.path.startswith("/scipass/")
        length = self.headers.get("Content-Length", "0").strip()
        self._unread = length not in ("", "0") or bool(self.headers.get("Transfer-Encoding"))
        try:
            if self._reader.head(self.rfile) > HEAD_BYTES:  # (the reader's limit is the head's and the body's)
                self._unread = True  # what is left of it
                raise _Refused(Reject.TOO_LARGE, f"request too large: its line and headers are over {HEAD_BYTES} "
                               "bytes")
            client = self._authenticate()
            body = self._body()
            self._route(client, body, scipass)
        except _Refused as refused:
            # An unread body would be taken for the next request: close instead.
            self._refuse(refused.why, refused.reason, scipass, close=self._unread)
        except TimeoutError:
            raise  # the base class cuts the connection
        except Exception:  # a bug must not leave the client unanswered (nor flood the log: rate-limited)
            self.server.rlog.log(logging.ERROR, "internal", "ids api: %s %s failed", self.command, self.path,
                                 exc_info=True)
            self._refuse(Reject.INTERNAL, "internal error (logged)", scipass, close=True)

    def _authenticate(self) -> Client:
        """The requester, held to its own rate (ids.rate_limit, per client: another's flood
        takes nothing of it). A request that fails authentication is answered 401 and its
        connection closed; one from a client (an address, or on this host a local user)
        failing more than ids.rate_limit_unauthenticated a second is answered 429 (closed)."""
        api = self.server.api
        now = time.monotonic()
        try:
            client = self._requester()
        except _Refused:
            self._unread = True  # closed: a 401 keeps nothing open
            if not api.unauthenticated.allow(self.client_address.who, now):
                raise _Refused(Reject.RATE_LIMITED, "rate limit: too many unauthenticated requests from this "
                               f"client (ids.rate_limit_unauthenticated is {api.cfg.rate_limit_unauthenticated} "
                               "a second)") from None
            raise
        self._authenticated = True
        if not api.limit.allow(client.source, now):
            raise _Refused(Reject.RATE_LIMITED, f"rate limit: too many requests from {client.source} "
                           f"(ids.rate_limit is {api.cfg.rate_limit} a second)")
        return client

    def _requester(self) -> Client:
        api = self.server.api
        if api.tls_client_names:
            name = _certificate_name(self.connection)
            if name is None:
                raise _Refused(Reject.UNAUTHENTICATED, "the client certificate has no usable common name")
            return Client(f"ids:{name}", False)
        assert api.tokens is not None
        token = api.tokens.client(self.headers.get("Authorization"))
        if token is None:
            raise _Refused(Reject.UNAUTHENTICATED, "missing or unknown bearer token (Authorization: Bearer ...)")
        return Client(f"ids:{token.client}", token.admin)

    def _body(self) -> Any:
        if self.headers.get("Transfer-Encoding"):
            raise _Refused(Reject.LENGTH_REQUIRED, "a body must come with Content-Length (no chunked encoding)")
        length_text = self.headers.get("Content-Length")
        if length_text is None:
            if self.command in ("POST", "PUT"):
                raise _Refused(Reject.LENGTH_REQUIRED, "a body with Content-Length is required")
            return None
        if not re.fullmatch(r"[0-9]{1,12}", length_text.strip(), re.ASCII):
            raise _Refused(Reject.MALFORMED, "Content-Length is not a number")
        length = int(length_text)
        limit = self.server.api.cfg.max_body_bytes
        if length > limit:
            raise _Refused(Reject.TOO_LARGE, f"request too large: {length} bytes, the limit is {limit} "
                           "(ids.max_body_bytes)")
        if length == 0:
            return None
        data = self.rfile.read(length)
        self._unread = False
        if len(data) < length:
            raise TimeoutError("the body ended early")
        try:
            return jsonfile.parse(data, "the body")
        except jsonfile.JsonInputError as exc:
            raise _Refused(Reject.MALFORMED, str(exc)) from None

    def _route(self, client: Client, body: Any, scipass: bool) -> None:
        api = self.server.api
        requester = client.source
        url = urlsplit(self.path)
        path = url.path
        if path == "/v1/rules":
            self._allow(("GET", "POST"))
            if self.command == "POST":
                rule = self._parse(lambda: parse(body, requester, api.now(), api.cfg))
                self._outcome(self._ask(api.backend.submit, rule, api.cfg.answer_timeout), rule.id)
                return
            self._no_body(body)
            page = self._list(client, _filters(url.query))
            self._send(200, {"rules": [v.to_json() for v in page.views],
                             **({} if page.next is None else {"next": page.next})})
            return
        if path.startswith("/v1/rules/"):
            self._allow(("GET", "DELETE"))
            self._no_body(body)
            rule_id = unquote(path[len("/v1/rules/"):])
            if not RULE_ID.fullmatch(rule_id):
                raise _Refused(Reject.INVALID, "id: not 1-128 of A-Z a-z 0-9 . _ : @ ~ -")
            if self.command == "DELETE":
                self._outcome(self._ask(api.backend.remove, requester, rule_id), rule_id)
                return
            view = self._ask(api.backend.rule, requester, rule_id)
            if view is None:
                raise _Refused(Reject.NOT_FOUND, f"no rule {rule_id} of {requester}")
            self._send(200, view.to_json())
            return
        flow = {"/scipass/flows/good_flow": True, "/scipass/flows/bad_flow": False}.get(path)
        if flow is not None:
            self._allow(("PUT", "DELETE"))
            rule = self._parse(lambda: parse_scipass(body, flow, requester, api.now(), api.cfg))
            if self.command == "PUT":
                self._outcome(self._ask(api.backend.submit, rule, api.cfg.answer_timeout), rule.id, scipass=True)
            else:
                assert rule.connection is not None
                self._outcome(self._ask(api.backend.remove, requester, scipass_id(rule.kind, rule.connection)), rule.id,
                              scipass=True)
            return
        listing = {"/scipass/flows/get_good_flows": Kind.SHUNT, "/scipass/flows/get_bad_flows": Kind.BLOCK}.get(path)
        if listing is not None:
            self._allow(("GET",))
            self._no_body(body)
            page = self._list(client, dataclasses.replace(_filters(url.query, ("after", "limit")), kind=listing))
            self._send(200, [scipass_json(v.rule) for v in page.views], next_after=page.next)
            return
        raise _Refused(Reject.NOT_FOUND, f"no such resource: {path[:100]}")

    def _list(self, client: Client, wanted: "Filters") -> Page:
        """A page of the rules the client may see: its own, or (a token marked admin) every
        client's. A client lists at most LIST_RULES rules a second: each page is read in the
        controller (off its event loop, but in its process)."""
        api = self.server.api
        source = wanted.source
        if not client.admin:
            if source not in (None, client.source):
                raise _Refused(Reject.FORBIDDEN, f"{client.source} sees its own rules only (a token marked admin in "
                               "ids.token_file sees every client's)")
            source = client.source
        if not api.lists.allow(client.source, time.monotonic()):
            raise _Refused(Reject.RATE_LIMITED, f"rate limit: a client lists at most {LIST_RULES} rules a second")
        page: Page = self._ask(api.backend.rules, source, wanted.kind, wanted.address, wanted.after, wanted.limit)
        api.lists.charge(client.source, len(page.views), time.monotonic())
        return page

    def _ask(self, call: Callable[..., Any], *args: Any) -> Any:
        """A backend call; its TimeoutError is the controller's, not the client's (which cuts the connection)."""
        try:
            return call(*args)
        except TimeoutError:
            raise _Refused(Reject.UNANSWERED, "the controller did not answer in time (an added rule, if it was "
                           "kept, expires as any rule; list the rules to see)") from None

    def _allow(self, methods: tuple[str, ...]) -> None:
        if self.command not in methods:
            raise _Refused(Reject.METHOD, f"{self.command} is not allowed here (allowed: {', '.join(methods)})")

    def _no_body(self, body: Any) -> None:
        if body is not None:
            raise _Refused(Reject.INVALID, f"a {self.command} of this resource takes no body")

    @staticmethod
    def _parse(make: Callable[[], Rule]) -> Rule:
        try:
            return make()
        except RuleError as exc:
            raise _Refused(Reject.INVALID, str(exc)) from None


@dataclass(frozen=True)
class Filters:
    """A listing's query: ?source= &kind= &address= (filters) &after= &limit= (its page)."""
    source: str | None = None
    kind: Kind | None = None
    address: Network | None = None
    after: int = 0
    limit: int = PAGE_SIZE


def _filters(query: str, allowed: tuple[str, ...] = ("source", "kind", "address", "after", "limit")) -> Filters:
    try:
        given = parse_qs(query, strict_parsing=True, max_num_fields=len(allowed)) if query else {}
    except ValueError as exc:
        raise _Refused(Reject.INVALID, f"query: {exc}") from None
    for name, values in given.items():
        if name not in allowed:
            raise _Refused(Reject.INVALID, f"query: unknown filter {name[:40]!r} (allowed: {', '.join(allowed)})")
        if len(values) > 1:
            raise _Refused(Reject.INVALID, f"query: {name} given twice")
    one = {name: values[0] for name, values in given.items()}
    try:
        # the controller's own check of a listing: one it refuses would be a forged frame there
        return Filters(*frames.listing_of(one.get("source"), one.get("kind"), one.get("address"),
                                          _number("after", one.get("after"), 0),
                                          _number("limit", one.get("limit"), PAGE_SIZE)))
    except FrameError as exc:
        raise _Refused(Reject.INVALID, f"query: {exc}") from None


def _number(name: str, text: str | None, default: int) -> int:
    if text is None:
        return default
    if not re.fullmatch(r"[0-9]{1,19}", text, re.ASCII):
        raise _Refused(Reject.INVALID, f"query: {name}: {text[:40]!r} is not a number")
    return int(text)


def _certificate_name(sock: socket.socket) -> str | None:
    if not isinstance(sock, ssl.SSLSocket):
        return None
    cert = sock.getpeercert() or {}
    # The subject's RDNs, each of (name, value) pairs; typeshed gives every field of a
    # certificate one type (a string or tuples nested either way).
    subject = cast("tuple[tuple[tuple[str, str], ...], ...]", cert.get("subject", ()))
    for rdn in subject:
        for key, value in rdn:
            if key == "commonName" and CLIENT_NAME.fullmatch(value):
                return str(value)
    return None


def listen(cfg: IdsConfig) -> socket.socket:
    """The API's socket, bound to its address and listening (by the controller when the API
    runs in its own process, ids_process: an address in use fails the controller's start).
    No name is looked up (http.server's bind would: a DNS query at start)."""
    sock = socket.socket(socket.AF_INET6 if ":" in cfg.listen_address else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((cfg.listen_address, cfg.listen_port))
        sock.listen(_Server.request_queue_size)
    except OSError:
        sock.close()
        raise
    return sock


class Peer(tuple[str, int]):
    """A connection's other end: its address and port (the client address http.server
    knows); `who`, the client it counts as for its share of connections and of failed
    logins (its address; on this host, its address and its local user, whose uid the kernel
    names: on the loopback every local user is 127.0.0.1); when it was accepted (monotonic)."""
    who: str
    accepted: float

    def __new__(cls, host: str, port: int, who: str, accepted: float) -> Peer:
        peer = super().__new__(cls, (host, port))
        peer.who, peer.accepted = who, accepted
        return peer


def _who(request: socket.socket, host: str, port: int) -> str:
    local = request.getsockname()
    if ipaddress.ip_address(host).is_loopback or host == local[0]:
        uid = sockdiag.owner((host, port), (local[0], local[1]))
        if uid is not None:
            return f"{host} uid {uid}"
    return host


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # stop() must not wait on a slow client's thread
    request_queue_size = 128

    def __init__(self, api: "IdsApi"):
        self.api = api
        self._slots = threading.BoundedSemaphore(api.cfg.max_connections)
        self._per_client = min(api.cfg.max_connections_per_client, api.cfg.max_connections)
        self._held: dict[str, int] = {}  # connections open, by client (Peer.who)
        self._held_lock = threading.Lock()
        super().__init__((api.cfg.listen_address, api.cfg.listen_port), _Handler, bind_and_activate=False)
        self.socket.close()  # (the one socketserver made unbound: ours is `listen`'s, or the controller's)
        self.socket = api.listening if api.listening is not None else listen(api.cfg)
        self.server_address = self.socket.getsockname()
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])
        self.rlog = RateLimitedLog(LOG)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection's thread ended on an exception (socketserver's default prints its
        traceback to stderr, once for every such connection a client opens)."""
        self.api.count(Reject.INTERNAL)
        self.rlog.warning("connection", "ids api: the connection from %s ended on an error: %r",
                           client_address[0], sys.exc_info()[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        """A connection takes one of ids.max_connections slots, and one of its client's
        ids.max_connections_per_client; with none free it is closed at once."""
        peer = Peer(client_address[0], client_address[1], _who(request, *client_address[:2]), time.monotonic())
        with self._held_lock:
            held = self._held.get(peer.who, 0)
            if not self._slots.acquire(blocking=False):
                busy: Reject | None = Reject.BUSY
            elif held >= self._per_client:
                self._slots.release()
                busy = Reject.CLIENT_BUSY
            else:
                busy, self._held[peer.who] = None, held + 1
        if busy is not None:
            self.api.count(busy)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, peer)
        except BaseException:
            self._release(peer)
            raise

    def _release(self, peer: Peer) -> None:
        with self._held_lock:
            held = self._held.pop(peer.who) - 1
            if held:
                self._held[peer.who] = held
            self._slots.release()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(client_address)

    def finish_request(self, request: Any, client_address: Any) -> None:
        ctx = self.api.tls
        if ctx is None:
            super().finish_request(request, client_address)
            return
        try:
            tls = ctx.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
        except (OSError, ValueError):
            return
        try:
            tls.settimeout(max(0.001, client_address.accepted + self.api.preauth_seconds - time.monotonic()))
            tls.do_handshake()
        except (OSError, ValueError) as exc:
            self.api.count(Reject.TLS)
            LOG.info("ids api: TLS handshake with %s failed: %s", client_address[0], exc)
            tls.close()
            return
        try:
            super().finish_request(tls, client_address)
        finally:
            tls.close()


class IdsApi:
    """The API's server: `start` binds and serves on a thread, `stop` ends it.
    count: called with each refusal's reason (the metrics' counter); now: wall-clock time;
    listening: a socket bound and listening already, served instead of binding one;
    tokens: the bearer tokens as given (the API's process: by the controller), else read
    from ids.token_file here."""

    def __init__(self, cfg: IdsConfig, backend: RuleBackend, count: Callable[[Reject], None] = lambda why: None,
                 now: Callable[[], float] = time.time, request_seconds: float = REQUEST_SECONDS,
                 listening: socket.socket | None = None, tokens: Tokens | None = None,
                 preauth_seconds: float = PREAUTH_SECONDS, idle_seconds: float = IDLE_SECONDS):
        self.cfg = cfg
        self.listening = listening
        self.backend = backend
        self.count = count
        self.now = now
        self.request_seconds = request_seconds
        self.preauth_seconds = preauth_seconds
        self.idle_seconds = idle_seconds
        self.limit = RateLimit(cfg.rate_limit)  # by requester
        self.unauthenticated = RateLimit(cfg.rate_limit_unauthenticated)  # by client (Peer.who)
        self.lists = RateLimit(LIST_RULES)  # rules listed, by requester
        self.tokens = tokens if tokens is not None else Tokens(cfg.token_file) if cfg.token_file else None
        self.tls: ssl.SSLContext | None = None
        self.tls_client_names = False
        if cfg.tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.load_cert_chain(cfg.tls.certificate, cfg.tls.private_key)
            if cfg.tls.client_ca is not None:
                ctx.load_verify_locations(cfg.tls.client_ca)
                ctx.verify_mode = ssl.CERT_REQUIRED
                self.tls_client_names = True
            self.tls = ctx
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """Where it listens (the port the kernel chose, for a configured port 0)."""
        assert self._server is not None
        return str(self._server.server_address[0]), int(self._server.server_address[1])

    def start(self) -> None:
        self._server = _Server(self)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="nfshunt-ids-api", daemon=True)
        self._thread.start()
        LOG.info("IDS API listening on %s port %d (%s)", *self.address, "TLS" if self.tls else "loopback, no TLS")

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        assert self._thread is not None
        self._thread.join()
        self._server = self._thread = None
