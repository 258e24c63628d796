#!/usr/bin/env python3
"""The one-command demo: NFShunt on the emulated testbed, then firewall-only for comparison.

Runs a shunted (port 5201), a blocked (5202) and an ignored (5203) iperf3 transfer from h1
to h2 through Open vSwitch and the firewall bridge, then the same bulk transfer with every
packet crossing the firewall, and prints where the packets went. Everything it builds is
torn down on exit, also on failure or Ctrl-C.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nfshunt_testbed import H2_IP, Testbed  # noqa: E402


def transfer(tb: Testbed, port: int, seconds: int) -> dict:
    srv = tb.h2.popen(["iperf3", "-s", "-1", "-p", str(port)], stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    slow0 = tb.slow_path_packets()
    cli = tb.h1.popen(["iperf3", "-c", H2_IP, "-p", str(port), "-t", str(seconds), "-J",
                       "--connect-timeout", "3000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    flows: list = []
    try:
        out, _ = cli.communicate(timeout=seconds + 8)
        result = json.loads(out) if out.strip() else {}
    except subprocess.TimeoutExpired:
        flows = tb.conn_flows(port)
        cli.kill()
        cli.communicate()
        result = {"error": "stalled"}
    finally:
        srv.kill()
        srv.wait()
    flows = flows or tb.conn_flows(port)
    bps = result.get("end", {}).get("sum_received", {}).get("bits_per_second", 0.0) if "error" not in result else 0.0
    return {"gbps": bps / 1e9, "slow": tb.slow_path_packets() - slow0,
            "fast": sum(int(f["n_packets"]) for f in flows), "flows": flows,
            "error": result.get("error")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=int, default=5, help="length of each transfer")
    ap.add_argument("--openflow", choices=["1.0", "1.3"], default="1.3")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("demo: run as root (network namespaces, Open vSwitch)", file=sys.stderr)
        return 1
    rows = []
    started = time.monotonic()
    with Testbed(mode="nfshunt", of_version=args.openflow, log=print) as tb:
        for label, port in (("shunted", 5201), ("blocked", 5202), ("ignored", 5203)):
            print(f"  {label} transfer on port {port} ...", flush=True)
            r = transfer(tb, port, args.seconds)
            rows.append((f"NFShunt, {label}", r))
        latencies = [float(x) for x in re.findall(r"shunt .* in ([0-9.]+) ms", tb.controller_output())]
    with Testbed(mode="firewall", of_version=args.openflow, log=print) as tb:
        print("  firewall-only transfer on port 5201 ...", flush=True)
        rows.append(("firewall only", transfer(tb, 5201, args.seconds)))

    print()
    print(f"{'path':<22}{'Gbit/s':>9}{'slow-path pkts':>16}{'switch-flow pkts':>18}  outcome")
    for label, r in rows:
        outcome = r["error"] or ("shunted" if r["flows"] and "blocked" not in label else
                                 "dropped by switch" if r["flows"] else "through firewall")
        print(f"{label:<22}{r['gbps']:>9.2f}{r['slow']:>16}{r['fast']:>18}  {outcome}")
    if latencies:
        latencies.sort()
        print(f"\nshunt latency (conntrack event -> flows confirmed by the switch): "
              f"median {latencies[len(latencies) // 2]:.2f} ms over {len(latencies)} shunts")
    print(f"demo finished in {time.monotonic() - started:.0f} s; everything torn down")
    ok = rows[0][1]["flows"] and rows[0][1]["slow"] < rows[2][1]["slow"] and rows[1][1]["error"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
