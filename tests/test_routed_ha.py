"""A pair of routing firewalls (issue 38 item 5, docs/routed.md "A firewall pair"): the
testbed's `ha` mode with routed=True. Both firewalls route between h1's and h2's subnets with
addresses of their own; the hosts' gateways are keepalived's virtual addresses on the active
one (config/ha/keepalived-routed.conf), conntrackd keeps the backup in step.

When the active firewall dies, its routed shunts stay on the switch and the new master adopts
them: their flows carry the dead host's MAC as the router's source, so it rewrites them with
its own egress MACs in place (the same flows, the same cookies), once its kernel has resolved
the next hops it never talked to. The waits read the switch and the logs, never a controller's
status (asking would wake it)."""
from __future__ import annotations

import json
import re
import time
from typing import Callable

import pytest

from tests.test_failsafe import longest_stall

pytestmark = [pytest.mark.integration, pytest.mark.testbed]

SHUNT, IGNORE = 5201, 5203
LONG, WATCH, WATCH_SLOW = 60, 2.0, 4.0  # as test_ha.py's


def _pair(nat: str | None):
    from tests.beds import Bed, running
    # Shunts outlive the transfers' idle iperf3 control connections (as test_ha.py's).
    return running(Bed(mode="ha", routed=True, nat=nat,
                       config={"experimental_routed": True, "default_shunt_timeout": 60}))


def _mac(tb, node, intf: str) -> str:
    return json.loads(tb.run(node, "ip", "-j", "link", "show", intf))[0]["address"]


def _routed_flows(tb, port: int) -> list[dict[str, str]]:
    """The pair's two forwarding flows (not its teardown catchers), by in_port."""
    return [f for f in tb.conn_flows(port) if "dec_ttl" in f["actions"] and "CONTROLLER" not in f["actions"]]


def _sources(tb, port: int) -> set[tuple[str, str]]:
    """(in_port, the source MAC its flow writes) of every pair's flows: one MAC a direction
    when every pair has it."""
    out = set()
    for f in _routed_flows(tb, port):
        m = re.search(r"set_field:([0-9a-f:]{17})->eth_src", f["actions"])
        out.add((f["in_port"], m.group(1) if m else ""))
    return out


def fail_over(tb, fw, rewritten: Callable[[], bool]) -> tuple[float, float, float]:
    """The active firewall `fw` dies: when (monotonic), and how long after that the other held
    the switch and its adopted shunts were rewritten (`rewritten` true)."""
    fw2 = tb.other(fw)
    failed_at = time.monotonic()
    tb.fail_firewall(fw)
    tb.wait_for(lambda: tb.defaults_point_to(fw2), 10, f"{fw2.name} to take the switch over")
    took_over = time.monotonic() - failed_at
    tb.wait_for(rewritten, 10, f"the adopted shunt rewritten with {fw2.name}'s MACs")
    return failed_at, took_over, time.monotonic() - failed_at


def assert_carried_on(shunted: dict, ignored: dict, took_over: float, new_master: str) -> None:
    """Both transfers whole; the shunted one never stalled, the slow-path one resumed within
    1.5 s of the new master holding the switch."""
    assert "error" not in shunted and "error" not in ignored, (shunted.get("error"), ignored.get("error"))
    assert longest_stall(shunted) < 1.0, "the shunted transfer stalled"
    assert longest_stall(ignored) < took_over + 1.5, \
        f"the slow-path transfer did not resume within 1.5 s of {new_master} holding the switch"


@pytest.mark.parametrize("nat", [None, "snat"])
def test_a_takeover_keeps_the_routed_shunts_rewritten_with_the_new_masters_macs(integration_ready, nat):
    """nat="snat": h1's connections translated to h2's gateway address, which moves with the
    active firewall; conntrackd syncs the kept entry of a NAT pair, and its commit on fw2 makes
    it anew (another id, the same tuples and mark): the pair is kept all the same."""
    from nfshunt_testbed.bed import STEADY_RATE
    with _pair(nat) as tb:
        fw, _ = tb.wait_for_elected(10)
        fw2 = tb.other(fw)
        tb.strict_firewalls()
        old = {("1", _mac(tb, tb.node(fw), f"{fw.name}-eth1")), ("3", _mac(tb, tb.node(fw), f"{fw.name}-eth0"))}
        new = {("1", _mac(tb, tb.node(fw2), f"{fw2.name}-eth1")), ("3", _mac(tb, tb.node(fw2), f"{fw2.name}-eth0"))}
        s_srv, s_cli = tb.start_transfer(SHUNT, LONG, bitrate=STEADY_RATE)
        i_srv, i_cli = tb.start_transfer(IGNORE, LONG, bitrate=STEADY_RATE)
        try:
            # Both of iperf3's connections to the port (its control and data) are shunted: both
            # pairs in (4 flows), or the later one's install can land after the cookies are read
            # (CI-7, session 51: 9 ms apart on a loaded first testbed).
            tb.wait_for(lambda: len(_routed_flows(tb, SHUNT)) == 4 and _sources(tb, SHUNT) == old, 10,
                        f"the two routed shunts with {fw.name}'s MACs")
            cookies = {f["cookie"] for f in tb.conn_flows(SHUNT)}
            if nat:  # translated to h2's gateway on the way out, back to h1's address on the way in
                actions = {f["in_port"]: f["actions"] for f in _routed_flows(tb, SHUNT)}
                assert "10.0.2.254->ip_src" in actions["1"] and "10.0.1.1->ip_dst" in actions["3"], actions
            time.sleep(2)  # both transfers under way, conntrackd has the ignored one on fw2
            failed_at, took_over, rewritten = fail_over(tb, fw, lambda: _sources(tb, SHUNT) == new)
            # Adopted and rewritten in place: the same flows (cookies) carry it.
            assert {f["cookie"] for f in tb.conn_flows(SHUNT)} == cookies
            # A connection opened after the takeover is shunted by the new master, with its MACs.
            fresh = tb.iperf(5204, 1, cport=SHUNT, watch=lambda: None, bitrate=STEADY_RATE)
            assert "error" not in fresh, fresh
            tb.watch_until(failed_at + WATCH_SLOW)
        finally:
            shunted = tb.stop_transfer(s_srv, s_cli)
            ignored = tb.stop_transfer(i_srv, i_cli)
        print(f"{fw2.name} had the switch {took_over:.2f} s after {fw.name} died, the shunt rewritten after "
              f"{rewritten:.2f} s; longest stall: shunted {longest_stall(shunted):.1f} s, slow path "
              f"{longest_stall(ignored):.1f} s")
        # The slow path resumes once fw2 holds the switch and has told the hosts its MACs (its
        # announcements): keepalived's own went out before, and reached no host (0.4-0.6 s after
        # 0.45-0.48 s takeovers on the 2-core VM).
        assert_carried_on(shunted, ignored, took_over, fw2.name)
        after = tb.controller_output(fw2).split("master of switch")[-1]
        assert re.search(r"reconciled with switch \w+ \([^)]*\): \d+ NFShunt flows read, [1-9]\d* pairs held, "
                         r"0 re-installed", after), f"{fw2.name} did not adopt the live pairs"
        assert re.search(r"shunt tcp 10\.0\.1\.1:5201 -> 10\.0\.2\.1:5204 .* in [0-9.]+ ms", after), \
            f"the connection opened after the takeover was not shunted by {fw2.name}"
        # fw2 had never sent to h1 or h2 (its slow ports heard nothing while it stood by): it was
        # made to resolve them; the pair was kept meanwhile, and nothing went back to the firewall
        # (a NAT pair not for its entry's new id either).
        counters = tb.control({"cmd": "status", "connections": False}, fw=fw2)["counters"]
        assert counters.get("routed_next_hops_solicited", 0) >= 1, counters
        assert not [k for k in counters if k.startswith("removed:shunt:routed")], counters
