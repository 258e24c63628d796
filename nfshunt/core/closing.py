"""TCP conntrack entries known to be closing, for events that do not say their state.

An update event carries the TCP state only when the state changed; an update for another
reason (the reply direction seen, a mark or timeout change) has none. A closing entry's
update without it could pass for a live connection's, and a closing entry a take-down
re-created keeps the policy's decision (connection.py `closing`): the controller would
shunt a connection that has just ended, and the shunt would outlive it until its idle
timeout, carrying whatever a new connection on the same ports sends past the firewall.

A conntrack entry never leaves a closing state (a new SYN on a TIME_WAIT or CLOSE entry
makes a new entry), so an entry seen closing once is closing for as long as it lives.
Entries are named by their id and original tuple together: ids are a 32-bit hash that
another entry may share. A later event that reports a live state for the same name is a
new entry that happens to have the same id (the kernel reuses them): it is forgotten then,
and when the entry is destroyed. No I/O.
"""
from __future__ import annotations

from nfshunt.records.model import TCP, TCP_CLOSING, ConnEvent, EventKind, FlowTuple

CLOSING_MAX = 65536  # entries remembered; past it the oldest go (they have long been closing)


class ClosingEntries:
    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[tuple[int, FlowTuple], None] = {}  # insertion order: oldest first

    def __len__(self) -> int:
        return len(self._entries)

    def closing(self, ev: ConnEvent) -> bool:
        """Whether the event's TCP entry is closing, learning from it: by its own state where
        it reports one, else by what earlier events of the same entry reported."""
        if ev.orig.proto != TCP:
            return False
        key = (ev.ct_id, ev.orig)
        entries = self._entries
        if ev.kind is EventKind.DESTROY:
            entries.pop(key, None)
            return False
        if ev.tcp_state is None:
            return key in entries
        if ev.tcp_state in TCP_CLOSING:
            if key not in entries:
                entries[key] = None
                if len(entries) > CLOSING_MAX:
                    del entries[next(iter(entries))]
            return True
        entries.pop(key, None)
        return False

    def peek(self, ev: ConnEvent) -> bool:
        """What `closing` would answer for the event, learning nothing (a dry run)."""
        if ev.orig.proto != TCP or ev.kind is EventKind.DESTROY:
            return False
        if ev.tcp_state is None:
            return (ev.ct_id, ev.orig) in self._entries
        return ev.tcp_state in TCP_CLOSING
