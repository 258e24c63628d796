"""The conntrack side against a real kernel, in a namespace of its own: the event filter
drops what never crossed the plumbing, dumps filter by mark, and a policy change clears
only the decision bits of every entry."""
from __future__ import annotations

import json
import os
import sys

import pytest

pytestmark = pytest.mark.integration
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import json, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from nfshunt.kernel import listener, table
from nfshunt.records import markcodec

def entry(sport, mark):
    subprocess.run(["conntrack", "-I", "-p", "udp", "-s", "10.9.0.1", "-d", "10.9.0.2", "--sport", str(sport),
                    "--dport", "53", "-t", "60", "--mark", str(mark)], check=True, capture_output=True)

events = []
listener = listener.ConntrackListener(1 << 20, events.extend, lambda: None, print)
listener.start()
entry(1001, 0)                       # the host's own traffic: filtered in the kernel
entry(1002, 0x0000BEEF)              # only the admin's bits: filtered
entry(1003, 0x61200000)              # crossed the bridge, not decided yet
entry(1004, 0x71210000 | 0xBEEF)     # decided: shunt
deadline = time.monotonic() + 2
while time.monotonic() < deadline and len(events) < 2:
    time.sleep(0.05)
time.sleep(0.3)  # a negative: the filtered entries' events would have come by now (asserted: seen)
listener.stop()
seen = sorted(e.orig.sport for e in events)
dumped = sorted(e.orig.sport for e in table.raw_dump(print, (markcodec.FLAG_INGRESS, markcodec.FLAG_INGRESS)))
cleared, failed = table.clear_marks(markcodec.DECISION_MASK)
marks = {e.orig.sport: e.mark for e in table.dump_entries()}
print(json.dumps({"seen": seen, "dumped": dumped, "cleared": cleared, "failed": failed, "marks": marks}))
"""


def test_event_filter_dump_filter_and_decision_clearing(netns):
    out = netns(sys.executable, "-c", SCRIPT, REPO).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["seen"] == [1003, 1004]
    assert result["dumped"] == [1003, 1004]
    assert (result["cleared"], result["failed"]) == (1, 0)
    marks = {int(k): v for k, v in result["marks"].items()}
    assert marks == {1001: 0, 1002: 0xBEEF, 1003: 0x61200000, 1004: 0x61200000 | 0xBEEF}


REUSED = r"""
import json, subprocess, sys, threading
sys.path.insert(0, sys.argv[1])
from nfshunt.kernel import table, worker
from nfshunt.records.model import TCP, FlowTuple

def entry(sport, state, timeout):
    subprocess.run(["conntrack", "-I", "-p", "tcp", "-s", "10.9.0.1", "-d", "10.9.0.2", "--sport", str(sport),
                    "--dport", "80", "--state", state, "-t", str(timeout), "--mark", str(0x71210000)],
                   check=True, capture_output=True)

def tuple_of(sport):
    return FlowTuple(4, TCP, "10.9.0.1", "10.9.0.2", sport, 80)

def timeout(sport):
    found = table.lookup_counted(tuple_of(sport))
    return found[1].timeout

entry(2001, "TIME_WAIT", 120)        # a closing entry, still there: shortened
entry(2002, "TIME_WAIT", 120)        # a closing entry the client's port reuse replaces
old = table.entry_of(tuple_of(2002))
subprocess.run(["conntrack", "-D", "-p", "tcp", "--sport", "2002"], check=True, capture_output=True)
entry(2002, "ESTABLISHED", 300)
new = table.entry_of(tuple_of(2002))
w = worker.ConntrackWorker(lambda _: None, print)
w.start()
done = threading.Event()
w.expire(4, tuple_of(2001), table.entry_of(tuple_of(2001)).ct_id, 10)
w.expire(4, tuple_of(2002), old.ct_id, 10)
w.after(done.set)
assert done.wait(5)
w.stop()
print(json.dumps({"kept": timeout(2001), "new": timeout(2002), "new_state": table.entry_of(tuple_of(2002)).tcp_state,
                  "same_id": old.ct_id == new.ct_id, "stale": w.stale}))
"""


def test_an_expire_meant_for_an_entry_since_re_created_leaves_the_new_one(netns):
    """The kernel applies an update to whatever entry holds the tuple (the id is checked on
    deletes only), and an entry re-created on the tuple mostly gets the old one's id: a
    take-down's 10 s meant for a closing entry must not reach the new connection on its ports."""
    out = netns(sys.executable, "-c", REUSED, REPO).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["kept"] <= 10  # the closing entry it was meant for is shortened
    assert result["new_state"] == 3 and result["new"] > 250, result  # the new one keeps its 300 s
    assert result["stale"] == 1
