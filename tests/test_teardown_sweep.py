"""When the switch's packet-in meter dropped teardowns, the catchers are read: how often."""
from __future__ import annotations

from nfshunt.teardown_sweep import SWEEP_INTERVAL, TeardownSweep


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
