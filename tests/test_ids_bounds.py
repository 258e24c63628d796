"""An IDS's decision keeps its bounds (issue 36: 1, 4, 6), on the real testbed behind a strict
firewall (INVALID dropped, no loose pickup), with the flows kept across a controller's stop
(`delete_flows_on_shutdown` false, as a pair requires):
  - an IDS's shunt ends on the switch at its rule's end while no controller runs, and a
    restart adopts only the pairs whose authority it can name;
  - saved rules are judged again at start: an operator who empties `ids.may_shunt` and
    restarts sees the old IDS shunts handed back to the firewall, their transfers going on;
  - an IDS's block of a connection inside a static stream stops its frames at the switch.
The takeover (36.2) is test_ha.py's."""
from __future__ import annotations

import os
import re
import sys
import tempfile
import time

import pytest

from tests.beds import Bed, Strict, running
from tests.test_failsafe import longest_stall
from tests.test_ids import API_PORT, IGNORE, TOKEN, api, connection
from tests.test_static_testbed import ECHO, PORT, STREAM, cycle

pytestmark = [pytest.mark.integration, pytest.mark.testbed, pytest.mark.second_bed]

IDS_KEYS = {"listen_port": API_PORT, "answer_timeout": 3.0,
            "may_shunt": {"prefixes": ["10.0.0.2/32"], "ports": [IGNORE]}}
KEPT = {"delete_flows_on_shutdown": False, "delete_flows_on_startup": False}
STATIC_KIND = 6


@pytest.fixture(scope="module")
def tb(integration_ready):
    folder = tempfile.mkdtemp(prefix="nfshunt-ids-bounds-")
    tokens = os.path.join(folder, "tokens")
    with open(os.open(tokens, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:
        fh.write(f"zeek {TOKEN}\n")
    base = {"default_shunt_timeout": 30, "ids": {**IDS_KEYS, "token_file": tokens}, "static_shunts": [STREAM],
            **KEPT}
    try:
        with running(Bed(config=base, strict=Strict.FULL)) as bed:
            bed.base_config = dict(base)
            yield bed
    finally:
        os.unlink(tokens)
        os.rmdir(folder)


@pytest.fixture
def fresh(tb):
    yield tb
    if tb.extra_config != tb.base_config or tb.controller is None or tb.controller.poll() is not None:
        tb.extra_config.clear()
        tb.reconfigure(**tb.base_config)
    for rule in api(tb, "GET", "/v1/rules")[1]["rules"]:
        api(tb, "DELETE", f"/v1/rules/{rule['id']}")
    tb.control({"cmd": "flush", "reason": "the previous case's leftovers"})
    tb.wait_for(lambda: not tb.conn_flows(IGNORE) and len(_static(tb)) == 2, 20, "the test's flows to go")


def _pair(tb, cport):
    """The per-connection flows of h1:cport <-> h2:IGNORE."""
    return [f for f in tb.conn_flows(IGNORE) if str(cport) in (f.get("tp_src"), f.get("tp_dst"), f.get("tcp_src"),
                                                                f.get("tcp_dst"))]


def _static(tb):
    return [f for f in tb.flows() if int(f.get("cookie", "0"), 16) >> 48 == 0x4E00 | STATIC_KIND]


def _state_file(tb):
    return os.path.join(tb.firewalls[0].workdir, "ids-rules.json")


def _closed_cleanly(proc):
    """conngen's held connections closed: True when every one saw the peer's FIN, no reset."""
    proc.stdin.write("close\n")
    proc.stdin.flush()
    line = proc.stdout.readline().split()
    proc.wait(10)
    return line == ["closed", "1", "0"], line


def _add(tb, rule_id, cport, expire, idle_timeout=600):
    status, body = api(tb, "POST", "/v1/rules", {"id": rule_id, "action": "shunt", "expire": expire,
                                                 "idle_timeout": idle_timeout,
                                                 "connection": connection(cport, IGNORE)})
    assert (status, body["result"]) == (201, "added"), body


def test_an_ids_shunt_ends_on_the_switch_at_its_rules_end_with_no_controller_and_a_restart_adopts_only_what_it_names(
        fresh):
    tb = fresh
    srv = tb.conn_server(IGNORE)
    short, _ = tb.open_conns(IGNORE, 1, cport_base=47601)  # each kept alive by an echo every 0.2 s
    long, _ = tb.open_conns(IGNORE, 1, cport_base=47602)
    try:
        _add(tb, "short", 47601, expire=6)
        added = time.monotonic()
        _add(tb, "long", 47602, expire=600)
        assert {f.get("hard_timeout") for f in _pair(tb, 47601)} == {"7"}  # the rule's end and a second
        assert tb.stop_controller() == 0  # the flows stay on the switch
        tb.wait_for(lambda: not _pair(tb, 47601), 15, "the short rule's pair to leave the switch")
        gone = time.monotonic() - added
        print(f"\nthe short rule's pair left the switch {gone:.1f} s after the rule was added (expire 6 s), "
              "no controller running")
        assert tb.controller is None and 6 <= gone < 9
        assert len(_pair(tb, 47602)) == 2
        cookies = {f["cookie"] for f in _pair(tb, 47602)}

        # A restart: the live rule names its pair (adopted, not bounced); the short one expired.
        mark = len(tb.controller_output())
        tb.restart_controller()
        tb.wait_for_controller()
        assert {f["cookie"] for f in _pair(tb, 47602)} == cookies
        assert api(tb, "GET", "/v1/rules/short")[1]["state"] == "expired"
        assert "adopted with no authority" not in tb.controller_output()[mark:]

        # The rules lost (or another controller's pair): nothing names it, it is handed back alive.
        assert tb.stop_controller() == 0
        os.unlink(_state_file(tb))
        tb.restart_controller()
        tb.wait_for_controller()
        tb.wait_for(lambda: not _pair(tb, 47602), 5, "the pair nothing names to be handed back")
        tb.wait_for(lambda: re.search(r"shunt removed \(adopted with no authority", tb.controller_output()[mark:]), 5,
                    "the hand-back's reason in the log")
        time.sleep(1.0)  # echoes cross the firewall meanwhile: a dead connection would not close cleanly
        ok, line = _closed_cleanly(long)
        assert ok, f"the handed-back connection did not close cleanly: {line}"
    finally:
        for proc in (short, long, srv):
            proc.kill()
            proc.communicate()


def test_an_emptied_may_shunt_hands_the_saved_rules_shunts_back_at_the_next_start(fresh):
    tb = fresh
    from nfshunt_testbed.bed import STEADY_RATE
    srv, cli = tb.start_transfer(IGNORE, 60, cport=47701, bitrate=STEADY_RATE)  # stopped 2 s after the hand-back
    try:
        status, body = api(tb, "POST", "/v1/rules", {"id": "wide", "action": "shunt", "expire": 30 * 86400,
                                                     "connection": connection(47701, IGNORE)})
        assert status in (201, 202) and body["result"] == "added", body  # (202: its data connection not up yet)
        tb.wait_for(lambda: len(_pair(tb, 47701)) == 2, 10, "the IDS's shunt of the transfer")
        # The operator empties may_shunt and restarts (the flows stay on the switch meanwhile).
        tb.reconfigure(ids={k: v for k, v in tb.base_config["ids"].items() if k != "may_shunt"})
        started = time.monotonic()
        tb.wait_for(lambda: not _pair(tb, 47701), 5, "the old IDS shunt handed back")
        back = time.monotonic()
        print(f"\nhanded back {back - started:.2f} s after the restarted controller had the switch")
        slow = tb.slow_path_packets()
        tb.wait_for(lambda: tb.slow_path_packets() > slow + 500, 5, "the transfer through the firewall")
        assert api(tb, "GET", "/v1/rules")[1]["rules"] == []
        assert api(tb, "GET", "/v1/rules/wide")[1]["state"] == "removed"
        tb.wait_for(lambda: "IDS rule ids:zeek/wide refused at start (ids.may_shunt is empty" in
                    tb.controller_output(since_start=True), 5, "the refusal at start in the log")
        tb.watch_until(back + 2.0)  # a stall over 1 s, or a dead connection, shows in this window
    finally:
        result = tb.stop_transfer(srv, cli)
    print(f"the handed-back transfer's longest stall: {longest_stall(result):.1f} s")
    assert "error" not in result, result.get("error")
    assert longest_stall(result) < 1.0


def test_an_ids_block_of_a_static_streams_connection_stops_its_frames_at_the_switch(fresh):
    tb = fresh
    from nfshunt_testbed.bed import H1_IP, H2_IP
    echo = tb.spawn(tb.h2, sys.executable, "-c", ECHO, str(PORT), stdout=-1)
    try:
        assert echo.stdout.readline().strip() == "ready"
        assert cycle(tb, 50)["echoed"] == 50  # the stream runs, fast port to fast port
        status, body = api(tb, "POST", "/v1/rules", {
            "id": "s1", "action": "block", "expire": 60,
            "connection": {"protocol": "udp", "src": H1_IP, "sport": 40000, "dst": H2_IP, "dport": PORT}})
        assert cycle(tb, 50)["echoed"] == 0, body
        counted = sum(int(f["n_packets"]) for f in _static(tb) if f["actions"] == "drop")
        assert counted >= 50, _static(tb)  # dropped at the switch, not carried past it
        # (Open vSwitch credits the drops with the stream's last frames before them too: its
        # revalidator pushes a datapath flow's counts to the rules it translates to now.)
        assert (status, body["result"]) == (201, "added"), body  # once the switch had the drops
        drops = [f for f in _static(tb) if f["actions"] == "drop"]
        assert len(drops) == 2 and {f.get("hard_timeout") for f in drops} == {"61"}  # ended by the switch too
        status, body = api(tb, "DELETE", "/v1/rules/s1")
        assert status == 200, body
        tb.wait_for(lambda: len(_static(tb)) == 2, 5, "the block's drops to go")
        assert cycle(tb, 50)["echoed"] == 50
    finally:
        echo.kill()
        echo.wait()
