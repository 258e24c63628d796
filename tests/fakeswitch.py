"""Moved to tests/support/fakeswitch.py (the test-support package); kept for tests that
still import it from here."""
from tests.support.fakeswitch import Entry, FakeSwitch, Fate, PacketIn, frame  # noqa: F401
