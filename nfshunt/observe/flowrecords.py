"""Accounting records: one JSON line for each pair that leaves the switch, with both paths'
packets and bytes, for an admin's log shipper (config `accounting_log`).

A shunted connection crosses two paths: the firewall carried it until the shunt (conntrack
counted that, with net.netfilter.nf_conntrack_acct=1: the entry's counters when the
controller deleted it, which the kernel echoes to the delete), then the switch (its flows'
counters, from their flow-removed messages). The schema (SCHEMA, documented in docs/operating.md
and held by tests/test_flowrecords.py) changes only with its version.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from typing import Any

from nfshunt.config.settings import Config
from nfshunt.core.authority import of_pair
from nfshunt.core.connection import Conn
from nfshunt.records.model import TCP, UDP, EntryCounts, FlowTuple

from .logs import BatchedFileHandler

SCHEMA = "nfshunt.accounting/1"
# Every key of a record, in its order (docs/operating.md's table; a test holds it).
FIELDS = ("schema", "time", "action", "authority", "reason", "family", "proto", "src", "sport", "dst", "dport",
          "zone", "vlan", "ct_id", "switch_ports", "start", "start_from", "end", "duration",
          "slow_counted", "slow_orig_packets", "slow_orig_bytes", "slow_reply_packets", "slow_reply_bytes",
          "fast_orig_packets", "fast_orig_bytes", "fast_reply_packets", "fast_reply_bytes", "packets", "bytes")
KEPT_MAX = 1 << 17  # deleted entries' counters waiting for their pair's end; past it the oldest go
PROTOCOLS = {TCP: "tcp", UDP: "udp"}


def wall(stamp: float) -> str:
    """Seconds since the epoch as RFC 3339 UTC to the millisecond."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(stamp)) + f".{int(stamp * 1000) % 1000:03d}Z"


def record(conn: Conn, cfg: Config, reason: str, slow: EntryCounts | None, now_wall: float,
           now_mono: float) -> dict[str, Any]:
    """The accounting record of a pair that has left the switch (pure: tests build it)."""
    o = conn.orig
    stats = conn.stats or {}
    fwd, rev = stats.get(False), stats.get(True)
    if slow is not None and slow.start_ns is not None:
        start, start_from = slow.start_ns / 1e9, "conntrack"  # nf_conntrack_timestamp=1: the entry's creation
    else:
        start, start_from = now_wall - (now_mono - conn.event_time), "decision"  # the marked event heard
    counted = slow is not None and slow.packets is not None and slow.bytes is not None
    sp, sb = (slow.packets, slow.bytes) if counted and slow is not None else (None, None)
    fast = [fwd.packets if fwd else None, fwd.bytes if fwd else None, rev.packets if rev else None,
            rev.bytes if rev else None]
    slow_nums = [sp[0] if sp else None, sb[0] if sb else None, sp[1] if sp else None, sb[1] if sb else None]
    packets = sum(n for n in (fast[0], fast[2], slow_nums[0], slow_nums[2]) if n is not None)
    nbytes = sum(n for n in (fast[1], fast[3], slow_nums[1], slow_nums[3]) if n is not None)
    values = (SCHEMA, wall(now_wall), conn.action.value, of_pair(conn).authority.value, reason, o.family,
              PROTOCOLS.get(o.proto, str(o.proto)), o.src, o.sport, o.dst, o.dport,
              o.zone or (slow.zone if slow is not None else 0), _vlans(conn), conn.ct_id,
              [conn.ingress.fast, conn.egress.fast],
              wall(start), start_from, wall(now_wall), round(max(0.0, now_wall - start), 3),
              "conntrack" if counted else ("off" if slow is not None else "none"),  # none: its entry was not deleted
              *slow_nums, *fast, packets, nbytes)
    return dict(zip(FIELDS, values, strict=True))


def _vlans(conn: Conn) -> list[int] | None:
    """A VLAN connection's tag on each side, ingress then egress (0: untagged); None untagged
    (and a routed one between untagged interfaces)."""
    tags = conn.tags
    if not conn.orig.zone and not (tags and any(tags)):
        return None
    return list(tags) if tags else [0, 0]


class FlowRecords:
    """Writes a record for each pair that leaves the switch; keeps the slow path's counts
    of shunts whose entries were deleted until their pair ends."""

    def __init__(self, path: str, cfg: Config):
        self.cfg = cfg
        self.log = logging.getLogger("nfshunt.accounting")
        self.log.propagate = False
        self.log.setLevel(logging.INFO)
        for handler in list(self.log.handlers):
            self.log.removeHandler(handler)
        os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
        self.handler = BatchedFileHandler(path)
        self.handler.setFormatter(logging.Formatter("%(message)s"))
        self.log.addHandler(self.handler)
        self._slow: collections.OrderedDict[tuple[int, FlowTuple], EntryCounts] = collections.OrderedDict()
        self._lock = threading.Lock()  # the worker's thread adds, the event loop takes

    def slow_counted(self, orig: FlowTuple, ct_id: int, counts: EntryCounts) -> None:
        """A shunt's entry deleted: what the slow path carried (the conntrack worker's thread)."""
        with self._lock:
            self._slow[(ct_id, orig)] = counts
            while len(self._slow) > KEPT_MAX:
                self._slow.popitem(last=False)

    def ended(self, conn: Conn, reason: str) -> None:
        """A pair left the switch (the Removed outcome, on the event loop): its record."""
        with self._lock:
            slow = self._slow.pop((conn.entry, conn.orig), None)
        self.log.info(json.dumps(record(conn, self.cfg, reason, slow, time.time(), time.monotonic())))
