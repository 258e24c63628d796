"""bench/profiles.py: py-spy's samples summed per stage of a shunt (issue 41.4)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import profiles  # noqa: E402

V = "/opt/nfshunt-venv/lib/python3.11/site-packages"
RAW = "\n".join([
    # A log line written from the decision: logging, not the decision.
    "run (/w/nfshunt/app/top.py:10);decide (/w/nfshunt/core/admission.py:240);"
    "info (/usr/lib/python3.11/logging/__init__.py:1489) 7",
    # The decision itself.
    "run (/w/nfshunt/app/top.py:10);decide (/w/nfshunt/core/admission.py:240) 5",
    # A flow-mod packed by os-ken for the flow builder; a reply parsed by os-ken.
    f"pair (/w/nfshunt/openflow/flows.py:88);serialize ({V}/os_ken/ofproto/ofproto_v1_3_parser.py:2770) 4",
    f"_recv_loop ({V}/os_ken/controller/controller.py:300);parser ({V}/os_ken/ofproto/ofproto_v1_3_parser.py:60) 3",
    # A delete built by the codec for the worker; an event parsed by the codec.
    "run (/w/nfshunt/kernel/worker.py:240);delete_message (/w/nfshunt/kernel/codec.py:280) 2",
    "read (/w/nfshunt/kernel/listener.py:90);parse_fast (/w/nfshunt/kernel/codec.py:130) 6",
    f"inc ({V}/prometheus_client/metrics.py:300) 1",
    "<module> (/usr/lib/python3.11/threading.py:1) 1",
    # The event loop caught leaving its queue's wait: not the dispatch's work.
    "_event_loop (/w/nfshunt/app/switch_app.py:54);Queue.get (/usr/lib/python3.11/queue.py:171);"
    "Condition.wait (/usr/lib/python3.11/threading.py:320) 8",
    "a garbled line without a count",
])


def test_each_sample_counts_for_its_innermost_named_stage():
    p = profiles.summarise(RAW)
    assert p.samples == 37
    assert p.by_category == {"logging": 7, "decision": 5, "flow build": 4, "switch replies": 3,
                             "conntrack requests": 2, "netlink parse": 6, "metrics": 1, "other": 1,
                             profiles.WOKEN: 8}


def test_the_busiest_functions_are_the_innermost_frames_with_short_paths():
    p = profiles.summarise(RAW)
    assert p.by_function["info (logging/__init__.py)"] == 7
    assert p.by_function["parse_fast (nfshunt/kernel/codec.py)"] == 6
    assert p.by_function["serialize (os_ken/ofproto/ofproto_v1_3_parser.py)"] == 4


def test_the_table_gives_shares_and_says_when_nothing_was_sampled():
    lines = profiles.table(profiles.summarise(RAW))
    assert "| logging | 7 | 18.9 % |" in lines
    assert lines[0].startswith("37 samples")
    assert profiles.table(profiles.summarise("")) == [
        "(no samples: the controller did not work while it was sampled)"]
