"""The decision core's parts on their own: the rules each module holds beyond what the
Core façade's tests (test_core.py, test_fake_core.py) show through it."""
import dataclasses

import pytest

from nfshunt.core import admission as adm
from nfshunt.core.core import Core
from nfshunt.core.layout import PIPELINE_ENTRIES, entries_per_pair, goes_to_pipeline
from nfshunt.core.pins import PIN_TTL, Pins
from nfshunt.core.reconcile import table_1_complete
from nfshunt.core.state import CoreState
from nfshunt.records import cookies
from nfshunt.records.model import OFP10, OFP13, TCP, UDP, Action, EventKind, SwitchFlow
from tests.helpers import config, event


def _state(cfg):
    """The one switch's shared core state."""
    return CoreState(cfg, cfg.switches[0])


def test_a_pin_holds_both_directions_and_only_its_own_entry_ending_lifts_an_unshunt():
    pins = Pins()
    ev = event(ct_id=5)
    pins.hold(ev.orig, Action.IGNORE, 10.0)
    assert pins[ev.reply] is pins[ev.orig] and pins[ev.orig].expires == 10.0 + PIN_TTL
    pins[ev.orig].ct_id = 5  # the entry it held back (set when the admission applied it)
    pins.destroyed(event(ct_id=6, kind=EventKind.DESTROY))  # another entry of the tuple
    assert ev.orig in pins
    pins.destroyed(event(ct_id=5, kind=EventKind.DESTROY))
    assert not pins


def test_an_unshunt_pin_ends_when_its_tcp_connection_is_over_whichever_entry_it_held_last():
    """TIME_WAIT or CLOSE ends the connection the operator unshunted (a SYN then starts a new
    one on the tuple, which the kernel may give the same id): the pin goes, and says so for
    the pins' file. A block pin and an IDS's stay until they expire or are released."""
    from nfshunt.core.pins import IdsHold
    pins = Pins()
    a, b, ids = event(sport=1, ct_id=5), event(sport=2), event(sport=3)
    pins.hold(a.orig, Action.IGNORE, 10.0)
    pins[a.orig].ct_id = 4  # the entry before a take-down re-created it (a new id)
    pins.hold(b.orig, Action.BLOCK, 10.0)
    pins.hold_for(ids.orig, IdsHold(Action.SHUNT, "ids:zeek"))
    pins.closed(event(sport=2, state=7))
    pins.closed(event(sport=3, state=7))
    assert len(pins) == 6 and not pins.ended
    pins.closed(dataclasses.replace(a, orig=a.reply, reply=a.orig, tcp_state=7))  # seen from the server's side
    assert a.orig not in pins and a.reply not in pins and pins.ended


def test_a_block_pin_outlives_its_entry_until_it_expires():
    pins = Pins()
    ev = event(ct_id=5)
    pins.hold(ev.orig, Action.BLOCK, 10.0)
    pins[ev.orig].ct_id = 5
    pins.destroyed(event(ct_id=5, kind=EventKind.DESTROY))
    assert len(pins) == 2
    pins.expire(10.0 + PIN_TTL - 1)
    assert len(pins) == 2
    pins.expire(10.0 + PIN_TTL)
    assert not pins


def test_pins_expire_by_their_last_hold_and_an_ids_pin_never():
    from nfshunt.core.pins import IdsHold
    pins = Pins()
    a, b, ids = event(sport=1), event(sport=2), event(sport=3)
    pins.hold(a.orig, Action.BLOCK, 10.0)
    pins.hold(b.orig, Action.IGNORE, 10.0)  # the same expiry: ties are fine
    pins.hold_for(ids.orig, IdsHold(Action.SHUNT, "ids:zeek"))
    pins.hold(a.reply, Action.BLOCK, 20.0)  # held again (by its other direction), for longer
    pins.destroyed(event(sport=2, ct_id=99, kind=EventKind.DESTROY))  # not the entry b held back
    pins[b.orig].ct_id = 7
    pins.destroyed(event(sport=2, ct_id=7, kind=EventKind.DESTROY))  # b ends with its entry
    pins.hold(b.orig, Action.BLOCK, 15.0)  # and is pinned again
    pins.expire(10.0 + PIN_TTL)
    assert set(pins) == {a.orig, a.reply, b.orig, b.reply, ids.orig, ids.reply}
    pins.expire(15.0 + PIN_TTL)
    assert set(pins) == {a.orig, a.reply, ids.orig, ids.reply}
    pins.expire(20.0 + PIN_TTL)
    pins.expire(1e12)
    assert set(pins) == {ids.orig, ids.reply} and not pins._expiring


def test_the_admission_decides_against_the_shared_state_alone():
    shared = _state(config(max_shunts=1))
    admission = adm.Admission(shared)
    assert admission.conntrack_event(event())[0].reason == adm.R_NO_SWITCH
    shared.version, shared.reconciled = OFP13, True
    (install,) = admission.conntrack_event(event())
    assert shared.conns.by_tuple(install.conn.reply) is install.conn and shared.conns.shunts == 1
    assert admission.conntrack_event(event(sport=2, ct_id=2))[0].reason == adm.R_BUDGET
    assert list(shared.waiting) == [event(sport=2).orig]


def test_waiting_blocks_go_first_and_the_newest_shunts_fall_off_a_full_queue(monkeypatch):
    monkeypatch.setattr(adm, "WAITING_MAX", 3)
    shared = _state(config())
    admission = adm.Admission(shared)
    for sport in (1, 2, 3):
        admission.wait(event(sport=sport), front=False)
    admission.wait(event(sport=9, action=2), front=True)
    assert [t.sport for t in shared.waiting] == [9, 1, 2]


def test_a_pair_waits_again_as_its_event_but_an_adopted_one_never():
    shared = _state(config())
    shared.version, shared.reconciled = OFP13, True
    admission = adm.Admission(shared)
    ev = event(action=2)
    (install,) = admission.conntrack_event(ev)
    admission.wait_again(install.conn)
    assert list(shared.waiting.items()) == [(ev.orig, ev)]  # made again from the pair, a block first
    adopted = dataclasses.replace(install.conn, orig=event(sport=3).orig, event_kind=None)
    admission.wait_again(adopted)
    assert list(shared.waiting) == [ev.orig]


def test_the_facade_reads_and_writes_the_state_its_parts_share():
    core = Core(config())
    core.switch_connected(OFP13)
    core.reconcile([], 0.0)
    core.budget = 1  # as the app's table size or a test sets it
    assert core.shared.budget == 1 and core.budget == 1
    core.conntrack_event(event())
    assert core.conntrack_event(event(sport=2, ct_id=2))[0].reason == adm.R_BUDGET
    assert core.waiting is core.shared.waiting and core.conns is core.shared.conns
    core.stale_policy = True
    assert core.shared.stale_policy


def _table_1(groups, missing=0):
    flows = [SwitchFlow(cookies.make_pipeline(g, catcher=i > 0, rst=i > 2), 100, None, None, fast)
             for g, fast in groups for i in range(PIPELINE_ENTRIES)]
    return flows[:len(flows) - missing]


def test_table_1_is_complete_with_every_flow_of_every_port_group_of_this_config():
    cfg = config().switches[0]  # two port groups, fast ports 1 and 3
    assert table_1_complete(cfg, _table_1([(0, 1), (1, 3)]))
    assert not table_1_complete(cfg, _table_1([(0, 1), (1, 3)], missing=1))
    assert not table_1_complete(cfg, _table_1([(0, 1), (1, 4)]))  # group 1's flows output elsewhere
    assert not table_1_complete(cfg, _table_1([(0, 1), (2, 3)]))  # a group this config does not have


@pytest.mark.parametrize("version,teardown,pipeline,action,proto,entries,goto", [
    (OFP13, True, False, Action.SHUNT, TCP, 6, False),  # its own four catchers
    (OFP13, True, True, Action.SHUNT, TCP, 2, True),  # table 1's shared catchers
    (OFP13, True, True, Action.SHUNT, UDP, 2, False),
    (OFP13, True, True, Action.BLOCK, TCP, 2, False),
    (OFP13, False, True, Action.SHUNT, TCP, 2, False),
    (OFP10, True, False, Action.SHUNT, TCP, 2, False),  # no catchers on OpenFlow 1.0
])
def test_what_a_pair_takes_on_the_switch_in_each_layout(version, teardown, pipeline, action, proto, entries, goto):
    cfg = config(tcp_teardown=teardown)
    catches = version != OFP10 and teardown and action is Action.SHUNT and proto == TCP
    assert entries_per_pair(catches, pipeline) == entries
    assert goes_to_pipeline(version, cfg, action, proto, pipeline) is goto
