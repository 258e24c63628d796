"""Admission's dry run (`Core.dry_run`, what `nfshunt explain` says): for every reason an
event can be ignored, the dry run names the reason the real event then gets, and it
changes nothing (no pair, no waiting entry, no closing entry learnt, no pin touched)."""
import copy
import dataclasses

import pytest

from nfshunt.core import admission as adm
from nfshunt.core import core as c
from nfshunt.core import routing
from nfshunt.core.connection import Action
from nfshunt.core.pins import IdsHold
from nfshunt.records import cookies, markcodec
from nfshunt.records.model import OFP10, OFP13, EventKind, FlowTuple, NextHop
from tests.helpers import config, event


def connected(version=OFP13, **cfg):
    core = c.Core(config(**cfg))
    core.switch_connected(version)
    core.reconcile([], 0.0)
    return core


def live(core, ev):
    (install,) = core.conntrack_event(ev)
    core.flows_confirmed(install.conn, 1.0)
    return install.conn


def _unmarked():
    return connected(), event(mark=0)


def _incomplete():
    return connected(), event(mark=markcodec.encode(1, 2))


def _unknown_action():
    return connected(), event(action=5)


def _unknown_port():
    return connected(), event(ingress=7)


def _same_port():
    return connected(), event(ingress=1, egress=1)


def _policy_ignore():
    return connected(), event(action=0)


def _protocol():
    ev = event()
    icmp = FlowTuple(4, 1, ev.orig.src, ev.orig.dst, 0, 0)
    ev.orig, ev.reply, ev.tcp_state = icmp, icmp.reversed(), None
    return connected(), ev


def _closing():
    return connected(), event(state=4)


def _destroy():
    return connected(), event(kind=EventKind.DESTROY)


def _no_switch():
    return c.Core(config()), event()


def _backup():
    core = connected()
    core.stand_by()
    return core, event()


def _ipv6_of10():
    return connected(OFP10), event(family=6)


def _duplicate():
    core = connected()
    live(core, event())
    return core, event()


def _queued():
    core = connected()
    conn = live(core, event())
    core.remove(conn, "flush", 2.0)
    return core, event(ct_id=99)


def _budget():
    core = connected(max_shunts=1)
    live(core, event())
    return core, event(sport=2, ct_id=2)


def _pinned():
    core = connected()
    core.pin(event().orig, Action.IGNORE, 0.0)
    return core, event()


def _nat():
    ev = event()
    ev.reply = FlowTuple(4, ev.orig.proto, "192.0.2.9", ev.orig.src, ev.orig.dport, 61000)
    return connected(), ev


def _id_collision():
    core = connected()
    for slot in range(cookies.SLOTS):
        live(core, event(ct_id=7, sport=1000 + slot))
    return core, event(ct_id=7, sport=9)


def _ids_server():
    core = connected()
    ev = event(action=0)
    core.pins.hold_for(ev.orig, IdsHold(Action.SHUNT, "ids:zeek", server=("10.0.0.9", 80)))
    return core, ev


def _decided_before():
    """A re-evaluation's clearing of the kernel's decisions going on (policy_state.Clearing)."""
    core = connected()
    core.clearing.begin()
    return core, event()


def _withdrawn():
    """A live shunt's entry with its decision cleared (a re-evaluation's clearing, or by hand)."""
    core = connected()
    live(core, event())
    return core, event(action=None)


def _vlan():
    return connected(), event(zone=100)


def _routed(**more):
    return connected(forwarding="routed", openflow_versions=["1.3"], **more,
                     ports=[{"fast": 1, "slow": 2, "physdevin": 1, "interface": "fw-eth0"},
                            {"fast": 3, "slow": 4, "physdevin": 2, "interface": "fw-eth1"}]), event()


def _hop_unknown():
    return _routed(experimental_routed=True, flow_layout="single")


def _hop_elsewhere():
    core, ev = _hop_unknown()
    hop = NextHop("fw-eth0", "02:00:00:00:fe:00", "02:00:00:00:00:09")  # both by fw-eth0
    core.shared.next_hops.learn({"10.0.0.2": hop, "10.0.0.1": hop}, ev.received)
    return core, ev


def _hop_answered(answer):
    """The tables' answer for the original's destination (10.0.0.2), learnt: their no."""
    def scene():
        core, ev = _hop_unknown()
        h1 = NextHop("fw-eth0", "02:00:00:00:fe:00", "02:00:00:00:00:01")
        core.shared.next_hops.learn({"10.0.0.2": answer, "10.0.0.1": h1}, ev.received)
        return core, ev
    return scene


def _stick_pipeline():
    """Two VLANs of one trunk (a router on a stick) with the pipeline layout."""
    core = connected(forwarding="routed", openflow_versions=["1.3"], experimental_routed=True,
                     flow_layout="pipeline",
                     ports=[{"fast": 1, "slow": 2, "physdevin": 1, "untagged": False,
                             "vlans": [{"id": 100, "physdevin": 3, "interface": "fw-eth0.100"},
                                       {"id": 300, "physdevin": 5, "interface": "fw-eth0.300"}]},
                            {"fast": 3, "slow": 4, "physdevin": 2, "interface": "fw-eth1"}])
    core.shared.pipeline = True  # (the switch's session takes the layout)
    return core, event(ingress=3, egress=5)


def _flapping():
    core, ev = _hop_unknown()
    h1 = NextHop("fw-eth0", "02:00:00:00:fe:00", "02:00:00:00:00:01")
    h2 = NextHop("fw-eth1", "02:00:00:00:fe:01", "02:00:00:00:00:02", "10.0.0.2")
    table = core.shared.next_hops
    table.learn({"10.0.0.2": h2, "10.0.0.1": h1}, ev.received)
    table.held[("fw-eth1", "10.0.0.2")] = ev.received + routing.HOLD_DOWN  # (as table.changed holds it)
    return core, ev


def _ports_moved():
    """A pair installed on the egress a flooded first packet's copy recorded; its reply set it right."""
    core = connected(ports=[{"fast": 1 + 2 * i, "slow": 2 + 2 * i, "physdevin": i + 1, "bridge_port": f"fw-eth{i}"}
                            for i in range(3)])
    live(core, event(egress=3))
    return core, event(egress=2)


def _reply_held():
    """A port forward's translation onto the reply tuple of a held routed pair."""
    core, ev = _hop_unknown()
    h1 = NextHop("fw-eth0", "02:00:00:00:fe:00", "02:00:00:00:00:01")
    h2 = NextHop("fw-eth1", "02:00:00:00:fe:01", "02:00:00:00:00:02")
    core.shared.next_hops.learn({"10.0.0.2": h2, "10.0.0.1": h1}, ev.received)
    live(core, ev)
    forwarded = FlowTuple(4, ev.orig.proto, "10.0.0.1", "10.0.0.254", ev.orig.sport, 8080)
    return core, dataclasses.replace(ev, ct_id=9, orig=forwarded)


SCENES = {adm.R_UNMARKED: _unmarked, adm.R_INCOMPLETE: _incomplete, adm.R_UNKNOWN_ACTION: _unknown_action,
          adm.R_UNKNOWN_PORT: _unknown_port, adm.R_SAME_PORT: _same_port, adm.R_POLICY_IGNORE: _policy_ignore,
          adm.R_PROTOCOL: _protocol, adm.R_CLOSING: _closing, adm.R_DESTROY: _destroy,
          adm.R_NO_SWITCH: _no_switch, adm.R_BACKUP: _backup, adm.R_IPV6_OF10: _ipv6_of10,
          adm.R_DUPLICATE: _duplicate, adm.R_QUEUED: _queued, adm.R_BUDGET: _budget, adm.R_PINNED: _pinned,
          adm.R_NAT: _nat, adm.R_ID_COLLISION: _id_collision, adm.R_IDS_SERVER: _ids_server,
          adm.R_DECIDED_BEFORE: _decided_before, adm.R_WITHDRAWN: _withdrawn,
          adm.R_VLAN: _vlan, adm.R_ROUTED: _routed, adm.R_HOP_UNKNOWN: _hop_unknown,
          adm.R_HOP_ELSEWHERE: _hop_elsewhere, adm.R_NO_ROUTE: _hop_answered(adm.R_NO_ROUTE),
          adm.R_BLACKHOLE: _hop_answered(adm.R_BLACKHOLE), adm.R_UNRESOLVED: _hop_answered(adm.R_UNRESOLVED),
          adm.R_NEXT_HOP_FAILED: _hop_answered(adm.R_NEXT_HOP_FAILED), adm.R_FLAPPING: _flapping,
          adm.R_STICK_PIPELINE: _stick_pipeline, adm.R_PORTS_MOVED: _ports_moved, adm.R_REPLY_HELD: _reply_held}
# Not a reason an event is ignored for: the removal's reason of a shunt whose entry
# closed on the firewall (its event is ignored as R_CLOSING; see the take-down test below).
# Nor a routed pair's take-down reason when its destination's route leaves by another
# interface (core/tables.py); a new event meeting that route is R_HOP_ELSEWHERE.
NOT_IGNORED = {adm.R_CLOSED_ON_FIREWALL, adm.R_ROUTE_MOVED}


def test_every_reason_admission_has_is_covered():
    reasons = {v for k, v in vars(adm).items() if k.startswith("R_")}
    assert reasons - NOT_IGNORED == set(SCENES)


def state(core):
    """Everything a dry run must leave as it was."""
    return (sorted(core.by_key), [(conn.state, conn.remove_reason, conn.resume) for conn in core.by_key.values()],
            list(core.waiting), dict(core.shared.closing._entries), {t: copy.copy(p) for t, p in core.pins.items()},
            core.shunts, core.blocks)


@pytest.mark.parametrize("reason", sorted(SCENES))
def test_the_dry_run_names_the_reason_the_event_gets_and_changes_nothing(reason):
    core, ev = SCENES[reason]()
    before = state(core)
    verdict = core.dry_run(ev)
    assert state(core) == before
    assert verdict.reason == reason
    out = core.conntrack_event(ev)
    ignored = [x.reason for x in out if type(x).__name__ == "Ignored"]
    assert ignored == [reason]


def test_a_decided_entry_the_dry_run_would_install_is_installed():
    core = connected()
    verdict = core.dry_run(event())
    assert verdict.act is adm.Act.INSTALL and verdict.reason == "" and verdict.decided[0] is Action.SHUNT
    assert not core.by_key  # nothing made
    (install,) = core.conntrack_event(event())
    assert install.conn.slot == verdict.slot


def test_a_closing_live_shunt_is_a_take_down_in_the_dry_run_and_in_fact():
    core = connected()
    conn = live(core, event())
    closing = event(state=4)
    verdict = core.dry_run(closing)
    assert (verdict.act, verdict.reason, verdict.existing) == (adm.Act.TAKE_DOWN, adm.R_CLOSING, conn)
    assert not conn.closed_on_firewall and conn.remove_reason is None and not core.shared.closing._entries
    out = core.conntrack_event(closing)
    assert conn.closed_on_firewall and conn.remove_reason == adm.R_CLOSED_ON_FIREWALL
    assert [x.reason for x in out if type(x).__name__ == "Ignored"] == [adm.R_CLOSING]


def test_a_block_at_full_budget_evicts_the_newest_shunt_in_the_dry_run_and_in_fact():
    core = connected(max_shunts=1)
    shunt = live(core, event())
    block = event(action=2, sport=2, ct_id=2)
    verdict = core.dry_run(block)
    assert (verdict.act, verdict.existing) == (adm.Act.EVICT, shunt) and shunt.state.value == "draining"
    core.conntrack_event(block)
    assert shunt.state.value == "taking down" and core.blocks == 1


def test_a_pin_keeps_the_entry_it_applied_to_through_a_dry_run():
    core = connected()
    core.pin(event().orig, Action.BLOCK, 0.0)
    core.conntrack_event(event(ct_id=5))  # the pin applies to entry 5
    assert core.pins[event().orig].ct_id == 5
    core.dry_run(event(ct_id=6))
    assert core.pins[event().orig].ct_id == 5
