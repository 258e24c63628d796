"""A routing firewall's shunts (docs/design/routed.md): the next hop each direction of a
connection leaves by, from the answers the kernel's tables gave (kernel/routes.py, asked by
the dispatcher on a ResolveHops), kept a while. Pure: plain values in, a reason or hops out.
"""
from __future__ import annotations

from nfshunt.config.switch import PortGroup
from nfshunt.records.model import ConnEvent, NextHop

KEEP = 10.0  # seconds an answer is used (the tables' change events come in a later slice)
KEEP_NONE = 1.0  # seconds "no next hop" is believed: the neighbour may resolve any moment
# A connection whose next hop the tables did not give is asked for again, KEEP_NONE apart,
# this many times: a UDP stream's entry sends no event after its decision to retry on.
RETRIES = 5
R_HOP_UNKNOWN = "routed: next hop being looked up"
R_HOP_ELSEWHERE = "routed: the route leaves by another interface than the port group's"


class NextHopTable:
    def __init__(self) -> None:
        self.answers: dict[str, tuple[NextHop | str, float]] = {}

    @staticmethod
    def wanted(ev: ConnEvent) -> tuple[str, str]:
        """The addresses the two directions are sent to: the reply's source (where the
        original goes) and the original's source (where the reply goes)."""
        return ev.reply.src, ev.orig.src

    def learn(self, answers: dict[str, NextHop | str], now: float) -> None:
        for address, answer in answers.items():
            self.answers[address] = (answer, now)

    def _known(self, address: str, now: float) -> NextHop | str | None:
        got = self.answers.get(address)
        if got is None:
            return None
        answer, when = got
        if now - when > (KEEP if isinstance(answer, NextHop) else KEEP_NONE):
            return None  # (left for learn() to replace: a dry run changes nothing)
        return answer

    def hops(self, ev: ConnEvent, ingress: PortGroup, egress: PortGroup,
             now: float) -> tuple[NextHop, NextHop] | str:
        """Both directions' next hops, or why not: R_HOP_UNKNOWN (ask the kernel), the
        kernel's reason, or R_HOP_ELSEWHERE (the firewall would route it out of another
        interface than the switch port the pair outputs to)."""
        out = []
        for address, group in zip(self.wanted(ev), (egress, ingress), strict=True):
            answer = self._known(address, now)
            if answer is None:
                return R_HOP_UNKNOWN
            if isinstance(answer, str):
                return answer
            if answer.ifname != group.interface:
                return R_HOP_ELSEWHERE
            out.append(answer)
        return out[0], out[1]
