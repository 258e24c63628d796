"""The local control channel: a Unix stream socket that only root may use.

One JSON object per line each way. The server runs on a thread of its own and hands each
request to a callback (the app answers it on its event loop). Requests:

  {"cmd": "status"}                                   switch state, counters, connections
  {"cmd": "flush", "reason": "..."}                   every shunt and block back to the slow path
  {"cmd": "unshunt"|"block", "ct_id": N}              one connection, by conntrack id ...
  {"cmd": "unshunt"|"block", "tuple": "tcp 10.0.0.1:40000 -> 10.0.0.2:5201"}   ... or tuple
  {"cmd": "reload"}                                   read the config again (operator_api.reload)
  {"cmd": "ids_remove", "source": "ids:zeek", "id": "12"}   an IDS's rule taken out by the operator
  {"cmd": "explain", "target": "tcp 10.0.0.1:40000 -> 10.0.0.2:5201"}   one connection through every layer
  {"cmd": "top", "limit": 20}                          the busiest connections of both paths, with rates

Refusals (not root, bad request) come back as {"error": "..."}; the socket file is mode
0600 in a 0700 directory, and the peer's credentials are checked as well.
"""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import stat
import struct
import threading
from typing import Any, Callable

from nfshunt.config import jsonfile
from nfshunt.records.model import TCP, UDP, FlowTuple, canonical_address

LOG = logging.getLogger("nfshunt.control")
MAX_REQUEST = 64 * 1024
REQUEST_TIMEOUT = 10.0  # seconds a client waits for an answer (a reload waits longer: cli.cmd_reload)
SO_PEERCRED_FMT = struct.Struct("3i")  # pid, uid, gid


class ControlError(RuntimeError):
    pass


class NotRunning(ControlError):
    """No controller listens on the socket (not started yet, or stopped)."""


class NotAnswered(ControlError):
    """The controller took the request but did not answer in time (it may still act on it)."""


_TUPLE = re.compile(r"^\s*(tcp|udp)\s+\[?([0-9a-fA-F.:]+?)\]?:(\d+)\s*->\s*\[?([0-9a-fA-F.:]+?)\]?:(\d+)"
                    r"(?:\s+zone\s+(\S+))?\s*$", re.ASCII)
ZONE_MAX = 65535  # a conntrack zone is a u16


def parse_tuple(text: str) -> FlowTuple:
    """'tcp 10.0.0.1:40000 -> 10.0.0.2:5201' (IPv6 in brackets), with ' zone N' after it
    for an entry in conntrack zone N (str(FlowTuple) writes it so), as a FlowTuple."""
    import ipaddress
    m = _TUPLE.match(text)
    if not m:
        raise ValueError(f"not a tuple: {text!r} (expected e.g. 'tcp 10.0.0.1:40000 -> 10.0.0.2:5201', "
                         "optionally followed by ' zone 100')")
    proto, src, sport, dst, dport, zone = m.groups()
    if zone is not None and not (zone.isascii() and zone.isdigit() and len(zone) <= 5 and int(zone) <= ZONE_MAX):
        raise ValueError(f"zone {zone!r}: a conntrack zone must be 0-{ZONE_MAX}")
    a, b = ipaddress.ip_address(src), ipaddress.ip_address(dst)
    if a.version != b.version:
        raise ValueError("source and destination are of different address families")
    for port in (sport, dport):
        if not 0 < int(port) < 65536:
            raise ValueError(f"port {port} out of range")
    return FlowTuple(a.version, TCP if proto == "tcp" else UDP, canonical_address(str(a)),
                     canonical_address(str(b)), int(sport), int(dport), int(zone or 0))


class ControlServer:
    def __init__(self, path: str, handle: Callable[[dict[str, Any]], dict[str, Any]]):
        self.path = path
        self.handle = handle
        self.requests = 0
        self.refused = 0
        self.sock = self._bind()
        self._thread = threading.Thread(target=self._serve, name="control", daemon=True)

    def _bind(self) -> socket.socket:
        directory = os.path.dirname(self.path)
        if not os.path.isdir(directory):
            os.makedirs(directory, mode=0o700)
        if os.path.lexists(self.path):
            if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
                raise ControlError(f"{self.path} exists and is not a socket; refusing to replace it")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(1)
            try:
                probe.connect(self.path)
                raise ControlError(f"another NFShunt controller answers on {self.path}")
            except (ConnectionRefusedError, FileNotFoundError, socket.timeout):
                os.unlink(self.path)  # left behind by a controller that died
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        sock.listen(8)
        return sock

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        try:
            self.sock.close()
        finally:
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed by stop()
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    def _client(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            try:
                _pid, uid, _gid = SO_PEERCRED_FMT.unpack(
                    conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, SO_PEERCRED_FMT.size))
                if uid != 0:
                    self.refused += 1
                    LOG.warning("control request from uid %d refused: root only", uid)
                    self._refuse(conn, {"error": "permission denied: the control socket is for root only"})
                    return
                data = b""
                while b"\n" not in data and len(data) <= MAX_REQUEST:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                line = data.split(b"\n", 1)[0]
                if len(line) > MAX_REQUEST:
                    self._refuse(conn, {"error": f"request too large (limit {MAX_REQUEST} bytes)"})
                    return
                try:
                    request = jsonfile.parse(line or b"null", "the request")  # bounded depth and digits
                    if not isinstance(request, dict) or not isinstance(request.get("cmd"), str):
                        raise ValueError("expected a JSON object with a string 'cmd'")
                except ValueError as exc:
                    self._reply(conn, {"error": f"bad request: {exc}"})
                    return
                self.requests += 1
                try:
                    self._reply(conn, self.handle(request))
                except Exception as exc:  # a failing request must not take the server down
                    LOG.exception("control request %s failed", request.get("cmd"))
                    self._reply(conn, {"error": f"internal error: {exc}"})
            except OSError as exc:
                LOG.debug("control client went away: %s", exc)

    def _refuse(self, conn: socket.socket, reply: dict[str, Any]) -> None:
        """Answer without reading the request, then read on (bounded) so a client still
        sending sees the answer: closed with its request unread, the socket would reset
        and the client lose the answer."""
        self._reply(conn, reply)
        conn.shutdown(socket.SHUT_WR)
        left = 16 * MAX_REQUEST
        while left > 0 and (chunk := conn.recv(min(left, 1 << 16))):
            left -= len(chunk)

    @staticmethod
    def _reply(conn: socket.socket, reply: dict[str, Any]) -> None:
        conn.sendall(json.dumps(reply, default=str).encode() + b"\n")


def request(path: str, payload: dict[str, Any], timeout: float = REQUEST_TIMEOUT) -> dict[str, Any]:
    """Send one request to a running controller; ControlError if it cannot be reached,
    NotAnswered if it took the request and gave no answer within `timeout`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sent = False
    try:
        sock.connect(path)
        sock.sendall(json.dumps(payload).encode() + b"\n")
        sent = True
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    except FileNotFoundError:
        raise NotRunning(f"no controller socket at {path} (is `nfshunt run` running?)") from None
    except PermissionError:
        raise ControlError(f"permission denied on {path}: the control socket is for root only") from None
    except ConnectionRefusedError:
        raise NotRunning(f"nothing listens on {path} (the controller is not running)") from None
    except socket.timeout:
        if not sent:  # (a request not whole is never read as one)
            raise ControlError(f"the controller did not take the request on {path} within {timeout:g} s") from None
        raise NotAnswered(f"the controller did not answer on {path} within {timeout:g} s") from None
    finally:
        sock.close()
    try:
        return json.loads(data)
    except ValueError:
        raise ControlError("the controller sent an unreadable answer") from None
