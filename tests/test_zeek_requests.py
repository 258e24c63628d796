"""The API held to the exact requests zeek/nfshunt.zeek sends, one test per NetControl rule
kind. Zeek cannot run here (not in Debian 12, not on PyPI): the body templates are read
out of the script (the fmt() after each `# nfshunt-body:` mark) and filled in with the
values Zeek would give them (Zeek's fmt and Python's % share %s, %d and %.3f); the
headers and paths are the script's too."""
import os
import re

import pytest

from tests.idsfake import OTHER, TOKEN, call, make_api, write_tokens

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "zeek", "nfshunt.zeek")


def script():
    with open(SCRIPT, encoding="utf-8") as fh:
        return fh.read()


def template(name):
    """The body format string the script builds for one kind of rule, as Zeek sees it."""
    m = re.search(r"# nfshunt-body: " + name + r"\n\s*return fmt\(\"((?:[^\"\\]|\\.)*)\"", script())
    assert m, f"no body template {name!r} in {SCRIPT}"
    return m.group(1).replace('\\"', '"')


def zeek_pattern(name):
    """The script's regular expression for a counter in the DELETE answer."""
    m = re.search(r"match_pattern\(body, /(\"" + name + r"\":\[0-9\]\+)/\)", script())
    assert m, f"no pattern for {name}"
    return m.group(1)


@pytest.fixture
def token_file(tmp_path):
    return write_tokens(tmp_path)


@pytest.fixture
def api(token_file):
    api, backend, counted = make_api(token_file)
    yield api
    api.stop()


def post(api, body):
    # What curl sends: -H @header_file (Authorization), -H Content-Type, -d @- (the body).
    return call(api, "POST", "/v1/rules", raw=body.encode(), headers={"Content-Type": "application/json"})


def connection(rule_id, action, proto="tcp", src="10.0.0.1", sport=40000, dst="10.0.0.2", dport=5201,
               priority=0, expire=60.0):
    # The script's arguments in order: id, action, protocol, src, sport, dst, dport, priority, expire.
    return template("connection") % (rule_id, action, proto, src, sport, dst, dport, priority, expire)


def address(rule_id, action, subnet, priority=0, expire=600.0):
    return template("address") % (rule_id, action, subnet, priority, expire)


def test_templates_are_what_the_api_takes():
    assert '"connection": {"protocol": "%s"' in template("connection")
    assert '"address": "%s"' in template("address")


def test_drop_connection_is_a_block(api):
    """NetControl::drop_connection: DROP, FORWARD, CONNECTION."""
    status, body = post(api, connection("1", "block"))
    assert status == 201 and body["result"] == "added"  # the script reports rule_added
    status, body = post(api, connection("1", "block"))
    assert status == 200 and body["result"] == "exists"  # rule_exists


def test_shunt_flow_is_a_shunt(api):
    """NetControl::shunt_flow: DROP, MONITOR, FLOW with both hosts and ports (subnet_to_addr)."""
    status, body = post(api, connection("2", "shunt", expire=30.5))
    assert status == 202 and body["pending"]  # rule_added (pending: the connection not seen yet)
    status, rule = call(api, "GET", "/v1/rules/2")
    assert rule["expire"] == 31 and rule["kind"] == "shunt"


def test_drop_monitor_connection_ipv6_udp(api):
    status, _ = post(api, connection("worker-1:3", "shunt", proto="udp", src="fd00::1", dst="fd00::2"))
    assert status == 202


def test_drop_address_is_an_address_block(api):
    """NetControl::drop_address (and catch-and-release): DROP, FORWARD, ADDRESS; Zeek's subnet
    prints as a/32 (a/128)."""
    status, _ = post(api, address("3", "block", "192.0.2.7/32"))
    assert status == 201
    assert post(api, address("3v6", "block", "2001:db8::7/128"))[0] == 201


def test_whitelist_address(api):
    """NetControl::whitelist_address: WHITELIST, ADDRESS, priority +5."""
    status, _ = post(api, address("4", "whitelist", "192.0.2.8/32", priority=5))
    assert status == 201
    status, body = post(api, address("5", "block", "192.0.2.8/32"))
    assert status == 403 and body["refusal"] == "whitelisted"  # the script reports rule_error


def test_refused_rule_is_an_error_with_a_reason(api):
    status, body = post(api, connection("6", "shunt", src="192.0.2.1", dst="192.0.2.2"))
    assert status == 403 and "may_shunt" in body["reason"]  # rule_error with NFShunt's reason


def test_remove_and_expiry_answers_carry_the_counters(api):
    post(api, connection("7", "block"))
    status, body = call(api, "DELETE", "/v1/rules/7", headers={"Content-Type": "application/json"})
    assert status == 200  # rule_removed
    raw_answer = call_raw(api, "DELETE", "/v1/rules/7")
    for name, value in (("packets", 3), ("bytes", 4500)):
        m = re.search(zeek_pattern(name), raw_answer)
        assert m and int(m.group(0).split(":")[1]) == value
    assert call(api, "DELETE", "/v1/rules/never")[0] == 404  # rule_removed too (gone already)


def call_raw(api, method, path):
    import http.client
    conn = http.client.HTTPConnection(*api.address, timeout=5)
    try:
        conn.request(method, path, headers={"Authorization": f"Bearer {TOKEN}"})
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def test_script_refuses_what_nfshunt_does_not_do():
    text = script()
    refusal = text[text.index("function nfshunt_refusal"):text.index("function nfshunt_expire")]
    for kind in ("REDIRECT", "MODIFY", "MAC"):
        assert kind in refusal
    assert "$can_expire=T" in text and "rule_timeout" in text and "rule_exists" in text
    assert "safe_shell_quote" in text and OTHER not in text
