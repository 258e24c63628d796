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
    InFlight,
    MeterRead,
    ReconcileRead,
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
    inflight.ask(3, MeterRead(1.0))
    assert inflight.expired(EXPIRY) == []
    inflight.answer(3, 4.0)  # the switch is working: what it was asked before waits on
    assert inflight.expired(4.0 + EXPIRY) == []
    late = inflight.expired(4.0 + EXPIRY + 0.1)
    assert [type(r) for r in late] == [MeterRead, TableSize] and len(inflight) == 0
    # A give-up restarts the clock for what is still in flight.
    inflight.ask(4, TableSize(9.5))
    inflight.ask(5, TableSize(14.0))
    assert inflight.expired(14.7) == [TableSize(9.5)]
    assert inflight.expired(14.0 + EXPIRY + 0.5) == [] and len(inflight) == 1  # 5 s from the give-up, not its asking


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
