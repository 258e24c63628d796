"""The conntrack zone in the connection key (issue 37, slice 1): FlowTuple carries the
entry's zone, zone 0 looks exactly as the 6-field tuple did (its text, its repr and the
stable ids hashed from the repr), and a zoned entry is kept apart and never shunted
while no VLAN names its zone. The kernel side is tests/test_conntrack_zone_netns.py."""
import os

import pytest

os.environ.setdefault("OSKEN_HUB_TYPE", "native")

from nfshunt.app import explain as ex  # noqa: E402
from nfshunt.app.target import parse_target  # noqa: E402
from nfshunt.core import admission as adm  # noqa: E402
from nfshunt.core.static_table import StaticTable  # noqa: E402
from nfshunt.ids.rules import Kind, pair_key, scipass_id  # noqa: E402
from nfshunt.kernel.codec import parse_datagram  # noqa: E402
from nfshunt.records import markcodec  # noqa: E402
from nfshunt.records.model import OFP13, TCP, UDP, Action, FlowTuple  # noqa: E402
from tests.helpers import config, event  # noqa: E402

T = FlowTuple(4, TCP, "10.0.0.2", "10.0.0.1", 5201, 40000)
T6 = FlowTuple(6, UDP, "2001:db8::1", "2001:db8::2", 40000, 34964)


def test_a_tuple_made_with_six_fields_is_in_zone_0_and_looks_as_it_did():
    assert T.zone == 0 and T == FlowTuple(4, TCP, "10.0.0.2", "10.0.0.1", 5201, 40000, 0)
    assert repr(T) == "FlowTuple(family=4, proto=6, src='10.0.0.2', dst='10.0.0.1', sport=5201, dport=40000)"
    assert str(T) == "tcp 10.0.0.2:5201 -> 10.0.0.1:40000"
    assert str(T6) == "udp [2001:db8::1]:40000 -> [2001:db8::2]:34964"


def test_a_zoned_tuple_names_its_zone_and_keeps_it_reversed():
    z = FlowTuple(4, TCP, "10.0.0.2", "10.0.0.1", 5201, 40000, 100)
    assert str(z) == "tcp 10.0.0.2:5201 -> 10.0.0.1:40000 zone 100"
    assert repr(z) == ("FlowTuple(family=4, proto=6, src='10.0.0.2', dst='10.0.0.1', sport=5201, dport=40000, "
                       "zone=100)")
    assert z.reversed() == FlowTuple(4, TCP, "10.0.0.1", "10.0.0.2", 40000, 5201, 100)
    assert z.reversed().reversed() == z and pair_key(z) == pair_key(z.reversed())


def test_the_same_addresses_and_ports_in_two_zones_are_two_keys():
    a, b = T._replace(zone=100), T._replace(zone=200)
    assert len({T, a, b, a.reversed(), b.reversed()}) == 5
    assert pair_key(a) != pair_key(b) and pair_key(a).zone == 100


def test_ids_hashed_from_a_zone_0_tuples_repr_are_mains():
    """The IDS rules' file keeps SciPass rule ids, and a static shunt's operator block is
    installed under a cookie hashed from the tuple's repr: an upgrade must not change
    either. The values are what main (624126c, 6-field FlowTuple) computes."""
    assert scipass_id(Kind.SHUNT, T) == "scipass-shunt-0c74e835463bc7a6"
    assert scipass_id(Kind.BLOCK, T6) == "scipass-block-561e42571c8936f0"
    stream = {"name": "plc-cycle", "protocol": "udp", "src": "10.0.0.1", "dst": "10.0.0.2", "dst_port": 34964,
              "fast_ports": [1, 3]}
    cfg = config(openflow_versions=["1.3"], static_shunts=[stream])
    flows = sorted(StaticTable(cfg, cfg.switches[0]).flows.values(), key=lambda f: f.reply)
    u = FlowTuple(4, UDP, "10.0.0.1", "10.0.0.2", 40000, 34964)
    assert [f.block(u, 100, 3600).cookie for f in flows] == [0x4e06000014cebc6c, 0x4e0600014f0d6d19]


def test_a_zoned_connections_scipass_id_is_its_own():
    assert scipass_id(Kind.SHUNT, T._replace(zone=100)) != scipass_id(Kind.SHUNT, T)


@pytest.mark.parametrize("zone", [1, 100, 65535])
def test_a_zoned_tuples_str_and_repr_differ_from_zone_0s(zone):
    z = T._replace(zone=zone)
    assert str(z) == f"{T} zone {zone}" and repr(z) == f"{repr(T)[:-1]}, zone={zone})"


# --- admission: no VLAN names a zone yet, so a zoned entry stays on the firewall ------------

def _connected():
    from nfshunt.core import core as c
    core = c.Core(config())
    core.switch_connected(OFP13)
    core.reconcile([], 0.0)
    return core


def _zoned_message(zone, action):
    """The ctnetlink event of a decided entry (ports 1 -> 2) in conntrack zone `zone`, as
    the kernel sends it: an admin's own `-j CT --zone` rule put it there."""
    import socket

    from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple, nfct_msg
    t = dict(family=socket.AF_INET, proto=TCP, saddr="10.0.0.1", daddr="10.0.0.2")
    m = nfct_msg.create_from(tuple_orig=NFCTAttrTuple(sport=40000, dport=5201, **t),
                             tuple_reply=NFCTAttrTuple(sport=5201, dport=40000, **{**t, "saddr": "10.0.0.2",
                                                                                     "daddr": "10.0.0.1"}),
                             id=7, mark=markcodec.encode(1, 2, action), zone=zone,
                             protoinfo={"attrs": [["CTA_PROTOINFO_TCP", {"attrs": [["CTA_PROTOINFO_TCP_STATE", 3]]}]]})
    m["header"]["type"] = 1 << 8
    m["nfgen_family"] = socket.AF_INET
    m.encode()
    return bytes(m.data)


@pytest.mark.parametrize("action", [1, 2])  # shunt, block
def test_a_zoned_entry_heard_from_the_kernel_is_ignored_not_installed_untagged(action):
    """Before: the zone was dropped by the parser, and the entry was shunted (or blocked)
    with untagged flows, its take-down's delete then sent for zone 0's entry (ENOENT)."""
    core = _connected()
    (ev,) = parse_datagram(_zoned_message(100, action), 1.0, lambda what: pytest.fail(what))
    out = core.conntrack_event(ev)
    assert [(type(x).__name__, x.reason) for x in out] == [("Ignored", "vlan: zone not configured on its port groups")]
    assert not core.by_key and not core.waiting
    (untagged,) = parse_datagram(_zoned_message(0, action), 1.0, lambda what: pytest.fail(what))
    assert [type(x).__name__ for x in core.conntrack_event(untagged)] == ["InstallFlows"]


def test_a_zoned_event_is_ignored_whatever_an_operator_pinned_and_its_untagged_twin_is_not():
    core = _connected()
    zoned = event(zone=100)
    core.pin(zoned.orig, Action.BLOCK, 0.0)
    (cmd,) = core.conntrack_event(zoned)
    assert cmd.reason == adm.R_VLAN and not core.by_key
    assert core.dry_run(event(zone=7)).reason == adm.R_VLAN
    assert [type(x).__name__ for x in core.conntrack_event(event(ct_id=8))] == ["InstallFlows"]
    assert adm.R_VLAN in ex.REASONS


# --- text forms: operator commands, explain targets, the pins file ---------------------------

@pytest.mark.parametrize("text,zone", [
    ("tcp 10.0.0.1:40000 -> 10.0.0.2:5201 zone 100", 100),
    ("udp [fd00::1]:1 -> [fd00::2]:2  zone  65535 ", 65535),
    ("tcp 10.0.0.1:40000 -> 10.0.0.2:5201 zone 0", 0),
    ("tcp 10.0.0.1:40000 -> 10.0.0.2:5201", 0),
])
def test_a_tuples_text_names_its_zone_and_reads_back(text, zone):
    from nfshunt.app.control import parse_tuple
    t = parse_tuple(text)
    assert t.zone == zone and parse_tuple(str(t)) == t
    assert parse_target(text).tuple == t


@pytest.mark.parametrize("text,problem", [
    ("tcp 10.0.0.1:1 -> 10.0.0.2:2 zone 65536", "zone '65536': a conntrack zone must be 0-65535"),
    ("tcp 10.0.0.1:1 -> 10.0.0.2:2 zone 0100000", "zone '0100000': a conntrack zone must be 0-65535"),
    ("tcp 10.0.0.1:1 -> 10.0.0.2:2 zone -1", "zone '-1': a conntrack zone must be 0-65535"),
    ("tcp 10.0.0.1:1 -> 10.0.0.2:2 zone vlan100", "zone 'vlan100': a conntrack zone must be 0-65535"),
    ("tcp 10.0.0.1:1 -> 10.0.0.2:2 zone \u0661", "a conntrack zone must be 0-65535"),  # an Arabic-Indic 1
    ("tcp 10.0.0.1:1 -> 10.0.0.2:2 zone", "not a tuple"),
])
def test_a_bad_zone_is_refused_with_its_reason(text, problem):
    from nfshunt.app.control import parse_tuple
    with pytest.raises(ValueError, match=problem):
        parse_tuple(text)
    with pytest.raises(ValueError, match=problem):
        parse_target(text)


def test_the_pins_file_keeps_a_pins_zone_and_reads_an_old_file_as_zone_0(tmp_path):
    import json

    from nfshunt.app import pin_file
    from nfshunt.core.pins import Pin
    t = FlowTuple(4, TCP, "10.0.0.1", "10.0.0.2", 40000, 5201)
    path = str(tmp_path / pin_file.FILE)
    pins = [(t._replace(zone=100), Pin(Action.BLOCK, 600.0)), (t, Pin(Action.IGNORE, 600.0)),
            (t._replace(zone=200), Pin(Action.IGNORE, 600.0))]
    pin_file.save(path, pins, 1000.0, 0.0)
    kept = {k.orig: k.action for k in pin_file.load(path, 1000.0)}
    assert kept == {t._replace(zone=100): Action.BLOCK, t: Action.IGNORE, t._replace(zone=200): Action.IGNORE}
    with open(path) as fh:
        assert [row["tuple"] for row in json.load(fh)["pins"]] == [
            "tcp 10.0.0.1:40000 -> 10.0.0.2:5201 zone 100", "tcp 10.0.0.1:40000 -> 10.0.0.2:5201",
            "tcp 10.0.0.1:40000 -> 10.0.0.2:5201 zone 200"]
    with open(path, "w") as fh:  # as main wrote it
        json.dump({"version": 1, "pins": [{"tuple": str(t), "action": "block", "expires": 1600.0}]}, fh)
    (old,) = pin_file.load(path, 1000.0)
    assert old.orig == t and old.orig.zone == 0 and old.action is Action.BLOCK
