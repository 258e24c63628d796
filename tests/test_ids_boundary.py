"""The IDS path's bounds on the real testbed, behind a strict firewall (INVALID dropped, no
loose pickup), tried as an attacker or an unlucky IDS would (issue 36):
  - a connection that closes between an IDS's request and the controller's turn is never
    shunted on what it was (the entry is read on the event loop, in the turn that pins);
  - the scope is the connection's server: a connection opened from the server's port the
    other way round is refused, named either way.
The requests go to the controller's IDS API on the firewall node's loopback (curl)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile

import pytest

from tests.beds import Bed, Strict, running

pytestmark = [pytest.mark.integration, pytest.mark.testbed, pytest.mark.third_bed]

IGNORE = 5203  # the example policy leaves 5203 to the firewall (accepted, not decided "shunt")
API_PORT = 9754
TOKEN = "ids-boundary-token-0123456789abcdef"
SHUNT_KIND = 2  # cookie kind of a shunt's flows
DECIDED = 0x10000000  # the mark's "policy decided" flag
TIME_WAIT = 7


@pytest.fixture(scope="module")
def tb(integration_ready):
    folder = tempfile.mkdtemp(prefix="nfshunt-ids-boundary-")
    tokens = os.path.join(folder, "tokens")
    with open(os.open(tokens, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:
        fh.write(f"zeek {TOKEN}\n")
    from nfshunt_testbed.bed import H2_IP
    ids = {"listen_port": API_PORT, "token_file": tokens, "answer_timeout": 3.0,
           "may_shunt": {"prefixes": [f"{H2_IP}/32"], "ports": [IGNORE]}}
    try:
        with running(Bed(config={"default_shunt_timeout": 30, "ids": ids}, strict=Strict.FULL)) as bed:
            yield bed
    finally:
        os.unlink(tokens)
        os.rmdir(folder)


@pytest.fixture
def fresh(tb):
    yield tb
    if tb.controller is not None and tb.controller.poll() is None:
        os.kill(tb.controller.pid, signal.SIGCONT)  # (a test that failed while it was stopped)
    for rule in api(tb, "GET", "/v1/rules")[1]["rules"]:
        api(tb, "DELETE", f"/v1/rules/{rule['id']}")


def _curl(method, path, body=None):
    args = ["curl", "-sS", "-m", "15", "-X", method, "-H", f"Authorization: Bearer {TOKEN}",
            "-w", "\n%{http_code}", f"http://127.0.0.1:{API_PORT}{path}"]
    if body is not None:
        args += ["-H", "Content-Type: application/json", "--data-binary", json.dumps(body)]
    return args


def _answer(out):
    text, _, status = out.rstrip("\n").rpartition("\n")
    return int(status), json.loads(text)


def api(tb, method, path, body=None):
    """One request to the IDS API from the firewall node: (status, JSON)."""
    return _answer(tb.run(tb.fw, *_curl(method, path, body), timeout=20))


def connection(src, sport, dst, dport):
    return {"protocol": "tcp", "src": src, "sport": sport, "dst": dst, "dport": dport}


def shunt_flows(tb, cport):
    return [f for f in tb.conn_flows(IGNORE) if int(f["cookie"], 16) >> 48 & 0xFF == SHUNT_KIND
            and str(cport) in (f.get("tp_src"), f.get("tp_dst"), f.get("tcp_src"), f.get("tcp_dst"))]


def entries(tb, cport):
    return [e for e in tb.conntrack() if cport in (e["sport"], e["dport"]) and IGNORE in (e["sport"], e["dport"])]


def _request_read(tb):
    """The API's process has read the request waiting on its socket (nothing unread on the
    server's end of a connection to the API's port)."""
    out = tb.run(tb.fw, "ss", "-Htn", "state", "established", "(", "sport", "=", f":{API_PORT}", ")")
    rows = [line.split() for line in out.splitlines() if line.strip()]
    return bool(rows) and all(r[0] == "0" for r in rows)


@pytest.mark.parametrize("how", ["destroyed", "time_wait"])
def test_a_connection_that_closes_while_its_shunt_request_waits_is_never_shunted(fresh, how):
    """Issue 36, 5: the controller's event loop is held (stopped) while the API's process
    takes the request; the connection then closes (its entry deleted, or a clean close to
    TIME_WAIT) and the loop goes on. The rule is judged on the kernel's entry as the loop
    finds it: no pair for a dead or closing entry (on main: a shunt of the dead entry, its
    tuple going fast port to fast port past the firewall), answered pending at once."""
    tb = fresh
    from nfshunt_testbed.bed import H1_IP, H2_IP
    cport = 47611 if how == "destroyed" else 47612
    srv = tb.conn_server(IGNORE)
    clients, _ = tb.open_conns(IGNORE, 1, cport_base=cport)
    try:
        tb.wait_for(lambda: any(e["mark"] & DECIDED for e in entries(tb, cport)), 5, "the policy's decision")
        os.kill(tb.controller.pid, signal.SIGSTOP)
        try:
            req = tb.spawn(tb.fw, *_curl("POST", "/v1/rules", {
                "id": how, "action": "shunt", "expire": 60, "connection": connection(H1_IP, cport, H2_IP, IGNORE)}),
                stdout=subprocess.PIPE)
            tb.wait_for(lambda: _request_read(tb), 5, "the API's process to read the request")
            tb.run(tb.fw, "sleep", "0.3")  # (on main its lookup follows the read at once)
            if how == "destroyed":
                tb.run(tb.fw, "conntrack", "-D", "-p", "tcp", "--orig-port-src", str(cport))
                tb.wait_for(lambda: not entries(tb, cport), 5, "the entry gone")
            else:
                clients.stdin.write("close\n")
                clients.stdin.flush()
                tb.wait_for(lambda: [e["state"] for e in entries(tb, cport)] == [TIME_WAIT], 5, "TIME_WAIT")
        finally:
            os.kill(tb.controller.pid, signal.SIGCONT)
        out, _ = req.communicate(timeout=20)
        status, body = _answer(out)
        assert (status, body["result"]) == (202, "added") and body["pending"], body
        assert shunt_flows(tb, cport) == []
        rule = api(tb, "GET", f"/v1/rules/{how}")[1]
        assert rule["state"] == "pending", rule
    finally:
        clients.kill()
        clients.communicate()
        srv.kill()
        srv.communicate()


def test_a_connection_from_the_servers_port_the_other_way_round_is_outside_named_either_way(fresh):
    """Issue 36, 3: may_shunt is h2 on port 5203. h2 opens a connection from its port 5203 to
    h1 (h1 the server, on a port of its own): outside, whichever way the rule names it; the
    connection to h2:5203 itself is inside, named from the server's side."""
    tb = fresh
    from nfshunt_testbed.bed import H1_IP, H2_IP
    srv = tb.conn_server(47621, node=tb.h1)
    clients, _ = tb.open_conns(47621, 1, cport_base=IGNORE, dst=H1_IP, src=tb.h2)  # h2:5203 -> h1:47621
    srv2 = tb.conn_server(IGNORE)
    clients2, _ = tb.open_conns(IGNORE, 1, cport_base=47622)  # h1:47622 -> h2:5203
    try:
        tb.wait_for(lambda: any(e["mark"] & DECIDED for e in tb.conntrack() if e["dport"] == 47621), 5,
                    "the policy's decision")
        for i, named in enumerate((connection(H2_IP, IGNORE, H1_IP, 47621), connection(H1_IP, 47621, H2_IP, IGNORE))):
            status, body = api(tb, "POST", "/v1/rules", {"id": f"r{i}", "action": "shunt", "expire": 60,
                                                         "connection": named})
            assert status == 403 and body["refusal"] == "outside_may_shunt", body
            assert f"{H1_IP}:47621" in body["reason"], body
        tb.wait_for(lambda: any(e["mark"] & DECIDED for e in entries(tb, 47622)), 5, "the policy's decision")
        status, body = api(tb, "POST", "/v1/rules", {"id": "in", "action": "shunt", "expire": 60,
                                                     "connection": connection(H2_IP, IGNORE, H1_IP, 47622)})
        assert (status, body["result"]) == (201, "added"), body
        assert len(shunt_flows(tb, 47622)) == 2
        assert body.get("rule") is None and api(tb, "GET", "/v1/rules/in")[1]["server"] == {"address": H2_IP,
                                                                                              "port": IGNORE}
    finally:
        for p in (clients, srv, clients2, srv2):
            p.kill()
            p.communicate()
