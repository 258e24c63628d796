"""Builders shared by the unit tests, and waits and result readers shared by the integration tests."""
import csv
import os
import subprocess
import sys

from nfshunt.config.settings import from_dict
from nfshunt.records import markcodec
from nfshunt.records.model import TCP, ConnEvent, EventKind, FlowTuple

BASE = {
    "ports": [
        {"fast": 1, "slow": 2, "physdevin": 1, "bridge_port": "fw-eth0"},
        {"fast": 3, "slow": 4, "physdevin": 2, "bridge_port": "fw-eth1"},
    ],
    "mark_actions": {"0": "ignore", "1": "shunt", "2": "block"},
}


def config(**overrides):
    raw = dict(BASE)
    raw.update(overrides)
    return from_dict(raw)


def event(action=1, ingress=1, egress=2, proto=TCP, state=3, family=4, ct_id=7, sport=40000,
          dport=5201, kind=EventKind.UPDATE, mark=None, received=100.0, zone=0):
    if family == 4:
        src, dst = "10.0.0.1", "10.0.0.2"
    else:
        src, dst = "fd00::1", "fd00::2"
    orig = FlowTuple(family, proto, src, dst, sport, dport, zone)
    if mark is None:
        mark = markcodec.encode(ingress, egress, action, admin=0x1234)
    return ConnEvent(kind, ct_id, orig, orig.reversed(), mark, state if proto == TCP else None, received)


def wait_listening(tb, node, port):
    """A server in a testbed node has bound its TCP port (iperf3's control connection is TCP
    for UDP tests too): a client started now is not refused."""
    tb.wait_for(lambda: tb.run(node, "ss", "-Hltn", "sport", "=", f":{port}", check=False).strip(), 5,
                f"{node.name} to listen on {port}", interval=0.05)


def show_log_if_failed(tb, request) -> None:
    """After a test on the testbed: the end of the controller's log when the test failed
    (or NFSHUNT_SHOW_LOG is set); the whole log into the folder NFSHUNT_KEEP_LOGS names, if set."""
    rep = getattr(request.node, "rep_call", None)
    failed = rep is not None and rep.failed
    if failed or os.environ.get("NFSHUNT_SHOW_LOG"):
        print(tb.controller_output()[-6000:])
    keep = os.environ.get("NFSHUNT_KEEP_LOGS")
    if failed and keep:
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in request.node.name)
        with open(os.path.join(keep, f"{name}-{os.getpid()}.log"), "w") as fh:
            fh.write(tb.controller_output())


def csv_rows(path):
    """A results CSV's rows (bench/, mininet/experiments.py), as dicts."""
    with open(path) as fh:
        return list(csv.DictReader(fh))


def machine_report(path):
    """A results report's text, checked to name the machine it was measured on."""
    text = open(path).read()
    for field in ("| cores |", "| kernel |", "Open vSwitch", "datapath"):
        assert field in text
    return text


def quick_experiment(tmp_path_factory, experiment):
    """mininet/experiments.py EXPERIMENT --quick into a fresh directory: (the directory, its output)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path_factory.mktemp(experiment)
    proc = subprocess.run([sys.executable, os.path.join(repo, "mininet", "experiments.py"), experiment, "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=900)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0
    return out, proc.stdout


def unbuildable(monkeypatch, name):
    """The switch side cannot build static stream `name`'s flows (a bug past the config's
    checks, as a scoped address once was); the others build as ever."""
    from nfshunt.openflow.flows import FlowBuilder
    build = FlowBuilder.static_add

    def static_add(fb, flow):
        if flow.shunt.name == name:
            raise ValueError("not an address")
        return build(fb, flow)
    monkeypatch.setattr(FlowBuilder, "static_add", static_add)
