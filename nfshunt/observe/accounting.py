"""Accounting: every outcome the core reports (Ignored, Installed, Refused, Removed) is
counted, logged and audited here, in one place; and what a shunt carried, for logs and the
audit file. Shunted bytes never reach iptables' counters, so each removed pair gets one
JSON line from the switch's own flow counters."""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Protocol

from nfshunt.core import commands as c
from nfshunt.core.connection import Conn

from .flowrecords import FlowRecords
from .logs import BatchedFileHandler
from .metrics import Metrics

LOG = logging.getLogger("nfshunt")


def conn_fields(conn: Conn, event: str, **more: Any) -> dict[str, Any]:
    """A connection as structured log fields (JSON logs, experiments, accounting); a VLAN's
    (zone not 0, or a routed trunk's tagged interface) also its zone and the tag of each side
    (0: untagged), an untagged one's line exactly as before VLANs. A routed one's ports are
    its interfaces' physdevins (the mark's)."""
    o = conn.orig
    out = {"event": event, "action": conn.action, "ct_id": conn.ct_id, "proto": o.proto, "src": o.src,
           "dst": o.dst, "sport": o.sport, "dport": o.dport, "ingress": conn.ports[0], "egress": conn.ports[1]}
    tags = conn.tags
    if o.zone or (tags is not None and any(tags)):
        out.update(zone=o.zone, vlan_in=tags[0] if tags else None, vlan_out=tags[1] if tags else None)
    return {**out, **more}


def audit_record(conn: Conn, reason: str) -> dict[str, Any]:
    """The accounting line for a removed pair: shunted bytes never reach iptables' counters."""
    stats = conn.stats or {}
    fwd, rev = stats.get(False), stats.get(True)
    durations = [s.duration for s in (fwd, rev) if s]
    return {"time": _stamp(), **conn_fields(conn, "removed", reason=reason),
            "switch_ports": [conn.ingress.fast, conn.egress.fast],
            "duration": round(max(durations), 3) if durations else None,
            "orig_packets": fwd.packets if fwd else None, "orig_bytes": fwd.bytes if fwd else None,
            "reply_packets": rev.packets if rev else None, "reply_bytes": rev.bytes if rev else None,
            **carried(conn)}


def _stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1000) % 1000:03d}Z"


def carried(conn: Conn) -> dict[str, int]:
    """Packets and bytes the pair's removed flows reported, both directions."""
    stats = (conn.stats or {}).values()
    return {"packets": sum(s.packets for s in stats), "bytes": sum(s.bytes for s in stats)}


def audit_logger(path: str | None) -> logging.Logger:
    """One JSON line per removed pair, batched; a file logrotate moved is reopened."""
    audit = logging.getLogger("nfshunt.audit")
    audit.propagate = False
    audit.setLevel(logging.INFO)
    for handler in list(audit.handlers):
        audit.removeHandler(handler)
    if path:
        os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
        handler = BatchedFileHandler(path)
        handler.setFormatter(logging.Formatter("%(message)s"))
        audit.addHandler(handler)
    return audit


class Watch(Protocol):
    def installed(self, conn: Conn) -> None: ...

    def not_installed(self, conn: Conn) -> None: ...

    def removed(self, conn: Conn) -> None: ...


class Outcomes:
    """Counts, logs and audits what the core reports; acts on nothing."""

    def __init__(self, metrics: Metrics, audit: logging.Logger):
        self.metrics = metrics
        self.counters = metrics.counters
        self.audit = audit
        self.handlers = {c.Ignored: self.ignored, c.Installed: self.installed, c.Refused: self.refused,
                         c.Removed: self.removed}
        self.watch: Watch | None = None  # the IDS backend: adds wait for installs, ends for removals
        self.records: FlowRecords | None = None  # accounting_log: a record for each pair that leaves

    def static(self, event: str, switch: str, flows: list[tuple[int, str]], reason: str,
               family: str = "static_flows") -> None:
        """Static flows (or address blocks: `family`) written to or deleted from a switch:
        one log line, one audit line each."""
        if not flows:
            return
        self.counters.add(family, event.rsplit("_", 1)[1], reason, amount=len(flows))
        LOG.info("%s on switch %s (%s): %d flows: %s", event.replace("_", " "), switch, reason, len(flows),
                 "; ".join(what for _, what in flows[:5]) + (" ..." if len(flows) > 5 else ""))
        if self.audit.handlers:
            stamp = _stamp()
            for cookie, what in flows:
                self.audit.info(json.dumps({"time": stamp, "event": event, "switch": switch,
                                            "cookie": f"0x{cookie:016x}", "flow": what, "reason": reason}))

    def ignored(self, cmd: c.Ignored) -> None:
        self.counters.add("ignored", cmd.reason)
        if LOG.isEnabledFor(logging.DEBUG):
            ev = cmd.event
            LOG.debug("ignored %s %s ct_id=%d mark=0x%08x: %s", ev.kind.value, ev.orig, ev.ct_id, ev.mark, cmd.reason)

    def installed(self, cmd: c.Installed) -> None:
        conn = cmd.conn
        self.counters.add("installed", conn.action)
        self.metrics.observe_latency(conn.action, cmd.latency)
        LOG.info("%s %s in %.2f ms", conn.action, conn.describe(), cmd.latency * 1000,
                 extra={"fields": conn_fields(conn, "installed", latency_ms=round(cmd.latency * 1000, 3))})
        if self.watch is not None:
            self.watch.installed(conn)

    def not_installed(self, conn: Conn) -> None:
        """A pair whose flows could not be built (Dispatcher.install_flows: counted and logged
        there, rolled back): what waits for its install is told."""
        if self.watch is not None:
            self.watch.not_installed(conn)

    def refused(self, cmd: c.Refused) -> None:
        self.counters.add("refused", cmd.conn.action)
        LOG.warning("%s refused, stays on the slow path: %s: %s", cmd.conn.action, cmd.conn.describe(), cmd.reason)

    def removed(self, cmd: c.Removed) -> None:
        conn = cmd.conn
        self.counters.add("removed", conn.action, cmd.reason)
        count = carried(conn)
        if count["bytes"]:  # shunted bytes never reach iptables' counters: the dashboard's fast path
            self.counters.add("removed_bytes", conn.action, amount=count["bytes"])
        LOG.info("%s removed (%s): %s, %d packets %d bytes", conn.action, cmd.reason, conn.describe(),
                 count["packets"], count["bytes"],
                 extra={"fields": conn_fields(conn, "removed", reason=cmd.reason, **count)})
        if self.audit.handlers:
            self.audit.info(json.dumps(audit_record(conn, cmd.reason)))
        if self.records is not None:
            self.records.ended(conn, cmd.reason)
        if self.watch is not None:
            self.watch.removed(conn)
