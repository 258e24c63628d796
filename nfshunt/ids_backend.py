"""The IDS API's backend (ids_api.RuleBackend): an IDS's rules judged and acted on.

The API's threads hand every call to the event loop (EventIds, as the control socket's
requests are) and wait for its answer; there the store (ids_store) and the one
precedence rule (ids_rules.precedence) decide, and the core acts:
  - a connection's shunt or block is a lower pin (pins.py) with the requester as its
    source: its flows are built and taken down by the existing paths (admission decides
    the entry, every take-down goes through Connections.hand_back), an operator's pin
    beats it, and a later policy change judges it again in admission.decide. `added` is
    answered once the switch confirmed the pair (the Installed outcome), or `added`
    pending when the connection has no live entry yet (its entry's event applies it);
  - an address block is a pair of drop flows on every served switch (address_blocks.py),
    above every shunt; `added` once each connected switch answered the barrier behind them.
Expiry is hard, on the tick (wall clock: it holds across a restart): the flows go, and the
rule is reported ended with what they counted (the flow-removed messages). The rules are
kept in the state file, saved on the tick when changed (written on a thread of its own: at
60,000 rules a write is ~50 ms the event loop must not wait for) and at stop, loaded at start.

The connection's live conntrack entry (what the policy decided) is read on the API's
thread (conntrack.lookup: one netlink request), never on the event loop.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

from os_ken.controller import event

from . import commands as c
from . import cookies, markcodec
from .address_flows import cookie_of
from .accounting import _stamp, carried
from .config import Config, IdsConfig
from .connection import ACTIVE, Conn
from .ids_api import Outcome, Reject, Result, RuleView, State
from .ids_rules import Decision, Kind, Network, Rule, Situation, precedence
from .ids_store import Added, Counts, Ended, Store, write
from .flows import ALL_ONES_64
from .inflight import FlowsRead
from .model import OFP10, Action, ConnEvent, FlowTuple, SwitchFlow
from .switch import Switch

LOG = logging.getLogger("nfshunt")
LATE = "the switch's confirmation (not in time: the rule is kept, and expires as any rule)"
QUEUED = 32  # IDS calls in the event loop's queue at most
ENDING_GRACE = 6.0  # seconds a rule's end waits for its flows' removal to be reported (the core's is 5)


class EventIds(event.EventBase):
    """An IDS API call, run on the event loop."""

    def __init__(self, work: Callable[[], None]):
        super().__init__()
        self.work = work


@dataclass
class _Answer:
    """One call's answer, from the event loop to the API thread that waits for it."""
    taken: threading.Event = field(default_factory=threading.Event)  # the loop has it
    done: threading.Event = field(default_factory=threading.Event)
    outcome: Outcome | None = None
    barriers: list[threading.Event] = field(default_factory=list)  # then these switches' confirmations
    views: list[RuleView] = field(default_factory=list)  # a list's answer

    def answer(self, outcome: Outcome, barriers: Iterable[threading.Event] = ()) -> None:
        self.outcome = outcome
        self.barriers = list(barriers)
        self.done.set()


@dataclass
class _Ending:
    """A rule whose flows are being removed; ended when they report it (or the grace is over)."""
    rule: Rule
    why: str
    deadline: float  # monotonic
    conn_counts: Counts | None = None  # a connection rule's pair, once removed
    waits_conn: bool = False
    answers: list[_Answer] = field(default_factory=list)


class Host(Protocol):
    """What the backend needs of the app."""
    cfg: Config
    switches: list[Switch]

    def run(self, sw: Switch, commands: Iterable[c.Command], waiter: threading.Event | None = None) -> None: ...

    def post(self, ev: event.EventBase) -> None: ...

    def feed(self, events: list[ConnEvent]) -> None: ...


def _key(t: FlowTuple) -> FlowTuple:
    return min(t, t.reversed())


def _action(rule: Rule) -> Action:
    return Action.SHUNT if rule.kind is Kind.SHUNT else Action.BLOCK


class IdsBackend:
    def __init__(self, cfg: IdsConfig, host: Host, counters: Any, audit: logging.Logger,
                 lookup: Callable[[FlowTuple], ConnEvent | None], wall: Callable[[], float] = time.time,
                 mono: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.host = host
        self.counters = counters
        self.audit = audit
        self.lookup = lookup
        self.wall = wall
        self.mono = mono
        self.store = Store(cfg.state_file or None, cfg.max_rules)
        self.waiting: dict[tuple[FlowTuple, Action], list[_Answer]] = {}  # adds waiting for their pair's install
        self.ending: dict[tuple[str, str], _Ending] = {}
        self.ending_conns: dict[FlowTuple, _Ending] = {}
        # Calls in the event loop's queue at once: os-ken's queue (128 events) also carries the
        # switch's replies, which must never wait behind a flood of requests (feeds.HANDOVERS).
        self._room = threading.BoundedSemaphore(QUEUED)
        self._writer: threading.Thread | None = None  # the tick's write of the state file

    # --- the API's threads ----------------------------------------------------------------

    def _call(self, work: Callable[[_Answer], None], timeout: float) -> _Answer:
        """Run `work` on the event loop; TimeoutError if it did not take it in time."""
        ans = _Answer()
        if not self._room.acquire(timeout=timeout):
            raise TimeoutError("the controller's event loop has too many IDS requests queued")

        def run() -> None:
            self._room.release()
            ans.taken.set()
            work(ans)
        self.host.post(EventIds(run))
        if not ans.taken.wait(timeout):
            raise TimeoutError("the controller's event loop did not take the request in time")
        return ans

    def submit(self, rule: Rule, timeout: float) -> Outcome:
        deadline = time.monotonic() + timeout
        entry = None
        if rule.connection is not None:
            try:
                entry = self.lookup(rule.connection)
            except OSError as exc:
                LOG.warning("conntrack lookup of %s failed: %s", rule.connection, exc)
        ans = self._call(lambda a: self._submit(rule, entry, a), timeout)
        if not ans.done.wait(max(0.0, deadline - time.monotonic())):
            return Outcome(Result.ADDED, pending=LATE)
        for barrier in ans.barriers:
            if not barrier.wait(max(0.0, deadline - time.monotonic())):
                return Outcome(Result.ADDED, pending=LATE)
        assert ans.outcome is not None
        return ans.outcome

    def remove(self, source: str, rule_id: str) -> Outcome:
        ans = self._call(lambda a: self._remove(source, rule_id, a), self.cfg.answer_timeout)
        if not ans.done.wait(ENDING_GRACE + 1.0):
            raise TimeoutError("the rule's flows were not removed in time")
        assert ans.outcome is not None
        return ans.outcome

    def rules(self, source: str | None, kind: Kind | None, address: Network | None) -> list[RuleView]:
        def work(a: _Answer) -> None:
            a.views = [self._view(r) for r in self.store.select(source, kind, address)]
            a.answer(Outcome(Result.ADDED))
        ans = self._call(work, self.cfg.answer_timeout)
        ans.done.wait(self.cfg.answer_timeout)
        return ans.views

    def rule(self, source: str, rule_id: str) -> RuleView | None:
        def work(a: _Answer) -> None:
            r = self.store.get(source, rule_id)
            if r is not None:
                self._read_counters(self._view(r), a)
                return
            ended = self.store.ended(source, rule_id)
            a.answer(Outcome(Result.ADDED, view=None if ended is None else _ended_view(ended)))
        ans = self._call(work, self.cfg.answer_timeout)
        if not ans.done.wait(self.cfg.answer_timeout):
            raise TimeoutError("the switch did not answer the read of the rule's counters in time")
        return None if ans.outcome is None else ans.outcome.view

    # --- on the event loop ----------------------------------------------------------------

    def _situation(self, rule: Rule, entry: ConnEvent | None) -> Situation:
        """What precedence needs: the operator's pin, the policy's decision of the live entry."""
        if rule.connection is None:
            return self.store.situation(rule)
        orig = rule.connection
        pin = policy = None
        accepted = True
        for sw in self.host.switches:
            p = sw.core.pins.get(orig)
            if p is not None and p.source is None:
                pin = p.action
            conn = sw.core.find(tuple_=orig)
            if conn is not None and policy is None:
                policy = self._policy(conn.mark) or conn.action
        if policy is None and entry is not None:
            policy = self._policy(entry.mark)
            if policy is None:  # crossed no decision yet (or not the plumbing at all)
                policy, accepted = Action.IGNORE, False
        return self.store.situation(rule, policy=policy, pin=pin, entry_accepted=accepted)

    def _policy(self, mark: int) -> Action | None:
        m = markcodec.decode(mark)
        return None if not m.complete else self.host.cfg.action_for(m.action)  # type: ignore[arg-type]

    def _submit(self, rule: Rule, entry: ConnEvent | None, ans: _Answer) -> None:
        had = self.store.get(rule.source, rule.id)
        if had is not None and had.target != rule.target:
            self._refuse(ans, rule, Reject.DUPLICATE, f"id {rule.id} names another active rule of {rule.source}")
            return
        if had is not None:
            self._count("exists", rule)
            ans.answer(Outcome(Result.EXISTS, "the same rule is already active"))
            return
        if rule.kind is Kind.BLOCK_ADDRESS and any(sw.session is not None and sw.session.fb.version == OFP10
                                                    for sw in self.host.switches):
            self._refuse(ans, rule, Reject.UNAVAILABLE, "an address block needs OpenFlow 1.3 (prefix and IPv6 "
                         "matches): a served switch speaks 1.0")
            return
        verdict = precedence(rule, self._situation(rule, entry), self.cfg.may_shunt)
        if verdict.decision is Decision.REFUSE:
            self.counters.add("ids_refused", f"refused:{verdict.refusal}")
            self._refuse(ans, rule, Reject.REFUSED, verdict.reason, verdict.refusal)
            return
        if self.store.add(rule) is Added.FULL:
            self._refuse(ans, rule, Reject.FULL, f"full: ids.max_rules ({self.cfg.max_rules}) rules are active")
            return
        self._audit("ids_rule_added", rule, verdict=verdict.decision.value, reason=verdict.reason)
        self._count("added", rule)
        if verdict.decision is Decision.EXISTS:
            self._apply(rule, None)
            ans.answer(Outcome(Result.EXISTS, verdict.reason))
        elif rule.kind is Kind.WHITELIST:
            for blocked in self.store.exempted_by(rule):
                self._end(blocked, f"lifted by whitelist {rule.source}/{rule.id}")
            ans.answer(Outcome(Result.ADDED))
        elif rule.kind is Kind.BLOCK_ADDRESS:
            barriers = self._apply(rule, None)
            if not barriers:
                ans.answer(Outcome(Result.ADDED, pending="a switch to connect (installed when one does)"))
            else:
                ans.answer(Outcome(Result.ADDED), barriers)
        else:
            self._connection(rule, entry, verdict.decision, ans)

    def _connection(self, rule: Rule, entry: ConnEvent | None, decision: Decision, ans: _Answer) -> None:
        assert rule.connection is not None
        action = _action(rule)
        key = (_key(rule.connection), action)
        conns = [conn for sw in self.host.switches if (conn := sw.core.find(tuple_=rule.connection)) is not None]
        self.waiting.setdefault(key, []).append(ans)
        self._apply(rule, entry)
        if ans.done.is_set():  # installed in this very turn (a switch that answers at once)
            return
        if any(conn.action is action and conn.state in ACTIVE for conn in conns):
            self._answered(key, Outcome(Result.ADDED, reason="its flows are on the switch already"))
        elif decision is Decision.WAIT or (entry is None and not conns):
            self._answered(key, Outcome(Result.ADDED, pending="the connection's conntrack entry (applied when "
                                        "its event comes)"))

    def _answered(self, key: tuple[FlowTuple, Action], outcome: Outcome) -> None:
        for ans in self.waiting.pop(key, ()):
            ans.answer(outcome)

    def _apply(self, rule: Rule, entry: ConnEvent | None) -> list[threading.Event]:
        """Put a kept rule into effect on every switch: barrier waiters of connected ones."""
        now = self.mono()
        waiters: list[threading.Event] = []
        if rule.kind is Kind.BLOCK_ADDRESS:
            assert rule.address is not None
            expires = now + rule.expires - self.wall()
            for sw in self.host.switches:
                out = sw.core.block_address(rule.address, expires, f"{rule.source}/{rule.id}")
                waiter = threading.Event()
                if sw.session is not None:
                    waiters.append(waiter)
                self.host.run(sw, out, waiter)
        elif rule.connection is not None:
            for sw in self.host.switches:
                self.host.run(sw, sw.core.ids_pin(rule.connection, _action(rule), rule.source, now))
            if entry is not None:
                self.host.feed([entry])
        return waiters

    def installed(self, conn: Conn) -> None:
        """The switch confirmed a pair (Outcomes' Installed): adds waiting for it are answered."""
        if self.waiting:
            key = (_key(conn.orig), conn.action)
            if key in self.waiting:
                self._answered(key, Outcome(Result.ADDED))

    def removed(self, conn: Conn) -> None:
        """A pair left the switch (Outcomes' Removed): a rule ending for it has its counters."""
        if self.ending_conns:
            ending = self.ending_conns.pop(_key(conn.orig), None)
            if ending is not None:
                ending.conn_counts = Counts(**carried(conn))
                self._finish_due()

    def _remove(self, source: str, rule_id: str, ans: _Answer) -> None:
        rule = self.store.get(source, rule_id)
        if rule is None:
            ended = self.store.ended(source, rule_id)
            if ended is None:
                ans.answer(Outcome(Result.ERROR, f"{source} has no rule {rule_id}", error=Reject.NOT_FOUND))
            else:
                ans.answer(Outcome(Result.EXPIRED if ended.why.startswith("expired") else Result.REMOVED,
                                   view=_ended_view(ended)))
            return
        self._end(rule, "removed", ans)

    def end_by_operator(self, source: str, rule_id: str) -> bool:
        """The operator beats every IDS (precedence 1): an IDS's rule taken out, as its
        requester's removal would (its flows go, it is reported ended). False: no such rule."""
        rule = self.store.get(source, rule_id)
        if rule is None:
            return False
        self._audit("ids_rule_removed_by_operator", rule)
        self._end(rule, "removed by the operator")
        return True

    def _end(self, rule: Rule, why: str, ans: _Answer | None = None) -> None:
        """Take a rule's flows down; it ends once they are gone (tick)."""
        ending = self.ending.get(rule.key)
        fresh = ending is None
        if ending is None:
            ending = self.ending[rule.key] = _Ending(rule, why, self.mono() + ENDING_GRACE)
        if ans is not None:
            ending.answers.append(ans)
        if fresh:
            self._take_down(rule, ending)  # (may end it at once: a switch that answers in this turn)
        self._finish_due()

    def _take_down(self, rule: Rule, ending: _Ending) -> None:
        now = self.mono()
        reason = f"{rule.source} rule {rule.id} {ending.why}"
        if rule.kind is Kind.BLOCK_ADDRESS:
            assert rule.address is not None
            if any(r.key != rule.key and r.key not in self.ending for r in self.store.holders(rule)):
                return  # the flows serve another requester's rule too: they stay
            for sw in self.host.switches:
                self.host.run(sw, sw.core.unblock_address(rule.address, reason))
        elif rule.connection is not None:
            self._answered((_key(rule.connection), _action(rule)), Outcome(
                Result.ERROR, "the rule ended before its flows were confirmed", error=Reject.UNAVAILABLE))
            # The pin passes to another rule of the connection, a block first (it beats a shunt).
            key = _key(rule.connection)
            left = sorted((r for r in self.store.rules.values() if r.connection is not None and r.key != rule.key
                           and r.key not in self.ending and _key(r.connection) == key),
                          key=lambda r: (r.kind is not Kind.BLOCK, r.created))
            successor = (_action(left[0]), left[0].source) if left else None
            for sw in self.host.switches:
                out = sw.core.ids_release(rule.connection, rule.source, reason, now, successor)
                if any(isinstance(cmd, (c.RemoveFlows, c.RestoreConntrack)) for cmd in out):
                    ending.waits_conn = True
                    self.ending_conns[_key(rule.connection)] = ending
                self.host.run(sw, out)

    def _finish_due(self) -> None:
        now = self.mono()
        for key, ending in list(self.ending.items()):
            counts = self._counts(ending)
            if counts is None and now < ending.deadline or self.ending.pop(key, None) is None:
                continue  # (None: ended meanwhile, by a call this one's take-down made)
            rule = ending.rule
            if rule.connection is not None:
                self.ending_conns.pop(_key(rule.connection), None)
            if rule.address is not None:
                for sw in self.host.switches:
                    sw.core.shared.address_blocks.forget_counts(rule.address)
            ended = self.store.end(rule, ending.why, self.wall(), counts or Counts())
            self._report(ended)
            for ans in ending.answers:
                ans.answer(Outcome(Result.EXPIRED if ending.why.startswith("expired") else Result.REMOVED,
                                   view=_ended_view(ended)))

    def _counts(self, ending: _Ending) -> Counts | None:
        """The flows' counters once every switch reported their removal; None: not yet."""
        rule = ending.rule
        if rule.kind is Kind.BLOCK_ADDRESS:
            assert rule.address is not None
            packets = nbytes = 0
            for sw in self.host.switches:
                if sw.session is None:
                    continue
                got = sw.core.shared.address_blocks.counts(rule.address)
                if got is None or got[2] < 2:
                    return None
                packets, nbytes = packets + got[0], nbytes + got[1]
            return Counts(packets, nbytes)
        if ending.waits_conn:
            return ending.conn_counts
        return Counts()

    def _report(self, ended: Ended) -> None:
        rule = ended.rule
        self._count(ended.why.split(" ", 1)[0], rule)
        LOG.info("IDS rule %s/%s (%s) ended: %s; %d packets %d bytes", rule.source, rule.id, rule.kind.value,
                 ended.why, ended.counts.packets, ended.counts.bytes)
        if self.audit.handlers:
            self.audit.info(json.dumps({"time": _stamp(), "event": "ids_rule_ended", "requester": rule.source,
                                        **ended.to_json()}))

    # --- the tick, start and stop ----------------------------------------------------------

    def tick(self) -> None:
        """Rules whose hard expiry came lose their flows; ends due are reported; the state
        file written when something changed."""
        for rule in self.store.due(self.wall()):
            if rule.key not in self.ending:
                self._end(rule, "expired")
        self._finish_due()
        self._save_later()

    def load(self) -> None:
        """At start (before the event loop runs): the kept rules back in effect, those that
        expired while the controller was down reported."""
        for ended in self.store.load(self.wall()):
            self._report(ended)
        for rule in list(self.store.rules.values()):
            self._apply(rule, None)
        if self.store.rules:
            LOG.info("IDS rules loaded from %s: %d active", self.store.path, len(self.store))

    def _save_later(self) -> None:
        """The state file written on a thread, one write at a time, of the rules as they are
        now (a failed write leaves the store dirty: tried again next tick)."""
        if not self.store.dirty or self._writer is not None and self._writer.is_alive():
            return
        path = self.store.path
        if path is None:
            self.store.save()  # (kept in memory only)
            return
        lines = self.store.snapshot()

        def run() -> None:
            try:
                write(path, lines)
            except OSError as exc:
                self.store.dirty = True
                LOG.error("cannot write the IDS rules file %s (%s): kept in memory, tried again next tick", path,
                          exc)
        self._writer = threading.Thread(target=run, name="nfshunt-ids-save", daemon=True)
        self._writer.start()

    def save(self) -> None:
        """At stop (and start): the state file written now, after the tick's write if one runs."""
        if self._writer is not None:
            self._writer.join()
        if not self.store.dirty:
            return
        try:
            self.store.save()
        except OSError as exc:
            LOG.error("cannot write the IDS rules file %s (%s): kept in memory, tried again next tick",
                      self.store.path, exc)

    def _read_counters(self, view: RuleView, ans: _Answer) -> None:
        """An active rule's view with its flows' counters, read from every connected switch
        (OpenFlow 1.3: by cookie); answered when all have replied (or gone: not counted)."""
        rule, now = view.rule, self.mono()
        reads: list[tuple[Switch, Any]] = []
        for sw in self.host.switches:
            s = sw.session
            if s is None or s.fb.version == OFP10:
                continue
            if rule.address is not None and rule.kind is Kind.BLOCK_ADDRESS:
                reads.append((sw, s.fb.cookie_stats_request(cookie_of(rule.address, False),
                                                            ALL_ONES_64 & ~cookies.DIRECTION_BIT)))
            elif rule.connection is not None:
                conn = sw.core.find(tuple_=rule.connection)
                if conn is not None and conn.action is _action(rule) and conn.state in ACTIVE:
                    reads.append((sw, s.fb.pair_stats_request(conn)))
        if not reads:
            ans.answer(Outcome(Result.ADDED, view=view))
            return
        got: list[list[SwitchFlow] | None] = []

        def done(flows: list[SwitchFlow] | None) -> None:
            got.append(flows)
            if len(got) == len(reads):
                counted = [f for fl in got if fl for f in fl]
                ans.answer(Outcome(Result.ADDED, view=dataclasses.replace(
                    view, packets=sum(f.packets for f in counted), bytes=sum(f.bytes for f in counted))))
        for sw, msg in reads:
            assert sw.session is not None
            sw.session.ask(msg, FlowsRead(now, done))
            sw.session.send.flush()

    # --- observability --------------------------------------------------------------------

    def by_source(self) -> dict[str, int]:
        """Active rules by requester (read by status and the metrics' scrape)."""
        return dict(Counter(r.source for r in list(self.store.rules.values())))

    def _view(self, rule: Rule) -> RuleView:
        if rule.connection is not None:
            conn = next((x for sw in self.host.switches if (x := sw.core.find(tuple_=rule.connection)) is not None),
                        None)
            if conn is not None and conn.action is _action(rule) and conn.state in ACTIVE:
                return RuleView(rule, State.ACTIVE)
            waits = "the connection's conntrack entry" if conn is None else "the switch's confirmation"
            return RuleView(rule, State.PENDING, waiting_for=waits)
        if rule.address is not None and not any(sw.session is not None for sw in self.host.switches):
            return RuleView(rule, State.PENDING, waiting_for="a switch to connect")
        return RuleView(rule, State.ACTIVE)

    def _refuse(self, ans: _Answer, rule: Rule, why: Reject, reason: str, refusal: Any = None) -> None:
        self._count(f"refused_{why.value}", rule)
        self._audit("ids_rule_refused", rule, error=why.value, reason=reason,
                    **({"refusal": refusal.value} if refusal is not None else {}))
        ans.answer(Outcome(Result.ERROR, reason, error=why, refusal=refusal))

    def _count(self, outcome: str, rule: Rule) -> None:
        self.counters.add("ids_rules", outcome, rule.kind.value)

    def _audit(self, event_name: str, rule: Rule, **more: Any) -> None:
        """The audit line of a rule's change: it names the requester (the rule's source)."""
        if self.audit.handlers:
            self.audit.info(json.dumps({"time": _stamp(), "event": event_name, "requester": rule.source,
                                        **rule.to_json(), **more}))


def _ended_view(ended: Ended) -> RuleView:
    expired = ended.why.startswith("expired")
    return RuleView(ended.rule, State.EXPIRED if expired else State.REMOVED, packets=ended.counts.packets,
                    bytes=ended.counts.bytes)

