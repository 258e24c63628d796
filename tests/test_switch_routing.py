"""Which switch's core a conntrack event goes to (switch.Router), from its mark's port groups."""
from nfshunt.config.settings import from_dict
from nfshunt.core import commands as cm
from nfshunt.core import core as c
from nfshunt.records import markcodec
from nfshunt.records.model import EventKind
from nfshunt.switch.switch import R_CROSSES_SWITCHES, Router
from tests.helpers import BASE, config, event

TWO = from_dict({"mark_actions": BASE["mark_actions"], "switches": [
    {"datapath_id": "a1", "ports": BASE["ports"]},
    {"datapath_id": "a2", "ports": [{"fast": 1, "slow": 2, "physdevin": 3}, {"fast": 3, "slow": 4, "physdevin": 4}]}]})


def test_a_connection_goes_to_the_switch_whose_groups_it_crossed():
    router = Router(TWO)
    assert router.route(event(ingress=1, egress=2)) == 0
    assert router.route(event(ingress=4, egress=3)) == 1


def test_a_connection_across_two_switches_stays_on_the_firewall_with_its_reason():
    out = Router(TWO).route(event(ingress=2, egress=3))
    assert isinstance(out, cm.Ignored) and out.reason == R_CROSSES_SWITCHES
    # Its end goes to the ingress switch's core, which has nothing of it to clean up.
    assert Router(TWO).route(event(ingress=2, egress=3, kind=EventKind.DESTROY)) == 0


def test_events_without_both_ports_go_where_a_core_can_say_why_they_are_ignored():
    router = Router(TWO)
    only_in = event(mark=markcodec.encode(ingress=3))  # egress not recorded yet
    assert router.route(only_in) == 1
    assert router.route(event(mark=0)) == 0
    assert router.route(event(ingress=9, egress=10)) == 0  # not a configured group: the core counts it


def test_the_routed_core_shunts_and_the_other_never_sees_the_connection():
    router = Router(TWO)
    cores = [c.Core(TWO, sw) for sw in TWO.switches]
    for core in cores:
        core.switch_connected(c.OFP13)
        core.reconcile([], 0.0)
    ev = event(ingress=3, egress=4, ct_id=11)
    out = cores[router.route(ev)].conntrack_event(ev)
    install = [cmd for cmd in out if isinstance(cmd, cm.InstallFlows)]
    assert len(install) == 1 and install[0].conn.ingress.physdevin == 3 and install[0].conn.egress.fast == 3
    assert len(cores[1].by_key) == 1 and not cores[0].by_key


def test_one_switch_takes_everything_as_before():
    assert Router(config()).route(event(ingress=2, egress=3)) == 0
