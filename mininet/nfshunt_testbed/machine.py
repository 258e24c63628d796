"""The machine a testbed runs on: Open vSwitch's daemons, the testbed lock, what an earlier
testbed left behind, and the machine-wide settings a testbed changes and puts back
(net.core.rmem_default while the switch ports open, Open vSwitch's userspace TSO)."""
from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
from typing import Callable

from .topology import MGMT_IFS, NODE_NAMES, STAND_INS, TestbedError

# The testbed's names (s1, fw, nfsmgmt0 ...) are fixed: two testbeds on one machine would
# tear each other down. start() holds this lock until stop(); a second one waits its turn.
LOCK_PATH = "/run/lock/nfshunt-testbed.lock"
# Open vSwitch's userspace datapath reads each port through a packet socket sized by
# net.core.rmem_default (208 KB here: about 15 jumbo frames, 1.5 ms at 1 Gbit/s), so any
# short stall of ovs-vswitchd's main thread dropped packets no hardware switch would. The
# ports get a switch-like 4 MB while they are opened; the machine's value is put back then.
SWITCH_RX_BUFFER = 4 * 1024 * 1024
RMEM_DEFAULT = "/proc/sys/net/core/rmem_default"
TSO_KEY = "userspace-tso-enable"


def kernel_datapath_available() -> bool:
    return os.path.exists("/sys/module/openvswitch")


def machine_info() -> dict[str, str]:
    """What results are recorded with: cores, kernel, Open vSwitch version, datapath."""
    ovs = subprocess.run(["ovs-vswitchd", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cores": str(os.cpu_count()), "cpu": model, "kernel": os.uname().release,
            "ovs": ovs.replace("ovs-vswitchd (Open vSwitch) ", ""),
            "datapath": "system (kernel)" if kernel_datapath_available() else "netdev (userspace)",
            "python": sys.version.split()[0]}


def ensure_ovs() -> None:
    """Start Open vSwitch's daemons if they are not running."""
    if subprocess.run(["ovs-vsctl", "--timeout=3", "show"], capture_output=True).returncode == 0:
        return
    ctl = "/usr/share/openvswitch/scripts/ovs-ctl"
    if not os.path.exists(ctl):
        raise TestbedError("Open vSwitch is not installed (apt-get install openvswitch-switch)")
    subprocess.run([ctl, "start", "--system-id=random"], capture_output=True)
    if subprocess.run(["ovs-vsctl", "--timeout=5", "show"], capture_output=True).returncode != 0:
        raise TestbedError("Open vSwitch did not start (ovs-ctl start)")


def userspace_tso_setting() -> str | None:
    """The machine's other_config:userspace-tso-enable as written ("true", "false"), or
    None where it is not set (Open vSwitch's default: off)."""
    out = subprocess.run(["ovs-vsctl", "--if-exists", "get", "Open_vSwitch", ".", f"other_config:{TSO_KEY}"],
                         capture_output=True, text=True).stdout.strip().strip('"')
    return out or None


def userspace_tso_enabled() -> bool:
    return userspace_tso_setting() == "true"


class Uninterruptible:
    """A stretch a Ctrl-C must not cut short: the testbed's signal handler (Testbed) asks
    `defer` first, and a signal that came meanwhile is raised as KeyboardInterrupt when the
    stretch ends. An Open vSwitch restart killed halfway by a Ctrl-C left the machine's
    userspace TSO on and its ovs-vswitchd without a database: every later testbed failed."""

    def __init__(self) -> None:
        self._depth = 0
        self._pending: int | None = None

    def __enter__(self) -> "Uninterruptible":
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0 and self._pending is not None:
            signum, self._pending = self._pending, None
            if exc[0] is None:
                raise KeyboardInterrupt(f"signal {signum} (after an Open vSwitch restart)")

    def defer(self, signum: int) -> bool:
        """Whether a signal that came now waits for the stretch's end."""
        if self._depth == 0:
            return False
        self._pending = signum
        return True


UNINTERRUPTIBLE = Uninterruptible()


def set_userspace_tso(setting: str | None) -> None:
    """Write Open vSwitch's userspace TSO setting ("true", "false", or None: the key
    removed) and restart it (no testbed may be up): a running daemon turns TSO on as soon
    as the key says true, but never off again, and ports it opened before then mangle every
    frame (each side expects the other's virtio-net header). Not cut short by Ctrl-C: the
    commands run in a session of their own (the terminal's SIGINT does not reach them) and
    the testbed's handler waits (UNINTERRUPTIBLE)."""
    if userspace_tso_setting() == setting:
        return
    change = (["remove", "Open_vSwitch", ".", "other_config", TSO_KEY] if setting is None
              else ["set", "Open_vSwitch", ".", f"other_config:{TSO_KEY}={setting}"])
    with UNINTERRUPTIBLE:
        subprocess.run(["ovs-vsctl", *change], check=True, capture_output=True, start_new_session=True)
        subprocess.run(["/usr/share/openvswitch/scripts/ovs-ctl", "restart", "--system-id=random"],
                       capture_output=True, start_new_session=True)
        if subprocess.run(["ovs-vsctl", "--timeout=10", "show"], capture_output=True,
                          start_new_session=True).returncode != 0:
            raise TestbedError("Open vSwitch did not come back after a restart (ovs-ctl restart)")


def processes_in_netns(ns: int) -> list[int]:
    """The pids of the processes in the network namespace with this inode."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino == ns:
                    pids.append(int(entry))
            except OSError:
                continue  # gone meanwhile, or a kernel thread
    return pids


def _parent_in_other_namespace(pid: int, root_ns: int) -> bool:
    """Whether the process's parent runs in a network namespace other than ours: a node
    shell of a live testbed on a machine of its own (own_machine.py), whose testbed process
    is its parent. A stale node's shell lost its testbed process and belongs to init."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
        return os.stat(f"/proc/{ppid}/ns/net").st_ino != root_ns
    except (OSError, IndexError, ValueError):
        return False  # gone meanwhile, or its parent is


def _kill_stale_nodes() -> tuple[int, int]:
    """Kill every process in a namespace whose shell is one of the testbed's nodes;
    (processes killed, namespaces)."""
    root_ns = os.stat("/proc/self/ns/net").st_ino  # the testbed runs in the root namespace
    shells = re.compile(rb"^bash\x00--norc\x00.*mininet:(" + b"|".join(n.encode() for n in NODE_NAMES) + rb")\x00")
    stale_ns: set[int] = set()
    procs: list[tuple[int, int]] = []  # (pid, netns inode)
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            ns = os.stat(f"/proc/{entry}/ns/net").st_ino
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except OSError:
            continue  # gone meanwhile, or a kernel thread
        procs.append((int(entry), ns))
        if ns != root_ns and shells.match(cmdline) and not _parent_in_other_namespace(int(entry), root_ns):
            stale_ns.add(ns)
    killed = 0
    for pid, ns in procs:
        if ns in stale_ns:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed, len(stale_ns)


def clear_leftovers(log: Callable[[str], None]) -> None:
    """Remove what a testbed killed before its clean-up (SIGKILL, a machine's session
    ending mid-run) left behind under the fixed names a new one needs: its nodes' shells and
    every process in their network namespaces (controllers, daemons, traffic), its switch
    ports' veths and control links in the root namespace, its bridges. Called with the
    testbed lock held, so no live testbed owns these names."""
    killed, namespaces = _kill_stale_nodes()
    links = [name for name in os.listdir("/sys/class/net")
             if name in MGMT_IFS or re.fullmatch(r"(s[12]|v[12]|vf[01])-eth\d+", name)]
    for name in links:
        subprocess.run(["ip", "link", "del", name], capture_output=True)
    bridges = subprocess.run(["ovs-vsctl", "--timeout=5", "list-br"], capture_output=True, text=True).stdout.split()
    stale_bridges = [br for br in ("s1", "s2", *STAND_INS) if br in bridges]
    for br in stale_bridges:
        subprocess.run(["ovs-vsctl", "--timeout=5", "--if-exists", "del-br", br], capture_output=True)
    if killed or links or stale_bridges:
        log(f"removed an earlier testbed's leftovers: {killed} processes in {namespaces} node namespaces, "
            f"links {' '.join(links) or '-'}, bridges {' '.join(stale_bridges) or '-'}")


class MachineSettings:
    """The testbed lock and the machine-wide settings one testbed changes, each put back
    exactly as it was (Testbed.stop calls the restores in its teardown order)."""

    def __init__(self, log: Callable[[str], None]):
        self.log = log
        self._lock_fd: int | None = None
        self._rmem_default: str | None = None  # the machine's value while the switch ports open
        self._tso_before: str | None = None
        self._tso_changed = False  # the machine's setting, to put back as it was (absent included)

    def lock(self) -> None:
        if os.environ.get("NFSHUNT_SIDE_RUN"):  # tests/run_suite.py's run beside the testbed tests
            raise TestbedError("a test that builds a testbed ran among the tests that need none: mark its module "
                               "pytest.mark.testbed")
        os.makedirs(os.path.dirname(LOCK_PATH), exist_ok=True)
        self._lock_fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.log(f"another testbed runs on this machine; waiting for it ({LOCK_PATH})")
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = None

    def enable_userspace_tso(self) -> None:
        """Open vSwitch restarted with userspace TSO on, unless it is on already."""
        if not userspace_tso_enabled():
            self._tso_before, self._tso_changed = userspace_tso_setting(), True
            set_userspace_tso("true")

    def restore_userspace_tso(self) -> None:
        if self._tso_changed:
            set_userspace_tso(self._tso_before)
            self._tso_changed = False

    def raise_switch_rx_buffer(self) -> None:
        with open(RMEM_DEFAULT) as fh:
            machine = fh.read().strip()
        if int(machine) >= SWITCH_RX_BUFFER:
            return
        try:
            with open(RMEM_DEFAULT, "w") as fh:
                fh.write(str(SWITCH_RX_BUFFER))
        except PermissionError:  # a network namespace of its own (own_machine.py): the kernel's one value
            self.log(f"net.core.rmem_default is the machine's ({machine} bytes): it can be set only from the "
                     "first network namespace, so the switch ports keep it")
            return
        self._rmem_default = machine

    def restore_rmem_default(self) -> None:
        old, self._rmem_default = self._rmem_default, None
        if old is not None:
            with open(RMEM_DEFAULT, "w") as fh:
                fh.write(old)
