"""Accounting: what a shunt carried, for logs and the audit file. Shunted bytes never
reach iptables' counters, so each removed pair gets one JSON line from the switch's own
flow counters."""
from __future__ import annotations

import logging
import os
import time
from typing import Any

from . import core as c
from .logs import BatchedFileHandler


def conn_fields(conn: c.Conn, event: str, **more: Any) -> dict[str, Any]:
    """A connection as structured log fields (JSON logs, experiments, accounting)."""
    o = conn.orig
    return {"event": event, "action": conn.action, "ct_id": conn.ct_id, "proto": o.proto, "src": o.src,
            "dst": o.dst, "sport": o.sport, "dport": o.dport, "ingress": conn.ingress.physdevin,
            "egress": conn.egress.physdevin, **more}


def audit_record(conn: c.Conn, reason: str) -> dict[str, Any]:
    """The accounting line for a removed pair: shunted bytes never reach iptables' counters."""
    stats = conn.stats or {}
    fwd, rev = stats.get(False), stats.get(True)
    durations = [s[2] for s in (fwd, rev) if s]
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1000) % 1000:03d}Z",
            **conn_fields(conn, "removed", reason=reason),
            "switch_ports": [conn.ingress.fast, conn.egress.fast],
            "duration": round(max(durations), 3) if durations else None,
            "orig_packets": fwd[0] if fwd else None, "orig_bytes": fwd[1] if fwd else None,
            "reply_packets": rev[0] if rev else None, "reply_bytes": rev[1] if rev else None,
            "packets": sum(s[0] for s in (fwd, rev) if s), "bytes": sum(s[1] for s in (fwd, rev) if s)}


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
