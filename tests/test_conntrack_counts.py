"""What the kernel counts for an entry, read three ways against a real kernel in a
namespace of its own: a lookup and a dump with counters (explain, top), and the last
counters a delete's echo carries (the accounting record's slow path), with conntrack's
accounting and timestamps on and off."""
from __future__ import annotations

import json
import os
import sys

import pytest

pytestmark = pytest.mark.integration
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import json, socket, subprocess, sys, threading, time
sys.path.insert(0, sys.argv[1])
on = sys.argv[2] == "1"
for name in ("nf_conntrack_acct", "nf_conntrack_timestamp"):
    with open(f"/proc/sys/net/netfilter/{name}", "w") as fh:
        fh.write("1" if on else "0")
# An entry reports its end (and a delete echoes it) only with event reporting: 2 (the
# default) has it for entries made while a listener is subscribed (the controller's, in
# production: any on the machine, here), 1 for every entry.
with open("/proc/sys/net/netfilter/nf_conntrack_events", "w") as fh:
    fh.write("1")
from nfshunt.kernel import table, worker
from nfshunt.records.model import UDP, FlowTuple
# Conntrack tracks a namespace's packets once a rule needs it.
subprocess.run(["iptables", "-w", "5", "-A", "OUTPUT", "-m", "conntrack", "--ctstate", "NEW,ESTABLISHED",
                "-j", "ACCEPT"], check=True)

rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
rx.bind(("127.0.0.1", 5353))
tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
tx.bind(("127.0.0.1", 40001))
for _ in range(3):
    tx.sendto(b"x" * 100, ("127.0.0.1", 5353))
    rx.sendto(b"y" * 50, ("127.0.0.1", 40001))
t = FlowTuple(4, UDP, "127.0.0.1", "127.0.0.1", 40001, 5353)
entry, counts = table.lookup_counted(t)
dumped = [n for e, n in table.dump_counted(print, None) if e.orig == t]
got, done = [], threading.Event()
w = worker.ConntrackWorker(lambda _: None, print)
w.on_counted = lambda orig, ct_id, n: (got.append((orig == t, ct_id == entry.ct_id, n)), done.set())
w.start()
w.delete(4, t, entry.ct_id, counted=True)
done.wait(3)
w.stop()
gone = table.lookup_counted(t)
echo = got[0][2] if got else None
print(json.dumps({"acct": table.sysctl_on(table.ACCT_SYSCTL), "lookup": [counts.packets, counts.bytes],
                  "start": counts.start_ns is not None, "timeout": counts.timeout, "zone": counts.zone,
                  "dump": [dumped[0].packets, dumped[0].bytes] if dumped else None,
                  "echo": [got[0][0], got[0][1], echo.packets, echo.bytes, echo.start_ns is not None,
                           echo.stop_ns is not None] if got else None,
                  "deleted": gone is None}))
"""


def _run(netns, on: bool) -> dict:
    out = netns(sys.executable, "-c", SCRIPT, REPO, "1" if on else "0").stdout
    return json.loads(out.strip().splitlines()[-1])


def test_counters_from_a_lookup_a_dump_and_a_deletes_echo(netns):
    got = _run(netns, True)
    assert got["acct"] is True and got["deleted"]
    # 3 datagrams each way: 128 B (IP + UDP + 100) and 78 B (IP + UDP + 50) each
    assert got["lookup"] == [[3, 3], [384, 234]] and got["dump"] == got["lookup"]
    assert got["start"] and 0 < got["timeout"] <= 180 and got["zone"] == 0
    assert got["echo"] == [True, True, [3, 3], [384, 234], True, True]  # its tuple, id, counts, start and stop


def test_without_conntrack_accounting_there_are_no_counters_but_the_echo_still_comes(netns):
    got = _run(netns, False)
    assert got["acct"] is False and got["deleted"]
    assert got["lookup"] == [None, None] and got["dump"] == [None, None] and not got["start"]
    assert got["echo"] == [True, True, None, None, False, False]
