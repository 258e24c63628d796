"""Prometheus metrics: the controller's counters, and gauges read from the app when scraped.

Every counter is a prometheus-client counter, labelled where it has labels (`Counters`):
the event loop increments a child looked up once per label values, and the status
request and logs read the same counters back. The gauges (pairs, table use, the pair's
role) are read from the app's state on the scrape thread. Served by prometheus-client's
HTTP server on `metrics_address` (off unless configured; localhost in the examples).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from nfshunt.records.model import Action

LOG = logging.getLogger("nfshunt.metrics")

# Event to confirmed flows, in seconds: from well under a millisecond to a slow switch.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# Labelled counter families: name used in code -> (metric, help, label names).
LABELLED = {
    "conntrack_event": ("nfshunt_conntrack_events", "Conntrack events and dumped entries read, by type", ("type",)),
    "ignored": ("nfshunt_ignored_events", "Events that changed nothing on the switch, by reason", ("reason",)),
    "routed_table_errors": ("nfshunt_routed_table_errors", "The route follower's troubles (lost events, a "
                            "failed turn), by what", ("what",)),
    "installed": ("nfshunt_flows_installed", "Shunt and block pairs confirmed by the switch", ("action",)),
    "refused": ("nfshunt_flows_refused", "Shunt and block pairs the switch refused (connection kept on the "
                "slow path)", ("action",)),
    "removed": ("nfshunt_flows_removed", "Shunt and block pairs removed, by reason", ("action", "reason")),
    "removed_bytes": ("nfshunt_removed_pair_bytes", "Bytes the flows of removed pairs counted (shunt: the fast "
                      "path's, forwarded by the switch; block: dropped there), from their flow-removed counters: "
                      "counted when the pair is removed", ("action",)),
    "openflow_error": ("nfshunt_openflow_errors", "OpenFlow error messages from the switch", ("type", "code")),
    "operator": ("nfshunt_operator_actions", "Manual control requests (flush, reevaluate, unshunt, block, role)",
                 ("action",)),
    "packet_in": ("nfshunt_packet_ins", "Packet-ins from the switch, by what they were (teardown or why "
                  "unexpected)", ("reason",)),
    "switch_refused": ("nfshunt_switch_refused", "OpenFlow peers refused, by reason", ("reason",)),
    "static_flows": ("nfshunt_static_flow_changes", "Static shunt flows written or deleted, by what and why",
                     ("change", "reason")),
    "address_blocks": ("nfshunt_address_block_flow_changes", "IDS address-block flows written or deleted, by "
                       "what and why", ("change", "reason")),
    "ids_refused": ("nfshunt_ids_refused", "IDS API requests refused, by reason (ids/calls.Reject; a precedence "
                    "refusal by the rule that refused it, as refused:<rule>)", ("reason",)),
    "ids_busy": ("nfshunt_ids_calls_busy", "Calls of the IDS API's process the controller answered busy at once, "
                 "by call: no room for them (its event loop's queue of IDS calls, or its pool of threads, was "
                 "full); nothing was done, and the API answered 504", ("op",)),
    "ids_rules": ("nfshunt_ids_rule_changes", "IDS rules added, found existing, ended, by outcome and kind",
                  ("outcome", "kind")),
    "openflow_ignored": ("nfshunt_openflow_ignored", "OpenFlow messages dropped because they did not come from "
                         "the served switch connection", ("message",)),
    "openflow_unasked": ("nfshunt_openflow_unasked", "Replies from the switch to nothing in flight (a request "
                         "given up, or never asked), dropped", ("message",)),
    "given_up": ("nfshunt_openflow_given_up", "Requests to the switch given up unanswered (barriers: "
                 "install_timeouts), by why: silent (it answered nothing for 5 s) or passed (it answered later "
                 "requests, not this one)", ("why",)),
}
PLAIN = {
    "switch_connects": "Switch connections accepted (the first and every reconnect)",
    "netlink_overflows": "Times the kernel dropped conntrack events (ENOBUFS)",
    "conntrack_resyncs": "Conntrack table dumps processed (start-up, reconnect, after lost events)",
    "netlink_malformed": "Conntrack netlink messages skipped as malformed",
    "openflow_malformed": "OpenFlow messages or flows skipped as unreadable",
    "handler_errors": "Events whose handler raised (logged with its traceback; the event loop goes on)",
    "switch_disconnects": "Switch connections that ended (closed, echoes unanswered, replaced)",
    "install_timeouts": "Installs rolled back because the switch did not answer their barrier",
    "install_queue_full": "Installs refused because the paced flow-mod queue was full (they wait for room)",
    "teardowns": "Shunts taken down because the connection sent FIN or RST",
    "packet_in_dropped": "Packet-ins the switch's controller meter dropped (packet_in_rate)",
    "teardowns_from_counters": "Shunts ended from their FIN/RST catchers' counters after the switch dropped "
                               "their packet-ins",
    "teardowns_half_closed": "Shunts (pipeline layout) taken as closed while half-closed: the packet-in of their "
                             "second FIN not heard of 0.3 s after the first",
    "teardowns_contradicted": "Closes (a FIN or RST the catchers or the firewall saw) that the connection's own "
                              "traffic then contradicted: forged on the path, most likely; the shunt is undone "
                              "and made again",
    "reevaluations": "TCP entries re-created so a new policy judges the connection again",
    "reconcile_deleted": "Flows deleted while reconciling with the switch",
    "internal_errors": "Commands that failed inside the controller (and reloads whose swap on the event loop failed: "
                       "put back whole)",
    "routed_rewrites": "Routed pairs rewritten in place: their next hop's MAC changed (docs/design/routed.md)",
    "routed_neighbours_held_down": "Neighbours held down for flapping (their MAC changed too often)",
    "routed_next_hops_solicited": "Next hops of adopted routed pairs the firewall had no MAC for, each of which "
                                  "its kernel was asked to resolve (a pair's new master: docs/routed.md)",
    "routed_announcements": "Gratuitous ARPs and unsolicited neighbour advertisements a routing firewall pair's "
                            "new master sent the hosts for its interfaces' addresses (docs/routed.md)",
    "role_promotions": "Times the switch granted this controller MASTER (a firewall pair's takeover)",
    "ids_api_restarts": "Times the IDS API's process ended on its own and was started again",
    "ids_api_bad_frames": "Frames from the IDS API's process that were not requests (nothing done; it was started "
                          "again)",
    "ids_lookup_failed": "Conntrack lookups of an IDS rule's connection that failed (the rule waits for its events)",
    "gc_full_collections": "Full garbage collections the controller made (collector.py: paced, not Python's own)",
    "role_demotions": "Times this controller stopped being MASTER (asked to, or another controller took over)",
    "role_claims_withheld": "Claims of the switch not made because the pair's state file could not be written "
                            "(tried again every role_check_interval; docs/pair.md)",
}


class Counters:
    """Every counter of the controller, as prometheus-client counters: plain ones by name
    (`inc`), labelled ones by family and label values (`add`). A child is looked up once
    per label values and kept, so an increment on the event loop is a dict lookup and an
    `inc`; safe from any thread (the conntrack listener counts malformed messages)."""

    def __init__(self, registry: CollectorRegistry):
        self._plain = {name: Counter(f"nfshunt_{name}", text, registry=registry) for name, text in PLAIN.items()}
        self._families = {family: Counter(metric, text, labelnames=labels, registry=registry)
                          for family, (metric, text, labels) in LABELLED.items()}
        self._children: dict[tuple[str, tuple[str, ...]], Any] = {}
        # Known label values exist from the start, at 0: Prometheus's increase() and rate()
        # miss a series' first count, and an alert on one that never existed sees nothing.
        for family in ("installed", "refused", "removed_bytes"):
            for action in (Action.SHUNT, Action.BLOCK):
                self.add(family, action, amount=0)

    def inc(self, name: str, amount: int = 1) -> None:
        self._plain[name].inc(amount)

    def add(self, family: str, *labels: str, amount: int = 1) -> None:
        key = (family, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._families[family].labels(*labels)
        child.inc(amount)

    def flat(self) -> dict[str, int]:
        """The counters that have counted, as `nfshunt status` has always shown them:
        "family:label:..." ("operator_<action>" for operator actions) and plain names."""
        out: dict[str, int] = {}
        for family, metric in self._families.items():
            names = LABELLED[family][2]
            for sample in next(iter(metric.collect())).samples:
                if sample.name.endswith("_total") and sample.value:
                    labels = [sample.labels[n] for n in names]
                    key = f"operator_{labels[0]}" if family == "operator" else ":".join((family, *labels))
                    out[key] = int(sample.value)
        for name, metric in self._plain.items():
            for sample in next(iter(metric.collect())).samples:
                if sample.name.endswith("_total") and sample.value:
                    out[name] = int(sample.value)
        return out


class AppCollector(Collector):
    """The gauges, read from the app's state when scraped."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]):
        self.snapshot = snapshot

    def collect(self) -> Iterable[Any]:
        snap = self.snapshot()
        active = GaugeMetricFamily("nfshunt_active", "Shunt and block pairs on the switch now", labels=("action",))
        active.add_metric(["shunt"], snap["shunts"])
        active.add_metric(["block"], snap["blocks"])
        yield active
        yield GaugeMetricFamily("nfshunt_switch_connected", "Served switches connected now (1 while the switch is "
                                "connected, with one)", value=snap["connected"])
        per_switch = snap.get("switches") or []
        if len(per_switch) > 1:  # several switches: each one's own state, by datapath id
            yield from _per_switch(per_switch)
        yield from _table(snap)
        slow = snap.get("slow_path_bytes")
        if slow:
            by_direction = CounterMetricFamily("nfshunt_slow_path_bytes", "Bytes the switch's default flows "
                                               "carried (to_firewall: from the external ports into the firewall's "
                                               "bridge; from_firewall: back), as last read from the switch: the "
                                               "slow path's traffic (OpenFlow 1.3; reset when the switch's table "
                                               "is)", labels=("direction",))
            for direction, n in sorted(slow.items()):
                by_direction.add_metric([direction], n)
            yield by_direction
        dropped = snap.get("vlan_dropped")
        if dropped:
            drops = CounterMetricFamily("nfshunt_vlan_dropped_packets", "Frames a VLAN trunk's port dropped: a tag "
                                        "no port group carries (another VLAN, VLAN 0, 4095; untagged where "
                                        "`untagged` is false), as last read from the switch (OpenFlow 1.3)",
                                        labels=("datapath_id", "port"))
            for dpid, port, n in dropped:
                drops.add_metric([dpid, str(port)], n)
            yield drops
        static = snap.get("static")
        if static and static["flows"]:
            yield from _statics(static)
        rules = snap.get("rules")
        if rules is not None:
            by_source = GaugeMetricFamily("nfshunt_rules", "What decides the switch now, by source: policy (pairs "
                                          "it decided), operator (pinned connections), ids:<client> (active "
                                          "IDS rules)", labels=("source",))
            for source, n in sorted(rules.items()):
                by_source.add_metric([source], n)
            yield by_source
        pair = snap.get("pair")
        if pair is not None:
            yield GaugeMetricFamily("nfshunt_pair_master", "1 while the switch has granted this controller MASTER "
                                    "(a firewall pair's active side)", value=1 if pair["granted"] == "master" else 0)
            yield GaugeMetricFamily("nfshunt_pair_generation", "The generation this controller took the switch "
                                    "over with", value=pair["generation"])


def _per_switch(per_switch: list[dict[str, Any]]) -> Iterable[Any]:
    """Each served switch's own state, by datapath id."""
    up = GaugeMetricFamily("nfshunt_switch_up", "1 while this switch is connected", labels=("datapath_id",))
    pairs = GaugeMetricFamily("nfshunt_switch_active", "Shunt and block pairs on this switch now",
                              labels=("datapath_id", "action"))
    used = GaugeMetricFamily("nfshunt_switch_table_entries_used", "Entries NFShunt's flows take in this "
                             "switch's table 0", labels=("datapath_id",))
    for sw in per_switch:
        up.add_metric([sw["datapath_id"]], sw["connected"])
        pairs.add_metric([sw["datapath_id"], "shunt"], sw["shunts"])
        pairs.add_metric([sw["datapath_id"], "block"], sw["blocks"])
        used.add_metric([sw["datapath_id"]], sw["table_used"])
    return (up, pairs, used)


def _table(snap: dict[str, Any]) -> Iterable[Any]:
    """The budget, the switch's table and what waits for room in it."""
    yield GaugeMetricFamily("nfshunt_flow_budget_used", "Pairs counted against max_shunts",
                            value=snap["shunts"] + snap["blocks"])
    yield GaugeMetricFamily("nfshunt_flow_budget_max", "Pairs allowed at once: max_shunts, or derived from the "
                            "switch's table size (0: no budget)", value=snap["max_shunts"])
    if snap.get("table_max") is not None:
        yield GaugeMetricFamily("nfshunt_table_entries_max", "Entries the switch's table 0 holds (as reported)",
                                value=snap["table_max"])
    yield GaugeMetricFamily("nfshunt_table_entries_used", "Entries NFShunt's flows take in table 0 (defaults, "
                            "pairs, teardown catchers)", value=snap.get("table_used", 0))
    yield GaugeMetricFamily("nfshunt_table1_entries_used", "Entries of the pipeline layout's table 1 (shared "
                            "outputs and teardown catchers; 0 in the single layout)",
                            value=snap.get("table_1", 0))
    yield GaugeMetricFamily("nfshunt_waiting", "Connections waiting for room on the switch", value=snap["waiting"])
    yield GaugeMetricFamily("nfshunt_install_queue", "Installs waiting for their turn under flow_mod_rate",
                            value=snap.get("queued", 0))


def _statics(static: dict[str, Any]) -> Iterable[Any]:
    """The static shunts' flows: their counters by stream and direction (summed when they
    were read), how many are configured and missing."""
    packets = CounterMetricFamily("nfshunt_static_packets", "Packets a static shunt's flows forwarded, by "
                                  "stream and direction (as last read from the switch)", labels=("name", "direction"))
    nbytes = CounterMetricFamily("nfshunt_static_bytes", "Bytes a static shunt's flows forwarded, by stream "
                                 "and direction (as last read from the switch)", labels=("name", "direction"))
    for one in static["by_stream"]:
        packets.add_metric([one["name"], one["direction"]], one["packets"])
        nbytes.add_metric([one["name"], one["direction"]], one["bytes"])
    yield from (packets, nbytes)
    yield GaugeMetricFamily("nfshunt_static_flows", "Static shunt flows configured", value=static["flows"])
    yield GaugeMetricFamily("nfshunt_static_flows_missing", "Static shunt flows not found on the switch "
                            "at the last read", value=static["missing"])


class Metrics:
    """The registry with the counters, the latency histogram and the gauges, and the HTTP
    endpoint (when configured)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]):
        self.registry = CollectorRegistry(auto_describe=False)
        self.counters = Counters(self.registry)
        self.latency = Histogram("nfshunt_shunt_latency_seconds",
                                 "Conntrack event read to flows confirmed by the switch (barrier)",
                                 labelnames=("action",), buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(AppCollector(snapshot))
        self.server: Any = None
        # Labelled children, looked up once; both actions' exist from the start (at 0), as the
        # counters' do: a rate over the buckets then sees the first observations too.
        self._by_action: dict[Action, Any] = {a: self.latency.labels(a) for a in (Action.SHUNT, Action.BLOCK)}

    def observe_latency(self, action: Action, seconds: float) -> None:
        child = self._by_action.get(action)
        if child is None:
            child = self._by_action[action] = self.latency.labels(action)
        child.observe(seconds)

    def serve(self, address: str, port: int) -> None:
        self.server, _thread = start_http_server(port, addr=address, registry=self.registry)
        LOG.info("Prometheus metrics on http://%s:%d/metrics", address if ":" not in address else f"[{address}]", port)

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
