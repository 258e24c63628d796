"""Teardowns whose packet-ins the switch dropped, found again from the catchers' counters.

The controller meter (`packet_in_rate`) keeps a host sending FIN/RST segments from loading
the controller, but an honest burst of closes (sixty connections ending at once) exceeds
its burst too, and the switch drops those packet-ins: the close crossed the switch, the
controller never heard of it, and the shunt would stay open until its idle timeout with
its conntrack entry long gone (a new connection on the same ports would cross unchecked).
The meter counts what it drops. When that count grows, one flow-stats read of the
catchers says which of them saw a FIN or RST (a catcher matches nothing else), and the
core takes each as the packet-in it missed; a FIN it already had changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

SWEEP_INTERVAL = 2.0  # at most one catcher read this often: a FIN flood costs a read per 2 s


@dataclass
class TeardownSweep:
    dropped: int = 0  # the meter's drop count at the last read
    owed: bool = False  # drops seen that no catcher read has covered yet
    pending: bool = False  # a catcher read asked for, its reply not complete
    last: float | None = None  # when the last catcher read was asked for

    def meter_read(self, dropped: int) -> int:
        """The meter's drop count; how many drops are new since the last read."""
        if dropped < self.dropped:  # the meter was set again (a reconnect): its count restarted
            self.dropped = 0
        new = dropped - self.dropped
        self.dropped = dropped
        self.owed = self.owed or new > 0
        return new

    def due(self, now: float) -> bool:
        """Whether to read the catchers now (and the read is then taken as asked for)."""
        if not self.owed or self.pending or (self.last is not None and now - self.last < SWEEP_INTERVAL):
            return False
        self.owed, self.pending, self.last = False, True, now
        return True

    def swept(self) -> None:
        self.pending = False

    def reset(self) -> None:
        """The switch went away: its meter and any read in flight with it."""
        self.dropped, self.pending = 0, False


# --- packet-ins lost without a meter drop (issue 26.4) ------------------------------------
#
# Open vSwitch's userspace datapath also loses catchers' packet-ins with no meter drop:
# reusing the tuples of connections closed a moment before, a FIN crossed a catcher and
# was forwarded, and its packet-in never came (1-13 of 20 closes in a round, measured).
# A close is two FINs a moment apart, and when one packet-in of the two is lost the core
# holds the connection half-closed: that is where to look, and it is cheap, as few
# connections are half-closed at once however many are shunted.
#   - flow_layout single: each half-closed connection's catchers of what it still lacks
#     (the other direction's FIN, either RST) are read by exact cookie (the switch finds
#     them through its cookie index) CHECK_AFTER after its FIN, then at doubling intervals.
#   - flow_layout pipeline: the catchers are shared and name no connection (their
#     counters, read against the packet-ins, lagged and undercounted: 192 FINs counted for
#     227 packet-ins received, so they cannot say that one was lost). A connection still
#     half-closed CHECK_AFTER after its FIN is taken as closed, as after a second FIN (its
#     entry re-created in TIME_WAIT, its close watched: close_watch.py). One that is really
#     half-closed, or whose FIN was forged, and still sends data contradicts the close: its
#     entry goes back to ESTABLISHED, decision cleared, and the policy shunts it again.
#     (Re-created ESTABLISHED at once instead, a closed connection's entry outlived it,
#     and a new connection on its tuple did not get shunted within 15 s.)
# A connection whose two packet-ins were both lost is not half-closed: it ends at its idle
# timeout, as before.

WATCH_PERIOD = 0.2  # seconds between looks at the half-closed connections
CHECK_AFTER = 0.3  # a half-closed connection is first looked at this long after its FIN
CHECK_MAX = 8.0  # and then at doubling intervals up to this (a long half-close costs little)


@dataclass(slots=True)
class _Check:
    next: float
    interval: float


class HalfClosed:
    """Connections (by pair key) with one FIN caught, and when to look at them again."""

    def __init__(self) -> None:
        self._checks: dict[int, _Check] = {}

    def __len__(self) -> int:
        return len(self._checks)

    def add(self, key: int, now: float) -> None:
        if key not in self._checks:
            self._checks[key] = _Check(now + CHECK_AFTER, CHECK_AFTER)

    def discard(self, key: int) -> None:
        self._checks.pop(key, None)

    def due(self, now: float) -> list[int]:
        """Keys to look at now; each is next due after its wait, which then doubles."""
        out = []
        for key, check in self._checks.items():
            if check.next <= now:
                out.append(key)
                check.next = now + check.interval
                check.interval = min(check.interval * 2, CHECK_MAX)
        return out

    def clear(self) -> None:
        self._checks.clear()
