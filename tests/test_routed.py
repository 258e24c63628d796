"""A routing firewall (forwarding "routed", docs/design/routed.md slice 1): its config keys,
its iptables plumbing (interfaces by -i/-o, no physdev), and the controller leaving each of its
connections on the firewall, counted, until routed shunts (MAC and TTL rewrite) exist."""
import os

import pytest

from nfshunt import iptables, routed_checks
from nfshunt.config.settings import ConfigError, from_dict
from nfshunt.core import admission as adm
from nfshunt.core import core as c
from nfshunt.core.commands import InstallFlows, ResolveHops
from nfshunt.kernel import routes
from nfshunt.records.model import OFP13, NextHop
from tests.helpers import BASE, config, event

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
ROUTED_PORTS = [{"fast": 1, "slow": 2, "physdevin": 1, "interface": "fw-eth0"},
                {"fast": 3, "slow": 4, "physdevin": 2, "interface": "fw-eth1"}]


def routed(**overrides):
    return config(**{"forwarding": "routed", "ports": ROUTED_PORTS, "openflow_versions": ["1.3"], **overrides})


def test_a_routed_config_reads_its_interfaces_and_a_bridged_one_is_unchanged():
    cfg = routed()
    assert cfg.switches[0].forwarding == "routed" and routed_checks.routed(cfg)
    assert routed_checks.interfaces(cfg) == [(1, "fw-eth0"), (2, "fw-eth1")]
    assert [g.interface for g in cfg.switches[0].ports] == ["fw-eth0", "fw-eth1"]
    plain = config()
    assert plain.switches[0].forwarding == "bridged" and not routed_checks.routed(plain)
    assert [g.interface for g in plain.switches[0].ports] == [None, None]


def _two(first, second):
    entry = {"ports": [{"fast": 1, "slow": 2, "physdevin": 1, "interface": "fw-eth0"},
                       {"fast": 3, "slow": 4, "physdevin": 2, "interface": "fw-eth1"}]}
    other = {"ports": [{"fast": 1, "slow": 2, "physdevin": 3, "bridge_port": "fw-eth2"},
                       {"fast": 3, "slow": 4, "physdevin": 4, "bridge_port": "fw-eth3"}]}
    return {"mark_actions": BASE["mark_actions"], "openflow_versions": ["1.3"],
            "switches": [{"datapath_id": "a1", "forwarding": first, **entry},
                         {"datapath_id": "a2", "forwarding": second, **other}]}


@pytest.mark.parametrize("raw,key,words", [
    ({**BASE, "forwarding": "routed", "openflow_versions": ["1.3"]}, "ports[0].bridge_port",
     "a routing firewall has no bridge"),
    ({**BASE, "ports": ROUTED_PORTS}, "ports[0].interface", "forwarding is bridged"),
    ({**BASE, "forwarding": "routed", "ports": ROUTED_PORTS, "openflow_versions": ["1.0", "1.3"]},
     "forwarding", "routed needs OpenFlow 1.3"),
    ({**BASE, "forwarding": "switched"}, "forwarding", "bridged"),
    ({**BASE, "forwarding": "routed", "openflow_versions": ["1.3"],
      "ports": [{**ROUTED_PORTS[0], "bridge_port": "fw-eth0"}, ROUTED_PORTS[1]]}, "ports[0].interface", "not both"),
    ({**BASE, "forwarding": "routed", "openflow_versions": ["1.3"],
      "ports": [ROUTED_PORTS[0], {**ROUTED_PORTS[1], "interface": "fw-eth0"}]}, "ports[1].interface",
     "already used by ports[0]"),
    (_two("routed", "bridged"), "switches[1].forwarding", "one firewall routes or bridges for all its switches"),
])
def test_a_routed_config_that_cannot_work_is_refused_with_the_key_and_what_to_do(raw, key, words):
    with pytest.raises(ConfigError) as err:
        from_dict(raw)
    assert err.value.key == key and words in str(err.value)


def test_the_routed_plumbing_names_the_interfaces_and_matches_golden():
    policy = iptables.read_policy(os.path.join(os.path.dirname(GOLDEN), "..", "iptables", "policy-example.rules"))
    text = iptables.render(routed(), policy)
    path = os.path.join(GOLDEN, "routed-two-port.rules")
    if os.environ.get("NFSHUNT_UPDATE_GOLDEN") == "1":
        with open(path, "w") as fh:
            fh.write(text)
    with open(path) as fh:
        assert text == fh.read()
    assert "physdev" not in text  # no bridge: a routed packet would RETURN at the physdev checks
    assert "-A NFSHUNT_PRE_PD_IN -i fw-eth0 -j MARK --set-xmark 0x41000000/0x4f000000" in text
    assert "-A NFSHUNT_POST_PD_OUT -o fw-eth1 -j MARK --set-xmark 0x20200000/0x20f00000" in text


def test_routed_plumbing_without_an_interface_names_the_key():
    cfg = routed(ports=[{"fast": 1, "slow": 2, "physdevin": 1, "interface": "fw-eth0"},
                        {"fast": 3, "slow": 4, "physdevin": 2}])
    with pytest.raises(ConfigError) as err:
        iptables.render(cfg, [])
    assert err.value.key == "ports[1].interface" and "routed mode" in str(err.value)


def test_preflight_refuses_interfaces_that_do_not_exist_and_changes_nothing():
    cfg = routed(ports=[{"fast": 1, "slow": 2, "physdevin": 1, "interface": "nfsh-none0"},
                        {"fast": 3, "slow": 4, "physdevin": 2, "interface": "nfsh-none1"}])
    problems = iptables.preflight(cfg, ["ipv4"], fix_sysctl=True)
    assert "interface nfsh-none0 does not exist: create it or fix ports[].interface (a routed VLAN's: " \
           "ports[].vlans[].interface)" in problems
    assert not any("bridge" in p for p in problems)  # no br_netfilter checks for a router


def test_routed_interfaces_of_one_mtu_pass_and_differing_ones_are_named_with_their_mtus():
    assert routed_checks.mtu_problem({"fw-eth0": 1500, "fw-eth1": 1500}) is None
    assert routed_checks.mtu_problem({"fw-eth0": 9000}) is None
    problem = routed_checks.mtu_problem({"fw-eth0": 1500, "fw-eth1": 1400, "fw-eth2": 1500})
    assert problem is not None
    assert "fw-eth0 has MTU 1500, fw-eth2 has MTU 1500, fw-eth1 has MTU 1400" in problem
    assert "packet too big" in problem and "one MTU" in problem


def connected(cfg):
    core = c.Core(cfg)
    core.switch_connected(OFP13)
    core.reconcile([], 0.0)
    return core


@pytest.mark.parametrize("action", [1, 2])  # shunt, block
def test_a_routed_connection_stays_on_the_firewall_counted_and_a_bridged_one_is_installed(action):
    """Bridged flows would carry a routed connection with the hosts' frames addressed to the
    router's MAC and its TTL unchanged: the receiver would drop them."""
    core = connected(routed())
    out = core.conntrack_event(event(action=action))
    assert [(type(x).__name__, x.reason) for x in out] == [("Ignored", adm.R_ROUTED)]
    assert not core.by_key and not core.waiting
    assert [type(x).__name__ for x in connected(config()).conntrack_event(event(action=action))] == ["InstallFlows"]


# --- slice 2 (experimental_routed): shunts with the router's rewrite ---------------------------

FW0, FW1, H1_MAC, H2_MAC = "02:00:00:00:fe:00", "02:00:00:00:fe:01", "02:00:00:00:01:01", "02:00:00:00:02:01"
GOOD = {"10.0.0.2": NextHop("fw-eth1", FW1, H2_MAC), "10.0.0.1": NextHop("fw-eth0", FW0, H1_MAC)}


def experimental(**overrides):
    return routed(experimental_routed=True, flow_layout="single", **overrides)


def test_a_routed_shunt_asks_the_firewall_s_tables_then_installs_with_both_next_hops():
    core = connected(experimental())
    ev = event()
    ask, ignored = core.conntrack_event(ev)
    assert isinstance(ask, ResolveHops) and ask.event is ev and ask.addresses == ("10.0.0.2", "10.0.0.1")
    assert ignored.reason == adm.R_HOP_UNKNOWN and not core.by_key
    (install,) = core.next_hops_known(GOOD, ev, 100.0)
    assert isinstance(install, InstallFlows)
    assert install.conn.hops == (GOOD["10.0.0.2"], GOOD["10.0.0.1"])
    # Known for a while: the next connection to the same hosts is installed at once.
    (again,) = core.conntrack_event(event(ct_id=8, sport=40001, received=105.0))
    assert isinstance(again, InstallFlows) and again.conn.hops == install.conn.hops
    # Then asked again (the tables may have changed; their events are a later slice).
    assert isinstance(core.conntrack_event(event(ct_id=9, sport=40002, received=111.0))[0], ResolveHops)


@pytest.mark.parametrize("answers,reason", [
    ({**GOOD, "10.0.0.2": routes.R_UNRESOLVED}, routes.R_UNRESOLVED),
    ({**GOOD, "10.0.0.1": routes.R_NO_ROUTE}, routes.R_NO_ROUTE),
    ({**GOOD, "10.0.0.2": NextHop("fw-eth0", FW0, H2_MAC)}, adm.R_HOP_ELSEWHERE),
])
def test_a_routed_connection_without_a_usable_next_hop_stays_on_the_firewall_counted(answers, reason):
    core = connected(experimental())
    ev = event()
    core.conntrack_event(ev)
    out = core.next_hops_known(answers, ev, 100.0)
    assert [x.reason for x in out if type(x).__name__ == "Ignored"] == [reason]
    assert [type(x).__name__ for x in out if type(x).__name__ != "Ignored"] == []
    assert not core.by_key
    # It waits for the tables to change (their follower tells: core/tables.py), not for a timer.
    assert list(core.shared.next_hops.waiting) == [ev.orig]


def test_a_routed_block_needs_no_next_hop_and_bridged_or_unflagged_routed_configs_never_ask():
    (install,) = connected(experimental()).conntrack_event(event(action=2))
    assert isinstance(install, InstallFlows) and install.conn.hops is None
    assert [type(x).__name__ for x in connected(routed()).conntrack_event(event())] == ["Ignored"]


@pytest.mark.parametrize("raw,key,words", [
    ({**BASE, "experimental_routed": True, "flow_layout": "single"}, "experimental_routed", "needs \"forwarding\""),
    ({**BASE, "forwarding": "routed", "openflow_versions": ["1.3"], "experimental_routed": True,
      "ports": [{**ROUTED_PORTS[0], "vlans": [100, 200]}, ROUTED_PORTS[1]]}, "ports[0].vlans[0]",
     "an interface of its own"),
])
def test_experimental_routed_refuses_what_it_cannot_build(raw, key, words):
    with pytest.raises(ConfigError) as err:
        from_dict(raw)
    assert err.value.key == key and words in str(err.value)


def test_experimental_routed_takes_the_default_flow_layout():
    cfg = from_dict({**BASE, "forwarding": "routed", "ports": ROUTED_PORTS, "openflow_versions": ["1.3"],
                     "experimental_routed": True})
    assert cfg.switches[0].flow_layout == "auto"  # (the switch's session takes single: switch/peers.py)


def test_a_routed_shunt_s_flows_decrement_the_ttl_then_rewrite_both_macs_before_the_output():
    from os_ken.ofproto import ofproto_protocol

    from nfshunt.openflow.flows import FlowBuilder
    core = connected(experimental())
    ev = event()
    core.conntrack_event(ev)
    (install,) = core.next_hops_known(GOOD, ev, 100.0)
    fb = FlowBuilder(ofproto_protocol.ProtocolDesc(OFP13), experimental())
    fb.templated = False
    msgs = fb.install(install.conn)
    assert len(msgs) == 6  # 2 flows, 4 catchers (single layout)
    for msg in msgs:
        msg.serialize()
    seen = []
    for msg in msgs:
        actions = list(msg.instructions[0].actions)
        if getattr(actions[0], "port", None) == fb.ofp.OFPP_CONTROLLER:  # a catcher: its copy as it arrived
            actions = actions[1:]
        names = [type(a).__name__ for a in actions]
        assert names[:3] == ["OFPActionDecNwTtl", "OFPActionSetField", "OFPActionSetField"], names
        macs = (actions[1].value, actions[2].value)
        forward = actions[3].port == 3
        assert macs == ((FW1, H2_MAC) if forward else (FW0, H1_MAC))
        seen.append(forward)
    assert sorted(seen) == [False] * 3 + [True] * 3
    # Templated (the hot path), the same bytes.
    fb2 = FlowBuilder(ofproto_protocol.ProtocolDesc(OFP13), experimental())
    plain = [bytes(m.buf) for m in _serialized(fb.install(install.conn))]
    assert [bytes(m.buf) for m in _serialized(fb2.install(install.conn))] == plain
    assert [bytes(m.buf) for m in _serialized(fb2.install(install.conn))] == plain  # (from the templates)


def _serialized(msgs):
    for m in msgs:
        m.set_xid(0)
        m.serialize()
    return msgs


def test_the_switch_is_asked_for_invalid_ttl_packet_ins_keeping_the_others_nfshunt_needs():
    """OpenFlow 1.3 has no set-config flag for it: OFPT_SET_ASYNC, whose masks replace the
    connection's, so flow-removed (idle timeouts) and the catchers' packet-ins stay on."""
    from os_ken.ofproto import ofproto_protocol
    from os_ken.ofproto import ofproto_v1_3 as ofp

    from nfshunt.openflow.flows import OFPR_INVALID_TTL, invalid_ttl_packet_ins, packet_out
    dp = ofproto_protocol.ProtocolDesc(OFP13)
    msg = invalid_ttl_packet_ins(dp)
    msg.set_xid(7)
    msg.serialize()
    assert OFPR_INVALID_TTL == ofp.OFPR_INVALID_TTL
    master_pin, slave_pin = msg.packet_in_mask
    assert master_pin == 1 << ofp.OFPR_NO_MATCH | 1 << ofp.OFPR_ACTION | 1 << ofp.OFPR_INVALID_TTL and slave_pin == 0
    assert msg.flow_removed_mask[0] == sum(1 << r for r in (ofp.OFPRR_IDLE_TIMEOUT, ofp.OFPRR_HARD_TIMEOUT,
                                                           ofp.OFPRR_DELETE, ofp.OFPRR_GROUP_DELETE))
    # The bytes the measurement sent to Open vSwitch (design F4), but for the masks it added.
    assert bytes(msg.buf)[:16] == bytes.fromhex("041c002000000007" "00000007" "00000000")
    out = packet_out(dp, 2, b"\x00" * 60)
    out.serialize()
    assert [a.port for a in out.actions] == [2] and out.in_port == ofp.OFPP_CONTROLLER


def test_a_lookup_that_failed_is_asked_for_again_a_few_times_then_left():
    """The socket failed, not the tables (what the tables say no to waits for their change):
    asked again, routing.RETRIES times, KEEP_NONE apart."""
    from nfshunt.core import routing
    from nfshunt.core.commands import Later
    core = connected(experimental())
    ev = event(proto=17, state=None)
    core.conntrack_event(ev)
    failed = {**GOOD, "10.0.0.1": routes.R_LOOKUP_FAILED}
    out = core.next_hops_known(failed, ev, 100.0)
    (later,) = [x for x in out if isinstance(x, Later)]
    (again,) = later.commands
    assert later.delay == routing.KEEP_NONE and isinstance(again, ResolveHops)
    assert (again.event, again.attempt) == (ev, 1)
    assert not any(isinstance(x, Later) for x in core.next_hops_known(failed, ev, 101.1, routing.RETRIES))
    (install,) = core.next_hops_known(GOOD, ev, 102.2, 2)  # answered meanwhile: shunted
    assert isinstance(install, InstallFlows) and install.conn.hops == (GOOD["10.0.0.2"], GOOD["10.0.0.1"])


def test_a_routed_trunk_s_vlans_are_interfaces_with_or_without_experimental_routed():
    """Without experimental_routed nothing routed is shunted, but `nfshunt iptables` marks each
    routed sub-interface by its physdevin all the same: a bridged VLAN list is refused."""
    with pytest.raises(ConfigError) as err:
        from_dict({**BASE, "forwarding": "routed", "openflow_versions": ["1.3"],
                   "ports": [{**ROUTED_PORTS[0], "vlans": [100, 200]}, ROUTED_PORTS[1]]})
    assert err.value.key == "ports[0].vlans[0]" and "physdevin" in str(err.value)
    cfg = from_dict({**BASE, "forwarding": "routed", "openflow_versions": ["1.3"],
                     "ports": [{**ROUTED_PORTS[0], "vlans": [{"id": 100, "physdevin": 3}]}, ROUTED_PORTS[1]]})
    assert [(s.physdevin, s.vid, s.interface) for s in cfg.switches[0].sides.values()] == \
        [(3, 100, "fw-eth0.100"), (2, 0, "fw-eth1")]  # (the trunk's untagged frames: not carried, by default)

