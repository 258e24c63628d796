"""The decision core against plain events: no switch, no netlink."""
import pytest

from nfshunt import cookies
from nfshunt import core as c
from nfshunt.model import UDP, EventKind, SwitchFlow
from tests.helpers import config, event


def types(cmds):
    return [type(x).__name__ for x in cmds]


def connected(version=c.OFP13, **cfg):
    core = c.Core(config(**cfg))
    core.switch_connected(version)
    core.reconcile([], 0.0)
    return core


def shunted(core, **kw):
    (install,) = core.conntrack_event(event(**kw))
    core.flows_confirmed(install.conn, 101.0)
    return install.conn


def test_shunt_installs_then_deletes_conntrack_only_after_confirmation():
    core = connected()
    cmds = core.conntrack_event(event())
    assert types(cmds) == ["InstallFlows"]
    conn = cmds[0].conn
    assert (conn.action, conn.ingress.fast, conn.egress.fast) == ("shunt", 1, 3)
    out = core.flows_confirmed(conn, 100.002)
    assert types(out) == ["DeleteConntrack", "Installed"]
    assert out[0].ct_id == 7 and out[0].orig == conn.orig
    assert out[1].latency == pytest.approx(0.002)


def test_block_installs_flows_of_kind_block():
    core = connected()
    (cmd,) = core.conntrack_event(event(action=2))
    assert cmd.conn.action == "block"
    assert cookies.parse(cmd.conn.cookie(True)) == (cookies.Kind.BLOCK, 7, True)


def test_udp_and_ipv6_on_openflow13_are_shunted():
    core = connected()
    assert types(core.conntrack_event(event(proto=UDP))) == ["InstallFlows"]
    assert types(core.conntrack_event(event(family=6, ct_id=8))) == ["InstallFlows"]


@pytest.mark.parametrize("kw,reason", [
    (dict(mark=0), c.R_UNMARKED),
    (dict(mark=0x0000BEEF), c.R_UNMARKED),  # only the admin's bits
    (dict(mark=0x61200000), c.R_INCOMPLETE),  # ports recorded, policy not decided yet
    (dict(mark=0x50010000), c.R_INCOMPLETE),  # no egress flag
    (dict(action=0), c.R_POLICY_IGNORE),
    (dict(action=9), c.R_UNKNOWN_ACTION),
    (dict(ingress=5), c.R_UNKNOWN_PORT),
    (dict(egress=5), c.R_UNKNOWN_PORT),
    (dict(egress=1), c.R_SAME_PORT),
    (dict(proto=1), c.R_PROTOCOL),
    (dict(state=4), c.R_CLOSING),  # FIN_WAIT
    (dict(state=7), c.R_CLOSING),  # TIME_WAIT
    (dict(state=8), c.R_CLOSING),  # CLOSE
    (dict(kind=EventKind.DESTROY), c.R_DESTROY),
])
def test_events_that_must_not_touch_the_switch(kw, reason):
    core = connected()
    (cmd,) = core.conntrack_event(event(**kw))
    assert isinstance(cmd, c.Ignored) and cmd.reason == reason
    assert not core.conns


def test_ipv6_on_openflow10_stays_on_slow_path():
    core = connected(version=c.OFP10)
    (cmd,) = core.conntrack_event(event(family=6))
    assert cmd.reason == c.R_IPV6_OF10
    assert types(core.conntrack_event(event(family=4))) == ["InstallFlows"]


def test_duplicates_are_suppressed_while_pending_and_active():
    core = connected()
    (install,) = core.conntrack_event(event())
    assert core.conntrack_event(event())[0].reason == c.R_DUPLICATE  # pending
    core.flows_confirmed(install.conn, 101.0)
    assert core.conntrack_event(event())[0].reason == c.R_DUPLICATE  # active, same entry


def test_stale_entry_recreated_for_an_active_shunt_is_deleted():
    core = connected()
    shunted(core)
    cmds = core.conntrack_event(event(ct_id=99))
    assert types(cmds) == ["DeleteConntrack", "Ignored"]
    assert cmds[0].ct_id == 99


def test_no_switch_means_no_action_until_connected_and_reconciled():
    core = c.Core(config())
    assert core.conntrack_event(event())[0].reason == c.R_NO_SWITCH
    cmds = core.switch_connected(c.OFP13)
    assert types(cmds) == ["InstallDefaults", "RequestSwitchFlows"]
    assert core.conntrack_event(event())[0].reason == c.R_NO_SWITCH  # not reconciled yet
    assert types(core.reconcile([], 0.0)) == ["ResyncConntrack"]
    assert types(core.conntrack_event(event())) == ["InstallFlows"]


def test_refused_flow_rolls_back_and_keeps_the_conntrack_entry():
    core = connected()
    (install,) = core.conntrack_event(event())
    cmds = core.flows_failed(install.conn, "table full")
    assert types(cmds) == ["RemoveFlows", "Refused"]
    assert not any(isinstance(x, c.DeleteConntrack) for x in cmds)
    assert core.flows_confirmed(install.conn, 101.0) == []  # a late barrier changes nothing
    assert types(core.conntrack_event(event())) == ["InstallFlows"]  # a later event may retry


def test_switch_disconnect_abandons_pending_installs():
    core = connected()
    (install,) = core.conntrack_event(event())
    assert types(core.switch_disconnected()) == ["Refused"]
    assert core.conntrack_event(event())[0].reason == c.R_NO_SWITCH


def test_removal_takes_the_pair_and_a_resumed_connection_is_shunted_again():
    core = connected()
    conn = shunted(core)
    cmds = core.flow_removed(conn.cookie(True), "idle timeout", 5, 300, 10.0, 200.0)
    assert types(cmds) == ["RemoveFlows"] and cmds[0].directions == (False,)
    # The connection resumes through the slow path before the pair is gone: queued.
    assert core.conntrack_event(event(ct_id=50))[0].reason == c.R_QUEUED
    cmds = core.flow_removed(conn.cookie(False), "delete", 10, 9000, 10.0, 200.1)
    assert types(cmds) == ["Removed", "InstallFlows"]
    assert cmds[0].conn.stats == {True: (5, 300, 10.0), False: (10, 9000, 10.0)}
    assert cmds[1].conn.ct_id == 50


def test_resumed_connection_after_full_removal_is_shunted_again():
    core = connected()
    conn = shunted(core)
    core.flow_removed(conn.cookie(False), "idle timeout", 1, 1, 1, 200.0)
    core.flow_removed(conn.cookie(True), "idle timeout", 1, 1, 1, 200.0)
    assert types(core.conntrack_event(event(ct_id=51))) == ["InstallFlows"]


def test_half_removed_pair_is_forgotten_after_grace():
    core = connected()
    conn = shunted(core)
    core.flow_removed(conn.cookie(False), "idle timeout", 1, 1, 1, 200.0)
    assert core.tick(201.0) == []
    assert types(core.tick(200.0 + c.REMOVAL_GRACE + 1)) == ["Removed"]
    assert not core.conns


def test_foreign_and_default_cookies_in_flow_removed_are_ignored():
    core = connected()
    assert core.flow_removed(0x1234, "idle timeout", 0, 0, 0, 0) == []
    assert core.flow_removed(cookies.make(cookies.Kind.DEFAULT), "delete", 0, 0, 0, 0) == []
    assert core.flow_removed(cookies.make(cookies.Kind.SHUNT, 12345), "delete", 0, 0, 0, 0) == []


def test_max_shunts_budget():
    core = connected(max_shunts=1)
    shunted(core)
    assert core.conntrack_event(event(sport=1))[0].reason == c.R_BUDGET
    assert types(core.conntrack_event(event(sport=2, action=2))) == ["InstallFlows"]  # blocks still go in


def _flows_for(conn, out_fwd=3, out_rev=1):
    return [SwitchFlow(conn.cookie(False), 33000, 1, conn.orig, out_fwd),
            SwitchFlow(conn.cookie(True), 33000, 3, conn.reply, out_rev)]


def test_reconcile_adopts_live_pairs_and_deletes_orphans():
    old = connected()
    conn = shunted(old)
    orphan = shunted(old, sport=2, ct_id=8)
    flows = _flows_for(conn) + _flows_for(orphan)[:1] + [
        SwitchFlow(cookies.make(cookies.Kind.DEFAULT), 100, 9, None, 10),  # a default of a removed group
        SwitchFlow(cookies.make(cookies.Kind.DEFAULT), 100, 1, None, 2),
    ]
    fresh = c.Core(config())  # a restarted controller knows nothing
    fresh.switch_connected(c.OFP13)
    cmds = fresh.reconcile(flows, 5.0)
    assert types(cmds) == ["DeleteSwitchFlow", "DeleteSwitchFlow", "ResyncConntrack"]
    assert fresh.conns[conn.orig].state is c.State.ACTIVE  # adopted, not bounced
    assert orphan.orig not in fresh.conns
    # The adopted shunt's removal is handled like any other.
    assert types(fresh.flow_removed(conn.cookie(False), "idle timeout", 1, 1, 1, 9.0)) == ["RemoveFlows"]


def test_reconcile_reinstalls_what_the_switch_lost():
    core = connected()
    conn = shunted(core)
    core.switch_disconnected()
    core.switch_connected(c.OFP13)
    cmds = core.reconcile([], 300.0)
    assert types(cmds) == ["InstallFlows", "ResyncConntrack"] and cmds[0].conn is conn


def test_reconcile_keeps_owned_flows_when_startup_deletion_is_off():
    core = c.Core(config(delete_flows_on_startup=False))
    core.switch_connected(c.OFP13)
    conn = shunted(connected())
    cmds = core.reconcile(_flows_for(conn)[:1], 0.0)
    assert types(cmds) == ["DeleteSwitchFlow", "ResyncConntrack"]  # unaccountable half pair
    core2 = c.Core(config(delete_flows_on_startup=False))
    core2.switch_connected(c.OFP13)
    assert types(core2.reconcile(_flows_for(conn), 0.0)) == ["ResyncConntrack"]


def test_foreign_wipe_only_on_request():
    core = c.Core(config(delete_foreign_flows_on_startup=True))
    assert types(core.switch_connected(c.OFP10))[0] == "DeleteAllFlows"


def test_stale_entry_recreated_in_reverse_direction_is_deleted_even_unmarked():
    core = connected()
    conn = shunted(core)
    ev = event(ct_id=77, mark=0x61200000)
    from dataclasses import replace
    reversed_ev = replace(ev, orig=conn.reply, reply=conn.orig)
    cmds = core.conntrack_event(reversed_ev)
    assert types(cmds) == ["DeleteConntrack", "Ignored"] and cmds[0].ct_id == 77


def test_entries_recreated_by_in_flight_packets_are_swept_once_by_tuple():
    core = connected()
    (install,) = core.conntrack_event(event())
    core.flows_confirmed(install.conn, 100.0)
    assert core.tick(100.5) == []
    cmds = core.tick(100.0 + c.SWEEP_AFTER)
    assert types(cmds) == ["DeleteConntrack"] and cmds[0].ct_id is None
    assert core.tick(110.0) == []
