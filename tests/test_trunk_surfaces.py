"""What an operator sees of VLAN trunks (issue 37, design slice 6): audit and accounting
lines name a VLAN connection's zone and each side's tag (an untagged one's line is what it
was), and the frames a trunk drops (tags no group carries) are counted in `status` and in
the metric nfshunt_vlan_dropped_packets, by port."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("OSKEN_HUB_TYPE", "native")

from prometheus_client import generate_latest  # noqa: E402

from nfshunt import cli  # noqa: E402
from nfshunt.app import operator_api  # noqa: E402
from nfshunt.app.explain import entry_json  # noqa: E402
from nfshunt.app.operator_api import _ID_ZONED, gauges  # noqa: E402
from nfshunt.core.connection import FlowCount  # noqa: E402
from nfshunt.observe import flowrecords  # noqa: E402
from nfshunt.observe.accounting import audit_record, conn_fields  # noqa: E402
from nfshunt.observe.metrics import Metrics  # noqa: E402
from nfshunt.records.model import OFP13, UDP, EntryCounts, FlowTuple  # noqa: E402
from tests.helpers import config, event  # noqa: E402
from tests.support.rig import FAST_A, FAST_B, Rig  # noqa: E402

TRUNKS = [
    {"fast": 1, "slow": 2, "physdevin": 1, "bridge_port": "fw-eth0", "vlans": [100, 200, 30]},
    {"fast": 3, "slow": 4, "physdevin": 2, "bridge_port": "fw-eth1",
     "vlans": [100, 200, {"id": 301, "zone": 30}]},
]
UNTAGGED_KEYS = ["event", "action", "ct_id", "proto", "src", "dst", "sport", "dport", "ingress", "egress"]


def vlan_rig() -> Rig:
    return Rig(OFP13, ports=TRUNKS, openflow_versions=["1.3"])


def test_audit_fields_name_the_zone_and_each_sides_tag_and_an_untagged_line_is_as_before():
    rig = vlan_rig()
    translated = rig.event(zone=30, proto=UDP)
    fields = conn_fields(translated, "installed")
    assert (fields["zone"], fields["vlan_in"], fields["vlan_out"]) == (30, 30, 301)
    assert list(fields)[:len(UNTAGGED_KEYS)] == UNTAGGED_KEYS
    untagged = Rig(OFP13).event()
    assert list(conn_fields(untagged, "installed")) == UNTAGGED_KEYS
    assert "zone" not in audit_record(untagged, "flush") and audit_record(translated, "flush")["vlan_out"] == 301


def test_the_accounting_record_has_the_zone_and_the_tags_ingress_then_egress():
    rig = vlan_rig()
    conn = rig.event(zone=30, ingress=2, egress=1, proto=UDP)  # from the 301 side
    conn.stats = {False: FlowCount(1, 100, 1.0), True: FlowCount(1, 100, 1.0)}
    rec = flowrecords.record(conn, config(), "flush", None, 1000.0, 100.0)
    assert (rec["zone"], rec["vlan"]) == (30, [301, 30])
    plain = Rig(OFP13).event()
    rec = flowrecords.record(plain, config(), "flush", None, 1000.0, 100.0)
    assert (rec["zone"], rec["vlan"]) == (0, None)


def test_frames_of_tags_no_group_carries_are_counted_in_status_and_the_metric_by_port():
    rig = vlan_rig()
    t = FlowTuple(4, UDP, "10.0.0.1", "10.0.0.2", 40000, 53)
    for vid in (999, 0, 4095):
        assert rig.packet(FAST_A, t, vlan=vid).dropped
    assert rig.packet(FAST_B, t, vlan=7).dropped
    rig.advance(1.5)  # a tick reads the drops' counters
    (sw,) = rig.control({"cmd": "status", "connections": False})["switches"]
    assert sw["vlan_dropped_packets"] == {"1": 3, "2": 0, "3": 1, "4": 0}
    text = generate_latest(Metrics(lambda: gauges([rig.sw])).registry).decode()
    assert f'nfshunt_vlan_dropped_packets_total{{datapath_id="{rig.sw.name}",port="1"}} 3.0' in text
    assert f'nfshunt_vlan_dropped_packets_total{{datapath_id="{rig.sw.name}",port="3"}} 1.0' in text


def test_an_untagged_switch_reads_no_drops_and_shows_none():
    rig = Rig(OFP13)
    rig.advance(1.5)
    (sw,) = rig.control({"cmd": "status", "connections": False})["switches"]
    assert "vlan_dropped_packets" not in sw and rig.sw.vlan_drops_reading is None
    assert "nfshunt_vlan_dropped" not in generate_latest(Metrics(lambda: gauges([rig.sw])).registry).decode()


def test_an_operators_block_names_the_vlan_and_pins_its_zone_only():
    rig = vlan_rig()
    text = "udp 10.0.0.1:40000 -> 10.0.0.2:53"
    reply = rig.control({"cmd": "block", "tuple": text, "vlan": 301})  # 301 is zone 30 (b's side)
    assert reply["tuple"] == f"{text} zone 30"
    assert rig.control({"cmd": "unshunt", "tuple": text, "zone": 200})["tuple"] == f"{text} zone 200"
    pinned = {t.zone for t in rig.core.pins}
    assert pinned == {30, 200}
    # The same tuple in zone 100 is another connection: not held by either pin.
    assert rig.event(zone=100, proto=UDP, sport=40000, dport=53) is not None


def test_a_vlan_no_group_carries_or_carries_in_two_zones_is_refused_saying_what_to_give():
    rig = vlan_rig()
    text = "udp 10.0.0.1:40000 -> 10.0.0.2:53"
    assert rig.control({"cmd": "block", "tuple": text, "vlan": 999})["error"] == \
        "VLAN 999 is carried by no port group: give a VLAN of the config's \"vlans\""
    assert "give 'vlan' or 'zone', not both" in rig.control({"cmd": "block", "tuple": text, "vlan": 30, "zone": 30})[
        "error"]
    assert "names its connection's zone already" in rig.control({"cmd": "block", "ct_id": 7, "vlan": 30})["error"]
    assert "names zone 100, the request 30" in rig.control({"cmd": "block", "tuple": f"{text} zone 100",
                                                            "vlan": 30})["error"]
    assert not rig.core.pins
    two = config(ports=[{**TRUNKS[0], "vlans": [100]}, {**TRUNKS[1], "vlans": [{"id": 100, "zone": 7}]}],
                 openflow_versions=["1.3"])
    with pytest.raises(ValueError, match=r"^VLAN 100 is zone 7 on ports\[1\] and zone 100 on ports\[0\]: name the "
                                         r"zone$"):
        two.zone_of_vlan(100)


def test_on_trunks_without_untagged_frames_a_tuple_without_its_vlan_is_refused_and_nothing_pinned():
    # Pinned in zone 0, which no group carries, the block held nothing: the VLAN's shunt
    # forwarded on, and the answer said the tuple was blocked.
    rig = vlan_rig()
    conn = rig.event(zone=100)
    text = str(conn.orig._replace(zone=0))
    for cmd in ("block", "unshunt"):
        for req in ({"tuple": text}, {"tuple": text, "zone": 0}):
            assert "serves VLANs only" in rig.control({"cmd": cmd, **req})["error"]
    assert not rig.core.pins and rig.core.conns.holds(conn)
    assert rig.control({"cmd": "block", "tuple": text, "vlan": 100})["tuple"] == f"{text} zone 100"
    rig.kernel_answers()
    assert not rig.core.conns.holds(conn)  # the VLAN's pair, taken down
    assert "error" not in Rig(OFP13).control({"cmd": "block", "tuple": text})  # untagged: zone 0 is served


def test_explain_takes_the_vlan_of_a_tuple(monkeypatch):
    rig = vlan_rig()
    conn = rig.event(zone=30, proto=UDP)
    ops = rig.app.operator
    seen = []
    monkeypatch.setattr(operator_api, "gather", lambda target: seen.append(target.tuple) or target)
    stop = {"error": "stop"}  # (the event loop's part is not this test's)
    assert ops.off_loop({"cmd": "explain", "target": "7", "vlan": 30}, lambda *_: stop) == \
        {"error": _ID_ZONED, "bad_input": True}
    ops.off_loop({"cmd": "explain", "target": "udp 10.0.0.1:40000 -> 10.0.0.2:5201", "vlan": 30}, lambda *_: stop)
    ops.off_loop({"cmd": "explain", "target": "udp 10.0.0.1:40000 -> 10.0.0.2:5201", "zone": 30}, lambda *_: stop)
    ops.off_loop({"cmd": "explain", "target": "udp 10.0.0.1:40000 -> 10.0.0.2:5201 zone 30"}, lambda *_: stop)
    assert seen == [conn.orig] * 3


def test_the_cli_sends_vlan_and_zone_with_the_tuple(monkeypatch):
    sent = []
    monkeypatch.setattr(cli, "_ask", lambda _args, payload: sent.append(payload) or {"tuple": "t"})
    for argv in (["block", "--vlan", "301", "udp 10.0.0.1:1 -> 10.0.0.2:2"],
                 ["unshunt", "--zone", "30", "udp 10.0.0.1:1 -> 10.0.0.2:2"],
                 ["block", "udp 10.0.0.1:1 -> 10.0.0.2:2"]):
        args = cli.build_parser().parse_args(argv)
        assert args.func(args) == 0
    assert sent == [{"cmd": "block", "tuple": "udp 10.0.0.1:1 -> 10.0.0.2:2", "vlan": 301},
                    {"cmd": "unshunt", "tuple": "udp 10.0.0.1:1 -> 10.0.0.2:2", "zone": 30},
                    {"cmd": "block", "tuple": "udp 10.0.0.1:1 -> 10.0.0.2:2"}]
    assert cli.build_parser().parse_args(["explain", "--vlan", "30", "7"]).vlan == 30


def test_explains_entry_view_names_each_sides_tag_of_a_zoned_entry():
    cfg = config(ports=TRUNKS, openflow_versions=["1.3"])
    ev = event(zone=30, ingress=2, egress=1)  # from the 301 side
    assert entry_json(ev, EntryCounts(zone=30), cfg)["vlan"] == [301, 30]
    assert entry_json(event(zone=7), EntryCounts(zone=7), cfg)["vlan"] == [None, None]  # carried by neither
    assert entry_json(event(), EntryCounts(), config())["vlan"] is None  # untagged: as before
