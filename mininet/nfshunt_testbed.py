"""The one NFShunt testbed: hosts, Open vSwitch fast path, firewall node, controller.

            h1 --(1) [ s1: Open vSwitch ] (3)-- h2
                      (2)         (4)
                       |           |
                  fw-eth0  [fw: br0]  fw-eth1       NFShunt controller runs in fw
                      (physdevin 1) (physdevin 2)

Modes from the one topology:
  direct    s1 patches h1 <-> h2, no firewall;
  firewall  s1 patches every fast port to its slow port: everything crosses br0;
  nfshunt   the NFShunt controller in fw programs s1 (fail mode secure).

The switch uses the kernel datapath when the kernel has it, otherwise the userspace
(netdev) datapath; `datapath` says which. An `Emulation` (linkemu.py) adds delay (netem or
the NFQUEUE fallback; `delay_mechanism` says which, `rtt_measured` what ping saw before the
run), link rates and a rate- and buffer-limited slow path. Integration tests, the demo, experiments and
benchmarks all build their network here. Everything is removed by stop(), also after a
failure, and on SIGTERM/SIGINT through the context manager.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

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
MGMT_OTHER = "169.254.66.3"  # free on the control link: a second host there (tests add it)
OF_PORT = 6653
FAST1, SLOW1, FAST2, SLOW2 = 1, 2, 3, 4
SHUNT_PORT, BLOCK_PORT, IGNORE_PORT = 5201, 5202, 5203
MODES = ("direct", "firewall", "nfshunt")


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


def userspace_tso_enabled() -> bool:
    out = subprocess.run(["ovs-vsctl", "--if-exists", "get", "Open_vSwitch", ".", "other_config:userspace-tso-enable"],
                         capture_output=True, text=True).stdout.strip().strip('"')
    return out == "true"


def set_userspace_tso(on: bool) -> None:
    """Turn Open vSwitch's userspace TSO support on or off: it is read when the daemon
    starts, so this restarts Open vSwitch (no testbed may be up)."""
    if userspace_tso_enabled() == on:
        return
    subprocess.run(["ovs-vsctl", "set", "Open_vSwitch", ".", f"other_config:userspace-tso-enable={str(on).lower()}"],
                   check=True, capture_output=True)
    subprocess.run(["/usr/share/openvswitch/scripts/ovs-ctl", "restart", "--system-id=random"], capture_output=True)
    if subprocess.run(["ovs-vsctl", "--timeout=10", "show"], capture_output=True).returncode != 0:
        raise TestbedError("Open vSwitch did not come back after a restart (ovs-ctl restart)")


def kernel_datapath_available() -> bool:
    return os.path.exists("/sys/module/openvswitch")


class TwoHostTopo(Topo):
    def build(self) -> None:  # type: ignore[override]
        h1 = self.addHost("h1", ip=f"{H1_IP}/24")
        h2 = self.addHost("h2", ip=f"{H2_IP}/24")
        fw = self.addHost("fw", ip=None)
        s1 = self.addSwitch("s1", dpid="00000000000000a1")
        self.addLink(h1, s1, port2=FAST1)
        self.addLink(fw, s1, port1=0, port2=SLOW1)
        self.addLink(h2, s1, port2=FAST2)
        self.addLink(fw, s1, port1=1, port2=SLOW2)


class Testbed:
    def __init__(self, mode: str = "nfshunt", of_version: str = "1.3",
                 config: dict[str, Any] | None = None, policy: str | None = POLICY,
                 workdir: str | None = None, log: Callable[[str], None] | None = None,
                 emulation: Emulation | None = None):
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
        self.controller: subprocess.Popen | None = None
        self.datapath = "system" if kernel_datapath_available() else "netdev"
        self.config_path = os.path.join(self.workdir, "nfshunt.json")
        self.controller_log = os.path.join(self.workdir, "controller.log")
        self._old_signals: dict[int, Any] = {}
        self.emulation = emulation or Emulation()
        self.delay_mechanism = "none"
        self.rtt_measured: float | None = None
        self._delayers: list[subprocess.Popen] = []
        self._procs: list[subprocess.Popen] = []

    # --- nodes ----------------------------------------------------------------------------

    @property
    def h1(self) -> Host:
        return self.net.get("h1")  # type: ignore[union-attr]

    @property
    def h2(self) -> Host:
        return self.net.get("h2")  # type: ignore[union-attr]

    @property
    def fw(self) -> Host:
        return self.net.get("fw")  # type: ignore[union-attr]

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

    def nfshunt(self, *args: str, check: bool = True, timeout: float = 30) -> str:
        """Run the nfshunt CLI inside the firewall node."""
        return self.run(self.fw, PYTHON, "-m", "nfshunt", *args, check=check, timeout=timeout)

    # --- config ---------------------------------------------------------------------------

    def nfshunt_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "delete_flows_on_startup": True,
            "delete_flows_on_shutdown": True,
            "default_shunt_timeout": 10,
            "default_block_timeout": 10,
            "default_no_shunting": True,
            "ports": [
                {"fast": FAST1, "slow": SLOW1, "physdevin": 1, "bridge_port": "fw-eth0"},
                {"fast": FAST2, "slow": SLOW2, "physdevin": 2, "bridge_port": "fw-eth1"},
            ],
            "mark_actions": {"0": "ignore", "1": "shunt", "2": "block"},
            "openflow_versions": [self.of_version],
            "listen_address": MGMT_FW,
            "listen_port": OF_PORT,
            "log_level": "DEBUG",
            "control_socket": os.path.join(self.workdir, "control", "nfshunt.sock"),
        }
        cfg.update(self.extra_config)
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

    def start(self) -> None:
        ensure_ovs()
        setLogLevel("error")
        ofproto = {"1.0": "OpenFlow10", "1.3": "OpenFlow13"}[self.of_version]
        controller = None
        if self.mode == "nfshunt":
            controller = lambda name: RemoteController(name, ip=MGMT_FW, port=OF_PORT)  # noqa: E731
        self.net = Mininet(topo=TwoHostTopo(), controller=controller, autoSetMacs=True,
                           switch=lambda name, **kw: OVSSwitch(name, datapath="user" if self.datapath == "netdev"
                                                               else "kernel", failMode="secure",
                                                               protocols=ofproto, **kw),
                           build=False)
        self.log(f"building testbed: mode={self.mode}, OpenFlow {self.of_version}, "
                 f"Open vSwitch datapath={self.datapath}")
        self.net.build()
        # The switch ports' kernel side (root namespace) would send neighbour and multicast
        # listener messages of its own onto the links: traffic no host sent.
        for port in (FAST1, SLOW1, FAST2, SLOW2):
            subprocess.run(["sysctl", "-qw", f"net.ipv6.conf.s1-eth{port}.disable_ipv6=1"], check=False)
        self._setup_hosts()
        self._setup_firewall()
        if self.mode == "nfshunt":
            self._setup_mgmt()
            self._start_controller()
        self.net.start()
        self._program_static_flows()
        if self.mode == "nfshunt":
            self.wait_for(self._defaults_installed, 20, "controller to install the default flows")
        self._setup_emulation()

    def _setup_emulation(self) -> None:
        """Link rates, MTU, host tuning, slow path, delay; then check the RTT before any run."""
        emu = self.emulation
        for port in (FAST1, SLOW1, FAST2, SLOW2):
            subprocess.run(["ovs-vsctl", "set", "interface", f"s1-eth{port}", f"mtu_request={emu.mtu}"],
                           check=True, capture_output=True)
        shape_slow_path(self.run, self.fw, ("fw-eth0", "fw-eth1"), emu)
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
        for host, ip6 in ((self.h1, H1_IP6), (self.h2, H2_IP6)):
            intf = f"{host.name}-eth0"
            self.run(host, "sysctl", "-qw", f"net.ipv6.conf.{intf}.accept_dad=0")
            self.run(host, "ip", "-6", "addr", "add", f"{ip6}/64", "dev", intf, "nodad")
            # The userspace datapath completes checksums of offloaded packets only with its
            # own TSO support on (other_config:userspace-tso-enable, set when Open vSwitch
            # starts); otherwise the hosts must not offload.
            if not userspace_tso_enabled():
                self.run(host, "ethtool", "-K", intf, "tx", "off", check=False)

    def _setup_firewall(self) -> None:
        fw = self.fw
        self.run(fw, "ip", "link", "add", "br0", "type", "bridge")
        # A transparent bridge sends nothing of its own: no addresses, no IPv6 on the bridge
        # or its ports (their neighbour and multicast-listener messages would be counted
        # as traffic leaving the firewall and make the per-hop loss accounting negative).
        # Bridged IPv6 is still forwarded and filtered (bridge-nf-call-ip6tables).
        for intf in ("br0", "fw-eth0", "fw-eth1"):
            self.run(fw, "sysctl", "-qw", f"net.ipv6.conf.{intf}.disable_ipv6=1")
        for intf in ("fw-eth0", "fw-eth1"):
            self.run(fw, "ip", "addr", "flush", "dev", intf)
            self.run(fw, "ip", "link", "set", intf, "master", "br0")
            self.run(fw, "ip", "link", "set", intf, "up")
        self.run(fw, "ip", "link", "set", "br0", "up")
        for name in ("bridge-nf-call-iptables", "bridge-nf-call-ip6tables", "bridge-nf-filter-vlan-tagged"):
            self.run(fw, "sysctl", "-qw", f"net.bridge.{name}=1")
        self.run(fw, "sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_loose=1")
        with open(self.config_path, "w") as fh:
            json.dump(self.nfshunt_config(), fh, indent=2)
        if self.mode != "direct":
            args = ["iptables", "apply", "--config", self.config_path]
            if self.policy:
                args += ["--policy", self.policy]
            self.nfshunt(*args)

    def _setup_mgmt(self) -> None:
        subprocess.run(["ip", "link", "add", "nfsmgmt0", "type", "veth", "peer", "name", "nfsmgmt1"], check=True)
        subprocess.run(["ip", "link", "set", "nfsmgmt1", "netns", str(self.fw.pid)], check=True)
        subprocess.run(["ip", "addr", "add", f"{MGMT_ROOT}/29", "dev", "nfsmgmt0"], check=True)
        subprocess.run(["ip", "link", "set", "nfsmgmt0", "up"], check=True)
        self.run(self.fw, "ip", "addr", "add", f"{MGMT_FW}/29", "dev", "nfsmgmt1")
        self.run(self.fw, "ip", "link", "set", "nfsmgmt1", "up")
        self.run(self.fw, "ip", "link", "set", "lo", "up")

    def _start_controller(self) -> None:
        logf = open(self.controller_log, "ab")
        self.controller = self.fw.popen([PYTHON, "-m", "nfshunt", "run", "--config", self.config_path],
                                        stdout=logf, stderr=subprocess.STDOUT, env=self._env(), cwd=REPO)
        logf.close()

    def stop_controller(self, sig: int = signal.SIGTERM, timeout: float = 10) -> int | None:
        proc, self.controller = self.controller, None
        if proc is None or proc.poll() is not None:
            return proc.returncode if proc else None
        proc.send_signal(sig)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def restart_controller(self) -> None:
        self.stop_controller()
        self._start_controller()

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

    def wait_for_controller(self, timeout: float = 20) -> None:
        """The controller answers on its control socket and has the switch."""
        def ready() -> bool:
            if self.controller is not None and self.controller.poll() is not None:
                raise TestbedError("the controller exited:\n" + self.controller_output()[-3000:])
            try:
                return bool(self.control({"cmd": "status"})["switch"]["connected"])
            except Exception:
                return False
        self.wait_for(ready, timeout, "the controller to answer with the switch connected")

    def control(self, payload: dict[str, Any], timeout: float = 10) -> dict[str, Any]:
        """One request on the controller's control socket (a path: reachable from any netns)."""
        from nfshunt.control import request
        return request(self.nfshunt_config()["control_socket"], payload, timeout)

    def _program_static_flows(self) -> None:
        """Direct and firewall modes have no controller: their patching is static."""
        if self.mode == "nfshunt":
            return
        pairs = [(FAST1, FAST2)] if self.mode == "direct" else [(FAST1, SLOW1), (FAST2, SLOW2)]
        for a, b in pairs:
            for src, dst in ((a, b), (b, a)):
                self.ofctl("add-flow", f"priority=100,in_port={src},actions=output:{dst}")

    def stop(self) -> None:
        try:
            self.stop_controller()
            while self._procs:
                stop_process(self._procs.pop(), timeout=2)
            while self._delayers:
                stop_process(self._delayers.pop())
        finally:
            try:
                if self.net is not None:
                    if self.mode != "direct":
                        self.nfshunt("iptables", "remove", "--config", self.config_path, check=False)
                    self.net.stop()
            finally:
                self.net = None
                subprocess.run(["ip", "link", "del", "nfsmgmt0"], capture_output=True)
                subprocess.run(["ovs-vsctl", "--if-exists", "del-br", "s1"], capture_output=True)
                for sig, old in self._old_signals.items():
                    signal.signal(sig, old)
                self._old_signals.clear()
                if self._own_workdir and os.environ.get("NFSHUNT_KEEP_WORKDIR") != "1":
                    shutil.rmtree(self.workdir, ignore_errors=True)

    # --- observation ----------------------------------------------------------------------

    def ofctl(self, *args: str) -> str:
        proto = {"1.0": "OpenFlow10", "1.3": "OpenFlow13"}[self.of_version]
        return subprocess.run(["ovs-ofctl", "-O", proto, *args[:1], "s1", *args[1:]],
                              check=True, capture_output=True, text=True).stdout

    def flows(self) -> list[dict[str, str]]:
        """s1's flows as dicts (cookie, priority, match fields, actions, n_packets ...)."""
        out = []
        for line in self.ofctl("dump-flows").splitlines():
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

    def conn_flows(self, port: int) -> list[dict[str, str]]:
        """The per-connection (shunt or block) flows that involve L4 port `port`."""
        p = str(port)
        return [f for f in self.flows()
                if int(f.get("cookie", "0"), 16) >> 56 == 0x4E and int(f["cookie"], 16) >> 48 & 0xFF in (2, 3)
                and p in (f.get("tp_src"), f.get("tp_dst"), f.get("tcp_src"), f.get("tcp_dst"),
                          f.get("udp_src"), f.get("udp_dst"))]

    def _defaults_installed(self) -> bool:
        if self.controller is not None and self.controller.poll() is not None:
            raise TestbedError("the controller exited:\n" + self.controller_output()[-3000:])
        cookie = "0x4e01000000000000"
        return sum(1 for f in self.flows() if f.get("cookie") == cookie) == 4

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

    def conn_server(self, port: int) -> subprocess.Popen:
        """conngen.py's echo server for many connections, on h2."""
        srv = self.spawn(self.h2, PYTHON, os.path.join(HERE, "conngen.py"), "serve", str(port),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = srv.stdout.readline() if srv.stdout else ""
        if not line.startswith("listening"):
            srv.kill()
            raise TestbedError(f"conngen server did not start: {line}")
        return srv

    def open_conns(self, port: int, n: int, cport_base: int | None = None,
                   dst: str = H2_IP) -> tuple[subprocess.Popen, float]:
        """n connections h1 -> h2 held open by conngen.py; (process, epoch when all were up).
        Write "close" to its stdin to close them cleanly."""
        args = [PYTHON, os.path.join(HERE, "conngen.py"), "open", dst, str(port), str(n)]
        if cport_base:
            args += ["--cport-base", str(cport_base)]
        proc = self.h1.popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
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
        for node, intf in ((self.h1, "h1-eth0"), (self.h2, "h2-eth0"), (self.fw, "fw-eth0"), (self.fw, "fw-eth1")):
            st = json.loads(self.run(node, "ip", "-s", "-j", "link", "show", "dev", intf))[0]["stats64"]
            c[f"{intf}.tx"], c[f"{intf}.rx"] = st["tx"]["packets"], st["rx"]["packets"]
            c[f"{intf}.rx_dropped"] = st["rx"]["dropped"]
            qd = json.loads(self.run(node, "tc", "-s", "-j", "qdisc", "show", "dev", intf) or "[]")
            c[f"{intf}.qdisc_drops"] = sum(q.get("drops", 0) for q in qd if q.get("root") or q.get("parent"))
        for port in (FAST1, SLOW1, FAST2, SLOW2):
            for d in ("rx", "tx"):
                with open(f"/sys/class/net/s1-eth{port}/statistics/{d}_packets") as fh:
                    c[f"s1-eth{port}.{d}"] = int(fh.read())
        for node in (self.h1, self.h2):
            c[f"{node.name}.nfqueue_drops"] = 0
            for line in self.run(node, "cat", "/proc/net/netfilter/nfnetlink_queue", check=False).splitlines():
                f = line.split()
                if len(f) >= 7:
                    c[f"{node.name}.nfqueue_drops"] += int(f[5]) + int(f[6])
        return c

    def settled_hop_counters(self, timeout: float = 3.0) -> dict[str, int]:
        """hop_counters() once the data path is quiet: packets still in flight between the
        reads (a close at 400 ms RTT) would count as lost on one hop and found on another."""
        last = self.hop_counters()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(0.25)
            now = self.hop_counters()
            if all(now[k] == last[k] for k in ("h1-eth0.tx", "h2-eth0.rx", "fw-eth0.rx", "fw-eth1.tx")):
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

    def conntrack(self) -> list[dict[str, Any]]:
        """The firewall's conntrack table, read over netlink inside fw."""
        out = self.run(self.fw, PYTHON, "-c",
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

    def controller_output(self) -> str:
        try:
            with open(self.controller_log, errors="replace") as fh:
                return fh.read()
        except OSError:
            return ""
