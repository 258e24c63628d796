#!/usr/bin/env python3
"""The one-command demo: NFShunt on the emulated testbed, then firewall-only for comparison.

With a 100 ms emulated RTT (linkemu.py: netem, or the NFQUEUE fallback; measured before the
runs), runs a shunted (port 5201), a blocked (5202) and an ignored (5203) iperf3 transfer
from h1 to h2 through Open vSwitch and the firewall bridge, then the same bulk transfer with
every packet crossing the firewall, and prints throughput, where the packets went and the
shunt latency. With --failover, the firewall pair instead: the active firewall dies in the
middle of a shunted and a slow-path transfer, and the table says what happened to each.
With --vlan, the table over VLAN trunks (docs/vlans.md): the same tuple shunted in VLANs 100
and 200, a block in 200, VLAN 30 bridged to 301, an ignored transfer.
With --routed, the same table for a routing firewall (docs/routed.md, experimental_routed):
h1 10.0.1.1/24 and h2 10.0.2.1/24, the firewall their gateway; the shunted path carries the
router's rewrite (its MACs, the TTL one lower), read from the frames h2 receives.
Everything it builds is torn down on exit, also on failure or Ctrl-C.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nfshunt_testbed.bed import (  # noqa: E402
    BLOCK_PORT,
    FAST1,
    IGNORE_PORT,
    SHUNT_PORT,
    Testbed,
    TestbedError,
    machine_info,
)
from nfshunt_testbed.linkemu import DELAY_MECHANISMS, Emulation  # noqa: E402

# tcpdump -e -v on h2: the Ethernet and IP header line of a frame (source MAC, TTL).
FRAME = re.compile(r"^\S+ (\S+) > \S+, ethertype IPv4 \(0x0800\), length \d+: \(tos \S+, ttl (\d+),")


def transfer(tb: Testbed, port: int, seconds: float, grace: float, frames_at_h2: bool = False,
             bitrate: str | None = None) -> dict:
    """One iperf3 transfer h1 -> h2: throughput, packets by path. frames_at_h2: the (source
    MAC, TTL) of up to 100 frames h2 receives, captured once the transfer's flows exist (the
    shunted path's) or from its second second (a path without flows)."""
    slow0 = tb.slow_path_packets()
    seen: dict[str, int] = {}  # flow cookie -> packets; FIN takes shunts down at the end
    capture: list = []
    started = time.monotonic()

    def watch() -> None:
        for f in tb.conn_flows(port):
            seen[f["cookie"] + f.get("in_port", "")] = int(f["n_packets"])
        if frames_at_h2 and not capture and (seen or time.monotonic() - started > 1):
            capture.append(tb.h2.popen(["timeout", "3", "tcpdump", "-l", "-nn", "-e", "-v", "-c", "100", "-i",
                                        "h2-eth0", "ip", "and", "tcp", "and", "dst", "port", str(port)],
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    result = tb.iperf(port, seconds, grace=grace, watch=watch, bitrate=bitrate)
    watch()
    s = Testbed.iperf_summary(result)
    frames = set()
    for cap in capture:
        out, _ = cap.communicate(timeout=10)
        frames = {m.groups() for m in map(FRAME.match, out.splitlines()) if m}
    return {"gbps": s["gbps"], "retransmits": s["retransmits"], "slow": tb.slow_path_packets() - slow0,
            "fast": sum(seen.values()), "flows": bool(seen), "error": result.get("error"), "frames": frames}


def failover(emu: Emulation, seconds: float, routed: bool = False) -> int:
    """The pair: fw active, fw2 backup, a strict policy on both; fw dies mid-transfer.
    `routed`: a pair of routing firewalls (docs/routed.md, "A firewall pair")."""
    rows = []
    config = {"default_shunt_timeout": 60, **({"experimental_routed": True} if routed else {})}
    with Testbed(mode="ha", routed=routed, emulation=emu, log=print, config=config) as tb:
        fw = tb.active_firewall()
        assert fw is not None  # the testbed waited for keepalived's election
        fw2 = tb.other(fw)
        tb.strict_firewalls()  # only conntrackd's synced state carries a connection across
        print(f"  pair up: {fw.name} active, {fw2.name} backup; starting a shunted and a slow-path transfer ...")
        shunted = tb.start_transfer(SHUNT_PORT, seconds)
        ignored = tb.start_transfer(IGNORE_PORT, seconds)
        time.sleep(seconds / 3)
        first_packet = tb.watch_first_packet(fw2)
        print(f"  killing everything on {fw.name} and downing its links ...", flush=True)
        t0, failed_at = time.monotonic(), time.time()
        tb.fail_firewall(fw)
        tb.wait_for(lambda: tb.defaults_point_to(fw2), 15, f"{fw2.name} to take the switch over")
        took = time.monotonic() - t0
        timeline = tb.takeover_timeline(fw2, failed_at, first_packet)
        adopted = f"switch flows, adopted by {fw2.name}"
        if routed:  # the adopted shunt's flows rewritten with the new master's MACs (read from the switch)
            mac = tb.run(tb.node(fw2), "cat", f"/sys/class/net/{fw2.name}-eth1/address").strip()

            def rewritten() -> bool:  # (h1's direction leaves by fw2-eth1's side)
                return any(f"set_field:{mac}->eth_src" in f["actions"]
                           for f in tb.conn_flows(SHUNT_PORT) if f.get("in_port") == str(FAST1))
            try:
                tb.wait_for(rewritten, 5, "the adopted shunt's flows to take the new master's MACs")
                adopted = f"switch flows, {fw2.name}'s MACs"
            except TestbedError:
                adopted = "switch flows, NOT rewritten"
        fresh = tb.iperf(5204, 2, cport=SHUNT_PORT)  # opened after the failover; shunted by source port
        after = tb.controller_output(fw2).split("master of switch")[-1]
        for label, (srv, cli), path in (("shunted", shunted, adopted),
                                        ("ignored", ignored, f"through {fw.name}, then {fw2.name}")):
            r = tb.finish_transfer(srv, cli)
            rows.append((label, path, r, None if "error" in r else tb.longest_stall(r)))
        rows.append(("opened after", f"shunted by {fw2.name}" if ":5204 " in after and "shunt tcp" in after
                     else "NOT shunted", fresh, None))
    print(f"\nfailover: {fw2.name} had the switch {took:.2f} s after {fw.name} died "
          f"(VRRP advert 0.1 s; conntrackd commit; OpenFlow MASTER claim with a newer generation)")
    print(f"takeover time line, s after {fw.name} died:")
    for step, at in timeline:
        print(f"  {'-' if at is None else f'{at:6.3f}':>6}  {step}")
    print(f"{'transfer':<14}{'path':<32}{'Gbit/s':>8}{'longest stall s':>17}  outcome")
    ok = True
    for label, path, r, stall in rows:
        s_ = Testbed.iperf_summary(r)
        outcome = r.get("error") or "completed, no reset"
        ok = ok and "error" not in r and "NOT" not in path
        print(f"{label:<14}{path:<32}{s_['gbps']:>8.3f}{'-' if stall is None else f'{stall:.1f}':>17}  {outcome}")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=8, help="length of each transfer (default 8)")
    ap.add_argument("--bitrate", help="cap each transfer of the plain and the routed table (iperf3 -b, e.g. "
                    "100M): a run that checks the table's shape, not its rates")
    ap.add_argument("--rtt", type=float, default=100, help="emulated round-trip time in ms (default 100)")
    ap.add_argument("--delay", choices=DELAY_MECHANISMS, default="auto", help="delay mechanism (default auto)")
    ap.add_argument("--openflow", choices=["1.0", "1.3"], default="1.3")
    ap.add_argument("--failover", action="store_true",
                    help="the firewall pair: fail the active firewall mid-transfer (OpenFlow 1.3; with --routed, "
                         "a pair of routing firewalls)")
    ap.add_argument("--vlan", action="store_true",
                    help="the table over VLAN trunks (mode vlan; no emulated delay)")
    ap.add_argument("--routed", action="store_true",
                    help="the table for a routing firewall (mode routed, experimental_routed; OpenFlow 1.3)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("demo: run as root (network namespaces, Open vSwitch)", file=sys.stderr)
        return 1
    emu = Emulation.thesis(rtt_ms=args.rtt, delay=args.delay)
    m = machine_info()
    print(f"NFShunt demo on {m['cores']} cores, kernel {m['kernel']}, Open vSwitch {m['ovs']} ({m['datapath']})")
    if args.vlan:
        print("emulation: none (mode vlan: trunks through Open vSwitch stand-ins, for correctness)")
    else:
        print(f"emulation: RTT {args.rtt:g} ms, {emu.link_mbit:g} Mbit/s host links, MTU {emu.mtu}, "
              f"slow path {emu.slow_mbit:g} Mbit/s with a {emu.slow_buffer_kb} KB buffer")
    started = time.monotonic()
    try:
        rc = (failover(emu, max(args.seconds, 6), args.routed) if args.failover else vlans(args) if args.vlan
              else routed(args, emu) if args.routed else paths(args, emu))
    except TestbedError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("demo: interrupted; everything torn down", file=sys.stderr)
        return 130
    print(f"demo finished in {time.monotonic() - started:.0f} s; everything torn down")
    return rc


def vlan_transfer(tb: Testbed, label: str, port: int, hosts: tuple[str, str], dst: str, seconds: float,
                  vids: tuple[int, ...]) -> tuple:
    """One transfer over the trunks (mode vlan), watched as transfer() watches h1 -> h2: the
    flows of its VLAN(s) only (the same tuple's in another VLAN may still be going)."""
    slow0, seen = tb.slow_path_packets(), {}
    srv, cli = tb.start_transfer(port, seconds, src=tb.host(hosts[0]), server=tb.host(hosts[1]), dst=dst,
                                 cport=41000)
    deadline = time.monotonic() + seconds + 10
    while cli.poll() is None and time.monotonic() < deadline:
        for f in tb.conn_flows(port):
            if f.get("dl_vlan") in {str(v) for v in vids}:
                seen[f["cookie"] + f.get("in_port", "")] = (int(f["n_packets"]), f["dl_vlan"])
        time.sleep(0.2)
    if cli.poll() is None:
        cli.kill()  # a blocked transfer stalls: its flows dropped it
    result = tb.finish_transfer(srv, cli, timeout=5)
    s = Testbed.iperf_summary(result)
    return (label, {"gbps": s["gbps"], "retransmits": s["retransmits"], "slow": tb.slow_path_packets() - slow0,
                    "fast": sum(n for n, _ in seen.values()), "flows": bool(seen),
                    "vlans": sorted({int(v) for _, v in seen.values()}), "error": result.get("error")})


def vlans(args: argparse.Namespace) -> int:
    """The table over trunks (mode vlan, docs/vlans.md): VLANs 100 and 200 with the same
    addresses, 30 inside bridged to 301 outside. No emulated delay: the trunks' stand-in
    bridges are for correctness, not for the thesis' numbers."""
    rows = []
    with Testbed(mode="vlan", log=print) as tb:
        for label, port, hosts, dst, vids in (
                ("VLAN 100, shunted", SHUNT_PORT, ("h1", "h2"), "10.0.0.2", (100,)),
                ("VLAN 200, shunted", SHUNT_PORT, ("h3", "h4"), "10.0.0.2", (200,)),
                ("VLAN 200, blocked", BLOCK_PORT, ("h3", "h4"), "10.0.0.2", (200,)),
                ("VLAN 30->301", SHUNT_PORT, ("h5", "h6"), "10.0.3.2", (30, 301)),
                ("VLAN 100, ignored", IGNORE_PORT, ("h1", "h2"), "10.0.0.2", (100,))):
            print(f"  {label}: {hosts[0]} -> {hosts[1]} ({dst}) on port {port} ...", flush=True)
            rows.append(vlan_transfer(tb, label, port, hosts, dst, 3 if port == BLOCK_PORT else args.seconds, vids))
    print("\nVLANs 100 and 200 carry the same addresses and tuples (client port 41000); 30 is 301 outside")
    print(f"{'path':<20}{'Gbit/s':>8}{'retrans':>9}{'slow-path pkts':>16}{'switch-flow pkts':>18}  "
          f"{'flows match':<16}outcome")
    for label, r in rows:
        outcome = ("stalled, dropped by the switch" if r["error"] and r["flows"] else r["error"] or
                   ("shunted: fast path" if r["flows"] else "through the firewall"))
        match = ("vlan " + ", ".join(map(str, r["vlans"]))) if r["vlans"] else "-"
        print(f"{label:<20}{r['gbps']:>8.3f}{r['retransmits']:>9}{r['slow']:>16}{r['fast']:>18}  {match:<16}{outcome}")
    ok = all(r["flows"] for _, r in rows[:4]) and bool(rows[2][1]["error"]) and not rows[4][1]["flows"]
    if not ok:
        print("demo: the paths did not behave as expected (see above)", file=sys.stderr)
    return 0 if ok else 1


def paths(args: argparse.Namespace, emu: Emulation) -> int:
    """Shunted, blocked and ignored transfers with NFShunt, then firewall-only."""
    rows = []
    grace = 10 + args.rtt / 50
    with Testbed(mode="nfshunt", of_version=args.openflow, emulation=emu, log=print) as tb:
        rtt = (tb.rtt_measured, tb.delay_mechanism)
        for label, port, secs, g in (("shunted", SHUNT_PORT, args.seconds, grace),
                                     ("blocked", BLOCK_PORT, 3, 5),
                                     ("ignored", IGNORE_PORT, args.seconds, grace)):
            print(f"  {label} transfer on port {port} ...", flush=True)
            rows.append((f"NFShunt, {label}", transfer(tb, port, secs, g, bitrate=args.bitrate)))
        latencies = [float(x) for x in re.findall(r"shunt .* in ([0-9.]+) ms", tb.controller_output())]
    with Testbed(mode="firewall", of_version=args.openflow, emulation=emu, log=print) as tb:
        print(f"  firewall-only transfer on port {SHUNT_PORT} ...", flush=True)
        rows.append(("firewall only", transfer(tb, SHUNT_PORT, args.seconds, grace, bitrate=args.bitrate)))
    print()
    print(f"RTT measured before the runs: {rtt[0]:.1f} ms (requested {args.rtt:g} ms, delay mechanism: {rtt[1]})")
    print(f"{'path':<20}{'Gbit/s':>8}{'retrans':>9}{'slow-path pkts':>16}{'switch-flow pkts':>18}  outcome")
    for label, r in rows:
        outcome = ("stalled, dropped by the switch" if r["error"] and r["flows"] else r["error"] or
                   ("shunted: fast path" if r["flows"] else "through the firewall"))
        print(f"{label:<20}{r['gbps']:>8.3f}{r['retransmits']:>9}{r['slow']:>16}{r['fast']:>18}  {outcome}")
    if latencies:
        latencies.sort()
        print(f"\nshunt latency (marked conntrack event -> flows confirmed by the switch): median "
              f"{latencies[len(latencies) // 2]:.2f} ms, max {latencies[-1]:.2f} ms over {len(latencies)} shunts")
    shunted, blocked, ignored = rows[0][1], rows[1][1], rows[2][1]
    ok = bool(shunted["flows"]) and shunted["slow"] < ignored["slow"] and bool(blocked["error"])
    if not ok:
        print("demo: the paths did not behave as expected (see above)", file=sys.stderr)
    return 0 if ok else 1


# Routed shunts (experimental_routed; flow_layout auto takes the single layout for them).
ROUTED_SHUNTS = {"experimental_routed": True}


def outcome(r: dict) -> str:
    return ("stalled, dropped by the switch" if r["error"] and r["flows"] else r["error"] or
            ("shunted: fast path" if r["flows"] else "through the firewall"))


def routed(args: argparse.Namespace, emu: Emulation) -> int:
    """The table for a routing firewall: shunted, blocked and ignored transfers with NFShunt
    (experimental_routed), then the router alone (the same bed without it: every connection
    stays on the router, counted). h2's frames say who forwarded them: the router's MAC and
    a TTL one lower on the shunted path too (the switch's dec_ttl and MAC rewrite)."""
    rows = []
    grace = 10 + args.rtt / 50
    with Testbed(mode="routed", emulation=emu, log=print, config=ROUTED_SHUNTS) as tb:
        rtt = (tb.rtt_measured, tb.delay_mechanism)
        router = tb.run(tb.fw, "cat", "/sys/class/net/fw-eth1/address").strip()
        for label, port, secs, g in (("shunted", SHUNT_PORT, args.seconds, grace),
                                     ("blocked", BLOCK_PORT, 3, 5),
                                     ("ignored", IGNORE_PORT, args.seconds, grace)):
            print(f"  {label} transfer on port {port} ...", flush=True)
            r = transfer(tb, port, secs, g, frames_at_h2=port != BLOCK_PORT, bitrate=args.bitrate)
            rows.append((f"NFShunt, {label}", {**r, "router": router}))
        latencies = [float(x) for x in re.findall(r"shunt .* in ([0-9.]+) ms", tb.controller_output())]
    with Testbed(mode="routed", emulation=emu, log=print) as tb:  # (each bed's MACs are its own)
        print(f"  router-only transfer on port {SHUNT_PORT} (experimental_routed off) ...", flush=True)
        r = transfer(tb, SHUNT_PORT, args.seconds, grace, frames_at_h2=True, bitrate=args.bitrate)
        rows.append(("router only", {**r, "router": tb.run(tb.fw, "cat", "/sys/class/net/fw-eth1/address").strip()}))
    print()
    print(f"RTT measured before the runs: {rtt[0]:.1f} ms (requested {args.rtt:g} ms, delay mechanism: {rtt[1]})")
    print(f"routing firewall: h1 {tb.h1_ip} -> h2 {tb.h2_ip}, the firewall their gateway; h1 sends with TTL 64; "
          "TTL at h2: of frames from the router's MAC (fw-eth1's)")
    print(f"{'path':<20}{'Gbit/s':>8}{'retrans':>9}{'slow-path pkts':>16}{'switch-flow pkts':>18}  "
          f"{'TTL at h2':<11}outcome")
    for label, r in rows:
        ttls = sorted({int(ttl) for mac, ttl in r["frames"] if mac == r["router"]})
        others = {mac for mac, _ in r["frames"]} - {r["router"]}
        ttl = "-" if not r["frames"] else ",".join(map(str, ttls)) + (" +others!" if others else "")
        print(f"{label:<20}{r['gbps']:>8.3f}{r['retransmits']:>9}{r['slow']:>16}{r['fast']:>18}  "
              f"{ttl:<11}{outcome(r)}")
    print("\nThe shunted path carries the router's rewrite: h2 receives its frames from the router's MAC "
          "with the TTL one lower (63), as through the router itself; the switch decrements it (dec_ttl) "
          "and rewrites both MACs.")
    if latencies:
        latencies.sort()
        print(f"shunt latency (marked conntrack event -> flows confirmed by the switch): median "
              f"{latencies[len(latencies) // 2]:.2f} ms, max {latencies[-1]:.2f} ms over {len(latencies)} shunts")
    shunted, blocked, ignored, alone = (r for _, r in rows)
    rewritten = all(r["frames"] and r["frames"] == {(r["router"], "63")} for r in (shunted, ignored, alone))
    ok = (bool(shunted["flows"]) and shunted["slow"] < ignored["slow"] and bool(blocked["error"])
          and not ignored["flows"] and not alone["flows"] and rewritten)
    if not ok:
        print("demo: the paths did not behave as expected (see above)", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
