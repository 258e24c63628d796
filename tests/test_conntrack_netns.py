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
