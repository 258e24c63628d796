"""When the switch's packet-in meter dropped teardowns, the catchers are read: how often; and
when a half-closed connection is looked at (its second FIN's packet-in may have been lost)."""
from __future__ import annotations

import pytest

from nfshunt.core.teardown_sweep import CHECK_AFTER, CHECK_MAX, SWEEP_INTERVAL, HalfClosed, TeardownSweep


def test_a_read_follows_new_drops_one_at_a_time_and_not_more_often_than_the_interval():
    s = TeardownSweep()
    assert s.meter_read(0) == 0 and not s.due(1.0)  # nothing dropped: no read
    assert s.meter_read(5) == 5 and s.due(1.0)
    assert s.meter_read(9) == 4 and not s.due(1.5)  # the first read is still out
    s.swept()
    assert not s.due(1.0 + SWEEP_INTERVAL / 2)  # too soon: owed, not forgotten
    assert s.due(1.0 + SWEEP_INTERVAL)
    s.swept()
    assert s.meter_read(9) == 0 and not s.due(10.0)  # no new drops since


def test_a_meter_set_again_counts_from_zero_and_a_lost_switch_ends_the_read_in_flight():
    s = TeardownSweep()
    s.meter_read(40)
    assert s.due(0.0)
    s.reset()  # the switch went away with the read
    assert s.meter_read(3) == 3 and s.due(SWEEP_INTERVAL)  # a new meter: 3 drops are new
    s.swept()
    s.meter_read(50)
    assert s.meter_read(2) == 2  # set again without a disconnect seen: a lower count restarted


def test_a_half_closed_connection_is_looked_at_soon_after_its_fin_then_less_and_less_often():
    h = HalfClosed()
    h.add(7, 10.0)
    h.add(7, 10.1)  # its FIN again (a retransmission): the schedule stands
    assert h.due(10.0 + CHECK_AFTER / 2) == []
    assert h.due(10.0 + CHECK_AFTER) == [7]
    looks = [10.0 + CHECK_AFTER]
    t = looks[0]
    while t < 60.0:
        t += 0.05
        if h.due(t):
            looks.append(t)
    gaps = [round(b - a, 1) for a, b in zip(looks, looks[1:], strict=False)]
    assert gaps[:3] == [CHECK_AFTER, 2 * CHECK_AFTER, 4 * CHECK_AFTER]  # a lost FIN is found within 1 s
    assert max(gaps) == pytest.approx(CHECK_MAX, abs=0.1) and gaps == sorted(gaps)  # a long half-close costs little
    h.discard(7)
    assert not h and h.due(100.0) == []
