"""Reading the testbed: the switches' flows, per-hop packet counters and where packets were
lost, a firewall's conntrack table."""
from __future__ import annotations

import json
import subprocess
import time
from typing import Any

from mininet.node import Host

from .topology import (
    FAST1,
    FAST2,
    HOP_COUNT,
    PYTHON,
    REPO,
    SLOW1,
    SLOW2,
    Firewall,
    TestbedError,
    Topology,
)

DEFAULT_COOKIE = "0x4e01000000000000"  # the controller's default flows (patching fast to slow ports)
VLAN_DROP_KIND = 0x4E08  # a cookie's top 16 bits: a trunk port's drop of what it does not carry


class Observation(Topology):

    # --- the switch's flows -----------------------------------------------------------------

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
        """Every switch has the controller's default flows: four; on trunks (mode vlan, routed
        with vlan=True) both ways per carried tag, and a drop (cookie kind VLAN_DROP) per trunk port."""
        if not self.vlan:
            return all(sum(1 for f in self.flows(br) if f.get("cookie") == DEFAULT_COOKIE) == 4 for br in self.bridges)
        flows = self.flows()
        drops = sum(1 for f in flows if int(f.get("cookie", "0"), 16) >> 48 == VLAN_DROP_KIND)
        return (sum(1 for f in flows if f.get("cookie") == DEFAULT_COOKIE) == sum(2 * len(t) for t in self.vlan_trunks)
                and drops == 2 * len(self.vlan_trunks))

    def defaults_point_to(self, fw: Firewall) -> bool:
        """s1's default flows patch the fast ports to this firewall's slow ports, and no other."""
        want = {(FAST1, fw.slow[0]), (fw.slow[0], FAST1), (FAST2, fw.slow[1]), (fw.slow[1], FAST2)}
        got = {(int(f["in_port"]), int(f["actions"].split("output:")[1].split(",")[0]))
               for f in self.flows() if f.get("cookie") == DEFAULT_COOKIE and "output:" in f["actions"]}
        return got == want

    # --- packet counters --------------------------------------------------------------------

    def slow_path_packets(self) -> int:
        """Packets the switch has sent towards the firewall bridge (both slow ports)."""
        total = 0
        for port in (SLOW1, SLOW2):
            with open(f"/sys/class/net/s1-eth{port}/statistics/tx_packets") as fh:
                total += int(fh.read())
        return total

    def _host_counters(self, c: dict[str, int], node: Host, intf: str) -> None:
        st = json.loads(self.run(node, "ip", "-s", "-j", "link", "show", "dev", intf))[0]["stats64"]
        c[f"{intf}.tx"], c[f"{intf}.rx"] = st["tx"]["packets"], st["rx"]["packets"]
        c[f"{intf}.rx_dropped"] = st["rx"]["dropped"]
        qd = json.loads(self.run(node, "tc", "-s", "-j", "qdisc", "show", "dev", intf) or "[]")
        c[f"{intf}.qdisc_drops"] = sum(q.get("drops", 0) for q in qd if q.get("root") or q.get("parent"))

    def _routed_ipv4_counts(self) -> tuple[int, int]:
        """Mode routed: IPv4 packets in on fw-eth0 and out of fw-eth1 (the HOP_COUNT rules)."""
        counts = []
        for chain in ("PREROUTING", "POSTROUTING"):
            out = self.run(self.fw, "iptables", "-w", "5", "-t", "mangle", "-nvxL", chain)
            counts.append(sum(int(line.split()[0]) for line in out.splitlines() if HOP_COUNT in line))
        return counts[0], counts[1]

    @staticmethod
    def _switch_counters(c: dict[str, int], *ports: int) -> None:
        for port in ports:
            for d in ("tx", "rx"):
                with open(f"/sys/class/net/s1-eth{port}/statistics/{d}_packets") as fh:
                    c[f"s1-eth{port}.{d}"] = int(fh.read())

    def hop_counters(self) -> dict[str, int]:
        """Packet counters along h1 -> h2 (the data direction) to locate loss, one per hop.

        h1 sends; s1 receives on port 1 and sends either to h2 (port 3, fast) or to the
        firewall (port 2), whose bridge forwards out fw-eth1 back into s1 port 4; h2
        receives, and its delay queue (NFQUEUE or netem) may drop. In mode routed the
        firewall's hop counts IPv4 only: a router sends and takes frames of its own. Not on
        trunks: the stand-in NICs sit between s1 and the firewall's sub-interfaces, and a slow
        link carries other VLANs' hosts too (the routed trunks' h3 beside h1).
        """
        if self.vlan:
            raise TestbedError("hop_counters is for the testbed without trunks (no fw-eth0/fw-eth1 there)")
        c: dict[str, int] = {}
        # Read against the data's direction, h2 first and h1 last: a packet moving during
        # the reads is then counted before a hop and not after it (in flight), never after
        # it and not before (a negative loss at that hop).
        self._host_counters(c, self.h2, "h2-eth0")
        self._switch_counters(c, FAST2, SLOW2)
        self._host_counters(c, self.fw, "fw-eth1")
        self._host_counters(c, self.fw, "fw-eth0")
        if self.routed:  # the router's own frames and the hosts' to it left out (topology.py)
            c["fw-eth0.rx"], c["fw-eth1.tx"] = self._routed_ipv4_counts()
        self._switch_counters(c, SLOW1, FAST1)
        self._host_counters(c, self.h1, "h1-eth0")
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

    # --- conntrack ----------------------------------------------------------------------------

    def conntrack(self, fw: Firewall | None = None) -> list[dict[str, Any]]:
        """A firewall's conntrack table, read over netlink inside its node."""
        out = self.run(self.node(fw or self.firewalls[0]), PYTHON, "-c",
                       "import json,sys; sys.path.insert(0, sys.argv[1]);"
                       "from nfshunt.kernel.table import dump_entries;"
                       "print(json.dumps([dict(id=e.ct_id, mark=e.mark, state=e.tcp_state, proto=e.orig.proto,"
                       " src=e.orig.src, dst=e.orig.dst, sport=e.orig.sport, dport=e.orig.dport)"
                       " for e in dump_entries()]))", REPO)
        return json.loads(out)

    # --- mode vlan ----------------------------------------------------------------------------

    def intf_packets(self, node: Host, intf: str) -> tuple[int, int]:
        """(rx, tx) packets of an interface in a node."""
        st = json.loads(self.run(node, "ip", "-s", "-j", "link", "show", "dev", intf))[0]["stats64"]
        return st["rx"]["packets"], st["tx"]["packets"]

    def tagged_drops(self, fw: Firewall | None = None) -> dict[str, int]:
        """Frames NFSHUNT_TAGGED dropped (still tagged inside a per-VLAN bridge), by the
        sub-interface they came in on; {} without the chain."""
        out = self.run(self.node(fw or self.firewalls[0]), "ebtables", "-L", "NFSHUNT_TAGGED", "--Lc", check=False)
        drops: dict[str, int] = {}
        for line in out.splitlines():
            words = line.split()
            if "-i" in words and "pcnt" in words:
                intf = words[words.index("-i") + 1]
                drops[intf] = drops.get(intf, 0) + int(words[words.index("pcnt") + 2])
        return drops

    def conntrack_zone(self, zone: int, fw: Firewall | None = None) -> list[dict[str, str]]:
        """A firewall's conntrack entries in one zone, as `conntrack -L -w` lists them (key=value
        fields of the original direction; zone 0: the entries of no zone)."""
        out = self.run(self.node(fw or self.firewalls[0]), "conntrack", "-L", "-w", str(zone), check=False)
        entries = []
        for line in out.splitlines():
            fields: dict[str, str] = {}
            for word in line.split():
                key, eq, value = word.partition("=")
                if eq and key not in fields:  # the original direction's come first
                    fields[key] = value
            if fields:
                entries.append(fields)
        return entries

    @staticmethod
    def packet_out(bridge: str, port: int, frame: bytes, count: int = 1) -> None:
        """Frames sent out of a stand-in's port as they are (tags included): what a trunk
        carries that no host of the testbed sends (another VLAN, stacked tags)."""
        for _ in range(count):
            subprocess.run(["ovs-ofctl", "-O", "OpenFlow13", "packet-out", bridge,
                            f"in_port=controller,packet={frame.hex()},actions=output:{port}"],
                           check=True, capture_output=True)

    def capture(self, node: Host | None, intf: str, expression: str, count: int | None = None) -> subprocess.Popen:
        """tcpdump (link-level headers, one line a frame received) on a node's interface (None:
        the root namespace's, a switch port's), ready when this returns; it ends by itself after
        `count` frames; stop_capture reads it."""
        args = ("tcpdump", "-i", intf, "-e", "-n", "-l", "-Q", "in", *(("-c", str(count)) if count else ()),
                expression)
        if node is None:
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self._procs.append(proc)
        else:
            proc = self.spawn(node, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        said = ""
        for _ in range(3):  # "listening on ...": it captures now
            said += proc.stderr.readline() if proc.stderr else ""
            if "listening on" in said:
                break
        if "listening on" not in said:
            proc.kill()
            raise TestbedError(f"tcpdump on {node.name if node else 'the root namespace'} {intf} did not start: {said}")
        return proc

    @staticmethod
    def stop_capture(proc: subprocess.Popen, wait: float = 0) -> list[str]:
        """The frames a capture saw: after it ended by itself (its count), or `wait` seconds."""
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            pass
        proc.terminate()
        out, _ = proc.communicate(timeout=5)
        return [line for line in out.splitlines() if line.strip()]
