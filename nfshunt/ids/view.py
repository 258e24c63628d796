"""An IDS rule as the API shows it: its state on the switches and its flows' counters."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from nfshunt.core.address_flows import cookie_of
from nfshunt.core.connection import ACTIVE
from nfshunt.openflow.flows import ALL_ONES_64, idle_timeout
from nfshunt.openflow.inflight import FlowsRead
from nfshunt.records import cookies
from nfshunt.records.model import OFP10, SwitchFlow
from nfshunt.switch.switch import Switch

from .calls import Outcome, Result, RuleView, State
from .rules import Kind, Rule
from .store import Ended


def view(rule: Rule, switches: Sequence[Switch]) -> RuleView:
    """An active rule's state: ACTIVE once its flows are on a switch, else PENDING and what for."""
    if rule.connection is not None:
        sw, conn = next(((sw, x) for sw in switches if (x := sw.core.find(tuple_=rule.connection)) is not None),
                        (None, None))
        if sw is not None and conn is not None and conn.action is rule.action and conn.state in ACTIVE:
            return RuleView(rule, State.ACTIVE, flows_idle_timeout=idle_timeout(sw.cfg, conn))
        waits = "the connection's conntrack entry" if conn is None else "the switch's confirmation"
        return RuleView(rule, State.PENDING, waiting_for=waits)
    if rule.address is not None and not any(sw.session is not None for sw in switches):
        return RuleView(rule, State.PENDING, waiting_for="a switch to connect")
    return RuleView(rule, State.ACTIVE)


def ended_view(ended: Ended) -> RuleView:
    expired = ended.why.startswith("expired")
    return RuleView(ended.rule, State.EXPIRED if expired else State.REMOVED, packets=ended.counts.packets,
                    bytes=ended.counts.bytes)


def read_counters(view: RuleView, switches: Sequence[Switch], now: float,
                  answer: Callable[[Outcome], None]) -> None:
    """An active rule's view with its flows' counters, read from every connected switch
    (OpenFlow 1.3: by cookie); answered when all have replied (or gone: not counted)."""
    rule = view.rule
    reads: list[tuple[Switch, Any]] = []
    for sw in switches:
        s = sw.session
        if s is None or s.fb.version == OFP10:
            continue
        if rule.address is not None and rule.kind is Kind.BLOCK_ADDRESS:
            reads.append((sw, s.fb.cookie_stats_request(cookie_of(rule.address, False),
                                                        ALL_ONES_64 & ~cookies.DIRECTION_BIT)))
        elif rule.connection is not None:
            conn = sw.core.find(tuple_=rule.connection)
            if conn is not None and conn.action is rule.action and conn.state in ACTIVE:
                reads.append((sw, s.fb.pair_stats_request(conn)))
    if not reads:
        answer(Outcome(Result.ADDED, view=view))
        return
    got: list[list[SwitchFlow] | None] = []

    def done(flows: list[SwitchFlow] | None) -> None:
        got.append(flows)
        if len(got) == len(reads):
            counted = [f for fl in got if fl for f in fl]
            answer(Outcome(Result.ADDED, view=dataclasses.replace(
                view, packets=sum(f.packets for f in counted), bytes=sum(f.bytes for f in counted))))
    for sw, msg in reads:
        assert sw.session is not None
        sw.session.ask(msg, FlowsRead(now, done))
        sw.session.send.flush()
