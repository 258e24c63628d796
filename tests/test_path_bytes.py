"""The dashboard's bytes by path (issue 40): the fast path's from removed pairs' flow-removed
counters, the slow path's from the switch's default flows read every tick; and the counters
an alert or a rate needs exist at 0 before their first count."""
import logging
import os
from types import SimpleNamespace

os.environ.setdefault("OSKEN_HUB_TYPE", "native")

from prometheus_client import generate_latest  # noqa: E402

from nfshunt.app.operator_api import gauges  # noqa: E402
from nfshunt.core import commands as cmds  # noqa: E402
from nfshunt.core import core as c  # noqa: E402
from nfshunt.core.connection import FlowCount  # noqa: E402
from nfshunt.observe.accounting import Outcomes  # noqa: E402
from nfshunt.observe.metrics import Metrics  # noqa: E402
from nfshunt.openflow.inflight import FlowsRead  # noqa: E402
from nfshunt.records import cookies  # noqa: E402
from nfshunt.records.model import OFP10, OFP13, SwitchFlow  # noqa: E402
from nfshunt.switch.housekeeping import Housekeeping  # noqa: E402
from nfshunt.switch.switch import Switch  # noqa: E402
from tests.helpers import config, event  # noqa: E402


def snapshot():
    return {"shunts": 0, "blocks": 0, "waiting": 0, "connected": 1, "max_shunts": 10}


def test_installs_refusals_pair_bytes_and_latency_exist_at_zero_before_their_first_count():
    text = generate_latest(Metrics(snapshot).registry).decode()
    for action in ("shunt", "block"):
        for line in (f'nfshunt_flows_installed_total{{action="{action}"}} 0.0',
                     f'nfshunt_flows_refused_total{{action="{action}"}} 0.0',
                     f'nfshunt_removed_pair_bytes_total{{action="{action}"}} 0.0',
                     f'nfshunt_shunt_latency_seconds_count{{action="{action}"}} 0.0'):
            assert line in text, line
    assert Metrics(snapshot).counters.flat() == {}  # `nfshunt status` shows what counted only


def test_a_removed_pair_adds_its_flow_counters_bytes_to_its_action():
    core = c.Core(config())
    core.switch_connected(c.OFP13)
    core.reconcile([], 0)
    conn = core.conntrack_event(event())[0].conn
    conn.stats = {False: FlowCount(100, 150000, 4.5), True: FlowCount(50, 3300, 4.4)}
    metrics = Metrics(snapshot)
    outcomes = Outcomes(metrics, logging.getLogger("nfshunt.test-audit-off"))
    outcomes.removed(cmds.Removed(conn, "tcp fin"))
    conn.stats = None  # a pair whose flows reported nothing (the switch gone): counts no bytes
    outcomes.removed(cmds.Removed(conn, "switch gone"))
    text = generate_latest(metrics.registry).decode()
    assert 'nfshunt_removed_pair_bytes_total{action="shunt"} 153300.0' in text
    assert 'nfshunt_removed_pair_bytes_total{action="block"} 0.0' in text


def test_the_slow_path_family_is_exported_once_read():
    snap = snapshot()
    assert "nfshunt_slow_path_bytes" not in generate_latest(Metrics(lambda: snap).registry).decode()
    snap["slow_path_bytes"] = {"to_firewall": 5000, "from_firewall": 4000}
    text = generate_latest(Metrics(lambda: snap).registry).decode()
    assert 'nfshunt_slow_path_bytes_total{direction="to_firewall"} 5000.0' in text
    assert 'nfshunt_slow_path_bytes_total{direction="from_firewall"} 4000.0' in text


class FakeSession:
    """What the housekeeping's read asks of a session: the request and its record."""

    def __init__(self, version=OFP13):
        self.fb = SimpleNamespace(version=version,
                                  cookie_stats_request=lambda cookie, mask: ("stats", cookie, mask))
        self.asked = []
        self.inflight = SimpleNamespace(count=lambda kind: 0)
        self.meter_on = False
        self.dp = None
        self.send = SimpleNamespace(queued=[])

    def ask(self, msg, req):
        self.asked.append((msg, req))


def _default(in_port, nbytes):
    return SwitchFlow(cookies.make(cookies.Kind.DEFAULT), 1, in_port, None, None, packets=nbytes // 100,
                      bytes=nbytes)


def _housekeeping():
    return Housekeeping(counters=None, rlog=None, replies=SimpleNamespace(give_up=lambda *a: None),
                        roles=SimpleNamespace(check=lambda *a: None), run=lambda sw, commands: None)


def test_the_tick_reads_the_default_flows_once_at_a_time_and_splits_their_bytes_by_direction():
    sw = Switch(config(), 0)  # ports: fast 1 <-> slow 2, fast 3 <-> slow 4
    s = sw.session = FakeSession()
    house = _housekeeping()
    house.tick(sw, 1.0)
    house.tick(sw, 2.0)  # the first read unanswered: not asked again
    [(msg, req)] = s.asked
    assert msg == ("stats", cookies.make(cookies.Kind.DEFAULT), cookies.OWNED_MASK | cookies.KIND_MASK)
    assert isinstance(req, FlowsRead)
    shunt = SwitchFlow(cookies.make(cookies.Kind.SHUNT, 7), 33000, 1, None, 3, packets=9, bytes=900000)
    req.done([_default(1, 7000), _default(3, 1000), _default(2, 5000), _default(4, 500), shunt])
    assert sw.slow_path_bytes == {"to_firewall": 8000, "from_firewall": 5500}
    house.tick(sw, 3.0)  # answered: the next tick reads again
    assert len(s.asked) == 2
    s.asked[1][1].done(None)  # given up, or the switch went: the last read stays
    assert sw.slow_path_bytes == {"to_firewall": 8000, "from_firewall": 5500}
    assert gauges([sw, sw])["slow_path_bytes"] == {"to_firewall": 16000, "from_firewall": 11000}


def test_a_new_session_reads_at_once_and_openflow_1_0_is_not_read():
    sw = Switch(config(), 0)
    old = sw.session = FakeSession()
    house = _housekeeping()
    house.tick(sw, 1.0)
    new = sw.session = FakeSession()  # a reconnect while the old session's read was in flight
    house.tick(sw, 2.0)
    assert len(old.asked) == 1 and len(new.asked) == 1
    old.asked[0][1].done(None)  # the old session's read given up: the new one's stays in flight
    house.tick(sw, 3.0)
    assert len(new.asked) == 1
    sw10 = Switch(config(), 0)
    sw10.session = FakeSession(version=OFP10)
    house.tick(sw10, 1.0)
    assert sw10.session.asked == [] and gauges([sw10])["slow_path_bytes"] == {}
