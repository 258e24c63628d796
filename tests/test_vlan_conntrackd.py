"""Does Debian's conntrackd (conntrack-tools 1.4.7) carry the conntrack zone to the backup of a
firewall pair (issue 37, docs/vlans.md "The firewall pair")? Two conntrackd in namespaces of
their own, FTFW over a veth as config/ha/conntrackd.conf has it: the same tuple in zones 0,
100 and 200 on the active host is three entries in the backup's external cache, committed
into their own zones, and a delete in one zone drops only that zone's entry there."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

pytestmark = pytest.mark.integration
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADDRS = ("10.255.9.1", "10.255.9.2")
TUPLE = ("-p", "tcp", "-s", "10.9.0.1", "-d", "10.9.0.2", "--sport", "41000", "--dport", "5201")


def _config(tmp_path, me: int) -> str:
    """config/ha/conntrackd.conf with this namespace's link, addresses and paths."""
    with open(os.path.join(REPO, "config", "ha", "conntrackd.conf")) as fh:
        text = fh.read()
    name = f"ctd{me}"
    for old, new in (("198.51.100.1", ADDRS[me]), ("198.51.100.2", ADDRS[1 - me]), ("sync0", f"vctd{me}"),
                     ("/var/log/conntrackd.log", str(tmp_path / f"{name}.log")),
                     ("/var/lock/conntrackd.lock", str(tmp_path / f"{name}.lock")),
                     ("/var/run/conntrackd.ctl", str(tmp_path / f"{name}.ctl"))):
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / f"{name}.conf"
    path.write_text(text)
    return str(path)


@pytest.fixture
def pair(integration_ready, tmp_path):
    """Two namespaces with a sync link and a conntrackd each; yields run(index, *args)."""
    names = [f"nfshunt-ctd{i}-{os.getpid()}" for i in (0, 1)]

    def run(i, *args, check=True):
        return subprocess.run(["ip", "netns", "exec", names[i], *args], check=check, capture_output=True, text=True)
    daemons = []
    try:
        for name in names:
            subprocess.run(["ip", "netns", "add", name], check=True)
        subprocess.run(["ip", "link", "add", "vctd0", "netns", names[0], "type", "veth", "peer", "name", "vctd1",
                        "netns", names[1]], check=True)
        for i in (0, 1):
            run(i, "ip", "addr", "add", f"{ADDRS[i]}/24", "dev", f"vctd{i}")
            run(i, "ip", "link", "set", f"vctd{i}", "up")
            run(i, "ip", "link", "set", "lo", "up")
        run.configs = [_config(tmp_path, i) for i in (0, 1)]
        for i in (0, 1):
            daemons.append(subprocess.Popen(["ip", "netns", "exec", names[i], "conntrackd", "-C", run.configs[i]],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for i in (0, 1):  # its control socket answers: it runs
            deadline = time.monotonic() + 10
            while run(i, "conntrackd", "-C", run.configs[i], "-s", check=False).returncode != 0:
                assert time.monotonic() < deadline, f"conntrackd {i} did not start"
                time.sleep(0.05)
        yield run
    finally:
        for proc in daemons:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _external(pair) -> list[str]:
    """The backup's external cache: the entries of the test's tuple."""
    out = pair(1, "conntrackd", "-C", pair.configs[1], "-e").stdout
    return sorted(line for line in out.splitlines() if "sport=41000" in line)


def _zone(line: str) -> int:
    fields = dict(word.split("=", 1) for word in line.split() if "=" in word)
    return int(fields.get("zone", 0))


def _wait(predicate, what):
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_conntrackd_carries_the_zone_to_the_backup_and_commits_each_entry_in_its_zone(pair):
    for zone, mark in ((0, 7), (100, 100), (200, 200)):
        pair(0, "conntrack", "-I", *TUPLE, "--state", "ESTABLISHED", "-t", "600", "--mark", str(mark),
             *(["--zone", str(zone)] if zone else []))
    _wait(lambda: len(_external(pair)) == 3, "the three entries in the backup's external cache")
    assert sorted(_zone(line) for line in _external(pair)) == [0, 100, 200]

    pair(1, "conntrackd", "-C", pair.configs[1], "-c")  # what the notify script does at a takeover
    _wait(lambda: "zone=200" in pair(1, "conntrack", "-L", "-w", "200", check=False).stdout, "the commit")
    for zone, mark in ((100, 100), (200, 200)):
        listed = [line for line in pair(1, "conntrack", "-L", "-w", str(zone), check=False).stdout.splitlines()
                  if "sport=41000" in line]
        assert len(listed) == 1 and f"mark={mark} " in listed[0] and f"zone={zone} " in listed[0], listed
    no_zone = [line for line in pair(1, "conntrack", "-L", check=False).stdout.splitlines()
               if "sport=41000" in line and "zone=" not in line]
    assert len(no_zone) == 1 and "mark=7 " in no_zone[0], no_zone

    pair(0, "conntrack", "-D", *TUPLE, "-w", "200")  # the active host deletes one zone's entry
    _wait(lambda: len(_external(pair)) == 2, "the delete to reach the backup")
    assert sorted(_zone(line) for line in _external(pair)) == [0, 100]
