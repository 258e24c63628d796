"""`nfshunt probe-switch`'s flow shapes against the fake switch (the testbed's run is
tests/test_probe.py): the VLAN trunks' shapes (issue 37, design section 5.4) are installed,
read back exactly and removed, and a switch that refuses one makes the recommendation say
VLAN shunts are not supported."""
from __future__ import annotations

import os
import threading
from types import SimpleNamespace
from typing import Any

import pytest

os.environ.setdefault("OSKEN_HUB_TYPE", "native")

from nfshunt import probe  # noqa: E402
from nfshunt.records.model import OFP10, OFP13  # noqa: E402
from tests.helpers import config  # noqa: E402
from tests.support import fakeswitch as fs  # noqa: E402


class _Dp:
    """The fake switch as the probe's datapath: what it answers goes straight to the app's
    queues (the probe waits on them), errors to its errors, as os-ken's handlers put them."""

    def __init__(self, switch: fs.FakeSwitch, app: Any):
        self.switch, self.app = switch, app
        self.ofproto, self.ofproto_parser = switch.ofproto, switch.ofproto_parser
        self.set_xid = switch.set_xid

    def send_msg(self, msg: Any) -> None:
        msg.serialize()
        self.send(bytes(msg.buf))

    def send(self, buf: bytes) -> None:
        self.switch.send(buf)
        for reply in self.switch.take_replies():
            if reply.msg_type == self.ofproto.OFPT_ERROR:
                self.app.errors[reply.xid] = reply
            else:
                self.app._answer(reply)


def _prober(version: int = OFP13, refuse: Any = None) -> tuple[probe.Prober, fs.FakeSwitch]:
    cfg = config(openflow_versions=["1.0" if version == OFP10 else "1.3"])
    app = SimpleNamespace(replies={}, errors={}, lock=threading.Lock())
    app._answer = lambda msg: probe.ProbeApp._answer(app, msg)
    switch = fs.FakeSwitch(version)
    switch.refuse_flow = refuse
    return probe.Prober(app, _Dp(switch, app), cfg, cfg.switches[0]), switch


def _shapes(version: int = OFP13, refuse: Any = None) -> tuple[probe.Report, dict[str, bool], fs.FakeSwitch]:
    prober, switch = _prober(version, refuse)
    report = probe.Report()
    shapes = prober.shapes(report)
    probe.recommend(report, prober.switch, version == OFP13, 1000, shapes, None, [])
    return report, shapes, switch


def test_each_vlan_shape_is_installed_read_back_exactly_and_removed(capsys):
    report, shapes, switch = _shapes()
    for name in (probe.SHAPE_VLAN, probe.SHAPE_VLAN_XLATE, probe.SHAPE_VLAN_PUSH, probe.SHAPE_VLAN_PCP):
        assert shapes[name] and f"  ok   {name}" in report.lines, name
    assert "VLAN shunts: supported (match, retag, push/pop, priority)" in report.lines
    assert switch.entries == [] and report.ok


def test_openflow_1_0_probes_a_plain_vlan_match():
    report, shapes, switch = _shapes(OFP10)
    assert shapes[probe.SHAPE_VLAN10] and probe.SHAPE_VLAN_XLATE not in shapes
    assert "VLAN shunts: supported (match, retag, push/pop)" in report.lines
    assert switch.entries == []


@pytest.mark.parametrize("refused, shape", [
    (lambda e: any(op[0] == "vid" for op in e.ops), probe.SHAPE_VLAN_XLATE),
    (lambda e: any(op[0] == "push" for op in e.ops), probe.SHAPE_VLAN_PUSH),
    (lambda e: "vlan_pcp" in e.match, probe.SHAPE_VLAN_PCP),
])
def test_a_refused_vlan_shape_says_vlan_shunts_are_not_supported_and_the_rest_stands(refused, shape):
    report, shapes, switch = _shapes(refuse=refused)
    assert not shapes[shape] and any(line.startswith(f"  no   {shape}: refused") for line in report.lines)
    (line,) = [line for line in report.lines if line.startswith("VLAN shunts:")]
    assert line.startswith("VLAN shunts: not supported by this switch (") and shape in line
    assert shapes[probe.SHAPE_TCP] and report.ok  # optional: the untagged shunts stand
    assert switch.entries == []


def test_a_switch_that_reads_a_tag_back_changed_fails_the_shape():
    """A switch that accepts the VLAN pair but keeps it without its tag match (a switch
    that drops a field it cannot hold): the read back is not the pair sent."""
    prober, switch = _prober()
    real = switch.entry

    def untagging(msg: Any, buf: bytes) -> Any:
        e = real(msg, buf)
        vid = e.match.get("vlan_vid")
        if vid is not None and vid[0] == 0x1000 | 100 and "tp_src" in e.match:
            del e.match["vlan_vid"]
            msg.match = type(msg.match)(**{k: v for k, v in msg.match.items() if k != "vlan_vid"})
            msg.serialize()
            e.raw = bytes(msg.buf)[48:]
        return e
    switch.entry = untagging
    report = probe.Report()
    shapes = probe.vlan_shapes(prober, report)
    assert not shapes[probe.SHAPE_VLAN] and "read back changed" in "\n".join(report.lines)
    assert shapes[probe.SHAPE_VLAN_XLATE]
