"""Run a command on a machine of its own, so that a second testbed can run beside the first.

The testbed's names are fixed (s1, fw, nfsmgmt0, 169.254.66.x, the testbed lock) and Open
vSwitch is one daemon with one configuration, so two testbeds in one set of namespaces would
tear each other down. Here the command gets new network, mount and PID namespaces: its own
links and addresses, its own view of /sys and /proc, and private (memory-backed) copies of
Open vSwitch's database, run, log and lock directories, so the testbed's ensure_ovs() starts an
Open vSwitch of its own, as on an empty machine. When the command ends, everything in the
PID namespace is killed and the namespaces and mounts go with it: nothing is left on the
machine. Needs root and util-linux's unshare.

    python mininet/own_machine.py COMMAND [ARG ...]

What a second testbed still shares with the first: the CPU, the kernel's global settings
(net.core.rmem_default can be set only from the first network namespace, so its switch
ports keep the machine's value: testbed_machine.MachineSettings) and /tmp.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

INSIDE_ENV = "NFSHUNT_OWN_MACHINE"  # set inside: the command runs in the new namespaces
# Open vSwitch's state (conf.db, sockets and pid files, logs) and the testbed lock's directory.
PRIVATE_DIRS = ("/etc/openvswitch", "/run/openvswitch", "/var/log/openvswitch", "/var/lib/openvswitch",
                "/run/lock")


def _enter(argv: list[str]) -> int:
    """Re-run this program as PID 1 of new namespaces; the new PID namespace's processes are
    killed when unshare itself is killed (--kill-child), also on Ctrl-C or SIGTERM."""
    return subprocess.call(["unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc",
                            "--propagation", "private", sys.executable, os.path.abspath(__file__), *argv],
                           env=dict(os.environ, **{INSIDE_ENV: "1"}))


def _set_up() -> None:
    for path in PRIVATE_DIRS:
        os.makedirs(path, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", path], check=True)
    subprocess.run(["mount", "-t", "sysfs", "sysfs", "/sys"], check=True)  # /sys/class/net of this namespace
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)


def _run_as_init(argv: list[str]) -> int:
    """PID 1 of the new PID namespace: the command as a child (PID 1 ignores signals it has
    no handler for, so they are passed on), its exit status returned."""
    _set_up()
    child = subprocess.Popen(argv)

    def forward(signum: int, _frame: object) -> None:
        child.send_signal(signum)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    return child.wait()


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    if os.environ.get(INSIDE_ENV) == "1" and os.getpid() == 1:
        return _run_as_init(argv)
    return _enter(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
