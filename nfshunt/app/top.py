"""`nfshunt top`'s one control request: the busiest connections on both paths with their
rates, the shunt and take-down rates, the budget, and the slow path's share.

The fast path's counts are the switch's (every pair's two flows, read live as status reads
them, on the event loop); the slow path's are conntrack's (a dump of the entries that
crossed the bridge, with their counters: bytes only with net.netfilter.nf_conntrack_acct=1),
read on the control socket's thread. Rates are the difference to the previous request's
sample (any client's; at most SAMPLE_AGE old), else a pair's average over its age.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from nfshunt.kernel import table
from nfshunt.records.model import TCP_STATES, ConnEvent, EntryCounts, SwitchFlow
from nfshunt.switch.switch import Switch

SAMPLE_AGE = 10.0  # seconds a sample serves as the base of the next one's rates
LIMIT_DEFAULT, LIMIT_MAX = 20, 200


class PairCount(NamedTuple):
    """A pair's counters as the switch reported them (one read, on the event loop)."""
    key: tuple[str, int]  # (switch, pair key)
    tuple: str
    action: str
    state: str
    packets: int
    bytes: int
    age: float


def pairs_counted(switches: list[Switch], flows: dict[int, list[SwitchFlow] | None], now: float) -> list[PairCount]:
    """Every pair with its two flows' counters summed (a flow not read counts 0)."""
    out = []
    for sw in switches:
        by_cookie = {f.cookie: f for f in flows.get(sw.index) or []}
        for conn in sw.core.by_key.values():
            got = [f for f in (by_cookie.get(conn.cookie(False)), by_cookie.get(conn.cookie(True))) if f is not None]
            out.append(PairCount((sw.name, conn.key), str(conn.orig), conn.action.value, conn.state.value,
                                 sum(f.packets for f in got), sum(f.bytes for f in got),
                                 now - (conn.confirmed_time or conn.event_time)))
    return out


def loop_view(switches: list[Switch], counters: dict[str, int], flows: dict[int, list[SwitchFlow] | None],
              now: float) -> dict[str, Any]:
    """What the event loop contributes (plain data, rated on the control socket's thread)."""
    return {"pairs": pairs_counted(switches, flows, now),
            "switches": [{"datapath_id": sw.name, "connected": sw.session is not None,
                          "flow_stats": flows.get(sw.index) is not None} for sw in switches],
            "shunts": sum(sw.core.shunts for sw in switches), "blocks": sum(sw.core.blocks for sw in switches),
            "waiting": sum(len(sw.core.waiting) for sw in switches),
            "budget": sum(sw.core.budget or 0 for sw in switches) if all(sw.core.budget for sw in switches) else None,
            "installed": sum(n for k, n in counters.items() if k.startswith("installed:")),
            "removed": sum(n for k, n in counters.items() if k.startswith("removed:"))}


@dataclass
class Sample:
    at: float
    fast: dict[tuple[str, int], tuple[int, int]]  # pair -> (packets, bytes)
    slow: dict[tuple[int, Any], tuple[int, int]]  # (ct_id, tuple) -> (packets, bytes), both directions
    installed: int
    removed: int


def _rate(now_value: int, before: int | None, dt: float, age: float) -> float:
    if before is not None and dt > 0 and now_value >= before:
        return (now_value - before) / dt
    return now_value / age if age > 0 else 0.0


class TopSampler:
    """The previous sample, shared by every client (control requests run on threads of
    their own: a lock)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._last: Sample | None = None
        self._lock = threading.Lock()

    def rate(self, view: dict[str, Any], entries: list[tuple[ConnEvent, EntryCounts]] | None, acct: bool | None,
             limit: int) -> dict[str, Any]:
        now = self.clock()
        with self._lock:
            last, self._last = self._last, self._sample(view, entries or [], now)
        if last is not None and now - last.at > SAMPLE_AGE:
            last = None
        dt = now - last.at if last is not None else 0.0
        rows = [{"path": "fast", "tuple": p.tuple, "action": p.action, "state": p.state, "bytes": p.bytes,
                 "packets": p.packets,
                 "bytes_per_s": _rate(p.bytes, last.fast.get(p.key, (0, None))[1] if last else None, dt, p.age),
                 "packets_per_s": _rate(p.packets, last.fast.get(p.key, (None, 0))[0] if last else None, dt, p.age)}
                for p in view["pairs"]]
        slow_rows = [self._slow_row(e, n, last, dt) for e, n in entries or []]
        fast_bps = sum(r["bytes_per_s"] for r in rows)
        slow_bps = sum(r["bytes_per_s"] or 0 for r in slow_rows)
        busiest = sorted(rows + slow_rows, key=lambda r: (r["bytes_per_s"] or 0, r["packets_per_s"] or 0),
                         reverse=True)[:max(1, min(limit, LIMIT_MAX))]

        def per_s(now_count: int, before: int) -> float | None:
            return (now_count - before) / dt if dt > 0 and now_count >= before else None
        return {"interval": round(dt, 3) if last is not None else None, "accounting": acct,
                "switches": view["switches"], "shunts": view["shunts"], "blocks": view["blocks"],
                "waiting": view["waiting"], "budget": view["budget"],
                "shunts_per_s": per_s(view["installed"], last.installed) if last else None,
                "takedowns_per_s": per_s(view["removed"], last.removed) if last else None,
                "fast_bytes_per_s": fast_bps, "slow_bytes_per_s": slow_bps if acct else None,
                "slow_share": slow_bps / (slow_bps + fast_bps) if acct and slow_bps + fast_bps > 0 else None,
                "slow_entries": len(entries or []), "top": busiest}

    @staticmethod
    def _sample(view: dict[str, Any], entries: list[tuple[ConnEvent, EntryCounts]], now: float) -> Sample:
        slow = {(e.ct_id, e.orig): (sum(n.packets), sum(n.bytes)) for e, n in entries
                if n.packets is not None and n.bytes is not None}
        return Sample(now, {p.key: (p.packets, p.bytes) for p in view["pairs"]}, slow, view["installed"],
                      view["removed"])

    @staticmethod
    def _slow_row(e: ConnEvent, n: EntryCounts, last: Sample | None, dt: float) -> dict[str, Any]:
        packets = sum(n.packets) if n.packets is not None else None
        nbytes = sum(n.bytes) if n.bytes is not None else None
        before = last.slow.get((e.ct_id, e.orig)) if last is not None and dt > 0 else None

        def per_s(value: int | None, was: int | None) -> float | None:
            return (value - was) / dt if value is not None and was is not None and value >= was else None
        state = TCP_STATES[e.tcp_state] if e.tcp_state is not None and e.tcp_state < len(TCP_STATES) else "-"
        return {"path": "slow", "tuple": str(e.orig), "action": None, "state": state, "bytes": nbytes,
                "packets": packets, "bytes_per_s": per_s(nbytes, before[1] if before else None),
                "packets_per_s": per_s(packets, before[0] if before else None)}


def read_slow(dump: Callable[[], list[tuple[ConnEvent, EntryCounts]]] | None = None
              ) -> tuple[list[tuple[ConnEvent, EntryCounts]] | None, bool | None, str | None]:
    """The slow path's entries with their counters (the control socket's thread), whether
    conntrack counts bytes, and an error if the kernel could not be read."""
    acct = table.sysctl_on(table.ACCT_SYSCTL)
    try:
        return (dump() if dump is not None else table.dump_counted(lambda _what: None)), acct, None
    except OSError as exc:
        return None, acct, f"conntrack could not be read: {exc}"
