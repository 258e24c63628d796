"""The registry of requests in flight (inflight.py) and how replies are routed by it
(replies.py): what was asked gets its answer, a reply to nothing asked is counted and
dropped, and a switch silent for EXPIRY has what it was asked given up, once."""
import logging
import os
from types import SimpleNamespace

os.environ.setdefault("OSKEN_HUB_TYPE", "native")

from nfshunt.core import commands as cm  # noqa: E402
from nfshunt.observe.logs import RateLimitedLog  # noqa: E402
from nfshunt.observe.metrics import Metrics  # noqa: E402
from nfshunt.openflow.inflight import (
    EXPIRY,
    Barrier,
    Batch,
    CounterRead,
    FlowsRead,
    GivenUp,
    InFlight,
    MeterRead,
    MeterSet,
    ReconcileRead,
    StaticRead,
    TableSize,
)
from nfshunt.openflow.session import Session  # noqa: E402
from nfshunt.switch.replies import Replies  # noqa: E402
from nfshunt.switch.switch import Switch  # noqa: E402
from tests.helpers import config, event  # noqa: E402
from tests.test_channel import FakeDatapath  # noqa: E402


def test_an_answer_takes_its_request_out_once_complete_and_an_unknown_xid_finds_nothing():
    inflight = InFlight()
    read = ReconcileRead(1.0)
    inflight.ask(7, read)
    assert inflight.answer(7, 2.0, done=False) is read and len(inflight) == 1  # a part: more to come
    assert inflight.answer(7, 2.5) is read and len(inflight) == 0
    assert inflight.answer(7, 3.0) is None and inflight.answered == 2.5  # nothing asked: no answer either


def test_requests_expire_only_once_the_switch_answered_nothing_for_expiry_since_they_were_asked():
    inflight = InFlight()
    inflight.ask(1, MeterRead(0.0))
    inflight.ask(2, TableSize(3.0))
    inflight.ask(3, StaticRead(1.0))  # (another kind of message: it passes neither)
    assert inflight.expired(EXPIRY) == []
    inflight.answer(3, 4.0)  # the switch is working: what it was asked before waits on
    assert inflight.expired(4.0 + EXPIRY) == []
    late = inflight.expired(4.0 + EXPIRY + 0.1)
    assert [(type(r), why) for r, why in late] == [(MeterRead, GivenUp.SILENT), (TableSize, GivenUp.SILENT)]
    assert len(inflight) == 0
    # A give-up restarts the clock for what is still in flight.
    inflight.ask(4, TableSize(9.5))
    inflight.ask(5, TableSize(14.0))
    assert [r.asked for r, _ in inflight.expired(14.7)] == [9.5]
    assert inflight.expired(14.0 + EXPIRY + 0.5) == [] and len(inflight) == 1  # 5 s from the give-up, not its asking


def test_a_request_the_switch_answered_past_is_given_up_though_it_answers_the_rest():
    """A lost answer: the switch answers a later request of the same kind of message (in order),
    or a later barrier (which it answers only after everything asked before it), and keeps
    answering: the first rule alone never gives the lost one up."""
    inflight = InFlight()
    inflight.ask(1, ReconcileRead(0.0))  # its answer lost
    tick = 0.0
    while tick < 3 * EXPIRY:  # a read of the default flows' counters every tick, answered
        tick += 1.0
        inflight.ask(100 + int(tick), StaticRead(tick))
        inflight.answer(100 + int(tick), tick + 0.01)
        late = inflight.expired(tick + 0.02)
        if late:
            break
    assert [(type(r), why) for r, why in late] == [(ReconcileRead, GivenUp.PASSED)] and tick == EXPIRY


def test_passed_by_another_kind_of_message_is_not_given_up_but_passed_by_a_barrier_is():
    """Different messages may be answered out of order (a switch that answers meter reads while
    it applies a burst): a meter read's answer does not give a flow read up; a barrier's does."""
    for passer, given_up in ((MeterRead(1.0), []), (Barrier(1.0), [(ReconcileRead, GivenUp.PASSED)])):
        inflight = InFlight()
        inflight.ask(1, ReconcileRead(0.0))
        inflight.ask(2, passer)
        inflight.answer(2, 4.0)
        assert [(type(r), why) for r, why in inflight.expired(EXPIRY + 0.5)] == given_up


def test_a_request_whose_answer_is_still_coming_or_passed_only_recently_is_not_given_up():
    inflight = InFlight()
    inflight.ask(1, ReconcileRead(0.0))  # a large table: its parts come over many seconds
    inflight.ask(2, StaticRead(0.5))
    inflight.answer(2, 0.6)  # (a switch may answer a small read between a large one's parts)
    for t in range(1, 12):
        inflight.answer(1, float(t), done=False)
        assert inflight.expired(t + 0.5) == []
    inflight.answer(1, 12.0)
    inflight.ask(3, TableSize(20.0))
    assert inflight.expired(20.0 + EXPIRY - 0.1) == []  # unanswered, passed by nothing: the silent rule's


def test_a_meter_setting_answered_only_by_a_refusal_is_never_passed():
    inflight = InFlight()
    inflight.ask(1, MeterSet(0.0))
    inflight.ask(2, Barrier(0.5))
    inflight.answer(2, 0.6)
    for t in range(1, 20):  # the switch answers every tick's read
        inflight.ask(10 + t, MeterRead(float(t)))
        inflight.answer(10 + t, t + 0.01)
        assert inflight.expired(t + 0.02) == []


def test_requests_are_found_and_dropped_by_kind():
    inflight = InFlight()
    waiter = SimpleNamespace(set=lambda: None)
    inflight.ask(1, Barrier(0.0, Batch([], {}), waiter))
    inflight.ask(2, MeterRead(0.0))
    inflight.ask(3, Barrier(0.0, None, waiter))
    assert [xid for xid, _ in inflight.of(Barrier)] == [1, 3] and inflight.count(MeterRead) == 1
    assert len(inflight.drop(Barrier)) == 2 and len(inflight) == 1


def _replies(**cfg):
    sw = Switch(config(**cfg), 0)
    sw.core.switch_connected(0x04)
    dp = FakeDatapath()
    dp.id, dp.address = 1, ("192.0.2.1", 6653)
    sw.session = Session(dp, sw.cfg)
    ran = []
    counters = Metrics(lambda: {}).counters
    roles = SimpleNamespace(reply=lambda sw, msg: ran.append(("role", msg)), request=lambda sw, req: None)
    replies = Replies(counters, RateLimitedLog(logging.getLogger("test")), SimpleNamespace(reconciled=lambda i: None),
                      roles, lambda sw, cmds: ran.append(list(cmds)))
    return sw, replies, ran, counters


def _stats(xid, body=(), more=False):
    return SimpleNamespace(xid=xid, body=list(body), flags=1 if more else 0)


def test_a_reply_goes_to_the_handler_of_what_was_asked_and_one_to_nothing_asked_is_counted():
    sw, replies, ran, counters = _replies()
    s = sw.session
    got = []
    s.read_flows(got.append, 1.0)
    ((xid, _),) = s.inflight.of(FlowsRead)
    replies.stats(sw, _stats(xid, more=True), 1.1)
    assert got == [] and s.inflight.count(FlowsRead) == 1  # a part: the read goes on
    replies.stats(sw, _stats(xid), 1.2)
    assert got == [[]] and len(s.inflight) == 0
    replies.stats(sw, _stats(xid), 1.3)  # the same xid again: nothing asked now
    assert got == [[]] and counters.flat()["openflow_unasked:SimpleNamespace"] == 1


def test_given_up_what_the_core_waits_for_is_asked_again_and_an_operators_read_answered_without():
    sw, replies, ran, _ = _replies()
    s = sw.session
    conn = SimpleNamespace()
    s.inflight.ask(1, CounterRead(0.0, conn))
    s.inflight.ask(2, ReconcileRead(0.0))
    got = []
    s.inflight.ask(3, FlowsRead(0.0, got.append))
    s.inflight.ask(4, MeterRead(0.0))
    replies.give_up(sw, s, EXPIRY + 1)
    assert ran == [[cm.ReadCounters(conn)], [cm.RequestSwitchFlows()]] and got == [None] and len(s.inflight) == 0


def test_an_unanswered_barrier_rolls_its_installs_back_and_tells_its_waiter():
    sw, replies, ran, counters = _replies()
    s = sw.session
    told = []
    sw.core.reconcile([], 0.0)
    conn = sw.core.conntrack_event(event())[0].conn
    s.inflight.ask(1, Barrier(0.0, Batch([conn], {}), SimpleNamespace(set=lambda: told.append(True))))
    replies.give_up(sw, s, EXPIRY + 1)
    assert told == [True] and counters.flat()["install_timeouts"] == 1
    assert [type(x).__name__ for x in ran[0]] == ["RemoveFlows", "Refused"]


def test_a_session_ends_with_its_connection_and_whoever_waits_for_a_read_is_answered():
    sw, replies, _, _ = _replies()
    got = []
    sw.session.read_flows(got.append, 1.0)
    session = sw.gone()
    assert sw.session is None and session is not None
    replies.abandoned(session)
    assert got == [None]
