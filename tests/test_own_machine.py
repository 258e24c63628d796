"""mininet/own_machine.py: a command on a machine of its own sees only its own links, Open
vSwitch state and processes, its exit status is passed on, and nothing of it is left after;
and the first testbed's clean-up takes a live testbed there for nobody's leftover."""
from __future__ import annotations

import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OWN_MACHINE = os.path.join(REPO, "mininet", "own_machine.py")


def _own(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, OWN_MACHINE, *argv], capture_output=True, text=True, timeout=30)


def test_the_command_sees_only_its_own_links_state_and_processes(integration_ready):
    marker = f"nfshunt-own-machine-test-{os.getpid()}"
    script = ("ip -o link show | cut -d: -f2; "
              "echo dirs: $(find /run/openvswitch /etc/openvswitch /run/lock -mindepth 1); "
              f"echo pids: $(ls /proc | grep -c '^[0-9]'); touch /run/lock/{marker}; exit 3")
    done = _own("sh", "-c", script)
    assert done.returncode == 3, done.stderr  # the command's status, passed on
    links, dirs, pids = done.stdout.strip().split("\n")
    assert links.strip() == "lo"
    assert dirs.strip() == "dirs:"  # empty: none of the machine's Open vSwitch state or locks
    assert int(pids.split()[1]) <= 5  # this namespace's init, the shell and its commands
    assert not os.path.exists(f"/run/lock/{marker}")  # written to its own, now gone


def test_a_killed_run_leaves_no_process(integration_ready):
    """SIGTERM to the process started (as tests/run_suite.py sends it) ends everything."""
    nap = f"3600.{os.getpid()}"  # a sleep no one else runs
    proc = subprocess.Popen([sys.executable, OWN_MACHINE, "sh", "-c", f"sleep {nap} & wait"])

    def sleepers() -> list[str]:  # anchored: the launcher's own command line names it too
        return subprocess.run(["pgrep", "-f", f"^sleep {nap}$"], capture_output=True, text=True).stdout.split()
    deadline = time.monotonic() + 10
    while not sleepers():
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.05)
    proc.terminate()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 5
    while sleepers():
        assert time.monotonic() < deadline, "a process outlived its machine"
        time.sleep(0.05)


def test_a_node_whose_testbed_runs_in_another_namespace_is_not_a_leftover(integration_ready):
    from nfshunt_testbed.machine import _parent_in_other_namespace
    root_ns = os.stat("/proc/self/ns/net").st_ino
    # A shell in a new network namespace whose child stays there: the child's parent is in
    # another namespace (a live testbed's node on a machine of its own); the shell's is ours.
    shell = subprocess.Popen(["unshare", "--net", "sh", "-c", "sleep 30 & echo $!; wait"], stdout=subprocess.PIPE,
                             text=True)
    try:
        child = int(shell.stdout.readline())
        assert _parent_in_other_namespace(child, root_ns) and not _parent_in_other_namespace(shell.pid, root_ns)
    finally:
        subprocess.run(["pkill", "-P", str(shell.pid)])
        shell.wait(timeout=10)


def test_a_command_that_cannot_run_is_said_plainly(integration_ready):
    done = _own("no-such-command-here")
    assert done.returncode == 127
    assert done.stderr.strip() == "own_machine.py: cannot run no-such-command-here: No such file or directory"
    usage = subprocess.run([sys.executable, OWN_MACHINE], capture_output=True, text=True)
    assert usage.returncode == 2 and usage.stderr.startswith("usage: python mininet/own_machine.py COMMAND")
