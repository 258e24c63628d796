"""What the switch says back, each to the handler of what was asked (switch/replies.py),
and the timers' work on it (switch/housekeeping.py), through the app's own handlers on
the rig (tests/support): table size, errors routed per request, multipart reads to their
askers, the packet-in meter and the catchers' counters, requests given up, replies to
nothing asked. The old rig restated these handlers and differed from them: each test
named for one of those differences fails on that restatement."""
from __future__ import annotations

import logging

import pytest

from nfshunt.core.close_watch import WATCH
from nfshunt.core.connection import CT_TCP_TIME_WAIT, State
from nfshunt.core.teardown_sweep import CHECK_AFTER, SWEEP_INTERVAL, WATCH_PERIOD
from nfshunt.openflow.inflight import EXPIRY, FlowsRead, ReconcileRead, TableSize
from nfshunt.records import cookies
from nfshunt.records.model import OFP10, OFP13, FlowTuple
from tests.helpers import event
from tests.support import fakeswitch as fs
from tests.support.rig import ACK, FAST_A, FAST_B, FIN, Rig, fast, shunted, slow

STREAM = {"name": "plc-cycle", "protocol": "udp", "src": "10.0.0.1", "dst": "10.0.0.2", "dst_port": 34964,
          "fast_ports": [1, 3]}


@pytest.fixture
def log(caplog):
    caplog.set_level(logging.INFO, logger="nfshunt")
    return caplog


# --- the table's size ------------------------------------------------------------------------

def test_a_table_size_answered_after_the_reconcile_lets_in_what_waited_for_the_budget_it_raises():
    """(The old rig never called room_freed after a table size.) A switch slow to report its
    tables answers after the reconcile: the connection that waited for the old budget goes
    in at once, not at the next pair's end."""
    rig = Rig(switch=fs.FakeSwitch(reported_size=4 + 6), packet_in_rate=0)  # the defaults and one TCP shunt
    first = shunted(rig, ct_id=1)
    waiting = event(ct_id=2, sport=40002)
    rig.events([waiting])
    assert rig.core.budget == 1 and list(rig.core.waiting) == [waiting.orig]
    bigger = fs.FakeSwitch(reported_size=4 + 6 * 3, now=rig.now)
    bigger.mute.add(fs.TABLE)
    rig.reconnect(bigger)
    assert rig.core.reconciled and rig.core.budget == 1 and list(rig.core.waiting) == [waiting.orig]
    bigger.mute = {fs.FLOWS}  # (nor the default flows' counters, read each tick: see SILENT)
    rig.advance(EXPIRY + 0.5)  # the switch answered nothing since: the read is given up, asked again
    assert rig.core.budget == 3 and bigger.asked[fs.TABLE] == 2
    conn = rig.core.find(tuple_=waiting.orig)
    assert conn is not None and fast(rig, conn) and fast(rig, first)


def test_the_table_size_the_switch_reports_sets_the_budget_in_both_versions():
    for version, size in ((OFP13, 4 + 6 * 3), (OFP10, 4 + 2 * 3)):
        rig = Rig(version, switch=fs.FakeSwitch(version, reported_size=size))
        assert (rig.core.table_max, rig.core.budget) == (size, 3)


def test_a_table_with_no_room_beyond_the_defaults_is_reported(log):
    Rig(switch=fs.FakeSwitch(reported_size=4))
    assert "table 0 holds 4 entries: the defaults" in log.text


# --- errors, each to what it refused -----------------------------------------------------------

def test_a_refused_table_size_request_is_reported_as_such_and_leaves_the_budget(log):
    """(The old rig skipped per-request error routing.)"""
    switch = fs.FakeSwitch()
    switch.refuse.add(fs.TABLE)
    rig = Rig(switch=switch)
    assert rig.core.reconciled and rig.core.budget == 0 and rig.core.table_max is None
    assert "did not report its table size" in log.text and "switch error for xid" not in log.text
    assert rig.counters.flat()[f"openflow_error:{switch.ofproto.OFPET_BAD_REQUEST}:"
                               f"{switch.ofproto.OFPBRC_BAD_MULTIPART}"] == 1
    assert fast(rig, shunted(rig))  # no budget: nothing waits


def test_a_refused_packet_in_meter_is_not_read_again(log):
    """(The old rig skipped per-request error routing.) The meter is read every tick while
    it is on; a switch that refused it is not asked for its counters."""
    on = Rig()
    on.advance(1)
    on.advance(1)
    assert on.s.meter_on and on.switch.asked[fs.METER_STATS] == 2
    switch = fs.FakeSwitch()
    switch.refuse.add(fs.METER_SET)
    rig = Rig(switch=switch)
    for _ in range(3):
        rig.advance(1)
    assert not rig.s.meter_on and switch.asked[fs.METER_STATS] == 0
    assert "refused the packet-in rate limit" in log.text


def test_an_error_for_no_request_of_ours_is_counted_and_logged(log):
    rig = Rig()
    ofp = rig.switch.ofproto
    rig.switch.error(9999, ofp.OFPET_BAD_REQUEST, ofp.OFPBRC_BAD_TYPE, b"")
    rig.run()
    assert rig.counters.flat()[f"openflow_error:{ofp.OFPET_BAD_REQUEST}:{ofp.OFPBRC_BAD_TYPE}"] == 1
    assert "switch error for xid 9999" in log.text


# --- multipart reads, each to its asker ----------------------------------------------------------

def test_the_static_flows_counters_read_each_tick_reach_status():
    """(The old rig sent unlisted stats reads to reconcile.) The static flows' counters are
    read at every tick, in parts, and status shows them."""
    rig = Rig(openflow_versions=["1.3"], static_shunts=[STREAM])
    rig.switch.stats_part = 1
    t = FlowTuple(4, 17, "10.0.0.1", "10.0.0.2", 5000, 34964)
    for _ in range(3):
        assert rig.packet(FAST_A, t).outputs == (FAST_B,)
    rig.advance(1)
    (row,) = [r for r in rig.control({"cmd": "status", "static": True})["static_shunts"]
              if r["direction"] == "original"]
    assert row["on_switch"] and row["packets"] == 3


def test_a_new_shunts_counters_are_summed_over_the_parts_of_their_read():
    rig = Rig(confirm="counters", openflow_versions=["1.3"])
    rig.switch.stats_part = 1  # each direction's flow in a part of its own
    conn = rig.event()
    assert fast(rig, conn)
    rig.advance(0.05)
    rig.advance(rig.core.switch.drain)
    assert conn.state is State.LIVE and rig.worker.deleted == [(conn.orig, conn.ct_id)]


def test_an_operators_read_of_the_flows_is_answered_and_one_given_up_is_answered_without():
    rig = Rig(packet_in_rate=0)  # (no meter reads: the switch answers nothing while muted)
    shunted(rig)
    got: list = []
    rig.s.read_flows(got.append, rig.now)
    rig.run()
    assert len(got) == 1 and {cookies.parse(f.cookie).kind for f in got[0]} >= {cookies.Kind.SHUNT}
    rig.switch.mute.add(fs.FLOWS)  # (the default flows' counters, read each tick, too: see SILENT)
    rig.s.read_flows(got.append, rig.now)
    rig.run()
    (mine,) = [xid for xid, _ in rig.s.inflight.of(FlowsRead)]
    assert len(got) == 1
    rig.advance(EXPIRY + 0.5)
    assert got[1] is None and mine not in [xid for xid, _ in rig.s.inflight.of(FlowsRead)]


def test_a_reply_to_nothing_asked_is_dropped_and_counted():
    rig = Rig()
    rig.switch.reply(rig.switch.ofproto.OFPT_BARRIER_REPLY, 4242)
    rig.run()
    assert rig.counters.flat()["openflow_unasked:OFPBarrierReply"] == 1


# --- requests given up ---------------------------------------------------------------------------

# A switch that answers nothing: an answer to anything keeps every request in flight waiting
# (inflight.py's one rule), and the default flows' counters are read at every tick (OpenFlow
# 1.3: housekeeping.read_slow_path), the packet-in meter's too while it is on. So these tests
# mute the flow-stats reads with what they leave unanswered, and turn the meter off.
SILENT = {fs.BARRIER, fs.FLOWS}

def test_an_unanswered_barrier_rolls_its_installs_back_and_the_connection_is_tried_again():
    rig = Rig(packet_in_rate=0)
    rig.switch.mute.update(SILENT)
    conn = rig.event()
    assert conn.state is State.PENDING
    rig.advance(EXPIRY + 0.5)
    assert rig.core.find(tuple_=conn.orig) is None and rig.counters.flat()["install_timeouts"] == 1
    assert slow(rig, conn) and rig.worker.deleted == []  # its entry kept: the firewall carries it on
    rig.switch.mute.clear()
    again = rig.event()
    assert again is not None
    rig.advance(rig.core.switch.drain)
    assert again.state is State.LIVE and fast(rig, again)


def test_an_unanswered_reconcile_read_is_asked_again():
    switch = fs.FakeSwitch()
    switch.mute.add(fs.FLOWS)
    rig = Rig(switch=switch, packet_in_rate=0)
    assert not rig.core.reconciled and rig.s.inflight.count(ReconcileRead) == 1
    rig.advance(EXPIRY + 0.5)  # given up: asked again (muted too; as is the default flows' read: see SILENT)
    assert not rig.core.reconciled and rig.s.inflight.count(ReconcileRead) == 1
    switch.mute.clear()
    rig.advance(EXPIRY + 0.5)  # given up again; now answered
    assert rig.core.reconciled and switch.asked[fs.FLOWS] >= 3  # kept defaults, the first read, again


def test_an_unanswered_table_size_read_is_asked_again():
    switch = fs.FakeSwitch(reported_size=4 + 6 * 2)
    switch.mute.add(fs.TABLE)
    rig = Rig(switch=switch, packet_in_rate=0)
    assert rig.s.inflight.count(TableSize) == 1 and rig.core.budget == 0
    switch.mute = {fs.FLOWS}  # (the default flows' counters, read each tick: see SILENT)
    rig.advance(EXPIRY + 0.5)
    assert rig.core.budget == 2 and not rig.s.inflight.count(TableSize)


def test_a_lost_answer_is_asked_again_while_the_switch_answers_the_reads_of_each_tick():
    """A switch that lost (or ignores) one answer and answers the rest: the reconcile read was
    never given up (an answer to anything kept every request waiting, and the default flows'
    counters are read and answered every tick), and the controller never programmed the
    switch. Now the read, passed by later reads' answers, is given up and asked again."""
    switch = fs.FakeSwitch()
    switch.mute.add(fs.FLOWS)
    rig = Rig(switch=switch)
    assert not rig.core.reconciled
    switch.mute.clear()  # it answers again: the reads of each tick
    rig.advance(3 * EXPIRY)
    assert rig.core.reconciled and rig.flows(cookies.Kind.DEFAULT)
    assert rig.counters.flat()["given_up:passed"] == 2  # (the read of the defaults it kept, and the reconcile's)


def test_an_unanswered_counter_read_is_asked_again_and_the_shunt_confirmed_once_counted():
    rig = Rig(confirm="counters", openflow_versions=["1.3"], packet_in_rate=0, default_shunt_timeout=60)
    conn = rig.event()
    rig.switch.mute.add(fs.FLOWS)
    assert fast(rig, conn)
    rig.advance(0.05)  # read, not answered
    rig.advance(EXPIRY + 0.5)  # given up: asked again (muted too)
    assert conn.state is State.DRAINING and rig.worker.deleted == []
    rig.switch.mute.clear()
    rig.advance(EXPIRY + 0.5)  # given up again; now answered
    rig.advance(rig.core.switch.drain)
    assert conn.state is State.LIVE and rig.worker.deleted == [(conn.orig, conn.ct_id)]


# --- teardowns the switch did not report -----------------------------------------------------------

def test_fins_the_meter_dropped_are_found_from_the_catchers_counters():
    rig = Rig()
    conn = shunted(rig)
    rig.switch.lose_packet_ins = fs.METER
    rig.packet(FAST_A, conn.orig, tcp_flags=FIN | ACK)
    rig.packet(FAST_B, conn.reply, tcp_flags=FIN | ACK)
    assert conn.state is State.LIVE and rig.worker.restores == []  # nothing heard
    rig.advance(1)  # the tick reads the meter: 2 dropped; the catchers are read
    (restore,) = rig.worker.restores
    assert restore.tcp_state == CT_TCP_TIME_WAIT  # (the close as the endpoints end it: close_watch.py)
    rig.kernel_answers()
    rig.advance(WATCH)  # the close's watch, over
    assert slow(rig, conn) and not rig.core.by_key
    flat = rig.counters.flat()
    assert flat["packet_in_dropped"] == 2 and flat["teardowns_from_counters"] == 1


def test_catchers_are_read_at_most_every_sweep_interval_however_many_drops():
    rig = Rig()
    rig.switch.lose_packet_ins = fs.METER
    conns = [shunted(rig, ct_id=10 + i, sport=41000 + i) for i in range(3)]
    rig.packet(FAST_A, conns[0].orig, tcp_flags=FIN)
    rig.advance(1)
    first = rig.sw.sweep.last
    assert first == rig.now and conns[0].fins == 1  # read at once, its FIN found
    rig.packet(FAST_A, conns[1].orig, tcp_flags=FIN)
    rig.advance(1)
    assert rig.sw.sweep.last == first and rig.sw.sweep.owed and conns[1].fins == 0  # owed, not yet due
    rig.advance(SWEEP_INTERVAL)
    assert rig.sw.sweep.last == first + SWEEP_INTERVAL and conns[1].fins == 1


def test_the_pipeline_layout_cannot_trace_dropped_teardowns_and_says_so(log):
    rig = Rig(pipeline=True)
    conn = shunted(rig)
    rig.switch.lose_packet_ins = fs.METER
    rig.packet(FAST_A, conn.orig, tcp_flags=FIN)
    rig.advance(1)
    assert "teardown packet-ins" in log.text and rig.counters.flat()["packet_in_dropped"] == 1


@pytest.mark.parametrize("pipeline", [False, True], ids=["single", "pipeline"])
def test_a_second_fin_whose_packet_in_was_lost_is_found_by_the_watch(pipeline):
    rig = Rig(pipeline=pipeline)
    conn = shunted(rig)
    rig.advance(1)  # (the first look comes a second after start)
    rig.packet(FAST_A, conn.orig, tcp_flags=FIN | ACK)
    rig.switch.lose_packet_ins = fs.SILENT
    rig.packet(FAST_B, conn.reply, tcp_flags=FIN | ACK)
    assert rig.worker.restores == []
    rig.advance(CHECK_AFTER + WATCH_PERIOD)  # the watch looks at the half-closed shunt
    (restore,) = rig.worker.restores
    assert restore.tcp_state == CT_TCP_TIME_WAIT  # (the close as the endpoints end it: close_watch.py)
    rig.kernel_answers()
    assert slow(rig, conn)
    counted = "teardowns_half_closed" if pipeline else "teardowns_from_counters"
    assert rig.counters.flat()[counted] == 1


def test_a_half_closed_shunt_still_sending_is_left_alone_by_the_watch():
    rig = Rig()
    conn = shunted(rig)
    rig.packet(FAST_A, conn.orig, tcp_flags=FIN | ACK)
    for _ in range(5):
        rig.advance(CHECK_AFTER)
        assert rig.packet(FAST_B, conn.reply).outputs == (FAST_A,)  # the other side still sends
    assert rig.worker.restores == [] and conn.state is State.LIVE


# --- packet-ins and flow-removed that name nothing of ours --------------------------------------

def test_a_packet_in_of_no_connection_of_ours_is_counted_and_changes_nothing():
    rig = Rig()
    conn = shunted(rig)
    for fin in (cookies.make_teardown(99, False, False), 0x1234):
        rig.deliver(_packet_in(rig, fin, FAST_A))
    flat = rig.counters.flat()
    assert flat["packet_in:no connection of ours"] == 2 and conn.state is State.LIVE and fast(rig, conn)


def _packet_in(rig: Rig, cookie: int, in_port: int):
    rig.switch.packet_in(fs.PacketIn(cookie, 0, {"in_port": in_port}, 128), 60)
    return rig.switch.replies.pop()  # (delivered by the caller)
