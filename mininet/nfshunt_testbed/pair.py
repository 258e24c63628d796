"""The firewall pair (mode "ha"): each firewall's conntrackd and keepalived, run from the
shipped config/ha examples rendered for the node and started as systemd would start them
beside the controller; which firewall is active, a firewall's death and return, and the
takeover's time line."""
from __future__ import annotations

import contextlib
import enum
import os
import re
import signal
import subprocess
import time
from datetime import datetime
from typing import Sequence

from .controller import Controllers
from .linkemu import stop_process
from .machine import processes_in_netns
from .topology import (
    GATEWAY_VIP,
    REPO,
    ROUTED_GATEWAYS,
    ROUTED_GATEWAYS6,
    SYNC_ADDRS,
    VRRP_ADDRS,
    VRRP_VIP,
    Firewall,
    TestbedError,
    sub_intf,
)

HA_CONFIG = os.path.join(REPO, "config", "ha")
# The environment keepalived gives its notify scripts (and systemd its services).
BARE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
# A second VRRP instance on the same keepalived, as a firewall's gateway address has: fw is its
# master by priority (preempting), until its track file demotes it (demote_gateway).
GATEWAY_INSTANCE = """
track_file GATEWAY_DEMOTE {{
    file "{demote}"
    weight -100                    # 1 in the file: priority 150 - 100, below the other host's 100
    init_file 0 overwrite
}}

vrrp_instance GATEWAY {{
    state BACKUP
    interface {intf}
    dont_track_primary
    virtual_router_id 62
    priority {priority}
    advert_int 0.1
    unicast_src_ip {me}
    unicast_peer {{
        {peer}
    }}
    virtual_ipaddress {{
        {vip}/24 dev {intf}
    }}
    track_file {{
        GATEWAY_DEMOTE
    }}
}}
"""


class Service(enum.Enum):
    """A firewall pair host's services, in the order `systemctl enable --now` names them."""
    CONNTRACKD = "conntrackd"
    KEEPALIVED = "keepalived"
    CONTROLLER = "nfshunt"


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


class Pair(Controllers):
    """A pair host's services: conntrackd and keepalived (kept on the Firewall records)
    beside its controller. vrrp_gateway: keepalived has a second instance (GATEWAY), not
    NFShunt's."""
    vrrp_gateway: bool

    # --- config -----------------------------------------------------------------------------

    @staticmethod
    def _notify_wrapper(fw: Firewall, script: str) -> str:
        """A shipped notify script (nfshunt-notify-fifo, nfshunt-notify) run as keepalived
        runs it (same arguments, keepalived's bare environment); only its stderr, a
        time-stamped line a step, is kept (keepalived discards it) for the takeover's time line."""
        path = os.path.join(fw.workdir, script)
        # Written aside and renamed over: keepalived may be starting the old one this moment
        # (a services restart), and a file being exec'd cannot be opened for writing (ETXTBSY).
        # The installed `nfshunt` (on keepalived's PATH) runs this checkout's code: the one under test.
        with open(f"{path}.new", "w") as fh:
            fh.write(f'#!/bin/sh\nexport PYTHONPATH={REPO}\n'
                     f'exec {os.path.join(HA_CONFIG, script)} "$@" 2>>{fw.workdir}/notify.log\n')
        os.chmod(f"{path}.new", 0o755)
        os.replace(f"{path}.new", path)
        return path

    def _gateways(self, fw: Firewall) -> list[tuple[str, str, str]]:
        """(interface, IPv4, IPv6) of each gateway keepalived holds on a routed pair's host: on
        fw-eth0 and fw-eth1, or (trunks) on each VLAN's sub-interface, h1's and h2's first."""
        if self.vlan:
            return [(sub_intf(h.side, h.vid, fw.name), str(h.gateway), str(h.gateway6)) for h in self.vlan_hosts]
        return [(f"{fw.name}-eth{side}", ROUTED_GATEWAYS[side], ROUTED_GATEWAYS6[side]) for side in (0, 1)]

    def render_pair_config(self, fw: Firewall) -> dict[str, str]:
        """The shipped config/ha examples with this node's interfaces, addresses and paths:
        what the testbed runs is what an admin starts from (a routed pair's keepalived:
        keepalived-routed.conf, the gateways on its lan0 and lan1). Returns the written paths."""
        me, peer = fw.index, 1 - fw.index
        lans = self._gateways(fw)
        subst = {
            "lan0": lans[0][0], "lan1": lans[1][0],
            "nfshunt-fw-a": f"nfshunt-{fw.name}",
            "vrrp0": f"{fw.name}-eth3", "sync0": f"{fw.name}-eth2",
            "192.0.2.1": VRRP_ADDRS[me], "192.0.2.2": VRRP_ADDRS[peer], "192.0.2.100": VRRP_VIP,
            "198.51.100.1": SYNC_ADDRS[me], "198.51.100.2": SYNC_ADDRS[peer],
            "priority 150": f"priority {150 if me == 0 else 100}",
            "/usr/local/sbin/nfshunt-notify-fifo": self._notify_wrapper(fw, "nfshunt-notify-fifo"),
            "/usr/local/sbin/nfshunt-notify": self._notify_wrapper(fw, "nfshunt-notify"),
            "/run/nfshunt-keepalived.fifo": os.path.join(fw.workdir, "keepalived.fifo"),
            "/etc/conntrackd/conntrackd.conf": os.path.join(fw.workdir, "conntrackd.conf"),
            "/etc/nfshunt/nfshunt.json": fw.config_path,
            "/var/log/conntrackd.log": os.path.join(fw.workdir, "conntrackd.log"),
            "/var/lock/conntrackd.lock": os.path.join(fw.workdir, "conntrackd.lock"),
            "/var/run/conntrackd.ctl": os.path.join(fw.workdir, "conntrackd.ctl"),
        }
        pattern = re.compile("|".join(re.escape(k) for k in sorted(subst, key=len, reverse=True)))
        out = {}
        for name in ("keepalived.conf", "conntrackd.conf"):
            shipped = "keepalived-routed.conf" if name == "keepalived.conf" and self.routed else name
            with open(os.path.join(HA_CONFIG, shipped)) as fh:
                text = pattern.sub(lambda m: subst[m.group(0)], fh.read())
            for lan, gateway, gateway6 in lans[2:] if name == "keepalived.conf" else ():  # (a third VLAN's)
                text = text.replace(f"{ROUTED_GATEWAYS[1]}/24 dev {lans[1][0]}",
                                    f"{ROUTED_GATEWAYS[1]}/24 dev {lans[1][0]}\n        {gateway}/24 dev {lan}")
                text = text.replace(f"{ROUTED_GATEWAYS6[1]}/64 dev {lans[1][0]}",
                                    f"{ROUTED_GATEWAYS6[1]}/64 dev {lans[1][0]}\n        {gateway6}/64 dev {lan}")
            if name == "keepalived.conf" and self.vrrp_gateway:
                text += GATEWAY_INSTANCE.format(demote=os.path.join(fw.workdir, "gateway-demote"),
                                                intf=f"{fw.name}-eth3", priority=150 if me == 0 else 100,
                                                me=VRRP_ADDRS[me], peer=VRRP_ADDRS[peer], vip=GATEWAY_VIP)
            out[name] = os.path.join(fw.workdir, name)
            with open(out[name], "w") as fh:
                fh.write(text)
        return out

    # --- the services -----------------------------------------------------------------------

    def start_services(self, firewalls: Sequence[Firewall], order: Sequence[Service] = ()) -> None:
        """Start a pair's three services on each firewall, as `systemctl enable --now`
        would: all at once (no order), or one after the other in `order`, each started
        before the next without waiting for it to be ready."""
        for fw in firewalls:
            for stale in ("conntrackd.lock", "conntrackd.ctl", "keepalived.pid", "vrrp.pid", "keepalived.fifo"):
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
            self._check_running(fw)
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
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        while fw.daemons:
            stop_process(fw.daemons.pop(), 5, sig)
        # A killed keepalived leaves its VRRP address behind (a routed pair's gateways too); a
        # host that died has none.
        node = self.node(fw)
        self.run(node, "ip", "addr", "del", f"{VRRP_VIP}/24", "dev", f"{fw.name}-eth3", check=False)
        if self.routed:
            for lan, gateway, gateway6 in self._gateways(fw):
                for address in (f"{gateway}/24", f"{gateway6}/64"):
                    self.run(node, "ip", "addr", "del", address, "dev", lan, check=False)
        self.stop_controller(sig, fw=fw)

    def _signal_all(self, node, sig: int) -> None:
        """`sig` to every process on the node but its shell, again until no new one appears
        (one forked while the list was read would be missed)."""
        netns = os.stat(f"/proc/{node.pid}/ns/net").st_ino
        done = {node.pid}
        for _ in range(100):
            new = [pid for pid in processes_in_netns(netns) if pid not in done]
            if not new:
                return
            for pid in new:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            done.update(new)
        raise TestbedError(f"processes kept appearing on {node.name} while signalling them")

    def _stop_daemons(self) -> None:
        """Every firewall's keepalived and conntrackd (on stop: keepalived first, so no
        takeover while the pair is taken down)."""
        for fw in self.firewalls:
            while fw.daemons:
                stop_process(fw.daemons.pop(), 5)

    def demote_gateway(self, fw: Firewall, demoted: bool = True) -> None:
        """fw's GATEWAY instance (vrrp_gateway) loses its priority (the other host preempts:
        fw's GATEWAY goes BACKUP), or gets it back. keepalived watches the file."""
        with open(os.path.join(fw.workdir, "gateway-demote.new"), "w") as fh:
            fh.write("1\n" if demoted else "0\n")
        os.replace(os.path.join(fw.workdir, "gateway-demote.new"), os.path.join(fw.workdir, "gateway-demote"))

    # --- which firewall, a death and a return -------------------------------------------------

    def wait_for_elected(self, timeout: float, hold: float = 1.5) -> tuple[Firewall, float]:
        """The firewall keepalived made master holds the switch (the default flows point to it)
        and has held it for `hold` s: keepalived can make both hosts master for a moment at
        boot, and the one that yields may claim the switch after the other did (its notify
        runs late), so a single look can fall into that moment. Held by its running
        controller: the flows a killed one left point to the same host, and a boot that
        reads them is done before the new controller has the switch (or its control
        socket). (fw, seconds from the call until it first held it for good)."""
        start = time.monotonic()
        since: tuple[Firewall, float] | None = None

        def settled() -> tuple[Firewall, float] | None:
            nonlocal since
            active = self.active_firewall()
            now = time.monotonic()
            if active is None or not self.claimed(active) or not self.defaults_point_to(active):
                since = None
            elif since is None or since[0] is not active:
                since = (active, now)
            return (since[0], since[1] - start) if since is not None and now - since[1] >= hold else None
        return self.wait_for(settled, timeout + hold, f"the firewall keepalived made master to hold the switch "
                             f"for {hold:g} s", interval=0.05)

    def claimed(self, fw: Firewall) -> bool:
        """fw's running controller has made itself the switch's master and not stood down
        since (read from its log: asking it would change what the test observes)."""
        out = self.controller_output(fw, since_start=True)
        return out.rfind(": programming it (") > out.rfind("no longer master of switch")

    def active_firewall(self) -> Firewall | None:
        """The firewall keepalived made master (it holds the VRRP address); None: none or
        both (a split brain)."""
        masters = [fw for fw in self.firewalls
                   if VRRP_VIP + "/" in self.run(self.node(fw), "ip", "-4", "-o", "addr", "show", "dev",
                                                  f"{fw.name}-eth3", check=False)]
        return masters[0] if len(masters) == 1 else None

    def other(self, fw: Firewall) -> Firewall:
        return self.firewalls[1 - fw.index]

    def fail_firewall(self, fw: Firewall) -> None:
        """The firewall host dies: every link down first (nothing it sends while dying gets
        out: no VRRP resignation, no last OpenFlow message), then everything on it killed."""
        node = self.node(fw)
        # Frozen first: between a link going down and the kill, keepalived went to FAULT and
        # its notify script recorded `role backup` in the state file for the controller,
        # already killed (seen once in a loaded suite run: the revived controller started as
        # backup and never made the stale claim). A host losing its power acts on nothing.
        self._signal_all(node, signal.SIGSTOP)
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

    # --- the takeover's time line ---------------------------------------------------------------

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
                (f"first packet through {fw.name}'s {'router' if self.routed else 'bridge'}", packet)]
