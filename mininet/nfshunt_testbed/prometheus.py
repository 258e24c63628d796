"""Debian's Prometheus on the testbed: a server in a firewall node's namespace that scrapes
that firewall's controller and evaluates NFShunt's shipped alert rules (the dashboard test,
the dashboard picture). Its scrape config is the shipped example with this bed's target and
short intervals; its storage is a temporary folder, removed with the server, also after a
failure or Ctrl-C. It listens on the node's control-link address, which the root namespace
reaches."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .controller import Controllers
from .linkemu import stop_process
from .topology import REPO, Firewall, TestbedError

RULES = os.path.join(REPO, "config", "prometheus", "nfshunt-alerts.yml")
SCRAPE_EXAMPLE = os.path.join(REPO, "config", "prometheus", "prometheus-example.yml")
DASHBOARD = os.path.join(REPO, "config", "grafana", "nfshunt.json")
PORT = 9090  # in the firewall node's namespace: no clash with a server of the machine's own
JOB = "nfshunt"  # the job the shipped rules expect


def scrape_config(target: str, interval: str, rules: str = RULES) -> dict[str, Any]:
    """The shipped example scrape config pointed at `target`, scraping and evaluating every
    `interval`, loading `rules`."""
    import yaml  # Debian's python3-yaml; only the testbed's Prometheus needs it
    with open(SCRAPE_EXAMPLE) as fh:
        cfg = yaml.safe_load(fh)
    cfg["global"].update(scrape_interval=interval, evaluation_interval=interval, scrape_timeout=interval)
    cfg["rule_files"] = [rules]
    jobs = [job for job in cfg["scrape_configs"] if job["job_name"] == JOB]
    if len(jobs) != 1:
        raise TestbedError(f"{SCRAPE_EXAMPLE} has no job {JOB!r}, which the shipped rules expect")
    jobs[0]["static_configs"] = [{"targets": [target]}]
    return cfg


def dashboard_queries(path: str = DASHBOARD) -> list[tuple[str, str, str]]:
    """Every query of the shipped dashboard: (panel title, legend, PromQL)."""
    with open(path) as fh:
        dash = json.load(fh)
    return [(panel["title"], target.get("legendFormat", ""), target["expr"])
            for panel in dash["panels"] for target in panel.get("targets", [])]


def alert_rules(path: str = RULES) -> list[dict[str, Any]]:
    """Every alerting rule of the shipped rules file."""
    import yaml
    with open(path) as fh:
        groups = yaml.safe_load(fh)["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


class Prometheus:
    """A running server's HTTP API (no proxy: the address is the testbed's)."""

    def __init__(self, url: str, proc: subprocess.Popen, folder: str):
        self.url = url
        self.proc = proc
        self.folder = folder
        self._open = urllib.request.build_opener(urllib.request.ProxyHandler({})).open

    def get(self, path: str, **params: Any) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with self._open(f"{self.url}{path}{query}", timeout=10) as reply:
            body = json.load(reply)
        if body.get("status") != "success":
            raise TestbedError(f"Prometheus {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's series (each {"metric": labels, "value": [time, "value"]})."""
        data = self.get("/api/v1/query", query=expr)
        if data["resultType"] != "vector":
            raise TestbedError(f"{expr}: a {data['resultType']}, not a vector")
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """A range query's series (each {"metric": labels, "values": [[time, "value"], ...]})."""
        return self.get("/api/v1/query_range", query=expr, start=start, end=end, step=step)["result"]

    def alerts(self) -> list[dict[str, Any]]:
        """The alerts pending or firing now."""
        return self.get("/api/v1/alerts")["alerts"]

    def firing(self) -> dict[str, list[dict[str, str]]]:
        """The firing alerts by name: their label sets."""
        out: dict[str, list[dict[str, str]]] = {}
        for alert in self.alerts():
            if alert["state"] == "firing":
                out.setdefault(alert["labels"]["alertname"], []).append(alert["labels"])
        return out

    def log(self) -> str:
        try:
            with open(os.path.join(self.folder, "prometheus.log"), errors="replace") as fh:
                return fh.read()
        except OSError:
            return ""


@contextmanager
def running(tb: Controllers, fw: Firewall | None = None, interval: str = "1s") -> Iterator[Prometheus]:
    """Prometheus scraping `fw`'s controller (the first firewall's by default; its config
    must set metrics_address), ready once it has scraped it. Stopped and its folder removed
    on exit."""
    fw = fw or tb.firewalls[0]
    cfg = tb.nfshunt_config(fw)
    if not cfg.get("metrics_address"):
        raise TestbedError("Prometheus needs a controller with metrics_address set")
    address = cfg["metrics_address"]
    target = f"[{address}]:{cfg.get('metrics_port', 9753)}" if ":" in address else \
        f"{address}:{cfg.get('metrics_port', 9753)}"
    if shutil.which("prometheus") is None:
        raise TestbedError("needs Debian's prometheus (scripts/install-deps.sh installs it)")
    import yaml
    folder = tempfile.mkdtemp(prefix="nfshunt-prometheus-")
    proc = None
    try:
        config = os.path.join(folder, "prometheus.yml")
        with open(config, "w") as fh:
            yaml.safe_dump(scrape_config(target, interval), fh)
        with open(os.path.join(folder, "prometheus.log"), "wb") as log:
            proc = tb.spawn(tb.node(fw), "prometheus", f"--config.file={config}",
                            f"--storage.tsdb.path={os.path.join(folder, 'data')}",
                            f"--web.listen-address={fw.mgmt_fw}:{PORT}", stdout=log, stderr=subprocess.STDOUT)
        prom = Prometheus(f"http://{fw.mgmt_fw}:{PORT}", proc, folder)
        _wait_scraped(tb, prom)
        yield prom
    finally:
        if proc is not None:
            stop_process(proc, timeout=5)
        shutil.rmtree(folder, ignore_errors=True)


def _wait_scraped(tb: Controllers, prom: Prometheus, timeout: float = 20) -> None:
    """Ready, and the controller scraped (up == 1)."""
    def scraped() -> bool:
        if prom.proc.poll() is not None:
            raise TestbedError(f"prometheus exited ({prom.proc.returncode}):\n{prom.log()[-3000:]}")
        try:
            return any(s["value"][1] == "1" for s in prom.query(f'up{{job="{JOB}"}}'))
        except (OSError, urllib.error.URLError):
            return False  # not listening yet
    started = time.monotonic()
    try:
        tb.wait_for(scraped, timeout, "Prometheus to scrape the controller", interval=0.2)
    except TestbedError:
        raise TestbedError(f"Prometheus did not scrape the controller in {time.monotonic() - started:.0f} s:\n"
                           f"{prom.log()[-3000:]}") from None
