"""`nfshunt explain`: one connection followed through every layer the controller knows:
its conntrack entry, the controller's view on each switch (its pair and state, the pin,
static shunts, what decided it), the switch's flows for it read live, and, when it is not
shunted, the exact reason, taken from admission's own verdict (`Core.dry_run`).

Three steps, so the event loop never waits on the kernel, a file or the switch:
- `gather` (the control socket's thread): the target parsed, the entry looked up (one
  netlink GET; a dump for a conntrack id or a cookie), the accounting sysctls read;
- `Explain.on_loop` (the event loop): the controller's view of every switch, answered once
  each switch's flows are read (or at READ_WAIT with what came);
- `finish` (the control socket's thread again): the audit log's recent lines for it, the
  verdict in words.
The policy rule that marked it is read by the CLI (iptables-save), above this layer.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

from nfshunt.config.settings import Config
from nfshunt.core import admission as adm
from nfshunt.core.authority import Decider, of_pair, of_tuple
from nfshunt.core.connection import Conn, State
from nfshunt.ids.backend import IdsBackend
from nfshunt.kernel import table
from nfshunt.records import cookies, markcodec
from nfshunt.records.model import OFP10, TCP_STATES, ConnEvent, EntryCounts, FlowTuple, NextHop, SwitchFlow
from nfshunt.records.routed import hop_json
from nfshunt.switch.switch import Switch

from .target import Target

READ_WAIT = 3.0  # seconds the answer waits for the switches' flows (the socket waits 5)
AUDIT_TAIL = 1 << 20  # bytes of the audit log read from its end
HISTORY = 10  # audit lines shown, newest last


@dataclass
class Gathered:
    """What the control socket's thread read before the event loop is asked."""
    target: Target
    entries: list[tuple[ConnEvent, EntryCounts]] = field(default_factory=list)
    kernel_error: str | None = None
    acct: bool | None = None  # net.netfilter.nf_conntrack_acct
    timestamps: bool | None = None  # net.netfilter.nf_conntrack_timestamp


def gather(target: Target, lookup: Callable[[FlowTuple], tuple[ConnEvent, EntryCounts] | None] = table.lookup_counted,
           dump: Callable[[], list[tuple[ConnEvent, EntryCounts]]] | None = None) -> Gathered:
    """The kernel's part, on the calling thread: the entry of a tuple (one GET each way), or
    the entries of a conntrack id (a dump of those that crossed the bridge)."""
    got = Gathered(target, acct=table.sysctl_on(table.ACCT_SYSCTL),
                   timestamps=table.sysctl_on(table.TIMESTAMP_SYSCTL))
    try:
        if target.tuple is not None:
            found = lookup(target.tuple)
            got.entries = [found] if found is not None else []
        else:
            everything = dump() if dump is not None else table.dump_counted(lambda _what: None)
            got.entries = [(e, n) for e, n in everything if e.ct_id == target.ct_id]
    except (OSError, TimeoutError) as exc:
        got.kernel_error = f"conntrack could not be read: {exc}"
    return got


def entry_json(ev: ConnEvent, counts: EntryCounts, cfg: Config) -> dict[str, Any]:
    mark = markcodec.decode(ev.mark)
    action = cfg.action_for(mark.action) if mark.action is not None else None
    o, r = ev.orig, ev.reply
    return {"ct_id": ev.ct_id, "tuple": str(o), "reply": str(r), "nat": not o.mirrors(r),
            "tcp_state": TCP_STATES[ev.tcp_state] if ev.tcp_state is not None and ev.tcp_state < len(TCP_STATES)
            else None, "mark": f"0x{ev.mark:08x}", "zone": counts.zone,
            "vlan": _vlans(cfg, o.zone, mark.ingress, mark.egress), "timeout": counts.timeout,
            "decoded": {"ingress": mark.ingress, "egress": mark.egress, "decided": mark.action is not None,
                        "action_number": mark.action, "action": action.value if action is not None else None},
            "packets": list(counts.packets) if counts.packets is not None else None,
            "bytes": list(counts.bytes) if counts.bytes is not None else None}


def _vlans(cfg: Config, zone: int, ingress: int | None, egress: int | None) -> list[int | None] | None:
    """A zoned entry's tag on each side, as the trunks of the groups its mark names carry its
    zone (0: untagged; None: that side not recorded, or not carrying it); None untagged. A
    routing firewall's: the tags of the interfaces its mark names (None: all untagged)."""
    sides = {p: side for sw in cfg.switches for p, side in sw.sides.items()}  # (a routing firewall's interfaces)
    if sides:
        tags = [sides[p].vid if p in sides else None for p in (ingress, egress)]
        return tags if any(tags) else None
    if not zone:
        return None
    groups = {g.physdevin: g for g in cfg.all_port_groups}
    return [groups[p].vid_of_zone.get(zone) if p in groups else None for p in (ingress, egress)]


def marked(source: ConnEvent | Conn | None, cfg: Config) -> dict[str, Any] | None:
    """What the policy's rules are matched against (the CLI reads NFSHUNT_POLICY): the
    entry's tuples and mark, or a pair's where its entry is gone (a live shunt's)."""
    if source is None:
        return None
    o, r = source.orig, source.reply
    mark = markcodec.decode(source.mark)
    action = cfg.action_for(mark.action) if mark.action is not None else None
    return {"from": "entry" if isinstance(source, ConnEvent) else "pair", "family": o.family, "proto": o.proto,
            "orig": [o.src, o.dst, o.sport, o.dport], "reply": [r.src, r.dst, r.sport, r.dport],
            "mark": f"0x{source.mark:08x}", "action": action.value if action is not None else None}


def pair_json(conn: Conn, now: float) -> dict[str, Any]:
    return {"action": conn.action.value, "state": conn.state.value, "ct_id": conn.ct_id, "slot": conn.slot,
            "cookie": f"0x{conn.cookie(False):016x}", "tuple": str(conn.orig),
            "ports": list(conn.ports),
            **({"vlans": list(conn.tags)} if conn.sides and conn.tags and any(conn.tags) else {}),
            "switch_ports": [conn.ingress.fast, conn.egress.fast],
            "age": round(now - (conn.confirmed_time or conn.event_time), 3), "entry_deleted": conn.entry_deleted,
            "idle_timeout": conn.idle_timeout, "remove_reason": conn.remove_reason, "adopted": conn.adopted,
            **({"next_hops": hops_json(conn.hops)} if conn.hops is not None else {})}


def hops_json(hops: tuple[NextHop, NextHop]) -> list[dict[str, str]]:
    """A routed pair's next hops: the original direction's, then the reply's."""
    return [hop_json(h) for h in hops]


def by_next_hop(conns: Iterable[Conn], static: Iterable[NextHop | str | None] = ()) -> list[dict[str, Any]]:
    """The routed pairs and static flows (`via`) by next hop, most first: a pair counts once
    under each of its two directions' next hops, a static flow under its own (a neighbour going
    away hands back every pair it is on and withdraws every such flow)."""
    pairs = Counter(h for conn in conns if conn.hops is not None for h in set(conn.hops))
    flows = Counter(h for h in static if isinstance(h, NextHop))
    return [{**hop_json(h), "pairs": pairs[h], "static_flows": flows[h]}
            for h in sorted(pairs.keys() | flows.keys(), key=lambda h: (-pairs[h] - flows[h], h.ifname, h.neighbour))]


def flow_json(f: SwitchFlow) -> dict[str, Any]:
    parsed = cookies.parse(f.cookie)
    return {"cookie": f"0x{f.cookie:016x}", "kind": parsed.kind.name.lower() if parsed else None,
            "direction": "reply" if parsed and parsed.reply else "original", "priority": f.priority,
            "in_port": f.in_port, "out_port": f.out_port, "match": str(f.match) if f.match else None,
            "packets": f.packets, "bytes": f.bytes, "duration": round(f.duration, 3)}


class Host(Protocol):
    cfg: Config
    switches: list[Switch]
    ids: IdsBackend | None


class ExplainRequest:
    """One explain waiting for the switches' flows: what was found on the event loop, the
    reads still open. Answered once (the last read, or READ_WAIT on a timer thread, which
    touches only what was captured here)."""

    def __init__(self, answer: Callable[[dict[str, Any]], None], found: dict[str, Any]):
        self._answer = answer
        self.found = found
        self.asked: set[int] = set()
        self._lock = threading.Lock()
        self._done = False

    def got(self, index: int, keep: Callable[[SwitchFlow], bool], flows: list[SwitchFlow] | None) -> None:
        """A switch's read (None: it went away or never answered)."""
        if self._done:  # answered without it (READ_WAIT)
            return
        row = self.found["switches"][index]
        row["flows"] = None if flows is None else [flow_json(f) for f in flows if keep(f)]
        self.asked.discard(index)
        if not self.asked:
            self.answer()

    def answer(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._answer(self.found)


class Explain:
    """The event loop's part of explain (OperatorAPI hands the request over)."""

    def __init__(self, host: Host):
        self.host = host

    def on_loop(self, got: Gathered, answer: Callable[[dict[str, Any]], None], now: float) -> None:
        target, cfg = got.target, self.host.cfg
        rows, conn_tuple = [], target.tuple
        for sw in self.host.switches:
            conn = self._pair(sw, target)
            if conn is not None:
                conn_tuple = conn.orig
            rows.append((sw, conn))
        entry = _chosen(got.entries, conn_tuple)
        if conn_tuple is None and entry is not None:
            conn_tuple = entry[0].orig
        found: dict[str, Any] = {
            "target": target.text, "tuple": str(conn_tuple) if conn_tuple else None, "_tuple": conn_tuple,
            "conntrack": {"found": entry is not None, "entries_with_id": len(got.entries),
                          "accounting": got.acct, "timestamps": got.timestamps, "error": got.kernel_error,
                          "entry": entry_json(entry[0], entry[1], cfg) if entry is not None else None},
            "ids_rules": self._ids_rules(conn_tuple), "switches": [],
            "marked": marked(entry[0] if entry else next((c for _, c in rows if c is not None), None), cfg),
            "mark_actions": {str(n): a.value for n, a in cfg.mark_actions.items()}}
        request = ExplainRequest(answer, found)
        reads = []
        for sw, conn in rows:
            row, read = self._switch(sw, conn, conn_tuple, entry[0] if entry else None, now)
            found["switches"].append(row)
            if read is not None:
                request.asked.add(sw.index)
                reads.append((sw, read))
        for sw, (msg, keep) in reads:
            assert sw.session is not None
            sw.session.ask(msg, _flows_read(now, request, sw.index, keep))
            sw.session.send.flush()
        if request.asked:
            timer = threading.Timer(READ_WAIT, request.answer)
            timer.daemon = True
            timer.start()
        else:
            request.answer()

    @staticmethod
    def _pair(sw: Switch, target: Target) -> Conn | None:
        core = sw.core
        if target.key is not None and target.kind in (cookies.Kind.SHUNT, cookies.Kind.BLOCK, cookies.Kind.TEARDOWN):
            return core.by_key.get(target.key)
        if target.tuple is not None:
            return core.find(tuple_=target.tuple)
        return core.find(ct_id=target.ct_id) if target.ct_id is not None else None

    def _switch(self, sw: Switch, conn: Conn | None, t: FlowTuple | None, entry: ConnEvent | None,
                now: float) -> tuple[dict[str, Any], tuple[Any, Callable[[SwitchFlow], bool]] | None]:
        """A switch's view of the connection, and the flow read to ask it (None: none)."""
        core, cfg = sw.core, sw.cfg
        pin = core.pins.get(t) if t is not None else None
        statics = [f for f in core.static.flows.values() if t is not None and (f.covers(t) or f.covers(t.reversed()))]
        decider: Decider = of_pair(conn, pin) if conn is not None else \
            of_tuple(cfg, entry.mark if entry else None, pin, statics)
        verdict = core.dry_run(entry) if entry is not None and conn is None else None
        session = sw.session
        row: dict[str, Any] = {
            "datapath_id": sw.name, "connected": session is not None, "reconciled": core.reconciled,
            "backup": core.backup, "pair": pair_json(conn, now) if conn is not None else None,
            "authority": {"kind": decider.authority.value, "source": decider.source,
                          "action": decider.action.value if decider.action else None},
            "pin": None if pin is None else {"action": pin.action.value, "source": pin.source or "operator",
                                             "expires_in": None if pin.expires == float("inf") else
                                             round(pin.expires - now, 1)},
            "static": [{"name": f.shunt.label, "flow": f.describe(), "cookie": f"0x{f.cookie:016x}"}
                       for f in statics],
            "waiting": t is not None and (t in core.waiting or t.reversed() in core.waiting),
            "verdict": None if verdict is None else {"act": verdict.act.value, "reason": verdict.reason or None,
                                                     "decided": verdict.decided[0].value if verdict.decided else None},
            "budget": {"used": core.shunts + core.blocks, "max": core.budget or None}, "flows": None}
        if session is None or (conn is None and not statics):
            return row, None
        if conn is not None:
            wanted = {cookies.make(kind, conn.key, r) for kind in (cookies.Kind.SHUNT, cookies.Kind.BLOCK)
                      for r in (False, True)}
            return row, (session.fb.pair_stats_request(conn, catchers=True) if session.fb.version != OFP10 else
                         session.fb.owned_flow_stats_request(), lambda f: f.cookie in wanted or _catcher_of(f, conn))
        cookies_of = {f.cookie for f in statics}
        return row, (session.fb.static_stats_request(), lambda f: f.cookie in cookies_of)

    def _ids_rules(self, t: FlowTuple | None) -> list[dict[str, Any]]:
        ids = self.host.ids
        if ids is None or t is None:
            return []
        rules = ids.store.of_connection(t)
        block = ids.store.blocking(t)
        if block is not None and block not in rules:
            rules.append(block)
        wall = time.time()
        return [{"source": r.source, "id": r.id, "kind": r.kind.value, "priority": r.priority,
                 "expires_in": round(r.expires - wall, 1), "idle_timeout": r.idle_timeout} for r in rules]


def _catcher_of(f: SwitchFlow, conn: Conn) -> bool:
    parsed = cookies.parse(f.cookie)
    return parsed is not None and parsed.kind is cookies.Kind.TEARDOWN and parsed.key == conn.key


def _flows_read(now: float, request: ExplainRequest, index: int, keep: Callable[[SwitchFlow], bool]) -> Any:
    from nfshunt.openflow.inflight import FlowsRead
    return FlowsRead(now, lambda flows: request.got(index, keep, flows))


def _chosen(entries: list[tuple[ConnEvent, EntryCounts]],
            t: FlowTuple | None) -> tuple[ConnEvent, EntryCounts] | None:
    """The entry of the connection: the one of its tuple (either direction), or the only one."""
    if t is not None:
        return next((e for e in entries if t in (e[0].orig, e[0].reply)), None)
    return entries[0] if len(entries) == 1 else None


# --- the verdict in words (the control socket's thread) -------------------------------------

REASONS = {
    adm.R_UNMARKED: "the entry carries no NFShunt mark: it did not cross the bridge's plumbing (the firewall "
                    "host's own traffic, or routed, not bridged)",
    adm.R_INCOMPLETE: "the policy has not decided yet (no NFSHUNT_POLICY rule has marked it)",
    adm.R_UNKNOWN_ACTION: "the mark's action number is not in mark_actions",
    adm.R_UNKNOWN_PORT: "the mark's bridge port is in no port group of the config",
    adm.R_SAME_PORT: "it entered and left by the same bridge port",
    adm.R_POLICY_IGNORE: "the policy says ignore: it stays on the firewall",
    adm.R_PROTOCOL: "only TCP and UDP are shunted",
    adm.R_CLOSING: "the TCP connection is closing on the firewall",
    adm.R_DESTROY: "the entry is gone",
    adm.R_NO_SWITCH: "no switch is connected (or its table is not read back yet): nothing is installed "
                     "until it is",
    adm.R_BACKUP: "this controller is the pair's backup: the other firewall is active",
    adm.R_IPV6_OF10: "IPv6 needs OpenFlow 1.3; the switch speaks 1.0",
    adm.R_DUPLICATE: "a pair of the connection is on the switch already",
    adm.R_QUEUED: "it waits for the pair on its tuple to leave the switch",
    adm.R_BUDGET: "the flow budget is full (max_shunts, or the switch's table): it waits on the slow path for room",
    adm.R_PINNED: "an operator's unshunt keeps it on the slow path",
    adm.R_NAT: "NAT: its reply tuple is not the original reversed (the switch would have to rewrite addresses)",
    adm.R_REPLY_HELD: "NAT gave it a reply tuple a pair on the switch holds (that pair's entry is gone, so the "
                      "kernel saw no clash): it stays on the firewall while that pair lives",
    adm.R_PORTS_MOVED: "its entry's mark names other bridge ports than its pair's (the egress a flooded first "
                       "packet's copy recorded, set right by its reply): the pair goes, and it is judged again",
    adm.R_ID_COLLISION: "every slot of its conntrack id is held by live pairs (a hash collision): it waits",
    adm.R_CLOSED_ON_FIREWALL: "it closed on the firewall",
    adm.R_IDS_SERVER: "an IDS's shunt was judged on the other end as the server: not applied to this direction",
    adm.R_WITHDRAWN: "the decision its pair rests on was cleared from the entry (a re-evaluation, or by hand): "
                     "the pair goes, and the connection's next packet is judged again",
    adm.R_DECIDED_BEFORE: "a re-evaluation (a new policy), or a start under a policy the switch's pairs were not "
                          "decided under, is clearing the decisions in the kernel, or the entry was read before it "
                          "had: the decision may be the old policy's, so it is not acted on (a dump reads every "
                          "entry again once the clearing is done)",
    adm.R_VLAN: "its entry is in a conntrack zone (a `-j CT --zone` rule) that no VLAN of its port groups names: "
                "it stays on the firewall",
    adm.R_ROUTED: "the firewall routes (forwarding \"routed\") and shunting through a routing firewall is not "
                  "enabled (experimental_routed), so it stays on the firewall",
    adm.R_STICK_PIPELINE: "a TCP shunt routed between two VLANs of one trunk (router on a stick), which the pipeline "
                          "flow layout cannot output: it stays on the firewall (flow_layout \"single\" shunts it)",
    adm.R_HOP_UNKNOWN: "the firewall's route and neighbour tables are being asked where its two directions go; it "
                       "is judged again with their answer",
    adm.R_HOP_ELSEWHERE: "the firewall routes one of its directions out of another interface than the one "
                         "its mark named: the switch cannot send it there, so it stays on the firewall",
    # The tables' no (core/tables.py): it stays on the firewall and is judged again when they change.
    adm.R_NO_ROUTE: "the firewall has no route to one of its ends: it stays there (judged again when a route "
                       "appears)",
    adm.R_BLACKHOLE: "the firewall's route to one of its ends is a blackhole: nothing is shunted to it",
    adm.R_UNRESOLVED: "the firewall has not resolved the MAC of one of its next hops yet: it is shunted once it "
                         "has",
    adm.R_NEXT_HOP_FAILED: "one of its next hops failed in the firewall's neighbour table: it is shunted again "
                              "once the firewall resolves it",
    adm.R_ROUTE_MOVED: "the firewall's route to one of its ends moved to another interface",
    adm.R_FLAPPING: "one of its next hops changed its MAC too often: held down (30 s), it stays on the "
                        "firewall meanwhile",
}
PRE_ESTABLISHED = {"NONE", "SYN_SENT", "SYN_RECV", "SYN_SENT2"}


def history(path: str | None, t: FlowTuple | None, ct_id: int | None) -> list[dict[str, Any]]:
    """The audit log's recent lines about this connection (its tuple either way, or its id
    where no tuple is known), newest last; the file's last AUDIT_TAIL bytes only."""
    if not path or (t is None and ct_id is None):
        return []
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.fstat(fh.fileno()).st_size - AUDIT_TAIL))
            lines = fh.read(AUDIT_TAIL).splitlines()
    except OSError:
        return []
    want = {(t.proto, t.src, t.sport, t.dst, t.dport), (t.proto, t.dst, t.dport, t.src, t.sport)} if t else set()
    out = []
    for line in lines[1:] if len(lines) > 1 else lines:  # the first may be cut
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        key = (_proto(rec.get("proto")), rec.get("src"), rec.get("sport"), rec.get("dst"), rec.get("dport"))
        if key in want or (t is None and rec.get("ct_id") == ct_id):
            out.append(rec)
    return out[-HISTORY:]


def _proto(value: Any) -> Any:
    return {"tcp": 6, "udp": 17}.get(value, value) if isinstance(value, str) else value


def verdict(found: dict[str, Any]) -> dict[str, Any]:
    """The answer in one line: where the connection's packets go, and why."""
    rows = found["switches"]
    ct = found["conntrack"]
    entry = ct["entry"]
    paired = next((r for r in rows if r["pair"] is not None), None)
    if paired is not None:
        return _pair_verdict(paired)
    static = next((r for r in rows if r["static"]), None)
    if static is not None:
        return {"path": "fast", "code": "static", "text": f"a static shunt ({static['static'][0]['name']}) carries "
                "it switch port to switch port: the firewall never sees it"}
    blocked = next((r for r in found["ids_rules"] if r["kind"] == "block_address"), None)
    if blocked is not None:
        return {"path": "dropped", "code": "address block", "text": f"{blocked['source']}'s address block "
                f"{blocked['id']} drops every frame of its host in the switch"}
    row = _deciding(rows)
    if entry is None:
        return _unseen(found, row)
    reason = (row["verdict"] or {}).get("reason")
    if reason is None:
        return {"path": "slow", "code": "would install", "text": "decided "
                f"{(row['verdict'] or {}).get('decided')}; no pair yet: the controller installs it at the entry's "
                "next event"}
    text = REASONS.get(reason, reason)
    if reason == adm.R_INCOMPLETE and entry["tcp_state"] in PRE_ESTABLISHED:
        text = f"not yet ESTABLISHED ({entry['tcp_state']}): the policy decides once the firewall has seen it " \
               "established"
    if reason in (adm.R_NO_SWITCH, adm.R_BACKUP) and not row["connected"]:
        text += " (the switch is away)"
    return {"path": "slow", "code": reason, "text": text}


def _pair_verdict(row: dict[str, Any]) -> dict[str, Any]:
    pair = row["pair"]
    state, action = pair["state"], pair["action"]
    away = "" if row["connected"] else " (the switch is away: its flows stay until their idle timeout)"
    if state == State.TAKING_DOWN.value:
        return {"path": "leaving", "code": "taking down",
                "text": f"its {action} is being taken down ({pair['remove_reason']}){away}"}
    if state == State.PENDING.value:
        return {"path": "slow", "code": "pending", "text": f"{action} flows sent; the switch has not confirmed them"
                f"{away}"}
    where = "on the fast path" if action == "shunt" else "dropped in the switch"
    return {"path": "fast" if action == "shunt" else "dropped", "code": action,
            "text": f"{where} ({state}, {pair['age']:.1f} s), decided by {row['authority']['kind']}{away}"}


def _deciding(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The switch whose port groups the entry's mark names (with several switches, the
    others say R_UNKNOWN_PORT), else the first."""
    return next((r for r in rows if r["verdict"] is not None and r["verdict"]["reason"] != adm.R_UNKNOWN_PORT),
                rows[0])


def _unseen(found: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    pin, last = row["pin"], (found.get("history") or [None])[-1]
    if found["conntrack"]["error"]:
        return {"path": "unknown", "code": "kernel", "text": found["conntrack"]["error"]}
    if pin is not None:
        return {"path": "none", "code": "pinned", "text": f"no conntrack entry now; {pin['source']}'s "
                f"{pin['action']} holds its tuple for its next appearance"}
    if last is not None:
        return {"path": "none", "code": "ended", "text": f"no conntrack entry and no pair now: it ended "
                f"(last seen {last.get('time')}: {last.get('event')} {last.get('reason') or ''})".rstrip()}
    return {"path": "none", "code": "unseen", "text": "nobody has seen this connection: no conntrack entry, no pair "
            "on any switch, no static shunt, nothing in the audit log's recent lines"}


def finish(found: dict[str, Any], audit_log: str | None) -> dict[str, Any]:
    """The answer completed on the control socket's thread: history and verdict."""
    t = found.pop("_tuple", None)
    ct_id = (found["conntrack"]["entry"] or {}).get("ct_id")
    found["history"] = history(audit_log, t, ct_id)
    found["verdict"] = verdict(found)
    return found
