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
