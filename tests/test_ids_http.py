"""The IDS API's own HTTP pieces, tested equal to http.server's, whose work they do
cheaper: the answer's head."""
import io
import json
from typing import Any

import pytest

from nfshunt import ids_api
from nfshunt.ids_api import _Handler


class _Conn:
    def settimeout(self, seconds: float) -> None:
        pass


def _handler(version: str, command: str) -> _Handler:
    """A handler as it is after a request's line (no server, no socket)."""
    h = _Handler.__new__(_Handler)
    h.request_version, h.command, h.requestline = version, command, f"{command} / {version}"
    h.wfile, h.close_connection = io.BytesIO(), False
    h.connection, h.client_address = _Conn(), ("127.0.0.1", 1)
    return h


def _library_send(h: _Handler, status: int, body: Any, close: bool) -> None:
    """The answer as http.server's send_response, send_header and end_headers write it."""
    data = json.dumps(body, separators=(",", ":")).encode() + b"\n"
    h.send_response(status)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    if close:
        h.send_header("Connection", "close")
    h.end_headers()
    if h.command != "HEAD":
        h.wfile.write(data)


@pytest.mark.parametrize("version", ["HTTP/1.1", "HTTP/1.0", "HTTP/0.9", ""])
@pytest.mark.parametrize("command", ["POST", "GET", "HEAD"])
def test_answers_are_byte_for_byte_http_servers(version, command, monkeypatch):
    monkeypatch.setattr(ids_api.time, "time", lambda: 1795550000.75)  # one Date for both
    body = {"result": "added", "id": "caf\u00e9", "n": [1, 2.5, None], "rule": {"a": True}}
    for status in (200, 201, 202, 400, 401, 404, 411, 413, 429, 431, 500, 501, 503, 504, 599):
        for close in (False, True):
            ours, library = _handler(version, command), _handler(version, command)
            ours._send(status, body, close)
            _library_send(library, status, body, close)
            assert ours.wfile.getvalue() == library.wfile.getvalue(), (status, close)
            assert ours.close_connection == library.close_connection == close


def test_the_date_follows_the_clock(monkeypatch):
    for now in (1795550000.0, 1795550000.999, 1795550001.0, 1795636800.5, 1700000000.2):
        monkeypatch.setattr(ids_api.time, "time", lambda now=now: now)
        h = _handler("HTTP/1.1", "GET")
        assert ids_api._http_date() == h.date_time_string(int(now)) == h.date_time_string(now)
