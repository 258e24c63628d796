"""The IDS HTTP API against a fake backend (the real store and precedence, no switch),
bound to 127.0.0.1 on an ephemeral port; tried as an attacker would as well."""
import http.client
import ipaddress
import json
import logging
import os
import re
import shutil
import socket
import ssl
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest

from nfshunt.config.ids import IdsConfig, IdsTLS, MayShunt
from nfshunt.ids import tokens
from nfshunt.ids.api import HEAD_BYTES, IdsApi
from nfshunt.ids.calls import Reject
from nfshunt.ids.frames import MAX_ANSWER, MAX_REQUEST, Channel
from nfshunt.ids.process import BackendServer, RemoteBackend
from nfshunt.observe import logs
from nfshunt.records.model import TCP, Action, FlowTuple
from tests.idsfake import ADMIN, CONN, OTHER, TOKEN, FakeBackend, call, ids_config, make_api, write_tokens


@pytest.fixture
def token_file(tmp_path):
    return write_tokens(tmp_path)


@pytest.fixture
def served(token_file):
    api, backend, counted = make_api(token_file)
    yield api, backend, counted
    api.stop()


def tuple_of(conn):
    t = FlowTuple(4, TCP, conn["src"], conn["dst"], conn["sport"], conn["dport"])
    return t, t.reversed()


def add(api, rule_id="1", token=TOKEN, **kw):
    body = {"id": rule_id, "action": "shunt", "connection": dict(CONN), "expire": 60}
    body.update(kw)
    return call(api, "POST", "/v1/rules", body, token=token)


def test_add_answers_once_with_the_outcome(served):
    api, backend, counted = served
    status, body = add(api)
    assert status == 202 and body["result"] == "added" and "conntrack entry" in body["pending"]
    status, body = add(api)
    assert (status, body["result"]) == (200, "exists")
    backend.policy[min(tuple_of(CONN))] = Action.IGNORE
    status, body = add(api, "2", connection={**CONN, "sport": 40001})
    assert (status, body["result"]) == (202, "added")  # that connection is not seen yet
    status, body = add(api, "1", connection={**CONN, "sport": 40002})
    assert (status, body["error"]) == (409, "duplicate") and "another" in body["reason"]
    assert counted == [Reject.DUPLICATE]


def test_policy_accepted_connection_added_policy_block_refused(served):
    api, backend, _ = served
    backend.policy[min(tuple_of(CONN))] = Action.IGNORE
    assert add(api)[0] == 201
    other = {**CONN, "sport": 40009}
    backend.policy[min(tuple_of(other))] = Action.BLOCK
    status, body = add(api, "2", connection=other)
    assert status == 403 and body["refusal"] == "blocked" and "a block beats a shunt" in body["reason"]
    status, body = add(api, "3", connection={**CONN, "dst": "192.0.2.1", "src": "192.0.2.2"})
    assert status == 403 and body["refusal"] == "outside_may_shunt"
    # An IDS block beats the policy's shunt.
    backend.policy[min(tuple_of(CONN))] = Action.SHUNT
    assert add(api, "b", action="block")[0] == 201


def test_get_list_delete(served):
    api, _, _ = served
    add(api, "1")
    add(api, "v6", connection={"protocol": "udp", "src": "fd00::1", "sport": 5, "dst": "fd00::2", "dport": 6})
    call(api, "POST", "/v1/rules", {"id": "a", "action": "block", "address": "192.0.2.0/24", "expire": 5})
    add(api, "s1", token=OTHER)
    status, one = call(api, "GET", "/v1/rules/v6")
    assert status == 200 and one["connection"]["src"] == "fd00::1" and one["state"] == "active"
    assert call(api, "GET", "/v1/rules/s1")[0] == 404  # another requester's id
    status, listed = call(api, "GET", "/v1/rules")
    assert status == 200 and [r["id"] for r in listed["rules"]] == ["1", "v6", "a"]  # its own, as added
    status, listed = call(api, "GET", "/v1/rules", token=ADMIN)  # an admin's token: every client's
    assert status == 200 and [r["id"] for r in listed["rules"]] == ["1", "v6", "a", "s1"]
    assert [r["id"] for r in call(api, "GET", "/v1/rules?source=ids:scipass", token=ADMIN)[1]["rules"]] == ["s1"]
    assert [r["id"] for r in call(api, "GET", "/v1/rules?kind=block_address")[1]["rules"]] == ["a"]
    assert [r["id"] for r in call(api, "GET", "/v1/rules?address=fd00::2")[1]["rules"]] == ["v6"]
    status, body = call(api, "DELETE", "/v1/rules/1")
    assert status == 200 and body["result"] == "removed" and body["rule"]["packets"] == 3
    assert body["rule"]["bytes"] == 4500
    status, body = call(api, "DELETE", "/v1/rules/nope")
    assert (status, body["error"]) == (404, "not_found")


@pytest.mark.parametrize("raw,problem", [
    (b"{not json", "not valid JSON"),
    (b'{"id": "1", "id": "2"}', "appears twice"),
    (b"[" * 40 + b"]" * 40, "nested deeper"),
    (b"\xff\xfe", "not UTF-8"),
])
def test_malformed_json(served, raw, problem):
    api, backend, counted = served
    status, body = call(api, "POST", "/v1/rules", raw=raw, headers={"Content-Type": "application/json"})
    assert (status, body["error"]) == (400, "malformed") and problem in body["reason"]
    assert counted == [Reject.MALFORMED] and len(backend.store) == 0


@pytest.mark.parametrize("change,problem", [
    ({"colour": "red"}, "colour: unknown field"),
    ({"expire": "60"}, "expire: expected a number"),
    ({"connection": {**CONN, "dst": "fd00::2"}}, "connection.dst: fd00::2 is not IPv4"),
    ({"connection": {**CONN, "dport": 0}}, "connection.dport: 0 is outside 1-65535"),
    ({"connection": {**CONN, "sport": 65536}}, "connection.sport: 65536 is outside 1-65535"),
    ({"action": "block", "connection": None, "address": "10.0.0.0/8"}, "address: 10.0.0.0/8 is wider than /16"),
    ({"action": "block", "connection": None, "address": "fe80::%eth0/64"}, "address: 'fe80::%eth0/64' has an IPv6"),
    ({"connection": {**CONN, "src": "fd00::1%eth0", "dst": "fd00::2"}}, "connection.src: 'fd00::1%eth0' has an IPv6"),
])
def test_bad_fields_are_400_with_the_field(served, change, problem):
    api, backend, counted = served
    body = {"id": "1", "action": "shunt", "connection": dict(CONN), "expire": 60, **change}
    body = {k: v for k, v in body.items() if v is not None}
    status, answer = call(api, "POST", "/v1/rules", body)
    assert (status, answer["error"]) == (400, "invalid") and problem in answer["reason"]
    assert counted == [Reject.INVALID] and len(backend.store) == 0


def test_unauthenticated_and_bad_tokens(served, token_file):
    api, backend, counted = served
    assert add(api, token=None)[0] == 401
    status, body = add(api, token="zeek-token-0123456789abcdeX")
    assert status == 401 and "bearer token" in body["reason"]
    assert call(api, "GET", "/v1/rules", token=None)[0] == 401
    assert counted == [Reject.UNAUTHENTICATED] * 3 and len(backend.store) == 0
    # A rotated token: the old one has expired from the next request on.
    new = "zeek-rotated-token-0123456789"
    with open(token_file, "w") as fh:
        fh.write(f"zeek {new}\n")
    assert add(api)[0] == 401
    assert add(api, token=new)[0] == 202
    # A token file others may read authenticates nobody.
    os.chmod(token_file, 0o644)
    assert add(api, "2", token=new)[0] == 401


@pytest.mark.parametrize("content", [
    f"zeek {'z' * 20}\nscipass {'z' * 20}\n",  # one token, two clients: which would a request be?
    f"# {'x' * 65536}\nzeek {'z' * 20}\n",  # too large: cut, its last line could read as a shorter token
])
def test_a_token_file_that_cannot_name_one_client_a_token_authenticates_nobody(tmp_path, content, caplog):
    path = tmp_path / "tokens"
    path.write_text(content)
    os.chmod(path, 0o600)
    with caplog.at_level(logging.ERROR, logger="nfshunt"):
        assert tokens.read(str(path))[1] == []
    assert "every request is refused" in caplog.text
    path.write_text(f"zeek {'z' * 20}\nzeek {'y' * 20}\n")  # a client's two tokens (a rotation): both
    assert [t.client for t in tokens.read(str(path))[1]] == ["zeek", "zeek"]


def test_oversized_and_unframed_bodies(served):
    api, backend, counted = served
    with socket.create_connection(api.address, timeout=5) as s:
        s.sendall(b"POST /v1/rules HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() +
                  b"\r\nContent-Length: 100000000\r\n\r\n")
        answer = recv_all(s)
    assert b" 413 " in answer.split(b"\r\n")[0] and b"request too large" in answer
    assert b"Connection: close" in answer  # the body is not read
    status, body = call(api, "POST", "/v1/rules", raw=b"x" * 20000)
    assert status == 413 and "request too large" in body["reason"]
    with socket.create_connection(api.address, timeout=5) as s:
        s.sendall(b"POST /v1/rules HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() +
                  b"\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
        assert b" 411 " in recv_all(s).split(b"\r\n")[0]
    assert counted == [Reject.TOO_LARGE, Reject.TOO_LARGE, Reject.LENGTH_REQUIRED] and len(backend.store) == 0


def test_header_flood_is_cut_off(served):
    api, backend, counted = served
    with socket.create_connection(api.address, timeout=5) as s:
        s.sendall(b"GET /v1/rules HTTP/1.1\r\nHost: x\r\n")
        try:
            for i in range(100):
                s.sendall(b"X-Filler-%d: %s\r\n" % (i, b"y" * 4000))
        except OSError:
            pass  # cut off while sending: that is the point
        answer = recv_all(s)
    # The client may see the answer, or a reset (the server closed with the flood unread).
    assert answer == b"" or (b" 413 " in answer.split(b"\r\n")[0] and b"Connection: close" in answer)
    assert counted == [Reject.TOO_LARGE]
    assert call(api, "GET", "/v1/rules")[0] == 200


def _padded_post(head_bytes, rule_id):
    """An add whose line and headers are `head_bytes` long (padded by a header), its body
    (valid, under max_body_bytes) 16,000 bytes; the connection closed after it."""
    body = json.dumps({"id": rule_id, "action": "shunt", "expire": 60,
                       "connection": {**CONN, "sport": 40000 + int(rule_id)}}).encode()
    body += b" " * (16000 - len(body))
    head = (f"POST /v1/rules HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\nX-Pad: ").encode()
    head += b"a" * (head_bytes - len(head) - 4) + b"\r\n\r\n"
    assert len(head) == head_bytes
    return head + body


def test_a_head_over_its_limit_is_refused_whatever_its_body(served):
    """Review s56, 6: a head over HEAD_BYTES with a valid body was cut off unanswered and
    uncounted (the body ran into the request's budget), or served when a little over. The
    head is measured once parsed: over the limit, 413 too_large and closed; at it, served,
    pipelined behind another request too (its bytes read with that one's counted)."""
    api, backend, counted = served
    get = f"GET /v1/rules HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
    for requests, statuses in [([_padded_post(HEAD_BYTES + 1, "1")], [b"413"]),
                               ([_padded_post(20000, "2")], [b"413"]),
                               ([get, _padded_post(HEAD_BYTES + 1, "3")], [b"200", b"413"]),
                               ([get, _padded_post(HEAD_BYTES, "4")], [b"200", b"202"])]:
        with socket.create_connection(api.address, timeout=5) as s:
            s.sendall(b"".join(requests))
            answer = recv_all(s)
        assert re.findall(rb"^HTTP/1.1 ([0-9]{3}) ", answer, re.M) == statuses, answer[:300]
        if statuses[-1] == b"413":
            assert b"Connection: close" in answer and b"line and headers are over" in answer
    assert counted == [Reject.TOO_LARGE] * 3
    assert [r.id for r in backend.store.rules.values()] == ["4"]


def recv_all(s):
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        return b""
    return out


def test_keep_alive_answers_do_not_wait_for_a_delayed_ack(served):
    """An answer went out as two writes (headers, body), and with Nagle's algorithm on the
    body waited for the client's delayed ACK of the headers: 40 ms an answer. Now it is
    one write, flushed after each request (one over the buffer is still two)."""
    api, _, _ = served
    conn = http.client.HTTPConnection(*api.address, timeout=5)
    try:
        took = []
        for _ in range(20):
            t0 = time.monotonic()
            conn.request("GET", "/v1/rules", headers={"Authorization": f"Bearer {TOKEN}"})
            resp = conn.getresponse()
            assert resp.status == 200 and json.loads(resp.read()) == {"rules": []}
            took.append(time.monotonic() - t0)
    finally:
        conn.close()
    assert sorted(took)[10] < 0.02, took


def test_a_client_expecting_100_continue_gets_it_before_it_sends_the_body(served):
    """curl (Zeek's ActiveHTTP) may send Expect: 100-continue and wait for the interim
    answer: it must not sit in the answer's buffer. The connection is kept for the next."""
    api, backend, _ = served
    body = json.dumps({"id": "1", "action": "shunt", "connection": dict(CONN), "expire": 60}).encode()
    head = (b"POST /v1/rules HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() +
            b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\nExpect: 100-continue\r\n\r\n" % len(body))
    with socket.create_connection(api.address, timeout=5) as s:
        s.sendall(head)
        assert s.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        reader = s.makefile("rb")
        for rule_id in (b"1", b"2"):
            status = reader.readline()
            headers = {}
            while (line := reader.readline()) != b"\r\n":
                name, _, value = line.decode().partition(":")
                headers[name.lower()] = value.strip()
            answer = json.loads(reader.read(int(headers["content-length"])))
            assert status.split()[1] == b"202" and answer["id"] == rule_id.decode()
            if rule_id == b"1":  # the same connection, no Expect this time
                nxt = body.replace(b'"id": "1"', b'"id": "2"')
                s.sendall(head.replace(b"Expect: 100-continue\r\n", b"") + nxt)
    assert len(backend.store) == 2


def test_rate_limit_per_client(token_file):
    api, _, counted = make_api(token_file, rate_limit=5)
    try:
        statuses = [call(api, "GET", "/v1/rules")[0] for _ in range(8)]
        assert statuses[:5] == [200] * 5 and 429 in statuses[5:]
        assert Reject.RATE_LIMITED in counted
    finally:
        api.stop()


def test_slow_client_holds_nothing_up(token_file):
    """A client sending one byte a second is cut off at the request deadline; others are
    answered meanwhile as fast as ever."""
    api, _, counted = make_api(token_file, request_seconds=2.0)
    try:
        slow = socket.create_connection(api.address, timeout=10)
        request = b"POST /v1/rules HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{}"
        cut = threading.Event()

        def trickle():
            try:
                for byte in request:
                    slow.sendall(bytes([byte]))
                    time.sleep(1)
            except OSError:
                pass
            cut.set()
        sender = threading.Thread(target=trickle, daemon=True)
        started = time.monotonic()
        sender.start()
        for _ in range(5):
            t0 = time.monotonic()
            assert call(api, "GET", "/v1/rules")[0] == 200
            assert time.monotonic() - t0 < 1.0  # the slow client takes 2 s, and it is not waited for
        slow.settimeout(5)
        assert slow.recv(100) == b""  # the server closed it...
        assert time.monotonic() - started < 4  # ...at the deadline, long before the request was sent
        assert Reject.TIMEOUT in counted
        slow.close()
        cut.wait(5)
    finally:
        api.stop()


def test_connection_cap(token_file):
    api, _, counted = make_api(token_file, max_connections=2)
    try:
        idle = [socket.create_connection(api.address, timeout=5) for _ in range(2)]
        time.sleep(0.2)
        with socket.create_connection(api.address, timeout=5) as third:
            assert third.recv(100) == b""  # closed at once
        assert Reject.BUSY in counted
        for s in idle:
            s.close()
        time.sleep(0.3)
        assert call(api, "GET", "/v1/rules")[0] == 200
    finally:
        api.stop()


def test_methods_paths_queries(served):
    api, backend, counted = served
    assert call(api, "PUT", "/v1/rules", {})[0] == 405
    assert call(api, "GET", "/v2/rules")[0] == 404
    assert call(api, "PATCH", "/v1/rules")[0] == 501
    status, body = call(api, "GET", "/v1/rules?colour=red")
    assert status == 400 and "unknown filter" in body["reason"]
    assert call(api, "GET", "/v1/rules?kind=x")[0] == 400
    assert call(api, "GET", "/v1/rules?kind=shunt&kind=block")[0] == 400
    assert call(api, "GET", "/v1/rules/a%2Fb")[0] == 400
    assert counted == [Reject.METHOD, Reject.NOT_FOUND, Reject.METHOD] + [Reject.INVALID] * 4
    backend.fail = RuntimeError("a bug")
    status, body = add(api)
    assert status == 500 and body["error"] == "internal"
    backend.fail = TimeoutError()  # the controller's, not the client's: answered all the same
    status, body = add(api)
    assert status == 504 and body["error"] == "unanswered" and "expires" in body["reason"]


def test_scipass_aliases(served):
    api, backend, counted = served
    good = {"nw_src": "10.0.0.1/32", "nw_dst": "10.0.0.2/32", "tp_src": "1470", "tp_dst": "25",
            "idle_timeout": "90", "priority": "10"}
    status, body = call(api, "PUT", "/scipass/flows/good_flow", good, token=OTHER)
    assert status == 200 and body["success"] == 1
    bad = {**good, "nw_src": "10.0.0.3/32"}
    assert call(api, "PUT", "/scipass/flows/bad_flow", bad, token=OTHER)[1]["success"] == 1
    status, flows = call(api, "GET", "/scipass/flows/get_good_flows", token=OTHER)
    assert status == 200 and [(f["nw_src"], f["tp_dst"]) for f in flows] == [("10.0.0.1/32", "25")]
    assert [f["nw_src"] for f in call(api, "GET", "/scipass/flows/get_bad_flows", token=OTHER)[1]] == ["10.0.0.3/32"]
    v6 = {"nw_src": "fd00::1/128", "nw_dst": "fd00::2/128", "tp_src": "1470", "tp_dst": "25"}
    assert call(api, "PUT", "/scipass/flows/bad_flow", v6, token=OTHER)[1]["success"] == 1
    status, body = call(api, "DELETE", "/scipass/flows/good_flow", good, token=OTHER)
    assert status == 200 and body["success"] == 1 and body["result"] == "removed"
    status, body = call(api, "PUT", "/scipass/flows/good_flow", {**good, "tp_dst": "0"}, token=OTHER)
    assert status == 400 and body["success"] == 0 and "tp_dst" in body["error"]
    outside = {**good, "nw_src": "192.0.2.1/32", "nw_dst": "192.0.2.2/32"}
    status, body = call(api, "PUT", "/scipass/flows/good_flow", outside, token=OTHER)
    assert status == 403 and body["success"] == 0 and "may_shunt" in body["error"]
    assert call(api, "GET", "/scipass/flows/good_flow", token=OTHER)[0] == 405


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_client_certificates(tmp_path):
    d = str(tmp_path)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=test-ca", cwd=d)
    for name in ("server", "zeek"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}", cwd=d)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "1", cwd=d)
    cfg = IdsConfig(listen_port=0, tls=IdsTLS(f"{d}/server.pem", f"{d}/server.key", f"{d}/ca.pem"),
                    may_shunt=MayShunt(prefixes=(ipaddress.ip_network("10.0.0.0/24"),)))
    counted = []
    api = IdsApi(cfg, FakeBackend(cfg), count=counted.append)
    api.start()
    try:
        ctx = ssl.create_default_context(cafile=f"{d}/ca.pem")
        ctx.check_hostname = False
        ctx.load_cert_chain(f"{d}/zeek.pem", f"{d}/zeek.key")
        conn = http.client.HTTPSConnection(*api.address, context=ctx, timeout=5)
        conn.request("POST", "/v1/rules", json.dumps({"id": "1", "action": "block", "address": "192.0.2.0/24",
                                                      "expire": 5}))
        resp = conn.getresponse()
        assert resp.status == 201
        resp.read()
        conn.request("GET", "/v1/rules")
        assert json.loads(conn.getresponse().read())["rules"][0]["source"] == "ids:zeek"
        conn.close()
        bare = ssl.create_default_context(cafile=f"{d}/ca.pem")
        bare.check_hostname = False
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException, OSError)):
            conn = http.client.HTTPSConnection(*api.address, context=bare, timeout=5)
            conn.request("GET", "/v1/rules")
            conn.getresponse().read()
        time.sleep(0.2)
        assert Reject.TLS in counted
    finally:
        api.stop()


def test_a_client_lists_its_own_rules_in_pages_and_an_admin_every_clients(served):
    """Issue 36, 10: a page at a time (?limit=, ?after= the answer's `next`), a client's own
    rules unless its token is marked admin; asking for another's is refused (403)."""
    api, _, counted = served
    for i in range(7):
        add(api, f"z{i}", connection={**CONN, "sport": 41000 + i})
        add(api, f"s{i}", token=OTHER, connection={**CONN, "sport": 42000 + i})
    status, first = call(api, "GET", "/v1/rules?limit=3")
    assert status == 200 and [r["id"] for r in first["rules"]] == ["z0", "z1", "z2"] and first["next"]
    _, second = call(api, "GET", f"/v1/rules?limit=3&after={first['next']}")
    _, third = call(api, "GET", f"/v1/rules?limit=3&after={second['next']}")
    assert [r["id"] for r in second["rules"] + third["rules"]] == ["z3", "z4", "z5", "z6"] and "next" not in third
    status, body = call(api, "GET", "/v1/rules?source=ids:scipass")
    assert (status, body["error"]) == (403, "forbidden") and Reject.FORBIDDEN in counted
    assert [r["id"] for r in call(api, "GET", "/v1/rules?source=ids:zeek")[1]["rules"]][:1] == ["z0"]
    _, everyone = call(api, "GET", "/v1/rules?limit=1000", token=ADMIN)
    assert len(everyone["rules"]) == 14 and "next" not in everyone
    for bad in ("limit=0", "limit=1001", "after=-1", "after=x", "limit=2&limit=3"):
        assert call(api, "GET", f"/v1/rules?{bad}")[0] == 400, bad
    # SciPass's lists: its own flows, a page of them; the rest's ?after= in a header
    conn = http.client.HTTPConnection(*api.address, timeout=5)
    try:
        conn.request("GET", "/scipass/flows/get_good_flows?limit=5", headers={"Authorization": f"Bearer {OTHER}"})
        resp = conn.getresponse()
        listed = json.loads(resp.read())
        assert resp.status == 200 and [f["id"] for f in listed] == [f"s{i}" for i in range(5)]
        assert resp.getheader("X-Next-After")
    finally:
        conn.close()


@pytest.fixture
def relayed(token_file):
    """The API as its own process serves it, here: each call a frame (RemoteBackend) to the
    controller's end (BackendServer, whose frames.request_of checks it) and on to the fake
    backend; `forged`, what the controller took for a forged frame (which ends the process)."""
    cfg = ids_config(token_file)
    ours, theirs = socket.socketpair()
    forged = []
    server = BackendServer(Channel(ours, MAX_REQUEST), cfg, FakeBackend(cfg), lambda why: None, lambda *a: None,
                           forged.append, workers=2)
    remote = RemoteBackend(Channel(theirs, MAX_ANSWER), cfg.answer_timeout)
    threads = [threading.Thread(target=server.serve, args=(lambda error: None,)),
               threading.Thread(target=remote.answers)]
    for t in threads:
        t.start()
    api = IdsApi(cfg, remote)
    api.start()
    yield api, forged
    api.stop()
    server.channel.close()
    remote.channel.close()
    for t in threads:
        t.join(5)


# A listing's query values at and just past each bound, and the status each is answered.
LISTING_EDGES = [
    ("after=0", 200), (f"after={(1 << 62) - 1}", 200), (f"after={1 << 62}", 400), ("after=-1", 400),
    ("after=" + "9" * 20, 400), ("limit=1", 200), ("limit=1000", 200), ("limit=0", 400), ("limit=1001", 400),
    ("source=ids:zeek", 200), ("source=ids:" + "a" * 64, 200), ("source=ids:" + "a" * 65, 400),
    ("source=zeek", 400), ("source=ids:", 400), ("source=ids:a%2Fb", 400),
    ("kind=block_address", 200), ("kind=Shunt", 400), ("address=10.0.0.0/8", 200), ("address=fd00::2", 200),
    ("address=10.0.0.0/32", 200), ("address=10.0.0.0/33", 400), ("address=x", 400),
    ("address=fe80::%25eth0/64", 400), ("address=fe80::1%251", 400),  # an IPv6 scope id (%25: '%')
]


def test_whatever_a_listing_query_the_api_takes_the_controller_takes(relayed):
    """Review s56, 1: the API took ?after=2^62 and an admin's ?source=zeek, which the
    controller's frame check refuses: it took the relayed listing for a forged frame and
    started the API's process again (every client cut off), as often as anyone asked. The
    API now checks a query with the controller's own code: a 400 naming the value, or served."""
    api, forged = relayed
    for query, expected in LISTING_EDGES:
        name = query.split("=")[0]
        status, body = call(api, "GET", f"/v1/rules?{query}", token=ADMIN)
        assert status == expected and not forged, (query, status, body, forged)
        if status == 400:
            assert body["error"] == "invalid" and body["reason"].startswith(f"query: {name}"), (query, body)
        if name in ("after", "limit"):
            status, body = call(api, "GET", f"/scipass/flows/get_bad_flows?{query}", token=OTHER)
            assert status == expected and not forged, (query, status, body, forged)


def test_a_bug_is_answered_and_counted_each_time_and_its_traceback_logged_rate_limited(served, caplog, monkeypatch):
    """Review s56, 4: each request a bug failed logged its whole traceback, unthrottled: one
    client could write thousands a second into the controller's log. Each is still answered
    500 and counted; its traceback is logged at most once every 10 s, the next one saying
    how many were held back."""
    api, backend, counted = served
    clock = [1000.0]
    monkeypatch.setattr(logs, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    backend.fail = RuntimeError("a bug")
    with caplog.at_level(logging.ERROR, logger="nfshunt"):
        assert [add(api)[0] for _ in range(5)] == [500] * 5
        clock[0] += 10
        assert add(api)[0] == 500
    logged = [r for r in caplog.records if "POST /v1/rules failed" in r.getMessage()]
    assert counted == [Reject.INTERNAL] * 6
    assert len(logged) == 2 and all(r.exc_info for r in logged), logged
    assert "(4 more like this since the last report)" in logged[1].getMessage()
