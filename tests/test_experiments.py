"""A quick run of each thesis experiment on the real testbed: it completes and writes its
CSV, PNG and markdown report with the machine and parameters. Timing is not asserted."""
import os
import subprocess
import sys

import pytest

from tests.helpers import csv_rows, machine_report, quick_experiment

pytestmark = [pytest.mark.integration, pytest.mark.testbed, pytest.mark.second_bed]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def quick_all(tmp_path_factory, integration_ready):
    return quick_experiment(tmp_path_factory, "all")


def test_timing_quick_run(quick_all):
    out, stdout = quick_all
    rows = csv_rows(out / "timing" / "timing.csv")
    assert len(rows) >= 2  # of 3 runs; a run missing a capture is reported, not invented
    for r in rows:
        assert 0 < float(r["event_ms"]) < float(r["confirmed_ms"])
    assert os.path.getsize(out / "timing" / "timing.png") > 1000
    assert "switch confirms the flows" in machine_report(out / "timing" / "timing.md")
    assert "[3/3]" in stdout  # progress is shown


def test_throughput_quick_run(quick_all):
    out, _ = quick_all
    rows = csv_rows(out / "throughput" / "throughput.csv")
    modes = ("direct", "nfshunt", "firewall", "direct-routed", "nfshunt-routed", "firewall-routed")
    assert sorted((r["mode"], r["rtt_ms"], r["run"]) for r in rows) == sorted(
        (m, "100", run) for m in modes for run in ("0", "1"))
    assert all(r["delay_mechanism"] in ("netem", "nfqueue") for r in rows)
    assert all(abs(float(r["rtt_measured_ms"]) - 100) <= 5 for r in rows)
    for r in rows:
        assert float(r["gbps"]) > 0 and r["error"] == ""
    # Where the packets went: firewall mode crosses the bridge (or the router), direct does not;
    # NFShunt's shunt takes a routed transfer off the router too.
    slow = {m: min(int(r["lost_slow_path_packets"]) for r in rows if r["mode"] == m) for m in modes}
    assert slow["direct"] < 10 < slow["firewall"]
    assert slow["direct-routed"] < 10 < slow["firewall-routed"]
    assert slow["nfshunt-routed"] < slow["firewall-routed"] / 2
    # Loss is located, never invented: no hop reports more packets out than in.
    for r in rows:
        for key in ("lost_host_link", "lost_switch", "lost_firewall", "lost_firewall_buffer",
                    "lost_receiver_delay_queue", "lost_sender_qdisc"):
            assert int(r[key]) >= 0, (r["mode"], r["rtt_ms"], r["run"], key, r[key])
        assert int(r["lost_firewall"]) == 0 or r["mode"] != "direct"  # direct never crosses the firewall
    ranksum = csv_rows(out / "throughput" / "throughput-ranksum.csv")
    assert {(r["a"], r["b"]) for r in ranksum} == {("nfshunt", "direct"), ("nfshunt", "firewall"),
                                                    ("nfshunt-routed", "direct-routed"),
                                                    ("nfshunt-routed", "firewall-routed")}
    assert all(0 < float(r["p_throughput"]) <= 1 for r in ranksum)  # two runs a path: ranked, not left out
    report = machine_report(out / "throughput" / "throughput.md")
    assert "rank-sum" in report and "Table 4.4 beside ours" in report
    assert "The routed row" in report and "| 100 ms | NFShunt, routed | 2 |" in report
    assert os.path.getsize(out / "throughput" / "throughput.png") > 1000


def test_cwnd_quick_run(quick_all):
    out, _ = quick_all
    rows = csv_rows(out / "cwnd" / "cwnd.csv")
    assert {r["mode"] for r in rows} == {"direct", "nfshunt", "firewall"}
    assert max(float(r["cwnd_kb"]) for r in rows) > 100
    assert os.path.getsize(out / "cwnd" / "cwnd.png") > 1000
    machine_report(out / "cwnd" / "cwnd.md")


def test_an_interrupted_experiment_tears_everything_down_and_keeps_its_data(tmp_path, integration_ready):
    import signal
    import time
    out = tmp_path / "interrupted"
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "mininet", "experiments.py"), "throughput",
                             "--quick", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("[1/"):
            proc.send_signal(signal.SIGINT)  # Ctrl-C after the first run
            break
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, "".join(lines) + rest
    assert "**Interrupted**" in open(out / "throughput.md").read()
    assert len(csv_rows(out / "throughput.csv")) >= 1
    # Nothing is left behind: no switch, no management link, no namespace processes. Looked
    # at under the testbed lock, so a testbed that another run starts meanwhile is not taken
    # for a leftover of this one.
    import fcntl

    from nfshunt_testbed.machine import LOCK_PATH
    fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert subprocess.run(["ovs-vsctl", "br-exists", "s1"]).returncode == 2
        assert subprocess.run(["ip", "link", "show", "nfsmgmt0"], capture_output=True).returncode != 0
        time.sleep(0.5)  # a fixed wait: processes killed at the end must be gone (a negative)
        leftovers = subprocess.run(["pgrep", "-f", "nfqdelay|iperf3 -s|nfshunt run"], capture_output=True,
                                   text=True).stdout
        assert leftovers.strip() == ""
    finally:
        os.close(fd)


def test_hop_counters_count_only_once_every_counter_stood_still():
    """A read during which one packet moved (an ARP probe) is not taken: the loss it would
    locate is negative at the hop the packet was half through."""
    from nfshunt_testbed.bed import Testbed
    reads = iter([{"h1-eth0.tx": 5, "s1-eth1.rx": 5}, {"h1-eth0.tx": 5, "s1-eth1.rx": 6},
                  {"h1-eth0.tx": 6, "s1-eth1.rx": 6}, {"h1-eth0.tx": 6, "s1-eth1.rx": 6}])

    class Bed:
        hop_counters = staticmethod(lambda: next(reads))
    assert Testbed.settled_hop_counters(Bed()) == {"h1-eth0.tx": 6, "s1-eth1.rx": 6}
