"""The operator API: what the control socket's requests do (status, flush, reevaluate,
unshunt, block), answered on the app's event loop. The app hands each request over
(EventControl) and lends this class its state; nothing here talks to a socket."""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from os_ken.controller import event

from . import core as c
from . import markcodec
from .accounting import conn_fields
from .control import parse_tuple
from .model import FlowTuple, SwitchFlow

if TYPE_CHECKING:
    from .switch_app import NFShuntApp

LOG = logging.getLogger("nfshunt")


class EventControl(event.EventBase):
    """A control-socket request, answered on the event loop."""

    def __init__(self, request: dict[str, Any]):
        super().__init__()
        self.request = request
        self.reply: dict[str, Any] = {}
        self.done = threading.Event()

    def answer(self, reply: dict[str, Any]) -> None:
        self.reply = reply
        self.done.set()


class OperatorAPI:
    def __init__(self, app: "NFShuntApp"):
        self.app = app
        self._requests: dict[int, tuple[list[SwitchFlow], EventControl]] = {}  # status requests by xid

    # The app's state, read where it is needed (the switch comes and goes).
    @property
    def core(self) -> c.Core:
        return self.app.core

    @property
    def counters(self) -> Any:
        return self.app.counters

    @property
    def dp(self) -> Any:
        return self.app.dp

    @property
    def fb(self) -> Any:
        return self.app.fb

    def collecting(self, xid: int) -> list[SwitchFlow] | None:
        """The flows gathered so far for a status request's flow-stats reply (None: not one)."""
        request = self._requests.get(xid)
        return request[0] if request is not None else None

    def answer_status(self, xid: int) -> None:
        flows, ev = self._requests.pop(xid)
        ev.answer(self.status(flows))

    def switch_gone(self) -> None:
        for _, request in self._requests.values():
            request.answer(self.status(None))
        self._requests.clear()

    def table(self) -> dict[str, Any]:
        """Entries of the switch's table 0: what it holds (as reported), what NFShunt uses;
        the flow layout, and in the pipeline layout the entries of table 1."""
        core = self.core
        used = core.default_entries() + core.entries
        layout = None if core.version is None else "pipeline" if core.pipeline else "single"
        return {"layout": layout, "max_entries": core.table_max, "used": used,
                "free": None if core.table_max is None else core.table_max - used,
                "table_1": core.shared_entries()}

    def handle(self, ev: EventControl) -> None:
        req = ev.request
        cmd = req.get("cmd")
        now = time.monotonic()
        if cmd == "status":
            if req.get("connections") is False:  # counts only: cheap with 100k shunts
                ev.answer(self.status(None, connections=False))
                return
            if self.dp is None or self.fb is None:
                ev.answer(self.status(None))
                return
            msg = self.fb.owned_flow_stats_request()
            xid = self.dp.set_xid(msg)
            self._requests[xid] = ([], ev)
            self.app._queue(msg)
            self.app._flush()
            return
        if cmd == "flush":
            reason = str(req.get("reason") or "flush by operator")
            out = self.core.flush(reason, now)
            self.counters["operator_flush"] += 1
            LOG.warning("operator flush (%s): taking down %d shunts and blocks", reason, len(out))
            self.app._run(out)
            ev.answer({"ok": True, "removed": len(out), "switch_connected": self.dp is not None})
            return
        if cmd == "reevaluate":
            self.reevaluate(ev, str(req.get("reason") or "policy changed"), now)
            return
        if cmd in ("unshunt", "block"):
            try:
                orig = self.target(req)
            except ValueError as exc:
                ev.answer({"error": str(exc)})
                return
            out = self.core.pin(orig, "ignore" if cmd == "unshunt" else "block", now)
            self.counters[f"operator_{cmd}"] += 1
            LOG.warning("operator %s of %s", cmd, orig)
            self.app._run(out)
            ev.answer({"ok": True, "tuple": str(orig),
                       "flows_removed": any(isinstance(c_, c.RemoveFlows) for c_ in out)})
            return
        if cmd == "role":
            self.role(ev, req.get("role"))
            return
        ev.answer({"error": f"unknown command {cmd!r} (status, flush, reevaluate, unshunt, block, role)"})

    def role(self, ev: EventControl, role: Any) -> None:
        """A pair's takeover or step-down (keepalived's notify, an admin). Answered once the
        request is on its way; `status` shows what the switch granted."""
        roles = self.app.roles
        if roles is None:
            ev.answer({"error": "this controller is not one of a pair (no 'pair' in its config)"})
            return
        if role not in ("master", "backup"):
            ev.answer({"error": f"role must be 'master' or 'backup', not {role!r}"})
            return
        was = roles.granted
        change = roles.take_over() if role == "master" else roles.stand_by()
        self.counters[f"operator_role_{role}"] += 1
        LOG.warning("operator: role %s (generation %d; was %s)", role, roles.generation, was or "nothing granted")
        self.app._role_change(change)
        ev.answer({"ok": True, **roles.status(), "switch_connected": self.dp is not None})

    def reevaluate(self, ev: EventControl, reason: str, now: float) -> None:
        """A new policy: every connection is judged again. Decided marks are cleared in
        the kernel (the next packet of each entry crosses NFSHUNT_POLICY); every shunt and
        block is taken down, a TCP one after its entry is re-created so it goes on through
        the firewall without a stall. Answered once the kernel has done its part."""
        out = self.core.flush(reason, now, reevaluate=True)
        self.counters["operator_reevaluate"] += 1
        LOG.warning("re-evaluating every connection (%s): taking down %d shunts and blocks", reason, len(out))
        self.app._run(out)
        removed = len(out)

        def done(cleared: int, failed: int, error: str | None) -> None:  # on the worker thread
            if error is not None:
                ev.answer({"error": f"could not clear the decision marks: {error}"})
            else:
                ev.answer({"ok": True, "removed": removed, "cleared": cleared, "clear_failed": failed,
                           "switch_connected": self.dp is not None})
        self.app.worker.clear_marks(markcodec.DECISION_MASK, done)

    def target(self, req: dict[str, Any]) -> FlowTuple:
        if "tuple" in req:
            return parse_tuple(str(req["tuple"]))
        ct_id = req.get("ct_id")
        if isinstance(ct_id, bool) or not isinstance(ct_id, int):
            raise ValueError("give 'tuple' or an integer 'ct_id'")
        conn = self.core.find(ct_id=ct_id)
        if conn is None:
            raise ValueError(f"no shunt or block with conntrack id {ct_id}; give the tuple instead")
        return conn.orig

    def status(self, flows: list[SwitchFlow] | None, connections: bool = True) -> dict[str, Any]:
        by_cookie = {f.cookie: f for f in flows or []}
        now = time.monotonic()
        conns = []
        for conn in self.core.conns.values() if connections else ():
            dirs = [by_cookie.get(conn.cookie(r)) for r in (False, True)]
            conns.append({
                **conn_fields(conn, "status"), "state": conn.state.value, "tuple": str(conn.orig),
                "switch_ports": [conn.ingress.fast, conn.egress.fast],
                "age": round(now - (conn.confirmed_time or conn.event_time), 3),
                "packets": [d.packets if d else None for d in dirs],
                "bytes": [d.bytes if d else None for d in dirs]})
        dp = self.dp
        return {
            "switch": {"connected": dp is not None,
                       "datapath_id": f"{dp.id:016x}" if dp is not None and dp.id is not None else None,
                       "openflow": None if dp is None else ("1.0" if dp.ofproto.OFP_VERSION == 1 else "1.3"),
                       "address": None if dp is None else f"{dp.address[0]}:{dp.address[1]}"},
            "uptime": round(time.time() - self.app.started, 1),
            "shunts": self.core.shunts, "blocks": self.core.blocks, "waiting": len(self.core.waiting),
            "pending": self.app.send.pending() if self.app.send is not None else 0,
            "queued": len(self.app.send.queued) if self.app.send is not None else 0,
            "max_shunts": self.core.budget, "flow_stats": flows is not None,
            "table": self.table(),
            "pair": self.app.roles.status() if self.app.roles is not None else None,
            "counters": dict(self.counters), "connections": conns}
