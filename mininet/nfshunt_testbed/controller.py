"""The testbed's controllers: each firewall's config and iptables plumbing, its controller
process and control socket, and what the switch connects to (a controller each, or the
OpenFlow lag proxy in front of the first)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
from typing import Any

from mininet.node import RemoteController

from .linkemu import stop_process
from .topology import (
    FAST1,
    FAST2,
    HERE,
    MGMT_FW,
    OF_PORT,
    PYTHON,
    REPO,
    S1_DPID,
    S2_DPID,
    SLOW1,
    SLOW2,
    VLAN_TRUNKS,
    VLAN_ZONES,
    Firewall,
    TestbedError,
    Topology,
    sub_intf,
)

LAG_PROXY_PORT = 6654  # oflag.py, on the root namespace's loopback, when the switch emulates hardware lag
# A strict firewall: what conntrack calls INVALID is dropped (a packet of a connection it
# does not track, an ACK outside the window it knows).
STRICT_RULE = ("FORWARD", "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP")


class Controllers(Topology):
    extra_config: dict[str, Any]
    policy: str | None
    config_path: str  # the first firewall's
    controller_log: str  # the first firewall's
    # Hardware-like barrier lag (oflag.py between s1 and the first firewall's controller).
    switch_lag_ms: float | None
    switch_reorder: bool
    late_barriers: bool  # the lag on the switch's barrier replies instead (flows forward before they are confirmed)
    _lag_proxy: subprocess.Popen | None

    # --- config ---------------------------------------------------------------------------

    def nfshunt_config(self, fw: Firewall | None = None) -> dict[str, Any]:
        fw = fw or self.firewalls[0]
        eth0, eth1 = fw.intfs[:2]
        ports = [{"fast": FAST1, "slow": fw.slow[0], "physdevin": 1, "bridge_port": eth0},
                 {"fast": FAST2, "slow": fw.slow[1], "physdevin": 2, "bridge_port": eth1}]
        groups: dict[str, Any] = {"ports": ports}
        if self.routed and self.vlan:  # the router's sub-interfaces on trunks
            groups = {"forwarding": "routed", "ports": self._routed_vlan_groups(fw)}
        elif self.routed:  # the router's interfaces, not bridge ports
            ports = [{"fast": g["fast"], "slow": g["slow"], "physdevin": g["physdevin"], "interface": g["bridge_port"]}
                     for g in ports]
            groups = {"ports": ports, "forwarding": "routed"}
        elif self.vlan:
            groups = {"ports": self._vlan_groups(fw)}
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

    @staticmethod
    def _vlan_groups(fw: Firewall) -> list[dict[str, Any]]:
        """Mode "vlan": each side's trunk carries its VLANs; a VLAN whose id is not its
        zone (301) names its zone and sub-interface. The trunks carry no untagged frames."""
        groups = []
        for side, (fast, slow) in enumerate(((FAST1, fw.slow[0]), (FAST2, fw.slow[1]))):
            vlans: list[Any] = [vid if vid == zone else
                                {"id": vid, "zone": zone, "bridge_port": sub_intf(side, vid, fw.name)}
                                for vid, zone in zip(VLAN_TRUNKS[side], VLAN_ZONES[side], strict=True)]
            groups.append({"fast": fast, "slow": slow, "physdevin": side + 1, "bridge_port": f"{fw.name}-eth{side}",
                           "vlans": vlans})
        return groups

    def _routed_vlan_groups(self, fw: Firewall) -> list[dict[str, Any]]:
        """Mode "routed" with vlan=True: each side's trunk (tagged only) carries its hosts' VLANs,
        each named by the router's sub-interface that is its hosts' gateway, with a number of
        its own in the mark (3, 4, 5: past the groups' 1 and 2); no group-level interface."""
        groups = []
        for side, (fast, slow) in enumerate(((FAST1, fw.slow[0]), (FAST2, fw.slow[1]))):
            vlans = [{"id": h.vid, "physdevin": h.physdevin, "interface": sub_intf(side, h.vid, fw.name)}
                     for h in self.vlan_hosts if h.side == side]
            groups.append({"fast": fast, "slow": slow, "physdevin": side + 1, "untagged": False, "vlans": vlans})
        return groups

    def _write_config(self, fw: Firewall) -> None:
        with open(fw.config_path, "w") as fh:
            json.dump(self.nfshunt_config(fw), fh, indent=2)

    def _apply_plumbing(self, fw: Firewall) -> None:
        """The firewall's iptables plumbing and policy, as `nfshunt iptables apply` installs them."""
        if self.mode != "direct":
            args = ["iptables", "apply", "--config", fw.config_path]
            if self.policy:
                args += ["--policy", self.policy]
            self.nfshunt(*args, fw=fw)

    def strict_firewalls(self, loose_pickup: bool = False) -> None:
        """Every firewall strict: INVALID dropped, and (unless loose_pickup) no loose pickup
        (a TCP connection the firewall does not track is not picked up mid-stream). Routed:
        dropped on INPUT from the routed interfaces too and for IPv6 as well
        (docs/design/routed.md section 6): a router's own stack answers an untranslated
        INVALID packet addressed to it with a reset (F16), and it routes IPv6 through the
        same policy."""
        for fw in self.firewalls:
            node = self.node(fw)
            for tool, rule in self.strict_rules(fw):
                self.run(node, tool, "-w", "5", "-I", *rule)
            if not loose_pickup:
                self.run(node, "sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_loose=0")

    def strict_rules(self, fw: Firewall) -> list[tuple[str, tuple[str, ...]]]:
        """(tool, rule) strict_firewalls inserts: FORWARD's for IPv4; a router's INPUT's from
        its routed interfaces, and IPv6's too. Not INPUT from every interface: a pair's backup
        shortens every conntrack entry's timer when it steps down (conntrackd -t: they expire
        5 s later), its controller's OpenFlow connection's too, and without loose pickup that
        connection's next segments are INVALID: dropped on INPUT, the backup lost the switch
        about 6 s after every election (7 of 7 runs of the routed pair with transfers and a
        capture, 2 of 7 without; 0 of 7 with this rule)."""
        if not self.routed:
            return [("iptables", STRICT_RULE)]
        return [(tool, rule) for tool in ("iptables", "ip6tables")
                for rule in (STRICT_RULE, *(("INPUT", "-i", intf, *STRICT_RULE[1:]) for intf in fw.intfs))]

    # --- what the switch connects to ------------------------------------------------------

    def _switch_controllers(self) -> Any:
        """Mininet's controller argument: none, or every firewall's controller (Open vSwitch
        connects to each); the first through the lag proxy, started here, when asked for."""
        if not self.controlled:
            return None
        controller = [lambda name, ip=f.mgmt_fw: RemoteController(name, ip=ip, port=OF_PORT)
                      for f in self.firewalls]
        if self.switch_lag_ms is not None:
            self._start_lag_proxy()
            controller[0] = lambda name: RemoteController(name, ip="127.0.0.1", port=LAG_PROXY_PORT)
        return controller

    def _start_lag_proxy(self) -> None:
        args = [PYTHON, os.path.join(HERE, "oflag.py"), "127.0.0.1", str(LAG_PROXY_PORT), MGMT_FW, str(OF_PORT),
                "--lag", str(self.switch_lag_ms)]
        if self.switch_reorder:
            args.append("--reorder")
        if self.late_barriers:
            args.append("--late-barriers")
        proxy = self._lag_proxy = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = proxy.stdout.readline() if proxy.stdout else ""
        if not line.startswith("listening"):
            err = proxy.stderr.read() if proxy.stderr and proxy.poll() is not None else ""
            raise TestbedError(f"the OpenFlow lag proxy did not start: {line}{err}")
        if self.late_barriers:
            self.log(f"the switch's barrier replies reach the controller {self.switch_lag_ms:g} ms late (oflag.py)")
        else:
            self.log(f"switch emulates hardware: barriers answered at once, flow-mods applied {self.switch_lag_ms:g} "
                     f"ms later{' and reordered' if self.switch_reorder else ''} (oflag.py)")

    def _stop_lag_proxy(self) -> None:
        if self._lag_proxy is not None:
            stop_process(self._lag_proxy)
            self._lag_proxy = None

    # --- the controller process -------------------------------------------------------------

    @property
    def controller(self) -> subprocess.Popen | None:
        """The first firewall's controller (the only one outside mode "ha")."""
        return self.firewalls[0].controller

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

    def reconfigure(self, wait: bool = True, fw: Firewall | None = None, **overrides: Any) -> None:
        """Restart a firewall's controller (the first's by default) with config keys changed
        (None: back to the default); wait=False: do not wait for it to have the switch."""
        fw = fw or self.firewalls[0]
        self._override(overrides)
        self.stop_controller(fw=fw)
        self._write_config(fw)
        self._start_controller(fw)
        if wait:
            self.wait_for_controller(fw=fw)

    def _override(self, overrides: dict[str, Any]) -> None:
        """The config's keys changed for the next write (None: back to the default)."""
        for key, value in overrides.items():
            if value is None:
                self.extra_config.pop(key, None)
            else:
                self.extra_config[key] = value

    def reload_config(self, **overrides: Any) -> None:
        """Change keys the running controller takes from a reload (nfshunt.config.reload.LIVE; None:
        back to the default) without a restart, which costs a test about 2 s. New pairs get
        the new values; a key that would need a restart fails here instead of being ignored."""
        self._override(overrides)
        self._write_config(self.firewalls[0])
        reply = self.control({"cmd": "reload"})
        if not reply.get("ok") or reply.get("kept"):
            raise TestbedError(f"the reload did not take the config as it is: {reply}")

    def _check_running(self, fw: Firewall) -> None:
        """A controller that was started and has exited fails the wait for it at once."""
        if fw.controller is not None and fw.controller.poll() is not None:
            raise TestbedError(f"{fw.name}'s controller exited:\n" + self.controller_output(fw)[-3000:])

    def wait_for_controller(self, timeout: float = 20, fw: Firewall | None = None) -> None:
        """The controller answers on its control socket and has the switch, reconciled (its
        table read back: connections started before are judged again at their next packet,
        a test's transfer started then could wait seconds for its shunt). A pair's
        controller only connected: a backup never reconciles."""
        fw = fw or self.firewalls[0]

        def ready() -> bool:
            self._check_running(fw)
            try:
                st = self.control({"cmd": "status", "connections": False}, fw=fw)
            except Exception:
                return False
            return bool(st["switch"]["connected"] and (st["switch"]["reconciled"] or st["pair"] is not None))
        self.wait_for(ready, timeout, f"{fw.name}'s controller to answer with the switch connected and reconciled")

    def control(self, payload: dict[str, Any], timeout: float = 10, fw: Firewall | None = None) -> dict[str, Any]:
        """One request on a controller's control socket (a path: reachable from any netns)."""
        from nfshunt.app.control import NotRunning, request
        fw = fw or self.firewalls[0]
        try:
            return request(fw.control_socket, payload, timeout)
        except NotRunning as exc:  # say how it ended: a test's failure should not need a re-run
            proc = fw.controller
            ended = "not started by the testbed" if proc is None else (
                "still running" if proc.poll() is None else f"exited with status {proc.returncode}")
            raise NotRunning(f"{exc}; {fw.name}'s controller process: {ended}") from None

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
