"""An IDS decides too (issue 28), on the real testbed: requests to the controller's IDS API
(on the firewall node's loopback, with a bearer token) shunt a connection the policy
ignores inside ids.may_shunt and are refused outside it, block a policy-shunted transfer,
block a host's address in the switch until the rule expires, come back after a restart
of the controller, and SciPass's alias works with SciPass's own body."""
from __future__ import annotations

import json
import os
import tempfile

import pytest

from tests.beds import Bed, running
from tests.test_failsafe import finish_iperf

pytestmark = [pytest.mark.integration, pytest.mark.testbed, pytest.mark.third_bed]

SHUNT, IGNORE, OUTSIDE = 5201, 5203, 5205  # the example policy: 5201 shunted, 5203 and 5205 ignored
API_PORT = 9754
TOKEN = "ids-testbed-token-0123456789abcdef"
ADDRESS_BLOCK = 7  # cookie kind of an address block's flows


@pytest.fixture(scope="module")
def tb(integration_ready):
    folder = tempfile.mkdtemp(prefix="nfshunt-ids-")
    tokens = os.path.join(folder, "tokens")
    with open(os.open(tokens, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:
        fh.write(f"zeek {TOKEN}\n")
    ids = {"listen_port": API_PORT, "token_file": tokens, "answer_timeout": 3.0,
           "may_shunt": {"prefixes": ["10.0.0.2/32"], "ports": [IGNORE]}}
    try:
        with running(Bed(config={"default_shunt_timeout": 30, "ids": ids})) as bed:
            yield bed
    finally:
        os.unlink(tokens)
        os.rmdir(folder)


@pytest.fixture
def fresh(tb):
    yield tb
    if tb.controller is None or tb.controller.poll() is not None:
        tb.restart_controller()
        tb.wait_for_controller()
    for rule in api(tb, "GET", "/v1/rules")[1]["rules"]:  # every rule of the test goes
        api(tb, "DELETE", f"/v1/rules/{rule['id']}")
    tb.wait_for(lambda: not _address_flows(tb) and not tb.conn_flows(SHUNT) and not tb.conn_flows(IGNORE), 20,
                "the test's flows to go")


def api(tb, method, path, body=None):
    """One request to the IDS API from the firewall node (it listens on its loopback): (status, JSON)."""
    args = ["curl", "-sS", "-m", "15", "-X", method, "-H", f"Authorization: Bearer {TOKEN}",
            "-w", "\n%{http_code}", f"http://127.0.0.1:{API_PORT}{path}"]
    if body is not None:
        args += ["-H", "Content-Type: application/json", "--data-binary", json.dumps(body)]
    out = tb.run(tb.fw, *args, timeout=20).rstrip("\n")
    text, _, status = out.rpartition("\n")
    return int(status), json.loads(text)


def connection(cport, dport):
    from nfshunt_testbed.bed import H1_IP, H2_IP
    return {"protocol": "tcp", "src": H1_IP, "sport": cport, "dst": H2_IP, "dport": dport}


def _flows_of(tb, kind, port, cport):
    return [f for f in tb.conn_flows(port) if int(f["cookie"], 16) >> 48 & 0xFF == kind
            and str(cport) in (f.get("tp_src"), f.get("tp_dst"), f.get("tcp_src"), f.get("tcp_dst"))]


def _address_flows(tb):
    return [f for f in tb.flows() if int(f.get("cookie", "0"), 16) >> 48 == 0x4E00 | ADDRESS_BLOCK]


def _reaches(tb, src, dst_ip):
    return " 0% packet loss" in tb.run(src, "ping", "-c", "1", "-W", "1", dst_ip, check=False)


def _held(tb, port, cport, n=1):
    """n idle connections h1:cport... -> h2:port, held open (conngen); (server, clients)."""
    srv = tb.conn_server(port)
    clients, _ = tb.open_conns(port, n, cport_base=cport)
    return srv, clients


def _close(*procs):
    for p in procs:
        p.kill()
        p.communicate()


def test_a_connection_the_policy_ignores_is_shunted_inside_may_shunt_and_refused_outside(fresh):
    tb = fresh
    srv, clients = _held(tb, IGNORE, 47001)
    srv2, clients2 = _held(tb, OUTSIDE, 47002)
    try:
        assert _flows_of(tb, 2, IGNORE, 47001) == []  # the policy leaves it to the firewall
        status, body = api(tb, "POST", "/v1/rules", {"id": "a1", "action": "shunt", "expire": 60,
                                                     "connection": connection(47001, IGNORE)})
        assert (status, body["result"]) == (201, "added"), body
        assert len(_flows_of(tb, 2, IGNORE, 47001)) == 2  # confirmed by the switch before the answer
        status, body = api(tb, "POST", "/v1/rules", {"id": "a2", "action": "shunt", "expire": 60,
                                                     "connection": connection(47002, OUTSIDE)})
        assert status == 403 and body["refusal"] == "outside_may_shunt", body
        assert _flows_of(tb, 2, OUTSIDE, 47002) == []
        status, listed = api(tb, "GET", "/v1/rules")
        assert [r["id"] for r in listed["rules"]] == ["a1"]
        status = tb.control({"cmd": "status", "connections": False})
        assert status["rules_by_source"]["ids:zeek"] == 1
        assert status["counters"].get("ids_refused:refused:outside_may_shunt") == 1
    finally:
        _close(clients, srv, clients2, srv2)


def test_a_policy_shunted_transfer_is_blocked_by_an_ids_request(fresh):
    tb = fresh
    from nfshunt_testbed.bed import STEADY_RATE
    # 4 s: the block is in place about 1 s in; the test waits for the transfer's end.
    srv, cli = tb.start_transfer(SHUNT, 4, cport=47101, bitrate=STEADY_RATE)
    try:
        tb.wait_for(lambda: len(_flows_of(tb, 2, SHUNT, 47101)) == 2, 10, "the policy's shunt")
        status, body = api(tb, "POST", "/v1/rules", {"id": "b1", "action": "block", "expire": 60,
                                                     "connection": connection(47101, SHUNT)})
        assert status in (201, 202) and body["result"] == "added", body
        tb.wait_for(lambda: len(_flows_of(tb, 3, SHUNT, 47101)) == 2 and not _flows_of(tb, 2, SHUNT, 47101), 5,
                    "the IDS's block in place of the shunt")
        got = tb.wait_for(lambda: (r := api(tb, "GET", "/v1/rules/b1")[1])["state"] == "active" and r, 5,
                          "the rule shown active")
        assert got["source"] == "ids:zeek"
    finally:
        finish_iperf(srv, cli, timeout=20)


def test_an_address_block_drops_a_hosts_traffic_in_the_switch_and_expires_on_time(fresh):
    tb = fresh
    from nfshunt_testbed.bed import H2_IP
    assert _reaches(tb, tb.h1, H2_IP)
    status, body = api(tb, "POST", "/v1/rules", {"id": "c1", "action": "block", "address": "10.0.0.1/32",
                                                 "expire": 3})
    assert (status, body["result"]) == (201, "added"), body
    assert len(_address_flows(tb)) == 2
    # Added means the switch answered the barrier behind the flows; Open vSwitch's userspace
    # datapath may still forward one packet more by the cached path the first ping made (CI-37:
    # the ping right after the answer passed). Blocked within 3 s, well inside the rule's life.
    tb.wait_for(lambda: not _reaches(tb, tb.h1, H2_IP), 3, "h1's traffic to be dropped by the address block")
    status, active = api(tb, "GET", "/v1/rules/c1")
    assert active["state"] == "active" and active["packets"] >= 1, active  # read from the switch's counters
    tb.wait_for(lambda: _reaches(tb, tb.h1, H2_IP), 8, "h1's traffic to pass again after the expiry", interval=0.2)
    tb.wait_for(lambda: not _address_flows(tb), 3, "the address block's flows to go")
    ended = tb.wait_for(lambda: (r := api(tb, "GET", "/v1/rules/c1")[1]).get("state") == "expired" and r, 8,
                        "the rule reported expired")
    assert ended["packets"] >= 1, ended


def test_rules_come_back_after_a_controller_restart(fresh):
    tb = fresh
    status, _ = api(tb, "POST", "/v1/rules", {"id": "d1", "action": "block", "address": "10.0.0.3/32",
                                              "expire": 120})
    assert status == 201
    status, body = api(tb, "POST", "/v1/rules", {"id": "d2", "action": "shunt", "expire": 120,
                                                 "connection": connection(47301, IGNORE)})
    assert status == 202 and body["result"] == "added", body  # no such connection yet: pending
    tb.restart_controller()
    tb.wait_for_controller()
    tb.wait_for(lambda: len(_address_flows(tb)) == 2, 10, "the address block back on the switch")
    ids = tb.wait_for(lambda: sorted(r["id"] for r in api(tb, "GET", "/v1/rules")[1]["rules"]), 10, "the rules")
    assert ids == ["d1", "d2"]
    from nfshunt_testbed.bed import H2_IP
    tb.wait_for(lambda: _reaches(tb, tb.h1, H2_IP), 10, "h1 to reach h2 through the switch again")
    srv, clients = _held(tb, IGNORE, 47301)  # the connection comes: the kept rule shunts it
    try:
        tb.wait_for(lambda: len(_flows_of(tb, 2, IGNORE, 47301)) == 2, 10, "the pending shunt applied")
    finally:
        _close(clients, srv)


def test_scipass_good_flow_shunts_with_scipass_own_body(fresh):
    tb = fresh
    from nfshunt_testbed.bed import H1_IP, H2_IP
    srv, clients = _held(tb, IGNORE, 47401)
    try:
        body = {"nw_src": f"{H1_IP}/32", "nw_dst": f"{H2_IP}/32", "tp_src": "47401", "tp_dst": str(IGNORE)}
        status, answer = api(tb, "PUT", "/scipass/flows/good_flow", body)
        assert status == 200 and answer["success"] == 1, answer
        assert len(_flows_of(tb, 2, IGNORE, 47401)) == 2
        status, listed = api(tb, "GET", "/scipass/flows/get_good_flows")
        assert [(f["tp_src"], f["tp_dst"]) for f in listed] == [("47401", str(IGNORE))]
        status, answer = api(tb, "DELETE", "/scipass/flows/good_flow", body)
        assert status == 200, answer
        tb.wait_for(lambda: not _flows_of(tb, 2, IGNORE, 47401), 10, "the shunt handed back")
    finally:
        _close(clients, srv)


def test_a_policy_change_judges_an_ids_shunt_again(fresh, tmp_path):
    """An IDS's shunt of a connection the new policy blocks becomes the policy's block
    (a block beats a shunt), judged again as the policy's own shunts are."""
    tb = fresh
    from nfshunt_testbed.bed import POLICY, PYTHON, STEADY_RATE
    blocking = tmp_path / "blocks-5203.rules"
    blocking.write_text(open(POLICY).read().replace("port 5202 ", f"port {IGNORE} "))

    def apply(policy, *extra):  # (its exit status says whether every entry's decision was cleared: the
        # entries of a transfer in flux may not be; the flows below are what this test is about)
        return tb.run(tb.fw, PYTHON, "-m", "nfshunt", "iptables", "apply", "--config", tb.config_path,
                      "--policy", policy, *extra, check=False)
    # 5 s: the new policy's block is in place 2-3 s in (the CLI's start included); the test
    # waits for the transfer's end.
    srv, cli = tb.start_transfer(IGNORE, 5, cport=47501, bitrate=STEADY_RATE)
    try:
        status, body = api(tb, "POST", "/v1/rules", {"id": "f1", "action": "shunt", "expire": 60,
                                                     "connection": connection(47501, IGNORE)})
        assert status in (201, 202) and body["result"] == "added", body  # (202: its data connection not up yet)
        tb.wait_for(lambda: len(_flows_of(tb, 2, IGNORE, 47501)) == 2, 5, "the IDS's shunt of the transfer")
        assert "existing connections sent back through the new policy" in apply(str(blocking))
        tb.wait_for(lambda: len(_flows_of(tb, 3, IGNORE, 47501)) == 2 and not _flows_of(tb, 2, IGNORE, 47501), 5,
                    "the new policy's block in place of the IDS's shunt")
    finally:
        apply(POLICY, "--no-reevaluate")
        finish_iperf(srv, cli, timeout=20)
        # The new policy's blocks outlive the rule and the transfer: the killed client's
        # retransmissions, dropped by them, would keep them from idling out for 15 s.
        tb.control({"cmd": "flush", "reason": "the test's blocks go"})
