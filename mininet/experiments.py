#!/usr/bin/env python3
"""The thesis experiments on the emulated testbed.

  timing      shunt timing (thesis Table 4.3): client SYN -> controller sees the marked
              event -> switch confirms the flows -> last packet through the slow path
  throughput  throughput and loss (Table 4.4): direct / NFShunt / firewall only x RTT,
              repeated; loss located per hop; Wilcoxon rank-sum tests
  cwnd        congestion window and throughput over the first seconds (Figure 4.1)
  jitter      one-way delay and jitter of a cyclic UDP stream (industrial TSN traffic, after
              Wüsteney et al.): direct / reactive shunt / firewall only x load on the firewall
  all         the thesis's three (timing, throughput, cwnd), one after the other

Every command has defaults for a real run and --quick for a short one (CI). Results go to
--out (default results/<experiment>-<time>): a CSV of raw values, PNG plots and a markdown
report with the machine and the parameters. Progress is printed as it goes; Ctrl-C stops
cleanly, tears the testbed down and keeps what was measured so far.

Emulation (see linkemu.py): links scaled down from the thesis's 10 Gbit/s to --link-mbit
(default 1000, what a 2-core userspace switch forwards without loss), MTU 9000 and the
thesis host tuning, half the RTT on each host (netem, or NFQUEUE where there is no netem),
and a slow path limited to --slow-mbit with a --slow-buffer-kb buffer.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from nfshunt_testbed.bed import (  # noqa: E402
    FAST1,
    FAST2,
    H1_IP,
    H2_IP,
    IGNORE_PORT,
    REPO,
    SHUNT_PORT,
    SWITCH_RX_BUFFER,
    Testbed,
    TestbedError,
    machine_info,
)
from nfshunt_testbed.cyclicstream import FRAME_BYTES, CyclicStream, delay_stats  # noqa: E402
from nfshunt_testbed.linkemu import DELAY_MECHANISMS, Emulation, stop_process  # noqa: E402

MODES = ("direct", "nfshunt", "firewall")
# The throughput experiment's routed row (docs/routed.md): the same three paths through a routing
# firewall (mode routed: h1 and h2 in two subnets, the firewall their gateway).
ROUTED_MODES = ("direct-routed", "nfshunt-routed", "firewall-routed")
THROUGHPUT_MODES = MODES + ROUTED_MODES
MODE_LABEL = {"direct": "direct switching", "nfshunt": "NFShunt", "firewall": "firewall only",
              "direct-routed": "direct routing (the switch routes)", "nfshunt-routed": "NFShunt, routed",
              "firewall-routed": "routing firewall only"}
# mode -> the testbed's mode and config. firewall-routed: experimental_routed off, so the
# controller leaves every connection on the router (counted); direct-routed: the switch routes
# (Testbed.route_on_switch) every IPv4 packet between h1 and h2.
# Routed shunts are built in the single flow layout only.
TESTBED_OF = {"direct-routed": ("routed", {}),
              "nfshunt-routed": ("routed", {"experimental_routed": True, "flow_layout": "single"}),
              "firewall-routed": ("routed", {})}


def throughput_testbed(mode: str, emu: Emulation) -> Testbed:
    bed_mode, config = TESTBED_OF.get(mode, (mode, {}))
    return Testbed(mode=bed_mode, config=config, emulation=emu, log=print)


# --- small statistics ------------------------------------------------------------------------

# The thesis's figures (Pica8 P-3290, Cisco ASA 5585, 10 Gbit/s, netem, 100 runs a cell).
THESIS_TABLE_4_3 = {"event_ms": (3.3, 0.30), "confirmed_ms": (58.0, 0.69), "last_slow_ms": (75.8, 0.04)}
THESIS_TABLE_4_4 = {  # RTT -> path -> (mean Gbit/s, mean loss % or None where the thesis gives none)
    0: {"direct": (9.944, None), "nfshunt": (9.923, 0.00), "firewall": (9.838, 0.05)},
    100: {"direct": (9.678, None), "nfshunt": (9.690, None), "firewall": (5.337, 0.10)},
    200: {"direct": (9.332, None), "nfshunt": (9.334, None), "firewall": (4.197, 0.21)},
    400: {"direct": (5.978, None), "nfshunt": (5.957, None), "firewall": (3.094, 0.21)},
}
SCALING = ("Scaling: the thesis ran 10 Gbit/s hosts through a Pica8 P-3290 and a Cisco ASA 5585 with netem "
           "delay; this testbed runs 1 Gbit/s host links (what a 2-core userspace Open vSwitch forwards without "
           "loss) through Open vSwitch's userspace datapath and a Linux bridge shaped to 900 Mbit/s with a 4 MB "
           "buffer (calibrated to the thesis firewall's loss), with netem where the kernel has it and an NFQUEUE "
           "delay program where it does not.")


def describe(values: list[float]) -> dict[str, float]:
    vals = sorted(v for v in values if not math.isnan(v))
    if not vals:
        return {"n": 0, "mean": math.nan, "sd": math.nan, "median": math.nan, "p99": math.nan, "max": math.nan}
    p99 = vals[min(len(vals) - 1, math.ceil(0.99 * len(vals)) - 1)]
    return {"n": len(vals), "mean": statistics.fmean(vals), "sd": statistics.stdev(vals) if len(vals) > 1 else 0.0,
            "median": statistics.median(vals), "p99": p99, "max": vals[-1]}


def ranksum(a: list[float], b: list[float]) -> float:
    """Two-sided Wilcoxon rank-sum (Mann-Whitney U) p-value; 1 when every value of both is
    the same (no loss in any run of either path: nothing tells them apart)."""
    if len(a) < 2 or len(b) < 2:
        return math.nan
    if len(set(a) | set(b)) < 2:
        return 1.0
    from scipy.stats import mannwhitneyu
    return float(mannwhitneyu(a, b, alternative="two-sided").pvalue)


# --- output -------------------------------------------------------------------------------------

class Results:
    """One experiment's output directory: CSV rows, plots, and the markdown report."""

    def __init__(self, out: str, name: str, params: dict[str, Any]):
        os.makedirs(out, exist_ok=True)
        self.out, self.name, self.params = out, name, params
        self.rows: list[dict[str, Any]] = []
        self.started = time.time()
        self.machine = machine_info()

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self.write_csv()   # after every run, so an interrupted experiment keeps its data

    def write_csv(self, rows: list[dict[str, Any]] | None = None, suffix: str = "") -> str:
        rows = self.rows if rows is None else rows
        path = os.path.join(self.out, f"{self.name}{suffix}.csv")
        if rows:
            keys: list[str] = []
            for r in rows:
                keys += [k for k in r if k not in keys]
            with open(path, "w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=keys)
                w.writeheader()
                w.writerows(rows)
        return path

    def report(self, title: str, body: list[str], interrupted: bool) -> str:
        m = self.machine
        lines = [f"# {title}", ""]
        if interrupted:
            lines += ["**Interrupted**: the tables cover the runs completed before the stop.", ""]
        lines += [f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(self.started))}, "
                  f"{time.time() - self.started:.0f} s.", "",
                  "| machine | |", "|---|---|",
                  f"| cores | {m['cores']} ({m['cpu']}) |", f"| kernel | {m['kernel']} |",
                  f"| Open vSwitch | {m['ovs']}, {m['datapath']} datapath |", f"| Python | {m['python']} |", "",
                  "| parameter | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in self.params.items()]
        lines += ["", *body, ""]
        path = os.path.join(self.out, f"{self.name}.md")
        with open(path, "w") as fh:
            fh.write("\n".join(lines))
        return path


def plot(path: str, draw: Callable[[Any], None], size: tuple[float, float] = (9, 6)) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = plt.figure(figsize=size)
    draw(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def fmt(x: float, digits: int = 2) -> str:
    return "–" if isinstance(x, float) and math.isnan(x) else f"{x:.{digits}f}"


def progress(i: int, n: int, msg: str) -> None:
    print(f"[{i}/{n}] {msg}", flush=True)


def emulation(args: argparse.Namespace, rtt: float) -> Emulation:
    return Emulation.thesis(rtt_ms=rtt, delay=args.delay, link_mbit=args.link_mbit, slow_mbit=args.slow_mbit,
                            slow_buffer_kb=args.slow_buffer_kb)


def emulation_params(args: argparse.Namespace) -> dict[str, Any]:
    return {"link rate": f"{args.link_mbit:g} Mbit/s per host link (thesis: 10 Gbit/s; scaled to this machine)",
            "MTU": "9000 (thesis)", "host tuning": "txqueuelen 10000, tcp_rmem/tcp_wmem max 500 MB (thesis)",
            "slow path": f"{args.slow_mbit:g} Mbit/s, {args.slow_buffer_kb} KB buffer per direction (tbf)",
            "delay": f"half the RTT on each host, mechanism {args.delay}",
            "switch port buffer": f"{SWITCH_RX_BUFFER // 2**20} MB per port (the userspace switch's packet "
                                  "sockets; 208 KB by default)"}


# --- experiment 1: shunt timing ----------------------------------------------------------------

def tcp_segments(path: str) -> Iterator[tuple[float, bytes]]:
    """(time, TCP header and what follows) of each IPv4/TCP frame in a classic pcap file."""
    with open(path, "rb") as fh:
        head = fh.read(24)
        if len(head) < 24:
            return
        magic = struct.unpack("<I", head[:4])[0]
        endian, scale = {0xA1B2C3D4: ("<", 1e-6), 0xA1B23C4D: ("<", 1e-9),
                         0xD4C3B2A1: (">", 1e-6), 0x4D3CB2A1: (">", 1e-9)}[magic]
        while len(rec := fh.read(16)) == 16:
            sec, frac, incl, _ = struct.unpack(endian + "IIII", rec)
            data = fh.read(incl)
            if len(data) < 34 or data[12:14] != b"\x08\x00" or data[23] != 6:
                continue
            tcp = data[14 + (data[14] & 0x0F) * 4:]
            if len(tcp) >= 14:
                yield sec + frac * scale, tcp


def read_pcap(path: str) -> list[tuple[float, int, int, int]]:
    """(time, sport, dport, tcp flags) of each IPv4/TCP packet in a classic pcap file."""
    return [(t, *struct.unpack("!HH", tcp[:4]), tcp[13]) for t, tcp in tcp_segments(path)]


class Capture:
    """tcpdump on an interface of the root namespace (Open vSwitch's side of a link)."""

    def __init__(self, intf: str, bpf: str, path: str, snaplen: int = 80):
        self.path = path
        self.proc = subprocess.Popen(["tcpdump", "-i", intf, "-n", "-s", str(snaplen), "-U", "-w", path,
                                      "--time-stamp-precision=nano", bpf],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        line = self.proc.stderr.readline() if self.proc.stderr else ""
        if "listening" not in line:
            self.proc.kill()
            raise TestbedError(f"tcpdump on {intf} did not start: {line.strip()}")

    def stop(self) -> list[tuple[float, int, int, int]]:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return read_pcap(self.path)


def controller_installs(tb: Testbed) -> list[dict[str, Any]]:
    out = []
    for line in tb.controller_output().splitlines():
        if line.startswith("{") and '"installed"' in line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def last_of_first_burst(times: list[float], gap: float = 0.5) -> float:
    """The last slow-path packet of the connection's set-up: where a gap > `gap` s first opens."""
    times = sorted(times)
    for a, b in zip(times, times[1:], strict=False):
        if b - a > gap:
            return a
    return times[-1]


def exp_timing(args: argparse.Namespace) -> int:
    rtts = args.rtts or ([0] if args.quick else [0, 100])
    runs = args.runs or (3 if args.quick else 50)
    params = {"runs per RTT": runs, "RTTs (ms)": rtts, "transfer": f"iperf3, {args.seconds:g} s, port {SHUNT_PORT}",
              "capture": "tcpdump on s1-eth1 (client SYN at the switch) and both slow links (s1-eth2, s1-eth4)",
              "last slow-path packet": "last packet of the first burst on the slow links (a gap > 0.5 s ends it)",
              **emulation_params(args)}
    res = Results(args.out, "timing", params)
    total, i = len(rtts) * runs, 0
    interrupted = False
    try:
        for rtt in rtts:
            with Testbed(mode="nfshunt", emulation=emulation(args, rtt), config={"log_format": "json"},
                         log=print) as tb:
                for run in range(runs):
                    i += 1
                    cport = 40000 + run
                    bpf = f"tcp port {cport}"
                    caps: list[Capture] = []
                    try:
                        for intf in ("s1-eth1", "s1-eth2", "s1-eth4"):
                            caps.append(Capture(intf, bpf, os.path.join(tb.workdir, f"{intf}-{run}.pcap")))
                        result = tb.iperf(SHUNT_PORT, args.seconds, cport=cport)
                    finally:
                        pkts = [cap.stop() for cap in caps]
                    syn_pkts, slow_pkts = pkts[0], pkts[1] + pkts[2]
                    syns = [t for t, sp, _, fl in syn_pkts if sp == cport and fl & 0x02 and not fl & 0x10]
                    inst = [e for e in controller_installs(tb) if e.get("sport") == cport]
                    if "error" in result or not syns or not inst or not slow_pkts:
                        progress(i, total, f"rtt={rtt} run {run}: incomplete ({result.get('error', '')}, "
                                           f"{len(syns)} SYN, {len(inst)} installs, {len(slow_pkts)} slow pkts)")
                        continue
                    t0 = syns[0]
                    confirmed = inst[-1]["ts"]
                    event = confirmed - inst[-1]["latency_ms"] / 1000
                    last_slow = last_of_first_burst([t for t, *_ in slow_pkts])
                    row = {"rtt_ms": rtt, "run": run, "rtt_measured_ms": tb.rtt_measured,
                           "delay_mechanism": tb.delay_mechanism, "event_ms": (event - t0) * 1000,
                           "confirmed_ms": (confirmed - t0) * 1000, "last_slow_ms": (last_slow - t0) * 1000,
                           "slow_packets": sum(1 for t, *_ in slow_pkts if t <= last_slow),
                           "gbps": Testbed.iperf_summary(result)["gbps"]}
                    res.add(row)
                    progress(i, total, f"rtt={rtt} run {run}: event {row['event_ms']:.2f} ms, confirmed "
                                       f"{row['confirmed_ms']:.2f} ms, last slow packet {row['last_slow_ms']:.2f} ms")
    except KeyboardInterrupt:
        interrupted = True
    mech = sorted({f"{r['rtt_ms']} ms: measured {r['rtt_measured_ms']:.1f} ms ({r['delay_mechanism']})"
                   for r in res.rows if r.get("rtt_measured_ms")})
    body = ["Milliseconds since the client's SYN reached the switch (thesis, 100 runs: 3.3 ms to the event, "
            "58 ms to flows programmed, 75.8 ms to the last slow-path packet).", "",
            "The policy marks a connection when the server's SYN-ACK crosses the firewall, so with an "
            "emulated RTT the event comes about half an RTT after the SYN (the delay sits on the hosts). "
            "What NFShunt adds is the gap between the event and the confirmation.",
            *([f"RTT before the runs: {', '.join(mech)}."] if mech else []), "",
            "| RTT | event | n | mean | sd | median | p99 |", "|---|---|---|---|---|---|---|"]
    labels = (("event_ms", "controller sees the marked event"),
              ("confirmed_ms", "switch confirms the flows (barrier)"),
              ("last_slow_ms", "last packet through the slow path"))
    for rtt in rtts:
        rows = [r for r in res.rows if r["rtt_ms"] == rtt]
        for key, label in labels:
            d = describe([r[key] for r in rows])
            body.append(f"| {rtt} ms | {label} | {d['n']} | {fmt(d['mean'])} | {fmt(d['sd'])} | "
                        f"{fmt(d['median'])} | {fmt(d['p99'])} |")
    zero = [r for r in res.rows if r["rtt_ms"] == 0]
    if zero:
        body += ["", "### The thesis's Table 4.3 beside ours (no synthetic delay)", "",
                 "| event | thesis mean (sd), ms | ours mean (sd), ms |", "|---|---|---|"]
        for key, label in labels:
            d = describe([r[key] for r in zero])
            body.append(f"| {label} | {THESIS_TABLE_4_3[key][0]} ({THESIS_TABLE_4_3[key][1]}) | "
                        f"{fmt(d['mean'])} ({fmt(d['sd'])}) |")
        body += ["", "The thesis's prototype shelled out to `conntrack` and programmed flows through POX one call at "
                 "a time (58 ms); NFShunt reads marked events from netlink and writes both flows behind one barrier. "
                 + SCALING]
    if res.rows:
        def draw(fig: Any) -> None:
            ax = fig.add_subplot(1, 1, 1)
            keys = ("event_ms", "confirmed_ms", "last_slow_ms")
            data = [[r[k] for r in res.rows if r["rtt_ms"] == rtt] for rtt in rtts for k in keys]
            ax.boxplot(data, labels=[f"{k.replace('_ms', '')}\n{rtt} ms" for rtt in rtts for k in keys])
            ax.set_ylabel("ms since client SYN")
            ax.set_title("Shunt timing")
        plot(os.path.join(args.out, "timing.png"), draw)
        body += ["", "![timing](timing.png)"]
    print(f"report: {res.report('Shunt timing (thesis Table 4.3)', body, interrupted)}")
    return 130 if interrupted else 0


# --- experiment 2: throughput and loss -----------------------------------------------------

BLOCK_RUNS = 5  # runs of one path on one testbed before the next path takes a turn


def interleaved(runs: int, block: int = BLOCK_RUNS, modes: tuple[str, ...] = MODES) -> list[tuple[str, int, int]]:
    """(mode, first run, runs) blocks in which the paths take turns, each block's order
    rotated: a machine that drifts over the hour (another path's leftovers, a busier
    neighbour) shows in every path alike instead of in whichever ran last."""
    out = []
    for k, first in enumerate(range(0, runs, block)):
        order = modes[k % len(modes):] + modes[:k % len(modes)]
        out.extend((mode, first, min(block, runs - first)) for mode in order)
    return out


def exp_throughput(args: argparse.Namespace) -> int:
    # Quick: the one RTT at which the paths differ (the firewall's buffer overflows), two
    # runs a cell so the rank-sum test has numbers to rank, a second a transfer.
    rtts = args.rtts or ([100] if args.quick else [0, 100, 200, 400])
    runs = args.runs or (2 if args.quick else 20)
    seconds = args.seconds if args.seconds else (1 if args.quick else 12)
    params = {"runs per cell": runs, "RTTs (ms)": rtts, "modes": ", ".join(THROUGHPUT_MODES),
              "routed modes": "h1 10.0.1.1/24 and h2 10.0.2.1/24 behind a routing firewall (their gateway); "
                              "NFShunt with experimental_routed; the firewall alone; the switch routing",
              "order": f"per RTT, the paths take turns in blocks of {BLOCK_RUNS} runs, each on a fresh testbed",
              "transfer": f"one iperf3 TCP stream h1 -> h2, {seconds:g} s, port {SHUNT_PORT} (shunted by the policy)",
              "loss": "h1-eth0 tx minus packets h2 accepted, per hop from interface, qdisc and queue counters",
              **emulation_params(args)}
    res = Results(args.out, "throughput", params)
    total, i = len(rtts) * len(THROUGHPUT_MODES) * runs, 0
    interrupted = False
    try:
        for rtt in rtts:
            for mode, first, count in interleaved(runs, modes=THROUGHPUT_MODES):
                with throughput_testbed(mode, emulation(args, rtt)) as tb:
                    if mode in ROUTED_MODES:
                        tb.pin_neighbours()  # (no ARP of the router's own on the hop counters)
                    if mode == "direct-routed":
                        tb.route_on_switch()
                    for run in range(first, first + count):
                        i += 1
                        before = tb.settled_hop_counters()
                        result = tb.iperf(SHUNT_PORT, seconds, grace=15 + rtt / 100)
                        loss = tb.locate_loss(before, tb.settled_hop_counters())
                        s = Testbed.iperf_summary(result)
                        row = {"rtt_ms": rtt, "mode": mode, "run": run, "rtt_measured_ms": tb.rtt_measured,
                               "delay_mechanism": tb.delay_mechanism, "gbps": s["gbps"],
                               "retransmits": s["retransmits"], "tcp_rtt_ms": s["mean_rtt_ms"],
                               "loss_pct": 100 * loss["lost"] / loss["sent"] if loss["sent"] else math.nan,
                               "error": result.get("error", ""),
                               **{f"lost_{k}": v for k, v in loss.items() if k not in ("lost",)}}
                        res.add(row)
                        progress(i, total, f"rtt={rtt} {mode} run {run}: {s['gbps']:.3f} Gbit/s, "
                                           f"loss {fmt(row['loss_pct'], 3)} %, {s['retransmits']} retransmits")
    except KeyboardInterrupt:
        interrupted = True
    body = ["## Throughput and loss (thesis Table 4.4)", "",
            "| RTT | path | runs | Gbit/s mean | sd | loss % mean | retransmits mean | lost at firewall | "
            "lost at switch | lost in receiver queue |", "|---|---|---|---|---|---|---|---|---|---|"]
    for rtt in rtts:
        for mode in THROUGHPUT_MODES:
            rows = [r for r in res.rows if r["rtt_ms"] == rtt and r["mode"] == mode]
            if not rows:
                continue
            g = describe([r["gbps"] for r in rows])
            body.append(f"| {rtt} ms | {MODE_LABEL[mode]} | {len(rows)} | {fmt(g['mean'], 3)} | {fmt(g['sd'], 3)} | "
                        f"{fmt(statistics.fmean(r['loss_pct'] for r in rows), 4)} | "
                        f"{statistics.fmean(r['retransmits'] for r in rows):.0f} | "
                        f"{sum(r['lost_firewall'] for r in rows)} | {sum(r['lost_switch'] for r in rows)} | "
                        f"{sum(r['lost_receiver_delay_queue'] for r in rows)} |")
    body += ["", "## The thesis's Table 4.4 beside ours", "",
             "| RTT | path | thesis Gbit/s | thesis loss % | ours Gbit/s | ours loss % | ours / direct |",
             "|---|---|---|---|---|---|---|"]
    for rtt in rtts:
        direct = [r["gbps"] for r in res.rows if r["rtt_ms"] == rtt and r["mode"] == "direct"]
        for mode in MODES:
            rows = [r for r in res.rows if r["rtt_ms"] == rtt and r["mode"] == mode]
            thesis = THESIS_TABLE_4_4.get(int(rtt), {}).get(mode)
            if not rows or thesis is None:
                continue
            ours = statistics.fmean(r["gbps"] for r in rows)
            ratio = f"{ours / statistics.fmean(direct):.3f}" if direct else "-"
            body.append(f"| {rtt} ms | {MODE_LABEL[mode]} | {thesis[0]:.3f} | "
                        f"{'—' if thesis[1] is None else f'{thesis[1]:.2f}'} | {ours:.3f} | "
                        f"{statistics.fmean(r['loss_pct'] for r in rows):.3f} | {ratio} |")
    body += ["", f"The thesis ran 100 runs a cell; these results have {runs}. " + SCALING + " The firewall's "
             "ratio to direct switching is what compares across the two set-ups, not the absolute rates."]
    body += routed_row(res.rows, rtts)
    body += ["", "## Wilcoxon rank-sum tests (two-sided; p < 0.05: the paths differ)", "",
             "| RTT | comparison | throughput p | loss p | difference in mean Gbit/s |", "|---|---|---|---|---|"]
    tests = []
    for rtt in rtts:
        by = {m: [r for r in res.rows if r["rtt_ms"] == rtt and r["mode"] == m] for m in THROUGHPUT_MODES}
        for a, b in (("nfshunt", "direct"), ("nfshunt", "firewall"), ("nfshunt-routed", "direct-routed"),
                     ("nfshunt-routed", "firewall-routed")):
            if not by[a] or not by[b]:
                continue
            pg = ranksum([r["gbps"] for r in by[a]], [r["gbps"] for r in by[b]])
            pl = ranksum([r["loss_pct"] for r in by[a]], [r["loss_pct"] for r in by[b]])
            diff = statistics.fmean(r["gbps"] for r in by[a]) - statistics.fmean(r["gbps"] for r in by[b])
            tests.append({"rtt_ms": rtt, "a": a, "b": b, "p_throughput": pg, "p_loss": pl, "diff_gbps": diff})
            body.append(f"| {rtt} ms | {MODE_LABEL[a]} vs {MODE_LABEL[b]} | {fmt(pg, 4)} | {fmt(pl, 4)} | "
                        f"{diff:+.3f} |")
    if tests:
        res.write_csv(tests, "-ranksum")
    if runs < 5:
        body += ["", f"With {runs} runs per cell the rank-sum test cannot reach p < 0.05; use --runs 10 or more."]
    if res.rows:
        def draw(fig: Any) -> None:
            for k, (key, label) in enumerate((("gbps", "throughput, Gbit/s"), ("loss_pct", "packet loss, %"))):
                ax = fig.add_subplot(2, 1, k + 1)
                width = 0.8 / len(THROUGHPUT_MODES)
                for j, mode in enumerate(THROUGHPUT_MODES):
                    vals = [[r[key] for r in res.rows if r["rtt_ms"] == rtt and r["mode"] == mode] for rtt in rtts]
                    means = [statistics.fmean(v) if v else 0 for v in vals]
                    sds = [statistics.stdev(v) if len(v) > 1 else 0 for v in vals]
                    ax.bar([x + (j - (len(THROUGHPUT_MODES) - 1) / 2) * width for x in range(len(rtts))], means,
                           width, yerr=sds, label=MODE_LABEL[mode], capsize=3,
                           hatch="//" if mode in ROUTED_MODES else None)
                ax.set_xticks(range(len(rtts)), [f"{r} ms" for r in rtts])
                ax.set_ylabel(label)
                ax.legend()
            fig.axes[0].set_title("Single-stream TCP by path and RTT")
        plot(os.path.join(args.out, "throughput.png"), draw)
        body += ["", "![throughput](throughput.png)"]
    print(f"report: {res.report('Throughput and packet loss', body, interrupted)}")
    return 130 if interrupted else 0


def routed_row(rows: list[dict[str, Any]], rtts: list[Any]) -> list[str]:
    """The routed row beside direct routing (the thesis's firewall bridged: no figures of its own)."""
    body = ["", "## The routed row: a routing firewall (docs/routed.md)", "",
            "NFShunt's routed shunts carry the router's rewrite (dec_ttl, its MACs); direct routing is the "
            "switch doing the same for every packet. The routed beds' neighbour entries are pinned "
            "(Testbed.pin_neighbours), so no ARP of the router's own is counted on the hops.", "",
            "| RTT | path | runs | Gbit/s mean | loss % mean | slow-path packets mean | ours / direct routing |",
            "|---|---|---|---|---|---|---|"]
    for rtt in rtts:
        direct = [r["gbps"] for r in rows if r["rtt_ms"] == rtt and r["mode"] == "direct-routed"]
        for mode in ROUTED_MODES:
            cell = [r for r in rows if r["rtt_ms"] == rtt and r["mode"] == mode]
            if not cell:
                continue
            ours = statistics.fmean(r["gbps"] for r in cell)
            ratio = f"{ours / statistics.fmean(direct):.3f}" if direct and statistics.fmean(direct) else "-"
            body.append(f"| {rtt} ms | {MODE_LABEL[mode]} | {len(cell)} | {ours:.3f} | "
                        f"{fmt(statistics.fmean(r['loss_pct'] for r in cell), 4)} | "
                        f"{statistics.fmean(r['lost_slow_path_packets'] for r in cell):.0f} | {ratio} |")
    return body


# --- experiment 3: congestion window over time ---------------------------------------------

class RxSampler:
    """The receiver's interface byte counter every 100 ms on a thread of its own (netlink,
    in h2's namespace): what crossed the link, not what iperf3 happened to read."""

    def __init__(self, tb: Testbed, period: float = 0.1):
        import threading
        self.tb = tb
        self.period = period
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            out = self.tb.run(self.tb.h2, "ip", "-s", "-j", "link", "show", "dev", "h2-eth0", check=False)
            try:
                rx = json.loads(out)[0]["stats64"]["rx"]["bytes"]
            except (ValueError, KeyError, IndexError):
                rx = None
            if rx is not None:
                self.samples.append((time.monotonic() - self.t0, rx))
            self._stop.wait(self.period)

    def stop(self) -> list[tuple[float, int]]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.samples


def align(samples: list[tuple[float, int]], intervals: list[dict[str, Any]], mark: int = 100_000) -> float:
    """Seconds from the sampler's clock to iperf3's: the moment the receiver has counted
    `mark` bytes of the transfer is the moment iperf3 had sent them (the delay is applied
    after the interface counter), less the control connection's few packets."""
    sent = 0.0
    t_sent = None
    for iv in intervals:
        st = iv["streams"][0]
        if sent + st["bytes"] >= mark:
            t_sent = st["start"] + (st["end"] - st["start"]) * (mark - sent) / max(st["bytes"], 1)
            break
        sent += st["bytes"]
    base = samples[0][1] if samples else 0
    t_rx = next((t for t, b in samples if b - base >= mark), None)
    return 0.0 if t_sent is None or t_rx is None else t_rx - t_sent


def rx_rate(samples: list[tuple[float, int]], start: float, end: float) -> float:
    """Mbit/s received between two times (seconds since sampling began), interpolated."""
    def at(t: float) -> float | None:
        for (t1, b1), (t2, b2) in zip(samples, samples[1:], strict=False):
            if t1 <= t <= t2:
                return b1 + (b2 - b1) * ((t - t1) / (t2 - t1) if t2 > t1 else 0)
        return None
    a, b = at(start), at(end)
    if a is None or b is None or end <= start:
        return math.nan
    return (b - a) * 8 / (end - start) / 1e6

def exp_cwnd(args: argparse.Namespace) -> int:
    rtt = (args.rtts or [100 if args.quick else 200])[0]
    runs = args.runs or (1 if args.quick else 3)
    seconds = args.seconds if args.seconds else (1 if args.quick else 10)  # quick: ten RTTs of slow start
    params = {"RTT": f"{rtt} ms", "runs per path": runs,
              "sampling": "every 100 ms: iperf3's sender snd_cwnd, and the bytes h2-eth0 received (interface counter)",
              "transfer": f"{seconds:g} s", **emulation_params(args)}
    res = Results(args.out, "cwnd", params)
    summaries: list[dict[str, Any]] = []
    total, i = len(MODES) * runs, 0
    interrupted = False
    try:
        for mode in MODES:
            with Testbed(mode=mode, emulation=emulation(args, rtt), log=print) as tb:
                for run in range(runs):
                    i += 1
                    sampler = RxSampler(tb)
                    try:
                        result = tb.iperf(SHUNT_PORT, seconds, interval=0.1, grace=15 + rtt / 100)
                    finally:
                        samples = sampler.stop()
                    intervals = result.get("intervals", [])
                    offset = align(samples, intervals)
                    for iv in intervals:
                        st = iv["streams"][0]
                        res.add({"mode": mode, "run": run, "t": round(st["end"], 3),
                                 "cwnd_kb": st.get("snd_cwnd", 0) / 1024,
                                 "received_mbps": rx_rate(samples, st["start"] + offset, st["end"] + offset),
                                 "retransmits": st.get("retransmits", 0)})
                    s = Testbed.iperf_summary(result)
                    summaries.append({"mode": mode, "run": run, **s})
                    progress(i, total, f"{mode} run {run}: {s['gbps']:.3f} Gbit/s, {s['retransmits']} retransmits")
    except KeyboardInterrupt:
        interrupted = True
    smooth = 3  # samples: a 0.3 s average of the receiver's interface counter
    body = [f"Congestion window and received rate over the first {seconds:g} s at {rtt} ms RTT (thesis Figure "
            "4.1), one panel per path. The bold line is the run with the median throughput, crosses mark its "
            "100 ms samples with retransmissions (losses); the other runs are faint. The received rate is what "
            "the receiver's interface counted (bytes on the wire, before its delay queue), averaged over "
            f"{smooth * 0.1:g} s; the earlier figure used iperf3's own 100 ms receive windows, which count what the "
            "application read and so catch whole receive-buffer bursts, well above the link rate.", "",
            "The thesis's Figure 4.1 shows the same shape at 10 Gbit/s with netem: the firewall's losses cut "
            "the window again and again, while direct switching and NFShunt keep it open. Ours is scaled to "
            f"{args.link_mbit:g} Mbit/s links with {'NFQUEUE' if args.delay != 'netem' else 'netem'} delay "
            "where netem is missing.", ""]
    if res.rows:
        representative = {}
        for mode in MODES:
            done = sorted((s["gbps"], s["run"]) for s in summaries if s["mode"] == mode)
            if done:
                representative[mode] = done[len(done) // 2][1]
        link = args.link_mbit

        def smoothed(values: list[float]) -> list[float]:
            return [statistics.fmean(values[max(0, k - smooth + 1):k + 1]) for k in range(len(values))]

        def draw(fig: Any) -> None:
            axes = fig.subplots(2, len(MODES), sharex=True, sharey="row")
            for col, mode in enumerate(MODES):
                color = {"direct": "tab:green", "nfshunt": "tab:blue", "firewall": "tab:red"}[mode]
                top, bottom = axes[0][col], axes[1][col]
                for run in range(runs):
                    rows = [r for r in res.rows if r["mode"] == mode and r["run"] == run]
                    if not rows:
                        continue
                    bold = run == representative.get(mode)
                    style = {"color": color, "alpha": 1.0 if bold else 0.25, "linewidth": 1.6 if bold else 0.8}
                    t = [r["t"] for r in rows]
                    top.plot(t, [r["cwnd_kb"] / 1024 for r in rows], **style)
                    rate = [0.0 if math.isnan(r["received_mbps"]) else r["received_mbps"] for r in rows]
                    bottom.plot(t, smoothed(rate), **style)
                    if bold:
                        lost = [r for r in rows if r["retransmits"]]
                        top.scatter([r["t"] for r in lost], [r["cwnd_kb"] / 1024 for r in lost], marker="x",
                                    color="black", s=25, zorder=3, label="retransmissions" if col == 0 else None)
                bottom.axhline(link, color="grey", linestyle="--", linewidth=0.8)
                top.set_title(MODE_LABEL[mode])
                bottom.set_xlabel("seconds")
            axes[0][0].set_ylabel("congestion window, MB")
            axes[1][0].set_ylabel(f"received, Mbit/s ({smooth * 0.1:g} s average)")
            axes[1][0].set_ylim(0, link * 1.15)
            if any(r["retransmits"] for r in res.rows):
                axes[0][0].legend(loc="upper left")
            fig.suptitle(f"Congestion window and received rate, RTT {rtt} ms (dashed: link rate)")
        plot(os.path.join(args.out, "cwnd.png"), draw, size=(12, 6.5))
        body += ["![cwnd](cwnd.png)", "", "| path | run | Gbit/s received | retransmits |", "|---|---|---|---|"]
        for s in summaries:
            shown = " (bold)" if representative.get(s["mode"]) == s["run"] else ""
            body.append(f"| {MODE_LABEL[s['mode']]} | {s['run']}{shown} | {s['gbps']:.3f} | {s['retransmits']} |")
    print(f"report: {res.report('Congestion window over time', body, interrupted)}")
    return 130 if interrupted else 0


# --- experiment 4: delay and jitter of a cyclic stream (industrial TSN traffic) ------------

@dataclass(frozen=True)
class JitterPath:
    """One path of the jitter experiment: the testbed mode (and config keys) it runs on.
    `shunted`: the stream ends on the fast path after crossing the firewall zero or more
    times; the frames that crossed it before are counted on the slow path's counters.
    `reactive`: its shunt is decided on the firewall, so its first frames must cross it."""
    key: str
    mode: str
    label: str
    color: str
    shunted: bool = False
    config: tuple[tuple[str, Any], ...] = ()
    reactive: bool = False


JITTER_PATHS = (
    JitterPath("direct", "direct", "direct switching", "tab:green"),
    JitterPath("reactive", "nfshunt", "reactive shunt", "tab:blue", shunted=True, reactive=True),
    JitterPath("firewall", "firewall", "firewall only", "tab:red"),
    # Declared in the config (static_shunts): on the fast path from its first frame.
    JitterPath("static", "nfshunt", "static shunt", "tab:purple", shunted=True,
               config=(("static_shunts", ({"name": "cyclic", "protocol": "udp", "src": H1_IP, "dst": H2_IP,
                                           "dst_port": SHUNT_PORT, "fast_ports": [FAST1, FAST2]},)),)),
)


@dataclass(frozen=True)
class Load:
    """Load on the firewall during a cell: UDP background crossing it (h1 -> h2, a port the
    policy leaves on the slow path) as a share of the nominal link rate, or a CPU hog."""
    key: str
    background_pct: float = 0.0
    cpu_hog: bool = False


JITTER_LOADS = (Load("0%"), Load("2%", 2), Load("10%", 10), Load("15%", 15), Load("cpu hog", cpu_hog=True))
JITTER_QUICK_LOADS = ("0%", "10%")
# The paper's numbers (512-byte frames, 10 s a cell, 1 Gbit/s, hardware stamping 30 ns precise).
PAPER_JITTER = (
    ("switch-chip ACL (FW1), any load", "7.6 µs", "< 0.2 µs (worst case 7.55 / 0.25 µs)"),
    ("CPU filtering FW2, 10–15 % load", "about 10 ms", "2.2 ms"),
    ("CPU filtering FW2, worst case over loads", "8.5 ms", "2.5 ms"),
    ("CPU filtering FW1, worst case over loads", "65 ms", "24 ms (13 ms at any one fixed load)"),
)
RAMP_S = 0.5  # after the background starts, before the window opens
# Each cell's stream from a source port of its own (one of the testbed's fixed client ports):
# a stream on an earlier cell's tuple would find that cell's shunt still on the switch and
# cross the firewall with none of its frames.
CYCLIC_SPORT_BASE = 49100


def wait_until_settled(tb: Testbed, since: float, before: int, reactive: bool, quiet: float = 0.3,
                       timeout: float = 10) -> int:
    """Slow-path packets since the stream started, once the counter has stood still for
    `quiet` s (the stream is on the fast path) and at least 0.5 s of the stream went by; a
    reactive shunt's stream must first have crossed the firewall (its decision is made
    there): a counter still at `before` is then a stream not yet sending (its sender slow to
    start on a loaded machine), not a shunted one: it once read 0 frames before the shunt."""
    last, last_change = tb.slow_path_packets(), time.monotonic()
    deadline = time.monotonic() + timeout
    while True:
        time.sleep(0.05)
        now = tb.slow_path_packets()
        if now != last:
            last, last_change = now, time.monotonic()
        if (last > before or not reactive) and time.monotonic() - since >= 0.5 and \
                time.monotonic() - last_change >= quiet:
            return last
        if time.monotonic() > deadline:
            if last == before and reactive:
                raise TestbedError(f"the stream never crossed the firewall in {timeout:g} s: not sending")
            raise TestbedError(f"the stream still crosses the firewall after {timeout:g} s: no shunt")


def jitter_beds(quick: bool) -> list[list[JitterPath]]:
    """The paths in the order they run, by testbed: a fresh one a path, or in quick mode one
    a testbed mode, the static path after the reactive one on its testbed (its shunts
    declared by a reload: a testbed fewer to build)."""
    if not quick:
        return [[path] for path in JITTER_PATHS]
    beds: dict[str, list[JitterPath]] = {}
    for path in JITTER_PATHS:  # the reactive path first on its testbed (built without static shunts)
        beds.setdefault(path.mode, []).append(path)
    return list(beds.values())


def reload_static_shunts(tb: Testbed, path: JitterPath) -> None:
    """The running controller given the path's config keys by `reload` (static_shunts is a
    live key); returns once the switch confirmed the flows."""
    with open(tb.config_path, "w") as fh:
        json.dump({**tb.nfshunt_config(), **dict(path.config)}, fh)
    reply = tb.control({"cmd": "reload"}, timeout=30)
    if not reply.get("confirmed"):
        raise TestbedError(f"{path.key}: the reload of its config was not confirmed: {reply}")


def background_load(tb: Testbed, load: Load, link_mbit: float, seconds: float) -> list[subprocess.Popen]:
    """The cell's load, as testbed processes (stopped by the cell, or by the testbed)."""
    procs = []
    if load.background_pct:
        procs.append(tb.iperf_server(IGNORE_PORT))
        procs.append(tb.spawn(tb.h1, "iperf3", "-c", H2_IP, "-p", str(IGNORE_PORT), "-u", "-l", "1472",
                              "-b", f"{link_mbit * load.background_pct / 100:g}M", "-t", f"{seconds:g}"))
    if load.cpu_hog:   # one busy loop per core in the firewall's namespace
        procs += [tb.spawn(tb.fw, sys.executable, "-c", "while True: pass") for _ in range(os.cpu_count() or 1)]
    return procs


def jitter_cell(tb: Testbed, path: JitterPath, load: Load, cycle_us: int, seconds: float, link_mbit: float,
                index: int) -> dict[str, Any]:
    tb.run(tb.h1, "ping", "-n", "-c", "1", "-W", "2", H2_IP, check=False)  # ARP resolved before counting
    before = tb.slow_path_packets()
    started = time.monotonic()
    stream = CyclicStream(tb, H2_IP, SHUNT_PORT, cycle_us, max_seconds=seconds + 60,
                          path=os.path.join(tb.workdir, f"cyclic-{index}.bin"), sport=CYCLIC_SPORT_BASE + index)
    procs: list[subprocess.Popen] = []
    try:
        before_shunt = wait_until_settled(tb, started, before, path.reactive) - before if path.shunted else None
        procs = background_load(tb, load, link_mbit, seconds + RAMP_S + 5)
        time.sleep(RAMP_S)
        slow_start, window_start = tb.slow_path_packets(), time.time_ns()
        time.sleep(seconds)
        slow_end, window_end = tb.slow_path_packets(), time.time_ns()
    finally:
        for proc in procs:
            stop_process(proc, timeout=2)
        report, records, said = stream.stop()
    try:
        stats = delay_stats(records, cycle_us, window_start, window_end)
    except ValueError as exc:
        raise TestbedError(f"{path.key} {load.key} {cycle_us} µs: {exc}") from None
    return {"path": path.key, "load": load.key, "cycle_us": cycle_us, "seconds": seconds, **stats.row(),
            "frames_before_shunt": "" if before_shunt is None else before_shunt,
            "slow_path_pps": (slow_end - slow_start) / seconds,
            **{f"sender_{k}": v for k, v in vars(report).items()}, "notes": said}


def exp_jitter(args: argparse.Namespace) -> int:
    cycles = args.cycles or ([1000] if args.quick else [1000, 100])
    seconds = args.seconds if args.seconds else (1 if args.quick else 60)  # quick: 1,000 frames a cell at 1 ms
    loads = [ld for ld in JITTER_LOADS if not args.quick or ld.key in JITTER_QUICK_LOADS]
    params = {"paths": ", ".join(p.label for p in JITTER_PATHS), "loads": ", ".join(ld.key for ld in loads),
              "stream": f"UDP h1 -> h2 port {SHUNT_PORT}, {FRAME_BYTES}-byte frames, cycle "
                        f"{', '.join(map(str, cycles))} µs "
                        "(cyclic.c: clock_nanosleep TIMER_ABSTIME on an absolute schedule, SCHED_FIFO)",
              "window": f"{seconds:g} s a cell, opened {RAMP_S} s after the load started",
              "timestamps": "send: CLOCK_REALTIME in the sender just before sendto(); receive: the kernel's "
                            "SO_TIMESTAMPNS stamp (CLOCK_REALTIME) as the frame entered h2's stack; one kernel, "
                            "one clock, 1 ns resolution",
              "background": f"iperf3 UDP h1 -> h2, 1514-byte frames, port {IGNORE_PORT} (the policy leaves it "
                            f"on the slow path), as a share of a nominal {args.link_mbit:g} Mbit/s link",
              "cpu hog": f"{os.cpu_count()} busy loops (one per core) in the firewall's namespace",
              "emulation": "none: no delay, no shaping, MTU 1500",
              "testbeds": ("quick: one a testbed mode, the static path's shunts declared by a reload after the "
                           "reactive path's cells" if args.quick else "a fresh one a path")}
    res = Results(args.out, "jitter", params)
    total, i = len(JITTER_PATHS) * len(loads) * len(cycles), 0
    interrupted = False
    try:
        for bed_paths in jitter_beds(args.quick):
            with Testbed(mode=bed_paths[0].mode, config=dict(bed_paths[0].config), log=print) as tb:
                for path in bed_paths:
                    if path is not bed_paths[0]:
                        reload_static_shunts(tb, path)
                    for cycle_us in cycles:
                        for load in loads:
                            i += 1
                            row = jitter_cell(tb, path, load, cycle_us, seconds, args.link_mbit, i)
                            res.add(row)
                            progress(i, total, f"{path.key} {load.key} {cycle_us} µs: median "
                                               f"{row['median_us']:.1f} µs, max {row['max_us']:.1f} µs, jitter "
                                               f"{row['jitter_us']:.1f} µs, {row['late']} late, {row['lost']} lost")
    except KeyboardInterrupt:
        interrupted = True
    body = jitter_report(res.rows, cycles, loads, seconds)
    if res.rows:
        plot(os.path.join(args.out, "jitter.png"), lambda fig: draw_jitter(fig, res.rows, cycles, loads),
             size=(12, 4.5 * len(cycles)))
        body += ["", "![jitter](jitter.png)"]
    print(f"report: {res.report('Delay and jitter of a cyclic stream', body, interrupted)}")
    return 130 if interrupted else 0


def draw_jitter(fig: Any, rows: list[dict[str, Any]], cycles: list[int], loads: list[Load]) -> None:
    """Box per path and load, whiskers at the minimum and maximum (as the paper draws them)."""
    width = 0.8 / len(JITTER_PATHS)
    for n, cycle_us in enumerate(cycles):
        ax = fig.add_subplot(len(cycles), 1, n + 1)
        for j, path in enumerate(JITTER_PATHS):
            stats, pos = [], []
            for k, load in enumerate(loads):
                r = next((r for r in rows if (r["path"], r["load"], r["cycle_us"]) == (path.key, load.key, cycle_us)),
                         None)
                if r is not None:
                    stats.append({"med": r["median_us"], "q1": r["q1_us"], "q3": r["q3_us"], "whislo": r["min_us"],
                                  "whishi": r["max_us"], "mean": r["mean_us"], "fliers": []})
                    pos.append(k + (j - (len(JITTER_PATHS) - 1) / 2) * width)
            if stats:
                art = ax.bxp(stats, positions=pos, widths=width * 0.8, showmeans=True, patch_artist=True,
                             manage_ticks=False)
                for box in art["boxes"]:
                    box.set_facecolor(path.color)
                    box.set_alpha(0.6)
                ax.plot([], [], color=path.color, linewidth=6, alpha=0.6, label=path.label)
        ax.axhline(cycle_us, color="grey", linestyle="--", linewidth=0.8, label=f"one cycle ({cycle_us} µs)")
        ax.set_yscale("log")
        ax.set_xticks(range(len(loads)), [ld.key for ld in loads])
        ax.set_xlabel("load on the firewall")
        ax.set_ylabel("one-way delay, µs (log)")
        ax.set_title(f"Cycle {cycle_us} µs: box quartiles, whiskers min and max, triangle the mean")
        ax.legend(loc="upper left", fontsize=8)


def jitter_report(rows: list[dict[str, Any]], cycles: list[int], loads: list[Load], seconds: float) -> list[str]:
    body = ["One-way delay of a cyclic UDP stream of 512-byte frames h1 -> h2, as Wüsteney, Menth, Hummen and "
            "Heer measured industrial firewalls (\"Impact of Packet Filtering on Time-Sensitive Networking "
            "Traffic\"). Jitter as the paper defines it: the larger distance of the minimum or the maximum from "
            "the mean. *late*: frames whose delay exceeded one cycle; *lost*: sequence numbers missing in the "
            "window. Delays in µs.", "",
            "| cycle | path | load | frames | lost | late | min | median | mean | p99.9 | max | jitter | "
            "frames before the shunt | sender wake-up late, p99.9 / max |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cycle_us in cycles:
        for path in JITTER_PATHS:
            for load in loads:
                r = next((r for r in rows if (r["path"], r["load"], r["cycle_us"]) == (path.key, load.key, cycle_us)),
                         None)
                if r is None:
                    continue
                body.append(f"| {cycle_us} µs | {path.label} | {load.key} | {r['frames']} | {r['lost']} | "
                            f"{r['late']} | {r['min_us']:.1f} | {r['median_us']:.1f} | {r['mean_us']:.1f} | "
                            f"{r['p999_us']:.1f} | {r['max_us']:.1f} | {r['jitter_us']:.1f} | "
                            f"{r['frames_before_shunt'] if r['frames_before_shunt'] != '' else '–'} | "
                            f"{r['sender_wake_late_p999_ns'] / 1000:.0f} / {r['sender_wake_late_max_ns'] / 1000:.0f} |")
    shunted = [r["frames_before_shunt"] for r in rows if r["frames_before_shunt"] != ""]
    body += ["", "*Frames before the shunt*: packets the switch sent towards the firewall from the stream's "
             "start until the slow-path counters stood still for 0.3 s (the stream on the fast path), with no "
             "other traffic: the stream's frames that crossed the firewall while conntrack, the controller and "
             "the switch set the shunt up, plus the receiver's one reply (which makes the stream ESTABLISHED, "
             "what the policy matches)."]
    if shunted:
        d = describe([float(v) for v in shunted])
        body.append(f"Over {d['n']} streams: mean {d['mean']:.1f}, min {min(shunted)}, max {max(shunted)}.")
    body += ["", "## The paper's numbers beside ours", "",
             "| the paper | delay | jitter |", "|---|---|---|"]
    body += [f"| {a} | {b} | {c} |" for a, b, c in PAPER_JITTER]
    body += ["", "| ours (cycle, path) | median delay over the loads | largest jitter over the loads | "
             "largest max |", "|---|---|---|---|"]
    for cycle_us in cycles:
        for path in JITTER_PATHS:
            sel = [r for r in rows if r["path"] == path.key and r["cycle_us"] == cycle_us]
            if sel:
                body.append(f"| {cycle_us} µs, {path.label} | {min(r['median_us'] for r in sel):.1f}–"
                            f"{max(r['median_us'] for r in sel):.1f} µs | {max(r['jitter_us'] for r in sel):.1f} µs "
                            f"| {max(r['max_us'] for r in sel):.1f} µs |")
    body += ["", "## What differs", "",
             "- **A software switch on two cores is not a switch chip.** The paper's fast path is an ACL in the "
             "switch ASIC: a constant pipeline, 7.6 µs with under 0.2 µs of jitter whatever the load. Ours is "
             "Open vSwitch's userspace datapath, a process that reads the ports through packet sockets on the same "
             "two cores as the hosts, the firewall and the load generators. Its delay is tens of µs and its "
             "jitter is whatever the scheduler makes of it: a frame waits whenever ovs-vswitchd waits for a CPU. "
             "So our fast path's own jitter is a property of this machine, not of shunting; on a switch chip "
             "the shunted stream would see the chip's constant delay.",
             "- **The firewall shares the CPU with everything.** The paper's firewalls had their own CPUs; here "
             "the bridge and iptables run in softirq on the cores the switch, the sender and the receiver use. "
             "The CPU hog (one busy loop per core in the firewall's namespace) therefore loads every path, the "
             "direct one too, not only the firewall's; the sender and receiver run at SCHED_FIFO priority so "
             "that what is measured is mostly the network path.",
             "- **Stamping.** The paper stamped in hardware units synchronised by IEEE 802.1AS to 30 ns. Ours "
             "are software stamps on one clock (no synchronisation error): the send stamp is taken in user space "
             "before sendto(), so the sender's own stack is inside the delay; the receive stamp is the kernel's "
             "(SO_TIMESTAMPNS), so the receiver's wake-up is not (its user-space stamp, `user_median_us` in the "
             "CSV, shows what a program would add). The sender's wake-up lateness (last column) is the source's "
             "own jitter: it shifts the send time, not the measured delay, but frames sent late in a burst "
             "queue behind each other. Where the sender, too, woke milliseconds late, the whole machine "
             "stalled (other processes, the hypervisor): the same stall holds whatever frame is in the switch.",
             "- **Load.** Background traffic is iperf3 UDP in 1514-byte frames on the stream's direction, at a "
             "share of a nominal 1 Gbit/s link (the links are veth pairs without a rate). In direct mode there is "
             "no firewall: the load crosses only the switch. The paper loaded the firewall's link the same way; "
             "its rule position experiments (a later matching rule costs more) are not repeated: our policy "
             "matches the stream in the first rules.",
             f"- **Duration.** {seconds:g} s a cell{'' if seconds >= 10 else ' (quick mode)'}; the paper: 10 s."]
    return body


EXPERIMENTS: dict[str, Callable[[argparse.Namespace], int]] = {
    "timing": exp_timing, "throughput": exp_throughput, "cwnd": exp_cwnd, "jitter": exp_jitter}
THESIS_EXPERIMENTS = ("timing", "throughput", "cwnd")  # what `all` runs


def parse_args(argv: Iterable[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", choices=[*EXPERIMENTS, "all"])
    ap.add_argument("--quick", action="store_true", help="a short run (CI): fewer RTTs, runs and seconds")
    ap.add_argument("--out", help="output directory (default results/<experiment>-<time>)")
    ap.add_argument("--runs", type=int, help="repetitions per cell")
    ap.add_argument("--rtts", type=lambda s: [float(x) if "." in x else int(x) for x in s.split(",")],
                    help="comma-separated RTTs in ms")
    ap.add_argument("--seconds", type=float, default=0, help="transfer length (timing: default 1; jitter: a cell)")
    ap.add_argument("--cycles", type=lambda s: [int(x) for x in s.split(",")],
                    help="jitter: comma-separated cycle times in µs (default 1000,100; quick 1000)")
    ap.add_argument("--delay", choices=DELAY_MECHANISMS, default="auto", help="delay mechanism (default auto)")
    ap.add_argument("--link-mbit", type=float, default=1000, help="host link rate (default 1000)")
    ap.add_argument("--slow-mbit", type=float, default=900, help="slow path rate (default 900)")
    ap.add_argument("--slow-buffer-kb", type=int, default=4096,
                    help="slow path buffer per direction (default 4096, calibrated to the thesis firewall's loss)")
    args = ap.parse_args(argv)
    if args.runs is not None and args.runs < 1:
        ap.error("--runs must be at least 1")
    if args.cycles and min(args.cycles) < 10:
        ap.error("--cycles: a cycle must be at least 10 µs")
    return args


def main(argv: Iterable[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("experiments: run as root (network namespaces, Open vSwitch)", file=sys.stderr)
        return 1
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = args.out or os.path.join(REPO, "results", f"{args.experiment}-{stamp}")
    names = list(THESIS_EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    for name in names:
        sub = argparse.Namespace(**vars(args))
        sub.out = os.path.join(base, name) if args.experiment == "all" else base
        if name == "timing" and not args.seconds:
            sub.seconds = 1
        try:
            rc = EXPERIMENTS[name](sub)
        except TestbedError as exc:
            print(f"experiments: {name}: {exc}", file=sys.stderr)
            return 1
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
