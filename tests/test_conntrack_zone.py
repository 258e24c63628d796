"""The conntrack zone in the connection key (issue 37, slice 1): FlowTuple carries the
entry's zone, zone 0 looks exactly as the 6-field tuple did (its text, its repr and the
stable ids hashed from the repr), and a zoned entry is kept apart and never shunted
while no VLAN names its zone. The kernel side is tests/test_conntrack_zone_netns.py."""
import os

import pytest

os.environ.setdefault("OSKEN_HUB_TYPE", "native")

from nfshunt.core.static_table import StaticTable  # noqa: E402
from nfshunt.ids.rules import Kind, pair_key, scipass_id  # noqa: E402
from nfshunt.records.model import TCP, UDP, FlowTuple  # noqa: E402
from tests.helpers import config  # noqa: E402

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
