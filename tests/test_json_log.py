"""The JSON log line (cli.JsonFormatter): its second's text is cached, and every line must
read as the plain strftime of each record's own time made it."""
from __future__ import annotations

import json
import logging
import sys
import time

from nfshunt.cli import JsonFormatter


def plain(record: logging.LogRecord) -> str:
    """The line as it was made before the cache: strftime of each record's time."""
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
             "ts": round(record.created, 6), "level": record.levelname, "logger": record.name,
             "message": record.getMessage()}
    fields = getattr(record, "fields", None)
    if isinstance(fields, dict):
        entry.update(fields)
    return json.dumps(entry)


def record(created: float, fields: dict | None = None, level: int = logging.INFO) -> logging.LogRecord:
    r = logging.LogRecord("nfshunt", level, __file__, 1, "shunt %s in %.2f ms", ("tcp a -> b", 1.5), None)
    r.created, r.msecs = created, (created - int(created)) * 1000
    if fields is not None:
        r.fields = fields  # type: ignore[attr-defined]
    return r


def test_each_line_reads_as_strftime_of_its_own_time_across_seconds_and_back():
    fmt = JsonFormatter()
    base = 1_795_549_498.0
    # within a second, across its end, a day's and a year's end, and a record older than the last
    times = [base + 0.001, base + 0.5, base + 0.999999, base + 1.0, base + 1.0004, base + 86_399.9991,
             1_798_761_599.999, 1_798_761_600.0, base + 0.25, 0.0, 1e9 + 0.123456789]
    for i, t in enumerate(times):
        r = record(t, {"event": "installed", "ct_id": i, "latency_ms": 0.125} if i % 2 else None,
                   logging.WARNING if i == 3 else logging.INFO)
        assert fmt.format(r) == plain(r)


def test_an_exception_is_kept():
    try:
        raise ValueError("boom")
    except ValueError:
        r = logging.LogRecord("nfshunt", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = json.loads(JsonFormatter().format(r))
    assert line["message"] == "failed" and "ValueError: boom" in line["exception"]
