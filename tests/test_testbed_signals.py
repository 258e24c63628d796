"""A Ctrl-C during an Open vSwitch restart waits for the restart (nfshunt_testbed.machine
Uninterruptible): the testbed's handler defers it, and it is raised when the restart ends."""
from __future__ import annotations

import signal

import pytest


def test_a_signal_inside_the_stretch_is_raised_at_its_end_and_one_outside_at_once():
    from nfshunt_testbed.bed import Testbed
    from nfshunt_testbed.machine import UNINTERRUPTIBLE
    done = []
    with pytest.raises(KeyboardInterrupt, match="signal 2"):
        with UNINTERRUPTIBLE:
            with UNINTERRUPTIBLE:  # nested: the outer end raises
                Testbed._on_signal(None, signal.SIGINT, None)  # type: ignore[arg-type]
                done.append("inner")
            done.append("outer")
    assert done == ["inner", "outer"]  # the stretch ran to its end
    with pytest.raises(KeyboardInterrupt, match="signal 15"):
        Testbed._on_signal(None, signal.SIGTERM, None)  # type: ignore[arg-type]
    with UNINTERRUPTIBLE:  # the deferred one was raised once, not again
        pass


def test_an_error_inside_the_stretch_is_not_replaced_by_the_deferred_signal():
    from nfshunt_testbed.machine import UNINTERRUPTIBLE, TestbedError
    with pytest.raises(TestbedError):
        with UNINTERRUPTIBLE:
            assert UNINTERRUPTIBLE.defer(signal.SIGINT)
            raise TestbedError("Open vSwitch did not come back")
    with UNINTERRUPTIBLE:  # nothing left pending
        pass
