#!/usr/bin/env python3
"""The dashboard's picture from real data: NFShunt on the testbed, scraped by Debian's
Prometheus with the shipped rules, through a few minutes of traffic (shunted, blocked,
ignored and refused transfers, held connections, IDS requests, the switch's control link
cut while the pair's controller steps down); then every panel of config/grafana/nfshunt.json
plotted with matplotlib from Prometheus's query_range answers to the panel's own queries
(Grafana is not packaged in Debian), with the alerts that fired underneath. Run as root:

    /opt/nfshunt-venv/bin/python mininet/dashboard.py --out docs/img/dashboard.png

Everything it builds is torn down on exit, also on failure or Ctrl-C.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nfshunt_testbed import prometheus  # noqa: E402
from nfshunt_testbed.bed import BLOCK_PORT, IGNORE_PORT, SHUNT_PORT, Testbed  # noqa: E402

METRICS_PORT, API_PORT = 9753, 9754
TOKEN = "dashboard-picture-token-0123456789"
# Each unit the dashboard uses: (scale, axis label) for the plot.
UNITS = {"Bps": (1e-6, "MB/s"), "s": (1e3, "ms"), "percentunit": (100, "%"), "ops": (1, "/s"), "short": (1, "")}


def ids_api(tb: Testbed, method: str, path: str, body: dict | None = None, token: str = TOKEN) -> int:
    args = ["curl", "-sS", "-m", "15", "-o", "/dev/null", "-w", "%{http_code}", "-X", method,
            "-H", f"Authorization: Bearer {token}", f"http://127.0.0.1:{API_PORT}{path}"]
    if body is not None:
        args += ["-H", "Content-Type: application/json", "--data-binary", json.dumps(body)]
    return int(tb.run(tb.fw, *args, timeout=20))


def limit_table(limit: int | None) -> None:
    if limit is None:
        subprocess.run(["ovs-vsctl", "--if-exists", "clear", "Bridge", "s1", "flow_tables"], check=True)
        return
    subprocess.run(["ovs-vsctl", "--", "--id=@ft", "create", "Flow_Table", f"flow_limit={limit}",
                    "overflow_policy=refuse", "--", "set", "Bridge", "s1", "flow_tables:0=@ft"], check=True,
                   capture_output=True)


def traffic(tb: Testbed, rounds: int, cport: int) -> int:
    """Rounds of a shunted, an ignored and (every third) a blocked transfer, IDS requests."""
    for i in range(rounds):
        tb.iperf(SHUNT_PORT, 3, cport=cport, bitrate="400M")
        tb.iperf(IGNORE_PORT, 2, cport=cport + 1, bitrate="100M")
        if i % 3 == 0:
            tb.iperf(BLOCK_PORT, 1, cport=cport + 2, grace=2)
            ids_api(tb, "POST", "/v1/rules", {"id": f"pic{cport}", "action": "block",
                                              "address": f"10.0.0.{20 + i}/32", "expire": 30})
        if i % 2 == 0:
            ids_api(tb, "GET", "/v1/rules", token="wrong")
        cport += 3
    return cport


def workload(tb: Testbed, log: Any) -> None:
    cport = 45400
    log("traffic ...")
    cport = traffic(tb, 4, cport)
    log("60 held connections, shunted ...")
    server = tb.conn_server(SHUNT_PORT)
    held, _ = tb.open_conns(SHUNT_PORT, 60, cport_base=47000)
    time.sleep(20)  # the held connections' pairs on the switch for a while
    held.stdin.write("close\n")  # type: ignore[union-attr]
    held.stdin.flush()  # type: ignore[union-attr]
    held.wait(10)
    server.kill()
    server.wait()
    log("the switch's table full for a while: shunts refused ...")
    limit_table(1)
    try:
        cport = traffic(tb, 1, cport)
    finally:
        limit_table(None)
    log("the pair's controller steps down and the switch's control link is cut for 20 s ...")
    targets = subprocess.run(["ovs-vsctl", "get-controller", "s1"], capture_output=True, text=True,
                             check=True).stdout.split()
    tb.control({"cmd": "role", "role": "backup"})
    subprocess.run(["ovs-vsctl", "del-controller", "s1"], check=True)
    try:
        tb.iperf(IGNORE_PORT, 3, cport=cport, bitrate="50M", grace=25)  # the switch forwards nothing new
        time.sleep(20)
    finally:
        subprocess.run(["ovs-vsctl", "set-controller", "s1", *targets], check=True)
    tb.wait_for_controller()
    tb.control({"cmd": "role", "role": "master"})
    log("traffic again ...")
    traffic(tb, 4, cport + 3)


def fetch(prom: prometheus.Prometheus, start: float, end: float) -> dict[str, Any]:
    """Every panel's queries over [start, end], and the alerts' states, as Prometheus answers."""
    with open(prometheus.DASHBOARD) as fh:
        panels = json.load(fh)["panels"]
    step = max(1.0, (end - start) / 400)
    for panel in panels:
        for target in panel["targets"]:
            target["series"] = prom.query_range(target["expr"], start, end, step)
    states = {state: prom.query_range(f'ALERTS{{alertstate="{state}"}}', start, end, step)
              for state in ("pending", "firing")}
    return {"start": start, "end": end, "panels": panels, "alerts": states}


def plot(data: dict[str, Any], out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels, start = data["panels"], data["start"]
    rows = math.ceil((len(panels) + 1) / 2)
    fig, axes = plt.subplots(rows, 2, figsize=(16, 2.9 * rows))
    for ax, panel in zip(axes.flat, panels, strict=False):
        scale, label = UNITS.get(panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short"), (1, ""))
        for target in panel["targets"]:
            for series in target["series"]:
                xs = [float(t) - start for t, _ in series["values"]]
                ys = [float(v) * scale for _, v in series["values"]]
                ax.plot(xs, ys, linewidth=1.2, label=legend(target.get("legendFormat", ""), series["metric"]))
        ax.set_title(panel["title"], fontsize=10, loc="left")
        ax.set_ylabel(label)
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    alerts(axes.flat[len(panels)], data["alerts"], start)
    for ax in list(axes.flat)[len(panels) + 1:]:
        ax.set_visible(False)
    for ax in axes.flat:
        ax.set_xlim(0, data["end"] - start)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("seconds")
    fig.suptitle("NFShunt dashboard (config/grafana/nfshunt.json): each panel's queries, answered by Prometheus "
                 "on the testbed", fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(out, dpi=72)


def alerts(ax: Any, states: dict[str, list[dict[str, Any]]], start: float) -> None:
    """Prometheus's ALERTS series: when each alert was pending and firing."""
    names: list[str] = []
    for state, color in (("pending", "#f2c14e"), ("firing", "#d1495b")):
        for series in states[state]:
            name = series["metric"]["alertname"]
            if name not in names:
                names.append(name)
            xs = [float(t) - start for t, _ in series["values"]]
            ax.scatter(xs, [names.index(name)] * len(xs), s=6, color=color, label=state)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_ylim(-0.5, max(len(names), 1) - 0.5)
    ax.set_title("Alerts (nfshunt-alerts.yml): pending, firing", fontsize=10, loc="left")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=False))
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="upper left")


def legend(template: str, labels: dict[str, str]) -> str:
    out = template
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out.replace("{{instance}}", "").strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/img/dashboard.png")
    ap.add_argument("--save-data", metavar="JSON", help="also keep Prometheus's answers in this file")
    ap.add_argument("--from-data", metavar="JSON", help="plot answers kept before; no testbed")
    args = ap.parse_args()
    if args.from_data:
        with open(args.from_data) as fh:
            plot(json.load(fh), args.out)
        return 0
    folder = tempfile.mkdtemp(prefix="nfshunt-dashboard-")
    tokens = os.path.join(folder, "tokens")
    with open(os.open(tokens, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:
        fh.write(f"zeek {TOKEN}\n")
    config = {"default_shunt_timeout": 3, "default_block_timeout": 3, "metrics_address": "127.0.0.1",
              "metrics_port": METRICS_PORT, "ids": {"listen_port": API_PORT, "token_file": tokens},
              "delete_flows_on_shutdown": False,
              "pair": {"state_file": os.path.join(folder, "pair.json"), "start_role": "master"}}
    try:
        with Testbed(config=config, log=print) as tb, prometheus.running(tb, interval="1s") as prom:
            tb.wait_for_controller()
            start = time.time()
            workload(tb, print)
            time.sleep(5)
            end = time.time()
            data = fetch(prom, start, end)
        if args.save_data:
            with open(args.save_data, "w") as fh:
                json.dump(data, fh)
        plot(data, args.out)
        print(f"{args.out}: {end - start:.0f} s of the dashboard's panels")
    finally:
        os.unlink(tokens)
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
