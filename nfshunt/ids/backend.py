"""The IDS API's backend (ids/calls.RuleBackend): an IDS's rules judged and acted on.

Every call is handed to the event loop (ids_loop); an add is answered from there the moment
the switch confirms it (`submit_async`: the API's process, ids_process), the other calls
on the thread that waits for them. On the event loop the store (ids_store) and the one
precedence rule (ids_rules.precedence) decide, and the core acts:
  - a connection's shunt or block is a lower pin (pins.py) with the requester as its
    source: its flows are built and taken down by the existing paths (admission decides
    the entry, every take-down goes through Connections.hand_back), an operator's pin
    beats it, and a later policy change judges it again in admission.decide. `added` is
    answered once the switch confirmed the pair (the Installed outcome), or `added`
    pending when the connection has no live entry yet (its entry's event applies it);
  - an address block is a pair of drop flows on every served switch (address_blocks.py),
    above every shunt; `added` once each connected switch answered the barrier behind them.
An add whose own flows failed inside the controller (one it could not build: a bug past the
checks) never went to the switch: the dispatcher tells the turn's waiter (TurnWaiter.failed)
or, for a pair's install, the adds waiting for it (`not_installed`); it is answered failed
(NOT_BUILT: the API's 500), never added, and its rule ends (RuleEnds.end_failing).
Expiry is hard, on the tick (the monotonic clock while running, the wall clock across a
restart: ids_store): the flows go, and the rule is reported ended with what they counted
(the flow-removed messages: ids_ends); a pair the rule decided also ends on the switch by
itself at the rule's end (its hard timeout: pins.py). The rules are kept in the state file,
saved on the tick when changed (on a thread of its own: at 60,000 rules a write is ~50 ms)
and at stop, loaded and judged again at start. A rule's view (state, counters) is
ids_view's; its counters and audit ids_log's.

The connection's live conntrack entry (what the policy decided) is read here, on the event
loop, in the turn that judges the rule and pins it (kernel/table.lookup: a netlink request
each way, ~10 us): the kernel's answer holds every event the loop has taken, and every
later event comes after the pin. An entry read anywhere else could be stale by the time
the loop installs on it (a connection closed meanwhile: a shunt of a dead entry, carrying
the next connection on its ports past the firewall). The API's process never reads it.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from nfshunt.config.ids import IdsConfig
from nfshunt.config.settings import Config
from nfshunt.core.commands import InstallStatic
from nfshunt.core.connection import ACTIVE, Conn
from nfshunt.observe.logs import RateLimitedLog
from nfshunt.openflow.inflight import TurnWaiter
from nfshunt.records import markcodec
from nfshunt.records.model import OFP10, TCP, TCP_CLOSING, Action, ConnEvent, FlowTuple

from .calls import Outcome, Page, Reject, Result, RuleView
from .ends import ENDING_GRACE, RuleEnds
from .log import RuleLog
from .loop import BUSY, Answer, Host, LoopCalls
from .rules import Decision, Kind, Network, Rule, Situation, holder, pair_key, precedence, server_of
from .store import Added, Store
from .view import ended_view, read_counters, view

LOG = logging.getLogger("nfshunt")
LATE = "the switch's confirmation (not in time: the rule is kept, and expires as any rule)"
NO_ENTRY = "the connection's conntrack entry (applied when its event comes)"
JUDGING = "the firewall's decision of the connection (applied when its event comes)"
CLOSING = "a new connection on these ports that the firewall accepts (this one is closing)"
# An add whose own flows failed inside the controller (Dispatcher._failed: a bug past the
# checks) never went to the switch: answered failed (the API's 500), and its rule ends.
NOT_BUILT = Outcome(Result.ERROR, "its flows could not be built (a bug in the controller, logged): the rule is not "
                    "kept", error=Reject.INTERNAL)


Reply = Callable[[Outcome | Exception], None]  # an add's answer (IdsBackend.submit_async)


class Submitted:
    """An add on its way, answered once (`give`): by the event loop, by a thread that waited
    for barriers or looked its entry up again, or at its deadline (`expire`), whichever
    comes first."""

    def __init__(self, reply: Reply, deadline: float):
        self.reply = reply
        self.deadline = deadline
        self.ans = Answer()
        self._once = threading.Lock()  # taken by the one that answers, never given back

    def give(self, result: Outcome | Exception) -> bool:
        if not self._once.acquire(blocking=False):
            return False
        self.reply(result)
        return True

    def expire(self) -> None:
        """Its deadline passed: kept and added pending the switch if the event loop took it."""
        if self.ans.taken:
            self.give(Outcome(Result.ADDED, pending=LATE))
        else:
            self.give(TimeoutError("the controller's event loop did not take the request in time"))


@dataclass
class _Waiter:
    """An add waiting for its pair's install: the rule it added (Rule.key), its answer."""
    rule: tuple[str, str]
    ans: Answer


class Waiting:
    """Adds waiting for their pair's install, by connection and action; each answered once,
    and dropped then. What the pair does (installed, on the switch already, closing, no entry
    yet) answers every add waiting for it: their rules are in force alike. A rule's end
    answers its own add alone: another rule's stays in force, and waits for the install it
    leads to. At most one a kept rule (a second add of it is answered `exists`), gone at its
    end at the latest."""

    def __init__(self) -> None:
        self.adds: dict[tuple[FlowTuple, Action], list[_Waiter]] = {}

    def __bool__(self) -> bool:
        return bool(self.adds)

    def wait(self, key: tuple[FlowTuple, Action], rule: Rule, ans: Answer) -> None:
        self.adds.setdefault(key, []).append(_Waiter(rule.key, ans))

    def answer(self, key: tuple[FlowTuple, Action], outcome: Outcome,
               barriers: Iterable[threading.Event] = ()) -> list[tuple[str, str]]:
        """Every add waiting for the pair with this action; their rules (Rule.key)."""
        waiters = self.adds.pop(key, ())
        for w in waiters:
            w.ans.answer(outcome, barriers)
        return [w.rule for w in waiters]

    def ended(self, rule: Rule, outcome: Outcome) -> None:
        """A connection rule ended before its pair was confirmed: its own add, if waiting."""
        assert rule.connection is not None
        key = (pair_key(rule.connection), rule.action)
        waiters = self.adds.pop(key, [])
        if left := [w for w in waiters if w.rule != rule.key]:
            self.adds[key] = left
        for w in waiters:
            if w.rule == rule.key:
                w.ans.answer(outcome)


class IdsBackend:
    def __init__(self, cfg: IdsConfig, host: Host, counters: Any, audit: logging.Logger,
                 lookup: Callable[[FlowTuple], ConnEvent | None], wall: Callable[[], float] = time.time,
                 mono: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.host = host
        self.lookup = lookup
        self.wall = wall
        self.mono = mono
        self.store = Store(cfg.state_file or None, cfg.max_rules, shared_whitelists=cfg.shared_whitelists,
                           wall=wall, mono=mono)
        self.log = RuleLog(counters, audit)
        self.waiting = Waiting()
        self.ends = RuleEnds(host, self.store, self.log, self.waiting.ended, wall, mono)
        self.loop = LoopCalls(host)
        self._rlog = RateLimitedLog(LOG)

    # --- the API's threads ----------------------------------------------------------------

    def submit(self, rule: Rule, timeout: float) -> Outcome:
        """An add, waited for on this thread (the in-process API's; its process's: `submit_async`)."""
        got: list[Outcome | Exception] = []
        done = threading.Event()

        def reply(result: Outcome | Exception) -> None:
            got.append(result)
            done.set()
        if (sub := self.submit_async(rule, timeout, reply)) is None:
            raise TimeoutError(BUSY)
        if not done.wait(timeout):
            sub.expire()
        done.wait()  # given by now, or being given by whoever came first
        if isinstance(got[0], Exception):
            raise got[0]
        return got[0]

    def submit_async(self, rule: Rule, timeout: float, reply: Reply) -> Submitted | None:
        """Add a rule, answered once through `reply`: on the event loop itself when the
        switch confirmed the pair (no thread waits for it: the API's process, ids_process),
        else from a thread of its own that waits for switches' barriers; `expire` the result
        at its deadline (`timeout` from now) if it was not answered. None (nothing done, no
        reply) while the loop's queue is full: never waited for (the process's frame reader)."""
        sub = Submitted(reply, time.monotonic() + timeout)
        sub.ans.then = lambda ans: self._added(sub)
        if not self.loop.try_call(lambda a: self._submit(rule, a), sub.ans):
            sub.ans.then = None  # never answered: the cycle it makes with `sub` goes now
            return None
        return sub

    def _added(self, sub: Submitted) -> None:
        """On the event loop: the add's outcome, given now unless switches' barriers are
        still to answer (waited for on a thread, never on the event loop)."""
        ans = sub.ans
        assert ans.outcome is not None
        if all(b.is_set() for b in ans.barriers):
            sub.give(ans.outcome)
            return
        threading.Thread(target=self._finish, args=(sub,), name="nfshunt-ids-add", daemon=True).start()

    @staticmethod
    def _finish(sub: Submitted) -> None:
        ans = sub.ans
        assert ans.outcome is not None
        for barrier in ans.barriers:
            if not barrier.wait(max(0.0, sub.deadline - time.monotonic())):
                sub.give(Outcome(Result.ADDED, pending=LATE))
                return
        sub.give(ans.outcome)

    def _lookup(self, connection: FlowTuple) -> ConnEvent | None:
        """On the event loop: the connection's entry as the kernel holds it now (every event
        the loop took is in the answer, every later one comes after the rule's pin)."""
        try:
            return self.lookup(connection)
        except OSError as exc:
            self.log.counters.inc("ids_lookup_failed")
            self._rlog.warning("ids-lookup", "conntrack lookup of %s failed (the rule waits for its entry's events): "
                               "%s", connection, exc)
            return None

    def remove(self, source: str, rule_id: str) -> Outcome:
        ans = self.loop.call(lambda a: self._remove(source, rule_id, a), self.cfg.answer_timeout)
        if not self.loop.wait(ans, self.cfg.answer_timeout, ENDING_GRACE + 1.0):
            raise TimeoutError("the rule's flows were not removed in time")
        assert ans.outcome is not None
        return ans.outcome

    def rules(self, source: str | None, kind: Kind | None, address: Network | None, after: int,
              limit: int) -> Page:
        """A page, read on the calling thread, never the loop (10,000 rules' views held it
        103 ms): rules as they are at once (Store.page), states from the pairs as they are."""
        rules, nxt = self.store.page(source, kind, address, after, limit)
        return Page([view(r, self.host.switches) for r in rules], nxt)

    def rule(self, source: str, rule_id: str) -> RuleView | None:
        def work(a: Answer) -> None:
            r = self.store.get(source, rule_id)
            if r is not None:
                read_counters(view(r, self.host.switches), self.host.switches, self.mono(), a.answer)
                return
            ended = self.store.ended(source, rule_id)
            a.answer(Outcome(Result.ADDED, view=None if ended is None else ended_view(ended)))
        ans = self.loop.call(work, self.cfg.answer_timeout)
        if not self.loop.wait(ans, self.cfg.answer_timeout, self.cfg.answer_timeout):
            raise TimeoutError("the switch did not answer the read of the rule's counters in time")
        return None if ans.outcome is None else ans.outcome.view

    # --- on the event loop: a rule judged and put into effect -----------------------------

    def _situation(self, rule: Rule, entry: ConnEvent | None) -> Situation:
        """What precedence needs: the operator's pin, the policy's decision of the live entry."""
        if rule.connection is None:
            return self.store.situation(rule)
        orig = rule.connection
        pin = policy = server = None
        accepted = True
        for sw in self.host.switches:
            p = sw.core.pins.get(orig)
            if p is not None and p.source is None:
                pin = p.action
            conn = sw.core.find(tuple_=orig)
            if conn is not None and policy is None:
                policy = self._policy(conn.mark) or conn.action
                server = server_of(conn.orig)
        if entry is not None and server is None:
            server = server_of(entry.orig)
        if policy is None and entry is not None:
            policy = self._policy(entry.mark)
            # An entry whose mark is not complete is still being judged (its first packets
            # crossed the plumbing, the decision comes with a later one): the rule waits for
            # it, as for an entry not seen yet. One with no NFShunt bits never crossed it, and
            # one decided with an action the config does not know never will be shunted.
            if policy is None and (entry.mark & markcodec.NFSHUNT_BITS == 0 or markcodec.decode(entry.mark).complete):
                policy, accepted = Action.IGNORE, False
        return self.store.situation(rule, policy=policy, pin=pin, entry_accepted=accepted, server=server)

    def _policy(self, mark: int) -> Action | None:
        m = markcodec.decode(mark)
        return None if not m.complete else self.host.cfg.action_for(m.action)  # type: ignore[arg-type]

    def _submit(self, rule: Rule, ans: Answer) -> None:
        rule, problem = zoned_rule(rule, self.host.cfg)
        if problem is not None:
            self._refuse(ans, rule, Reject.INVALID, problem)
            return
        had = self.store.get(rule.source, rule.id)
        if had is not None and had.target != rule.target:
            self._refuse(ans, rule, Reject.DUPLICATE, f"id {rule.id} names another active rule of {rule.source}")
            return
        if had is not None:
            self.log.count("exists", rule)
            ans.answer(Outcome(Result.EXISTS, "the same rule is already active"))
            return
        if rule.kind is Kind.BLOCK_ADDRESS and any(sw.session is not None and sw.session.fb.version == OFP10
                                                    for sw in self.host.switches):
            self._refuse(ans, rule, Reject.UNAVAILABLE, "an address block needs OpenFlow 1.3 (prefix and IPv6 "
                         "matches): a served switch speaks 1.0")
            return
        entry = None
        if rule.connection is not None and not any(sw.core.find(tuple_=rule.connection) for sw in self.host.switches):
            entry = self._lookup(rule.connection)  # (a pair on a switch: its entry was decided already)
        verdict = precedence(rule, self._situation(rule, entry), self.cfg.may_shunt)
        if verdict.decision is Decision.REFUSE:
            self.log.counters.add("ids_refused", f"refused:{verdict.refusal}")
            self._refuse(ans, rule, Reject.REFUSED, verdict.reason, verdict.refusal)
            return
        if verdict.server is not None:
            rule = dataclasses.replace(rule, server=verdict.server)  # its pin applies to entries going there
        if self.store.add(rule) is Added.FULL:
            self._refuse(ans, rule, Reject.FULL, f"full: ids.max_rules ({self.cfg.max_rules}) rules are active")
            return
        self.log.change("ids_rule_added", rule, verdict=verdict.decision.value, reason=verdict.reason)
        self.log.count("added", rule)
        if verdict.decision is Decision.EXISTS:
            self._apply(rule, None)
            ans.answer(Outcome(Result.EXISTS, verdict.reason))
        elif rule.kind is Kind.WHITELIST:
            for blocked in self.store.exempted_by(rule):
                self.ends.end(blocked, f"lifted by whitelist {rule.source}/{rule.id}")
            ans.answer(Outcome(Result.ADDED))
        elif rule.kind is Kind.BLOCK_ADDRESS:
            barriers = self._apply(rule, None)
            if _not_built(barriers):
                self.ends.failing.append(rule.key)
                ans.answer(NOT_BUILT)
            elif not barriers:
                ans.answer(Outcome(Result.ADDED, pending="a switch to connect (installed when one does)"))
            else:
                ans.answer(Outcome(Result.ADDED), barriers)
        else:
            self._connection(rule, entry, verdict.decision, ans)
        self.ends.end_failing()  # (an add answered NOT_BUILT: its rule ends now, out of the dispatcher's turns)

    def _connection(self, rule: Rule, entry: ConnEvent | None, decision: Decision, ans: Answer) -> None:
        assert rule.connection is not None
        action = rule.action
        key = (pair_key(rule.connection), action)
        conns = [conn for sw in self.host.switches if (conn := sw.core.find(tuple_=rule.connection)) is not None]
        # A closing entry is never shunted nor blocked (admission): the rule's pin waits for
        # a new connection on the ports, which the firewall judges first.
        closing = entry is not None and entry.orig.proto == TCP and entry.tcp_state in TCP_CLOSING
        self.waiting.wait(key, rule, ans)
        stream = self._apply(rule, None if closing else entry)  # (waiters: a static stream's tuple dropped above it)
        if ans.done.is_set():  # installed in this very turn (a switch that answers at once), or not built
            return
        if _not_built(stream):
            self.ends.failing.append(rule.key)
            self.waiting.ended(rule, NOT_BUILT)
        elif stream:
            self.waiting.answer(key, Outcome(Result.ADDED, reason="dropped in the switch above a static stream"),
                                stream)
        elif any(conn.action is action and conn.state in ACTIVE for conn in conns):
            self.waiting.answer(key, Outcome(Result.ADDED, reason="its flows are on the switch already"))
        elif closing:
            self.waiting.answer(key, Outcome(Result.ADDED, pending=CLOSING))
        elif decision is Decision.WAIT or (entry is None and not conns):
            self.waiting.answer(key, Outcome(Result.ADDED, pending=NO_ENTRY if entry is None else JUDGING))

    def _apply(self, rule: Rule, entry: ConnEvent | None) -> list[TurnWaiter]:
        """Put a kept rule into effect on every switch: barrier waiters of connected ones."""
        now = self.mono()
        waiters: list[TurnWaiter] = []
        if rule.kind is Kind.BLOCK_ADDRESS:
            assert rule.address is not None
            for sw in self.host.switches:
                out = sw.core.block_address(rule.address, self.store.deadline(rule), f"{rule.source}/{rule.id}")
                waiter = TurnWaiter()
                if sw.session is not None:
                    waiters.append(waiter)
                self.host.run(sw, out, waiter)
        elif rule.connection is not None:
            for sw in self.host.switches if self._holds(rule) else ():
                out = sw.core.ids_pin(rule.connection, self.store.hold(rule), now)
                static = TurnWaiter() if sw.session and any(isinstance(c, InstallStatic) for c in out) else None
                waiters.extend([static] if static else [])
                self.host.run(sw, out, static)
            if entry is not None:
                self.host.feed([entry])
        return waiters

    def _holds(self, rule: Rule) -> bool:
        """A connection rule is the one its connection's pin follows (ids_rules.holder)."""
        assert rule.connection is not None
        held = holder(r for r in self.store.of_connection(rule.connection) if r.key not in self.ends)
        return held is not None and held.key == rule.key

    def installed(self, conn: Conn) -> None:
        """The switch confirmed a pair (Outcomes' Installed): adds waiting for it are answered."""
        if self.waiting:
            self.waiting.answer((pair_key(conn.orig), conn.action), Outcome(Result.ADDED))

    def not_installed(self, conn: Conn) -> None:
        """A pair's flows could not be built (Outcomes'; the pair rolled back): adds waiting for
        it are answered failed, their rules ended out of the dispatcher's turn (RuleEnds.failing)."""
        if self.waiting:
            self.ends.failing.extend(self.waiting.answer((pair_key(conn.orig), conn.action), NOT_BUILT))

    def _remove(self, source: str, rule_id: str, ans: Answer) -> None:
        rule = self.store.get(source, rule_id)
        if rule is None:
            ended = self.store.ended(source, rule_id)
            if ended is None:
                ans.answer(Outcome(Result.ERROR, f"{source} has no rule {rule_id}", error=Reject.NOT_FOUND))
            else:
                ans.answer(Outcome(Result.EXPIRED if ended.why.startswith("expired") else Result.REMOVED,
                                   view=ended_view(ended)))
            return
        self.ends.end(rule, "removed", ans)

    def end_by_operator(self, source: str, rule_id: str) -> bool:
        """The operator beats every IDS (precedence 1): an IDS's rule taken out, as its
        requester's removal would (its flows go, it is reported ended). False: no such rule."""
        rule = self.store.get(source, rule_id)
        if rule is None:
            return False
        self.log.change("ids_rule_removed_by_operator", rule)
        self.ends.end(rule, "removed by the operator")
        return True

    def removed(self, conn: Conn) -> None:
        """A pair left the switch (Outcomes' Removed): a rule ending for it has its counters."""
        self.ends.removed(conn)

    # --- the tick, start and stop ----------------------------------------------------------

    def tick(self) -> None:
        """Rules whose hard expiry came lose their flows; ends due are reported; the state
        file written when something changed."""
        self.ends.end_failing()
        for rule in self.store.due(self.mono()):
            if rule.key not in self.ends:
                self.ends.end(rule, "expired")
        self.ends.finish_due()
        self.store.save_soon()

    def load(self) -> None:
        """At start (before the event loop runs): the kept rules judged again against this
        config (ids_store.judge: one it refuses now ends, and a pair of it adopted from the
        switch is handed back: reconcile.py), the others back in effect; those that expired
        while the controller was down reported."""
        for ended in [*self.store.load(), *self.store.judge(self.cfg.may_shunt)]:
            self.log.ended(ended)
        for rule in list(self.store.rules.values()):
            self._apply(rule, None)
        if self.store.rules:
            LOG.info("IDS rules loaded from %s: %d active", self.store.path, len(self.store))

    def save(self) -> None:
        """At stop (and start): the state file written now."""
        self.store.save_now()

    def by_source(self) -> dict[str, int]:
        """Active rules by requester (read by status and the metrics' scrape)."""
        return dict(Counter(r.source for r in list(self.store.rules.values())))

    def _refuse(self, ans: Answer, rule: Rule, why: Reject, reason: str, refusal: Any = None) -> None:
        self.log.count(f"refused_{why.value}", rule)
        self.log.change("ids_rule_refused", rule, error=why.value, reason=reason,
                        **({"refusal": refusal.value} if refusal is not None else {}))
        ans.answer(Outcome(Result.ERROR, reason, error=why, refusal=refusal))


def _not_built(waiters: Iterable[TurnWaiter]) -> bool:
    """Whether something of an add's own turns failed inside the controller (Dispatcher._failed)."""
    return any(w.failed for w in waiters)


def zoned_rule(rule: Rule, cfg: Config) -> tuple[Rule, str | None]:
    """A connection rule in the zone its VLAN names on this config's trunks (the API's
    process cannot see them), or why not (a 400): a VLAN no group carries, or carries in two
    zones; no VLAN nor zone where no group carries untagged frames."""
    c = rule.connection
    if c is None:
        return rule, None
    if rule.vlan is not None:
        try:
            return dataclasses.replace(rule, connection=c._replace(zone=cfg.zone_of_vlan(rule.vlan))), None
        except ValueError as exc:
            return rule, f"connection.vlan: {exc}"
    if (refused := cfg.zone_refused(c.zone)) is not None:  # (an operator's tuple: the same)
        return rule, f"connection: {refused}"
    return rule, None
