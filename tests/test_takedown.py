"""Every way a shunt ends hands its connection back to the firewall alive (issue 26.1), and
a policy applied while the controller was stopped reaches the pairs it left on the switch
(26.2). On the real testbed behind a strict firewall: INVALID dropped and no loose pickup,
so a TCP connection whose conntrack entry is not re-created before its flows go is dead.
Each take-down path runs a paced 3 s transfer that is shunted, taken down mid-way, and
must carry on with no stall over 1 s."""
from __future__ import annotations

import signal
import time

import pytest

from tests.beds import Bed, Strict
from tests.test_failsafe import TCP_PAIR, finish_iperf, longest_stall, shunt_flows, start_iperf, wait_flows_gone

pytestmark = [pytest.mark.integration, pytest.mark.testbed, pytest.mark.third_bed]

SHUNT, BLOCK = 5201, 5202
BASE = {"default_shunt_timeout": 30}


TESTBED = Bed(config=BASE, strict=Strict.FULL)


@pytest.fixture
def fresh(tb):
    yield tb
    if tb.extra_config != BASE or tb.controller is None or tb.controller.poll() is not None:
        tb.extra_config.clear()
        tb.reconfigure(**BASE)
    # A connection shunted again while its close crossed the firewall (iperf3's control
    # connection after a flush) keeps its shunt until it idles out: no catcher saw the
    # close. Known and not fixed yet; its leftovers go, so the next case starts clean.
    tb.control({"cmd": "flush", "reason": "the previous case's leftovers"})
    wait_flows_gone(tb, (SHUNT, BLOCK))


def _invalid_dropped(tb):
    """Packets the firewall's strict rule dropped as INVALID (FORWARD)."""
    out = tb.run(tb.fw, "iptables", "-w", "5", "-nvxL", "FORWARD")
    for line in out.splitlines():
        if "INVALID" in line and "DROP" in line:
            return int(line.split()[0])
    raise AssertionError(f"no strict rule in FORWARD:\n{out}")


def _shutdown(tb):
    assert tb.stop_controller(signal.SIGTERM) == 0  # delete_flows_on_shutdown: true (the default)


def _evict(tb):
    """A block with the budget full pushes the newest shunt out: with max_shunts 1 iperf3's
    control connection (connected first, shunted first; the data connection waits for room on
    the firewall). Its last message, after the transfer, must cross the firewall."""
    from nfshunt_testbed.bed import H2_IP
    srv = tb.conn_server(BLOCK)
    cli = None
    try:
        cli, _ = tb.open_conns(BLOCK, 1)
        tb.wait_for(lambda: any(int(f["cookie"], 16) >> 48 & 0xFF == 3 for f in tb.conn_flows(BLOCK)), 10,
                    f"the block of {H2_IP}:{BLOCK}")
    finally:
        srv.kill()
        if cli is not None:  # else it retransmits into the firewall (INVALID) until the testbed ends
            cli.kill()
            cli.wait()


def _unshunt(tb):
    """The operator sends every shunted connection of the transfer back to the firewall."""
    sock = tb.nfshunt_config()["control_socket"]
    for conn in tb.control({"cmd": "status"})["connections"]:
        if conn["action"] == "shunt" and conn["tuple"].endswith(f":{SHUNT}"):
            tb.nfshunt("unshunt", "--socket", sock, conn["tuple"])


def _flush(tb):
    tb.nfshunt("flush", "--socket", tb.nfshunt_config()["control_socket"])


# The take-downs a user sees, end to end: an operator's unshunt and flush, the controller's
# own exit (its restores must reach the kernel before the process ends) and a block's
# eviction. Every take-down is also checked in both layouts against the fake switch
# (test_fake_core.py::test_every_take_down_recreates_the_entry_before_the_flows_go_and_leaves_the_slow_path).
PATHS = {"unshunt": (_unshunt, {}), "flush": (_flush, {}), "shutdown": (_shutdown, {}),
         "eviction": (_evict, {"max_shunts": 1, "max_block_share": 0.5})}


def _operator_pins_ended(tb):
    """The unshunt case's pins ended with its connections (TIME_WAIT), and the controller wrote
    its pins' file again: a restart holds none of them. When they came back at a restart, a pin
    held iperf3's next connection on a reused client port on the firewall (CI-19, CI-20 of
    session 45; CI-9 of session 46: the eviction then took the data connection mid-transfer)."""
    from nfshunt.app import pin_file
    path = pin_file.path_in(tb.firewalls[0].workdir)
    tb.wait_for(lambda: not pin_file.load(path, time.time()), 3,
                "the unshunt case's pins to end with its connections and leave the pins' file")


def _entries_deleted(tb):
    """The shunted pairs' conntrack entries are gone (deleted once a shunt is confirmed): the
    state a take-down must recover from. (With max_shunts 1 the pair is iperf3's idle control
    connection: no packet count to wait for.)"""
    ids = {int(f["cookie"], 16) & 0xFFFFFFFF for f in shunt_flows(tb, SHUNT)}
    return ids and not ids & {e["id"] for e in tb.conntrack() if e["dport"] == SHUNT}


@pytest.mark.parametrize("path", list(PATHS))
def test_a_taken_down_shunt_carries_on_through_a_strict_firewall(fresh, path):
    from nfshunt_testbed.bed import STEADY_RATE
    take_down, config = PATHS[path]
    if config:
        _operator_pins_ended(fresh)
        fresh.reconfigure(**BASE, **config)
    # 3 s: the take-down is over within 0.5 s (printed below), leaving over 2 s in which a stall
    # over 1 s (or a dead connection) shows.
    srv, cli = start_iperf(fresh, SHUNT, 3, bitrate=STEADY_RATE)
    started = time.monotonic()
    try:
        fresh.wait_for(lambda: len(shunt_flows(fresh, SHUNT)) >= 2, 10, "the transfer to be shunted")
        fresh.wait_for(lambda: _entries_deleted(fresh), 3, "the shunted pairs' conntrack entries to be deleted")
        dropped = _invalid_dropped(fresh)
        slow = fresh.slow_path_packets()
        pair = {f["cookie"] for f in shunt_flows(fresh, SHUNT)}
        ports = {f.get(k) for f in shunt_flows(fresh, SHUNT) for k in ("tp_src", "tp_dst", "tcp_src", "tcp_dst")}
        take_down(fresh)
        fresh.wait_for(lambda: not pair & {f["cookie"] for f in shunt_flows(fresh, SHUNT)}, 5, "the take-down")
        taken_down = time.monotonic() - started
        # Back on the firewall (a flush's re-evaluation may shunt it again at once, as a new pair).
        fresh.wait_for(lambda: fresh.slow_path_packets() > slow, 5, "the transfer to cross the firewall")
    finally:
        result = finish_iperf(srv, cli)
    assert "error" not in result, result.get("error")
    stall = longest_stall(result)
    print(f"\n{path}: taken down {taken_down:.1f} s into the transfer; longest stall {stall:.1f} s, "
          f"{_invalid_dropped(fresh) - dropped} packets dropped as INVALID")
    if path == "eviction":
        data = str(result["start"]["connected"][0]["local_port"])
        assert data not in ports, f"the eviction took the data connection ({data}), not iperf3's control connection"
    assert stall < 1.0
    if path == "shutdown":
        fresh.restart_controller()
        fresh.wait_for_controller()


def _swapped_policy(tmp_path):
    from nfshunt_testbed.bed import POLICY
    text = open(POLICY).read().replace("port 5201 ", "port 5999 ")  # 5201 no longer shunted
    path = tmp_path / "no5201.rules"
    path.write_text(text)
    return str(path)


def test_a_policy_applied_while_the_controller_is_stopped_holds_for_the_pairs_it_left(fresh, tmp_path):
    from nfshunt_testbed.bed import POLICY, PYTHON, STEADY_RATE
    _operator_pins_ended(fresh)
    fresh.stop_controller()
    fresh.reconfigure(**BASE, delete_flows_on_shutdown=False, delete_flows_on_startup=False)
    # A restart with the policy unchanged adopts the pair (hitless): the control case.
    srv, cli = fresh.start_transfer(SHUNT, 60, bitrate=STEADY_RATE)  # stopped after the last look
    try:
        # Both of iperf3's connections (control and data): in a loaded suite run the data
        # connection was shunted only after the restart, and its new pair read as a bounce.
        fresh.wait_for(lambda: len(shunt_flows(fresh, SHUNT)) >= 2 * TCP_PAIR, 10, "the transfer to be shunted")
        cookies = {f["cookie"] for f in shunt_flows(fresh, SHUNT)}
        fresh.restart_controller()
        fresh.wait_for_controller()
        mark = len(fresh.controller_output())
        fresh.wait_for(lambda: "reconciled with switch" in fresh.controller_output()[mark - 2000:], 10,
                       "the restarted controller's reconcile")
        assert {f["cookie"] for f in shunt_flows(fresh, SHUNT)} == cookies, "the unchanged policy's pair was bounced"
        # Now stop, apply a policy that no longer shunts 5201, start again.
        fresh.stop_controller()
        out = fresh.run(fresh.fw, PYTHON, "-m", "nfshunt", "iptables", "apply", "--config", fresh.config_path,
                        "--policy", _swapped_policy(tmp_path))
        assert "handed back to this policy when the controller starts" in out, out
        slow = fresh.slow_path_packets()
        mark = len(fresh.controller_output())
        fresh.restart_controller()
        fresh.wait_for(lambda: "reconciled with switch" in fresh.controller_output()[mark:], 10,
                       "the restarted controller's reconcile")
        t0 = time.monotonic()
        fresh.wait_for(lambda: not shunt_flows(fresh, SHUNT), 3, "the old pair handed back to the new policy")
        print(f"\nhanded back {time.monotonic() - t0:.2f} s after the reconcile")
        fresh.wait_for(lambda: fresh.slow_path_packets() > slow + 500, 5, "the transfer on the slow path")
        time.sleep(1.0)  # a negative: the new policy must not shunt it again
        assert not shunt_flows(fresh, SHUNT)
    finally:
        result = fresh.stop_transfer(srv, cli)
        fresh.run(fresh.fw, PYTHON, "-m", "nfshunt", "iptables", "apply", "--config", fresh.config_path,
                  "--policy", POLICY, "--no-reevaluate", check=False)
    assert "error" not in result, result.get("error")
    assert longest_stall(result) < 1.0
