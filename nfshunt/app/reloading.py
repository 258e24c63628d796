"""A config reload (SIGHUP, `nfshunt reload`; what may change: config/reload.py), done off
the event loop but for what must be on it.

The thread that asked (the control socket's; SIGHUP's is started from the event loop)
reads and validates the file, makes the plan and works out each switch's static change
(StaticTable.change: the new flows, the difference as commands): for 10,000 static entries
a second or more, during which the loop used to serve nothing (conntrack events, the
switch's replies, status requests). The loop then takes one short turn to swap the config
and the static tables in (Core.reload), and one turn per slice of the difference: a slice
is as many flow-mods as SLICE_BUDGET of the loop's time allows at the last slice's pace
(Sizer), sent behind a barrier of its own, so whatever came meanwhile is served between
slices. The answer comes once every slice is sent and every barrier behind them answered
(or RELOAD_WAIT passed).

One reload at a time: one asked while another is read, applied or waiting for the
switches is refused, saying so, and changes nothing (ask again once the first is answered).

A turn of the loop that raises (a bug) is told apart from one the loop did not take within
LOOP_WAIT (never run: nothing changed). The swap's turn is all or nothing: what it swapped
in is put back, so the controller runs the config it ran (_apply); a slice's ends that
switch's change there, as a slice not taken does. Either is counted and logged with its
traceback, and the answer says which it was and what runs.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import sys
import threading
import time
from typing import Any, Callable, Iterable, Protocol

from nfshunt.config import settings as config
from nfshunt.config.reload import Plan, plan
from nfshunt.config.settings import Config
from nfshunt.core import commands as c
from nfshunt.core.static_table import StaticChange
from nfshunt.observe.metrics import Counters
from nfshunt.openflow.inflight import ChangeWatch
from nfshunt.switch.switch import Switch

LOG = logging.getLogger("nfshunt")

RELOAD_WAIT = 4.0  # seconds the answer waits for the switches' barriers once the last slice is sent
LOOP_WAIT = 5.0  # seconds a step waits for the event loop to take it (the control socket's own wait)
SLICE_BUDGET = 0.005  # seconds of the event loop a slice aims at: a request may wait for two (under 50 ms)
FIRST_SLICE, MIN_SLICE, MAX_SLICE = 200, 20, 5000  # flow-mods a slice: the first, and the bounds
PREPARE_SWITCH = 0.0005  # seconds: the interpreter's switch interval while a reload is prepared


def answer_waits() -> float:
    """What a reload's answer may wait for on top of its work (reading and validating the
    file, a second at 10,000 static entries; the slices' turns, milliseconds each): the loop
    taking the swap's turn (LOOP_WAIT), a slice it then takes late or not at all (LOOP_WAIT:
    not taken, that switch's change ends there) and the switches' barriers (RELOAD_WAIT,
    from the last slice). Nothing bounds the whole: a file far larger takes longer to read,
    and a loop that takes every slice late waits up to LOOP_WAIT each (`nfshunt reload`
    says, when it gives up, that the reload may still be in progress)."""
    return 2 * LOOP_WAIT + RELOAD_WAIT


class Host(Protocol):
    """What a reload needs of the controller."""
    cfg: Config
    config_path: str | None
    switches: list[Switch]
    counters: Counters
    clock: Callable[[], float]  # monotonic: the event loop's `now`

    def run(self, sw: Switch, commands: Iterable[c.Command], waiter: threading.Event | None = None) -> None:
        """Execute a switch's core's commands and send what they make, behind a barrier
        whose answer sets `waiter`."""


class Posted(Protocol):
    """A request handed to the event loop (operator_api.EventControl)."""
    done: threading.Event
    reply: dict[str, Any]


Post = Callable[[dict[str, Any], Any], Posted]  # hands (request, context) to the event loop


@dataclasses.dataclass
class Step:
    """Work for the event loop, run there once, unless the thread that asked gave up first."""
    work: Callable[[], dict[str, Any]]
    gate: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def take(self) -> bool:
        """True for the first to take it (the loop to run it, or the asker to drop it)."""
        return self.gate.acquire(blocking=False)


@dataclasses.dataclass
class Applied:
    """The loop's turn of a reload: the answer's head, and each switch's row and commands
    to send (None: nothing is sent to it, its row says why)."""
    head: dict[str, Any]
    switches: list[tuple[Switch, dict[str, Any], list[c.Command] | None]]
    took: float = 0.0  # seconds of the event loop


class Sizer:
    """How many flow-mods the next slice takes: what SLICE_BUDGET allows at the pace of the
    last one (at most twice the last, so that one fast slice does not make a long one)."""

    def __init__(self) -> None:
        self.size = FIRST_SLICE

    def took(self, flow_mods: int, seconds: float) -> None:
        if flow_mods < MIN_SLICE:  # (too few to tell the pace: a last slice, a command alone)
            return
        fit = int(SLICE_BUDGET * flow_mods / seconds) if seconds > 0 else MAX_SLICE
        self.size = max(MIN_SLICE, min(MAX_SLICE, 2 * self.size, fit))


def flow_mods(cmd: c.Command) -> int:
    if isinstance(cmd, c.InstallStatic):
        return len(cmd.flows)
    if isinstance(cmd, c.RemoveStatic):
        return len(cmd.cookies)
    return 1


def take(work: collections.deque[c.Command], size: int) -> list[c.Command]:
    """The next `size` flow-mods' worth of commands, in their order: a static install or
    removal larger than what is left of the slice is split, its rest left first in `work`."""
    out: list[c.Command] = []
    while work and size > 0:
        cmd = work[0]
        n = flow_mods(cmd)
        if n <= size:
            out.append(work.popleft())
        elif isinstance(cmd, c.InstallStatic):
            out.append(c.InstallStatic(cmd.flows[:size], cmd.reason))
            work[0] = c.InstallStatic(cmd.flows[size:], cmd.reason)
        else:
            assert isinstance(cmd, c.RemoveStatic)
            out.append(c.RemoveStatic(cmd.cookies[:size], cmd.what[:size], cmd.reason))
            work[0] = c.RemoveStatic(cmd.cookies[size:], cmd.what[size:], cmd.reason)
        size -= n
    return out


@dataclasses.dataclass
class Progress:
    """The reload being done (what a second one is told)."""
    by: str
    started: float
    sent: int = 0
    total: int | None = None  # flow-mods to send (None: not known yet)

    def __str__(self) -> str:
        age = time.monotonic() - self.started
        if self.total is None:
            return f"another reload ({self.by}, {age:.1f} s ago) is being read and validated"
        return f"another reload ({self.by}, {age:.1f} s ago) is being applied: {self.sent} of {self.total} " \
               "flow-mods sent"


class Reloader:
    def __init__(self, app: Host, post: Post):
        self.app = app
        self.post = post
        self._one = threading.Lock()  # held by the reload being done
        self.progress: Progress | None = None

    # --- on the event loop ---------------------------------------------------------------------

    def on_loop(self, context: Any, answer: Callable[[dict[str, Any]], None], request: dict[str, Any]) -> None:
        """A reload's request on the event loop: a step of one being done, run (unless its
        asker gave up), or a new one (SIGHUP's), done by a thread of its own."""
        if isinstance(context, Step):
            if context.take():
                reply: dict[str, Any] = {"failed": "(the log says why)"}
                try:
                    reply = context.work()
                except Exception as exc:  # the loop logs it with its traceback and counts it (handler_errors)
                    reply = {"failed": f"{type(exc).__name__}: {exc}"}
                    raise
                finally:
                    answer(reply)
            return
        threading.Thread(target=lambda: answer(self.reload(request)), name="reload", daemon=True).start()

    def _apply(self, by: str, change: Plan, statics: list[StaticChange], progress: Progress) -> dict[str, Any]:
        """The loop's turn: the new config swapped in, each switch's static change taken in.
        All of it or none: should any of it raise (a bug), what it swapped in is put back
        (the config, the log level, each switch's keys and static table; nothing of it was
        sent yet), so the controller runs the one config it ran; counted (internal_errors)
        and logged with its traceback, and the answer says so."""
        t0 = time.perf_counter()
        app = self.app
        cfg, level, put_back = app.cfg, LOG.level, [sw.saved() for sw in app.switches]
        try:
            applied = self._swap(by, change, statics, progress)
        except Exception as exc:
            app.cfg = cfg
            LOG.setLevel(level)
            for undo in put_back:
                undo()
            app.counters.inc("internal_errors")
            LOG.exception("reload (%s) failed on the event loop: nothing of it kept, what it had swapped in is put "
                          "back: the config running is the one before it", by)
            return {"failed": f"{type(exc).__name__}: {exc}", "put_back": True}
        applied.took = time.perf_counter() - t0
        return {"applied": applied}

    def _swap(self, by: str, change: Plan, statics: list[StaticChange], progress: Progress) -> Applied:
        """_apply's work. Its last steps count and log the reload, and make the progress say
        "applied" from this turn on: a second reload asked as soon as the loop has answered
        is told so, not that this one is still being validated (its thread may not have run
        yet)."""
        app = self.app
        app.cfg = change.config
        if "log_level" in change.changed:  # else a --log-level given at start stays
            LOG.setLevel(config.log_level(change.config))
        static = {"added": 0, "removed": 0}
        switches: list[tuple[Switch, dict[str, Any], list[c.Command] | None]] = []
        cfg = change.config
        for sw, static_change in zip(app.switches, statics, strict=True):
            old = sw.core.static.flows
            out = sw.reload(cfg, static_change, app.clock())
            new = sw.core.static.flows
            added, removed = len(new.keys() - old.keys()), len(old.keys() - new.keys())
            static["added"] += added
            static["removed"] += removed
            row: dict[str, Any] = {"datapath_id": sw.name, "changed_flows": added + removed}
            if sw.session is not None and not sw.core.shared.programs():  # connected, not ours: nothing sent
                row.update(_not_ours(sw, row["changed_flows"]))
                switches.append((sw, row, None))
            else:
                switches.append((sw, row, out))
        static["flows"] = sum(sw.core.static.entries for sw in app.switches)
        total = sum(flow_mods(cmd) for _, _, out in switches for cmd in out or ())
        head = {"ok": True, "changed": list(change.changed), "static": static,
                "kept": {key: "needs a restart: running value kept" for key in change.kept}}
        app.counters.add("operator", "reload")
        LOG.warning("reload (%s): changed %s; static flows %d added, %d removed, %d now%s", by,
                    ", ".join(change.changed) or "nothing", static["added"], static["removed"], static["flows"],
                    f"; kept until a restart: {', '.join(change.kept)}" if change.kept else "")
        progress.total = total
        return Applied(head, switches)

    def _slice(self, sw: Switch, commands: list[c.Command], watch: ChangeWatch) -> dict[str, Any]:
        """The loop's turn for one slice: sent, behind a barrier that `watch` waits for."""
        t0 = time.perf_counter()
        self.app.run(sw, commands, watch)
        return {"took": time.perf_counter() - t0}

    # --- on the thread that asked --------------------------------------------------------------

    def reload(self, request: dict[str, Any]) -> dict[str, Any]:
        """Read and validate the config file again: a bad one changes nothing; of a good one
        the live keys apply, static shunts as the difference only. Answered once every
        connected switch has answered the barriers behind the change: confirmed only if
        every flow-mod of it is in every switch; otherwise what is pending (a switch away,
        or silent) or failed (a flow-mod the switch refused), switch by switch."""
        by = str(request.get("by") or "control socket")
        path = self.app.config_path
        if path is None:
            return {"error": "this controller was not started from a config file"}
        if not self._one.acquire(blocking=False):
            busy = self.progress or "another reload is being done"
            LOG.warning("reload (%s) refused, nothing changed: %s", by, busy)
            return {"error": f"reload refused, nothing changed: {busy}; ask again once it is answered",
                    "busy": True}
        try:
            self.progress = Progress(by, time.monotonic())
            return self._reload(by, path, self.progress)
        finally:
            self.progress = None
            self._one.release()

    def _reload(self, by: str, path: str, progress: Progress) -> dict[str, Any]:
        started = progress.started
        try:
            change, statics = self._prepare(path)
        except config.ConfigError as exc:
            LOG.error("reload (%s) refused, nothing changed: %s: %s", by, path, exc)
            return {"error": f"reload refused, nothing changed: {path}: {exc}", "invalid_config": True}
        validated = time.monotonic()
        reply = self._on_loop(functools.partial(self._apply, by, change, statics, progress))
        if reply is None:
            LOG.error("reload (%s): the event loop did not take it within %g s: nothing changed", by, LOOP_WAIT)
            return {"error": f"the controller's event loop did not take the reload within {LOOP_WAIT:g} s: "
                             "nothing changed"}
        if "applied" not in reply:
            return self._failed(by, reply)
        applied: Applied = reply["applied"]
        longest, slices = applied.took, 0
        sizer = Sizer()
        rows: list[tuple[dict[str, Any], list[SliceWatch] | None]] = []
        for sw, row, out in applied.switches:
            watches = None if out is None else self._send(sw, out, sizer, progress)
            for watch in watches or ():
                longest = max(longest, watch.took)
            slices += len(watches or ())
            rows.append((row, watches))
        answer = self._answer(applied.head, rows, started)
        answer.update(validated_ms=round((validated - started) * 1000, 3), slices=slices,
                      loop_ms_max=round(longest * 1000, 3))
        LOG.log(logging.INFO if answer["confirmed"] else logging.WARNING, "reload (%s) %s: %d flow-mods in %d "
                "slices (the event loop's longest turn %.1f ms)%s", by,
                "confirmed" if answer["confirmed"] else "NOT confirmed", progress.sent, slices, longest * 1000,
                "" if answer["confirmed"] else ": " + "; ".join(f"{r['datapath_id']} {r['state']}"
                                                                for r in answer["switches"]))
        return answer

    @staticmethod
    def _failed(by: str, reply: dict[str, Any]) -> dict[str, Any]:
        """The answer to a reload whose turn on the loop raised (logged there with its
        traceback, and counted): put back whole (_apply), or, should the putting back itself
        have failed, not known to be."""
        why = reply.get("failed")
        if reply.get("put_back"):
            return {"error": f"reload failed on the controller's event loop ({why}): nothing of it kept, the "
                             "controller runs the config it ran before (the log has the traceback)"}
        LOG.error("reload (%s) failed on the event loop (%s) and what it had swapped in may not all be put back: "
                  "restart the controller to run one config", by, why)
        return {"error": f"reload failed on the controller's event loop ({why}) and what it had swapped in may not "
                         "all be put back: the controller may run part of the new config; restart it (the log has "
                         "the traceback)"}

    def _prepare(self, path: str) -> tuple[Plan, list[StaticChange]]:
        """The file read and checked, the plan made, each switch's static change worked out:
        a second of CPU at 10,000 entries, during which a thread that waits for the
        interpreter's lock (the event loop's, the conntrack listener's) gets it within
        PREPARE_SWITCH instead of Python's 5 ms."""
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, PREPARE_SWITCH))
        try:
            new = config.load(path)
            # The running config and static tables, read here: only a reload changes them
            # (one at a time), and a table's flows are replaced, never changed in place.
            change = plan(self.app.cfg, new)
            cfg = change.config
            return change, [sw.core.static.change(cfg, cfg.switches[sw.index]) for sw in self.app.switches]
        finally:
            sys.setswitchinterval(interval)

    def _send(self, sw: Switch, out: list[c.Command], sizer: Sizer, progress: Progress) -> list[SliceWatch]:
        """A switch's commands sent in slices, each its own turn of the loop and its own
        barrier (at least one: an empty change is confirmed by a barrier too)."""
        work = collections.deque(out)
        watches: list[SliceWatch] = []
        while work or not watches:
            commands = take(work, sizer.size)
            n = sum(flow_mods(cmd) for cmd in commands)
            watch = SliceWatch()
            watches.append(watch)
            reply = self._on_loop(functools.partial(self._slice, sw, commands, watch))
            if reply is None:
                watch.end(f"the event loop did not take the change's next flow-mods within {LOOP_WAIT:g} s: "
                          f"{progress.sent} of {progress.total} sent (the rest go in when the switch connects again)")
                break
            if "took" not in reply:  # (its turn raised: the loop logged and counted it)
                watch.end(f"the event loop's turn sending the change's next flow-mods failed ({reply.get('failed')}; "
                          f"the log has the traceback): {progress.sent} of {progress.total} sent before it, that "
                          "turn's perhaps in part (the rest go in when the switch connects again)")
                break
            watch.took = reply["took"]
            sizer.took(n, watch.took)
            progress.sent += n
        return watches

    def _on_loop(self, work: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """Run `work` on the event loop and wait for its reply; None if the loop did not take
        it within LOOP_WAIT (then it is never run); {"failed": why} if it raised there."""
        step = Step(work)
        ev = self.post({"cmd": "reload"}, step)
        if not ev.done.wait(LOOP_WAIT) and step.take():
            return None
        ev.done.wait()  # (taken: running now)
        return ev.reply

    @staticmethod
    def _answer(head: dict[str, Any], rows: list[tuple[dict[str, Any], list[SliceWatch] | None]],
                started: float) -> dict[str, Any]:
        """Each switch's state once its barriers are answered (or RELOAD_WAIT passed):
        confirmed (every flow-mod of the change in it), failed (it refused some, or some
        could not be built: `refused` says which and why), pending (not known to be in it:
        `why`), backup (a pair's backup sends nothing); `confirmed` only if no switch is
        failed or pending."""
        deadline = time.monotonic() + RELOAD_WAIT
        last = None
        for row, watches in rows:
            if watches is None:
                continue
            silent = unanswered = None
            refused: list[tuple[str, str]] = []
            for watch in watches:
                if not watch.wait(max(0.0, deadline - time.monotonic())):
                    silent = f"the switch has not answered within {RELOAD_WAIT:g} s"
                    continue
                refused += watch.failed + watch.refused  # (not built, then what the switch refused)
                if watch.unanswered is not None:
                    unanswered = unanswered or watch.unanswered
                else:
                    last = max(last or 0.0, watch.at or 0.0)
            if refused:
                row.update(state="failed", refused=[{"flow": what, "error": why} for what, why in refused])
            elif silent is not None:
                row.update(state="pending", why=silent)
            elif unanswered is not None:
                row.update(state="pending" if row["changed_flows"] else "nothing to send", why=unanswered)
            else:
                row["state"] = "confirmed"
            row["sent"] = sum(len(watch.xids) for watch in watches)
        states = [row["state"] for row, _ in rows]
        confirmed = all(state not in ("pending", "failed") for state in states)
        return {**head, "switches": [row for row, _ in rows], "confirmed": confirmed,
                "confirmed_ms": round(((last or started) - started) * 1000, 3) if confirmed else None}


def _not_ours(sw: Switch, changed: int) -> dict[str, Any]:
    """The row of a switch that is connected but not this controller's to program (the one
    rule: CoreState.programs), to which nothing is sent: a pair's backup need not (the
    master programs it); a master whose claim the switch has not granted yet (or refused)
    has the change not in the switch: pending, its flows installed whole at the grant."""
    if sw.core.backup:
        return {"state": "backup", "sent": 0, "why": "not master of the switch (a pair's backup): the master programs "
                                                     "it, this controller installs these flows when it takes over"}
    return {"state": "pending" if changed else "nothing to send", "sent": 0,
            "why": "not master of the switch yet (its role claim not granted): the flows go in when the switch is ours"}


class SliceWatch(ChangeWatch):
    """A slice's ChangeWatch, with the event loop's time it took."""

    def __init__(self) -> None:
        super().__init__()
        self.took = 0.0
