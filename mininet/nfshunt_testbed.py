"""The one NFShunt testbed: hosts, Open vSwitch fast path, firewall node, controller.

            h1 --(1) [ s1: Open vSwitch ] (3)-- h2
                      (2)         (4)
                       |           |
                  fw-eth0  [fw: br0]  fw-eth1       NFShunt controller runs in fw
                      (physdevin 1) (physdevin 2)

Modes from the one topology:
  direct    s1 patches h1 <-> h2, no firewall;
  firewall  s1 patches every fast port to its slow port: everything crosses br0;
  nfshunt   the NFShunt controller in fw programs s1 (fail mode secure);
  ha        a firewall pair: fw and fw2 (slow ports 5, 6), each with bridge, plumbing,
            controller, conntrackd and keepalived (config/ha/ rendered for the node), a
            sync link (fw-eth2 <-> fw2-eth2) and a VRRP link (fw-eth3 <-> fw2-eth3); both
            controllers connected to s1, fw the active one after start.
  two-switch  one controller serves two switches (config `switches`): s1 as above, and
            s2 with h3 (port 1) and h4 (port 3), cabled to fw-eth2 (port 2, physdevin 3)
            and fw-eth3 (port 4, physdevin 4) of the same bridge br0; h1 -> h3 crosses
            both switches through the firewall.

The switch uses the kernel datapath when the kernel has it, otherwise the userspace
(netdev) datapath; `datapath` says which. An `Emulation` (linkemu.py) adds delay (netem or
the NFQUEUE fallback; `delay_mechanism` says which, `rtt_measured` what ping saw before the
run), link rates and a rate- and buffer-limited slow path. Integration tests, the demo, experiments and
benchmarks all build their network here. Everything is removed by stop(), also after a
failure, and on SIGTERM/SIGINT through the context manager.
"""
from __future__ import annotations

import enum
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from datetime import datetime
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from mininet.log import setLogLevel
from mininet.net import Mininet
from mininet.node import Host, OVSSwitch, RemoteController
from mininet.topo import Topo

from linkemu import (Emulation, EmulationError, check_rtt, choose_delay_mechanism, measure_rtt, nfqueue_rules,
                     shape_host_egress, shape_slow_path, start_nfqdelay, stop_process, tune_host)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
POLICY = os.path.join(REPO, "iptables", "policy-example.rules")
PYTHON = sys.executable

H1_IP, H2_IP = "10.0.0.1", "10.0.0.2"
H1_IP6, H2_IP6 = "fd00::1", "fd00::2"
# Control link between the root namespace (where Open vSwitch runs) and fw.
MGMT_ROOT, MGMT_FW = "169.254.66.1", "169.254.66.2"
# The testbed's names (s1, fw, nfsmgmt0 ...) are fixed: two testbeds on one machine would
# tear each other down. start() holds this lock until stop(); a second one waits its turn.
LOCK_PATH = "/run/lock/nfshunt-testbed.lock"
MGMT_OTHER = "169.254.66.3"  # free on the control link: a second host there (tests add it)
OF_PORT = 6653
LAG_PROXY_PORT = 6654  # oflag.py, on the root namespace's loopback, when the switch emulates hardware lag
FAST1, SLOW1, FAST2, SLOW2 = 1, 2, 3, 4
SHUNT_PORT, BLOCK_PORT, IGNORE_PORT = 5201, 5202, 5203
MODES = ("direct", "firewall", "nfshunt", "ha", "two-switch")
H3_IP, H4_IP = "10.0.0.3", "10.0.0.4"
S1_DPID, S2_DPID = "00000000000000a1", "00000000000000a2"
# The pair's second firewall (mode "ha"): its slow ports, control link, and the pair's links.
SLOW1_B, SLOW2_B = 5, 6
MGMT_ROOT2, MGMT_FW2 = "169.254.66.9", "169.254.66.10"
SYNC_ADDRS = ("10.255.1.1", "10.255.1.2")  # conntrackd's link, fw-eth2 <-> fw2-eth2
VRRP_ADDRS = ("10.255.2.1", "10.255.2.2")  # keepalived's link, fw-eth3 <-> fw2-eth3
VRRP_VIP = "10.255.2.100"
HA_CONFIG = os.path.join(REPO, "config", "ha")
# A strict firewall: what conntrack calls INVALID is dropped (a packet of a connection it
# does not track, an ACK outside the window it knows).
# Transfers whose stalls a test measures run paced: the userspace switch forwards on the CPU
# the hosts and daemons share, and two unpaced transfers (about 300 Mbit/s each) lost 2-3 %
# of their segments in the switch alone (measured on the 2-core VM); one more loss while a
# failover or policy change loads the CPU chains TCP's RTO backoff (0.2 + 0.4 + 0.8 s) past
# 1 s. At 100 Mbit/s the switch loses under 1 %.
STEADY_RATE = "100M"
# Open vSwitch's userspace datapath reads each port through a packet socket sized by
# net.core.rmem_default (208 KB here: about 15 jumbo frames, 1.5 ms at 1 Gbit/s), so any
# short stall of ovs-vswitchd's main thread dropped packets no hardware switch would. The
# ports get a switch-like 4 MB while they are opened; the machine's value is put back then.
SWITCH_RX_BUFFER = 4 * 1024 * 1024
RMEM_DEFAULT = "/proc/sys/net/core/rmem_default"
STRICT_RULE = ("FORWARD", "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP")


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


class TestbedError(RuntimeError):
    pass


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


TSO_KEY = "userspace-tso-enable"


def userspace_tso_setting() -> str | None:
    """The machine's other_config:userspace-tso-enable as written ("true", "false"), or
    None where it is not set (Open vSwitch's default: off)."""
    out = subprocess.run(["ovs-vsctl", "--if-exists", "get", "Open_vSwitch", ".", f"other_config:{TSO_KEY}"],
                         capture_output=True, text=True).stdout.strip().strip('"')
    return out or None


def userspace_tso_enabled() -> bool:
    return userspace_tso_setting() == "true"


def set_userspace_tso(setting: str | None) -> None:
    """Write Open vSwitch's userspace TSO setting ("true", "false", or None: the key
    removed) and restart it (no testbed may be up): a running daemon turns TSO on as soon
    as the key says true, but never off again, and ports it opened before then mangle every
    frame (each side expects the other's virtio-net header)."""
    if userspace_tso_setting() == setting:
        return
    change = (["remove", "Open_vSwitch", ".", "other_config", TSO_KEY] if setting is None
              else ["set", "Open_vSwitch", ".", f"other_config:{TSO_KEY}={setting}"])
    subprocess.run(["ovs-vsctl", *change], check=True, capture_output=True)
    subprocess.run(["/usr/share/openvswitch/scripts/ovs-ctl", "restart", "--system-id=random"], capture_output=True)
    if subprocess.run(["ovs-vsctl", "--timeout=10", "show"], capture_output=True).returncode != 0:
        raise TestbedError("Open vSwitch did not come back after a restart (ovs-ctl restart)")


class Service(enum.Enum):
    """A firewall pair host's services, in the order `systemctl enable --now` names them."""
    CONNTRACKD = "conntrackd"
    KEEPALIVED = "keepalived"
    CONTROLLER = "nfshunt"


# The environment keepalived gives its notify scripts (and systemd its services).
BARE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
NODE_NAMES = ("h1", "h2", "h3", "h4", "fw", "fw2", "s1", "s2")  # every node TwoHostTopo may build
MGMT_IFS = ("nfsmgmt0", "nfsmgmt2")  # the control links' root-namespace ends


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


def clear_leftovers(log: Callable[[str], None]) -> None:
    """Remove what a testbed killed before its clean-up (SIGKILL, a machine's session
    ending mid-run) left behind under the fixed names a new one needs: its nodes' shells and
    every process in their network namespaces (controllers, daemons, traffic), its switch
    ports' veths and control links in the root namespace, its bridges. Called with the
    testbed lock held, so no live testbed owns these names."""
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
        if ns != root_ns and shells.match(cmdline):
            stale_ns.add(ns)
    killed = 0
    for pid, ns in procs:
        if ns in stale_ns:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    links = [name for name in os.listdir("/sys/class/net")
             if name in MGMT_IFS or re.fullmatch(r"s[12]-eth\d+", name)]
    for name in links:
        subprocess.run(["ip", "link", "del", name], capture_output=True)
    bridges = subprocess.run(["ovs-vsctl", "--timeout=5", "list-br"], capture_output=True, text=True).stdout.split()
    stale_bridges = [br for br in ("s1", "s2") if br in bridges]
    for br in stale_bridges:
        subprocess.run(["ovs-vsctl", "--timeout=5", "--if-exists", "del-br", br], capture_output=True)
    if killed or links or stale_bridges:
        log(f"removed an earlier testbed's leftovers: {killed} processes in {len(stale_ns)} node namespaces, "
            f"links {' '.join(links) or '-'}, bridges {' '.join(stale_bridges) or '-'}")


def kernel_datapath_available() -> bool:
    return os.path.exists("/sys/module/openvswitch")


class TwoHostTopo(Topo):
    def build(self, ha: bool = False, two_switch: bool = False) -> None:  # type: ignore[override]
        h1 = self.addHost("h1", ip=f"{H1_IP}/24")
        h2 = self.addHost("h2", ip=f"{H2_IP}/24")
        fw = self.addHost("fw", ip=None)
        s1 = self.addSwitch("s1", dpid=S1_DPID)
        self.addLink(h1, s1, port2=FAST1)
        self.addLink(fw, s1, port1=0, port2=SLOW1)
        self.addLink(h2, s1, port2=FAST2)
        self.addLink(fw, s1, port1=1, port2=SLOW2)
        if ha:
            fw2 = self.addHost("fw2", ip=None)
            self.addLink(fw2, s1, port1=0, port2=SLOW1_B)
            self.addLink(fw2, s1, port1=1, port2=SLOW2_B)
            self.addLink(fw, fw2, port1=2, port2=2)  # conntrackd's sync link
            self.addLink(fw, fw2, port1=3, port2=3)  # VRRP
        if two_switch:
            h3 = self.addHost("h3", ip=f"{H3_IP}/24")
            h4 = self.addHost("h4", ip=f"{H4_IP}/24")
            s2 = self.addSwitch("s2", dpid=S2_DPID)
            self.addLink(h3, s2, port2=FAST1)
            self.addLink(fw, s2, port1=2, port2=SLOW1)
            self.addLink(h4, s2, port2=FAST2)
            self.addLink(fw, s2, port1=3, port2=SLOW2)


@dataclass
class Firewall:
    """One firewall node: the switch ports of its bridge, its control link, its controller
    and (in a pair) its conntrackd and keepalived."""
    name: str
    slow: tuple[int, int]
    mgmt_root: str  # the control link's address in the root namespace (Open vSwitch's side)
    mgmt_fw: str  # the controller's address
    mgmt_ifs: tuple[str, str]  # the control link's veth ends: root side, node side
    workdir: str
    index: int = 0
    bridge_ports: int = 2  # fw-eth0 ... : 4 in mode two-switch
    controller: subprocess.Popen | None = None
    log_start: int = 0  # where the running controller's output begins in controller_log
    daemons: list[subprocess.Popen] = field(default_factory=list)

    @property
    def config_path(self) -> str:
        return os.path.join(self.workdir, "nfshunt.json")

    @property
    def controller_log(self) -> str:
        return os.path.join(self.workdir, "controller.log")

    @property
    def control_socket(self) -> str:
        return os.path.join(self.workdir, "control", "nfshunt.sock")

    @property
    def intfs(self) -> tuple[str, ...]:
        return tuple(f"{self.name}-eth{i}" for i in range(self.bridge_ports))

    @property
    def links(self) -> tuple[str, ...]:
        """Every link of the node: bridge ports, (in a pair) sync and VRRP, control."""
        return tuple(dict.fromkeys((*self.intfs, f"{self.name}-eth2", f"{self.name}-eth3", self.mgmt_ifs[1])))


class Testbed:
    def __init__(self, mode: str = "nfshunt", of_version: str = "1.3",
                 config: dict[str, Any] | None = None, policy: str | None = POLICY,
                 workdir: str | None = None, log: Callable[[str], None] | None = None,
                 emulation: Emulation | None = None, switch_lag_ms: float | None = None,
                 switch_reorder: bool = False, host_offload: bool = False, userspace_tso: bool = False):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.mode = mode
        self.of_version = of_version
        self.extra_config = config or {}
        self.policy = policy
        self.log = log or (lambda msg: None)
        self._own_workdir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="nfshunt-testbed-")
        self.net: Mininet | None = None
        self.datapath = "system" if kernel_datapath_available() else "netdev"
        self.firewalls = [Firewall("fw", (SLOW1, SLOW2), MGMT_ROOT, MGMT_FW, ("nfsmgmt0", "nfsmgmt1"), self.workdir,
                                   bridge_ports=4 if mode == "two-switch" else 2)]
        self.bridges = ("s1", "s2") if mode == "two-switch" else ("s1",)
        if mode == "ha":
            self.firewalls.append(Firewall("fw2", (SLOW1_B, SLOW2_B), MGMT_ROOT2, MGMT_FW2, ("nfsmgmt2", "nfsmgmt3"),
                                           os.path.join(self.workdir, "fw2"), index=1))
        self.config_path = self.firewalls[0].config_path
        self.controller_log = self.firewalls[0].controller_log
        self._old_signals: dict[int, Any] = {}
        self.emulation = emulation or Emulation()
        self.delay_mechanism = "none"
        self.rtt_measured: float | None = None
        self._delayers: list[subprocess.Popen] = []
        self._procs: list[subprocess.Popen] = []
        # Hardware-like barrier lag (oflag.py between s1 and the first firewall's controller).
        self.switch_lag_ms = switch_lag_ms
        self.switch_reorder = switch_reorder
        self._lag_proxy: subprocess.Popen | None = None
        self._rmem_default: str | None = None  # the machine's value while the switch ports open
        self._lock_fd: int | None = None
        # The hosts' TSO and checksum offload (Linux's defaults) need Open vSwitch's
        # userspace TSO support on; off by default, whatever the machine's setting, so packet
        # sizes are the MTU's. userspace_tso: Open vSwitch runs with it on (as a machine
        # carrying real traffic may), the hosts offloading or not. Open vSwitch reads the
        # setting once, so it is restarted to change it, and put back on stop.
        self.host_offload = host_offload
        self.userspace_tso = userspace_tso or host_offload
        self._tso_before: str | None = None
        self._tso_changed = False  # the machine's setting, to put back as it was (absent included)

    # --- nodes ----------------------------------------------------------------------------

    @property
    def h1(self) -> Host:
        return self.net.get("h1")  # type: ignore[union-attr]

    @property
    def h2(self) -> Host:
        return self.net.get("h2")  # type: ignore[union-attr]

    @property
    def hosts(self) -> list[Host]:
        """The end hosts: h1, h2 (and h3, h4 on s2 in mode two-switch)."""
        return [self.net.get(h) for h in ("h1", "h2", "h3", "h4")[:2 * len(self.bridges)]]  # type: ignore[union-attr]

    @property
    def fw(self) -> Host:
        return self.net.get("fw")  # type: ignore[union-attr]

    @property
    def controller(self) -> subprocess.Popen | None:
        """The first firewall's controller (the only one outside mode "ha")."""
        return self.firewalls[0].controller

    def node(self, fw: Firewall) -> Host:
        return self.net.get(fw.name)  # type: ignore[union-attr]

    def run(self, node: Host, *args: str, check: bool = True, timeout: float = 30) -> str:
        """Run a command (argument list, no shell) inside a node's namespace."""
        proc = node.popen(list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=self._env(), cwd=REPO)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise TestbedError(f"{node.name}: {' '.join(args)} timed out") from None
        if check and proc.returncode != 0:
            raise TestbedError(f"{node.name}: {' '.join(args)} failed ({proc.returncode}): {err.strip()}")
        return out

    @staticmethod
    def _env() -> dict[str, str]:
        return dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def nfshunt(self, *args: str, check: bool = True, timeout: float = 30, fw: Firewall | None = None) -> str:
        """Run the nfshunt CLI inside a firewall node (the first by default)."""
        return self.run(self.node(fw or self.firewalls[0]), PYTHON, "-m", "nfshunt", *args, check=check,
                        timeout=timeout)

    # --- config ---------------------------------------------------------------------------

    def nfshunt_config(self, fw: Firewall | None = None) -> dict[str, Any]:
        fw = fw or self.firewalls[0]
        eth0, eth1 = fw.intfs[:2]
        ports = [{"fast": FAST1, "slow": fw.slow[0], "physdevin": 1, "bridge_port": eth0},
                 {"fast": FAST2, "slow": fw.slow[1], "physdevin": 2, "bridge_port": eth1}]
        groups: dict[str, Any] = {"ports": ports}
        if self.mode == "two-switch":
            groups = {"switches": [
                {"datapath_id": S1_DPID, "ports": ports},
                {"datapath_id": S2_DPID, "ports": [
                    {"fast": FAST1, "slow": SLOW1, "physdevin": 3, "bridge_port": fw.intfs[2]},
                    {"fast": FAST2, "slow": SLOW2, "physdevin": 4, "bridge_port": fw.intfs[3]}]}]}
        cfg: dict[str, Any] = {
            "delete_flows_on_startup": True,
            "delete_flows_on_shutdown": True,
            "default_shunt_timeout": 10,
            "default_block_timeout": 10,
            "default_no_shunting": True,
            **groups,
            "mark_actions": {"0": "ignore", "1": "shunt", "2": "block"},
            "openflow_versions": [self.of_version],
            "listen_address": fw.mgmt_fw,
            "listen_port": OF_PORT,
            "log_level": "DEBUG",
            "control_socket": fw.control_socket,
            "state_dir": fw.workdir,
        }
        extra = dict(self.extra_config)
        if self.mode == "ha":  # the other controller adopts what this one leaves
            cfg["delete_flows_on_shutdown"] = False
            cfg["pair"] = {"state_file": os.path.join(fw.workdir, "pair.json"), **(extra.pop("pair", None) or {})}
        cfg.update(extra)
        return cfg

    # --- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> "Testbed":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_signals[sig] = signal.signal(sig, self._on_signal)
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    def _lock(self) -> None:
        os.makedirs(os.path.dirname(LOCK_PATH), exist_ok=True)
        self._lock_fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.log(f"another testbed runs on this machine; waiting for it ({LOCK_PATH})")
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = None

    def start(self) -> None:
        self._lock()
        ensure_ovs()
        clear_leftovers(self.log)
        if self.userspace_tso and self.datapath == "netdev" and not userspace_tso_enabled():
            self._tso_before, self._tso_changed = userspace_tso_setting(), True
            set_userspace_tso("true")
        setLogLevel("error")
        ofproto = {"1.0": "OpenFlow10", "1.3": "OpenFlow13"}[self.of_version]
        controller: Any = None
        if self.controlled:  # Open vSwitch connects to every firewall's controller
            controller = [lambda name, ip=f.mgmt_fw: RemoteController(name, ip=ip, port=OF_PORT)
                          for f in self.firewalls]
            if self.switch_lag_ms is not None:
                self._start_lag_proxy()
                controller[0] = lambda name: RemoteController(name, ip="127.0.0.1", port=LAG_PROXY_PORT)
        self.net = Mininet(topo=TwoHostTopo(ha=self.mode == "ha", two_switch=self.mode == "two-switch"),
                           controller=controller, autoSetMacs=True,
                           switch=lambda name, **kw: OVSSwitch(name, datapath="user" if self.datapath == "netdev"
                                                               else "kernel", failMode="secure",
                                                               protocols=ofproto, **kw),
                           build=False)
        self.log(f"building testbed: mode={self.mode}, OpenFlow {self.of_version}, "
                 f"Open vSwitch datapath={self.datapath}")
        if self.datapath == "netdev":
            self._switch_rx_buffer()
        self.net.build()
        # The switch ports' kernel side (root namespace) would send neighbour and multicast
        # listener messages of its own onto the links: traffic no host sent.
        for intf in self.switch_intfs:
            subprocess.run(["sysctl", "-qw", f"net.ipv6.conf.{intf}.disable_ipv6=1"], check=False)
        self._setup_hosts()
        for fw in self.firewalls:
            os.makedirs(fw.workdir, exist_ok=True)
            self._setup_firewall(fw)
            if self.controlled:
                self._setup_mgmt(fw)
                if self.mode != "ha":  # a pair's controllers start with its other services
                    self._start_controller(fw)
        if self.mode == "ha":
            self._setup_pair_links()
        self.net.start()
        self._restore_rmem_default()  # ovs-vsctl waited for vswitchd to open every port
        self._program_static_flows()
        if self.mode == "ha":
            # Both hosts' services, each up before the next: the controllers have the switch
            # before keepalived elects (the first firewall, by its priority), as when the pair
            # boots with nfshunt ordered first; tests try the other orders too.
            self.start_services(self.firewalls, (Service.CONTROLLER, Service.CONNTRACKD, Service.KEEPALIVED))
            self.wait_for(lambda: (a := self.active_firewall()) is not None and self.defaults_point_to(a), 20,
                          "keepalived to elect a firewall and its controller to take the switch over")
        elif self.controlled:
            self.wait_for(self._defaults_installed, 20, "controller to install the default flows")
        self._setup_emulation()

    def _switch_rx_buffer(self) -> None:
        with open(RMEM_DEFAULT) as fh:
            self._rmem_default = fh.read().strip()
        if int(self._rmem_default) < SWITCH_RX_BUFFER:
            with open(RMEM_DEFAULT, "w") as fh:
                fh.write(str(SWITCH_RX_BUFFER))

    def _restore_rmem_default(self) -> None:
        old, self._rmem_default = self._rmem_default, None
        if old is not None:
            with open(RMEM_DEFAULT, "w") as fh:
                fh.write(old)

    def _start_lag_proxy(self) -> None:
        args = [PYTHON, os.path.join(HERE, "oflag.py"), "127.0.0.1", str(LAG_PROXY_PORT), MGMT_FW, str(OF_PORT),
                "--lag", str(self.switch_lag_ms)]
        if self.switch_reorder:
            args.append("--reorder")
        proxy = self._lag_proxy = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = proxy.stdout.readline() if proxy.stdout else ""
        if not line.startswith("listening"):
            err = proxy.stderr.read() if proxy.stderr and proxy.poll() is not None else ""
            raise TestbedError(f"the OpenFlow lag proxy did not start: {line}{err}")
        self.log(f"switch emulates hardware: barriers answered at once, flow-mods applied {self.switch_lag_ms:g} ms "
                 f"later{' and reordered' if self.switch_reorder else ''} (oflag.py)")

    @property
    def controlled(self) -> bool:
        return self.mode in ("nfshunt", "ha", "two-switch")

    @property
    def switch_ports(self) -> tuple[int, ...]:
        return (FAST1, FAST2) + tuple(p for fw in self.firewalls for p in fw.slow)

    @property
    def switch_intfs(self) -> list[str]:
        """The switches' ports' interfaces in the root namespace (s1-eth1 ...)."""
        return [f"{br}-eth{port}" for br in self.bridges for port in self.switch_ports]

    def _setup_emulation(self) -> None:
        """Link rates, MTU, host tuning, slow path, delay; then check the RTT before any run."""
        emu = self.emulation
        for intf in self.switch_intfs:
            subprocess.run(["ovs-vsctl", "set", "interface", intf, f"mtu_request={emu.mtu}"],
                           check=True, capture_output=True)
        for fw in self.firewalls:
            shape_slow_path(self.run, self.node(fw), fw.intfs, emu)
        half = emu.rtt_ms / 2
        try:
            mechanism = choose_delay_mechanism(emu.delay, self.h1) if half > 0 else "none"
            for host in (self.h1, self.h2):
                intf = f"{host.name}-eth0"
                tune_host(self.run, host, intf, emu)
                shape_host_egress(self.run, host, intf, emu, half, mechanism)
                if mechanism == "nfqueue":
                    self._delayers.append(start_nfqdelay(host, half))
                    for rule in nfqueue_rules(intf, add=True):
                        self.run(host, *rule)
            self.delay_mechanism = mechanism
            if half > 0 or emu.link_mbit:
                self.rtt_measured = measure_rtt(self.run, self.h1, H2_IP)
                self.log(f"RTT requested {emu.rtt_ms:g} ms, measured {self.rtt_measured:.2f} ms "
                         f"(delay mechanism: {mechanism})")
                check_rtt(emu.rtt_ms, self.rtt_measured)
        except EmulationError as exc:
            raise TestbedError(str(exc)) from None

    def _setup_hosts(self) -> None:
        for i, host in enumerate(self.hosts):
            intf = f"{host.name}-eth0"
            self.run(host, "sysctl", "-qw", f"net.ipv6.conf.{intf}.accept_dad=0")
            self.run(host, "ip", "-6", "addr", "add", f"fd00::{i + 1}/64", "dev", intf, "nodad")
            # The userspace datapath completes checksums of offloaded packets only with its
            # own TSO support on (set in start() when host_offload asks for it).
            if not self.host_offload:
                self.run(host, "ethtool", "-K", intf, "tx", "off", check=False)

    def _setup_firewall(self, firewall: Firewall) -> None:
        fw = self.node(firewall)
        self.run(fw, "ip", "link", "add", "br0", "type", "bridge")
        # A transparent bridge sends nothing of its own: no addresses, no IPv6 on the bridge
        # or its ports (their neighbour and multicast-listener messages would be counted
        # as traffic leaving the firewall and make the per-hop loss accounting negative).
        # Bridged IPv6 is still forwarded and filtered (bridge-nf-call-ip6tables).
        for intf in ("br0", *firewall.intfs):
            self.run(fw, "sysctl", "-qw", f"net.ipv6.conf.{intf}.disable_ipv6=1")
        for intf in firewall.intfs:
            self.run(fw, "ip", "addr", "flush", "dev", intf)
            self.run(fw, "ip", "link", "set", intf, "master", "br0")
            self.run(fw, "ip", "link", "set", intf, "up")
        self.run(fw, "ip", "link", "set", "br0", "up")
        for name in ("bridge-nf-call-iptables", "bridge-nf-call-ip6tables", "bridge-nf-filter-vlan-tagged"):
            self.run(fw, "sysctl", "-qw", f"net.bridge.{name}=1")
        self.run(fw, "sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_loose=1")
        with open(firewall.config_path, "w") as fh:
            json.dump(self.nfshunt_config(firewall), fh, indent=2)
        if self.mode != "direct":
            args = ["iptables", "apply", "--config", firewall.config_path]
            if self.policy:
                args += ["--policy", self.policy]
            self.nfshunt(*args, fw=firewall)

    def _setup_mgmt(self, fw: Firewall) -> None:
        root_if, fw_if = fw.mgmt_ifs
        node = self.node(fw)
        subprocess.run(["ip", "link", "add", root_if, "type", "veth", "peer", "name", fw_if], check=True)
        subprocess.run(["ip", "link", "set", fw_if, "netns", str(node.pid)], check=True)
        subprocess.run(["ip", "addr", "add", f"{fw.mgmt_root}/29", "dev", root_if], check=True)
        subprocess.run(["ip", "link", "set", root_if, "up"], check=True)
        self.run(node, "ip", "addr", "add", f"{fw.mgmt_fw}/29", "dev", fw_if)
        self.run(node, "ip", "link", "set", fw_if, "up")
        self.run(node, "ip", "link", "set", "lo", "up")

    def _start_controller(self, fw: Firewall | None = None) -> None:
        fw = fw or self.firewalls[0]
        logf = open(fw.controller_log, "ab")
        fw.log_start = logf.tell()
        fw.controller = self.node(fw).popen([PYTHON, "-m", "nfshunt", "run", "--config", fw.config_path],
                                            stdout=logf, stderr=subprocess.STDOUT, env=self._env(), cwd=REPO)
        logf.close()

    def stop_controller(self, sig: int = signal.SIGTERM, timeout: float = 10, fw: Firewall | None = None) -> int | None:
        fw = fw or self.firewalls[0]
        proc, fw.controller = fw.controller, None
        return stop_process(proc, timeout, sig) if proc is not None else None

    def restart_controller(self, fw: Firewall | None = None) -> None:
        self.stop_controller(fw=fw)
        self._start_controller(fw)

    def reconfigure(self, wait: bool = True, **overrides: Any) -> None:
        """Restart the controller with config keys changed (None: back to the default);
        wait=False: do not wait for it to have the switch."""
        for key, value in overrides.items():
            if value is None:
                self.extra_config.pop(key, None)
            else:
                self.extra_config[key] = value
        self.stop_controller()
        with open(self.config_path, "w") as fh:
            json.dump(self.nfshunt_config(), fh, indent=2)
        self._start_controller()
        if wait:
            self.wait_for_controller()

    def wait_for_controller(self, timeout: float = 20, fw: Firewall | None = None) -> None:
        """The controller answers on its control socket and has the switch."""
        fw = fw or self.firewalls[0]

        def ready() -> bool:
            if fw.controller is not None and fw.controller.poll() is not None:
                raise TestbedError(f"{fw.name}'s controller exited:\n" + self.controller_output(fw)[-3000:])
            try:
                return bool(self.control({"cmd": "status"}, fw=fw)["switch"]["connected"])
            except Exception:
                return False
        self.wait_for(ready, timeout, f"{fw.name}'s controller to answer with the switch connected")

    def control(self, payload: dict[str, Any], timeout: float = 10, fw: Firewall | None = None) -> dict[str, Any]:
        """One request on a controller's control socket (a path: reachable from any netns)."""
        from nfshunt.control import request
        return request((fw or self.firewalls[0]).control_socket, payload, timeout)

    def strict_firewalls(self) -> None:
        """Every firewall strict: INVALID dropped, and no loose pickup (a TCP connection
        the firewall does not track is not picked up mid-stream)."""
        for fw in self.firewalls:
            node = self.node(fw)
            self.run(node, "iptables", "-w", "5", "-I", *STRICT_RULE)
            self.run(node, "sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_loose=0")

    # --- the pair (mode "ha") -----------------------------------------------------------------

    def _setup_pair_links(self) -> None:
        for fw in self.firewalls:
            node = self.node(fw)
            for intf, addrs in ((f"{fw.name}-eth2", SYNC_ADDRS), (f"{fw.name}-eth3", VRRP_ADDRS)):
                self.run(node, "ip", "addr", "flush", "dev", intf)
                self.run(node, "ip", "addr", "add", f"{addrs[fw.index]}/24", "dev", intf)
                self.run(node, "ip", "link", "set", intf, "up")

    @staticmethod
    def _notify_wrapper(fw: Firewall) -> str:
        """The shipped notify script run as keepalived runs it (same arguments, keepalived's
        bare environment); only its stderr, a time-stamped line a step, is kept (keepalived
        discards it) for the takeover's time line."""
        path = os.path.join(fw.workdir, "nfshunt-notify")
        with open(path, "w") as fh:
            fh.write(f'#!/bin/sh\nexec {os.path.join(HA_CONFIG, "nfshunt-notify")} "$@" 2>>{fw.workdir}/notify.log\n')
        os.chmod(path, 0o755)
        return path

    def render_pair_config(self, fw: Firewall) -> dict[str, str]:
        """The shipped config/ha examples with this node's interfaces, addresses and paths:
        what the testbed runs is what an admin starts from. Returns the written paths."""
        me, peer = fw.index, 1 - fw.index
        subst = {
            "nfshunt-fw-a": f"nfshunt-{fw.name}",
            "vrrp0": f"{fw.name}-eth3", "sync0": f"{fw.name}-eth2",
            "192.0.2.1": VRRP_ADDRS[me], "192.0.2.2": VRRP_ADDRS[peer], "192.0.2.100": VRRP_VIP,
            "198.51.100.1": SYNC_ADDRS[me], "198.51.100.2": SYNC_ADDRS[peer],
            "priority 150": f"priority {150 if me == 0 else 100}",
            "/usr/local/sbin/nfshunt-notify": self._notify_wrapper(fw),
            "/etc/conntrackd/conntrackd.conf": os.path.join(fw.workdir, "conntrackd.conf"),
            "/etc/nfshunt/nfshunt.json": fw.config_path,
            "/var/log/conntrackd.log": os.path.join(fw.workdir, "conntrackd.log"),
            "/var/lock/conntrackd.lock": os.path.join(fw.workdir, "conntrackd.lock"),
            "/var/run/conntrackd.ctl": os.path.join(fw.workdir, "conntrackd.ctl"),
        }
        pattern = re.compile("|".join(re.escape(k) for k in sorted(subst, key=len, reverse=True)))
        out = {}
        for name in ("keepalived.conf", "conntrackd.conf"):
            with open(os.path.join(HA_CONFIG, name)) as fh:
                text = pattern.sub(lambda m: subst[m.group(0)], fh.read())
            out[name] = os.path.join(fw.workdir, name)
            with open(out[name], "w") as fh:
                fh.write(text)
        return out

    def start_services(self, firewalls: Sequence[Firewall], order: Sequence[Service] = ()) -> None:
        """Start a pair's three services on each firewall, as `systemctl enable --now`
        would: all at once (no order), or one after the other in `order`, each started
        before the next without waiting for it to be ready."""
        for fw in firewalls:
            for stale in ("conntrackd.lock", "conntrackd.ctl", "keepalived.pid", "vrrp.pid"):
                if os.path.exists(os.path.join(fw.workdir, stale)):
                    os.unlink(os.path.join(fw.workdir, stale))
        for service in order or tuple(Service):
            for fw in firewalls:
                {Service.CONNTRACKD: self._start_conntrackd, Service.KEEPALIVED: self._start_keepalived,
                 Service.CONTROLLER: self._start_controller}[service](fw)
            if order:
                for fw in firewalls:
                    self.wait_for(lambda fw=fw, service=service: self._service_ready(fw, service), 20,
                                  f"{service.value} on {fw.name}", interval=0.05)

    def _service_ready(self, fw: Firewall, service: Service) -> bool:
        """Up, read from what the service leaves behind (never by asking the controller)."""
        if service is Service.CONTROLLER:
            if fw.controller is not None and fw.controller.poll() is not None:
                raise TestbedError(f"{fw.name}'s controller exited:\n" + self.controller_output(fw)[-3000:])
            return " connected from " in self.controller_output(fw, since_start=True)
        return os.path.exists(os.path.join(fw.workdir, "conntrackd.ctl" if service is Service.CONNTRACKD
                                           else "vrrp.pid"))

    def _start_conntrackd(self, fw: Firewall) -> None:
        paths = self.render_pair_config(fw)
        with open(os.path.join(fw.workdir, "daemons.log"), "ab") as log:
            fw.daemons.append(self.node(fw).popen(["conntrackd", "-C", paths["conntrackd.conf"]], stdout=log,
                                                  stderr=subprocess.STDOUT, env=BARE_ENV))

    def _start_keepalived(self, fw: Firewall) -> None:
        """keepalived runs the shipped notify script as installed: with keepalived's own
        minimal environment, finding the `nfshunt` command the install put on the PATH."""
        paths = self.render_pair_config(fw)
        pids = [f"--pid={fw.workdir}/keepalived.pid", f"--vrrp_pid={fw.workdir}/vrrp.pid",
                f"--checkers_pid={fw.workdir}/checkers.pid"]
        with open(os.path.join(fw.workdir, "daemons.log"), "ab") as log:
            fw.daemons.append(self.node(fw).popen(["keepalived", "--dont-fork", "--log-console", "--vrrp", "-f",
                                                   paths["keepalived.conf"], *pids],
                                                  stdout=log, stderr=subprocess.STDOUT, env=BARE_ENV))

    def stop_services(self, fw: Firewall, sig: int = signal.SIGTERM) -> None:
        """keepalived and conntrackd, then the controller. SIGKILL is a power cut: every
        process on the node dies at once (keepalived's VRRP child and a notify script under
        way too, which would otherwise outlive it and act on the next start)."""
        if sig == signal.SIGKILL:
            node = self.node(fw)
            for pid in processes_in_netns(os.stat(f"/proc/{node.pid}/ns/net").st_ino):
                if pid != node.pid:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        while fw.daemons:
            stop_process(fw.daemons.pop(), 5, sig)
        # A killed keepalived leaves its VRRP address behind; a host that died has none.
        self.run(self.node(fw), "ip", "addr", "del", f"{VRRP_VIP}/24", "dev", f"{fw.name}-eth3", check=False)
        self.stop_controller(sig, fw=fw)

    def active_firewall(self) -> Firewall | None:
        """The firewall keepalived made master (it holds the VRRP address); None: none or
        both (a split brain)."""
        masters = [fw for fw in self.firewalls
                   if VRRP_VIP + "/" in self.run(self.node(fw), "ip", "-4", "-o", "addr", "show", "dev",
                                                  f"{fw.name}-eth3", check=False)]
        return masters[0] if len(masters) == 1 else None

    def watch_first_packet(self, fw: Firewall) -> subprocess.Popen:
        """tcpdump on the firewall's first bridge port, ready when this returns: its output
        is the first TCP packet the bridge forwards (a backup's bridge sees none)."""
        proc = self.node(fw).popen(["tcpdump", "-i", fw.intfs[0], "-n", "-tt", "-l", "-c", "1", "tcp"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._procs.append(proc)
        said = ""
        while proc.stderr is not None and "listening on" not in said:
            line = proc.stderr.readline()
            if not line:
                raise TestbedError(f"tcpdump on {fw.name} did not start: {said}")
            said += line
        return proc

    def takeover_timeline(self, fw: Firewall, failed_at: float, first_packet: subprocess.Popen,
                          timeout: float = 10) -> list[tuple[str, float | None]]:
        """When each step of fw's takeover happened, in seconds after failed_at (wall clock,
        the one the notify script, the controller's log and tcpdump share); None: not seen."""
        def after(times: list[float]) -> float | None:
            later = [t - failed_at for t in times if t >= failed_at]
            return min(later) if later else None

        def notify(what: str) -> float | None:
            return after([float(m.group(1)) for m in re.finditer(
                rf"nfshunt-notify: ([0-9.]+) {re.escape(what)}", _read(os.path.join(fw.workdir, "notify.log")))])

        def logged(what: str) -> float | None:
            return after([datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() for m in re.finditer(
                rf"^(\S+ \S+) .*{re.escape(what)}", self.controller_output(fw, since_start=True), re.M)])
        try:
            out, _ = first_packet.communicate(timeout=timeout)
            packet = after([float(out.split()[0])]) if out.strip() else None
        except subprocess.TimeoutExpired:
            first_packet.kill()
            packet = None
        return [("keepalived MASTER (notify script)", notify("keepalived state MASTER")),
                ("conntrackd committed its cache", notify("conntrackd committed")),
                ("controller claims MASTER", logged("claiming MASTER of switch")),
                ("switch granted; defaults sent", logged("master of switch")),
                (f"first packet through {fw.name}'s bridge", packet)]

    def other(self, fw: Firewall) -> Firewall:
        return self.firewalls[1 - fw.index]

    def fail_firewall(self, fw: Firewall) -> None:
        """The firewall host dies: every link down first (nothing it sends while dying gets
        out: no VRRP resignation, no last OpenFlow message), then everything on it killed."""
        node = self.node(fw)
        for intf in fw.links:
            self.run(node, "ip", "link", "set", intf, "down")
        self.stop_services(fw, signal.SIGKILL)

    def revive_firewall(self, fw: Firewall, order: Sequence[Service] = ()) -> None:
        """The firewall host comes back: links up, then its services (all at once, or in
        `order`; a service left out of `order` is not started). The controller reads its
        pair state file."""
        node = self.node(fw)
        for intf in fw.links:
            self.run(node, "ip", "link", "set", intf, "up")
        self.start_services([fw], order)

    def defaults_point_to(self, fw: Firewall) -> bool:
        """s1's default flows patch the fast ports to this firewall's slow ports, and no other."""
        want = {(FAST1, fw.slow[0]), (fw.slow[0], FAST1), (FAST2, fw.slow[1]), (fw.slow[1], FAST2)}
        got = {(int(f["in_port"]), int(f["actions"].split("output:")[1].split(",")[0]))
               for f in self.flows() if f.get("cookie") == "0x4e01000000000000" and "output:" in f["actions"]}
        return got == want

    def _program_static_flows(self) -> None:
        """Direct and firewall modes have no controller: their patching is static."""
        if self.controlled:
            return
        pairs = [(FAST1, FAST2)] if self.mode == "direct" else [(FAST1, SLOW1), (FAST2, SLOW2)]
        for a, b in pairs:
            for src, dst in ((a, b), (b, a)):
                self.ofctl("add-flow", f"priority=100,in_port={src},actions=output:{dst}")

    def stop(self) -> None:
        try:
            for fw in self.firewalls:  # keepalived first: no takeover while the pair is taken down
                while fw.daemons:
                    stop_process(fw.daemons.pop(), 5)
            for fw in self.firewalls:
                self.stop_controller(fw=fw)
            while self._procs:
                stop_process(self._procs.pop(), timeout=2)
            while self._delayers:
                stop_process(self._delayers.pop())
            if self._lag_proxy is not None:
                stop_process(self._lag_proxy)
                self._lag_proxy = None
        finally:
            try:
                if self.net is not None:
                    if self.mode != "direct":
                        for fw in self.firewalls:
                            self.nfshunt("iptables", "remove", "--config", fw.config_path, check=False, fw=fw)
                    self.net.stop()
            finally:
                self.net = None
                self._restore_rmem_default()  # a start that failed halfway
                for fw in self.firewalls:
                    subprocess.run(["ip", "link", "del", fw.mgmt_ifs[0]], capture_output=True)
                for bridge in self.bridges:
                    subprocess.run(["ovs-vsctl", "--if-exists", "del-br", bridge], capture_output=True)
                if self._tso_changed:
                    set_userspace_tso(self._tso_before)
                    self._tso_changed = False
                for sig, old in self._old_signals.items():
                    signal.signal(sig, old)
                self._old_signals.clear()
                if self._own_workdir and os.environ.get("NFSHUNT_KEEP_WORKDIR") != "1":
                    shutil.rmtree(self.workdir, ignore_errors=True)
                self._unlock()

    # --- observation ----------------------------------------------------------------------

    def ofctl(self, *args: str, bridge: str = "s1") -> str:
        proto = {"1.0": "OpenFlow10", "1.3": "OpenFlow13"}[self.of_version]
        return subprocess.run(["ovs-ofctl", "-O", proto, *args[:1], bridge, *args[1:]],
                              check=True, capture_output=True, text=True).stdout

    def flows(self, bridge: str = "s1") -> list[dict[str, str]]:
        """A switch's flows as dicts (cookie, priority, match fields, actions, n_packets ...)."""
        out = []
        for line in self.ofctl("dump-flows", bridge=bridge).splitlines():
            line = line.strip()
            if not line.startswith("cookie="):
                continue
            head, _, actions = line.partition(" actions=")
            flow: dict[str, str] = {"actions": actions}
            for part in head.replace(", ", ",").split(","):
                part = part.strip()
                if not part:
                    continue
                key, eq, value = part.partition("=")
                flow[key.strip()] = value if eq else ""
            out.append(flow)
        return out

    def conn_flows(self, port: int, bridge: str = "s1") -> list[dict[str, str]]:
        """The per-connection (shunt or block) flows that involve L4 port `port`."""
        p = str(port)
        return [f for f in self.flows(bridge)
                if int(f.get("cookie", "0"), 16) >> 56 == 0x4E and int(f["cookie"], 16) >> 48 & 0xFF in (2, 3)
                and p in (f.get("tp_src"), f.get("tp_dst"), f.get("tcp_src"), f.get("tcp_dst"),
                          f.get("udp_src"), f.get("udp_dst"))]

    def _defaults_installed(self) -> bool:
        if self.controller is not None and self.controller.poll() is not None:
            raise TestbedError("the controller exited:\n" + self.controller_output()[-3000:])
        cookie = "0x4e01000000000000"
        return all(sum(1 for f in self.flows(br) if f.get("cookie") == cookie) == 4 for br in self.bridges)

    def slow_path_packets(self) -> int:
        """Packets the switch has sent towards the firewall bridge (both slow ports)."""
        total = 0
        for port in (SLOW1, SLOW2):
            with open(f"/sys/class/net/s1-eth{port}/statistics/tx_packets") as fh:
                total += int(fh.read())
        return total

    # --- traffic ---------------------------------------------------------------------------

    def iperf_server(self, port: int, interval: float | None = None) -> subprocess.Popen:
        """A one-off iperf3 server on h2 (JSON output), returned once it listens."""
        extra = ["-i", str(interval)] if interval else []
        srv = self.spawn(self.h2, "iperf3", "-s", "-1", "-J", "-p", str(port), *extra)
        try:
            self.wait_for(lambda: srv.poll() is not None or self.listening(self.h2, port), 10,
                          f"iperf3 server on port {port}", interval=0.02)
        except BaseException:
            srv.kill()
            raise
        if srv.poll() is not None:
            raise TestbedError(f"iperf3 server on port {port} exited ({srv.returncode})")
        return srv

    def conn_server(self, port: int, node: Host | None = None) -> subprocess.Popen:
        """conngen.py's echo server for many connections, on h2 (or another host)."""
        srv = self.spawn(node or self.h2, PYTHON, os.path.join(HERE, "conngen.py"), "serve", str(port),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = srv.stdout.readline() if srv.stdout else ""
        if not line.startswith("listening"):
            srv.kill()
            raise TestbedError(f"conngen server did not start: {line}")
        return srv

    def open_conns(self, port: int, n: int, cport_base: int | None = None,
                   dst: str = H2_IP, src: Host | None = None) -> tuple[subprocess.Popen, float]:
        """n connections h1 (or src) -> h2 (or dst) held open by conngen.py; (process, epoch
        when all were up). Write "close" to its stdin to close them cleanly."""
        args = [PYTHON, os.path.join(HERE, "conngen.py"), "open", dst, str(port), str(n)]
        if cport_base:
            args += ["--cport-base", str(cport_base)]
        proc = (src or self.h1).popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=self._env(), cwd=REPO)
        self._procs.append(proc)
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("open "):
            proc.kill()
            err = proc.stderr.read() if proc.stderr else ""
            raise TestbedError(f"conngen could not open {n} connections: {line}{err}")
        return proc, float(line.split()[1])

    def listening(self, node: Host, port: int) -> bool:
        """Whether a TCP socket listens on `port` in the node (its /proc/net/tcp, tcp6)."""
        want = f":{port:04X}"
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in self.run(node, "cat", table, check=False).splitlines()[1:]:
                f = line.split()
                if len(f) > 3 and f[1].endswith(want) and f[3] == "0A":
                    return True
        return False

    def spawn(self, node: Host, *args: str, stdout: Any = subprocess.DEVNULL, stderr: Any = subprocess.DEVNULL,
              ) -> subprocess.Popen:
        """A background process in a node; stop() kills it if it is still running then."""
        proc = node.popen(list(args), stdout=stdout, stderr=stderr, text=True, env=self._env(), cwd=REPO)
        self._procs = [p for p in self._procs if p.poll() is None] + [proc]
        return proc

    def iperf(self, port: int, seconds: float, *, interval: float | None = None, cport: int | None = None,
              udp: bool = False, grace: float = 15, server_output: bool = False,
              watch: Callable[[], Any] | None = None, bitrate: str | None = None) -> dict[str, Any]:
        """An iperf3 transfer h1 -> h2; the parsed JSON, or {"error": ...} (stalled or refused).
        `watch` is called every 0.2 s while it runs (to look at flows before a FIN removes them)."""
        srv = self.iperf_server(port, interval)
        args = ["iperf3", "-c", H2_IP, "-p", str(port), "-t", str(seconds), "-J", "--connect-timeout", "5000"]
        if interval:
            args += ["-i", str(interval)]
        if cport:
            args += ["--cport", str(cport)]
        if udp:
            args += ["-u", "-b", bitrate or "200M"]
        elif bitrate:
            args += ["-b", bitrate]
        if server_output:   # the receiver's intervals: what arrived, not what was written
            args += ["--get-server-output"]
        cli = self.spawn(self.h1, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + seconds + grace
        try:
            while watch is not None and cli.poll() is None and time.monotonic() < deadline:
                watch()
                time.sleep(0.2)
            out, _ = cli.communicate(timeout=max(0.1, deadline - time.monotonic()))
            result = json.loads(out) if out.strip() else {"error": "no output"}
        except subprocess.TimeoutExpired:
            cli.kill()
            cli.communicate()
            result = {"error": "stalled"}
        except json.JSONDecodeError:
            result = {"error": "unreadable iperf3 output"}
        finally:
            srv.kill()
            srv.communicate()
        return result

    def start_transfer(self, port: int, seconds: float, interval: float = 0.2, cport: int | None = None,
                       bitrate: str | None = None) -> tuple[subprocess.Popen, subprocess.Popen]:
        """An iperf3 transfer h1 -> h2 in the background (server, client); the receiver's
        intervals come back with the result (finish_transfer)."""
        srv = self.iperf_server(port, interval)
        args = ["iperf3", "-c", H2_IP, "-p", str(port), "-t", str(seconds), "-J", "-i", str(interval),
                "--get-server-output", "--connect-timeout", "5000"]
        if cport:
            args += ["--cport", str(cport)]
        if bitrate:
            args += ["-b", bitrate]
        return srv, self.spawn(self.h1, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    @staticmethod
    def finish_transfer(srv: subprocess.Popen, cli: subprocess.Popen, timeout: float = 40) -> dict[str, Any]:
        """Wait for a start_transfer(); its JSON, or {"error": ...}."""
        try:
            out, _ = cli.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            cli.kill()
            cli.communicate()
            return {"error": "stalled"}
        finally:
            srv.kill()
            srv.communicate()
        try:
            return json.loads(out) if out.strip() else {"error": "no output"}
        except json.JSONDecodeError:
            return {"error": "unreadable iperf3 output"}

    @staticmethod
    def longest_stall(result: dict[str, Any], interval: float = 0.2) -> float:
        """The longest run of receiver intervals with no data, in seconds."""
        worst = run = 0
        for iv in result["server_output_json"]["intervals"][:-1]:  # the last interval is partial
            run = run + 1 if iv["sum"]["bytes"] == 0 else 0
            worst = max(worst, run)
        return worst * interval

    @staticmethod
    def iperf_summary(result: dict[str, Any]) -> dict[str, float]:
        """Throughput, retransmits and TCP's mean RTT from an iperf3 result."""
        if "error" in result:
            return {"gbps": 0.0, "retransmits": 0, "mean_rtt_ms": float("nan"), "bytes": 0}
        end = result.get("end", {})
        streams = end.get("streams") or [{}]
        sender = streams[0].get("sender", {})
        return {"gbps": end.get("sum_received", {}).get("bits_per_second", 0.0) / 1e9,
                "retransmits": end.get("sum_sent", {}).get("retransmits", 0),
                "mean_rtt_ms": sender.get("mean_rtt", float("nan")) / 1000,
                "bytes": end.get("sum_received", {}).get("bytes", 0)}

    def hop_counters(self) -> dict[str, int]:
        """Packet counters along h1 -> h2 (the data direction) to locate loss, one per hop.

        h1 sends; s1 receives on port 1 and sends either to h2 (port 3, fast) or to the
        firewall (port 2), whose bridge forwards out fw-eth1 back into s1 port 4; h2
        receives, and its delay queue (NFQUEUE or netem) may drop.
        """
        c: dict[str, int] = {}

        def host(node: Host, intf: str) -> None:
            st = json.loads(self.run(node, "ip", "-s", "-j", "link", "show", "dev", intf))[0]["stats64"]
            c[f"{intf}.tx"], c[f"{intf}.rx"] = st["tx"]["packets"], st["rx"]["packets"]
            c[f"{intf}.rx_dropped"] = st["rx"]["dropped"]
            qd = json.loads(self.run(node, "tc", "-s", "-j", "qdisc", "show", "dev", intf) or "[]")
            c[f"{intf}.qdisc_drops"] = sum(q.get("drops", 0) for q in qd if q.get("root") or q.get("parent"))

        def switch(*ports: int) -> None:
            for port in ports:
                for d in ("tx", "rx"):
                    with open(f"/sys/class/net/s1-eth{port}/statistics/{d}_packets") as fh:
                        c[f"s1-eth{port}.{d}"] = int(fh.read())
        # Read against the data's direction, h2 first and h1 last: a packet moving during
        # the reads is then counted before a hop and not after it (in flight), never after
        # it and not before (a negative loss at that hop).
        host(self.h2, "h2-eth0")
        switch(FAST2, SLOW2)
        host(self.fw, "fw-eth1")
        host(self.fw, "fw-eth0")
        switch(SLOW1, FAST1)
        host(self.h1, "h1-eth0")
        for node in (self.h1, self.h2):
            c[f"{node.name}.nfqueue_drops"] = 0
            for line in self.run(node, "cat", "/proc/net/netfilter/nfnetlink_queue", check=False).splitlines():
                f = line.split()
                if len(f) >= 7:
                    c[f"{node.name}.nfqueue_drops"] += int(f[5]) + int(f[6])
        return c

    def settled_hop_counters(self, timeout: float = 3.0) -> dict[str, int]:
        """hop_counters() once the data path is quiet: packets still in flight between the
        reads (a close at 400 ms RTT) would count as lost on one hop and found on another.
        Quiet means two reads 0.25 s apart agree on every counter: a single packet (an ARP
        probe) crossing the switch while its ports are read one after another counts on the
        ports it left by and not on the one it came in by, a negative loss at that hop."""
        last = self.hop_counters()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(0.25)
            now = self.hop_counters()
            if now == last:
                return now
            last = now
        return last

    @staticmethod
    def locate_loss(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
        """Packets of the h1 -> h2 direction lost at each hop between two hop_counters()."""
        d = {k: after[k] - before.get(k, 0) for k in after}
        delivered = d["h2-eth0.rx"] - d["h2.nfqueue_drops"]
        return {
            "sent": d["h1-eth0.tx"],
            "delivered": delivered,
            "lost": d["h1-eth0.tx"] - delivered,
            "host_link": d["h1-eth0.tx"] - d["s1-eth1.rx"],
            "switch": (d["s1-eth1.rx"] + d["s1-eth4.rx"]) - (d["s1-eth2.tx"] + d["s1-eth3.tx"]),
            "firewall": d["fw-eth0.rx"] - d["fw-eth1.tx"],
            "firewall_buffer": d["fw-eth1.qdisc_drops"],
            "receiver_delay_queue": d["h2.nfqueue_drops"],
            "sender_qdisc": d["h1-eth0.qdisc_drops"],
            "slow_path_packets": d["s1-eth2.tx"],
        }

    def conntrack(self, fw: Firewall | None = None) -> list[dict[str, Any]]:
        """A firewall's conntrack table, read over netlink inside its node."""
        out = self.run(self.node(fw or self.firewalls[0]), PYTHON, "-c",
                       "import json,sys; sys.path.insert(0, sys.argv[1]);"
                       "from nfshunt.conntrack import dump_entries;"
                       "print(json.dumps([dict(id=e.ct_id, mark=e.mark, state=e.tcp_state, proto=e.orig.proto,"
                       " src=e.orig.src, dst=e.orig.dst, sport=e.orig.sport, dport=e.orig.dport)"
                       " for e in dump_entries()]))", REPO)
        return json.loads(out)

    @staticmethod
    def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TestbedError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(interval)

    def controller_output(self, fw: Firewall | None = None, since_start: bool = False) -> str:
        """The controller's log; since_start: only the running controller's."""
        fw = fw or self.firewalls[0]
        try:
            with open(fw.controller_log, "rb") as fh:
                if since_start:
                    fh.seek(fw.log_start)
                return fh.read().decode(errors="replace")
        except OSError:
            return ""
