"""The operator API over several switches: a status request asks every connected switch
for its flows and is answered once all have replied or gone; take-downs act on all. On the
rig: the operator's requests through the app's event loop, and a re-evaluation against what
the kernel says while it clears the decisions."""
import dataclasses
import os
import threading
import time
from types import SimpleNamespace

os.environ.setdefault("OSKEN_HUB_TYPE", "native")

from nfshunt.app.operator_api import EventControl, OperatorAPI  # noqa: E402
from nfshunt.config.settings import from_dict  # noqa: E402
from nfshunt.core import core as c  # noqa: E402
from nfshunt.observe.metrics import Metrics  # noqa: E402
from nfshunt.openflow.inflight import FlowsRead  # noqa: E402
from nfshunt.openflow.session import Session  # noqa: E402
from nfshunt.switch.switch import Switch  # noqa: E402
from tests.helpers import BASE, event  # noqa: E402
from tests.test_channel import FakeDatapath  # noqa: E402

TWO = from_dict({"mark_actions": BASE["mark_actions"], "switches": [
    {"datapath_id": "a1", "ports": BASE["ports"]},
    {"datapath_id": "a2", "ports": [{"fast": 1, "slow": 2, "physdevin": 3}, {"fast": 3, "slow": 4, "physdevin": 4}]}]})


def _api(state_dir, connected=(True, True)):
    switches = [Switch(TWO, i) for i in range(len(TWO.switches))]
    for sw, up in zip(switches, connected, strict=True):
        sw.core.switch_connected(c.OFP13)
        sw.core.reconcile([], 0.0)
        if up:
            dp = FakeDatapath()
            dp.id, dp.address = sw.switch.datapath_id, ("192.0.2.1", 40000)
            sw.session = Session(dp, sw.cfg, switch=sw.switch)
    app = SimpleNamespace(switches=switches, ids=None, counters=Metrics(lambda: {}).counters, started=time.time(),
                          clock=time.monotonic,
                          run=lambda sw, out: None,
                          cfg=dataclasses.replace(TWO, state_dir=str(state_dir)))
    # One live shunt on each switch.
    for sw, ev in zip(switches, (event(ingress=1, egress=2, ct_id=1, sport=1),
                                 event(ingress=3, egress=4, ct_id=2, sport=2)), strict=True):
        sw.core.flows_confirmed(sw.core.conntrack_event(ev)[0].conn, 1.0)
    return OperatorAPI(app), switches


def _reads(sw):
    """The status reads in flight to a switch, by xid."""
    return dict(sw.session.inflight.of(FlowsRead)) if sw.session is not None else {}


def _status(api):
    ev = EventControl({"cmd": "status"})
    api.handle(ev)
    return ev


def test_status_waits_for_every_connected_switch_and_a_switch_that_goes_answers_for_itself(tmp_path):
    api, (a1, a2) = _api(tmp_path)
    ev = _status(api)
    (xid1, read1), = _reads(a1).items()
    (xid2, read2), = _reads(a2).items()
    assert len(a1.session.dp.sent) == 1 and len(a2.session.dp.sent) == 1 and not ev.done.is_set()
    assert xid1 == xid2  # each switch counts its own xids: each session keeps its own reads
    read1.done(read1.flows)
    assert not ev.done.is_set()  # a2 has not replied
    read2.done(None)  # a2 went away
    assert ev.done.is_set()
    reply = ev.reply
    assert [sw["datapath_id"] for sw in reply["switches"]] == ["00000000000000a1", "00000000000000a2"]
    assert [sw["flow_stats"] for sw in reply["switches"]] == [True, False] and not reply["flow_stats"]
    assert reply["shunts"] == 2 and [sw["shunts"] for sw in reply["switches"]] == [1, 1]
    assert [sw["ports"] for sw in reply["switches"]] == [[1, 2], [3, 4]]
    assert {cn["datapath_id"] for cn in reply["connections"]} == {"00000000000000a1", "00000000000000a2"}
    assert reply["switch"]["datapath_id"] == "00000000000000a1"


def test_status_with_a_switch_away_asks_only_the_connected_one(tmp_path):
    api, (a1, a2) = _api(tmp_path, connected=(True, False))
    ev = _status(api)
    (read,) = _reads(a1).values()
    assert not _reads(a2)
    read.done([])
    assert ev.done.is_set() and [sw["connected"] for sw in ev.reply["switches"]] == [True, False]
    api2, _ = _api(tmp_path, connected=(False, False))
    ev2 = _status(api2)
    assert ev2.done.is_set()  # nobody to ask: answered at once


def test_flush_and_unshunt_act_on_every_switch(tmp_path):
    api, switches = _api(tmp_path)
    ev = EventControl({"cmd": "flush"})
    api.handle(ev)
    assert ev.reply["removed"] == 2 and ev.reply["switch_connected"]
    assert all(conn.remove_reason for sw in switches for conn in sw.core.by_key.values())
    assert api.counters.flat()["operator_flush"] == 1
    (tmp_path / "again").mkdir()
    api, switches = _api(tmp_path / "again")
    ev = EventControl({"cmd": "unshunt", "ct_id": 2})  # found on the second switch
    api.handle(ev)
    assert ev.reply["ok"] and ev.reply["flows_removed"]
    assert all(sw.core.pins for sw in switches)  # its next entry may come to either switch's core


def test_the_shutdown_waiter_is_set_once_every_switch_confirmed():
    from nfshunt.switch.housekeeping import AllSet
    done = threading.Event()
    waiter = AllSet(2, done)
    waiter.set()
    assert not done.is_set()
    waiter.set()
    assert done.is_set()
    none = threading.Event()
    AllSet(0, none)
    assert none.is_set()


# --- on the rig: the operator's requests through the app's event loop -----------------------------

def test_status_lists_a_live_shunt_with_moving_counters_then_unshunt_holds_it_and_block_drops_it():
    """status, unshunt and block as the control socket hands them to the app (the CLI and
    the socket themselves: tests/test_operate.py on the testbed)."""
    from nfshunt.core.admission import R_PINNED
    from tests.support.rig import FAST_A, FAST_B, Rig, fast, shunted, slow
    rig = Rig(default_shunt_timeout=60)
    conn = shunted(rig, sport=45010)
    assert fast(rig, conn)
    (row,) = rig.control({"cmd": "status"})["connections"]
    assert (row["action"], row["state"], row["tuple"][:18]) == ("shunt", "live", "tcp 10.0.0.1:45010")
    assert row["packets"] == [1, 1]
    rig.packet(FAST_A, conn.orig)
    (row,) = rig.control({"cmd": "status"})["connections"]
    assert row["packets"] == [2, 1] and row["bytes"][0] > 100
    reply = rig.control({"cmd": "unshunt", "tuple": row["tuple"]})
    assert reply["ok"] and reply["flows_removed"]
    rig.kernel_answers()
    assert slow(rig, conn)
    again = rig.event(sport=45010, ct_id=conn.ct_id + 1)  # its next update, decided shunt by the policy
    assert again is None and rig.counters.flat()[f"ignored:{R_PINNED}"] == 1 and slow(rig, conn)
    assert rig.control({"cmd": "block", "tuple": row["tuple"]})["ok"]
    blocked = rig.event(sport=45010, ct_id=conn.ct_id + 1)  # the dump the block asked for reads its entry
    assert blocked is not None and rig.packet(FAST_A, conn.orig).dropped and rig.packet(FAST_B, conn.reply).dropped
    flat = rig.control({"cmd": "status"})["counters"]
    assert flat["operator_unshunt"] == 1 and flat["operator_block"] == 1


def test_an_unshunt_that_ended_with_its_connection_leaves_the_pins_file_at_the_next_tick():
    """The pins' file is what a restart holds again: an unshunt whose connection has closed
    must not come back with it and hold the next connection on the tuple for an hour (CI-9
    of session 46: iperf3's next transfer reused the client port)."""
    from nfshunt.app import pin_file
    from tests.support.rig import Rig, shunted
    rig = Rig(default_shunt_timeout=60)
    kept = shunted(rig, sport=45020)
    closing = shunted(rig, sport=45021)
    for conn in (kept, closing):
        assert rig.control({"cmd": "unshunt", "tuple": str(conn.orig)})["ok"]
    rig.kernel_answers()
    path = pin_file.path_in(rig.state_dir.name)
    assert {p.orig.sport for p in pin_file.load(path, time.time())} == {45020, 45021}
    rig.event(sport=45021, ct_id=closing.ct_id + 1, state=7)  # its re-created entry in TIME_WAIT
    rig.advance(1.0)  # a tick
    assert {p.orig.sport for p in pin_file.load(path, time.time())} == {45020}


def test_bad_requests_and_an_unknown_conntrack_id_are_answered_with_an_error():
    from tests.support.rig import Rig, shunted
    rig = Rig()
    conn = shunted(rig)
    assert "no shunt or block with conntrack id 424242" in rig.control({"cmd": "unshunt", "ct_id": 424242})["error"]
    assert "unknown command 'launch'" in rig.control({"cmd": "launch"})["error"]
    assert "not a tuple" in rig.control({"cmd": "block", "tuple": "tcp nonsense"})["error"]
    assert "integer 'ct_id'" in rig.control({"cmd": "unshunt", "ct_id": True})["error"]
    assert rig.control({"cmd": "unshunt", "ct_id": conn.ct_id})["ok"]


def test_reevaluate_clears_the_decisions_hands_every_pair_back_and_records_the_policy():
    """A new policy (`nfshunt iptables apply` asks for this): every shunt and block back to
    the firewall, a TCP shunt's entry re-created first with its decision cleared, the
    decided marks cleared in the kernel, the policy recorded as the pairs' from now on; the
    next decision is the new policy's (the moves of running transfers on a real firewall:
    tests/test_policy_change.py)."""
    from nfshunt.records.markcodec import DECISION_MASK
    from nfshunt.records.model import UDP
    from tests.support.rig import FAST_A, Rig, fast, shunted, slow
    rig = Rig(default_shunt_timeout=60, default_block_timeout=60)
    tcp = shunted(rig, sport=45020, ct_id=1)
    block = shunted(rig, sport=45021, ct_id=2, action=2, proto=UDP)
    reply = rig.control({"cmd": "reevaluate", "reason": "policy changed"})
    assert reply["ok"] and reply["removed"] == 2 and rig.worker.cleared == [DECISION_MASK]
    assert rig.app.policy.recorded == 2  # (1: at start, once the switch was reconciled)
    (restore,) = rig.worker.restores
    assert restore.orig == tcp.orig and restore.mark == tcp.mark & ~DECISION_MASK
    assert fast(rig, tcp)  # its flows wait for the kernel's re-creation
    rig.kernel_answers()
    assert slow(rig, tcp) and not rig.packet(FAST_A, block.orig).dropped and not rig.core.by_key
    assert rig.event(sport=45020, ct_id=1, action=0) is None and slow(rig, tcp)  # the new policy ignores it
    assert rig.counters.flat()["removed:shunt:policy changed"] == 1


# --- a re-evaluation against what the kernel says meanwhile -------------------------------------
# The flush takes every pair down at once; clearing the decisions in the kernel walks the whole
# conntrack table on the worker's thread (seconds for a big one). What the event loop reads
# meanwhile (the listener's backlog, a dump's entries) may carry the old policy's decision: it
# must not put a shunt on the switch that outlives the re-evaluation (V5 of session 57's review).

def _reevaluating(rig):
    """A re-evaluation asked for, its clearing of the kernel's decisions still going on: the
    function that ends it (the worker's answer, then the event loop's turn) and returns the reply."""
    from nfshunt.app.operator_api import EventControl
    pending = []
    rig.app.worker.clear_marks = lambda _mask, done: pending.append(done)
    ev = EventControl({"cmd": "reevaluate", "reason": "policy changed"})
    rig.post(ev)
    rig.pump()
    assert len(pending) == 1

    def cleared(done=1):
        pending.pop()(done, 0, None)  # (on the worker's thread, in production)
        rig.pump()
        assert ev.done.is_set() and ev.reply["ok"], ev.reply
        return ev.reply
    return cleared


def _ignored_before_cleared(rig):
    from nfshunt.core.admission import R_DECIDED_BEFORE
    return rig.counters.flat().get(f"ignored:{R_DECIDED_BEFORE}", 0)


def test_reevaluate_an_event_of_the_listeners_backlog_decided_by_the_old_policy_is_not_shunted():
    """The listener's backlog at the flush: an update the kernel sent before the clearing
    reached its entry, its decision the old policy's. Shunted then, the kernel's clearing of
    the entry (an update with the decision bits cleared) was ignored as a duplicate and the
    shunt stayed. Nothing the policy decided is admitted until the clearing is done; the dump
    asked once it is reads every entry again, and shunts what the new policy decided."""
    from nfshunt.records import cookies
    from nfshunt.records.model import EventKind
    from tests.support.rig import Rig
    rig = Rig(default_shunt_timeout=60)
    rig.advance(1)
    cleared = _reevaluating(rig)
    old = rig.event(sport=41000, ct_id=99)  # marked shunt by the old policy
    assert old is None and rig.flows(cookies.Kind.SHUNT) == []
    rig.advance(rig.core.switch.drain)
    assert rig.event(sport=41000, ct_id=99, action=None) is None  # the kernel clears its decision
    dumps = rig.worker.dumps
    reply = cleared()
    assert rig.core.find(ct_id=99) is None and rig.flows(cookies.Kind.SHUNT) == []
    assert _ignored_before_cleared(rig) == 1 and reply["ignored_meanwhile"] == 1
    assert rig.worker.dumps == dumps + 1  # what the new policy decided meanwhile is read again
    new = rig.event(sport=41000, ct_id=99, kind=EventKind.DUMP)  # that dump: the new policy shunts it
    assert new is not None and new.ct_id == 99 and len(rig.flows(cookies.Kind.SHUNT)) == 2


def test_reevaluate_a_dump_read_before_the_clearing_ended_and_fed_after_it_is_not_shunted():
    """A dump (a reconnect's resync, an overflow's) is read on the worker's thread, the
    clearing's too, but fed to the event loop in slices on a thread of its own: an entry
    read before the clearing ended may reach the loop after it, its decision the old
    policy's. It is ignored (counted); the dump asked after the clearing reads it again."""
    from nfshunt.records import cookies
    from nfshunt.records.model import EventKind
    from nfshunt.switch.feeds import EventConntrack
    from tests.helpers import event
    from tests.support.rig import Rig
    rig = Rig(default_shunt_timeout=60)
    cleared = _reevaluating(rig)
    stale = event(sport=41001, ct_id=98, kind=EventKind.DUMP, received=rig.now)  # read before the clearing ended
    rig.advance(0.5)
    cleared()
    rig.app.feeds.hand_over(EventConntrack([stale], dump=True))  # its slice, fed after
    rig.pump()
    assert rig.core.find(ct_id=98) is None and rig.flows(cookies.Kind.SHUNT) == []
    assert _ignored_before_cleared(rig) == 1
    fresh = event(sport=41001, ct_id=98, kind=EventKind.DUMP, received=rig.now)  # the dump after the clearing
    rig.app.feeds.hand_over(EventConntrack([fresh], dump=True))
    rig.pump()
    assert rig.core.find(ct_id=98) is not None and len(rig.flows(cookies.Kind.SHUNT)) == 2


def test_reevaluate_an_old_decision_whose_entry_went_at_the_drain_leaves_no_shunt():
    """Shunted from the backlog while the clearing went on, a pair's entry is deleted at its
    drain: the clearing finds no entry, and no event comes to take the shunt down. The
    event is not admitted at all, so no entry is deleted and nothing is left on the switch."""
    from nfshunt.records import cookies
    from tests.support.rig import Rig
    rig = Rig(default_shunt_timeout=60)
    rig.advance(1)
    cleared = _reevaluating(rig)
    rig.event(sport=41002, ct_id=97)  # the old policy's shunt
    rig.advance(rig.core.switch.drain + 1)
    cleared()
    rig.advance(1)
    rig.kernel_answers()
    assert rig.core.find(ct_id=97) is None and rig.flows(cookies.Kind.SHUNT) == []
    assert all(ct_id != 97 for _, ct_id in rig.worker.deleted)  # its entry kept, for the new policy to judge



def test_reevaluate_an_old_decision_read_after_the_clearing_ended_goes_with_the_clearings_update():
    """The listener reads the socket in order, but behind the worker: an update the kernel
    sent before the clearing reached its entry can be read after the clearing ended (and
    shunted). The clearing's own update of that entry comes right behind it: the entry the
    pair holds (its conntrack id) says the policy's decision was withdrawn, and the pair is
    handed back to the firewall, even once its entry went at the drain."""
    from nfshunt.core.connection import State
    from nfshunt.records import cookies, markcodec
    from tests.support.rig import Rig, slow
    rig = Rig(default_shunt_timeout=60)
    cleared = _reevaluating(rig)
    rig.advance(0.5)
    cleared()
    rig.advance(0.1)
    late = rig.event(sport=41003, ct_id=96)  # read late: the old policy's shunt
    assert late is not None
    rig.advance(rig.core.switch.drain + 0.1)
    assert late.state is State.LIVE and late.entry_deleted
    rig.event(sport=41003, ct_id=96, action=None)  # the clearing's update, right behind it
    assert late.state is State.TAKING_DOWN
    (restore,) = [r for r in rig.worker.restores if r.orig == late.orig]
    assert restore.mark == late.mark & ~markcodec.DECISION_MASK
    rig.kernel_answers()
    assert rig.core.find(ct_id=96) is None and rig.flows(cookies.Kind.SHUNT) == [] and slow(rig, late)
    assert rig.counters.flat()["removed:shunt:its decision was withdrawn"] == 1


def test_a_decision_cleared_by_hand_takes_the_policys_shunt_down_and_not_an_operators_block():
    """An admin's `conntrack -U --mark` clearing an entry's decision: the policy's shunt on
    it goes back to the firewall (its next packet is judged again); an operator's block is
    the operator's, not the policy's, and stays. A new entry made on a shunt's tuple with
    its id (the kernel reuses ids) says nothing about the shunt's own decision."""
    from nfshunt.core.connection import Action, State
    from nfshunt.records.cookies import Authority
    from nfshunt.records.model import EventKind
    from tests.support.rig import Rig, shunted
    rig = Rig(default_shunt_timeout=60, default_block_timeout=60)
    shunt = shunted(rig, sport=41004, ct_id=95)
    rig.event(sport=41004, ct_id=95, action=None, kind=EventKind.NEW)  # (a new entry's)
    assert shunt.state is State.LIVE
    rig.event(sport=41004, ct_id=95, action=None)
    assert shunt.state is State.TAKING_DOWN
    other = shunted(rig, sport=41005, ct_id=94)
    assert rig.control({"cmd": "block", "tuple": str(other.orig)})["ok"]
    rig.kernel_answers()
    block = rig.event(sport=41005, ct_id=93)  # its entry made again, read by the dump the block asked for
    rig.advance(rig.core.switch.drain)
    assert (block.action, block.authority, block.state) == (Action.BLOCK, Authority.OPERATOR, State.LIVE)
    rig.event(sport=41005, ct_id=93, action=None)
    assert block.state is State.LIVE and rig.core.find(ct_id=93) is block
