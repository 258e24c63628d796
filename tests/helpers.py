"""Builders shared by the unit tests, and waits shared by the integration tests."""
from nfshunt import markcodec
from nfshunt.config import from_dict
from nfshunt.model import TCP, ConnEvent, EventKind, FlowTuple

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
          dport=5201, kind=EventKind.UPDATE, mark=None, received=100.0):
    if family == 4:
        src, dst = "10.0.0.1", "10.0.0.2"
    else:
        src, dst = "fd00::1", "fd00::2"
    orig = FlowTuple(family, proto, src, dst, sport, dport)
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
    import os
    rep = getattr(request.node, "rep_call", None)
    failed = rep is not None and rep.failed
    if failed or os.environ.get("NFSHUNT_SHOW_LOG"):
        print(tb.controller_output()[-6000:])
    keep = os.environ.get("NFSHUNT_KEEP_LOGS")
    if failed and keep:
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in request.node.name)
        with open(os.path.join(keep, f"{name}-{os.getpid()}.log"), "w") as fh:
            fh.write(tb.controller_output())
