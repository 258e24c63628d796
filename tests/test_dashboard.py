"""The shipped Grafana dashboard and Prometheus alert rules, proven against Debian's real
Prometheus on the testbed (issue 40): it scrapes the controller with the shipped example
scrape config and evaluates the shipped rules; shunted, blocked, ignored and refused
transfers, an IDS rule and a refused IDS request, an IDS API process killed; then every
dashboard query and every alert expression (read from the shipped files themselves) has
data, the error and restart alerts fired on their events, and the switch and pair alerts
fire while the switch is away and the pair has no master, and clear when they return."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from tests.beds import Bed, running

pytestmark = [pytest.mark.integration, pytest.mark.testbed, pytest.mark.second_bed]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRICS_PORT, API_PORT = 9753, 9754
TOKEN = "dashboard-testbed-token-0123456789"
SHUNT, BLOCK, IGNORE = 5201, 5202, 5203  # the example policy's ports


def _missing() -> str | None:
    for tool in ("prometheus", "promtool"):
        if shutil.which(tool) is None:
            return f"needs {tool} (Debian's prometheus; run `make deps`)"
    try:
        import yaml  # noqa: F401
    except ImportError:
        return "needs the Python module yaml (Debian package python3-yaml; run `make deps`)"
    return None


@pytest.fixture(scope="module")
def ready(integration_ready):
    reason = _missing()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"dashboard test prerequisites missing in CI: {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def tb(ready, tmp_path_factory):
    folder = tmp_path_factory.mktemp("dashboard")
    tokens = folder / "tokens"
    with open(os.open(tokens, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:
        fh.write(f"zeek {TOKEN}\n")
    # A one-controller "pair" (its role and generation in the metrics) that starts as master.
    config = {"default_shunt_timeout": 3, "default_block_timeout": 3,
              "metrics_address": "127.0.0.1", "metrics_port": METRICS_PORT,
              "ids": {"listen_port": API_PORT, "token_file": str(tokens)},
              "delete_flows_on_shutdown": False,
              "pair": {"state_file": str(folder / "pair.json"), "start_role": "master"}}
    started = time.monotonic()
    with running(Bed(config=config)) as bed:
        print(f"\nthe bed up in {time.monotonic() - started:.1f} s (with any wait for the testbed lock)")
        yield bed


@pytest.fixture(scope="module")
def prom(tb):
    from nfshunt_testbed import prometheus
    started = time.monotonic()
    with prometheus.running(tb, interval="1s") as server:
        print(f"\nPrometheus scraping in {time.monotonic() - started:.1f} s")
        yield server


# --- what the test reads from the shipped files -------------------------------------------

def _shipped():
    from nfshunt_testbed import prometheus
    return prometheus.dashboard_queries(), prometheus.alert_rules()


_COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)(\s*)(?=[-+]?[0-9.])")


def measured(expr: str) -> str:
    """The alert expression with each comparison against a number at its top level (outside
    any parentheses) made a `bool` one: every series the alert compares, 1 where it would
    fire and 0 where not; no series at all where its data is missing."""
    out, depth, i = [], 0, 0
    while i < len(expr):
        ch = expr[i]
        if ch == '"':  # a label value: copied as it is
            end = expr.index('"', i + 1)
            while expr[end - 1] == "\\":
                end = expr.index('"', end + 1)
            out.append(expr[i:end + 1])
            i = end + 1
            continue
        depth += (ch in "([{") - (ch in ")]}")
        m = _COMPARISON.match(expr, i) if depth == 0 else None
        if m:
            out.append(f"{m.group(1)} bool ")
            i = m.end()
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def test_measured_rewrites_only_top_level_comparisons_against_numbers():
    assert measured('up{job="nfshunt"} == 0') == 'up{job="nfshunt"} == bool 0'
    assert measured("a / (b > 0) > 0.9") == "a / (b > 0) > bool 0.9"
    assert measured('x{a!="1>2"} >= 3 or sum by (i) (c > time() - 300) > 0') == \
        'x{a!="1>2"} >= bool 3 or sum by (i) (c > time() - 300) > bool 0'


# --- the workload -----------------------------------------------------------------------------

def _ids_api(tb, method, path, body=None, token=TOKEN):
    args = ["curl", "-sS", "-m", "15", "-X", method, "-H", f"Authorization: Bearer {token}",
            "-w", "\n%{http_code}", f"http://127.0.0.1:{API_PORT}{path}"]
    if body is not None:
        args += ["-H", "Content-Type: application/json", "--data-binary", json.dumps(body)]
    text, _, status = tb.run(tb.fw, *args, timeout=20).rstrip("\n").rpartition("\n")
    return int(status), json.loads(text)


def _value(prom, expr: str) -> float:
    series = prom.query(expr)
    return sum(float(s["value"][1]) for s in series) if series else 0.0


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in os.listdir(f"/proc/{parent}/task"):
            try:
                with open(f"/proc/{parent}/task/{task}/children") as fh:
                    kids = [int(k) for k in fh.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _ids_process(tb) -> int | None:
    """The controller's IDS API process (ids/process.py's child)."""
    for pid in _descendants(tb.controller.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if b"nfshunt.ids.process" in fh.read():
                    return pid
        except OSError:
            continue
    return None


def _limit_table(limit: int | None) -> None:
    if limit is None:
        subprocess.run(["ovs-vsctl", "--if-exists", "clear", "Bridge", "s1", "flow_tables"], check=True)
        return
    subprocess.run(["ovs-vsctl", "--", "--id=@ft", "create", "Flow_Table", f"flow_limit={limit}",
                    "overflow_policy=refuse", "--", "set", "Bridge", "s1", "flow_tables:0=@ft"], check=True,
                   capture_output=True)


def _counter(tb, key: str) -> int:
    return tb.control({"cmd": "status", "connections": False})["counters"].get(key, 0)


@pytest.fixture(scope="module")
def workload(tb, prom):
    """What the dashboard shows, made to happen once Prometheus scrapes: {what: measured}."""
    from nfshunt_testbed.traffic import STEADY_RATE
    t0 = time.monotonic()
    seen = {}
    # A shunted transfer: its bytes reach the fast-path counter when its pair is removed (FIN).
    fast0 = _value(prom, 'nfshunt_removed_pair_bytes_total{action="shunt"}')
    result = tb.iperf(SHUNT, 2, cport=45301, bitrate=STEADY_RATE)
    assert "error" not in result, result
    sent = result["end"]["sum_received"]["bytes"]
    seen["fast path bytes"] = tb.wait_for(
        lambda: (v := _value(prom, 'nfshunt_removed_pair_bytes_total{action="shunt"}') - fast0) > 0.9 * sent and v,
        15, "the shunted transfer's bytes in nfshunt_removed_pair_bytes_total")
    # A blocked one stalls in the switch's drop flows.
    assert tb.iperf(BLOCK, 1, cport=45302, grace=3).get("error") == "stalled"
    # An ignored one crosses the firewall: the default flows' bytes (the slow path) grow by it.
    slow0 = _value(prom, 'nfshunt_slow_path_bytes_total{direction="to_firewall"}')
    result = tb.iperf(IGNORE, 1, cport=45303, bitrate=STEADY_RATE)
    assert "error" not in result, result
    sent = result["end"]["sum_received"]["bytes"]
    seen["slow path bytes"] = tb.wait_for(
        lambda: (v := _value(prom, 'nfshunt_slow_path_bytes_total{direction="to_firewall"}') - slow0) > sent and v,
        10, "the ignored transfer's bytes in nfshunt_slow_path_bytes_total")
    # An IDS rule, and a request with a wrong token.
    assert _ids_api(tb, "POST", "/v1/rules", {"id": "dash1", "action": "block", "address": "10.0.0.9/32",
                                              "expire": 120})[0] == 201
    assert _ids_api(tb, "GET", "/v1/rules", token="not-the-token")[0] == 401
    # A shunt the switch refuses (its table full): an OpenFlow error; the transfer goes on
    # through the firewall.
    refused = _counter(tb, "refused:shunt")
    _limit_table(1)
    try:
        result = tb.iperf(SHUNT, 1, cport=45304, bitrate=STEADY_RATE)
        tb.wait_for(lambda: _counter(tb, "refused:shunt") > refused, 10, "the switch to refuse the shunt")
    finally:
        _limit_table(None)
    assert "error" not in result, result
    # The IDS API's process dies: the controller starts it again.
    restarts = _counter(tb, "ids_api_restarts")
    child = tb.wait_for(lambda: _ids_process(tb), 5, "the IDS API process")
    os.kill(child, signal.SIGKILL)
    tb.wait_for(lambda: _counter(tb, "ids_api_restarts") > restarts, 10, "the IDS API process started again")
    # Prometheus has scraped all of it (one more scrape after the last counter moved).
    tb.wait_for(lambda: _value(prom, "nfshunt_ids_api_restarts_total") > restarts, 10, "the last scrape")
    seen["seconds"] = round(time.monotonic() - t0, 1)
    print(f"\nworkload: {seen}")
    return seen


# --- the checks -------------------------------------------------------------------------------

def test_promtool_accepts_the_shipped_rules_and_example_scrape_config(ready):
    for what, path in (("rules", "config/prometheus/nfshunt-alerts.yml"),
                       ("config", "config/prometheus/prometheus-example.yml")):
        proc = subprocess.run(["promtool", "check", what, path], capture_output=True, text=True, cwd=REPO)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    queries, rules = _shipped()
    assert len(queries) >= 20 and len(rules) == 7


def test_every_dashboard_query_returns_data(prom, workload):
    queries, _ = _shipped()
    empty, nan = [], []
    for title, legend, expr in queries:
        series = prom.query(expr)
        if not series:
            empty.append(f"{title} / {legend}: {expr}")
        elif all(math.isnan(float(s["value"][1])) for s in series):
            nan.append(f"{title} / {legend}: {expr}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
    assert not nan, "dashboard queries with only NaN:\n" + "\n".join(nan)


def test_every_alert_expression_returns_data(prom, workload):
    _, rules = _shipped()
    missing = []
    for rule in rules:
        expr = measured(rule["expr"])
        assert " bool " in expr, f"{rule['alert']}: no comparison against a number at the top level"
        if not prom.query(expr):
            missing.append(f"{rule['alert']}: {expr}")
        assert "check first" in rule["annotations"]["summary"], rule["alert"]
    assert not missing, "alert expressions without data:\n" + "\n".join(missing)


def test_the_flow_mod_error_and_ids_restart_alerts_fired_on_their_events(tb, prom, workload):
    firing = tb.wait_for(lambda: (f := prom.firing()) and {"NFShuntFlowModErrors", "NFShuntIdsApiRestarting"} <= set(f)
                         and f, 10, "the flow-mod error and IDS API restart alerts to fire")
    assert not {"NFShuntSwitchDisconnected", "NFShuntNoMasterInPair", "NFShuntControllerDown"} & set(firing), firing
    print(f"\nfiring after the workload: {sorted(firing)}")


def test_switch_and_pair_alerts_fire_while_away_and_clear_on_return(tb, prom, workload):
    """The switch's control link cut (the admin's `ovs-vsctl del-controller`) and the
    pair's only controller stepped down: each alert fires once its `for` has passed, and
    both clear once the switch is back and the controller master again."""
    watched = {"NFShuntSwitchDisconnected", "NFShuntNoMasterInPair"}
    assert not watched & {a["labels"]["alertname"] for a in prom.alerts()}
    targets = subprocess.run(["ovs-vsctl", "get-controller", "s1"], capture_output=True, text=True,
                             check=True).stdout.split()
    assert tb.control({"cmd": "role", "role": "backup"}).get("ok")
    subprocess.run(["ovs-vsctl", "del-controller", "s1"], check=True)
    cut = time.monotonic()
    fired: dict[str, float] = {}
    try:
        def both() -> bool:
            for name in watched & set(prom.firing()):
                fired.setdefault(name, round(time.monotonic() - cut, 1))
            return fired.keys() == watched
        tb.wait_for(both, 40, "the switch-disconnected and no-master alerts to fire", interval=0.25)
    finally:
        subprocess.run(["ovs-vsctl", "set-controller", "s1", *targets], check=True)
    # `for: 10s` / `for: 15s`: not before (a scrape and an evaluation later at most).
    assert fired["NFShuntSwitchDisconnected"] >= 10 and fired["NFShuntNoMasterInPair"] >= 15, fired
    tb.wait_for_controller()
    assert tb.control({"cmd": "role", "role": "master"}).get("ok")
    back = time.monotonic()
    tb.wait_for(lambda: not watched & {a["labels"]["alertname"] for a in prom.alerts()}, 20,
                "both alerts to clear", interval=0.25)
    print(f"\nfired after the cut: {fired}; cleared {time.monotonic() - back:.1f} s after the return")
