"""Flow-mod pacing (issue 13.3) on the real testbed: a burst of connections is installed
at the configured flow-mod rate, the ones beyond the queue wait on the slow path and are
installed as it drains, and none is lost. The same on the rig, and the budget a switch's
reported table size sets: test_fake_core."""
from __future__ import annotations

import pytest

from tests.beds import Bed

pytestmark = [pytest.mark.integration, pytest.mark.testbed]
SHUNT = 5201
RATE = 120  # flow-mods a second: 20 TCP shunts (2 flows and 4 teardown catchers each, single layout)


TESTBED = Bed(config={"default_shunt_timeout": 60, "flow_mod_rate": RATE, "install_queue": 20,
                      "flow_layout": "single"})


def _port_flows(tb) -> list[dict[str, str]]:
    """Every flow on the switch for the test's port: shunt pairs and their teardown catchers."""
    return [f for f in tb.flows() if str(SHUNT) in (f.get("tp_src"), f.get("tp_dst"))]


def test_a_burst_is_installed_at_the_flow_mod_rate_and_nothing_is_lost(tb):
    n = 60
    srv = tb.conn_server(SHUNT)
    conns, _ = tb.open_conns(SHUNT, n, cport_base=51001)
    try:
        def shunted():
            return [f for f in tb.conn_flows(SHUNT) if int(f["cookie"], 16) >> 48 & 0xFF == 2]
        tb.wait_for(lambda: len(shunted()) == 2 * n, 15, f"all {n} connections shunted", interval=0.2)
        st = tb.control({"cmd": "status"})
        assert st["shunts"] == n and st["queued"] == 0 and st["waiting"] == 0
        ages = sorted(cn["age"] for cn in st["connections"])
        spread = ages[-1] - ages[0]
        print(f"\n{n} shunts confirmed over {spread:.2f} s at {RATE} flow-mods/s; "
              f"{st['counters'].get('install_queue_full', 0)} waited for room in the queue")
        assert spread >= (n - 2) * 6 / RATE * 0.8  # the rate held (less the bucket's burst)
        assert st["counters"].get("install_queue_full", 0) >= 1  # the queue filled: they waited, not lost
    finally:
        conns.kill()
        srv.kill()
