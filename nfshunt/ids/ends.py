"""An IDS rule's end: its flows taken down on every switch, then the rule ended with what
they counted once every switch reported their removal (or ENDING_GRACE is over), the
requester's removal answered and the end reported. Expiry, the requester's removal, the
operator's and a whitelist's all end a rule here; on the event loop."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from nfshunt.core import commands as c
from nfshunt.core.connection import Conn
from nfshunt.observe.accounting import carried
from nfshunt.records.model import FlowTuple

from .calls import Outcome, Reject, Result
from .log import RuleLog
from .loop import Answer, Host
from .rules import Kind, Rule, holder, pair_key
from .store import Counts, Store
from .view import ended_view

ENDING_GRACE = 6.0  # seconds a rule's end waits for its flows' removal to be reported (the core's is 5)


@dataclass
class _Ending:
    """A rule whose flows are being removed; ended when they report it (or the grace is over)."""
    rule: Rule
    why: str
    deadline: float  # monotonic
    conn_counts: Counts | None = None  # a connection rule's pair, once removed
    waits_conn: bool = False
    answers: list[Answer] = field(default_factory=list)


class RuleEnds:
    def __init__(self, host: Host, store: Store, log: RuleLog,
                 answered: Callable[[Rule, Outcome], None], wall: Callable[[], float], mono: Callable[[], float]):
        """answered: a rule's own add, if still waiting for its pair's install, answered (the
        rule ended first); another rule's waiting for the pair stays in force, and waits on."""
        self.host = host
        self.store = store
        self.log = log
        self.answered = answered
        self.wall = wall
        self.mono = mono
        self.ending: dict[tuple[str, str], _Ending] = {}
        self.ending_conns: dict[FlowTuple, _Ending] = {}
        # Rules whose adds were answered failed (their flows could not be built): ended by
        # `end_failing`, out of the dispatcher's turn that found it (a run inside one is not).
        self.failing: list[tuple[str, str]] = []

    def __contains__(self, key: tuple[str, str]) -> bool:
        """A rule (by key) whose end is under way."""
        return key in self.ending

    def end(self, rule: Rule, why: str, ans: Answer | None = None, grace: float = ENDING_GRACE) -> None:
        """Take a rule's flows down; it ends once they are gone (tick), or `grace` is over
        (0: at once, with no counters: an add whose flows never went to the switch)."""
        ending = self.ending.get(rule.key)
        fresh = ending is None
        if ending is None:
            ending = self.ending[rule.key] = _Ending(rule, why, self.mono() + grace)
        if ans is not None:
            ending.answers.append(ans)
        if fresh:
            self._take_down(rule, ending)  # (may end it at once: a switch that answers in this turn)
        self.finish_due()

    def end_failing(self) -> None:
        """Rules whose adds failed end at once: nothing of them was confirmed on the switch,
        so there are no counters to wait for."""
        while self.failing:
            rule = self.store.get(*self.failing.pop())
            if rule is not None and rule.key not in self.ending:
                self.end(rule, "failed to install: its flows could not be built", grace=0.0)

    def removed(self, conn: Conn) -> None:
        """A pair left the switch (Outcomes' Removed): a rule ending for it has its counters."""
        if self.ending_conns:
            ending = self.ending_conns.pop(pair_key(conn.orig), None)
            if ending is not None:
                ending.conn_counts = Counts(**carried(conn))
                self.finish_due()

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
            self.answered(rule, Outcome(
                Result.ERROR, "the rule ended before its flows were confirmed", error=Reject.UNAVAILABLE))
            # The pin passes to the connection's next holder (ids_rules.holder: a block first).
            key = pair_key(rule.connection)
            left = holder(r for r in self.store.of_connection(rule.connection)
                          if r.key != rule.key and r.key not in self.ending)
            successor = None if left is None else self.store.hold(left)
            for sw in self.host.switches:
                out = sw.core.ids_release(rule.connection, rule.source, reason, now, successor)
                if any(isinstance(cmd, (c.RemoveFlows, c.RestoreConntrack)) for cmd in out):
                    ending.waits_conn = True
                    self.ending_conns[key] = ending
                self.host.run(sw, out)

    def finish_due(self) -> None:
        """Ends whose flows' removal was reported, or whose grace is over, are done."""
        now = self.mono()
        for key, ending in list(self.ending.items()):
            counts = self._counts(ending)
            if counts is None and now < ending.deadline or self.ending.pop(key, None) is None:
                continue  # (None: ended meanwhile, by a call this one's take-down made)
            rule = ending.rule
            if rule.connection is not None:
                self.ending_conns.pop(pair_key(rule.connection), None)
            if rule.address is not None:
                for sw in self.host.switches:
                    sw.core.shared.address_blocks.forget_counts(rule.address)
            ended = self.store.end(rule, ending.why, self.wall(), counts or Counts())
            self.log.ended(ended)
            for ans in ending.answers:
                ans.answer(Outcome(Result.EXPIRED if ending.why.startswith("expired") else Result.REMOVED,
                                   view=ended_view(ended)))

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
