"""`nfshunt probe-switch` (issue 13.6) against the testbed's Open vSwitch, and against it
behind the hardware-lag proxy: it must see the lag, recommend confirming by counters, and
leave the switch's flows as it found them."""
from __future__ import annotations

import json

import pytest

from tests.beds import Bed, running

pytestmark = [pytest.mark.integration, pytest.mark.testbed, pytest.mark.second_bed]


def _probe(tb):
    tb.stop_controller()
    before = {(f["cookie"], f.get("in_port"), f["actions"]) for f in tb.flows()}
    try:
        # Three lags a median (five by default: 0.35 s each behind the lag proxy).
        out = tb.nfshunt("probe-switch", "--config", tb.config_path, "--wait", "30", "--pairs", "500",
                         "--lag-runs", "3", timeout=120)
    finally:
        after = {(f["cookie"], f.get("in_port"), f["actions"]) for f in tb.flows()}
        tb.restart_controller()
        tb.wait_for_controller()
    assert after == before, "the probe left flows behind or removed the switch's own"
    settings = json.loads(out[out.index("recommended settings"):].split("\n", 1)[1])
    return out, settings


def _refused_while_the_controller_holds_the_port(tb):
    import subprocess

    from nfshunt_testbed.bed import PYTHON
    proc = tb.fw.popen([PYTHON, "-m", "nfshunt", "probe-switch", "--config", tb.config_path, "--wait", "1"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=tb._env())
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "stop the controller first" in out, out
    assert tb.controller is not None and tb.controller.poll() is None  # untouched


def test_probe_switch_reports_what_the_switch_can_do_and_recommends_settings(integration_ready):
    """First, while the controller holds the port, the probe says what to do and leaves it
    alone (checked on this testbed rather than on one of its own); then, with it stopped,
    the probe's report."""
    with running(Bed()) as tb:
        _refused_while_the_controller_holds_the_port(tb)
        out, settings = _probe(tb)
    print(out)
    for shape in ("TCP shunt + FIN/RST catchers", "IPv6 UDP shunt", "block (no actions)", "packet-in meter",
                  "pipeline layout: TCP shunt to table 1", "VLAN 100 TCP shunt, tag kept", "VLAN 30 <-> 301 UDP shunt",
                  "untagged <-> VLAN 70 UDP shunt", "VLAN 30 priority 6 static shunt"):
        assert f"ok   {shape}" in out, shape
    assert "VLAN shunts: supported (match, retag, push/pop, priority)" in out  # Open vSwitch 3.1 reads each back
    assert "flow-mod rate: 1000 flow-mods behind one barrier" in out
    lag = float(out.split("forwarding lag after the barrier reply: median ")[1].split(" ms")[0])
    assert lag < 50
    assert settings["confirm"] == "barrier" and settings["tcp_teardown"] is True
    assert settings["flow_layout"] == "auto"
    assert settings["openflow_versions"] == ["1.3"] and settings["max_shunts"] > 0


def test_probe_switch_sees_a_hardware_lag_and_recommends_confirming_by_counters(integration_ready):
    with running(Bed(switch_lag_ms=300)) as tb:
        out, settings = _probe(tb)
    print(out)
    lag = float(out.split("forwarding lag after the barrier reply: median ")[1].split(" ms")[0])
    assert 250 < lag < 1000
    assert settings["confirm"] == "counters" and settings["confirm_delay"] >= 0.4
