"""The operator API: what the control socket's requests do (status, flush, reevaluate:
reevaluation.py, unshunt, block, ids_remove: an IDS's rule taken out; reload:
reloading.py), answered on the app's event loop. The app hands each request over
(EventControl) and lends this class its state; nothing here talks to a socket.

With several switches every request concerns all of them: status reads each connected
switch's flows and answers once all have replied (or gone); flush, reevaluate, unshunt
and block act on every switch's pairs."""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

from os_ken.controller import event

from nfshunt.config.settings import Config
from nfshunt.core import commands as c
from nfshunt.core.connection import Action
from nfshunt.core.policy_state import PolicyWatch
from nfshunt.core.roles import Change
from nfshunt.ids.backend import IdsBackend
from nfshunt.kernel.worker import ConntrackWorker
from nfshunt.observe.accounting import conn_fields
from nfshunt.observe.metrics import Counters
from nfshunt.records.model import FlowTuple, SwitchFlow, openflow_label
from nfshunt.switch.switch import Switch

from . import pin_file, top
from .control import parse_tuple
from .explain import Explain, Gathered, by_next_hop, finish, gather, hops_json
from .reevaluation import Cleared, Reevaluation
from .reloading import Reloader
from .target import parse_target

LOG = logging.getLogger("nfshunt")


class EventControl(event.EventBase):
    """A control-socket request, answered on the event loop."""

    def __init__(self, request: dict[str, Any], context: Any = None):
        super().__init__()
        self.request = request
        self.context = context  # what the control socket's thread read first (explain, top)
        self.reply: dict[str, Any] = {}
        self.done = threading.Event()

    def answer(self, reply: dict[str, Any]) -> None:
        self.reply = reply
        self.done.set()


class StatusRequest:
    """A status request waiting for the flow stats of every switch it asked."""

    def __init__(self, ev: EventControl, status: Callable[[dict[int, list[SwitchFlow] | None]], dict[str, Any]]):
        self.ev = ev
        self.status = status
        self.flows: dict[int, list[SwitchFlow] | None] = {}  # by switch index (None: no read)
        self.asked: set[int] = set()  # switch indexes whose read is still open

    def got(self, index: int, flows: list[SwitchFlow] | None) -> None:
        """A switch's flows (None: it went away, or did not answer)."""
        self.flows[index] = flows
        self.asked.discard(index)
        self.answer_if_complete()

    def answer_if_complete(self) -> None:
        if not self.asked:
            self.ev.answer(self.status(self.flows))


STATIC_COUNTS = ("streams", "flows", "on_switch", "missing", "packets", "bytes")  # status's static part
STATIC_LIMIT_DEFAULT, STATIC_LIMIT_MAX = 100, 1000  # rows of a status's static listing


@dataclass(frozen=True)
class StaticListing:
    """A status's page of static flow rows (`"static": true`; `name`: one stream's only)."""
    name: str | None
    offset: int
    limit: int

    @classmethod
    def of(cls, req: dict[str, Any]) -> "StaticListing | None":
        """The request's listing (None: not asked); ValueError for a bad one."""
        want = req.get("static", False)
        if want is False:
            return None
        if want is not True:
            raise ValueError("static must be true or false")
        name, limit, offset = req.get("name"), req.get("limit", STATIC_LIMIT_DEFAULT), req.get("offset", 0)
        if name is not None and (not isinstance(name, str) or not 1 <= len(name) <= 256):
            raise ValueError("name must be a static shunt's name (a string of 1-256 characters)")
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= STATIC_LIMIT_MAX:
            raise ValueError(f"limit must be an integer 1-{STATIC_LIMIT_MAX}")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError("offset must be an integer 0 or more")
        return cls(name, offset, limit)

    def page(self, switches: list[Switch]) -> dict[str, Any]:
        """The rows offset..offset+limit of every switch's static flows in turn (only those
        rows are made), and where the listing stands."""
        rows: list[dict[str, Any]] = []
        skip, matched = self.offset, 0
        for sw in switches:
            table = sw.core.static
            n = table.matching(self.name)
            matched += n
            if skip >= n:
                skip -= n
                continue
            if len(rows) < self.limit:
                rows += [{**row, "datapath_id": sw.name} for row in table.rows(self.name, skip, self.limit - len(rows))]
            skip = 0
        end = self.offset + len(rows)
        return {"static_shunts": rows, "static_page": {"name": self.name, "offset": self.offset, "limit": self.limit,
                                                       "matched": matched, "next": end if end < matched else None}}


def totals(rows: list[dict[str, Any]], keys: Iterable[str]) -> dict[str, Any]:
    """The controller's figures: the sums of its switches' (status and metrics both show them)."""
    return {k: sum(row[k] for row in rows) for k in keys}


class Controller(Protocol):
    """What the operator API needs of the controller, and nothing more."""
    cfg: Config
    config_path: str | None
    switches: list[Switch]
    counters: Counters
    started: float
    worker: ConntrackWorker
    policy: PolicyWatch
    ids: IdsBackend | None
    clock: Callable[[], float]  # monotonic: the app's (a rig's own)

    def run(self, sw: Switch, commands: Iterable[c.Command], waiter: threading.Event | None = None) -> None:
        """Execute a switch's core's commands and send what they make (then a barrier
        whose answer sets `waiter`)."""

    def role_change(self, sw: Switch, change: Change) -> None:
        """Act on a pair's role change."""

    def post(self, ev: event.EventBase) -> None:
        """Hand an event to the event loop (from any thread)."""


class OperatorAPI:
    def __init__(self, app: Controller):
        self.app = app
        self.explainer = Explain(app)
        self.sampler = top.TopSampler()
        self.reloader = Reloader(app, self._post)
        self.reevaluation = Reevaluation(app, self._post)

    def _post(self, request: dict[str, Any], context: Any) -> EventControl:
        ev = EventControl(request, context)
        self.app.post(ev)
        return ev

    def off_loop(self, request: dict[str, Any],
                 ask: Callable[[dict[str, Any], Any], dict[str, Any]]) -> dict[str, Any] | None:
        """On the control socket's thread, before and after the event loop's part: what
        reads the kernel or a file (explain, top, reload). None: the request is the loop's alone."""
        if request.get("cmd") == "reload":
            return self.reloader.reload(request)
        if request.get("cmd") == "top":
            return self.top(request, ask)
        if request.get("cmd") != "explain":
            return None
        try:
            target = parse_target(request.get("target"))
            if target.tuple is not None:
                target = dataclasses.replace(target, tuple=zoned(target.tuple, request, self.app.cfg))
            elif "vlan" in request or "zone" in request:
                raise ValueError(_ID_ZONED)
        except ValueError as exc:
            return {"error": str(exc), "bad_input": True}
        reply = ask(request, gather(target))
        return reply if "error" in reply else finish(reply, self.app.cfg.audit_log)

    @property
    def counters(self) -> Any:
        return self.app.counters

    @property
    def switches(self) -> list[Switch]:
        return self.app.switches

    def _connected(self) -> bool:
        return any(sw.session is not None for sw in self.switches)

    @staticmethod
    def table(sw: Switch) -> dict[str, Any]:
        """Entries of a switch's table 0: what it holds (as reported), what NFShunt uses;
        the flow layout, and in the pipeline layout the entries of table 1."""
        core = sw.core
        used = core.default_entries() + core.entries
        layout = None if core.version is None else "pipeline" if core.pipeline else "single"
        return {"layout": layout, "max_entries": core.table_max, "used": used,
                "free": None if core.table_max is None else core.table_max - used,
                "table_1": core.shared_entries()}

    def handle(self, ev: EventControl) -> None:
        req = ev.request
        cmd = req.get("cmd")
        now = self.app.clock()  # (the app's, every handler's: a rig's own)
        match cmd:
            case "status":
                self.ask_status(ev, req, now)
            case "flush":
                reason = str(req.get("reason") or "flush by operator")
                removed = self._each(lambda sw: sw.core.flush(reason, now))
                self.counters.add("operator", "flush")
                LOG.warning("operator flush (%s): taking down %d shunts and blocks", reason, removed)
                ev.answer({"ok": True, "removed": removed, "switch_connected": self._connected()})
            case "reevaluate" if isinstance(ev.context, Cleared):  # (the kernel's part done)
                self.reevaluation.cleared(ev.context)
            case "reevaluate":
                self.reevaluation.begin(req, ev.answer, str(req.get("reason") or "policy changed"), now)
            case "unshunt" | "block":
                self.pin(ev, cmd, req, now)
            case "ids_remove":
                self.ids_remove(ev, req)
            case "role":
                self.role(ev, req.get("role"))
            case "reload":  # (a step of one: reloading.py; or SIGHUP's, done off the loop from here)
                self.reloader.on_loop(ev.context, ev.answer, req)
            case "top" if ev.context == "top":
                self.ask_top(ev, now)
            case "explain" if isinstance(ev.context, Gathered):
                self.explainer.on_loop(ev.context, ev.answer, now)
            case _:
                ev.answer({"error": f"unknown command {cmd!r} (status, flush, reevaluate, unshunt, block, "
                                    "ids_remove, role, reload, explain)"})

    def top(self, request: dict[str, Any], ask: Callable[[dict[str, Any], Any], dict[str, Any]]) -> dict[str, Any]:
        """nfshunt top: conntrack's entries read here, the switches' counters on the loop."""
        limit = request.get("limit", top.LIMIT_DEFAULT)
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= top.LIMIT_MAX:
            return {"error": f"limit must be an integer 1-{top.LIMIT_MAX}", "bad_input": True}
        entries, acct, error = top.read_slow()
        view = ask(request, "top")
        if "error" in view:
            return view
        return {**self.sampler.rate(view, entries, acct, limit), "conntrack_error": error}

    def ask_top(self, ev: EventControl, now: float) -> None:
        """top's part on the loop: every pair's counters, read from each connected switch."""
        counters = self.counters.flat()
        request = StatusRequest(ev, lambda flows: top.loop_view(self.switches, counters, flows, time.monotonic()))
        for sw in self.switches:
            if sw.session is not None:
                request.asked.add(sw.index)
                sw.session.read_flows(functools.partial(request.got, sw.index), now)
        request.answer_if_complete()

    def ask_status(self, ev: EventControl, req: dict[str, Any], now: float) -> None:
        """Status: with the connections, once every connected switch's flows are read back;
        the static flows as counts, and one page of their rows if asked (`static`)."""
        try:
            listing = StaticListing.of(req)
        except ValueError as exc:
            ev.answer({"error": str(exc), "bad_input": True})
            return
        if req.get("connections") is False:  # counts only: cheap with 100k shunts (and 10k static streams)
            ev.answer(self.status({}, connections=False, listing=listing))
            return
        request = StatusRequest(ev, functools.partial(self.status, listing=listing))
        for sw in self.switches:
            request.flows[sw.index] = None
            if sw.session is not None:
                request.asked.add(sw.index)
                sw.session.read_flows(functools.partial(request.got, sw.index), now)
        request.answer_if_complete()  # nobody to ask: at once

    def pin(self, ev: EventControl, cmd: str, req: dict[str, Any], now: float) -> None:
        """An operator's unshunt or block of a connection, on every switch."""
        try:
            orig = self.target(req)
        except ValueError as exc:
            ev.answer({"error": str(exc)})
            return
        removed = 0
        for sw in self.switches:  # the connection's next entry may come to any switch's core
            out = sw.core.pin(orig, Action.IGNORE if cmd == "unshunt" else Action.BLOCK, now)
            removed += sum(isinstance(c_, (c.RemoveFlows, c.RestoreConntrack)) for c_ in out)
            # Or its take-down waits (a pending pair's confirmation, an RST's grace): the
            # shunt forwards still, and goes once that comes.
            held = sw.core.find(tuple_=orig)
            removed += held is not None and held.leaving
            self.app.run(sw, out)
        self.counters.add("operator", cmd)
        LOG.warning("operator %s of %s", cmd, orig)
        self.save_pins(now)
        ev.answer({"ok": True, "tuple": str(orig), "flows_removed": removed > 0})

    def save_ended_pins(self, now: float) -> None:
        """The pins written again once one ended with its connection (each tick, and at
        stop): a restart would otherwise hold an ended unshunt's tuple for the rest of its
        hour, and with it the next connection on the tuple."""
        if any(sw.core.pins.ended for sw in self.switches):
            for sw in self.switches:
                sw.core.pins.ended = False
            self.save_pins(now)

    def save_pins(self, now: float) -> None:
        """The operator's pins written for the next start (pin_file.py): the first switch's,
        which every switch holds alike."""
        path = pin_file.path_in(self.app.cfg.state_dir)
        try:
            pin_file.save(path, list(self.switches[0].core.pins.items()), time.time(), now)
        except OSError as exc:
            LOG.error("cannot write the operator's pins to %s (%s): a restart would forget them", path, exc)

    def restore_pins(self) -> None:
        """At start, before the switches connect and the IDS rules are loaded: the operator's
        pins of the last run held again for what is left of them (an operator's pin beats
        an IDS's, so it is there first), and its blocks inside static streams made again."""
        now = self.app.clock()
        kept = pin_file.load(pin_file.path_in(self.app.cfg.state_dir), time.time())
        for pin in kept:
            for sw in self.switches:
                sw.core.pin(pin.orig, pin.action, now, pin.left)  # (no switch yet: nothing to send)
        if kept:
            LOG.warning("held again the operator's %d pins of the last run (%s)", len(kept),
                        pin_file.path_in(self.app.cfg.state_dir))

    def ids_remove(self, ev: EventControl, req: dict[str, Any]) -> None:
        """The operator takes an IDS's rule out (it beats every IDS)."""
        ids = self.app.ids
        source, rule_id = str(req.get("source") or ""), str(req.get("id") or "")
        if ids is None:
            ev.answer({"error": "this controller has no IDS API (no 'ids' in its config)"})
        elif not ids.end_by_operator(source, rule_id):
            ev.answer({"error": f"no active IDS rule {rule_id!r} of {source!r}"})
        else:
            self.counters.add("operator", "ids_remove")
            LOG.warning("operator removed IDS rule %s/%s", source, rule_id)
            ev.answer({"ok": True, "source": source, "id": rule_id})

    def role(self, ev: EventControl, role: Any) -> None:
        """A pair's takeover or step-down (keepalived's notify, an admin). Answered once the
        request is on its way; `status` shows what the switch granted."""
        sw = self.switches[0]  # a pair serves one switch (config.py)
        roles = sw.roles
        if roles is None:
            ev.answer({"error": "this controller is not one of a pair (no 'pair' in its config)"})
            return
        if role not in ("master", "backup"):
            ev.answer({"error": f"role must be 'master' or 'backup', not {role!r}"})
            return
        was = roles.granted
        change = roles.take_over() if role == "master" else roles.stand_by()
        self.counters.add("operator", f"role_{role}")
        LOG.warning("operator: role %s (generation %d; was %s)", role, roles.generation, was or "nothing granted")
        self.app.role_change(sw, change)
        ev.answer({"ok": True, **roles.status(), "switch_connected": sw.session is not None})

    def _each(self, take_down: Callable[[Switch], list[c.Command]]) -> int:
        """Run a take-down on every switch's core; how many pairs it took down."""
        removed = 0
        for sw in self.switches:
            out = take_down(sw)
            removed += len(out)
            self.app.run(sw, out)
        return removed

    def target(self, req: dict[str, Any]) -> FlowTuple:
        if "tuple" in req:
            t = zoned(parse_tuple(str(req["tuple"])), req, self.app.cfg)
            if (refused := self.app.cfg.zone_refused(t.zone)) is not None:  # (the IDS's rules: the same)
                raise ValueError(refused)
            return t
        if "vlan" in req or "zone" in req:
            raise ValueError(_ID_ZONED)
        ct_id = req.get("ct_id")
        if isinstance(ct_id, bool) or not isinstance(ct_id, int):
            raise ValueError("give 'tuple' or an integer 'ct_id'")
        conn = next((found for sw in self.switches if (found := sw.core.find(ct_id=ct_id)) is not None), None)
        if conn is None:
            raise ValueError(f"no shunt or block with conntrack id {ct_id}; give the tuple instead")
        return conn.orig

    def status(self, flows: dict[int, list[SwitchFlow] | None], connections: bool = True,
               listing: "StaticListing | None" = None) -> dict[str, Any]:
        """Every switch's state and pairs; the top-level counts are their sums, and
        "switch", "table" and "pair" describe the first switch (the only one, usually).
        The static flows are counted (`static`), listed a page at a time only if asked."""
        now = time.monotonic()
        conns = []
        switches: list[dict[str, Any]] = []
        for sw in self.switches:
            by_cookie = {f.cookie: f for f in flows.get(sw.index) or []}
            for conn in sw.core.by_key.values() if connections else ():
                dirs = [by_cookie.get(conn.cookie(r)) for r in (False, True)]
                conns.append({
                    **conn_fields(conn, "status"), "state": conn.state.value, "tuple": str(conn.orig),
                    "datapath_id": sw.name, "switch_ports": [conn.ingress.fast, conn.egress.fast],
                    "age": round(now - (conn.confirmed_time or conn.event_time), 3),
                    "packets": [d.packets if d else None for d in dirs],
                    "bytes": [d.bytes if d else None for d in dirs],
                    **({"next_hops": hops_json(conn.hops)} if conn.hops is not None else {})})
            core, session = sw.core, sw.session
            dp, send = (session.dp, session.send) if session is not None else (None, None)
            switches.append({
                "connected": dp is not None,
                "reconciled": dp is not None and core.reconciled,  # its table read back and agreed: shunting
                "datapath_id": f"{dp.id:016x}" if dp is not None and dp.id is not None else
                (sw.name if sw.switch.datapath_id is not None else None),
                "openflow": None if dp is None else openflow_label(dp.ofproto.OFP_VERSION),
                "address": None if dp is None else f"{dp.address[0]}:{dp.address[1]}",
                "ports": [g.physdevin for g in sw.switch.ports],
                **({"routed_interfaces": [{"physdevin": s.physdevin, "port": s.group.fast, "vlan": s.vid or None,
                                           "interface": s.interface} for s in sw.switch.sides.values()]}
                   if sw.switch.sides else {}),
                "shunts": core.shunts, "blocks": core.blocks, "waiting": len(core.waiting),
                "pending": send.pending() if send is not None else 0,
                "queued": len(send.queued) if send is not None else 0,
                "max_shunts": core.budget, "flow_stats": flows.get(sw.index) is not None,
                "table": self.table(sw), "pair": sw.roles.status() if sw.roles is not None else None,
                "static": sw.core.static.summary(),
                # A routing firewall's pairs and static flows by next hop (what a neighbour's loss
                # would hand back or withdraw)
                **({"next_hops": by_next_hop(core.by_key.values(), core.static.hops.values())}
                   if sw.switch.forwarding == "routed" else {}),
                # A trunk's frames of tags no group carries, dropped, by in_port (untagged configs: none)
                **({"vlan_dropped_packets": {str(p): n for p, n in sorted(sw.vlan_dropped.items())}}
                   if any(g.trunk for g in sw.switch.ports) else {})})
        first = switches[0]
        listed = {} if listing is None else listing.page(self.switches)
        return {
            "switch": {k: first[k] for k in ("connected", "reconciled", "datapath_id", "openflow", "address")},
            "switches": switches,
            "uptime": round(time.time() - self.app.started, 1),
            **totals(switches, ("shunts", "blocks", "waiting", "pending", "queued", "max_shunts")),
            "flow_stats": all(sw["flow_stats"] for sw in switches),
            "table": first["table"], "pair": first["pair"],
            "rules_by_source": rules_by_source(self.switches, self.app.ids),
            "counters": self.counters.flat(), "connections": conns,
            "static": totals([sw["static"] for sw in switches], STATIC_COUNTS), **listed}


_ID_ZONED = "a conntrack id or a cookie names its connection's zone already: give a VLAN or zone with a tuple only"


def zoned(t: FlowTuple, req: dict[str, Any], cfg: Config) -> FlowTuple:
    """A request's tuple in the zone its `vlan` (resolved by the config) or `zone` names
    (the tuple's own ' zone N' otherwise); ValueError saying what to give."""
    if "vlan" in req and "zone" in req:
        raise ValueError("give 'vlan' or 'zone', not both")
    if "zone" in req:
        zone = req["zone"]
        if isinstance(zone, bool) or not isinstance(zone, int) or not 0 <= zone <= 65535:
            raise ValueError(f"zone {zone!r} is not a conntrack zone (0-65535)")
    elif "vlan" in req:
        zone = cfg.zone_of_vlan(req["vlan"])
    else:
        return t
    if t.zone and t.zone != zone:
        raise ValueError(f"the tuple names zone {t.zone}, the request {zone}: give one")
    return t._replace(zone=zone)


def rules_by_source(switches: list[Switch], ids: IdsBackend | None) -> dict[str, int]:
    """What decides the pairs and pins now: the policy (pairs it decided), the operator
    (pinned tuples) and each IDS ("ids:<client>": its active rules). Pins hold both
    directions: each counts once. Read on the event loop (status) or a scrape thread."""
    pinned_pairs = operator = 0
    for sw in switches:
        conns = sw.core.conns
        for t, pin in list(sw.core.pins.items()):
            if pin.source is None:
                operator += 1
            elif conns.by_tuple(t) is not None:
                pinned_pairs += 1
    pairs = sum(sw.core.shunts + sw.core.blocks for sw in switches)
    return {"policy": pairs - pinned_pairs // 2, "operator": operator // 2, **(ids.by_source() if ids else {})}


def gauges(switches: list[Switch], ids: IdsBackend | None = None) -> dict[str, Any]:
    """The metrics' gauges, read on the scrape thread (plain reads of the event loop's state)."""
    per_switch = []
    for sw in switches:
        table = OperatorAPI.table(sw)  # what status shows, the same numbers
        per_switch.append({"datapath_id": sw.name, "connected": 1 if sw.session is not None else 0,
                           "shunts": sw.core.shunts, "blocks": sw.core.blocks, "max_shunts": sw.core.budget,
                           "table_max": table["max_entries"], "table_used": table["used"],
                           "table_1": table["table_1"]})
    maxes = [sw["table_max"] for sw in per_switch]
    roles = switches[0].roles
    return {"switches": per_switch,
            **totals(per_switch, ("shunts", "blocks", "connected", "max_shunts", "table_used", "table_1")),
            "waiting": sum(len(sw.core.waiting) for sw in switches),
            "queued": sum(len(sw.session.send.queued) for sw in switches if sw.session is not None),
            "table_max": None if None in maxes else sum(maxes),
            "pair": roles.status() if roles is not None else None,
            "static": static_gauges(switches),
            "slow_path_bytes": _summed([sw.slow_path_bytes for sw in switches]),
            "vlan_dropped": [(sw.name, port, n) for sw in switches for port, n in sorted(sw.vlan_dropped.items())],
            "rules": rules_by_source(switches, ids)}


def static_gauges(switches: list[Switch]) -> dict[str, Any]:
    """The static flows' counts and their counters by stream and direction, summed when they
    were read (StaticTable.counted): O(streams) a scrape, not a walk over every flow."""
    flows = missing = 0
    by_group: dict[tuple[str, bool], tuple[int, int]] = {}
    for sw in switches:
        table = sw.core.static
        counted = table.totals  # (one read: the loop replaces it whole)
        flows += len(table.flows)
        missing += max(0, len(table.flows) - counted.on_switch)
        for group, (_, p, b) in counted.by_group.items():
            was = by_group.get(group, (0, 0))
            by_group[group] = (was[0] + p, was[1] + b)
    return {"flows": flows, "missing": missing,
            "by_stream": [{"name": name, "direction": "reply" if reply else "original", "packets": p, "bytes": b}
                          for (name, reply), (p, b) in by_group.items()]}


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    """Per-switch counters by key, added up (empty while no switch has read any)."""
    out: dict[str, int] = {}
    for one in counts:
        for key, n in one.items():
            out[key] = out.get(key, 0) + n
    return out
