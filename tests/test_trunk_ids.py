"""IDS rules on VLAN trunks (issue 37, design slice 6): a connection rule may name the
connection's `vlan` (1-4094: the controller resolves it to the zone its trunks bridge it
in) or its conntrack `zone` (0-65535), not both; a VLAN no group carries, or one carried in
two zones, is refused saying what to give; a rule naming neither on a controller that
serves no untagged frames is refused. An untagged rule is what it was."""
from __future__ import annotations

import dataclasses
import os

import pytest

os.environ.setdefault("OSKEN_HUB_TYPE", "native")

from nfshunt.config.ids import IdsConfig  # noqa: E402
from nfshunt.ids.backend import zoned_rule  # noqa: E402
from nfshunt.ids.calls import Reject, Result  # noqa: E402
from nfshunt.ids.rules import RuleError, parse  # noqa: E402
from nfshunt.ids.store import from_json  # noqa: E402
from nfshunt.records.model import OFP13, TCP, Action, FlowTuple  # noqa: E402
from tests.helpers import config, event  # noqa: E402
from tests.support.rig import FAST_A, FAST_B, Rig  # noqa: E402
from tests.test_ids_backend import rule as ids_rule  # noqa: E402
from tests.test_ids_backend import setup as ids_setup  # noqa: E402

CFG = IdsConfig(token_file="/unused")
NOW = 1_700_000_000.0
CONN = {"protocol": "tcp", "src": "10.0.0.1", "sport": 40000, "dst": "10.0.0.2", "dport": 5201}
TRUNKS = [
    {"fast": 1, "slow": 2, "physdevin": 1, "vlans": [100, 200, 30]},
    {"fast": 3, "slow": 4, "physdevin": 2, "vlans": [100, 200, {"id": 301, "zone": 30}]},
]


def rule(**conn):
    return parse({"id": "7", "action": "shunt", "connection": {**CONN, **conn}, "expire": 60}, "ids:zeek", NOW, CFG)


def trunks(ports=TRUNKS):
    return config(ports=ports, openflow_versions=["1.3"])


def test_a_rule_names_a_vlan_or_a_zone_and_its_json_keeps_them():
    by_vlan, by_zone = rule(vlan=301), rule(zone=30)
    assert (by_vlan.vlan, by_vlan.connection.zone) == (301, 0)  # resolved by the controller, not here
    assert by_zone.vlan is None and by_zone.connection == FlowTuple(4, TCP, "10.0.0.1", "10.0.0.2", 40000, 5201, 30)
    assert by_zone.target != rule().target  # another zone: another connection, another rule
    assert by_zone.to_json()["connection"]["zone"] == 30 and "zone" not in rule().to_json()["connection"]
    for r in (by_vlan, by_zone, rule()):
        again = from_json(r.to_json())
        assert (again.connection, again.vlan) == (r.connection, r.vlan)
    assert rule().to_json() == {**rule().to_json(), "connection": {**CONN}}  # untagged: as before


@pytest.mark.parametrize("conn, field, problem", [
    ({"vlan": 301, "zone": 30}, "connection.zone", "give the connection's vlan or its zone, not both"),
    ({"vlan": 4095}, "connection.vlan", "outside 1-4094"),
    ({"vlan": 0}, "connection.vlan", "outside 1-4094"),
    ({"zone": 65536}, "connection.zone", "outside 0-65535"),
    ({"vlan": "30"}, "connection.vlan", "expected an integer"),
])
def test_a_bad_vlan_or_zone_is_refused_naming_the_field(conn, field, problem):
    with pytest.raises(RuleError) as info:
        rule(**conn)
    assert info.value.field == field and problem in info.value.problem


def test_the_controller_resolves_a_vlan_to_its_zone_or_says_what_to_give():
    cfg = trunks()
    resolved, problem = zoned_rule(rule(vlan=301), cfg)
    assert problem is None and resolved.connection.zone == 30 and resolved.vlan == 301
    _, problem = zoned_rule(rule(vlan=999), cfg)
    assert problem == "connection.vlan: VLAN 999 is carried by no port group: give a VLAN of the config's \"vlans\""
    _, problem = zoned_rule(rule(), cfg)
    assert problem.startswith("connection: this controller serves VLANs only") and "name the connection's vlan" \
        in problem
    assert zoned_rule(rule(zone=200), cfg) == (rule(zone=200), None)
    two = trunks([{**TRUNKS[0], "vlans": [100]}, {**TRUNKS[1], "vlans": [{"id": 100, "zone": 7}]}])
    _, problem = zoned_rule(rule(vlan=100), two)
    assert problem == "connection.vlan: VLAN 100 is zone 7 on ports[1] and zone 100 on ports[0]: name the zone"


def test_an_untagged_rule_on_an_untagged_controller_is_as_before():
    assert zoned_rule(rule(), config()) == (rule(), None)


def test_an_ids_shunt_named_by_vlan_shunts_that_vlans_connection_only():
    """On the rig: the rule names VLAN 301 (b's side of zone 30); the zone-30 entry of the
    tuple is shunted, the same tuple's untagged-zone twin is not touched; a VLAN no group
    carries is a 400."""
    rig = Rig(OFP13, ports=TRUNKS, openflow_versions=["1.3"])
    rig, backend, entries, _ = ids_setup(rig=rig)
    z30 = event(action=0, zone=30)
    entries[z30.orig] = z30  # accepted, left to the firewall by the policy
    out = backend.submit(dataclasses.replace(ids_rule(rig), vlan=301), 1.0)
    assert (out.result, out.pending) == (Result.ADDED, None)
    conn = rig.core.find(tuple_=z30.orig)
    assert conn.action is Action.SHUNT and conn.orig.zone == 30 and rig.core.find(tuple_=z30.orig._replace(zone=100)) \
        is None
    there = rig.packet(FAST_A, conn.orig, vlan=30)
    assert (there.outputs, there.tags) == ((FAST_B,), (301,))
    bad = backend.submit(dataclasses.replace(ids_rule(rig, rule_id="2"), vlan=999), 1.0)
    assert (bad.result, bad.error) == (Result.ERROR, Reject.INVALID) and "VLAN 999 is carried by no port group" in \
        bad.reason
