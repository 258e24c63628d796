"""Every decision keeps its bounds (issue 36: 1, 2, 4, 6, 7), against the fake switch table:
an IDS's pair ends on the switch at its rule's end with no controller running, a restart
or a takeover keeps an adopted pair only while it can name what decided it, saved rules
are judged again at start, an IDS's block wins inside a static stream, and a rule's end
follows the monotonic clock while the controller runs."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("OSKEN_HUB_TYPE", "native")
from nfshunt.core.close_watch import WATCH  # noqa: E402
from nfshunt.core.connection import REEVALUATE_TIMEOUT, State  # noqa: E402
from nfshunt.core.static_table import RENEW  # noqa: E402
from nfshunt.ids.calls import Result  # noqa: E402
from nfshunt.ids.rules import Kind  # noqa: E402
from nfshunt.records import cookies  # noqa: E402
from nfshunt.records.model import UDP, Action, FlowTuple  # noqa: E402
from tests.helpers import event  # noqa: E402
from tests.support import fakeswitch as fs  # noqa: E402
from tests.support.rig import FAST_A, FAST_B, LAYOUTS, Rig, fast, slow  # noqa: E402
from tests.test_ids_backend import ORIG, WALL, _failed, _in_one_turn, rule, setup, tick  # noqa: E402

OTHER = event(sport=40001).orig  # tcp 10.0.0.1:40001 -> 10.0.0.2:5201


def _shunted(rig, backend, entries, expire=60, idle_timeout=600, orig=ORIG, **kw):
    """An IDS's shunt of a connection the policy accepted and left alone, LIVE on the switch."""
    entries[orig] = event(action=0, sport=orig.sport, ct_id=orig.sport)
    out = backend.submit(rule(rig, expire=expire, idle_timeout=idle_timeout, connection=orig, **kw), 1.0)
    assert out.result is Result.ADDED and out.pending is None, out
    conn = rig.core.find(tuple_=orig)
    rig.advance(rig.core.switch.drain)
    assert conn.state is State.LIVE and fast(rig, conn)
    return conn


def _of(rig, kind, orig):
    return [e for e in rig.flows(kind) if cookies.parse(e.cookie).key == rig.core.find(tuple_=orig).key] \
        if rig.core.find(tuple_=orig) else []


# --- 1: the switch ends an IDS's pair at its rule's end ----------------------------------------

@pytest.mark.parametrize("version, pipeline", LAYOUTS)
def test_an_ids_shunt_ends_on_the_switch_at_its_rules_end_with_no_controller(version, pipeline):
    rig, backend, entries, _ = setup(rig=Rig(version, pipeline))
    conn = _shunted(rig, backend, entries, expire=60)
    pair = [e for e in rig.switch.entries if cookies.parse(e.cookie) and cookies.parse(e.cookie).key == conn.key]
    # The pair's flows and (single-table layout) its catchers: the rule's end and a second.
    assert {e.hard_timeout for e in pair} == {61} and len(pair) == rig.s.fb.install_cost(conn)
    start = min(e.added for e in pair)
    rig.switch.expire(start + 60.5)  # no controller: nothing but the switch's own timers
    assert fast(rig, conn)
    rig.switch.expire(start + 61)
    assert not [e for e in rig.switch.entries if cookies.parse(e.cookie) and cookies.parse(e.cookie).key == conn.key]
    assert cookies.authority(pair[0].cookie) is cookies.Authority.IDS  # (what a restart reads back)


@pytest.mark.parametrize("pipeline", [False, True], ids=["single", "pipeline"])
def test_an_ids_shunts_close_is_caught_and_its_counters_read_with_its_authority_in_the_cookie(pipeline):
    """The authority bits are not the pair's key: its catchers (their cookies, or the pipeline
    layout's metadata) and its counter reads still name it."""
    rig, backend, entries, _ = setup(rig=Rig(pipeline=pipeline))
    conn = _shunted(rig, backend, entries)
    assert backend.rule("ids:zeek", "1").packets == 2  # (fast() sent one each way)
    rig.packet(FAST_A, conn.orig, tcp_flags=0x01)
    rig.packet(FAST_B, conn.reply, tcp_flags=0x01)
    assert [r.orig for r in rig.worker.restores] == [conn.orig]
    rig.kernel_answers()
    rig.advance(WATCH)  # the close's watch (close_watch.py), over
    assert slow(rig, conn) and rig.flows(cookies.Kind.TEARDOWN) == [] and not rig.core.by_key


def test_a_pair_the_policy_decided_has_no_hard_timeout_and_names_the_policy():
    rig, backend, _, _ = setup()
    conn = rig.event()  # the policy shunts it; then an IDS asks the same: it exists
    assert backend.submit(rule(rig), 1.0).result is Result.EXISTS
    assert conn.authority is cookies.Authority.POLICY and {e.hard_timeout for e in rig.flows(cookies.Kind.SHUNT)} == {0}


def test_a_pair_ended_by_its_hard_timeout_while_the_controller_runs_is_judged_again():
    """The switch's end came before the tick's (a loaded controller): the connection is
    handed back alive, its entry re-created for re-evaluation, not as an idle one."""
    rig, backend, entries, _ = setup()
    conn = _shunted(rig, backend, entries, expire=10)
    rig.advance(11)  # the core's tick, not the backend's: the switch ends the pair
    assert [r.timeout for r in rig.worker.restores] == [REEVALUATE_TIMEOUT]
    rig.kernel_answers()
    assert slow(rig, conn)


def test_an_operators_block_ends_on_the_switch_with_its_pin():
    rig = Rig()
    rig.run(rig.core.pin(ORIG, Action.BLOCK, rig.now))
    conn = rig.event()  # the policy would shunt it: the operator's block decides
    assert {e.hard_timeout for e in rig.flows(cookies.Kind.BLOCK)} == {3601}
    assert conn.action is Action.BLOCK and conn.authority is cookies.Authority.OPERATOR


# --- 1, 2, 4: what a restart or a takeover adopts -------------------------------------------------

def _restart(tmp_path, rig, backend, **kw):
    """The controller stops with its flows kept and starts again 5 s later (its rules file
    saved at stop, read at start before the switch connects): the new one's rig, backend
    and audit records."""
    backend.tick()
    backend.save()
    switch = rig.switch
    again, restarted, entries, records = setup(tmp_path, rig=Rig(now=rig.now + 5), **kw)
    restarted.load()
    switch.expire(again.now)
    again.reconnect(switch)
    return again, restarted, entries, records


def test_a_restart_adopts_an_ids_shunt_whose_rule_lives_and_keeps_its_bound(tmp_path):
    rig, backend, entries, _ = setup(tmp_path)
    conn = _shunted(rig, backend, entries, expire=60)
    cookie = conn.cookie(False)
    again, _, _, _ = _restart(tmp_path, rig, backend)
    adopted = again.core.find(tuple_=ORIG)
    assert adopted.adopted and adopted.state is State.LIVE and adopted.cookie(False) == cookie
    assert fast(again, adopted) and again.worker.restores == []


def test_a_restart_hands_back_an_ids_shunt_whose_rule_it_cannot_name(tmp_path):
    """The rules file lost (or another controller's pair): the adopted IDS shunt goes back
    to the firewall alive, its entry re-created first."""
    rig, backend, entries, _ = setup(tmp_path)
    conn = _shunted(rig, backend, entries, expire=3600)
    os.unlink(backend.store.path) if backend.store.path and os.path.exists(backend.store.path) else None
    backend.store.path = None  # (nothing written at the stop)
    again, _, _, _ = _restart(tmp_path, rig, backend)
    (restore,) = again.worker.restores
    assert restore.orig == conn.orig and restore.timeout == REEVALUATE_TIMEOUT
    again.kernel_answers()
    assert slow(again, conn) and again.core.find(tuple_=ORIG) is None


def test_saved_rules_are_judged_again_at_start_and_an_emptied_may_shunt_hands_their_pairs_back(tmp_path):
    rig, backend, entries, _ = setup(tmp_path)
    conn = _shunted(rig, backend, entries, expire=30 * 86400)
    backend.submit(rule(rig, Kind.BLOCK, "b", connection=OTHER), 1.0)  # an IDS block: not the scope's concern
    again, restarted, _, records = _restart(tmp_path, rig, backend, may_shunt=())
    assert [r.id for r in restarted.store.rules.values()] == ["b"]
    (ended,) = [r for r in records if r["event"] == "ids_rule_ended"]
    assert ended["id"] == "1" and ended["why"].startswith("refused at start: ids.may_shunt is empty")
    again.kernel_answers()
    assert slow(again, conn) and again.core.find(tuple_=ORIG) is None


def test_a_takeover_hands_the_old_masters_ids_shunt_back_and_keeps_its_blocks_until_their_end(tmp_path):
    """The new master holds none of the old one's IDS rules nor its operator's pins: the
    IDS's shunt goes back to its firewall; the IDS's and the operator's blocks stay until
    their own end on the switch, the operator's held as a pin of the new master meanwhile."""
    rig, backend, entries, _ = setup(tmp_path)
    conn = _shunted(rig, backend, entries, expire=600)
    backend.submit(rule(rig, Kind.BLOCK, "b", expire=100, connection=OTHER), 1.0)
    blocked = rig.event(sport=OTHER.sport, ct_id=11)
    third = event(sport=40002).orig
    rig.run(rig.core.pin(third, Action.BLOCK, rig.now))
    by_operator = rig.event(sport=third.sport, ct_id=12)
    assert blocked.action is by_operator.action is Action.BLOCK
    switch = rig.switch
    peer, _, _, _ = setup(rig=Rig(now=rig.now + 2))  # the other firewall's controller: no rules, no pins
    switch.expire(peer.now)
    peer.reconnect(switch)
    (restore,) = peer.worker.restores
    assert restore.orig == conn.orig
    peer.kernel_answers()
    assert slow(peer, conn)
    kept_ids, kept_op = peer.core.find(tuple_=OTHER), peer.core.find(tuple_=third)
    assert (kept_ids.authority, kept_op.authority) == (cookies.Authority.IDS, cookies.Authority.OPERATOR)
    assert kept_ids.adopted and kept_op.adopted and peer.packet(FAST_A, OTHER).dropped
    assert peer.core.pins[third].source is None and peer.core.pins[third].expires <= peer.now + 3600
    assert ORIG not in peer.core.pins and OTHER not in peer.core.pins
    assert kept_ids.hard_timeout == 99  # what its flows have left (101 s from their install 2 s ago)
    peer.advance(100)  # both blocks have gone by now (idled out, or their end)
    assert peer.core.find(tuple_=OTHER) is None and peer.core.find(tuple_=third) is None
    assert peer.event(sport=OTHER.sport, ct_id=21).action is Action.SHUNT  # the policy's, the rule is not here
    assert peer.event(sport=third.sport, ct_id=22).action is Action.BLOCK  # the operator's pin, held again


def test_a_pair_of_an_unknown_authority_or_directions_that_disagree_is_not_kept():
    rig = Rig()
    conn = rig.event()
    rig.advance(rig.core.switch.drain)
    for e in rig.switch.entries:  # another release's, or forged: authority 3
        if e.cookie >> 48 == 0x4E02 and e.cookie & cookies.DIRECTION_BIT:
            e.cookie |= cookies.AUTHORITY_MASK
    peer = Rig(now=rig.now + 1)
    peer.reconnect(rig.switch)
    assert [r.orig for r in peer.worker.restores] == [conn.orig]


# --- 1: an operator's pins across a restart ---------------------------------------------------

def test_an_operators_pins_are_kept_across_a_restart_for_what_is_left_of_them(tmp_path):
    from nfshunt.app import pin_file
    rig = Rig()
    rig.run(rig.core.pin(ORIG, Action.BLOCK, rig.now))
    rig.run(rig.core.pin(OTHER, Action.IGNORE, rig.now - 3000))  # 600 s left of it
    path = str(tmp_path / pin_file.FILE)
    pin_file.save(path, list(rig.core.pins.items()), WALL, rig.now)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    kept = {k.orig: k for k in pin_file.load(path, WALL + 100)}  # restarted 100 s later
    assert set(kept) == {ORIG, OTHER}
    assert (kept[ORIG].action, kept[ORIG].left) == (Action.BLOCK, 3500.0)
    assert (kept[OTHER].action, kept[OTHER].left) == (Action.IGNORE, 500.0)
    assert pin_file.load(path, WALL - 10_000)[0].left == 3600  # a wall clock set back lengthens none
    assert pin_file.load(path, WALL + 4000) == []
    (tmp_path / "bad.json").write_text('{"version": 1, "pins": [{"tuple": "nonsense", "action": "block", '
                                       '"expires": 1}]}')
    assert pin_file.load(str(tmp_path / "bad.json"), WALL) == []


def test_a_restart_adopts_an_operators_block_its_pin_names(tmp_path):
    rig = Rig()
    rig.run(rig.core.pin(ORIG, Action.BLOCK, rig.now))
    conn = rig.event()
    again = Rig(now=rig.now + 5, switch=fs.FakeSwitch(now=rig.now + 5))
    again.run(again.core.pin(ORIG, Action.BLOCK, again.now, 3595))  # what restore_pins holds again
    again.reconnect(rig.switch)
    adopted = again.core.find(tuple_=ORIG)
    assert adopted.adopted and adopted.cookie(True) == conn.cookie(True) and again.packet(FAST_B, conn.reply).dropped


# --- 6: an IDS's block wins inside a static stream ----------------------------------------------

STREAM = {"name": "plc-cycle", "protocol": "udp", "src": "10.0.0.1", "dst": "10.0.0.2", "dst_port": 34964,
          "fast_ports": [FAST_A, FAST_B]}
IN_STREAM = FlowTuple(4, UDP, "10.0.0.1", "10.0.0.2", 40000, 34964)


def test_an_ids_block_of_a_static_streams_connection_drops_its_frames_until_the_rule_ends():
    rig, backend, _, _ = setup(rig=Rig(openflow_versions=["1.3"], static_shunts=[STREAM]))
    assert rig.packet(FAST_A, IN_STREAM).outputs == (FAST_B,)  # the stream: fast port to fast port
    out = backend.submit(rule(rig, Kind.BLOCK, connection=IN_STREAM, expire=30), 1.0)
    assert (out.result, out.pending) == (Result.ADDED, None), out  # once the switch has the drops
    assert rig.packet(FAST_A, IN_STREAM).dropped and rig.packet(FAST_B, IN_STREAM.reversed()).dropped
    drops = [e for e in rig.flows(cookies.Kind.STATIC) if not e.outputs]
    assert len(drops) == 2 and {e.hard_timeout for e in drops} == {31}  # ended by the switch too
    other = IN_STREAM._replace(sport=40001)
    assert rig.packet(FAST_A, other).outputs == (FAST_B,)  # the rest of the stream flows
    tick(rig, backend, 30)
    assert rig.packet(FAST_A, IN_STREAM).outputs == (FAST_B,) and not backend.store.rules


def test_an_operators_block_over_an_ids_block_in_a_stream_holds_for_the_operators_hour():
    rig, backend, _, _ = setup(rig=Rig(openflow_versions=["1.3"], static_shunts=[STREAM]))
    backend.submit(rule(rig, Kind.BLOCK, connection=IN_STREAM, expire=30), 1.0)
    rig.run(rig.core.pin(IN_STREAM, Action.BLOCK, rig.now))
    drops = [e for e in rig.flows(cookies.Kind.STATIC) if not e.outputs]
    assert len(drops) == 2 and {e.hard_timeout for e in drops} == {3601}  # written again with the pin's, and a second
    tick(rig, backend, 31)  # the IDS's rule ends: the operator's block stays
    assert rig.packet(FAST_A, IN_STREAM).dropped


def test_a_static_streams_block_nobody_here_names_is_kept_until_its_own_end():
    """A restart (or the pair's other controller) finds a block inside a stream it holds no
    pin of: a drop with its own hard timeout, kept, not removed as stale."""
    rig = Rig(openflow_versions=["1.3"], static_shunts=[STREAM])
    rig.run(rig.core.pin(IN_STREAM, Action.BLOCK, rig.now))
    peer = Rig(now=rig.now + 1, openflow_versions=["1.3"], static_shunts=[STREAM])
    peer.reconnect(rig.switch)
    assert peer.packet(FAST_A, IN_STREAM).dropped


# --- 7: the IDS clock -------------------------------------------------------------------------

def test_a_wall_clock_set_back_does_not_lengthen_a_rule_nor_one_set_forward_cut_it_short():
    rig, backend, entries, _ = setup()
    conn = _shunted(rig, backend, entries, expire=60)
    backend.wall = backend.store.wall = backend.ends.wall = lambda: WALL + rig.now + 3600  # an hour forward
    tick(rig, backend, 30)
    assert ORIG in rig.core.pins and rig.worker.restores == [] and fast(rig, conn)  # not ended
    backend.wall = backend.store.wall = backend.ends.wall = lambda: WALL + rig.now - 7200  # two hours back
    tick(rig, backend, 30)  # 60 s since the rule was made: it ends
    assert ORIG not in rig.core.pins
    rig.kernel_answers()  # its entry re-created: its flows go
    tick(rig, backend, 0)
    assert backend.store.ended("ids:zeek", "1").why == "expired" and slow(rig, conn)


def test_an_address_block_nobody_here_names_is_kept_until_its_own_end():
    """The pair's other controller (or a run whose rules file is gone) blocked a prefix: the
    drop flows carry their own end, and a block is safe to keep until then."""
    rig, backend, _, _ = setup()
    backend.submit(rule(rig, Kind.BLOCK_ADDRESS, address="10.0.0.1/32", expire=100), 1.0)
    peer = Rig(now=rig.now + 1)
    rig.switch.expire(peer.now)
    peer.reconnect(rig.switch)
    assert peer.packet(FAST_A, ORIG).dropped
    peer.advance(99)
    assert not peer.packet(FAST_A, ORIG).dropped and not peer.flows(cookies.Kind.ADDRESS_BLOCK)


def test_an_ids_block_in_a_stream_longer_than_a_hard_timeout_holds_is_written_again_before_it_lapses(monkeypatch):
    """A hard timeout is at most 65,535 s (18 h); a rule of a day keeps its drops all day.
    The walk through the cap runs with the cap lowered to 600 s: the same code at a 100th of
    the ticks (at the real cap it was 32,768 steps, 66 s of CPU in every `make test`)."""
    from nfshunt.core import pins
    rig, backend, _, _ = setup(rig=Rig(openflow_versions=["1.3"], static_shunts=[STREAM]))
    backend.submit(rule(rig, Kind.BLOCK, connection=IN_STREAM, expire=86400), 1.0)
    assert {e.hard_timeout for e in rig.flows(cookies.Kind.STATIC) if not e.outputs} == {pins.HARD_TIMEOUT_MAX} \
        == {65535}
    cap, expire = 600, 1000
    monkeypatch.setattr(pins, "HARD_TIMEOUT_MAX", cap)
    rig, backend, _, _ = setup(rig=Rig(openflow_versions=["1.3"], static_shunts=[STREAM]))
    backend.submit(rule(rig, Kind.BLOCK, connection=IN_STREAM, expire=expire), 1.0)
    assert {e.hard_timeout for e in rig.flows(cookies.Kind.STATIC) if not e.outputs} == {cap}
    for _ in range((cap + 1) // 2):
        rig.advance(2)
        assert rig.packet(FAST_A, IN_STREAM).dropped
    # Written again RENEW s before the switch would end it (the app's tick, each second):
    # the rule's time left then, and the hard timeout's grace.
    assert {e.hard_timeout for e in rig.flows(cookies.Kind.STATIC) if not e.outputs} == {expire - (cap - RENEW) + 1}
    for _ in range((expire - cap) // 2 - 2):
        rig.advance(2)
        assert rig.packet(FAST_A, IN_STREAM).dropped


def test_an_ids_block_in_a_stream_whose_drops_cannot_be_built_is_answered_failed_its_turns_others_added():
    """Review s57: a drop the builder could not encode was counted and left out, and the
    barrier behind the turn answered the add `201 added` with no drop on the switch."""
    rig, backend, _, _ = setup(rig=Rig(openflow_versions=["1.3"], static_shunts=[STREAM]))
    rig._check = lambda: None  # (the rig fails a test on an internal error: here the one counted is the point)
    build = rig.s.fb.static_add

    def add(flow):
        if flow.out_port is None and IN_STREAM.sport in (flow.src_port, flow.dst_port):
            raise ValueError("a value the flow builder cannot encode")
        return build(flow)
    rig.s.fb.static_add = add
    other = IN_STREAM._replace(sport=40001)
    got = _in_one_turn(rig, backend, [rule(rig, Kind.BLOCK, "bad", connection=IN_STREAM, expire=30),
                                      rule(rig, Kind.BLOCK, "good", connection=other, expire=30)])
    assert _failed(got["bad"]), got["bad"]
    assert [(o.result, o.pending) for o in got["good"]] == [(Result.ADDED, None)]
    assert backend.store.get("ids:zeek", "bad") is None and IN_STREAM not in rig.core.pins
    assert rig.packet(FAST_A, IN_STREAM).outputs == (FAST_B,)  # the stream's, as before the add
    assert rig.packet(FAST_A, other).dropped and rig.packet(FAST_B, other.reversed()).dropped
