"""The decision core against plain events: no switch, no netlink."""
import pytest

from nfshunt.core import admission as adm
from nfshunt.core import commands as cm
from nfshunt.core import confirmation, layout, pins, removal
from nfshunt.core import connection as cn
from nfshunt.core import core as c
from nfshunt.records import cookies, markcodec
from nfshunt.records.model import OFP10, OFP13, UDP, EventKind, FlowTuple, SwitchFlow
from tests.helpers import config, event


def types(cmds):
    return [type(x).__name__ for x in cmds]


def handed_back(cmds):
    """The commands with each take-down's re-created entry opened up: a TCP shunt's
    RestoreConntrack comes first and carries the flows' removal (connection.py's rule)."""
    out = []
    for x in cmds:
        out.append(x)
        if isinstance(x, cm.RestoreConntrack):
            out.extend(x.then)
    return out


def watch_ended(core, cmds, now):
    """A close seen on the firewall is watched first (close_watch.py): what its watch's end
    brings, nothing having contradicted it."""
    (ends,) = {id(y): y for x in handed_back(cmds) if isinstance(x, cm.Later) for y in x.commands
               if isinstance(y, cm.WatchEnds)}.values()
    return core.watch_ends(ends.conn, ends.watch, now)


def connected(version=OFP13, **cfg):
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
    # The entry stays while the slow path drains (packets queued there must still find it).
    assert types(out) == ["Installed", "Later"] and out[1].delay == core.switch.drain
    assert out[0].latency == pytest.approx(0.002)
    assert conn.state is cn.State.DRAINING
    (delete,) = core.entry_due(conn, 100.06)
    assert type(delete).__name__ == "DeleteConntrack" and delete.ct_id == 7 and delete.orig == conn.orig
    assert core.entry_due(conn, 100.07) == []  # once


def test_with_no_drain_the_entry_goes_at_the_barrier():
    core = connected(drain=0)
    (install,) = core.conntrack_event(event())
    assert types(core.flows_confirmed(install.conn, 100.0)) == ["DeleteConntrack", "Installed"]


def test_confirm_delay_keeps_the_entry_for_the_delay_and_the_drain():
    core = connected(confirm="delay", confirm_delay=0.4)
    (install,) = core.conntrack_event(event())
    out = core.flows_confirmed(install.conn, 100.0)
    assert types(out) == ["Installed", "Later"] and out[1].delay == pytest.approx(0.45)


def test_confirm_counters_waits_for_both_directions_or_one_after_the_delay():
    core = connected(confirm="counters", confirm_delay=0.4, openflow_versions=["1.3"])
    (install,) = core.conntrack_event(event())
    conn = install.conn
    assert types(core.flows_confirmed(conn, 100.0)) == ["Installed", "ReadCounters"]
    again = core.counters_read(conn, {False: 0, True: 0}, 100.05)  # the switch does not forward yet
    assert types(again) == ["Later"] and types(again[0].commands) == ["ReadCounters"]
    assert types(core.counters_read(conn, {False: 12}, 100.1)) == ["Later"]  # one way, too early to tell
    (drain,) = core.counters_read(conn, {False: 12, True: 3}, 100.15)
    assert drain.delay == core.switch.drain and types(drain.commands) == ["EntryDue"]
    one_way = connected(confirm="counters", confirm_delay=0.4, openflow_versions=["1.3"])
    (install,) = one_way.conntrack_event(event(proto=UDP))
    one_way.flows_confirmed(install.conn, 100.0)
    assert types(one_way.counters_read(install.conn, {False: 5}, 100.5)[0].commands) == ["EntryDue"]


def test_a_pair_taken_down_before_its_entry_went_keeps_the_entry():
    core = connected(confirm="delay")
    (install,) = core.conntrack_event(event())
    core.flows_confirmed(install.conn, 100.0)
    core.flush("flush by operator", 100.1)
    assert core.entry_due(install.conn, 101.0) == []


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
    (dict(mark=0), adm.R_UNMARKED),
    (dict(mark=0x0000BEEF), adm.R_UNMARKED),  # only the admin's bits
    (dict(mark=0x61200000), adm.R_INCOMPLETE),  # ports recorded, policy not decided yet
    (dict(mark=0x50010000), adm.R_INCOMPLETE),  # no egress flag
    (dict(action=0), adm.R_POLICY_IGNORE),
    (dict(action=9), adm.R_UNKNOWN_ACTION),
    (dict(ingress=5), adm.R_UNKNOWN_PORT),
    (dict(egress=5), adm.R_UNKNOWN_PORT),
    (dict(egress=1), adm.R_SAME_PORT),
    (dict(proto=1), adm.R_PROTOCOL),
    (dict(state=4), adm.R_CLOSING),  # FIN_WAIT
    (dict(state=7), adm.R_CLOSING),  # TIME_WAIT
    (dict(state=8), adm.R_CLOSING),  # CLOSE
    (dict(kind=EventKind.DESTROY), adm.R_DESTROY),
])
def test_events_that_must_not_touch_the_switch(kw, reason):
    core = connected()
    (cmd,) = core.conntrack_event(event(**kw))
    assert isinstance(cmd, cm.Ignored) and cmd.reason == reason
    assert not core.by_key


def test_ipv6_on_openflow10_stays_on_slow_path():
    core = connected(version=OFP10)
    (cmd,) = core.conntrack_event(event(family=6))
    assert cmd.reason == adm.R_IPV6_OF10
    assert types(core.conntrack_event(event(family=4))) == ["InstallFlows"]


def test_duplicates_are_suppressed_while_pending_and_active():
    core = connected()
    (install,) = core.conntrack_event(event())
    assert core.conntrack_event(event())[0].reason == adm.R_DUPLICATE  # pending
    core.flows_confirmed(install.conn, 101.0)
    assert core.conntrack_event(event())[0].reason == adm.R_DUPLICATE  # active, same entry


def test_stale_entry_recreated_for_an_active_shunt_is_deleted():
    core = connected()
    shunted(core)
    cmds = core.conntrack_event(event(ct_id=99))
    assert types(cmds) == ["DeleteConntrack", "Ignored"]
    assert cmds[0].ct_id == 99


def test_no_switch_means_no_action_until_connected_and_reconciled():
    core = c.Core(config())
    assert core.conntrack_event(event())[0].reason == adm.R_NO_SWITCH
    cmds = core.switch_connected(OFP13)
    assert types(cmds) == ["RequestKeptDefaults", "InstallDefaults", "LimitPacketIns", "RequestTableSize",
                           "RequestSwitchFlows"]
    assert core.conntrack_event(event())[0].reason == adm.R_NO_SWITCH  # not reconciled yet
    assert types(core.reconcile([], 0.0)) == ["ResyncConntrack"]
    assert types(core.conntrack_event(event())) == ["InstallFlows"]


def test_refused_flow_rolls_back_and_keeps_the_conntrack_entry():
    core = connected()
    (install,) = core.conntrack_event(event())
    cmds = core.flows_failed(install.conn, "table full")
    assert types(cmds) == ["RemoveFlows", "Refused"]
    assert not any(isinstance(x, cm.DeleteConntrack) for x in cmds)
    assert core.flows_confirmed(install.conn, 101.0) == []  # a late barrier changes nothing
    assert types(core.conntrack_event(event())) == ["InstallFlows"]  # a later event may retry


def test_switch_disconnect_abandons_pending_installs():
    core = connected()
    (install,) = core.conntrack_event(event())
    assert types(core.switch_disconnected()) == ["Refused"]
    assert core.conntrack_event(event())[0].reason == adm.R_NO_SWITCH


def test_removal_takes_the_pair_and_a_resumed_connection_is_shunted_again():
    core = connected()
    conn = shunted(core)
    cmds = handed_back(core.flow_removed(conn.cookie(True), "idle timeout", 5, 300, 10.0, 200.0))
    assert types(cmds) == ["RestoreConntrack", "RemoveFlows"] and cmds[1].directions == (False,)
    # The connection resumes through the slow path before the pair is gone: queued.
    assert core.conntrack_event(event(ct_id=50))[0].reason == adm.R_QUEUED
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


def test_half_removed_pair_has_its_removal_sent_again_and_is_forgotten_a_grace_later():
    """The switch may have lost the partner flow's removal (its flow would carry the tuple
    on, untracked) or only its flow-removed: the removal goes once more before the pair is
    forgotten."""
    core = connected()
    conn = shunted(core)
    core.flow_removed(conn.cookie(False), "idle timeout", 1, 1, 1, 200.0)
    core.conns.entry_back(conn, 200.0)  # (the kernel answered the entry's re-creation: the partner's removal went)
    assert core.tick(201.0) == []
    t = 200.0 + removal.REMOVAL_GRACE + 1
    (again,) = core.tick(t)
    assert types([again]) == ["RemoveFlows"] and again.directions == (True,) and again.reason == "idle timeout"
    assert core.tick(t + removal.REMOVAL_GRACE) == [] and core.find(tuple_=conn.orig) is conn
    (removed,) = core.tick(t + removal.REMOVAL_GRACE + 1)
    assert types([removed]) == ["Removed"] and removed.reason == removal.R_NOT_CONFIRMED
    assert not core.by_key
    # A removal begun since (a reconnect's hand-back) is sent again too before it is given up.
    other = shunted(core, sport=2, ct_id=2)
    core.remove(other, "flush", 300.0)
    # Its grace starts once its entry is back: a kernel answering late (a worker behind a
    # mass take-down) never has the removal sent again before the entry returns.
    assert core.tick(320.0) == [] and core.find(tuple_=other.orig) is other
    core.conns.entry_back(other, 320.0)
    assert types(core.tick(326.0)) == ["RemoveFlows"]
    core.conns.hand_back(other, "flush", 330.0)
    core.conns.entry_back(other, 330.5)
    assert types(core.tick(336.0)) == ["RemoveFlows"] and core.find(tuple_=other.orig) is other



def test_a_pairs_key_is_its_id_and_slot_and_slot_0_keeps_the_ids_own_int():
    """The table holds 100,000 pairs by key: slot 0's (the common case) is the id's own int
    object, not one more int a pair; every slot's key still names its id and slot."""
    ct_id = 3_000_000_000 + 7  # (an int Python does not keep shared itself)
    assert cookies.key(ct_id) is ct_id and cookies.key(ct_id, 0) is ct_id
    for slot in (0, 1, 15):
        k = cookies.key(ct_id, slot)
        assert k & 0xFFFFFFFF == ct_id and k >> cookies.KEY_SLOT_SHIFT == slot
        assert cookies.parse(cookies.make(cookies.Kind.SHUNT, k)) == (cookies.Kind.SHUNT, k, False)


def test_a_pair_is_found_by_either_direction_and_keeps_no_mirror_of_its_original():
    """100,000 pairs kept their reply tuples and indexed them: a mirror of the original is
    now made when asked for, and only a NAT pair's reply is kept and indexed."""
    core = connected()
    conn = shunted(core)
    assert conn._reply is None and conn.reply == conn.orig.reversed()
    assert list(core.conns.tuples) == [conn.orig]
    assert core.find(tuple_=conn.orig) is conn and core.find(tuple_=conn.reply) is conn
    assert core.find(tuple_=conn.orig._replace(sport=1)) is None
    # A NAT pair: its reply is not its original's mirror, so that mirror names no pair.
    orig = conn.orig._replace(sport=40001)
    reply = FlowTuple(4, orig.proto, orig.dst, "192.0.2.9", orig.dport, 61000)
    nat = cn.Conn(orig, reply, 8, conn.action, conn.ingress, conn.egress, 100.0)
    core.conns.remember(nat, 2)
    assert nat.translated and nat.reply is reply
    assert core.find(tuple_=reply) is nat and core.find(tuple_=orig) is nat
    assert core.find(tuple_=orig.reversed()) is None
    core.conns.forget(nat)
    assert core.find(tuple_=reply) is None and list(core.conns.tuples) == [conn.orig]

def test_a_plain_shunt_keeps_no_seldom_part_until_one_of_its_fields_is_set():
    """18 fields few pairs set live apart (connection.Seldom): a confirmed shunt has none;
    a field set to its default makes none; a take-down makes one."""
    core = connected()
    conn = shunted(core)
    assert conn._seldom is None and conn.watch is None and conn.hard_timeout == 0 and not conn.adopted
    conn.hard_timeout, conn.nat, conn.adopted = 0, None, False
    assert conn._seldom is None
    core.remove(conn, "flush", 102.0)
    core.conns.entry_back(conn, 102.5)
    assert conn._seldom is not None and conn.remove_reason == "flush" and conn.removing_since == 102.5
    assert conn.hard_timeout == 0 and conn.fins == 0  # the others still read as their defaults
    assert isinstance(cn.Conn.watch, cn._Seldom) and cn.Conn.watch.name == "watch"


def test_every_seldom_field_reads_the_same_default_with_or_without_its_part():
    """A seldom field's default is written twice (Seldom's field, the descriptor's argument):
    they must agree, or a pair would read one value before its part is made and another after."""
    from dataclasses import fields
    names = [f.name for f in fields(cn.Seldom)]
    assert names == [n for n, v in vars(cn.Conn).items() if isinstance(v, cn._Seldom)]
    made = cn.Seldom()
    for name in names:
        assert getattr(cn.Conn, name).default == getattr(made, name), name


def test_foreign_and_default_cookies_in_flow_removed_are_ignored():
    core = connected()
    assert core.flow_removed(0x1234, "idle timeout", 0, 0, 0, 0) == []
    assert core.flow_removed(cookies.make(cookies.Kind.DEFAULT), "delete", 0, 0, 0, 0) == []
    assert core.flow_removed(cookies.make(cookies.Kind.SHUNT, 12345), "delete", 0, 0, 0, 0) == []


def _remove_pair(core, conn, reason="idle timeout"):
    out = core.flow_removed(conn.cookie(False), reason, 1, 1, 1, 200.0)
    return out + core.flow_removed(conn.cookie(True), "delete", 1, 1, 1, 200.0)


def test_max_shunts_budget_keeps_the_connection_waiting_until_room_frees():
    core = connected(max_shunts=1)
    first = shunted(core)
    assert core.conntrack_event(event(sport=1, ct_id=8))[0].reason == adm.R_BUDGET
    assert list(core.waiting) == [event(sport=1).orig]
    out = _remove_pair(core, first)
    assert types(out) == ["RestoreConntrack", "Removed", "InstallFlows"]
    assert out[-1].conn.orig.sport == 1 and out[-1].conn.ct_id == 8 and not core.waiting


def test_a_waiting_connection_whose_entry_is_destroyed_is_forgotten():
    core = connected(max_shunts=1)
    first = shunted(core)
    core.conntrack_event(event(sport=1, ct_id=8))
    core.conntrack_event(event(sport=1, ct_id=8, kind=EventKind.DESTROY))
    assert types(_remove_pair(core, first)) == ["RestoreConntrack", "Removed"]


def test_a_block_evicts_the_newest_shunt_when_the_budget_is_full():
    core = connected(max_shunts=2)
    older = shunted(core, sport=1, ct_id=1)
    newer = shunted(core, sport=2, ct_id=2)
    out = handed_back(core.conntrack_event(event(sport=3, ct_id=3, action=2)))
    assert types(out) == ["RestoreConntrack", "RemoveFlows", "InstallFlows"]
    assert out[0].orig == newer.orig and out[0].tcp_state == cn.CT_TCP_ESTABLISHED  # evicted alive
    assert out[1].conn is newer and out[1].directions == (False, True)
    assert out[2].conn.action == "block"
    assert older.state is cn.State.DRAINING and newer.state is cn.State.TAKING_DOWN
    assert core.shunts + core.blocks == 2
    # The evicted pair leaving does not free budget twice.
    _remove_pair(core, newer)
    assert (core.shunts, core.blocks) == (1, 1)


def test_table_full_error_parks_the_connection_and_retries_it_when_a_pair_leaves():
    core = connected()
    first = shunted(core, sport=1, ct_id=1)
    (install,) = core.conntrack_event(event(sport=2, ct_id=2))
    out = core.flows_failed(install.conn, "switch error type=5 code=1", table_full=True)
    assert types(out) == ["RemoveFlows", "Refused"]  # entry kept: no DeleteConntrack
    assert list(core.waiting) == [install.conn.orig]
    out = _remove_pair(core, first)
    assert types(out)[-1] == "InstallFlows" and out[-1].conn.ct_id == 2


@pytest.mark.parametrize("how", ["table full", "queue full"])
def test_a_refused_install_waits_as_the_event_that_created_it(how):
    # The pair does not keep its event (memory); the retry is made again from the pair.
    core = connected()
    ev = event(sport=2, ct_id=2, kind=EventKind.NEW, state=2, received=99.5)
    (install,) = core.conntrack_event(ev)
    if how == "table full":
        core.flows_failed(install.conn, "switch error type=5 code=1", table_full=True)
    else:
        core.install_dropped(install.conn, "flow-mod queue full", wait=True)
    assert core.waiting[ev.orig] == ev


def test_a_block_refused_for_a_full_table_evicts_a_shunt_and_goes_first():
    core = connected()
    shunt = shunted(core, sport=1, ct_id=1)
    core.conntrack_event(event(sport=5, ct_id=5))
    core.flows_failed(core.find(tuple_=event(sport=5).orig), "full", table_full=True)
    (install,) = core.conntrack_event(event(sport=2, ct_id=2, action=2))
    out = handed_back(core.flows_failed(install.conn, "full", table_full=True))
    assert types(out) == ["RemoveFlows", "Refused", "RestoreConntrack", "RemoveFlows"] and out[3].conn is shunt
    assert list(core.waiting)[0] == install.conn.orig  # the block before the waiting shunt
    out = _remove_pair(core, shunt)
    assert out[-1].conn.action == "block"


def test_flush_takes_every_active_pair_down_and_removal_reports_the_reason():
    core = connected()
    a, b = shunted(core, sport=1, ct_id=1), shunted(core, sport=2, ct_id=2, action=2)
    out = handed_back(core.flush("policy changed", 150.0))
    # The TCP shunt's entry first; a block is not handed back (its next packet meets the firewall as it is).
    assert types(out) == ["RestoreConntrack", "RemoveFlows", "RemoveFlows"]
    assert {x.conn for x in out[1:]} == {a, b} and out[0].orig == a.orig
    removed = _remove_pair(core, a)
    assert [x.reason for x in removed if type(x).__name__ == "Removed"] == ["policy changed"]
    assert core.flush("again", 151.0) == []  # nothing active is left to take down


def test_the_second_direction_s_fin_ends_the_shunt():
    core = connected()
    conn = shunted(core)
    fin_reply = cookies.make_teardown(conn.ct_id, reply=True, rst=False)
    fin_orig = cookies.make_teardown(conn.ct_id, reply=False, rst=False)
    # The server closes first (the switch forwarded it): the shunt stays, the client may still send.
    assert core.teardown_packet(fin_reply, 3, 120.0) == []
    assert core.teardown_packet(fin_reply, 3, 120.1) == []  # retransmitted FIN
    assert conn.state is cn.State.DRAINING
    out = core.teardown_packet(fin_orig, 1, 120.2)
    assert types(out) == ["RestoreConntrack"]
    restore = out[0]
    assert restore.tcp_state == cn.CT_TCP_TIME_WAIT and restore.closer_is_reply  # the server closed first
    assert restore.mark == event().mark  # the entry's mark as the policy set it
    # The flows show the next packets first (close_watch.py), then go.
    assert types(restore.then) == ["WatchFlows", "Later"] and types(restore.then[1].commands) == ["WatchEnds"]
    watch = conn.watch
    assert types(core.watch_ends(conn, watch, 120.5)) == ["RemoveFlows"] and core.watch_ends(conn, watch, 120.6) == []
    # A late FIN while the pair is going: nothing restored twice.
    assert core.teardown_packet(fin_orig, 1, 120.3) == []
    removed = _remove_pair(core, conn, "delete")
    assert [x.reason for x in removed if type(x).__name__ == "Removed"] == ["tcp fin"]


def test_a_close_caught_before_the_barrier_reply_is_taken_once_the_flows_are_confirmed():
    # The catchers forward as soon as the switch has them: a short connection can close
    # before the controller has the barrier reply. Dropping those FINs left the shunt on the
    # switch until its idle timeout (seen on the testbed: 3 of 20 quick closes).
    core = connected()
    (install,) = core.conntrack_event(event())
    conn = install.conn
    assert core.teardown_packet(cookies.make_teardown(conn.ct_id, False, False), 1, 1.0) == []
    assert core.teardown_packet(cookies.make_teardown(conn.ct_id, True, False), 3, 1.0) == []
    assert conn.state is cn.State.PENDING and conn.fins == 0  # nothing happens before the confirmation
    out = core.flows_confirmed(conn, 1.1)
    kinds = [type(x).__name__ for x in out]
    assert kinds == ["Installed", "RestoreConntrack"]  # its entry, never deleted, goes to TIME_WAIT
    assert conn.state is cn.State.TAKING_DOWN and out[1].tcp_state == cn.CT_TCP_TIME_WAIT
    assert [type(x).__name__ for x in out[1].then] == ["WatchFlows", "Later"]


def test_one_fin_before_the_barrier_reply_is_remembered_and_the_shunt_goes_on():
    core = connected()
    (install,) = core.conntrack_event(event())
    conn = install.conn
    core.teardown_packet(cookies.make_teardown(conn.ct_id, True, False), 3, 1.0)  # a half-close
    out = core.flows_confirmed(conn, 1.1)
    assert conn.state is cn.State.DRAINING and conn.fins == 2 and conn.early is None
    assert [type(x).__name__ for x in out] == ["Installed", "Later"]  # its entry goes after the drain
    assert isinstance(out[1].commands[0], cm.EntryDue)
    (restore,) = core.teardown_packet(cookies.make_teardown(conn.ct_id, False, False), 1, 2.0)
    assert isinstance(restore, cm.RestoreConntrack) and restore.tcp_state == cn.CT_TCP_TIME_WAIT


def test_rst_restores_a_closed_entry_after_a_grace_and_strange_packet_ins_are_not_ours():
    core = connected()
    conn = shunted(core)
    watch, later = core.teardown_packet(cookies.make_teardown(conn.ct_id, False, True), 1, 1.0)
    # Data still in flight towards the side that reset stays on the fast path a moment, its
    # packets shown to the controller (close_watch.py).
    assert type(watch).__name__ == "WatchFlows" and conn.watch.forwarding
    assert type(later).__name__ == "Later" and later.delay == 0.5 and conn.state is cn.State.TAKING_DOWN
    (ends,) = later.commands
    (restore,) = core.watch_ends(ends.conn, ends.watch, 1.5)
    assert restore.tcp_state == cn.CT_TCP_CLOSE and restore.timeout == 10
    assert types(restore.then) == ["RemoveFlows"]  # watched already
    nograce = connected(rst_grace=0)
    conn0 = shunted(nograce)
    out = nograce.teardown_packet(cookies.make_teardown(conn0.ct_id, False, True), 1, 1.0)
    assert types(out) == ["RestoreConntrack"]
    assert core.teardown_packet(cookies.make_teardown(999, False, False), 1, 1.0) is None  # orphan catcher
    assert core.teardown_packet(cookies.make(cookies.Kind.SHUNT, conn.ct_id), 1, 1.0) is None  # not a catcher
    other = shunted(core, sport=2, ct_id=8)
    # A catcher's cookie arriving from the wrong port is not that connection's packet.
    assert core.teardown_packet(cookies.make_teardown(other.ct_id, False, False), 3, 1.0) is None



def test_catchers_that_counted_end_shunts_their_dropped_packet_ins_would_have():
    core = connected()
    closed, half, reset, already = (shunted(core, sport=n, ct_id=n) for n in (1, 2, 3, 4))
    assert core.teardown_packet(cookies.make_teardown(already.ct_id, False, False), 1, 1.0) == []  # heard live
    counted = [cookies.make_teardown(1, False, False), cookies.make_teardown(1, True, False),  # both FINs
               cookies.make_teardown(2, True, False),  # one FIN: a half-close, the shunt stays
               cookies.make_teardown(3, True, True),  # an RST
               cookies.make_teardown(4, True, False),  # the FIN that completes one heard live
               cookies.make_teardown(999, False, False),  # a catcher of no connection of ours
               cookies.make(cookies.Kind.SHUNT, 2)]  # not a catcher
    out, ended = core.catchers_counted(counted, 2.0)
    assert ended == 3
    assert (closed.state, half.state, reset.state, already.state) == (
        cn.State.TAKING_DOWN, cn.State.DRAINING, cn.State.TAKING_DOWN, cn.State.TAKING_DOWN)
    assert types(out) == ["RestoreConntrack", "WatchFlows", "Later", "RestoreConntrack"]
    assert out[0].tcp_state == cn.CT_TCP_TIME_WAIT and not out[0].closer_is_reply
    # The same counters read again (the next sweep) change nothing.
    assert core.catchers_counted(counted, 4.0) == ([], 0) and half.fins == 2


def test_reconcile_keeps_catchers_of_live_pairs_and_deletes_orphan_ones():
    core = connected()
    conn = shunted(core)
    flows = _flows_for(conn) + [
        SwitchFlow(cookies.make_teardown(conn.ct_id, False, False), 33001, 1, conn.orig, None),
        SwitchFlow(cookies.make_teardown(4242, True, True), 33001, 3, conn.reply, None)]
    core.switch_connected(OFP13)
    out = core.reconcile(flows, 300.0)
    deletes = [x for x in out if type(x).__name__ == "DeleteSwitchFlow"]
    assert [cookies.parse(d.flow.cookie)[1] for d in deletes] == [4242]


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
    fresh.switch_connected(OFP13)
    cmds = fresh.reconcile(flows, 5.0)
    assert types(cmds) == ["DeleteSwitchFlow", "DeleteSwitchFlow", "ResyncConntrack"]
    assert fresh.find(tuple_=conn.orig).state is cn.State.LIVE  # adopted, not bounced
    assert fresh.find(tuple_=orphan.orig) is None
    # The adopted shunt's removal is handled like any other.
    (restore,) = fresh.flow_removed(conn.cookie(False), "idle timeout", 1, 1, 1, 9.0)
    assert types(restore.then) == ["RemoveFlows"]


def test_reconcile_reinstalls_what_the_switch_lost():
    core = connected()
    conn = shunted(core)
    core.switch_disconnected()
    core.switch_connected(OFP13)
    cmds = core.reconcile([], 300.0)
    assert types(cmds) == ["InstallFlows", "ResyncConntrack"] and cmds[0].conn is conn


def test_a_pair_the_switch_timed_out_while_away_is_handed_back_and_one_it_lost_installed_again():
    """No flow-removed reaches a controller that is away. A switch that kept its table (its
    defaults there before they were sent again) removed the pair itself: it is handed back
    as that flow-removed would have (the connection may have ended; a new one on its ports
    must meet the firewall). A switch that lost its table (a reboot) gets it back."""
    from nfshunt.core import reconcile
    core = connected(drain=0)
    conn = shunted(core)  # LIVE: its entry deleted
    core.switch_disconnected()
    assert types(core.switch_connected(OFP13))[0] == "RequestKeptDefaults"  # asked before the defaults go
    core.defaults_kept([SwitchFlow(cookies.make(cookies.Kind.DEFAULT), 1, 1, None, 2)])
    out = handed_back(core.reconcile([], 300.0))
    assert types(out) == ["RestoreConntrack", "RemoveFlows", "Removed", "ResyncConntrack"]
    restore = out[0]
    # Re-evaluated (300 s; a resuming connection's traffic renews it): its close may have gone unheard.
    assert (restore.tcp_state, restore.timeout) == (cn.CT_TCP_ESTABLISHED, cn.REEVALUATE_TIMEOUT)
    assert out[2].reason == reconcile.R_TIMED_OUT_AWAY and core.find(tuple_=conn.orig) is None
    # The same with a switch that came back empty, or with only another firewall's defaults
    # (the pair's peer's ports): installed again.
    for found in ([], [SwitchFlow(cookies.make(cookies.Kind.DEFAULT), 1, 9, None, 10)]):
        again = shunted(core, sport=2, ct_id=2)
        core.switch_disconnected()
        core.switch_connected(OFP13)
        core.defaults_kept(found)
        assert types(core.reconcile([], 400.0)) == ["InstallFlows", "ResyncConntrack"]
        assert again.state is cn.State.PENDING
        core.flows_confirmed(again, 401.0)
        _remove_pair(core, again)


def test_whether_the_switch_kept_its_table_is_asked_only_where_the_answer_means_it():
    """Not asked with no defaults to find, on OpenFlow 1.0 (no cookie filter), or where the
    controller wipes the switch itself at connect; unknown, a lost pair is installed again."""
    assert "RequestKeptDefaults" not in types(c.Core(config(default_no_shunting=False)).switch_connected(OFP13))
    assert "RequestKeptDefaults" not in types(c.Core(config()).switch_connected(OFP10))
    wipe = types(c.Core(config(delete_foreign_flows_on_startup=True)).switch_connected(OFP13))
    assert wipe[0] == "DeleteAllFlows" and "RequestKeptDefaults" not in wipe


def test_reconcile_keeps_owned_flows_when_startup_deletion_is_off():
    core = c.Core(config(delete_flows_on_startup=False))
    core.switch_connected(OFP13)
    conn = shunted(connected())
    cmds = core.reconcile(_flows_for(conn)[:1], 0.0)
    assert types(cmds) == ["DeleteSwitchFlow", "ResyncConntrack"]  # unaccountable half pair
    core2 = c.Core(config(delete_flows_on_startup=False))
    core2.switch_connected(OFP13)
    assert types(core2.reconcile(_flows_for(conn), 0.0)) == ["ResyncConntrack"]


def test_foreign_wipe_only_on_request():
    core = c.Core(config(delete_foreign_flows_on_startup=True))
    assert types(core.switch_connected(OFP10))[0] == "DeleteAllFlows"


def test_stale_entry_recreated_in_reverse_direction_is_deleted_even_unmarked():
    core = connected()
    conn = shunted(core)
    ev = event(ct_id=77, mark=0x61200000)
    from dataclasses import replace
    reversed_ev = replace(ev, orig=conn.reply, reply=conn.orig)
    cmds = core.conntrack_event(reversed_ev)
    assert types(cmds) == ["DeleteConntrack", "Ignored"] and cmds[0].ct_id == 77


def test_entries_recreated_by_in_flight_packets_are_swept_once_by_tuple():
    core = connected(drain=0)
    (install,) = core.conntrack_event(event())
    core.flows_confirmed(install.conn, 100.0)
    assert core.tick(100.5) == []
    cmds = core.tick(100.0 + confirmation.SWEEP_AFTER)
    assert types(cmds) == ["DeleteConntrack"] and cmds[0].ct_id is None
    assert core.tick(110.0) == []


def test_unshunt_pin_removes_the_pair_and_keeps_the_reappearing_entry_on_the_slow_path():
    core = connected()
    conn = shunted(core)
    out = handed_back(core.pin(conn.orig, cn.Action.IGNORE, 200.0))
    assert types(out) == ["RestoreConntrack", "RemoveFlows"] and out[1].reason == "unshunt by operator"
    _remove_pair(core, conn)
    # Its next packet re-creates the entry (loose pickup), seen from either direction.
    (cmd,) = core.conntrack_event(event(ct_id=70))
    assert cmd.reason == adm.R_PINNED
    # The connection ending ends the pin: a later connection on the tuple is shunted again.
    core.conntrack_event(event(ct_id=70, kind=EventKind.DESTROY))
    assert types(core.conntrack_event(event(ct_id=72))) == ["InstallFlows"]


def test_an_unshunted_connection_that_closes_frees_its_tuple_for_the_next_even_with_the_same_id():
    """A SYN on a TIME_WAIT entry starts a new connection, and the kernel may give it the old
    entry's id; the unshunt was of the connection that closed, not of the tuple (CI-9 of
    session 46: iperf3 reused a client port and an hour-long pin held the new transfer)."""
    core = connected()
    conn = shunted(core)
    handed_back(core.pin(conn.orig, cn.Action.IGNORE, 200.0))
    _remove_pair(core, conn)
    (cmd,) = core.conntrack_event(event(ct_id=70))
    assert cmd.reason == adm.R_PINNED
    core.conntrack_event(event(ct_id=70, state=4))  # FIN_WAIT: half-closed, still pinned
    assert core.conntrack_event(event(ct_id=70))[0].reason == adm.R_PINNED
    core.conntrack_event(event(ct_id=70, state=7))  # TIME_WAIT: over
    assert types(core.conntrack_event(event(ct_id=70, kind=EventKind.NEW))) == ["InstallFlows"]


def test_block_pin_turns_a_shunt_into_a_block_and_expires():
    core = connected()
    conn = shunted(core)
    out = core.pin(conn.orig, cn.Action.BLOCK, 200.0)
    assert types(handed_back(out)) == ["RestoreConntrack", "RemoveFlows", "ResyncConntrack"]
    assert core.conntrack_event(event(ct_id=80))[0].reason == adm.R_QUEUED
    out = _remove_pair(core, conn)
    install = [x for x in out if type(x).__name__ == "InstallFlows"]
    assert install and install[0].conn.action == "block"
    core.tick(200.0 + pins.PIN_TTL + 1)
    assert not core.pins


def test_stopping_takes_every_pair_down_and_installs_nothing_more():
    core = connected(max_shunts=1)
    conn = shunted(core)
    core.conntrack_event(event(sport=9, ct_id=9))  # waits for budget
    out = handed_back(core.stopping(150.0, take_down=True))
    assert types(out) == ["RestoreConntrack", "RemoveFlows"] and out[1].conn is conn
    removed = _remove_pair(core, conn)
    assert "InstallFlows" not in types(removed)  # the waiting one is not shunted on the way out
    assert core.conntrack_event(event(sport=10, ct_id=10))[0].reason == adm.R_NO_SWITCH


# --- trust, policy changes, collisions (issue 11) ---------------------------------------------

def test_a_pair_adopted_from_a_switch_is_never_installed_again():
    """A peer that posed as the switch reported a pair; on the real switch it is absent:
    forgotten, not re-installed (only policy decisions are ever installed)."""
    conn = shunted(connected(), sport=2222, ct_id=0x1234)
    core = c.Core(config())
    core.switch_connected(OFP13)
    core.reconcile(_flows_for(conn), 1.0)
    assert core.find(tuple_=conn.orig).adopted
    core.switch_disconnected()
    core.switch_connected(OFP13)
    out = handed_back(core.reconcile([], 2.0))
    # Its connection, if it lives, is back on the firewall: the entry comes back first.
    assert types(out) == ["RestoreConntrack", "RemoveFlows", "Removed", "ResyncConntrack"]
    assert core.find(tuple_=conn.orig) is None
    # A policy decision, by contrast, is re-installed after the same loss.
    mine = shunted(core, sport=5)
    core.switch_disconnected()
    core.switch_connected(OFP13)
    assert types(core.reconcile([], 3.0)) == ["InstallFlows", "ResyncConntrack"]
    assert core.find(tuple_=mine.orig).state is cn.State.PENDING


def test_a_switch_pair_under_our_cookie_with_another_tuple_is_not_taken_for_ours():
    core = connected()
    conn = shunted(core)
    other = shunted(connected(), sport=9)  # same ct_id 7, another tuple
    core.switch_disconnected()
    core.switch_connected(OFP13)
    out = core.reconcile(_flows_for(other), 5.0)
    assert types(out).count("DeleteSwitchFlow") == 2 and "InstallFlows" in types(out)
    assert [x.conn for x in out if type(x).__name__ == "InstallFlows"] == [conn]


def test_connections_whose_conntrack_ids_collide_are_shunted_side_by_side():
    """Issue 26.5: ids are a 32-bit hash (1 collision in a 100,000 burst, measured); a second
    live entry of one id takes the next slot, its cookies name it apart, and each pair's
    feedback touches only itself."""
    core = connected()
    first = shunted(core, sport=1, ct_id=42)
    (install,) = core.conntrack_event(event(sport=2, ct_id=42))  # another connection, the same id
    second = install.conn
    assert (first.slot, second.slot) == (0, 1) and len({first.cookie(False), second.cookie(False)}) == 2
    assert cookies.parse(second.cookie(True)) == (cookies.Kind.SHUNT, second.key, True)
    core.flows_confirmed(second, 101.0)
    assert core.find(ct_id=42) is first and core.by_key == {first.key: first, second.key: second}
    # The first pair's removal touches only the first; the second lives on, and its FIN is its own.
    _remove_pair(core, first)
    assert core.by_key == {second.key: second} and second.state is cn.State.DRAINING
    fin = cookies.make_teardown(second.key, reply=False, rst=True)
    assert core.teardown_packet(fin, 1, 130.0) and second.state is cn.State.TAKING_DOWN
    # A third connection of the id takes the freed slot 0.
    (third,) = core.conntrack_event(event(sport=3, ct_id=42))
    assert third.conn.slot == 0


def test_a_waiting_event_is_counted_as_ignored_once_not_at_every_retry():
    core = connected(max_shunts=1)
    first = shunted(core, sport=1, ct_id=42)
    (ignored,) = core.conntrack_event(event(sport=2, ct_id=43))
    assert ignored.reason == adm.R_BUDGET
    for _ in range(3):  # the queue drained, but the budget is still full: it waits on, uncounted
        assert core.room_freed(5) == [] and len(core.waiting) == 1
    installs = [x for x in _remove_pair(core, first) if type(x).__name__ == "InstallFlows"]
    assert [x.conn.orig.sport for x in installs] == [2]


def test_one_pair_per_key_whatever_its_kind():
    """Pairs are kept by key (conntrack id and slot): a block whose id a live shunt holds
    takes the next slot, and a switch that carries a shunt and a block under one key keeps
    one of them (the other's flows go; its connection is judged on the slow path again)."""
    core = connected()
    shunt = shunted(core, sport=1, ct_id=42)
    (install,) = core.conntrack_event(event(sport=2, ct_id=42, action=2))
    assert install.conn.slot == 1 and install.conn.kind is cookies.Kind.BLOCK
    other = c.Core(config())
    other.switch_connected(OFP13)
    other.reconcile([], 0.0)
    (install,) = other.conntrack_event(event(sport=2, ct_id=42, action=2))
    block = install.conn
    fresh = c.Core(config())
    fresh.switch_connected(OFP13)
    out = fresh.reconcile(_flows_for(shunt) + _flows_for(block, out_fwd=None, out_rev=None), 5.0)
    deleted = [x.flow.cookie for x in out if type(x).__name__ == "DeleteSwitchFlow"]
    assert sorted(deleted) == sorted([block.cookie(False), block.cookie(True)])
    assert fresh.by_key[42].action == "shunt" and fresh.find(tuple_=shunt.orig).adopted


def test_a_nat_entry_stays_on_the_slow_path():
    from dataclasses import replace

    from nfshunt.records.model import FlowTuple
    core = connected()
    ev = event()
    nat = replace(ev, reply=FlowTuple(4, ev.orig.proto, "192.0.2.9", ev.orig.src, ev.orig.dport, ev.orig.sport))
    out = core.conntrack_event(nat)
    assert types(out) == ["Ignored"] and out[0].reason == adm.R_NAT


def test_a_flush_while_the_switch_is_away_holds_when_it_returns():
    core = connected()
    conn = shunted(core)
    core.switch_disconnected()
    # The entry comes back now; the removal is not sent: no switch.
    assert types(handed_back(core.flush("flush by operator", 10.0))) == ["RestoreConntrack", "RemoveFlows"]
    assert core.tick(100.0) == []  # the removal waits for the switch, however long
    core.switch_connected(OFP13)
    out = handed_back(core.reconcile(_flows_for(conn), 101.0))
    assert types(out) == ["RestoreConntrack", "RemoveFlows", "ResyncConntrack"]  # not adopted again
    _remove_pair(core, conn, "delete")
    assert core.find(tuple_=conn.orig) is None
    # And when the switch lost the pair meanwhile, the removal simply completes.
    other = shunted(core, sport=3)
    core.switch_disconnected()
    core.flush("again", 200.0)
    core.switch_connected(OFP13)
    out = core.reconcile([], 201.0)
    assert types(out) == ["RemoveFlows", "Removed", "ResyncConntrack"] and core.find(tuple_=other.orig) is None


def test_a_removal_the_switch_half_holds_at_a_reconnect_takes_the_half_left():
    """A shunt's reply flow idled out and its partner's removal went nowhere (the link
    dropped): the switch still has half the pair. Forgotten at the reconcile, that half
    would carry one direction past the firewall until it idles out too, wherever
    delete_flows_on_startup does not delete it as an orphan."""
    core = connected(delete_flows_on_startup=False)
    conn = shunted(core)
    assert types(handed_back(core.flow_removed(conn.cookie(True), "idle timeout", 1, 1, 1, 200.0))) == \
        ["RestoreConntrack", "RemoveFlows"]
    core.switch_disconnected()
    core.switch_connected(OFP13)
    out = core.reconcile(_flows_for(conn)[:1], 300.0)
    assert types(out) == ["RemoveFlows", "Removed", "ResyncConntrack"] and out[0].conn is conn
    assert core.find(tuple_=conn.orig) is None


def test_a_pending_pair_is_taken_down_as_soon_as_it_is_confirmed_and_keeps_its_entry():
    core = connected()
    (install,) = core.conntrack_event(event())
    assert core.flush("policy changed", 100.0) == []
    out = handed_back(core.flows_confirmed(install.conn, 100.001))
    # No DeleteConntrack: the firewall keeps tracking it, its decision cleared.
    assert types(out) == ["RestoreConntrack", "RemoveFlows"]


FIN_WAIT, TIME_WAIT = 4, 7  # conntrack TCP states


def test_a_connection_that_closes_on_the_firewall_while_its_shunt_goes_in_loses_the_shunt():
    """Its FINs crossed the firewall before the switch carried it (the update events say
    so): the shunt would outlive it and carry a later connection on its ports past the
    firewall. It goes once confirmed, and the entry tracking the close is left as it is;
    its flows are watched first (a forged FIN reaches the firewall too: close_watch.py)."""
    core = connected()
    (install,) = core.conntrack_event(event())
    out = core.conntrack_event(event(state=FIN_WAIT))  # the same entry, closing
    assert types(out) == ["Ignored"] and out[0].reason == adm.R_CLOSING
    out = core.flows_confirmed(install.conn, 100.001)
    # No DeleteConntrack, and no RestoreConntrack that would bring the entry back to ESTABLISHED;
    # a shorter life (part of the close may have taken the switch, leaving it FIN_WAIT).
    assert types(out) == ["ShortenConntrack", "WatchFlows", "Later"]
    assert (out[0].ct_id, out[0].timeout) == (install.conn.ct_id, cn.SPLIT_CLOSE_TIMEOUT)
    out = watch_ended(core, out, 100.201)
    assert types(out) == ["RemoveFlows"] and out[0].reason == adm.R_CLOSED_ON_FIREWALL
    (removed,) = [x for x in _remove_pair(core, install.conn, "delete") if type(x).__name__ == "Removed"]
    assert removed.reason == adm.R_CLOSED_ON_FIREWALL and core.find(tuple_=install.conn.orig) is None


@pytest.mark.parametrize("why", ["openflow 1.0", "no tcp_teardown", "no packet-in meter", "an rst"])
def test_a_close_on_the_firewall_is_not_watched_where_it_cannot_be_or_an_rsts_side_is_unknown(why):
    """The watch needs what the catchers need (OpenFlow 1.3, tcp_teardown, the packet-in
    meter): without it the pair goes at once, as before. An RST seen on the firewall (CLOSE)
    is not watched either: the data of the side that did not reset would contradict it."""
    version = OFP10 if why == "openflow 1.0" else OFP13
    kw = {"tcp_teardown": False} if why == "no tcp_teardown" else {}
    if why == "no packet-in meter":
        kw["packet_in_rate"] = 0
    core = connected(version, **kw)
    (install,) = core.conntrack_event(event())
    core.conntrack_event(event(state=cn.CT_TCP_CLOSE if why == "an rst" else FIN_WAIT))
    out = core.flows_confirmed(install.conn, 100.001)
    assert types(out) == ["ShortenConntrack", "RemoveFlows"] and out[1].reason == adm.R_CLOSED_ON_FIREWALL


def test_a_draining_shunt_whose_entry_closes_goes_and_its_entry_is_not_deleted():
    core = connected(drain=0.5)
    (install,) = core.conntrack_event(event())
    conn = install.conn
    core.flows_confirmed(conn, 100.001)
    assert conn.state is cn.State.DRAINING
    out = core.conntrack_event(event(state=TIME_WAIT, kind=EventKind.UPDATE))
    assert types(out) == ["ShortenConntrack", "WatchFlows", "Later", "Ignored"]
    assert types(watch_ended(core, out, 100.3)) == ["RemoveFlows"]
    assert core.entry_due(conn, 100.6) == []  # the entry tracking the close stays
    # Another entry's closing update (the id of another live entry) takes nothing down.
    other = shunted(core, sport=2, ct_id=9)
    assert types(core.conntrack_event(event(sport=2, ct_id=10, state=FIN_WAIT))) == ["DeleteConntrack", "Ignored"]
    assert other.state is cn.State.DRAINING


def test_a_live_shunt_told_late_of_a_close_on_the_firewall_goes_and_is_not_shunted_again():
    """With no drain the entry may be deleted before the close's events are read: the
    shunt still goes, its entry re-created in the closing state reported with the decision
    kept. Its last packets are not judged again (an ESTABLISHED entry with the decision
    cleared was marked again by them and shunted once the pair had gone)."""
    from nfshunt.records import markcodec
    core = connected(drain=0)
    conn = shunted(core)
    assert conn.state is cn.State.LIVE and conn.entry_deleted
    out = handed_back(core.conntrack_event(event(state=FIN_WAIT)))
    assert types(out) == ["RestoreConntrack", "WatchFlows", "Later", "Ignored"]
    restore = out[0]
    assert (restore.tcp_state, restore.timeout) == (FIN_WAIT, 120)
    assert restore.mark & markcodec.DECISION_MASK == conn.mark & markcodec.DECISION_MASK
    assert types(watch_ended(core, out, 101.3)) == ["RemoveFlows"]
    # The re-created entry (another id) reports its close: nothing waits to be shunted.
    assert core.conntrack_event(event(ct_id=70, state=TIME_WAIT))[0].reason == adm.R_CLOSING
    assert "InstallFlows" not in types(_remove_pair(core, conn))


def test_a_pending_shunt_that_closed_on_the_firewall_and_found_no_room_is_not_retried():
    core = connected()
    (install,) = core.conntrack_event(event())
    core.conntrack_event(event(state=FIN_WAIT))
    out = core.flows_failed(install.conn, "table full", True, 100.1)
    assert "Refused" in types(out) and not core.waiting
    assert core.room_freed(1) == []


def test_a_connection_that_waited_for_room_and_closed_is_not_shunted_when_room_frees():
    core = connected(max_shunts=1)
    first = shunted(core)
    assert core.conntrack_event(event(sport=1, ct_id=8))[0].reason == adm.R_BUDGET
    core.conntrack_event(event(sport=1, ct_id=8, state=TIME_WAIT))
    assert not core.waiting
    assert "InstallFlows" not in types(_remove_pair(core, first))


def test_a_close_seen_while_a_take_down_waits_keeps_the_take_down_reason():
    core = connected()
    (install,) = core.conntrack_event(event())
    core.flush("policy changed", 100.0)
    core.conntrack_event(event(state=FIN_WAIT))
    out = watch_ended(core, core.flows_confirmed(install.conn, 100.001), 100.201)
    assert types(out) == ["RemoveFlows"] and out[0].reason == "policy changed"


def test_a_flush_forgets_connections_waiting_for_room():
    core = connected(max_shunts=1)
    shunted(core, sport=1, ct_id=1)
    core.conntrack_event(event(sport=2, ct_id=2))
    assert len(core.waiting) == 1
    core.flush("policy changed", 5.0)
    assert not core.waiting


def test_reevaluation_recreates_a_tcp_entry_with_the_decision_cleared_before_the_flows_go():
    from nfshunt.records import markcodec
    core = connected()
    tcp = shunted(core, sport=1, ct_id=1)
    udp = shunted(core, sport=2, ct_id=2, proto=UDP)
    out = core.flush("policy changed", 5.0)
    restore, remove = out
    assert type(restore).__name__ == "RestoreConntrack" and restore.orig == tcp.orig
    assert restore.tcp_state == cn.CT_TCP_ESTABLISHED and types(restore.then) == ["RemoveFlows"]
    assert restore.mark & markcodec.DECISION_MASK == 0 and restore.mark & markcodec.FLAG_INGRESS
    assert restore.mark & 0xFFFF == event().mark & 0xFFFF  # the admin's bits are kept
    assert type(remove).__name__ == "RemoveFlows" and remove.conn is udp  # UDP: picked up afresh


def test_blocks_evict_shunts_only_up_to_their_share_of_the_budget():
    core = connected(max_shunts=4, max_block_share=0.5)
    for i in range(4):
        shunted(core, sport=i + 1, ct_id=i + 1)
    for i in range(2):  # two blocks may push two shunts out ...
        out = core.conntrack_event(event(sport=100 + i, ct_id=100 + i, action=2))
        assert types(out) == ["RestoreConntrack", "InstallFlows"]
        core.flows_confirmed(out[1].conn, 102.0)
    out = core.conntrack_event(event(sport=102, ct_id=102, action=2))  # ... a third waits
    assert types(out) == ["Ignored"] and out[0].reason == adm.R_BUDGET
    assert core.blocks == 2 and len(core.waiting) == 1


def test_the_switch_is_asked_to_rate_limit_packet_ins_on_openflow13_only():
    core = c.Core(config(packet_in_rate=300))
    assert [x.rate for x in core.switch_connected(OFP13) if type(x).__name__ == "LimitPacketIns"] == [300]
    assert "LimitPacketIns" not in types(core.switch_connected(OFP10))
    assert "LimitPacketIns" not in types(c.Core(config(packet_in_rate=0)).switch_connected(OFP13))


def test_the_budget_is_derived_from_the_switch_table_size_when_max_shunts_is_unset():
    core = connected()
    assert core.budget == 0
    # 2 port groups: 4 default entries; a TCP shunt with catchers takes 6.
    assert core.table_size(4 + 6 * 10 + 5) == 10 and core.budget == 10
    conn = shunted(core)
    assert core.entries == 6 and conn.entries == 6
    shunted(core, sport=2, ct_id=2, proto=UDP)
    assert core.entries == 8
    _remove_pair(core, conn)
    assert core.entries == 2
    pinned = connected(max_shunts=3)
    assert pinned.table_size(1000) is None and pinned.budget == 3 and pinned.table_max == 1000
    assert connected(OFP10).table_size(4 + 20) == 10  # no catchers on OpenFlow 1.0


PAIR_CFG = dict(openflow_versions=["1.3"], delete_flows_on_startup=False, delete_flows_on_shutdown=False,
                pair={"state_file": "/nonexistent/pair.json"})


def test_a_pair_member_takes_over_the_peers_pairs_and_removes_only_the_peers_defaults():
    peer = connected()
    conn = shunted(peer)
    flows = _flows_for(conn) + [
        SwitchFlow(cookies.make(cookies.Kind.DEFAULT), 100, 1, None, 2),  # ours (fast 1 <-> slow 2)
        SwitchFlow(cookies.make(cookies.Kind.DEFAULT), 100, 6, None, 1),  # the peer's slow port
    ]
    core = c.Core(config(**PAIR_CFG))
    assert core.backup
    assert types(core.conntrack_event(event())) == ["Ignored"]
    assert core.conntrack_event(event())[0].reason == adm.R_BACKUP
    assert types(core.switch_connected(OFP13)) == ["RequestKeptDefaults", "InstallDefaults", "LimitPacketIns",
                                                     "RequestTableSize", "RequestSwitchFlows"]
    cmds = core.reconcile(flows, 5.0)
    # With delete_flows_on_startup off, still: a default from another firewall's port goes.
    assert types(cmds) == ["DeleteSwitchFlow", "ResyncConntrack"] and cmds[0].flow.in_port == 6
    adopted = core.find(tuple_=conn.orig)
    assert adopted.adopted and adopted.state is cn.State.LIVE
    # A committed entry of the adopted shunt (conntrackd's copy, a new id) is deleted again.
    assert types(core.conntrack_event(event(ct_id=99))) == ["DeleteConntrack", "Ignored"]


def test_standing_by_forgets_every_pair_without_touching_the_switch():
    core = c.Core(config(**PAIR_CFG))
    core.switch_connected(OFP13)
    core.reconcile([], 0.0)
    active = shunted(core)
    (pending,) = core.conntrack_event(event(sport=2, ct_id=8))
    out = core.stand_by()
    assert types(out) == ["Refused"] and out[0].conn is pending.conn  # its entry stays on the slow path
    assert not any(isinstance(x, cm.RemoveFlows) for x in out)
    assert core.by_key == {} and core.shunts == 0 and core.entries == 0 and core.backup
    assert core.conntrack_event(event(sport=3, ct_id=9))[0].reason == adm.R_BACKUP
    assert core.flow_removed(active.cookie(False), "idle timeout", 1, 1, 1, 9.0) == []


def test_an_idled_out_tcp_shunt_gets_its_entry_back_before_the_partner_flow_goes():
    from nfshunt.records import markcodec
    core = connected(drain=0)
    conn = shunted(core)
    (restore,) = core.flow_removed(conn.cookie(True), "idle timeout", 3, 300, 10.0, 120.0)
    # ESTABLISHED with the decision cleared: a firewall without loose pickup lets the next
    # packet through, and the policy judges (and shunts) it again.
    assert restore.tcp_state == cn.CT_TCP_ESTABLISHED and restore.timeout == cn.IDLE_RESTORE_TIMEOUT
    assert restore.mark & markcodec.DECISION_MASK == 0 and restore.mark & markcodec.NFSHUNT_BITS
    assert types(restore.then) == ["RemoveFlows"] and restore.then[0].directions == (False,)
    udp = shunted(core, proto=UDP, sport=9, ct_id=9)
    assert types(core.flow_removed(udp.cookie(False), "idle timeout", 1, 1, 1.0, 121.0)) == ["RemoveFlows"]


# --- the pipeline layout -------------------------------------------------------------------

def _table_1(ports=None):
    """The table-1 flows of the test config's two port groups (fast ports 1 and 3)."""
    return [SwitchFlow(cookies.make_pipeline(i, catcher, rst), 2 if catcher else 1, None, None, fast)
            for i, fast in enumerate(ports or (1, 3)) for catcher, rst in
            ((False, False), (True, False), (True, False), (True, True), (True, True))]


def test_pipeline_layout_counts_two_entries_a_tcp_shunt_and_its_shared_table():
    core = c.Core(config())
    cmds = core.switch_connected(OFP13, pipeline=True)
    assert "InstallPipeline" in types(cmds)
    core.reconcile(_table_1(), 0.0)
    shunted(core)
    assert core.entries == 2 and core.max_pair_entries() == 2
    assert core.default_entries() == 4 and core.shared_entries() == layout.PIPELINE_ENTRIES * 2
    assert core.table_size(4 + 2 * 10) == 10  # table 1 is a table of its own
    single = connected()
    shunted(single)
    assert single.entries == 6 and "InstallPipeline" not in types(single.switch_connected(OFP13))


def _pipeline_flows_for(conn, goto=True):
    return [SwitchFlow(conn.cookie(False), 33000, 1, conn.orig, 3, goto=goto),
            SwitchFlow(conn.cookie(True), 33000, 3, conn.reply, 1, goto=goto)]


def test_reconcile_adopts_only_pairs_of_the_layout_in_use():
    old = connected()
    conn = shunted(old)
    piped = c.Core(config())
    piped.switch_connected(OFP13, pipeline=True)
    # A single-layout pair (output in table 0) is not adopted by a pipeline controller ...
    assert types(piped.reconcile(_flows_for(conn) + _table_1(), 1.0)) == ["DeleteSwitchFlow"] * 2 + ["ResyncConntrack"]
    assert piped.find(tuple_=conn.orig) is None
    # ... a pipeline pair is, and a single-layout controller leaves that one alone.
    piped.switch_connected(OFP13, pipeline=True)
    assert types(piped.reconcile(_pipeline_flows_for(conn) + _table_1(), 2.0)) == ["ResyncConntrack"]
    assert piped.find(tuple_=conn.orig).adopted and piped.entries == 2
    single = c.Core(config())
    single.switch_connected(OFP13)
    assert types(single.reconcile(_pipeline_flows_for(conn), 3.0)) == ["DeleteSwitchFlow"] * 2 + ["ResyncConntrack"]


def test_reconcile_keeps_table_1_flows_of_the_config_and_deletes_others():
    core = c.Core(config())
    core.switch_connected(OFP13, pipeline=True)
    stale = [SwitchFlow(cookies.make_pipeline(1), 1, None, None, 9),  # not group 1's port
             SwitchFlow(cookies.make_pipeline(5), 1, None, None, 1)]  # no such group
    deletes = [x.flow for x in core.reconcile(_table_1() + stale, 0.0) if type(x).__name__ == "DeleteSwitchFlow"]
    assert deletes == stale
    single = c.Core(config())
    single.switch_connected(OFP13)
    assert len([x for x in single.reconcile(_table_1() + stale, 0.0) if type(x).__name__ == "DeleteSwitchFlow"]) == 12


def test_no_shunt_goes_to_table_1_before_the_switch_shows_all_of_it():
    """A lagging switch (hardware) answers the flow read before it applied table 1: the
    read is repeated, and nothing is installed or adopted meanwhile."""
    core = c.Core(config())
    core.switch_connected(OFP13, pipeline=True)
    (again,) = core.reconcile(_table_1()[:7], 0.0)
    assert types(again.commands) == ["RequestSwitchFlows"] and again.delay == c.PIPELINE_READ_AGAIN
    assert not core.reconciled and "InstallFlows" not in types(core.conntrack_event(event()))
    assert "ResyncConntrack" in types(core.reconcile(_table_1(), 0.3)) and core.reconciled
    # A switch that never shows it: after PIPELINE_READS reads the controller goes on.
    stuck = c.Core(config())
    stuck.switch_connected(OFP13, pipeline=True)
    for _ in range(c.PIPELINE_READS):
        assert not stuck.reconciled and types(stuck.reconcile([], 0.0)) == ["Later"]
    assert types(stuck.reconcile([], 0.0)) == ["ResyncConntrack"]


def test_stopping_hands_back_a_pair_whose_rst_grace_is_still_running():
    """The RST's hand-back waits in a Later that a stopping controller never runs, so the
    flows go with the others (it was adopted by the next start, 1.2 M packets later). But
    nothing was handed back yet: removing the flows alone left a connection whose RST was
    forged with neither flows nor entry (a strict firewall drops it as INVALID). The grace
    is cut short as a reconnect's is (pairs.cut_short): its entry first, ESTABLISHED with
    the decision cleared (the RST not judged), then the flows go."""
    core = connected(rst_grace=0.5)
    conn = shunted(core)
    _, later = core.teardown_packet(cookies.make_teardown(conn.ct_id, reply=False, rst=True), 1, 120.0)
    assert type(later).__name__ == "Later" and conn.state is cn.State.TAKING_DOWN
    out = core.stopping(120.1, take_down=True)
    assert types(out) == ["RestoreConntrack"] and out[0].orig == conn.orig
    (restore,) = out
    assert restore.tcp_state == cn.CT_TCP_ESTABLISHED and restore.mark & markcodec.DECISION_MASK == 0
    assert types(restore.then) == ["RemoveFlows"] and restore.then[0].directions == (False, True)
    assert conn.watch.settled  # the grace's end, should it still come, finds it done
    assert core.watch_ends(conn, conn.watch, 120.6) == []


@pytest.mark.parametrize("odd", ["older shape", "second flow"])
def test_only_pairs_of_exactly_this_shape_are_adopted_and_the_rest_goes_whatever_the_config(odd):
    """Issue 26.6: a pair of another shape (an older release's, a wildcarded one) or with a
    second flow under its cookie is neither adopted nor left: every such flow is deleted,
    also with delete_flows_on_startup off."""
    conn = shunted(connected(), sport=2222, ct_id=0x1234)
    flows = _flows_for(conn)
    if odd == "older shape":
        flows[1] = flows[1]._replace(exact=False)
    else:
        flows.append(SwitchFlow(conn.cookie(False), 33000, 1, conn.orig._replace(sport=1), 3))
    core = c.Core(config(delete_flows_on_startup=False))
    core.switch_connected(OFP13)
    out = core.reconcile(flows, 1.0)
    deleted = [x.flow for x in out if isinstance(x, cm.DeleteSwitchFlow)]
    assert sorted(map(id, deleted)) == sorted(map(id, flows)) and core.find(tuple_=conn.orig) is None
    # A pair of ours with such company is installed again, after the deletes.
    core = connected()
    mine = shunted(core, sport=5)
    core.switch_disconnected()
    core.switch_connected(OFP13)
    flows = _flows_for(mine)
    flows[0] = flows[0]._replace(exact=False)
    out = core.reconcile(flows, 2.0)
    assert types(out) == ["DeleteSwitchFlow", "DeleteSwitchFlow", "InstallFlows", "ResyncConntrack"]


def test_a_half_closed_shunt_has_its_missing_catchers_read_in_the_single_layout():
    core = connected()
    half, done = shunted(core, sport=1, ct_id=1), shunted(core, sport=2, ct_id=2)
    assert core.teardown_packet(cookies.make_teardown(1, False, False), 1, 10.0) == []  # one FIN: half-closed
    core.teardown_packet(cookies.make_teardown(2, True, False), 3, 10.0)
    core.teardown_packet(cookies.make_teardown(2, False, False), 1, 10.01)  # both: ended, not watched
    assert len(core.half_closed) == 1 and done.state is cn.State.TAKING_DOWN
    assert core.half_closed_due(10.1).catchers == []  # the other FIN has a moment to come
    due = core.half_closed_due(10.5)
    # The reply direction's FIN (the one not heard of) and either direction's RST.
    assert due.catchers == [cookies.make_teardown(1, True, False), cookies.make_teardown(1, False, True),
                            cookies.make_teardown(1, True, True)] and due.commands == [] and due.ended == 0
    # The read finds the FIN its packet-in would have brought: the shunt ends as a close.
    out, ended = core.catchers_counted([cookies.make_teardown(1, True, False)], 10.6)
    assert ended == 1 and out[0].tcp_state == cn.CT_TCP_TIME_WAIT and not out[0].closer_is_reply
    assert half.state is cn.State.TAKING_DOWN
    assert core.half_closed_due(20.0).catchers == [] and not core.half_closed  # gone from the watch


def test_a_half_closed_shunt_is_taken_as_closed_in_the_pipeline_layout():
    core = c.Core(config())
    core.switch_connected(OFP13, pipeline=True)
    core.reconcile(_table_1(), 0.0)
    half, alive = shunted(core, sport=1, ct_id=1), shunted(core, sport=2, ct_id=2)
    core.teardown_packet(cookies.make_teardown(1, True, False), 3, 10.0)  # the reply's FIN, the other lost
    assert core.half_closed_due(10.1).ended == 0
    due = core.half_closed_due(10.4)
    assert due.catchers == [] and due.ended == 1 and half.state is cn.State.TAKING_DOWN
    (restore,) = due.commands
    # The state a second FIN leaves, closed by the reply side; watched, so that a connection
    # that was really only half-closed (and still sends data) is shunted again.
    assert restore.tcp_state == cn.CT_TCP_TIME_WAIT and restore.closer_is_reply
    assert types(restore.then) == ["WatchFlows", "Later"]
    assert alive.state is cn.State.DRAINING and not core.half_closed


@pytest.mark.parametrize("teardown,pipeline", [(True, False), (True, True), (False, False)])
def test_probe_recommends_the_budget_the_core_derives_from_the_same_table(teardown, pipeline):
    from nfshunt import probe  # imports os-ken: only here
    report = probe.Report()
    shapes = {probe.SHAPE_TCP: teardown, probe.SHAPE_PIPELINE: pipeline}
    probe.recommend(report, config().switches[0], True, 1000, shapes, None, [])
    core = connected(tcp_teardown=teardown)
    core.pipeline = pipeline
    assert report.settings["max_shunts"] == core.table_size(1000)


THREE_GROUPS = [{"fast": 1 + 2 * i, "slow": 2 + 2 * i, "physdevin": i + 1, "bridge_port": f"fw-eth{i}"}
                for i in range(3)]


@pytest.mark.parametrize("confirmed", [True, False])
def test_a_pair_whose_entry_s_mark_names_other_ports_goes_and_its_event_is_judged_again(confirmed):
    """A first packet flooded by a bridge of three groups recorded one copy's port as the
    egress; the connection's reply sets it right (iptables.py). The pair installed on the
    first record sends the connection into the wrong group's network: it goes, its entry
    gets the ports as they are now, and the update is judged again once the pair is gone."""
    core = connected(ports=THREE_GROUPS)
    (install,) = core.conntrack_event(event(egress=3))
    conn = install.conn
    if confirmed:
        core.flows_confirmed(conn, 101.0)
        core.entry_due(conn, 101.1)
    moved = event(egress=2, received=102.0)
    out = core.conntrack_event(moved)
    assert out[-1].reason == adm.R_PORTS_MOVED and conn.remove_reason == adm.R_PORTS_MOVED
    if not confirmed:  # its flows go once the switch confirms them
        assert conn.state is cn.State.PENDING
        out = core.flows_confirmed(conn, 102.1)
    (restore,) = [x for x in out if isinstance(x, cm.RestoreConntrack)]
    assert restore.mark & 0x0ff00000 == 0x01200000  # the entry keeps its ports as the reply set them
    for reply in (False, True):
        out = core.flow_removed(conn.cookie(reply), "delete", 0, 0, 1.0, 103.0)
    (again,) = [x for x in out if isinstance(x, cm.InstallFlows)]
    assert (again.conn.ingress.physdevin, again.conn.egress.physdevin) == (1, 2)
    same = event(egress=2, received=104.0)  # its own ports: a duplicate, as before
    assert [x.reason for x in core.conntrack_event(same)] == [adm.R_DUPLICATE]


def test_while_a_reevaluation_clears_the_decisions_only_a_pin_that_overrides_the_policy_is_acted_on():
    """policy_state.Clearing: until the kernel's clearing ends, what the policy decided in an
    entry may be the old policy's: neither a policy's shunt or block nor an IDS's shunt
    (applied only to what the policy left alone) is installed. An operator's block and an
    IDS's block decide whatever the policy said, and are. Once the clearing ends, an entry
    read before its end still is not acted on; one read after is, and a dump is asked."""
    from nfshunt.core.pins import IdsHold
    from nfshunt.records.cookies import Authority
    core = connected()
    core.clearing.begin()
    (ignored,) = core.conntrack_event(event(sport=1, ct_id=1))
    assert ignored.reason == adm.R_DECIDED_BEFORE
    ids_shunt = event(sport=2, ct_id=2, action=0)
    core.ids_pin(ids_shunt.orig, IdsHold(cn.Action.SHUNT, "ids:zeek", until=700.0), 100.0)
    assert [x.reason for x in core.conntrack_event(ids_shunt)] == [adm.R_DECIDED_BEFORE]
    ids_block, operator_block = event(sport=3, ct_id=3), event(sport=4, ct_id=4)
    core.ids_pin(ids_block.orig, IdsHold(cn.Action.BLOCK, "ids:zeek", until=700.0), 100.0)
    core.pin(operator_block.orig, cn.Action.BLOCK, 100.0)
    (a,), (b,) = core.conntrack_event(ids_block), core.conntrack_event(operator_block)
    assert (a.conn.action, a.conn.authority, b.conn.action, b.conn.authority) == \
        (cn.Action.BLOCK, Authority.IDS, cn.Action.BLOCK, Authority.OPERATOR)
    assert core.clearing.ignored == 2
    core.clearing.begin()  # a second re-evaluation while the first clears
    assert core.clearing.end(150.0) == []  # (the first's: the second's still goes on)
    assert types(core.conntrack_event(event(sport=1, ct_id=1, received=151.0))) == ["Ignored"]
    assert types(core.clearing.end(160.0)) == ["ResyncConntrack"]
    assert types(core.conntrack_event(event(sport=1, ct_id=1, received=159.9))) == ["Ignored"]
    assert types(core.conntrack_event(event(sport=1, ct_id=1, received=160.0))) == ["InstallFlows"]
    assert core.clearing.ignored == 4  # (until the next re-evaluation begins)


def test_a_start_up_reconcile_under_another_policy_clears_the_decisions_behind_the_same_gate():
    """The first reconcile under a policy the switch's pairs were not decided under begins
    the core's clearing with its ClearDecisions: no decision of the policy's is acted on
    until the kernel's answer ends it, and that end (not the reconcile) asks for the dump.
    A reconnect's reconcile meanwhile neither clears again nor opens the gate; what was not
    acted on is said once, at the end that comes next (`reported`)."""
    core = c.Core(config())
    core.stale_policy = True
    core.switch_connected(OFP13)
    out = core.reconcile([], 0.0)
    assert "ClearDecisions" in types(out) and "ResyncConntrack" not in types(out) and core.clearing.going == 1
    assert [x.reason for x in core.conntrack_event(event(sport=1, ct_id=1))] == [adm.R_DECIDED_BEFORE]
    core.switch_disconnected()
    core.switch_connected(OFP13)
    again = core.reconcile([], 0.0)
    assert types(again)[-1] == "ResyncConntrack" and "ClearDecisions" not in types(again)
    assert core.clearing.going == 1 and core.clearing.reported() == 1 and core.clearing.reported() == 0
    assert types(core.clearing.end(150.0)) == ["ResyncConntrack"]
    assert types(core.conntrack_event(event(sport=1, ct_id=1, received=150.0))) == ["InstallFlows"]


def test_a_withdrawn_decision_takes_down_what_rests_on_the_policy_and_not_what_a_pin_decided():
    """An update or a dump of a pair's own entry with its decision cleared: the pair goes if
    it rests on the policy (its own decision, or an IDS's shunt of what the policy left
    alone); an IDS's block and an operator's decide whatever the policy said, and stay. Another
    entry's (a different id), or a NEW one made on the tuple, says nothing of it."""
    from nfshunt.core.pins import IdsHold
    from nfshunt.records.cookies import Authority
    core = connected()
    ids_shunt_ev, ids_block_ev = event(sport=2, ct_id=2, action=0), event(sport=3, ct_id=3)
    core.ids_pin(ids_shunt_ev.orig, IdsHold(cn.Action.SHUNT, "ids:zeek", until=700.0), 100.0)
    core.ids_pin(ids_block_ev.orig, IdsHold(cn.Action.BLOCK, "ids:zeek", until=700.0), 100.0)
    ids_shunt, ids_block = shunted(core, sport=2, ct_id=2, action=0), shunted(core, sport=3, ct_id=3)
    shunt = shunted(core, sport=1, ct_id=1)
    assert (ids_shunt.authority, ids_block.authority, shunt.authority) == (Authority.IDS,) * 2 + (Authority.POLICY,)
    assert types(core.conntrack_event(event(sport=1, ct_id=9, action=None))) == ["DeleteConntrack", "Ignored"]
    assert types(core.conntrack_event(event(sport=1, ct_id=1, action=None, kind=EventKind.NEW))) == ["Ignored"]
    assert shunt.state is cn.State.DRAINING
    out = core.conntrack_event(event(sport=1, ct_id=1, action=None, kind=EventKind.DUMP))
    assert types(out) == ["RestoreConntrack", "Ignored"] and out[1].reason == adm.R_WITHDRAWN
    assert shunt.state is cn.State.TAKING_DOWN and shunt.remove_reason == adm.R_WITHDRAWN
    assert types(core.conntrack_event(event(sport=2, ct_id=2, action=None))) == ["RestoreConntrack", "Ignored"]
    assert types(core.conntrack_event(event(sport=3, ct_id=3, action=None))) == ["Ignored"]
    assert ids_shunt.state is cn.State.TAKING_DOWN and ids_block.state in cn.ACTIVE
