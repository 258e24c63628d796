"""A routing firewall's shunts (docs/design/routed.md): the next hop each direction of a
connection leaves by, from the answers the kernel's tables gave (kernel/routes.py's follower,
asked on a ResolveHops, and telling of every change that matters), kept a while; what a change
does to the pairs using it; the events waiting for a next hop; flapping neighbours held down.
Pure: plain values in, a reason or hops out.
"""
from __future__ import annotations

import collections
import enum
from typing import Callable, Iterable

from nfshunt.config.switch import RoutedSide
from nfshunt.records.model import ConnEvent, FlowTuple, NextHop
from nfshunt.records.routed import (
    R_BLACKHOLE,
    R_NEXT_HOP_FAILED,
    R_NO_ROUTE,
    R_NOT_UNICAST,
    R_UNRESOLVED,
    Answer,
)

from .connection import Conn

KEEP = 10.0  # seconds an answer is used without being asked again (changes are told meanwhile)
KEEP_NONE = 1.0  # seconds "no next hop" is believed: the neighbour may resolve any moment
# A lookup that failed (the socket, not the tables) is asked again, KEEP_NONE apart, this
# many times; what the tables said no to waits for their change instead (TableNews).
RETRIES = 5
R_HOP_UNKNOWN = "routed: next hop being looked up"
R_HOP_ELSEWHERE = "routed: the route leaves by another interface than the port group's"  # (or VLAN's)
R_ROUTE_MOVED = "routed: route moved"
R_FLAPPING = "routed: neighbour flapping"
# Flap damping (issue 38 item 6): more than FLAP_CHANGES MAC changes within FLAP_WINDOW
# seconds hold the neighbour down for HOLD_DOWN: its pairs go back to the firewall.
FLAP_CHANGES, FLAP_WINDOW, HOLD_DOWN = 5, 10.0, 30.0
WAIT_MAX = 60.0  # seconds an event waits for the tables to give its next hop
WAITING_MAX = 4096  # events waiting at most (the oldest go)
# The tables' no: the event waits for their change (a UDP stream's entry sends no event after
# its decision to be judged again by).
TABLE_REASONS = frozenset((R_NO_ROUTE, R_BLACKHOLE, R_NOT_UNICAST, R_UNRESOLVED, R_NEXT_HOP_FAILED,
                           R_HOP_ELSEWHERE, R_ROUTE_MOVED, R_FLAPPING))

Neighbour = tuple[str, str]  # (interface, address)


class Change(enum.Enum):
    SAME = "same"
    REWRITE = "rewrite"  # the same interface, another MAC: the flows' actions replaced in place


def neighbour_of(hop: NextHop, address: str) -> Neighbour:
    return hop.ifname, hop.neighbour or address


class NextHopTable:
    def __init__(self) -> None:
        self.answers: dict[str, tuple[Answer, float]] = {}
        self.flaps: dict[Neighbour, collections.deque[float]] = {}
        self.held: dict[Neighbour, float] = {}  # held down until
        # Events the tables said no to, by the addresses they need; oldest first.
        self.waiting: collections.OrderedDict[FlowTuple, tuple[ConnEvent, float]] = collections.OrderedDict()
        # The routed pairs sending to each destination, by key: a feed finds its pairs without
        # a walk of the whole table (a flapping neighbour feeds ten times a second). Pairs gone
        # are dropped when met, and by prune().
        self.users: dict[str, dict[int, Conn]] = {}

    @staticmethod
    def wanted(ev: ConnEvent) -> tuple[str, str]:
        """The addresses the two directions are sent to: the reply's source (where the
        original goes) and the original's source (where the reply goes)."""
        return ev.reply.src, ev.orig.src

    def learn(self, answers: dict[str, Answer], now: float) -> None:
        for address, answer in answers.items():
            self.answers[address] = (answer, now)

    def _known(self, address: str, now: float) -> Answer | None:
        got = self.answers.get(address)
        if got is None:
            return None
        answer, when = got
        if now - when > (KEEP if isinstance(answer, NextHop) else KEEP_NONE):
            return None  # (left for learn() to replace: a dry run changes nothing)
        return answer

    def held_down(self, neighbour: Neighbour, now: float) -> bool:
        return self.held.get(neighbour, 0.0) > now

    def hops(self, ev: ConnEvent, sides: tuple[RoutedSide, RoutedSide],
             now: float) -> tuple[NextHop, NextHop] | str:
        """Both directions' next hops, or why not: R_HOP_UNKNOWN (ask the kernel), the
        kernel's reason, R_HOP_ELSEWHERE (the firewall would route it out of another
        interface than the switch port the pair outputs to) or R_FLAPPING (held down)."""
        out = []
        for address, side in zip(self.wanted(ev), reversed(sides), strict=True):
            answer = self._known(address, now)
            if answer is None:
                return R_HOP_UNKNOWN
            if isinstance(answer, str):
                return answer
            if answer.ifname != side.interface:
                return R_HOP_ELSEWHERE
            if self.held_down(neighbour_of(answer, address), now):
                return R_FLAPPING
            out.append(answer)
        return out[0], out[1]

    # --- the tables' changes ---------------------------------------------------------------

    def changed(self, answers: dict[str, Answer], now: float) -> list[Neighbour]:
        """The follower's news learnt; the neighbours it newly holds down (a MAC changed more
        than FLAP_CHANGES times within FLAP_WINDOW), each once however many destinations it serves."""
        counted: set[Neighbour] = set()
        newly: list[Neighbour] = []
        for address, answer in answers.items():
            before = self.answers.get(address)
            self.answers[address] = (answer, now)
            old = before[0] if before is not None else None
            if not (isinstance(answer, NextHop) and isinstance(old, NextHop)) or old.ifname != answer.ifname \
                    or old.eth_dst == answer.eth_dst:
                continue
            who = neighbour_of(answer, address)
            if who in counted:
                continue
            counted.add(who)
            times = self.flaps.setdefault(who, collections.deque())
            times.append(now)
            while now - times[0] > FLAP_WINDOW:
                times.popleft()
            if len(times) > FLAP_CHANGES and not self.held_down(who, now):
                self.held[who] = now + HOLD_DOWN
                newly.append(who)
        return newly

    def change(self, hop: NextHop, address: str, answer: Answer, now: float) -> Change | str:
        """What a pair's direction through `hop` does now the tables give `answer` for its
        destination: stays, is rewritten, or goes back to the firewall (the reason)."""
        if isinstance(answer, str):
            return answer
        if answer.ifname != hop.ifname:
            return R_ROUTE_MOVED
        if self.held_down(neighbour_of(answer, address), now):
            return R_FLAPPING
        if answer.eth_dst != hop.eth_dst or answer.eth_src != hop.eth_src:
            return Change.REWRITE
        return Change.SAME

    def released(self, now: float) -> bool:
        """Hold-downs over (their neighbours may carry shunts again); True if any ended."""
        over = [who for who, until in self.held.items() if until <= now]
        for who in over:
            del self.held[who]
            self.flaps.pop(who, None)
        return bool(over)

    def use(self, conn: Conn) -> None:
        """A routed pair made: found by either destination from now on."""
        for address in (conn.reply.src, conn.orig.src):
            self.users.setdefault(address, {})[conn.key] = conn

    def users_of(self, addresses: Iterable[str], alive: Callable[[Conn], bool]) -> list[Conn]:
        """The live pairs sending to any of `addresses`, each once."""
        out: dict[int, Conn] = {}
        for address in addresses:
            for conn in self._alive(address, alive):
                out[id(conn)] = conn
        return list(out.values())

    def _alive(self, address: str, alive: Callable[[Conn], bool]) -> list[Conn]:
        pairs = self.users.get(address)
        if not pairs:
            return []
        for key, conn in list(pairs.items()):
            if not alive(conn):
                del pairs[key]
        if not pairs:
            del self.users[address]
        return list(pairs.values())

    def prune(self, alive: Callable[[Conn], bool]) -> None:
        for address in list(self.users):
            self._alive(address, alive)

    # --- events waiting for a next hop -----------------------------------------------------

    def wait(self, ev: ConnEvent, now: float) -> None:
        self.waiting[ev.orig] = (ev, now)
        self.waiting.move_to_end(ev.orig)
        while len(self.waiting) > WAITING_MAX:
            self.waiting.popitem(last=False)

    def forget(self, orig: FlowTuple) -> None:
        """The entry is gone from the firewall: nothing to shunt later."""
        self.waiting.pop(orig, None)

    def due(self, addresses: set[str] | None, now: float) -> list[ConnEvent]:
        """The waiting events a change of `addresses` (None: any) may admit, taken out; the
        ones older than WAIT_MAX dropped."""
        out = []
        for orig, (ev, since) in list(self.waiting.items()):
            if now - since > WAIT_MAX:
                del self.waiting[orig]
            elif addresses is None or not addresses.isdisjoint(self.wanted(ev)):
                del self.waiting[orig]
                out.append(ev)
        return out
