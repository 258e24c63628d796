#!/usr/bin/env python3
"""Benchmarks of the shunting machinery on the real testbed (Open vSwitch, conntrack).

  latency  N single shunts of an iperf3 connection: client SYN -> marked event read ->
           flows confirmed (barrier) -> conntrack entry deleted -> last slow-path packet
  rate     shunts per second at increasing offered rates, each sustained for --seconds,
           until p99 (creation -> confirmed) passes 100 ms or events are lost; fed by
           conntrack entries created over netlink (--feed netlink, isolates the controller)
           or by real TCP connections through the bridge (--feed tcp)
  scale    controller RSS and CPU with 1k, 10k, 100k active shunts, and the time to
           reconcile them after a restart
  burst    N marked entries created at once: time until every pair is confirmed on the switch
           and every conntrack entry deleted, beside the switch's own limit for the same
           flow-mods written straight to it (bench/switchlimit.py) in the same run
  reload   static shunts changed by a reload (`nfshunt reload`): 1, 100 and 1,000 streams added,
           then removed; time from the request to every new flow confirmed (barrier), beside
           the switch's own time for as many flow-mods written straight to it
  reload-hold  the longest the controller's event loop is held while a reload adds 10,000 static
           streams (20,000 flow-mods) and removes them again: requests the loop answers at once,
           sent back to back on the control socket meanwhile, each timed (what a conntrack event
           or a switch reply would wait), beside the controller's own longest turn and the switch alone
  ids      shunt requests to the IDS API (issue 28) at a rate, each against a live conntrack entry
           the policy accepted and left alone: send -> `201 added` (after the switch's barrier),
           every answer counted by status, beside the switch alone at the same rate and its top rate
  config   static shunts validated offline (config load, no testbed): 10,000 entries (--sizes)
           between one host pair, from spread sources, and as prefixes; the file written one
           key a line, as an admin writes it
  all      the four (not reload, reload-hold, ids, config)

--quick runs each small (the test suite does). Results: bench/results/<bench>-<time>/
<bench>.md and CSV, with the machine (cores, kernel, Open vSwitch, datapath).
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any, Iterable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "mininet"))
sys.path.insert(0, REPO)

import profiles  # noqa: E402
import switchlimit  # noqa: E402
from ctfeed import address  # noqa: E402
from experiments import Capture, Results, last_of_first_burst, tcp_segments  # noqa: E402

from nfshunt.config import settings as nfconfig  # noqa: E402
from nfshunt_testbed.bed import H2_IP, OF_PORT, PYTHON, SHUNT_PORT, Testbed, TestbedError  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    vals = sorted(values)
    if not vals:
        return math.nan
    return vals[min(len(vals) - 1, max(0, math.ceil(q * len(vals)) - 1))]


def summary(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "median": pct(values, 0.5), "p90": pct(values, 0.9), "p99": pct(values, 0.99),
            "max": max(values) if values else math.nan,
            "mean": statistics.fmean(values) if values else math.nan}


def f(x: float, d: int = 2) -> str:
    return "–" if isinstance(x, float) and math.isnan(x) else f"{x:.{d}f}"


def md_table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows)]


def until_settled(measure: Any, done: Any, quiet: float, limit: float, interval: float) -> tuple[Any, float]:
    """Poll `measure` until `done(value)`, `limit` seconds pass, or the value stays the same
    for `quiet` seconds. Returns the last value and when it last changed. A None is no
    reading (the controller too busy to answer a status behind a burst): it is never
    `done` and never quiet."""
    deadline = time.time() + limit
    value, changed = measure(), time.time()
    while (value is None or not done(value)) and time.time() < deadline and time.time() - changed < quiet:
        time.sleep(interval)
        now = measure()
        if now is None or now != value:
            value, changed = now, time.time()
    return value, changed


def log_events(tb: Testbed, event: str) -> list[dict[str, Any]]:
    out = []
    for line in tb.controller_output().splitlines():
        if line.startswith("{") and f'"event": "{event}"' in line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def cpu_seconds(stat_path: str) -> float:
    """User plus system CPU seconds from a /proc stat file (a process's or one thread's)."""
    with open(stat_path) as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_usage(pid: int) -> tuple[float, int]:
    """(CPU seconds, RSS bytes) of a process."""
    cpu = cpu_seconds(f"/proc/{pid}/stat")
    with open(f"/proc/{pid}/status") as fh:
        rss = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))
    return cpu, rss


def machine_busy() -> float:
    """CPU seconds every core of the machine spent busy (not idle, not waiting on I/O)."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / CLK_TCK


def ovs_vswitchd_pid() -> int:
    with open("/var/run/openvswitch/ovs-vswitchd.pid") as fh:
        return int(fh.read().strip())


def ovs_main_thread_cpu(pid: int) -> float:
    """CPU seconds of ovs-vswitchd's main thread: it applies flow-mods, expires idle flows
    and sends flow-removed, one core at most, so near 100 % it is the switch's limit."""
    return cpu_seconds(f"/proc/{pid}/task/{pid}/stat")


def counts(tb: Testbed, within: float = 120) -> dict[str, Any]:
    """The controller's status. Past its rate it may not answer in time (an error reply):
    asked again until the backlog lets it, for up to `within` seconds."""
    deadline = time.time() + within
    while True:
        st = tb.control({"cmd": "status", "connections": False}, timeout=30)
        if "counters" in st or time.time() > deadline:
            if "counters" not in st:
                raise TestbedError(f"the controller's status did not answer within {within:.0f} s: {st}")
            return st
        print(f"    status not answered yet: {st.get('error', st)}", flush=True)
        time.sleep(1)


def profile_path(args: argparse.Namespace, res: Results, name: str) -> str | None:
    """Where --profile keeps a run's py-spy samples (bench/profiles.py), beside its report."""
    if not args.profile:
        return None
    os.makedirs(res.out, exist_ok=True)
    return os.path.join(res.out, f"{name}-profile.txt")


def profile_section(paths: list[str]) -> list[str]:
    """The report's section of where the controller's time went, over every sampled run."""
    raw = ""
    for path in paths:
        with open(path) as fh:
            raw += fh.read() + "\n"
    files = ", ".join(f"`{os.path.basename(p)}`" for p in paths)
    return ["", "## Where the controller's time went", "",
            f"py-spy samples of the controller process while the load ran (`bench/profiles.py`; raw: {files}).",
            "", *profiles.table(profiles.summarise(raw))]


# --- latency -----------------------------------------------------------------------------------

OFPT_FLOW_MOD, OFPT_BARRIER_REPLY = 14, 21
OF_SNAPLEN = 256  # bytes a frame kept of the control connection: the headers of a write's first messages


def read_openflow(path: str) -> list[tuple[float, bool, tuple[int, ...]]]:
    """(time, from the controller, OpenFlow message types) of each segment of the control
    connection that carries data, in a pcap of it (port OF_PORT). The types are those whose
    headers the segment starts with, as far as its captured bytes go: a batch of flow-mods
    and its barrier go out in one write, a barrier reply comes in a segment of its own."""
    out = []
    for t, tcp in tcp_segments(path):
        payload = tcp[(tcp[12] >> 4) * 4:]
        types = []
        while len(payload) >= 4 and payload[0] in (1, 4):  # OpenFlow 1.0 or 1.3 header
            types.append(payload[1])
            length = struct.unpack("!H", payload[2:4])[0]
            if length < 8:
                break
            payload = payload[length:]
        if types:
            out.append((t, struct.unpack("!H", tcp[:2])[0] == OF_PORT, tuple(types)))
    return out


def switch_round_trip(segments: list[tuple[float, bool, tuple[int, ...]]], start: float,
                      end: float) -> tuple[float, float] | None:
    """When the shunt's flow-mods went out on the control connection (the first write with a
    flow-mod after `start`) and when the barrier reply behind them came back, before `end`."""
    sent = next((t for t, out, types in segments if out and start <= t <= end and OFPT_FLOW_MOD in types), None)
    if sent is None:
        return None
    back = next((t for t, out, types in segments if not out and sent <= t <= end and OFPT_BARRIER_REPLY in types),
                None)
    return None if back is None else (sent, back)


def _latency_runs(tb: Testbed, res: Results, runs: int, bitrate: str) -> None:
    control_if = tb.firewalls[0].mgmt_ifs[0]
    for run in range(runs):
        cport = 40000 + run
        caps: list[Capture] = []
        try:
            for intf in ("s1-eth1", "s1-eth2", "s1-eth4"):
                caps.append(Capture(intf, f"tcp port {cport}", os.path.join(tb.workdir, f"{intf}-{run}.pcap")))
            control = Capture(control_if, f"tcp port {OF_PORT}", os.path.join(tb.workdir, f"control-{run}.pcap"),
                              snaplen=OF_SNAPLEN)
            caps.append(control)
            tb.iperf(SHUNT_PORT, 1, cport=cport, bitrate=bitrate)
        finally:
            pkts = [cap.stop() for cap in caps]
        tb.wait_for(lambda cport=cport: [e for e in log_events(tb, "ct_deleted") if e.get("sport") == cport], 5,
                    "the conntrack deletion", interval=0.05)
        syns = [t for t, sp, _, fl in pkts[0] if sp == cport and fl & 0x02 and not fl & 0x10]
        # The SYN/ACK as it leaves the firewall for the switch (s1-eth2, h1's side): conntrack has
        # marked the entry and sent the marked update by then (the policy marks ESTABLISHED).
        synacks = [t for t, _, dp, fl in pkts[1] if dp == cport and fl & 0x12 == 0x12]
        inst = [e for e in log_events(tb, "installed") if e.get("sport") == cport]
        dele = [e for e in log_events(tb, "ct_deleted") if e.get("sport") == cport]
        slow = [t for t, *_ in pkts[1] + pkts[2]]
        if not (syns and synacks and inst and dele and slow):
            print(f"[{run + 1}/{runs}] incomplete run skipped", flush=True)
            continue
        t0, confirmed = syns[0], inst[-1]["ts"]
        event = confirmed - inst[-1]["latency_ms"] / 1000
        row = {"run": run, "marked_ms": (synacks[0] - t0) * 1000, "event_ms": (event - t0) * 1000,
               "confirmed_ms": (confirmed - t0) * 1000, "ct_deleted_ms": (dele[0]["ts"] - t0) * 1000,
               "last_slow_ms": (last_of_first_burst(slow) - t0) * 1000,
               "controller_ms": inst[-1]["latency_ms"]}
        trip = switch_round_trip(read_openflow(control.path), event, confirmed)
        if trip is not None:  # the controller's share cut where the switch's begins and ends
            row.update(flowmods_out_ms=(trip[0] - t0) * 1000, barrier_back_ms=(trip[1] - t0) * 1000)
        res.add(row)
        print(f"[{run + 1}/{runs}] event {row['event_ms']:.2f} confirmed {row['confirmed_ms']:.2f} "
              f"deleted {row['ct_deleted_ms']:.2f} last slow {row['last_slow_ms']:.2f} ms", flush=True)


def bench_latency(args: argparse.Namespace) -> int:
    runs = args.runs or (2 if args.quick else 100)
    res = Results(args.out, "latency", {"runs": runs, "transfer": f"iperf3 -t 1 -b {args.bitrate} on the shunted "
                                        "port, one per run (low load: the machine is not saturated)",
                                        "OpenFlow": "1.3", "capture": "tcpdump on s1-eth1 (SYN) and s1-eth2/4 (slow; "
                                        "the SYN/ACK out of the firewall on s1-eth2)"})
    sampled = profile_path(args, res, "latency")
    with Testbed(mode="nfshunt", config={"log_format": "json"}, log=print) as tb:
        tb.wait_for_controller()
        with profiles.sampled(tb.controller.pid, sampled):  # type: ignore[union-attr]
            _latency_runs(tb, res, runs, args.bitrate)
    body = ["Milliseconds since the client's SYN reached the switch. Thesis (100 runs, means): 3.3 ms to the "
            "event, 58 ms to flows programmed, 75.8 ms to the last slow-path packet.", "",
            "| stage | n | median | p90 | p99 | max |", "|---|---|---|---|---|---|"]
    for key, label in (("marked_ms", "SYN/ACK leaves the firewall (the marked update sent)"),
                       ("event_ms", "marked event read by the controller"),
                       ("confirmed_ms", "flows confirmed by the switch (barrier)"),
                       ("ct_deleted_ms", "conntrack entry deleted (acknowledged)"),
                       ("last_slow_ms", "last packet on the slow path"),
                       ("controller_ms", "controller: event read -> confirmed")):
        s = summary([r[key] for r in res.rows])
        body.append(f"| {label} | {s['n']} | {f(s['median'])} | {f(s['p90'])} | {f(s['p99'])} | {f(s['max'])} |")
    # The controller's share cut by the control connection's capture: its own work before the
    # switch has the flow-mods, the switch's round trip, its own work after the barrier reply.
    cut = [r for r in res.rows if "flowmods_out_ms" in r]
    body += ["", "The controller's share, cut where the control connection carries the flow-mods out and the "
             f"barrier reply back (tcpdump on the control link's switch side; {len(cut)} of {len(res.rows)} runs "
             "matched):", "",
             "| span | n | median | p90 | p99 | max |", "|---|---|---|---|---|---|"]
    for label, a, b in (("marked update sent -> read by the controller", "marked_ms", "event_ms"),
                        ("event read -> flow-mods on the wire", "event_ms", "flowmods_out_ms"),
                        ("flow-mods on the wire -> barrier reply on the wire (the switch)", "flowmods_out_ms",
                         "barrier_back_ms"),
                        ("barrier reply on the wire -> confirmed", "barrier_back_ms", "confirmed_ms")):
        s = summary([r[b] - r[a] for r in cut])
        body.append(f"| {label} | {s['n']} | {f(s['median'])} | {f(s['p90'])} | {f(s['p99'])} | {f(s['max'])} |")
    if sampled:
        body += profile_section([sampled])
    print(f"report: {res.report('Shunt latency', body, False)}")
    return 0


# --- rate ------------------------------------------------------------------------------------------

def _feed_netlink(tb: Testbed, rate: float, seconds: float, start: int, proto: str) -> tuple[dict, dict]:
    out = os.path.join(tb.workdir, f"feed-{int(rate)}.csv")
    proc = tb.spawn(tb.fw, PYTHON, os.path.join(HERE, "ctfeed.py"), "--rate", str(rate), "--seconds", str(seconds),
                    "--start", str(start), "--proto", proto, "--out", out, stdout=subprocess.PIPE)
    line, _ = proc.communicate(timeout=seconds + 60)
    result = json.loads(line.strip().splitlines()[-1])
    created: dict[tuple[str, int], float] = {}
    with open(out) as fh:
        next(fh)
        for row in fh:
            _, src, sport, t = row.split(",")
            created[(src, int(sport))] = float(t)
    return result, created


def _feed_tcp(tb: Testbed, rate: float, seconds: float) -> tuple[dict, dict]:
    out = os.path.join(tb.workdir, f"tcp-{int(rate)}.csv")
    proc = tb.spawn(tb.h1, PYTHON, os.path.join(REPO, "mininet", "conngen.py"), "rate", H2_IP, str(SHUNT_PORT),
                    "--rate", str(rate), "--seconds", str(seconds), "--hold", "1", "--out", out,
                    stdout=subprocess.PIPE)
    line, _ = proc.communicate(timeout=seconds + 60)
    result = json.loads(line.strip().splitlines()[-1])
    result["created"] = result["connected"]
    created: dict[tuple[str, int], float] = {}
    with open(out) as fh:
        next(fh)
        for row in fh:
            sport, t = row.split(",")
            created[("10.0.0.1", int(sport))] = float(t)
    return result, created


def _switch_alone(tb: Testbed, rate: float, seconds: float) -> dict[str, Any]:
    """The switch alone at this rate (switchlimit.sustained), the controller stopped for it
    and started again after."""
    tb.stop_controller()
    try:
        ovs_pid = ovs_vswitchd_pid()
        main0, t0 = ovs_main_thread_cpu(ovs_pid), time.time()
        r = switchlimit.sustained(nfconfig.load(tb.config_path), "s1", rate, seconds)
        r["ovs_main_thread_cpu_pct"] = 100 * (ovs_main_thread_cpu(ovs_pid) - main0) / (time.time() - t0)
    finally:
        tb.restart_controller()
        tb.wait_for_controller()
    return r


def bench_rate(args: argparse.Namespace) -> int:
    feed = args.feed
    if args.rates:
        rates = args.rates
    elif feed == "netlink":
        rates = [500] if args.quick else [500, 1000, 1500, 2000, 2500, 3000, 4000, 5000]
    else:
        rates = [100] if args.quick else [100, 200, 300, 500, 1000]
    seconds = args.seconds or (2 if args.quick else 30)
    proto = args.proto
    teardown = proto == "tcp" and not args.no_teardown
    alone_too = feed == "netlink" and proto == "udp"
    params = {"feed": {"netlink": "conntrack entries created over netlink in fw (ESTABLISHED, shunt mark)",
                       "tcp": "real TCP connections h1 -> h2 through the bridge, each closed 1 s after set-up"}[feed],
              "protocol": proto if feed == "netlink" else "tcp",
              "flows per shunt": 6 if (teardown or feed == "tcp") else 2,
              "offered rates (/s)": rates, "seconds per rate": seconds, "shunt idle timeout": "10 s (steady state: "
              "removals run alongside installs)", "logging": "INFO, JSON (one line per shunt, as in production)",
              "the switch alone": "the same UDP pairs' flow-mods (the controller's, flow-removed flag kept) written "
              "straight to the switch at the same rate for as long, a batch and a barrier every 10 ms, before the "
              "controller's run in the same testbed, the controller stopped meanwhile (bench/switchlimit.py "
              "sustained); latency from a batch's due time to its barrier reply" if alone_too else
              "not measured (it writes UDP pairs: netlink feed of UDP only)"}
    res = Results(args.out, f"rate-{feed}", params)
    for k, rate in enumerate(rates):
        with Testbed(mode="nfshunt", config={"log_format": "json", "log_level": "INFO",
                                             "tcp_teardown": teardown or feed == "tcp"}, log=print) as tb:
            tb.wait_for_controller()
            if alone_too:
                print(f"[{k + 1}/{len(rates)}] the switch alone at {rate}/s for {seconds} s", flush=True)
                alone = _switch_alone(tb, rate, seconds)
            pid = tb.controller.pid  # type: ignore[union-attr]
            if feed == "tcp":
                tb.run(tb.h1, "sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1")
                tb.run(tb.h1, "sysctl", "-qw", "net.ipv4.ip_local_port_range=1024 65000")
                srv = tb.conn_server(SHUNT_PORT)
            cpu0, _ = proc_usage(pid)
            ovs_pid = ovs_vswitchd_pid()
            ovs0, _ = proc_usage(ovs_pid)
            main0 = ovs_main_thread_cpu(ovs_pid)
            t0 = time.time()
            overflow0 = counts(tb)["counters"].get("netlink_overflows", 0)
            print(f"[{k + 1}/{len(rates)}] offering {rate}/s for {seconds} s ({feed})", flush=True)
            result, created = (_feed_netlink(tb, rate, seconds, k * 10_000_000 // 8, proto) if feed == "netlink"
                               else _feed_tcp(tb, rate, seconds))

            def installed(created: set = created) -> list[dict]:
                return [e for e in log_events(tb, "installed") if (e["src"], e["sport"]) in created]
            # until every created entry is shunted, or nothing moves for 3 s
            until_settled(lambda: len(installed()), lambda n, want=len(created): n >= want, 3, 30, 0.5)
            cpu1, rss = proc_usage(pid)
            ovs1, _ = proc_usage(ovs_pid)
            main1 = ovs_main_thread_cpu(ovs_pid)
            st = counts(tb)
            inst = installed()
            if feed == "tcp":
                srv.kill()
        e2e = [(e["ts"] - created[(e["src"], e["sport"])]) * 1000 for e in inst]
        ctl = [e["latency_ms"] for e in inst]
        span = (max(e["ts"] for e in inst) - min(created.values())) if inst else math.nan
        row = {"offered_rate": rate, "seconds": seconds, "created": result["created"], "shunted": len(inst),
               "lost": result["created"] - len(inst), "achieved_rate": len(inst) / span if inst else 0.0,
               "netlink_overflows": st["counters"].get("netlink_overflows", 0) - overflow0,
               "controller_cpu_pct": 100 * (cpu1 - cpu0) / (time.time() - t0), "controller_rss_mb": rss / 2**20,
               "ovs_vswitchd_cpu_pct": 100 * (ovs1 - ovs0) / (time.time() - t0),
               "ovs_main_thread_cpu_pct": 100 * (main1 - main0) / (time.time() - t0),
               **{f"e2e_{k2}_ms": v for k2, v in summary(e2e).items() if k2 != "n"},
               **{f"controller_{k2}_ms": v for k2, v in summary(ctl).items() if k2 != "n"}}
        if alone_too:
            row.update({"switch_alone_pairs_per_s": alone["pairs_per_s"],
                        **{f"switch_alone_{k2}_ms": v for k2, v in summary(alone["latencies_ms"]).items()
                           if k2 in ("median", "p99")},
                        "switch_alone_main_thread_cpu_pct": alone["ovs_main_thread_cpu_pct"],
                        "switch_alone_flow_removed": alone["flow_removed"], "switch_alone_errors": alone["errors"]})
            print(f"    the switch alone: {alone['pairs_per_s']:.0f} pairs/s, p50 {f(row['switch_alone_median_ms'])} "
                  f"p99 {f(row['switch_alone_p99_ms'])} ms, main thread "
                  f"{row['switch_alone_main_thread_cpu_pct']:.0f} %, {alone['flow_removed']} flow-removed, "
                  f"{alone['errors']} errors", flush=True)
        res.add(row)
        print(f"    shunted {row['shunted']}/{row['created']} at {row['achieved_rate']:.0f}/s, e2e p50 "
              f"{f(row['e2e_median_ms'])} p99 {f(row['e2e_p99_ms'])} ms, controller p99 "
              f"{f(row['controller_p99_ms'])} ms, overflows {row['netlink_overflows']}, CPU controller "
              f"{row['controller_cpu_pct']:.0f} % ovs-vswitchd {row['ovs_vswitchd_cpu_pct']:.0f} % (main thread "
              f"{row['ovs_main_thread_cpu_pct']:.0f} %)", flush=True)
        if row["e2e_p99_ms"] > 100 or row["lost"] > 0:
            print("    stopping: p99 over 100 ms or events lost", flush=True)
            break
    body = ["End to end: entry created (netlink feed) or connect() called (TCP feed) -> flows confirmed by the "
            "switch. Controller: event read from netlink -> confirmed. OVS main thread: the ovs-vswitchd thread that "
            "applies flow-mods, expires idle flows and sends flow-removed (one core at most: near 100 % the switch "
            "is the limit).", "",
            "| offered /s | shunted /s | shunted | lost | e2e p50 ms | e2e p99 ms | e2e max ms | ctl p50 ms | "
            "ctl p99 ms | overflows | CPU % | OVS CPU % | OVS main thread CPU % | RSS MB | the switch alone: pairs/s "
            "| p50 ms | p99 ms | OVS main thread CPU % |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res.rows:
        alone_cells = (f"{r['switch_alone_pairs_per_s']:.0f} | {f(r['switch_alone_median_ms'])} | "
                       f"{f(r['switch_alone_p99_ms'])} | {r['switch_alone_main_thread_cpu_pct']:.0f}"
                       if "switch_alone_p99_ms" in r else "– | – | – | –")
        body.append(f"| {r['offered_rate']:g} | {r['achieved_rate']:.0f} | {r['shunted']} | {r['lost']} | "
                    f"{f(r['e2e_median_ms'])} | {f(r['e2e_p99_ms'])} | {f(r['e2e_max_ms'])} | "
                    f"{f(r['controller_median_ms'])} | {f(r['controller_p99_ms'])} | {r['netlink_overflows']} | "
                    f"{r['controller_cpu_pct']:.0f} | {r['ovs_vswitchd_cpu_pct']:.0f} | "
                    f"{r['ovs_main_thread_cpu_pct']:.0f} | "
                    f"{r['controller_rss_mb']:.0f} | {alone_cells} |")
    print(f"report: {res.report(f'Shunt rate ({feed} feed)', body, False)}")
    return 0


# --- scale -------------------------------------------------------------------------------------------

def switch_connected_at(log_path: str, after: float) -> float | None:
    """When the controller's JSON log first says the switch connected at or after `after`
    (its `ts`): a restart's reconcile is the switch's reconnect (its backoff, a switch
    setting) and then the controller's own work, reported apart."""
    with open(log_path, errors="replace") as fh:
        for line in fh:
            if "connected from" not in line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("ts", 0) >= after and " connected from " in rec.get("message", ""):
                return float(rec["ts"])
    return None


def bench_scale(args: argparse.Namespace) -> int:
    sizes = args.sizes or ([1000] if args.quick else [1000, 10000, 100000])
    res = Results(args.out, "scale", {"sizes": sizes, "entries": "UDP conntrack entries created over netlink "
                                      "(2 flows per shunt)", "shunt idle timeout": "3600 s",
                                      "reconcile": "controller restarted (flows kept); time until every shunt is "
                                      "adopted from the switch's flow stats; the switch's reconnect (from its "
                                      "controller log line) and the rest reported apart; beside it, the switch alone "
                                      "reporting the same flows to a reader that only counts them (median of 3)",
                                      "decided and sent": "until the controller counts every entry as a shunt "
                                      "(sent or confirmed; entries whose conntrack id another pair holds wait)"})
    for size in sizes:
        with Testbed(mode="nfshunt", config={"log_format": "json", "log_level": "INFO",
                                             "default_shunt_timeout": 3600, "delete_flows_on_shutdown": False},
                     log=print) as tb:
            tb.wait_for_controller()
            pid = tb.controller.pid  # type: ignore[union-attr]
            cpu0, rss0 = proc_usage(pid)
            t0 = time.time()
            print(f"[{size}] creating {size} entries", flush=True)
            feeder = tb.spawn(tb.fw, PYTHON, os.path.join(HERE, "ctfeed.py"), "--rate", "0", "--count", str(size),
                              "--proto", "udp", stdout=subprocess.DEVNULL)
            feeder.wait(timeout=600)
            # Every entry shunted, or the count still for 10 s: entries whose conntrack id
            # another pair holds (a 32-bit id, about one collision in 100,000) rightly wait.
            shunts, last = until_settled(lambda: _shunts_or_none(tb), lambda n, size=size: n >= size, 10, 600, 0.5)
            shunts = shunts or 0
            install_s = last - t0
            idle_s = 0.5 if args.quick else 5  # the idle CPU's window
            cpu1, rss1 = proc_usage(pid)
            time.sleep(idle_s)
            cpu2, rss2 = proc_usage(pid)
            idle_pct = 100 * (cpu2 - cpu1) / idle_s
            time.sleep(0.5 if args.quick else 25)  # at rest: deletes' DESTROY events read, a quiet second, memory back
            _, rss_rest = proc_usage(pid)
            # The switch alone reporting the flows a reconcile reads, to quote beside it.
            reads = [switchlimit.read_seconds(nfconfig.load(tb.config_path), "s1") for _ in range(3)]
            # Reconcile: a restart adopts every pair from the switch.
            tb.restart_controller()
            t1 = time.time()
            tb.wait_for(lambda shunts=shunts: (_shunts_or_none(tb) or 0) >= shunts, 900, "reconcile", interval=0.25)
            reconcile_s = time.time() - t1
            _, rss3 = proc_usage(tb.controller.pid)  # type: ignore[union-attr]
            # The controller writes its log in batches, a line at most a second late.
            deadline, back = time.time() + 5, switch_connected_at(tb.controller_log, t1)
            while back is None and time.time() < deadline:
                time.sleep(0.2)
                back = switch_connected_at(tb.controller_log, t1)
        switch_back_s = back - t1 if back is not None else math.nan
        row = {"active_shunts": shunts, "install_s": install_s, "install_rate": shunts / install_s,
               "cpu_s_install": cpu1 - cpu0, "rss_mb_before": rss0 / 2**20, "rss_mb": rss2 / 2**20,
               "idle_cpu_pct": idle_pct, "rss_mb_at_rest": rss_rest / 2**20, "reconcile_s": reconcile_s,
               "switch_back_s": switch_back_s, "adopted_after_connect_s": reconcile_s - switch_back_s,
               "rss_mb_after_reconcile": rss3 / 2**20, "switch_read_s": statistics.median(r["seconds"] for r in reads),
               "switch_read_entries": reads[0]["entries"]}
        res.add(row)
        print(f"    {size}: RSS {row['rss_mb']:.0f} MB, install {install_s:.1f} s, idle CPU {idle_pct:.1f} %, "
              f"reconcile {reconcile_s:.1f} s (the switch back after {switch_back_s:.1f} s)", flush=True)
    body = md_table(["active shunts", "RSS MB (empty)", "RSS MB", "RSS MB 30 s later", "decided and sent in s",
                     "per s", "CPU s", "CPU % after", "reconcile s", "of which the switch's reconnect s",
                     "adopted after connect s", "the switch alone reports its flows in s", "RSS MB after reconcile"],
                    ([f"{r['active_shunts']}", f"{r['rss_mb_before']:.0f}", f"{r['rss_mb']:.0f}",
                      f"{r['rss_mb_at_rest']:.0f}", f"{r['install_s']:.1f}", f"{r['install_rate']:.0f}",
                      f"{r['cpu_s_install']:.1f}", f"{r['idle_cpu_pct']:.1f}", f"{r['reconcile_s']:.1f}",
                      f"{r['switch_back_s']:.1f}", f"{r['adopted_after_connect_s']:.1f}",
                      f"{r['switch_read_s']:.1f} ({r['switch_read_entries']} flows)",
                      f"{r['rss_mb_after_reconcile']:.0f}"]
                     for r in res.rows))
    print(f"report: {res.report('Scale: memory, CPU, reconcile', body, False)}")
    return 0


# --- burst -------------------------------------------------------------------------------------------

def conntrack_count(tb: Testbed) -> int:
    return int(tb.run(tb.fw, "conntrack", "-C").strip())


def bench_burst(args: argparse.Namespace) -> int:
    sizes = args.sizes or ([2000] if args.quick else [10000, 20000, 100000])
    runs = args.runs or 1
    res = Results(args.out, "burst", {
        "sizes": sizes, "runs per size": runs,
        "entries": "UDP conntrack entries created over netlink in fw as fast as the feeder can (ctfeed --rate 0)",
        "flows per shunt": 2, "shunt idle timeout": "3600 s (nothing idles out)",
        "logging": "INFO, JSON (one line per shunt, as in production)",
        "switch limit": "the same 2N flow-mods, serialised beforehand, written to s1's management socket "
                        "behind one barrier, in the same testbed just before the burst"})
    sampled: list[str] = []
    for size in sizes:
        for run in range(runs):
            with Testbed(mode="nfshunt", config={"log_format": "json", "log_level": "INFO",
                                                 "default_shunt_timeout": 3600}, log=print) as tb:
                tb.wait_for_controller()
                limit = switchlimit.measure(nfconfig.load(tb.config_path), "s1", size)
                if limit["errors"]:
                    raise TestbedError(f"the switch refused {limit['errors']} of the switch-limit run's flow-mods: "
                                       "its rate would not be the rate of the controller's flows")
                pid = tb.controller.pid  # type: ignore[union-attr]
                cpu0, _ = proc_usage(pid)
                ct0 = conntrack_count(tb)
                overflow0 = counts(tb)["counters"].get("netlink_overflows", 0)
                print(f"[{size} #{run + 1}] switch alone: {limit['pairs_per_s']:,.0f} pairs/s; creating {size} "
                      "entries", flush=True)
                path = profile_path(args, res, f"burst-{size}-{run + 1}")
                with profiles.sampled(pid, path):
                    feeder = tb.spawn(tb.fw, PYTHON, os.path.join(HERE, "ctfeed.py"), "--rate", "0", "--count",
                                      str(size), "--proto", "udp", stdout=subprocess.PIPE)
                    line, _ = feeder.communicate(timeout=600)
                    fed = json.loads(line.strip().splitlines()[-1])
                    # Until every created entry is deleted, or none is for 30 s (an entry whose
                    # conntrack id a live pair holds waits on the slow path until that pair goes).
                    # deleted_at: the last deletion seen; entries_left says how many wait.
                    left, deleted_at = until_settled(lambda base=ct0: conntrack_count(tb) - base, lambda n: n <= 0,
                                                     30, max(60.0, size / 100), 0.1)
                if path:
                    sampled.append(path)
                cpu1, rss = proc_usage(pid)
                st = counts(tb)
                overflows = st["counters"].get("netlink_overflows", 0) - overflow0
                flushed = time.time() + 10  # log lines are written in batches
                while len(inst := [e["ts"] for e in log_events(tb, "installed")]) < fed["created"] \
                        and time.time() < flushed:
                    time.sleep(0.5)
            start = fed["start"]
            confirmed_s = (max(inst) - start) if inst else math.nan
            deleted_s = deleted_at - start
            row = {"burst": size, "run": run, "created": fed["created"], "fed_s": fed["end"] - start,
                   "shunted": len(inst), "confirmed_s": confirmed_s, "shunts_per_s": len(inst) / confirmed_s,
                   "deleted_s": deleted_s, "entries_left": max(0, left),
                   "switch_pairs_per_s": limit["pairs_per_s"],
                   "ratio": (len(inst) / confirmed_s) / limit["pairs_per_s"],
                   "netlink_overflows": overflows, "controller_cpu_s": cpu1 - cpu0, "controller_rss_mb": rss / 2**20,
                   # why entries are left: waiting (an id a live pair holds, no room), refused, the switch lost
                   "waiting": st["waiting"], "refused": st["counters"].get("refused:shunt", 0),
                   "install_timeouts": st["counters"].get("install_timeouts", 0),
                   "switch_disconnects": st["counters"].get("switch_disconnects", 0)}
            res.add(row)
            print(f"    shunted {row['shunted']}/{row['created']} in {f(confirmed_s)} s: "
                  f"{row['shunts_per_s']:,.0f}/s = {row['ratio']:.2f} of the switch's {limit['pairs_per_s']:,.0f}; "
                  f"entries deleted in {f(deleted_s)} s ({row['entries_left']} left); overflows {overflows}; "
                  f"CPU {row['controller_cpu_s']:.1f} s; RSS {row['controller_rss_mb']:.0f} MB; "
                  f"waiting {row['waiting']}, refused {row['refused']}, install timeouts {row['install_timeouts']}, "
                  f"switch disconnects {row['switch_disconnects']}", flush=True)
    body = ["Seconds from the feeder's first entry. Shunts/s: pairs confirmed by barrier over that span. "
            "The switch alone: the same flow-mods written straight to it, pairs/s. Ratio: controller / switch.", "",
            *md_table(["burst", "shunted", "confirmed s", "shunts/s", "switch alone pairs/s", "ratio",
                       "entries deleted s", "entries left", "waiting", "refused", "overflows", "CPU s", "RSS MB"],
                      ([f"{r['burst']}", f"{r['shunted']}", f(r['confirmed_s']), f"{r['shunts_per_s']:,.0f}",
                        f"{r['switch_pairs_per_s']:,.0f}", f"{r['ratio']:.2f}", f(r['deleted_s']),
                        f"{r['entries_left']}", f"{r['waiting']}", f"{r['refused']}", f"{r['netlink_overflows']}",
                        f"{r['controller_cpu_s']:.1f}", f"{r['controller_rss_mb']:.0f}"]
                       for r in res.rows))]
    if sampled:
        body += profile_section(sampled)
    print(f"report: {res.report('Burst: shunts a second against the switch alone', body, False)}")
    return 0


def _streams(n: int, run: int) -> list[dict[str, Any]]:
    """n engineered streams, host to host, distinct from every other run's."""
    return [{"name": f"r{run}-{i}", "protocol": "udp", "src": f"10.{100 + run}.{i // 250}.{i % 250 + 1}",
             "dst": "10.0.0.2", "dst_port": 30000, "fast_ports": [1, 3]} for i in range(n)]


def bench_reload(args: argparse.Namespace) -> int:
    sizes = args.sizes or ([1, 10] if args.quick else [1, 100, 1000])
    runs = args.runs or (1 if args.quick else 5)
    res = Results(args.out, "reload", {
        "streams changed": sizes, "runs per size": runs,
        "stream": "UDP host to host, both directions (2 flows a stream), OpenFlow 1.3",
        "measured": "controller: request on its event loop -> file read and validated -> flow-mods sent -> "
                    "barrier reply; client: `reload` request sent on the control socket -> answer",
        "switch alone": "2N flow-mods of exact-match pairs, serialised beforehand, written to s1's management "
                        "socket behind one barrier (bench/switchlimit.py), in the same testbed"})
    with Testbed(mode="nfshunt", config={"log_level": "INFO"}, log=print) as tb:
        tb.wait_for_controller()
        base = tb.nfshunt_config()

        def reload_to(streams: list[dict[str, Any]]) -> tuple[dict[str, Any], float]:
            with open(tb.config_path, "w") as fh:
                json.dump({**base, "static_shunts": streams}, fh)
            t0 = time.monotonic()
            reply = tb.control({"cmd": "reload"}, timeout=30)
            return reply, time.monotonic() - t0
        for size in sizes:
            limit = switchlimit.measure(nfconfig.load(tb.config_path), "s1", size)
            for run in range(runs):
                streams = _streams(size, run)
                for change, target in (("add", streams), ("remove", [])):
                    reply, client_s = reload_to(target)
                    if not reply.get("confirmed"):
                        raise TestbedError(f"reload of {size} streams not confirmed: {reply}")
                    row = {"streams": size, "run": run, "change": change, "flows": 2 * size,
                           "validated_ms": reply["validated_ms"], "confirmed_ms": reply["confirmed_ms"],
                           "client_ms": client_s * 1000, "switch_alone_ms": size / limit["pairs_per_s"] * 1000}
                    res.add(row)
                    print(f"[{size} #{run + 1} {change}] confirmed in {row['confirmed_ms']:.1f} ms "
                          f"(validated {row['validated_ms']:.1f} ms, client {row['client_ms']:.1f} ms); "
                          f"switch alone {row['switch_alone_ms']:.1f} ms", flush=True)
    rows = []
    for size in sizes:
        for change in ("add", "remove"):
            sel = [r for r in res.rows if r["streams"] == size and r["change"] == change]
            conf = summary([r["confirmed_ms"] for r in sel])
            rows.append([f"{size}", change, f"{2 * size}", f(summary([r['validated_ms'] for r in sel])['median']),
                         f(conf["median"]), f(conf["max"]), f(summary([r['client_ms'] for r in sel])['median']),
                         f(sel[0]["switch_alone_ms"]) if sel else "–"])
    body = ["Milliseconds, median (and max) over the runs. Confirmed: from the request reaching the controller's "
            "event loop to the switch's barrier reply after the last flow-mod. Switch alone: the switch's own time "
            "for as many flow-mods (adds), written straight to it.", "",
            *md_table(["streams", "change", "flows", "validated", "confirmed", "confirmed max", "client",
                       "switch alone"], rows)]
    print(f"report: {res.report('Reload: static shunts changed without a restart', body, False)}")
    return 0


PROBE = {"cmd": "loop-probe"}  # unknown: the event loop answers it with an error, in its shortest turn


class LoopProbe:
    """Requests the event loop answers at once, sent back to back on the control socket from
    a thread of the bench, each one's round trip kept with when it was sent: the longest is
    an upper bound of how long the loop was held meanwhile. (Not `status`: with 10,000
    static streams a status took a quarter of a second of the loop for its per-flow rows,
    before it only counted them by default; the probe stays the loop's shortest turn.)"""

    def __init__(self, tb: Testbed):
        self.tb = tb
        self.times: list[tuple[float, float]] = []  # (sent, seconds to the answer)
        self.errors = 0  # no answer (the loop's own error is the expected answer)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                reply = self.tb.control(PROBE, timeout=30)
            except Exception:
                reply = {}
            self.times.append((t0, time.monotonic() - t0))
            self.errors += "unknown command" not in str(reply.get("error"))

    def __enter__(self) -> "LoopProbe":
        self._thread.start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        self._stop.set()
        self._thread.join(60)

    def during(self, start: float, end: float) -> list[float]:
        """Round trips (ms) of the requests sent between start and end."""
        return [dt * 1000 for t0, dt in self.times if start <= t0 <= end]

    def overlapping(self, start: float, end: float) -> float:
        """The longest round trip (ms) of a request in flight at any moment between start and end."""
        return max([dt * 1000 for t0, dt in self.times if t0 < end and t0 + dt > start] or [math.nan])


def _status_ms(tb: Testbed) -> float:
    """One status (counts only) round trip, in ms."""
    t0 = time.monotonic()
    tb.control({"cmd": "status", "connections": False}, timeout=30)
    return (time.monotonic() - t0) * 1000


def _hold_streams(n: int, run: int) -> list[dict[str, Any]]:
    """n streams host to host, distinct from every other run's; no name, so that 10,000 of
    them stay inside the config's size limit (1 MiB) written compactly."""
    return [{"protocol": "udp", "src": f"10.{100 + run}.{i // 250}.{i % 250 + 1}", "dst": "10.0.0.2",
             "dst_port": 30000, "fast_ports": [1, 3]} for i in range(n)]


def bench_reload_hold(args: argparse.Namespace) -> int:
    size = (args.sizes or [500 if args.quick else 10000])[0]
    runs = args.runs or (1 if args.quick else 5)
    res = Results(args.out, "reload-hold", {
        "static streams": size, "runs": runs,
        "stream": "UDP host to host, both directions (2 flows a stream), OpenFlow 1.3",
        "change": "a reload adds the streams, the next removes them (config written compactly, no names)",
        "probe": f"`{json.dumps(PROBE)}` requests back to back on the control socket (the event loop answers each "
                 "at once: an unknown command), each timed from the bench, a new connection each; idle: the same for "
                 "2 s before the first reload",
        "status": "one `status` (counts only) round trip after each reload: what it costs with the streams in",
        "controller's own": "the reload's answer: validated_ms (file read, checked, the difference worked out), "
                            "loop_ms_max (the longest turn it took of the event loop), slices, confirmed_ms",
        "switch alone": "2N flow-mods of exact-match pairs, serialised beforehand, written to s1's management "
                        "socket behind one barrier (bench/switchlimit.py), in the same testbed"})
    with Testbed(mode="nfshunt", config={"log_level": "INFO"}, log=print) as tb:
        tb.wait_for_controller()
        base = tb.nfshunt_config()
        limit = switchlimit.measure(nfconfig.load(tb.config_path), "s1", size)
        with LoopProbe(tb) as probe:
            time.sleep(2)
        idle = summary([dt * 1000 for _, dt in probe.times])
        print(f"idle probe: median {idle['median']:.1f} ms, max {idle['max']:.1f} ms ({idle['n']} requests)")
        for run in range(runs):
            for change, streams in (("add", _hold_streams(size, run)), ("remove", [])):
                with open(tb.config_path, "w") as fh:
                    json.dump({**base, "static_shunts": streams}, fh, separators=(",", ":"))
                with LoopProbe(tb) as probe:
                    time.sleep(0.2)
                    t0 = time.monotonic()
                    reply = tb.control({"cmd": "reload"}, timeout=60)
                    t1 = time.monotonic()
                if not reply.get("confirmed"):
                    raise TestbedError(f"reload of {size} streams not confirmed: {reply}")
                during = probe.during(t0, t1)
                waited = probe.overlapping(t0, t1)  # (one sent just before the reload waits for its turns too)
                checked = t0 + reply["validated_ms"] / 1000  # (about: the controller's clock started a little later)
                row = {"streams": size, "run": run, "change": change, "flows": 2 * size,
                       "probe_n": len(during), "probe_errors": probe.errors, "probe_max_ms": waited,
                       "probe_max_validating_ms": probe.overlapping(t0, checked),
                       "probe_max_applying_ms": probe.overlapping(checked, t1),
                       "probe_p99_ms": pct(during, 0.99), "probe_median_ms": pct(during, 0.5),
                       "loop_ms_max": reply.get("loop_ms_max", math.nan), "slices": reply.get("slices", 1),
                       "validated_ms": reply["validated_ms"], "confirmed_ms": reply["confirmed_ms"],
                       "client_ms": (t1 - t0) * 1000, "idle_probe_median_ms": idle["median"],
                       "idle_probe_max_ms": idle["max"], "status_ms": _status_ms(tb),
                       "switch_alone_ms": size / limit["pairs_per_s"] * 1000}
                res.add(row)
                print(f"[#{run + 1} {change}] the probe waited at most {waited:.1f} ms (validating "
                      f"{row['probe_max_validating_ms']:.1f}, applying {row['probe_max_applying_ms']:.1f}; "
                      f"p99 {row['probe_p99_ms']:.1f}, {len(during)} requests); the controller's longest turn "
                      f"{row['loop_ms_max']:.1f} ms in {row['slices']} slices; validated "
                      f"{row['validated_ms']:.0f} ms, confirmed {row['confirmed_ms']:.0f} ms; a status after it "
                      f"{row['status_ms']:.0f} ms; switch alone {row['switch_alone_ms']:.0f} ms", flush=True)
    body = ["Milliseconds: median over the runs, and the spread (min-max). `probe waited` is the longest round "
            "trip of a probe request in flight at any moment of the reload, measured by the bench: an upper bound "
            "of the event loop's longest hold (it includes the control socket and the scheduling of the bench and "
            f"of the controller's threads; idle, the same requests took {f(idle['median'])} ms median, "
            f"{f(idle['max'])} ms max). `loop turn` is the controller's own measure of its longest turn for the "
            "reload; `validating`, `applying`: the probe's longest wait while the file was read and checked off "
            "the loop, and while the loop took the change in and sent it. `status` is one status (counts only) "
            "right after the reload.", "",
            *md_table(["change", "flows", "probe waited", "validating", "applying", "probe p99", "loop turn", "slices",
                       "validated", "confirmed", "status", "switch alone"],
                      [[change, f"{2 * size}", *(_spread([r[k] for r in res.rows if r["change"] == change])
                                                 for k in ("probe_max_ms", "probe_max_validating_ms",
                                                           "probe_max_applying_ms", "probe_p99_ms", "loop_ms_max",
                                                           "slices",
                                                           "validated_ms", "confirmed_ms", "status_ms",
                                                           "switch_alone_ms"))]
                       for change in ("add", "remove")])]
    print(f"report: {res.report('Reload: how long the event loop is held', body, False)}")
    return 0


def _spread(values: list[float]) -> str:
    vals = [v for v in values if not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return "–"
    return f"{f(pct(vals, 0.5), 1)} ({f(min(vals), 1)}-{f(max(vals), 1)})"


# --- config ------------------------------------------------------------------------------------------

def _static_entries(shape: str, n: int) -> list[dict[str, Any]]:
    """n static streams none of which overlaps another: between one host pair (by client port,
    then server port), from n distinct sources, or as n distinct /28 prefixes."""
    if shape == "host pair":
        return [{"name": f"p{i}", "protocol": "udp", "src": "10.0.0.1", "dst": "10.0.0.2",
                 "src_port": 1024 + i % 60000, "dst_port": 5201 + i // 60000, "fast_ports": [1, 3]} for i in range(n)]
    if shape == "sources":
        return [{"name": f"s{i}", "protocol": "udp", "src": str(ipaddress.ip_address((11 << 24) + i)),
                 "dst": "10.0.0.2", "dst_port": 30000, "fast_ports": [1, 3]} for i in range(n)]
    return [{"name": f"n{i}", "protocol": "tcp", "src": f"{ipaddress.ip_address((11 << 24) + (i << 4))}/28",
             "dst": "10.0.0.0/24", "fast_ports": [1, 3]} for i in range(n)]


def bench_config(args: argparse.Namespace) -> int:
    sizes = args.sizes or ([1000] if args.quick else [10000])
    runs = args.runs or (1 if args.quick else 5)
    res = Results(args.out, "config", {
        "sizes": sizes, "runs per shape": runs, "measured": "nfshunt.config.settings.load: the file read, "
        "parsed and validated (overlaps included), in this process, one after another",
        "file": "indented JSON, one key a line (json.dump indent=2)"})
    base = json.load(open(os.path.join(REPO, "config", "nfshunt.json")))
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            for shape in ("host pair", "sources", "prefixes"):
                path = os.path.join(tmp, "nfshunt.json")
                with open(path, "w") as fh:
                    json.dump({**base, "openflow_versions": ["1.3"], "static_shunts": _static_entries(shape, size)},
                              fh, indent=2)
                times = []
                for _ in range(runs):
                    t0 = time.perf_counter()
                    nfconfig.load(path)
                    times.append((time.perf_counter() - t0) * 1000)
                res.add({"entries": size, "shape": shape, "file_bytes": os.path.getsize(path),
                         "median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)})
                print(f"[{size} {shape}] validated in {_spread(times)} ms", flush=True)
    body = ["Milliseconds to load and validate the whole config, median (min-max).", "",
            *md_table(["entries", "shape", "file MB", "validated ms"],
                      ([f"{r['entries']}", r["shape"], f(r["file_bytes"] / 2**20),
                        f"{f(r['median_ms'], 1)} ({f(r['min_ms'], 1)}-{f(r['max_ms'], 1)})"] for r in res.rows))]
    print(f"report: {res.report('Static shunts validated offline', body, False)}")
    return 0


# --- ids ---------------------------------------------------------------------------------------------

IDS_PORT = 9754
IDS_CLIENT = "bench"


def _ids_config(count: int, tokens: str, conns: int) -> dict[str, Any]:
    """The testbed's IDS section: ctfeed's destination 10.65.0.1:5201 inside ids.may_shunt,
    room for every rule of the run, and for the client's connections (one local user)."""
    return {"listen_port": IDS_PORT, "token_file": tokens, "max_rules": count + 1000, "answer_timeout": 5.0,
            "may_shunt": {"prefixes": ["10.65.0.1/32"], "ports": [5201]},
            "max_connections": max(64, conns), "max_connections_per_client": max(16, conns)}


def _ignored(tb: Testbed) -> int:
    return sum(v for k, v in counts(tb)["counters"].items() if k.startswith("ignored:"))


def _answers(path: str) -> list[dict[str, Any]]:
    with open(path) as fh:
        next(fh)
        out = []
        for line in fh:
            i, due, sent, answered, status, result, error = line.rstrip("\n").split(",", 6)
            out.append({"index": int(i), "due": float(due), "sent": float(sent), "answered": float(answered),
                        "status": int(status), "result": result, "error": error})
    return out


def bench_ids(args: argparse.Namespace) -> int:
    rates = args.rates or ([100] if args.quick else [1000])
    seconds = args.seconds or (2 if args.quick else 60)
    conns = args.connections
    alone_pairs = 1000 if args.quick else 10000
    res = Results(args.out, "ids", {
        "requests": "POST /v1/rules, a TCP connection's shunt each (bench/idsload.py in fw: one thread, "
                    f"{conns} keep-alive HTTP/1.1 connections on the loopback, one request in flight on each, "
                    "bearer token), request i due at i/rate", "offered rates (/s)": rates, "seconds per rate": seconds,
        "live connections": "one conntrack entry per request, created over netlink before the requests (ctfeed "
                            "--rate 0 --action 0: ESTABLISHED, marked by the policy ignore between port groups 1 and "
                            "2, i.e. accepted and left alone), 10.64.x.y:p -> 10.65.0.1:5201 inside ids.may_shunt",
        "timed": "send -> the whole `201 added` answer (the switch confirmed the pair's flows); an answer of any "
                 "other status, a failed connection or no answer within 30 s is counted, never dropped",
        "flows per shunt": "2 (OpenFlow 1.3, pipeline layout: TCP catchers shared in table 1)",
        "shunt idle timeout": f"{args.shunt_timeout} s" + (" (no traffic: from then on, pairs idle out alongside the "
                                                             "installs, each TCP entry re-created by the hand-back)"
                                                             if args.shunt_timeout < seconds else " (none idles out)"),
        "rule expiry": "600 s (every rule stays active)",
        "logging": "INFO, JSON (one line per shunt)",
        "the switch alone": f"(1) {alone_pairs} pairs' flow-mods behind one barrier (its top rate); (2) the same "
                            "rate for as long, a batch and a barrier every 10 ms, flows idling out "
                            "(bench/switchlimit.py sustained), the controller stopped meanwhile; both before the "
                            "requests, in the same testbed"})
    sampled: list[str] = []
    for k, rate in enumerate(rates):
        count = int(rate * seconds)
        start_index = k * 10_000_000 // 8
        folder = tempfile.mkdtemp(prefix="nfshunt-idsbench-")
        tokens = os.path.join(folder, "tokens")
        with open(os.open(tokens, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:
            fh.write(f"{IDS_CLIENT} {os.urandom(16).hex()}\n")
        try:
            with Testbed(mode="nfshunt", config={"log_format": "json", "log_level": "INFO",
                                                 "default_shunt_timeout": args.shunt_timeout,
                                                 "ids": _ids_config(count, tokens, conns)}, log=print) as tb:
                tb.wait_for_controller()
                cfg = nfconfig.load(tb.config_path)
                limit = switchlimit.measure(cfg, "s1", alone_pairs)
                print(f"[{k + 1}/{len(rates)}] the switch alone: {limit['pairs_per_s']:,.0f} pairs/s at most; at "
                      f"{rate}/s for {seconds} s", flush=True)
                alone = _switch_alone(tb, rate, seconds)
                ignored0 = _ignored(tb)
                feeder = tb.spawn(tb.fw, PYTHON, os.path.join(HERE, "ctfeed.py"), "--rate", "0", "--count",
                                  str(count), "--start", str(start_index), "--action", "0", "--proto", "tcp",
                                  stdout=subprocess.PIPE)
                line, _ = feeder.communicate(timeout=600)
                fed = json.loads(line.strip().splitlines()[-1])
                if fed["created"] != count:
                    raise TestbedError(f"ctfeed created {fed['created']} of {count} entries: {fed}")
                # every entry's event decided (ignore) before the first request
                until_settled(lambda base=ignored0: _ignored(tb) - base, lambda n, want=count: n >= want, 5, 120, 0.5)
                pid = tb.controller.pid  # type: ignore[union-attr]
                ovs_pid = ovs_vswitchd_pid()
                cpu0, _ = proc_usage(pid)
                ovs0, main0, busy0, t0 = (proc_usage(ovs_pid)[0], ovs_main_thread_cpu(ovs_pid), machine_busy(),
                                          time.time())
                print(f"    {count} live entries; {count} shunt requests at {rate}/s", flush=True)
                out = os.path.join(tb.workdir, f"ids-{int(rate)}.csv")
                path = profile_path(args, res, f"ids-{int(rate)}")
                with profiles.sampled(pid, path):
                    load = tb.spawn(tb.fw, PYTHON, os.path.join(HERE, "idsload.py"), "--port", str(IDS_PORT),
                                    "--token-file", tokens, "--rate", str(rate), "--count", str(count), "--start",
                                    str(start_index), "--connections", str(conns), "--out", out,
                                    stdout=subprocess.PIPE)
                    line, _ = load.communicate(timeout=seconds + 120)
                if path:
                    sampled.append(path)
                sent = json.loads(line.strip().splitlines()[-1])
                cpu1, rss = proc_usage(pid)
                ovs1, main1, busy1, t1 = (proc_usage(ovs_pid)[0], ovs_main_thread_cpu(ovs_pid), machine_busy(),
                                          time.time())
                answers = _answers(out)
                if args.keep_requests:  # every request's times, for a look at when latency grew
                    shutil.copy(out, args.keep_requests)
                st = counts(tb)
                want = {address(start_index + i) for i in range(count)}
                flushed = time.time() + 5  # log lines are written in batches
                while len(inst := {(e["src"], e["sport"]): e for e in log_events(tb, "installed")
                                   if (e["src"], e["sport"]) in want}) < count and time.time() < flushed:
                    time.sleep(0.5)
        finally:
            os.unlink(tokens)
            os.rmdir(folder)
        added = [a for a in answers if a["status"] == 201 and a["result"] == "added"]
        lat = [(a["answered"] - a["sent"]) * 1000 for a in added]
        from_due = [(a["answered"] - a["due"]) * 1000 for a in added]
        late = [(a["sent"] - a["due"]) * 1000 for a in answers if a["sent"]]
        # The answer's legs, from the controller's `installed` line (ts: confirmed; latency_ms: lookup -> confirmed)
        legs = [(a, inst[address(a["index"])]) for a in added if address(a["index"]) in inst]
        before = [(e["ts"] - e["latency_ms"] / 1000 - a["sent"]) * 1000 for a, e in legs]
        ctl = [e["latency_ms"] for _, e in legs]
        after = [(a["answered"] - e["ts"]) * 1000 for a, e in legs]
        outcomes = Counter(f"{a['status']} {a['result'] or '-'}{' ' + a['error'] if a['error'] else ''}"
                           for a in answers)
        span = max(a["answered"] for a in added) - sent["start"] if added else math.nan
        wall = t1 - t0
        row = {"offered_rate": rate, "seconds": seconds, "connections": conns, "requests": count,
               "answered": sum(1 for a in answers if a["status"]), "added": len(added),
               "not_added": count - len(added),
               "outcomes": "; ".join(f"{k2}: {v}" for k2, v in sorted(outcomes.items())),
               "sent_rate": sent["achieved_rate"], "added_rate": len(added) / span if added else 0.0,
               **{f"{k2}_ms": v for k2, v in summary(lat).items() if k2 != "n"},
               "from_due_p99_ms": pct(from_due, 0.99), "send_late_p99_ms": pct(late, 0.99),
               "send_late_max_ms": max(late) if late else math.nan,
               "to_lookup_median_ms": pct(before, 0.5), "to_lookup_p99_ms": pct(before, 0.99),
               "lookup_to_confirmed_median_ms": pct(ctl, 0.5), "lookup_to_confirmed_p99_ms": pct(ctl, 0.99),
               "confirmed_to_answer_median_ms": pct(after, 0.5), "confirmed_to_answer_p99_ms": pct(after, 0.99),
               "installed": len(inst), "controller_cpu_pct": 100 * (cpu1 - cpu0) / wall,
               "controller_rss_mb": rss / 2**20, "ovs_vswitchd_cpu_pct": 100 * (ovs1 - ovs0) / wall,
               "ovs_main_thread_cpu_pct": 100 * (main1 - main0) / wall,
               "client_cpu_pct": 100 * sent.get("cpu_s", math.nan) / wall,
               # the machine's other work meanwhile (the cores are shared: another run of the test suite shows here)
               "rest_of_machine_cpu_pct": 100 * ((busy1 - busy0) - (cpu1 - cpu0) - (ovs1 - ovs0)
                                                 - sent.get("cpu_s", math.nan)) / wall,
               "ids_refused": sum(v for k2, v in st["counters"].items() if k2.startswith("ids_refused")),
               "handler_errors": st["counters"].get("handler_errors", 0),
               "switch_max_pairs_per_s": limit["pairs_per_s"], "switch_alone_pairs_per_s": alone["pairs_per_s"],
               "switch_alone_p99_ms": pct(alone["latencies_ms"], 0.99),
               "switch_alone_main_thread_cpu_pct": alone["ovs_main_thread_cpu_pct"]}
        res.add(row)
        print(f"    added {row['added']}/{count} ({row['outcomes']}); send -> added p50 {f(row['median_ms'])} p99 "
              f"{f(row['p99_ms'])} max {f(row['max_ms'])} ms; sent at {f(row['sent_rate'], 0)}/s, added at "
              f"{f(row['added_rate'], 0)}/s; CPU controller {row['controller_cpu_pct']:.0f} % ovs main thread "
              f"{row['ovs_main_thread_cpu_pct']:.0f} %; the switch alone {row['switch_alone_pairs_per_s']:,.0f} "
              f"pairs/s (p99 {f(row['switch_alone_p99_ms'])} ms), at most {row['switch_max_pairs_per_s']:,.0f}",
              flush=True)
    body = ["Milliseconds. Send -> added: from the request's first byte sent to its whole `201 added` answer read "
            "(the switch confirmed the pair's flows by barrier). From due: from when the request was due by the "
            "schedule (a request waits when every connection has one in flight). The legs, from the controller's "
            "`installed` log line: send -> the API thread's conntrack lookup (HTTP, token, parse), lookup -> the "
            "switch's confirmation (event loop, flow-mods, barrier), confirmation -> the answer read by the client.",
            "", *md_table(["offered /s", "requests", "added", "other answers", "sent /s", "added /s", "p50", "p99",
                           "max", "p99 from due", "p99 late send", "legs p50: to lookup / to confirmed / to answer",
                           "legs p99", "CPU % ctl", "CPU % OVS (main thread)", "CPU % client",
                           "CPU % rest of machine", "the switch alone at this rate: pairs/s (p99 ms)",
                           "the switch's top rate pairs/s"],
                          ([f"{r['offered_rate']:g}", f"{r['requests']}", f"{r['added']}",
                            r["outcomes"] if r["not_added"] else "none", f(r["sent_rate"], 0), f(r["added_rate"], 0),
                            f(r["median_ms"]), f(r["p99_ms"]), f(r["max_ms"]), f(r["from_due_p99_ms"]),
                            f(r["send_late_p99_ms"]),
                            f"{f(r['to_lookup_median_ms'])} / {f(r['lookup_to_confirmed_median_ms'])} / "
                            f"{f(r['confirmed_to_answer_median_ms'])}",
                            f"{f(r['to_lookup_p99_ms'])} / {f(r['lookup_to_confirmed_p99_ms'])} / "
                            f"{f(r['confirmed_to_answer_p99_ms'])}",
                            f"{r['controller_cpu_pct']:.0f}",
                            f"{r['ovs_vswitchd_cpu_pct']:.0f} ({r['ovs_main_thread_cpu_pct']:.0f})",
                            f(r["client_cpu_pct"], 0), f(r["rest_of_machine_cpu_pct"], 0),
                            f"{r['switch_alone_pairs_per_s']:,.0f} ({f(r['switch_alone_p99_ms'])})",
                            f"{r['switch_max_pairs_per_s']:,.0f}"] for r in res.rows))]
    if sampled:
        body += profile_section(sampled)
    print(f"report: {res.report('IDS requests: shunts of live connections over the API', body, False)}")
    return 0


def _shunts_or_none(tb: Testbed) -> int | None:
    try:
        return counts(tb)["shunts"]
    except Exception:
        return None


def parse_args(argv: Iterable[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench", choices=["latency", "rate", "scale", "burst", "reload", "reload-hold", "ids", "config",
                                     "all"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", action="store_true", help="latency, burst, ids: sample the controller with py-spy "
                    "while the load runs; the report says where its time went (bench/profiles.py)")
    ap.add_argument("--out", help="output directory (default bench/results/<bench>-<time>)")
    ap.add_argument("--runs", type=int)
    ap.add_argument("--bitrate", default="100M", help="latency: iperf3 rate of each run (default 100M)")
    ap.add_argument("--feed", choices=["netlink", "tcp"], default="netlink")
    ap.add_argument("--proto", choices=["tcp", "udp"], default="tcp", help="netlink feed's protocol")
    ap.add_argument("--no-teardown", action="store_true", help="TCP shunts without FIN/RST catchers")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")])
    ap.add_argument("--seconds", type=float, default=0)
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--connections", type=int, default=16, help="ids: the client's keep-alive connections")
    ap.add_argument("--keep-requests", metavar="CSV", help="ids: keep the client's per-request times (index, due, "
                    "sent, answered, status, ...) in this file")
    ap.add_argument("--shunt-timeout", type=int, default=10, help="ids: the shunts' idle timeout (default 10 s, the "
                    "testbed's)")
    return ap.parse_args(argv)


def main(argv: Iterable[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("bench: run as root (network namespaces, Open vSwitch)", file=sys.stderr)
        return 1
    stamp = time.strftime("%Y%m%d-%H%M%S")
    names = ["latency", "rate", "rate-tcp", "scale", "burst"] if args.bench == "all" else [args.bench]
    base = args.out or os.path.join(HERE, "results", f"{args.bench}-{stamp}")
    try:
        for name in names:
            sub = argparse.Namespace(**vars(args))
            sub.out = os.path.join(base, name) if args.bench == "all" else base
            if name == "rate-tcp":
                sub.feed = "tcp"
            {"latency": bench_latency, "rate": bench_rate, "rate-tcp": bench_rate, "scale": bench_scale,
             "burst": bench_burst, "reload": bench_reload, "reload-hold": bench_reload_hold,
             "ids": bench_ids, "config": bench_config}[name](sub)
    except TestbedError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench: interrupted; everything torn down", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
