"""`make demo-routed`: the demo's table for a routing firewall (mininet/demo.py --routed), run
as the Makefile runs it, on the routed testbed with experimental_routed and then the router
alone. Its table says what each path did, and the frames h2 received say who forwarded them:
the router's MAC and a TTL one lower, on the shunted path as through the router."""
import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.testbed, pytest.mark.second_bed]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "mininet", "demo.py")
# path, Gbit/s, retransmits, slow-path packets, switch-flow packets, TTL at h2, outcome
ROW = re.compile(r"^(NFShunt, \w+|router only) +([0-9.]+) +(\d+) +(\d+) +(\d+)  (\S+) +(.+)$")


def test_make_demo_routed_runs_the_demo_s_routed_table():
    with open(os.path.join(REPO, "Makefile")) as fh:
        assert re.search(r"^demo-routed: deps\n\t\$\(PY\) mininet/demo.py --routed$", fh.read(), re.M)


def test_the_routed_demo_prints_each_path_and_the_router_s_rewrite_at_the_receiver(integration_ready):
    # (paced: the table's shape is the claim, and unpaced transfers took a core beside the first testbed)
    proc = subprocess.run([sys.executable, DEMO, "--routed", "--seconds", "2", "--bitrate", "100M"],
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    rows = {m.group(1): m.groups()[1:] for m in map(ROW.match, out.splitlines()) if m}
    assert set(rows) == {"NFShunt, shunted", "NFShunt, blocked", "NFShunt, ignored", "router only"}, out[-3000:]
    gbps, _, slow, fast, ttl, outcome = rows["NFShunt, shunted"]
    assert outcome == "shunted: fast path" and ttl == "63" and int(fast) > int(slow) and float(gbps) > 0
    assert rows["NFShunt, blocked"][5] == "stalled, dropped by the switch"
    for path in ("NFShunt, ignored", "router only"):
        gbps, _, slow, fast, ttl, outcome = rows[path]
        assert outcome == "through the firewall" and ttl == "63" and int(fast) == 0 and int(slow) > 1000
    assert int(rows["NFShunt, shunted"][2]) < int(rows["NFShunt, ignored"][2])
    assert "The shunted path carries the router's rewrite" in out and "TTL one lower (63)" in out
    assert "h1 sends with TTL 64" in out
