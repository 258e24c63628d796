"""The IDS API tried as an attacker on the same host would try it (issue 36, 8 and 9): an
unprivileged local user (the attacker runs as `nobody`, a process of its own) holds
connections open without a token, trickles, or floods, while a real IDS (this process,
another local user) sends its requests. On the loopback both come from 127.0.0.1: the
API tells them apart by the local user the kernel names for each connection. The server
is the real one (IdsApi, as the API's process runs it) on a fake backend, over real sockets."""
from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import time

import pytest

from nfshunt.ids.calls import Reject
from tests.idsfake import OTHER, TOKEN, call, make_api, write_tokens

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the attacker runs as another local user (nobody)")

ATTACKER = r"""
import socket, sys, threading, time
port, mode, count = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
seconds, period = float(sys.argv[4]), float(sys.argv[5])
token = sys.argv[6] if len(sys.argv) > 6 else None
auth = b"Authorization: Bearer " + token.encode() + b"\r\n" if token else b""
REQUEST = b"GET /v1/rules HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n"
end = time.monotonic() + seconds
sent = answered = opened = refused = 0
lock = threading.Lock()

def connect():
    global opened
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    with lock:
        opened += 1
    return s

def silencer():
    # issue 36's: one unauthenticated GET every `period` on a kept connection, again when closed
    global sent, answered, refused
    s = None
    while time.monotonic() < end:
        try:
            if s is None:
                s = connect()
            s.sendall(REQUEST)
            with lock:
                sent += 1
            data = s.recv(65536)
            if not data:
                raise ConnectionError
            with lock:
                answered += 1
            time.sleep(period)
        except OSError:
            with lock:
                refused += 1
            if s is not None:
                s.close()
            s = None
            time.sleep(0.05)

def slowloris():
    # connect and send one byte of a head every `period`, never a whole request
    global refused
    while time.monotonic() < end:
        try:
            s = connect()
            for b in REQUEST:
                s.sendall(bytes([b]))
                time.sleep(period)
                if time.monotonic() > end:
                    break
        except OSError:
            with lock:
                refused += 1
            time.sleep(0.05)

def flood():
    # requests as fast as the server answers them
    global sent, answered, refused
    s = None
    while time.monotonic() < end:
        try:
            if s is None:
                s = connect()
            s.sendall(REQUEST)
            with lock:
                sent += 1
            if not s.recv(65536):
                raise ConnectionError
            with lock:
                answered += 1
        except OSError:
            with lock:
                refused += 1
            if s is not None:
                s.close()
            s = None

threads = [threading.Thread(target={"silencer": silencer, "slowloris": slowloris, "flood": flood}[mode], daemon=True)
           for _ in range(count)]
for t in threads:
    t.start()
print("started", flush=True)
for t in threads:
    t.join(seconds + 10)
print(sent, answered, opened, refused, flush=True)
"""


class Attacker:
    """The attack program, run as `nobody`: mode silencer, slowloris or flood, `count` threads."""

    def __init__(self, api, mode, count, seconds, period=0.0, token=None):
        args = [sys.executable, "-c", ATTACKER, str(api.address[1]), mode, str(count), str(seconds), str(period)]
        self.proc = subprocess.Popen(args + ([token] if token else []), user="nobody", stdout=subprocess.PIPE,
                                     text=True, cwd="/")
        assert self.proc.stdout.readline().strip() == "started"

    def result(self):
        out, _ = self.proc.communicate(timeout=60)
        sent, answered, opened, refused = (int(x) for x in out.split())
        return {"sent": sent, "answered": answered, "opened": opened, "refused": refused}

    def kill(self):
        self.proc.kill()
        self.proc.communicate()


def valid_requests(api, n, every, token=TOKEN):
    """The real IDS's requests, each on a connection of its own (as Zeek's curl makes
    them): their statuses (0: the connection was refused or reset) and times (ms)."""
    got = []
    for _ in range(n):
        t0 = time.monotonic()
        try:
            status = call(api, "GET", "/v1/rules", token=token)[0]
        except (OSError, http.client.HTTPException):
            status = 0
        got.append((status, (time.monotonic() - t0) * 1000))
        time.sleep(every)
    return got


def report(what, got, attacker=None):
    times = sorted(t for _, t in got)
    print(f"\n{what}: statuses {sorted(s for s, _ in got)}; ms median {times[len(times) // 2]:.1f} max "
          f"{times[-1]:.1f}; attacker {attacker}")


def test_unauthenticated_connections_cannot_hold_every_slot(tmp_path):
    """Issue 36, 8: 64 sockets, each sending one unauthenticated GET every period shorter
    than the request deadline, held every one of the 64 slots (a 401 kept the connection,
    and each request renewed its deadline): real requests were reset. Now a 401 closes its
    connection and a local user holds at most max_connections_per_client (16) at once."""
    api, _, counted = make_api(write_tokens(tmp_path), request_seconds=2.0)
    try:
        attacker = Attacker(api, "silencer", 64, 6.0, period=1.0)
        try:
            time.sleep(1.0)  # (its 64 sockets up and holding)
            got = valid_requests(api, 20, 0.2)
            result = attacker.result()
        finally:
            attacker.kill()
        report("valid requests beside 64 silencers", got, result)
        assert [s for s, _ in got] == [200] * 20
        assert result["opened"] > 64  # each 401 closed its connection: it had to open again
        assert Reject.UNAUTHENTICATED in counted
    finally:
        api.stop()


def test_a_401_closes_its_connection(tmp_path):
    api, _, counted = make_api(write_tokens(tmp_path))
    try:
        with socket.create_connection(api.address, timeout=5) as s:
            s.sendall(b"GET /v1/rules HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 401 ") and b"Connection: close" in answer
        assert counted == [Reject.UNAUTHENTICATED]
    finally:
        api.stop()


def test_slow_and_idle_connections_are_closed_at_short_deadlines(tmp_path):
    """Before its first request is authenticated a connection has preauth_seconds from its
    accept, however it trickles; an authenticated keep-alive connection waits idle_seconds
    for its next request; a slowloris of 64 connections holds at most 16 slots meanwhile."""
    api, _, counted = make_api(write_tokens(tmp_path), request_seconds=10.0, preauth_seconds=1.0, idle_seconds=0.5)
    try:
        t0 = time.monotonic()
        with socket.create_connection(api.address, timeout=5) as silent:
            assert silent.recv(100) == b""
        assert 0.9 < time.monotonic() - t0 < 3.0  # (10 s before: the whole request's deadline)
        kept = http.client.HTTPConnection(*api.address, timeout=5)
        kept.request("GET", "/v1/rules", headers={"Authorization": f"Bearer {TOKEN}"})
        assert kept.getresponse().read()
        t0 = time.monotonic()
        assert kept.sock.recv(100) == b""  # closed once idle for 0.5 s
        assert 0.4 < time.monotonic() - t0 < 3.0
        kept.close()
        attacker = Attacker(api, "slowloris", 64, 4.0, period=0.3)
        try:
            time.sleep(0.5)
            got = valid_requests(api, 10, 0.2)
            result = attacker.result()
        finally:
            attacker.kill()
        report("valid requests beside a slowloris of 64", got, result)
        assert [s for s, _ in got] == [200] * 10
        assert Reject.CLIENT_BUSY in counted and Reject.TIMEOUT in counted
    finally:
        api.stop()


@pytest.mark.parametrize("token", [None, "wrong-token-0123456789abcdef", OTHER],
                         ids=["no-token", "wrong-token", "another-clients-token"])
def test_an_unprivileged_flood_does_not_rate_limit_a_real_ids(tmp_path, token):
    """Issue 36, 9: the rate limit was per address, checked before authentication: on the
    loopback a local user's flood emptied 127.0.0.1's bucket, and 13 of 20 valid Zeek
    requests got 429. Now an authenticated client is limited by its own name, and failed
    logins by their client's own (tighter) limit."""
    api, _, counted = make_api(write_tokens(tmp_path), rate_limit=50, rate_limit_unauthenticated=5)
    try:
        attacker = Attacker(api, "flood", 8, 4.0, token=token)
        try:
            time.sleep(0.5)
            got = valid_requests(api, 20, 0.1)
            result = attacker.result()
        finally:
            attacker.kill()
        report(f"valid requests beside a flood ({token and token[:6]})", got, result)
        assert [s for s, _ in got] == [200] * 20
        assert Reject.RATE_LIMITED in counted  # the flood was held to its own limit
        assert result["answered"] > 0
    finally:
        api.stop()


def test_failed_logins_are_limited_per_local_user(tmp_path):
    """Past rate_limit_unauthenticated failed logins a second, a client is answered 429 and
    closed; another local user (this process) is still told 401 for its own failure."""
    api, _, counted = make_api(write_tokens(tmp_path), rate_limit_unauthenticated=5)
    try:
        attacker = Attacker(api, "flood", 2, 1.5, token="wrong-token-0123456789abcdef")
        try:
            time.sleep(0.5)
            assert call(api, "GET", "/v1/rules", token="mine-is-wrong-too-0123456789")[0] == 401
            result = attacker.result()
        finally:
            attacker.kill()
        # 2 s of failures at 5 a second allowed: the rest were 429
        assert counted.count(Reject.UNAUTHENTICATED) <= 5 * 3 + 1 < result["answered"]
        assert counted.count(Reject.RATE_LIMITED) >= result["answered"] - counted.count(Reject.UNAUTHENTICATED)
    finally:
        api.stop()
