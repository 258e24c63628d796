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
  vlan      trunks (issue 37, docs/vlans.md): s1's ports carry VLANs 100, 200 and 30 (301
            outside); h1/h2 (VLAN 100) and h3/h4 (VLAN 200) have the same addresses, h5/h6
            are VLAN 30 inside and 301 outside. Open vSwitch stand-ins (this kernel has no
            802.1Q) play the hosts' trunk switches (v1, v2) and the firewall's NICs with
            their sub-interfaces (vf0, vf1: fw-eth0.100 ... fw-eth1.301, veths in fw); fw
            bridges each VLAN in its own bridge (br100, br200, br30) and conntrack zone.
            With mode ha, Testbed(vlan=True): the pair, both firewalls on these trunks
            (fw2's NICs vf2, vf3 on slow ports 5, 6: fw2-eth0.100 ...).
  routed    fw routes between h1's 10.0.1.0/24 and h2's 10.0.2.0/24 (and fd01::/64,
            fd02::/64), the hosts' gateway (docs/routed.md); nat="masquerade" (or "snat": to
            h2's gateway) translates h1's subnet. With mode ha, Testbed(routed=True): a pair of
            routing firewalls, each with addresses of its own (.252, .253), keepalived holding
            the gateways (.254) on the active one (config/ha/keepalived-routed.conf); nat="snat".
            With vlan=True (docs/design/routed.md section 9; no NAT; with mode ha a pair, each
            firewall's own addresses .252/.253 on every sub-interface): the routing
            firewall on mode vlan's stand-in trunks, each host a VLAN and a subnet of its own:
            h1 on FAST1's trunk in VLAN 100 (10.0.1.1, fd01::1), h2 on FAST2's in VLAN 200
            (10.0.2.1), h3 on FAST1's in VLAN 300 (10.0.3.1, fd03::1); their gateways (.254,
            ::fe) the sub-interfaces fw-eth0.100, fw-eth1.200 and fw-eth0.300. h1 <-> h3 is a
            router on a stick: two VLANs of one trunk, in and out of slow port 2.

The switch uses the kernel datapath when the kernel has it, otherwise the userspace
(netdev) datapath; `datapath` says which. An `Emulation` (linkemu.py) adds delay (netem or
the NFQUEUE fallback; `delay_mechanism` says which, `rtt_measured` what ping saw before the
run), link rates and a rate- and buffer-limited slow path. Integration tests, the demo, experiments and
benchmarks all build their network here. Everything is removed by stop(), also after a
failure, and on SIGTERM/SIGINT through the context manager.

Testbed is one object; its jobs are in their own modules: topology (names, nodes,
links, link emulation: the base the others read), controller (each firewall's
config and plumbing, its controller process, the lag proxy), pair (conntrackd and
keepalived beside the controller), observe (flows, hop counters, conntrack),
traffic (iperf3, conngen) and machine (Open vSwitch, the testbed lock, the
machine-wide settings a testbed changes and puts back). This module starts and stops them.
"""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
from typing import Any, Callable

from mininet.log import setLogLevel

from .controller import STRICT_RULE
from .linkemu import Emulation
from .machine import (
    RMEM_DEFAULT,
    SWITCH_RX_BUFFER,
    UNINTERRUPTIBLE,
    MachineSettings,
    clear_leftovers,
    ensure_ovs,
    kernel_datapath_available,
    machine_info,
    userspace_tso_enabled,
    userspace_tso_setting,
)
from .observe import Observation
from .pair import Pair, Service
from .topology import (
    BLOCK_PORT,
    FAST1,
    FAST2,
    H1_IP,
    H2_IP,
    H2_IP6,
    H4_IP,
    HERE,
    IGNORE_PORT,
    MGMT_FW,
    MGMT_FW2,
    MGMT_OTHER,
    MGMT_ROOT,
    MGMT_ROOT2,
    MODES,
    OF_PORT,
    POLICY,
    PYTHON,
    REPO,
    ROUTED_VLAN_HOSTS,
    SHUNT_PORT,
    SLOW1,
    SLOW1_B,
    SLOW2,
    SLOW2_B,
    VLAN_HOSTS,
    Firewall,
    TestbedError,
    sub_intfs,
)
from .traffic import STEADY_RATE, Traffic

# The names tests, the demo, experiments and benchmarks import from here; the rest are in
# their job's module.
__all__ = ["BLOCK_PORT", "FAST1", "FAST2", "H1_IP", "H2_IP", "H2_IP6", "H4_IP", "HERE", "IGNORE_PORT", "MGMT_FW",
           "MGMT_OTHER", "MGMT_ROOT", "OF_PORT", "POLICY", "PYTHON", "REPO", "RMEM_DEFAULT", "SHUNT_PORT",
           "STEADY_RATE", "STRICT_RULE", "SWITCH_RX_BUFFER", "Service", "Testbed", "TestbedError", "VLAN_HOSTS",
           "machine_info",
           "userspace_tso_enabled", "userspace_tso_setting"]


class Testbed(Pair, Observation, Traffic):
    """The one testbed: its jobs' classes (the topology they share, the controllers and the
    pair, observation, traffic) over one state, started and stopped here."""

    def __init__(self, mode: str = "nfshunt", of_version: str = "1.3",
                 config: dict[str, Any] | None = None, policy: str | None = POLICY,
                 workdir: str | None = None, log: Callable[[str], None] | None = None,
                 emulation: Emulation | None = None, switch_lag_ms: float | None = None,
                 switch_reorder: bool = False, host_offload: bool = False, userspace_tso: bool = False,
                 vrrp_gateway: bool = False, late_barriers: bool = False, nat: str | None = None,
                 pcp_stream: tuple[int, int] | None = None, vlan: bool = False, routed: bool = False):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        if routed and mode != "ha":
            raise ValueError("routed=True is for mode ha (a routing firewall alone is mode routed)")
        self.routed = mode == "routed" or routed  # the firewalls route; with mode ha: a routed pair
        if nat not in (None, "masquerade", "snat") or (nat is not None and not self.routed):
            raise ValueError("nat: \"masquerade\" or \"snat\" (to the gateway's address), with routing firewalls")
        if nat is not None and vlan:
            raise ValueError("nat is not built for the routing firewall on VLAN trunks (mode routed, vlan=True): "
                             "leave nat out, or vlan")
        if nat == "masquerade" and mode == "ha":
            raise ValueError("a pair translates to the gateway (nat=\"snat\"): masquerade takes each host's own "
                             "address, which a takeover would change under the connection")
        self.nat = nat  # routed: the firewall translates h1's subnet towards h2's (masquerade, or snat to the gateway)
        self.mode = mode
        if vlan and mode not in ("vlan", "ha", "routed"):
            raise ValueError("vlan=True is for mode ha or routed (mode vlan has trunks anyway)")
        # trunks; with mode ha: both firewalls' (docs/vlans.md); with mode routed: the router's
        # sub-interfaces, a VLAN and a subnet each host (ROUTED_VLAN_HOSTS)
        self.vlan = mode == "vlan" or vlan
        self.vrrp_gateway = vrrp_gateway  # mode "ha": keepalived gets a second instance, not NFShunt's
        # mode "vlan": (UDP port, PCP): the hosts' access switches tag that port's datagrams with the
        # PCP, as an industrial device marks its engineered stream (every other frame gets PCP 0)
        self.pcp_stream = pcp_stream
        self.of_version = of_version
        self.extra_config = config or {}
        self.policy = policy
        self.log = log or (lambda msg: None)
        self._own_workdir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="nfshunt-testbed-")
        self.net = None
        self.datapath = "system" if kernel_datapath_available() else "netdev"
        trunk_hosts = ROUTED_VLAN_HOSTS if self.routed else VLAN_HOSTS
        self.firewalls = [Firewall("fw", (SLOW1, SLOW2), MGMT_ROOT, MGMT_FW, ("nfsmgmt0", "nfsmgmt1"), self.workdir,
                                   bridge_ports=4 if mode == "two-switch" else 2,
                                   sub_intfs=sub_intfs("fw", trunk_hosts) if self.vlan else ())]
        self.bridges = ("s1", "s2") if mode == "two-switch" else ("s1",)
        if mode == "ha":
            self.firewalls.append(Firewall("fw2", (SLOW1_B, SLOW2_B), MGMT_ROOT2, MGMT_FW2, ("nfsmgmt2", "nfsmgmt3"),
                                           os.path.join(self.workdir, "fw2"), index=1,
                                           sub_intfs=sub_intfs("fw2", trunk_hosts) if self.vlan else ()))
        self.config_path = self.firewalls[0].config_path
        self.controller_log = self.firewalls[0].controller_log
        self._old_signals: dict[int, Any] = {}
        self.emulation = emulation or Emulation()
        self.delay_mechanism = "none"
        self.rtt_measured = None
        self._delayers = []
        self._procs = []
        self.switch_lag_ms = switch_lag_ms
        self.switch_reorder = switch_reorder
        self.late_barriers = late_barriers
        self._lag_proxy = None
        self._machine = MachineSettings(self.log)
        # The hosts' TSO and checksum offload (Linux's defaults) need Open vSwitch's
        # userspace TSO support on; off by default, whatever the machine's setting, so packet
        # sizes are the MTU's. userspace_tso: Open vSwitch runs with it on (as a machine
        # carrying real traffic may), the hosts offloading or not. Open vSwitch reads the
        # setting once, so it is restarted to change it, and put back on stop.
        self.host_offload = host_offload
        self.userspace_tso = userspace_tso or host_offload

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
        if not UNINTERRUPTIBLE.defer(signum):  # an Open vSwitch restart finishes first
            raise KeyboardInterrupt(f"signal {signum}")

    def start(self) -> None:
        self._machine.lock()
        ensure_ovs()
        clear_leftovers(self.log)
        if self.userspace_tso and self.datapath == "netdev":
            self._machine.enable_userspace_tso()
        setLogLevel("error")
        self.net = self._build_net(self._switch_controllers())
        self.log(f"building testbed: mode={self.mode}, OpenFlow {self.of_version}, "
                 f"Open vSwitch datapath={self.datapath}")
        if self.datapath == "netdev":
            self._machine.raise_switch_rx_buffer()
        self.net.build()
        self._quiet_switch_ports()
        self._setup_hosts()
        for fw in self.firewalls:
            os.makedirs(fw.workdir, exist_ok=True)
            if self.vlan and not self.routed:
                self._setup_vlan_bridges(fw)
            else:
                self._setup_bridge(fw)  # (routed, on trunks too: the router, _setup_router)
            self._write_config(fw)
            self._apply_plumbing(fw)
            if self.controlled:
                self._setup_mgmt(fw)
                if self.mode != "ha":  # a pair's controllers start with its other services
                    self._start_controller(fw)
        if self.mode == "ha":
            self._setup_pair_links()
        elif self.controlled:
            self._wait_for_listener()
        self.net.start()
        self._machine.restore_rmem_default()  # ovs-vsctl waited for vswitchd to open every port
        self._program_stand_ins()
        self._program_static_flows()
        self._wait_for_control()
        self._setup_emulation()

    def _wait_for_listener(self) -> None:
        """The controller listens before the switch starts: a switch that finds no listener
        tries again only after a second (Open vSwitch's backoff), which cost every testbed
        about half a second over the controller's own start."""
        fw = self.firewalls[0]

        def listening() -> bool:
            self._check_running(fw)
            return self.listening(self.node(fw), OF_PORT)
        self.wait_for(listening, 20, "controller to listen for the switch", interval=0.02)

    def _wait_for_control(self) -> None:
        """The controllers have the switch and installed its default flows."""
        if self.mode == "ha":
            # Both hosts' services, each up before the next: the controllers have the switch
            # before keepalived elects (the first firewall, by its priority), as when the pair
            # boots with nfshunt ordered first; tests try the other orders too.
            self.start_services(self.firewalls, (Service.CONTROLLER, Service.CONNTRACKD, Service.KEEPALIVED))
            self.wait_for_elected(20)
        elif self.controlled:
            def installed() -> bool:
                self._check_running(self.firewalls[0])
                return self._defaults_installed()
            self.wait_for(installed, 20, "controller to install the default flows")

    def stop(self) -> None:
        """Everything removed, each step also after an earlier one failed: processes first
        (keepalived before the controllers: no takeover while the pair is taken down), then
        the network (the firewalls' plumbing with their nodes), then the machine's settings
        and the lock."""
        try:
            self._stop_daemons()
            for fw in self.firewalls:
                self.stop_controller(fw=fw)
            self._stop_processes()
            self._stop_emulation()
            self._stop_lag_proxy()
        finally:
            try:
                if self.net is not None:
                    # The plumbing is in the firewall nodes' namespaces and goes with them
                    # (`nfshunt iptables remove` there first cost a Python start a testbed).
                    self.net.stop()
            finally:
                self.net = None
                self._machine.restore_rmem_default()  # a start that failed halfway
                self._remove_links()
                self._machine.restore_userspace_tso()
                for sig, old in self._old_signals.items():
                    signal.signal(sig, old)
                self._old_signals.clear()
                if self._own_workdir and os.environ.get("NFSHUNT_KEEP_WORKDIR") != "1":
                    shutil.rmtree(self.workdir, ignore_errors=True)
                self._machine.unlock()
