"""Which TCP entries are closing, for updates that do not say (nfshunt/closing.py)."""
from nfshunt.core.closing import CLOSING_MAX, ClosingEntries
from nfshunt.records.model import UDP, EventKind
from tests.helpers import event

ESTABLISHED, LAST_ACK, TIME_WAIT = 3, 6, 7


def test_an_entry_seen_closing_stays_closing_for_updates_without_a_state():
    seen = ClosingEntries()
    assert not seen.closing(event(state=None))  # never seen: a stateless update is taken as live
    assert seen.closing(event(state=LAST_ACK))
    assert seen.closing(event(state=None))
    assert not seen.closing(event(state=None, ct_id=8))  # another entry: ids name entries with their tuple
    assert not seen.closing(event(state=None, sport=40001))


def test_a_live_state_under_the_same_name_is_a_new_entry_and_a_destroy_forgets():
    seen = ClosingEntries()
    seen.closing(event(state=TIME_WAIT))
    assert not seen.closing(event(state=ESTABLISHED))  # the kernel gave a new entry the same id
    assert not seen.closing(event(state=None)) and len(seen) == 0
    seen.closing(event(state=TIME_WAIT))
    assert not seen.closing(event(state=None, kind=EventKind.DESTROY))
    assert not seen.closing(event(state=None)) and len(seen) == 0


def test_udp_is_never_closing_and_the_memory_is_bounded():
    seen = ClosingEntries()
    assert not seen.closing(event(proto=UDP))
    for i in range(CLOSING_MAX + 10):
        seen.closing(event(state=LAST_ACK, ct_id=i))
    assert len(seen) == CLOSING_MAX
    assert not seen.closing(event(state=None, ct_id=0))  # the oldest went first
    assert seen.closing(event(state=None, ct_id=CLOSING_MAX + 9))
