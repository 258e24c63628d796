"""The start-up clearing of the kernel's decisions against what the event loop reads meanwhile
(on the rig).

A controller that starts and finds the policy is not the one the switch's pairs were decided
under (core/policy_state.PolicyWatch) hands every adopted pair back and clears the decisions
of the whole conntrack table on the worker's thread (reconcile.py's ClearDecisions), seconds
for a big table. What the event loop reads meanwhile (the listener's backlog, a dump's
entries) may carry the old policy's decision: acted on, its shunt outlives the clearing once
its entry is deleted at the drain before the clearing reaches it. The gate is the
re-evaluation's (policy_state.Clearing): no decision of the policy's is acted on until the
clearing is answered, whatever the answer, and a dump then reads every entry again.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from nfshunt.core.admission import R_DECIDED_BEFORE
from nfshunt.records import cookies
from nfshunt.records.markcodec import DECISION_MASK
from nfshunt.records.model import EventKind
from tests.support.rig import Rig

Done = Callable[[int, int, "str | None"], None]


def _starting(**cfg: Any) -> tuple[Rig, list[Done]]:
    """A controller started under a policy the switch's pairs were not decided under, its
    clearing of the kernel's decisions asked and not answered yet (the worker's done()s)."""
    rig = Rig(stale_policy=True, connect=False, default_shunt_timeout=60, **cfg)
    pending: list[Done] = []
    rig.worker.clear_marks = lambda mask, done: pending.append(done) if mask == DECISION_MASK else None
    rig.connect(rig.switch)
    assert rig.core.reconciled and len(pending) == 1
    return rig, pending


def _answer(rig: Rig, pending: list[Done], cleared: int = 1, error: str | None = None) -> None:
    pending.pop()(cleared, 0, error)  # (on the worker's thread, in production)
    rig.pump()


def _ignored(rig: Rig) -> int:
    return rig.counters.flat().get(f"ignored:{R_DECIDED_BEFORE}", 0)


def test_an_old_policys_decision_read_while_the_start_up_clearing_goes_on_is_not_shunted(caplog):
    """The listener's backlog at start: an entry the old policy marked shunt. Shunted, its
    entry went at the drain, before the clearing reached it: nothing was left to clear and
    nothing took the old policy's shunt down. It is not acted on (counted, logged once at the
    end); the dump the end asks reads every entry again and shunts what the new policy marked."""
    rig, pending = _starting()
    dumps = rig.worker.dumps
    old = rig.event(sport=41000, ct_id=99)  # marked shunt by the old policy
    assert old is None and rig.flows(cookies.Kind.SHUNT) == []
    rig.advance(rig.core.switch.drain + 1)
    assert all(ct_id != 99 for _, ct_id in rig.worker.deleted)  # its entry kept, for the new policy to judge
    assert _ignored(rig) == 1 and rig.worker.dumps == dumps  # (a dump now would read it before the clearing)
    with caplog.at_level(logging.WARNING, logger="nfshunt"):
        _answer(rig, pending)
    assert rig.worker.dumps == dumps + 1 and not rig.core.clearing.going
    assert "1 decisions read before the kernel had cleared them were not acted on" in caplog.text
    new = rig.event(sport=41000, ct_id=99, kind=EventKind.DUMP)  # that dump: the new policy marked it shunt
    assert new is not None and len(rig.flows(cookies.Kind.SHUNT)) == 2


def test_a_dump_read_before_the_start_up_clearing_ended_and_fed_after_it_is_not_shunted():
    """A dump's entries are fed to the event loop in slices after they were read: one read
    before the clearing's end (the worker's, on its clock) is not acted on when it comes
    after it; what is read after is."""
    from nfshunt.switch.feeds import EventConntrack
    from tests.helpers import event
    rig, pending = _starting()
    stale = event(sport=41001, ct_id=98, kind=EventKind.DUMP, received=rig.now)
    rig.advance(0.5)
    _answer(rig, pending)
    rig.app.feeds.hand_over(EventConntrack([stale], dump=True))
    rig.pump()
    assert rig.core.find(ct_id=98) is None and _ignored(rig) == 1
    fresh = event(sport=41001, ct_id=98, kind=EventKind.DUMP, received=rig.now)
    rig.app.feeds.hand_over(EventConntrack([fresh], dump=True))
    rig.pump()
    assert rig.core.find(ct_id=98) is not None and len(rig.flows(cookies.Kind.SHUNT)) == 2


def test_a_start_up_clearing_that_fails_opens_the_gate_all_the_same(caplog):
    """The kernel could not be asked (the worker answers every clearing, kernel/worker.py):
    the decisions are acted on again from its answer on (a gate stuck closed would stop
    every policy shunt for good), a dump reads every entry, the failure is logged."""
    rig, pending = _starting()
    dumps = rig.worker.dumps
    assert rig.event(sport=41002, ct_id=97) is None
    with caplog.at_level(logging.WARNING, logger="nfshunt"):
        _answer(rig, pending, cleared=0, error="netlink: no buffer space")
    assert "could not clear the policy's decisions in conntrack: netlink: no buffer space" in caplog.text
    assert not rig.core.clearing.going and rig.worker.dumps == dumps + 1
    rig.advance(0.1)
    assert rig.event(sport=41002, ct_id=97) is not None


def test_a_start_up_clearing_that_cannot_be_asked_opens_the_gate():
    """The worker's request itself raised (a bug): the turn counts it, and the gate opens at
    once (no answer will ever come)."""
    rig = Rig(stale_policy=True, connect=False, default_shunt_timeout=60)

    def broken(_mask: int, _done: Done) -> None:
        raise RuntimeError("worker gone")
    rig.worker.clear_marks = broken
    try:
        rig.connect(rig.switch)
    except AssertionError as exc:  # (the rig fails a turn whose handler raised: here, on purpose)
        assert "worker gone" in str(exc)
    rig.pump()
    assert rig.core.reconciled and not rig.core.clearing.going
    rig.advance(0.1)
    assert rig.event(sport=41003, ct_id=96) is not None


def test_a_switch_that_reconnects_or_goes_while_the_start_up_clearing_goes_on_leaves_no_gate_closed():
    """The clearing is the kernel's, not the switch connection's: a session that ends before
    the clearing is answered, and the reconnect's reconcile, neither clear again nor keep the
    gate: the answer opens it whether the switch is there or not."""
    rig, pending = _starting()
    rig.reconnect(rig.switch)  # the reconcile again: no second clearing, the gate still closed
    assert rig.core.reconciled and len(pending) == 1 and rig.core.clearing.going == 1
    assert rig.event(sport=41004, ct_id=95) is None
    rig.disconnect()
    dumps = rig.worker.dumps
    _answer(rig, pending)  # answered while the switch is away
    assert not rig.core.clearing.going and rig.worker.dumps == dumps + 1
    rig.connect(rig.switch)
    rig.advance(0.1)
    assert rig.event(sport=41004, ct_id=95) is not None and len(rig.flows(cookies.Kind.SHUNT)) == 2


def test_a_re_evaluation_during_the_start_up_clearing_ends_the_gate_with_the_last_of_them():
    """A re-evaluation asked while the start-up clearing goes on: the gate is one, closed
    until both are answered (the worker answers them in the order they began)."""
    rig, pending = _starting()
    rig.post(__import__("nfshunt.app.operator_api", fromlist=["EventControl"]).EventControl(
        {"cmd": "reevaluate", "reason": "policy changed"}))
    rig.pump()
    assert len(pending) == 2 and rig.core.clearing.going == 2
    first = pending.pop(0)
    first(1, 0, None)  # the start-up's
    rig.pump()
    assert rig.core.clearing.going == 1 and rig.event(sport=41005, ct_id=94) is None
    _answer(rig, pending)  # the re-evaluation's
    assert not rig.core.clearing.going
    rig.advance(0.1)
    assert rig.event(sport=41005, ct_id=94) is not None
