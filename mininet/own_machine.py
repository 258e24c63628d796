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
ports keep the machine's value: nfshunt_testbed.machine.MachineSettings) and /tmp.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

STOP_GRACE = 60.0  # seconds the command gets to end after a SIGTERM before everything is killed
USAGE = "python mininet/own_machine.py COMMAND [ARG ...]"
INSIDE_ENV = "NFSHUNT_OWN_MACHINE"  # set inside: the command runs in the new namespaces
# Open vSwitch's state (conf.db, sockets and pid files, logs) and the testbed lock's directory.
PRIVATE_DIRS = ("/etc/openvswitch", "/run/openvswitch", "/var/log/openvswitch", "/var/lib/openvswitch",
                "/run/lock")


def _enter(argv: list[str]) -> int:
    """Run this program again as PID 1 of new namespaces (unshare), and wait for it.

    unshare ignores SIGINT and SIGTERM while it waits, so they are dealt with here: SIGTERM
    or SIGHUP is passed on to that PID 1, which passes it on to the command (a test run
    then tears its testbed down); Ctrl-C reaches the command with its process group. If the
    command has not ended STOP_GRACE seconds later, unshare is killed, and with it
    (--kill-child) every process in the new PID namespace."""
    proc = subprocess.Popen(["unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc",
                             "--propagation", "private", sys.executable, os.path.abspath(__file__), *argv],
                            env=dict(os.environ, **{INSIDE_ENV: "1"}))
    deadline: list[threading.Timer] = []

    def stop(signum: int, _frame: object) -> None:
        if signum != signal.SIGINT:
            for init in _children(proc.pid):
                try:
                    os.kill(init, signum)
                except ProcessLookupError:  # ended meanwhile
                    pass
        if not deadline:
            deadline.append(threading.Timer(STOP_GRACE, proc.kill))
            deadline[0].daemon = True
            deadline[0].start()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    code = proc.wait()
    return code if code >= 0 else 128 - code


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        return []


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
    try:
        child = subprocess.Popen(argv)
    except OSError as exc:  # as a shell says it: 127 not found, 126 not runnable
        print(f"own_machine.py: cannot run {argv[0]}: {exc.strerror}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126

    def forward(signum: int, _frame: object) -> None:
        child.send_signal(signum)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    signal.signal(signal.SIGINT, lambda *_: None)  # Ctrl-C reaches the command with its process group
    return child.wait()


def main(argv: list[str]) -> int:
    if not argv:
        print(f"usage: {USAGE}", file=sys.stderr)
        return 2
    if os.environ.get(INSIDE_ENV) == "1" and os.getpid() == 1:
        return _run_as_init(argv)
    return _enter(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
