"""Decisions that override the policy's for one connection, and what names a pair's
authority. No I/O.

An operator's pin (an unshunt or a block) and an IDS's rule (a shunt or a block) are held
as pins by tuple (pins.py) and act on a pair on the switch through the one take-down
(connection.py), on a static stream's tuple by an exact drop above it (static_table.py),
and on the pair that admission builds while they hold. A pin that changed the policy's
decision names itself in the pair's cookie (cookies.Authority) and ends the pair on the
switch at its own end (a hard timeout), with a controller running or none.

What a reconcile keeps of a pair it adopts (`judge_adopted`): one it can name the authority
of (the policy it was decided under, a live IDS rule's pin, an operator's pin); a block it
cannot name until its own bound (its hard timeout: the rule's or pin's end; an operator's
block is held as a pin again for what is left of it); any other pair is handed back to
the firewall alive.
"""
from __future__ import annotations

from typing import Iterable, Mapping

from nfshunt.config.static import StaticFlow
from nfshunt.records import markcodec
from nfshunt.records.cookies import Authority
from nfshunt.records.model import Action, FlowTuple

from .commands import Command, ResyncConntrack
from .connection import Conn
from .pins import PIN_TTL, IdsHold, Pin, hard_timeout
from .state import CoreState

R_UNNAMED = "adopted with no authority this controller can name (no live IDS rule or operator pin)"


def follows_policy(conn: Conn) -> bool:
    """Whether a pair rests on the policy's decision: the policy's own, or an IDS's shunt
    (applied only to what the policy accepted and left alone). An operator's pin and an
    IDS's block decide whatever the policy said (admission.decide: `overridden`)."""
    return conn.authority is Authority.POLICY or (conn.authority is Authority.IDS and conn.action is Action.SHUNT)


class Overrides:
    def __init__(self, shared: CoreState):
        self.shared = shared

    # --- an operator's pins ------------------------------------------------------------------

    def pin(self, orig: FlowTuple, action: Action, now: float, ttl: float = PIN_TTL) -> list[Command]:
        """An operator's unshunt (IGNORE) or block for a connection, by tuple, for `ttl`
        seconds: its flows go, and the entry its next packet re-creates on the slow path
        is held there (unshunt) or blocked. Dumping conntrack applies it to a connection
        that is on the slow path already."""
        if action not in (Action.IGNORE, Action.BLOCK):
            raise ValueError(action)
        sh = self.shared
        sh.pins.hold(orig, action, now, ttl)
        out: list[Command] = []
        conn = sh.conns.by_tuple(orig)
        if conn is not None and not (action is Action.BLOCK and conn.action is Action.BLOCK):
            why = "unshunt by operator" if action is Action.IGNORE else "blocked by operator"
            out.extend(sh.conns.take_down(conn, why, now))
        if action is Action.BLOCK:
            out.append(ResyncConntrack())
            out.extend(self._drops(orig, sh.pins[orig], now))
        else:
            out.extend(sh.static.unblock(orig, "unshunt by operator"))
        return out

    # --- an IDS's rules (ids/backend decides with ids/rules.precedence; these act) ------------

    def ids_pin(self, orig: FlowTuple, hold: IdsHold, now: float) -> list[Command]:
        """An IDS's shunt or block of a connection, held as a lower pin (pins.py): a pair
        the policy shunted is taken down for a block (its next packet's entry is blocked),
        and a static stream's tuple is dropped above the stream until the rule's end, as an
        operator's block is; an entry on the slow path is decided when the backend feeds it
        (or its next event). A pair already on the switch keeps the idle timeout it was
        installed with."""
        sh = self.shared
        if not sh.pins.hold_for(orig, hold):
            return []
        if hold.action is not Action.BLOCK:
            return []
        out = self._drops(orig, sh.pins[orig], now)
        conn = sh.conns.by_tuple(orig)
        if conn is not None and conn.action is not Action.BLOCK:
            out.extend(sh.conns.take_down(conn, f"blocked by {hold.source}", now))
        return out

    def ids_release(self, orig: FlowTuple, source: str, reason: str, now: float,
                    successor: IdsHold | None = None) -> list[Command]:
        """An IDS's rule of a connection ended: its pin goes (to `successor`, another IDS
        rule of the connection, if one is left), and a pair that neither it nor the policy
        would make now is handed back to the firewall, where admission judges it again."""
        sh = self.shared
        released = sh.pins.release(orig, source)
        if released is None:
            return []
        out: list[Command] = []
        if successor is not None:
            sh.pins.hold_for(orig, successor)
        if successor is not None and successor.action is Action.BLOCK:
            out.extend(self._drops(orig, sh.pins[orig], now))
        elif released.action is Action.BLOCK:
            out.extend(sh.static.unblock(orig, reason))
        conn = sh.conns.by_tuple(orig)
        if conn is None:
            return out
        mark = markcodec.decode(conn.mark)
        policy = None if mark.action is None else sh.cfg.action_for(mark.action)
        wanted = successor.action if successor is not None else policy
        if conn.action is wanted or (wanted is Action.SHUNT and conn.action is policy):
            return out  # (a policy's block stays under an IDS's shunt: a block beats a shunt)
        return [*out, *sh.conns.take_down(conn, reason, now)]

    # --- blocks inside static streams (static_table.block) ---------------------------------------

    def _drops(self, t: FlowTuple, pin: Pin, now: float, among: Iterable[StaticFlow] | None = None) -> list[Command]:
        """The one rule for a held block inside static streams, wherever it is applied (the
        block, an IDS's successor rule, a restart's pins held again, their renewal, a
        reload's new flows): exact drops above the flows that carry its tuple (of `among`
        only, if given), ended by the switch at the pin's end (hard_timeout, as its pair's)."""
        return self.shared.static.block(t, now, hard_timeout(pin.expires, now), among)

    def renew_drops(self, now: float) -> list[Command]:
        """(The tick.) Drops the switch ends within RENEW s whose pin holds longer (a hard
        timeout is at most 18 h): written again, so the drop never lapses."""
        sh = self.shared
        due = {min(t, t.reversed()) for t, until in sh.static.expire(now)
               if (pin := sh.pins.get(t)) is not None and pin.action is Action.BLOCK and pin.expires > until}
        return [cmd for t in due for cmd in self._drops(t, sh.pins[t], now)]

    def reloaded(self, base: Mapping[int, StaticFlow], now: float) -> list[Command]:
        """A reload took new static flows (those whose cookies `base`, the table before it,
        lacks: new streams, and changed ones, whose flows are new): every held block of a
        tuple one of them carries gets its drops above it, as at a restart (to be sent
        before the reload's installs, so no frame of the tuple crosses meanwhile). A
        block held before the stream existed was a pin alone: the stream never reaches
        conntrack, so without its drops it carried the tuple for the rest of the block."""
        sh = self.shared
        held = {min(t, t.reversed()): pin for t, pin in sh.pins.items()
                if pin.action is Action.BLOCK and pin.expires > now}
        new = [f for cookie, f in sh.static.flows.items() if cookie not in base] if held else []
        return [cmd for t, pin in held.items() if new for cmd in self._drops(t, pin, now, new)]

    # --- a pair's authority --------------------------------------------------------------------

    def holding(self, conn: Conn, now: float) -> Pin | None:
        """The pin that is the authority of a pair an IDS or an operator decided (None: none
        holds it now: the rule or pin ended, or is another's, or another action's)."""
        pin = self.shared.pins.get(conn.orig)
        if pin is None or pin.action is not conn.action or pin.expires <= now:
            return None
        by = Authority.OPERATOR if pin.source is None else Authority.IDS
        return pin if conn.authority is by else None

    def judge_adopted(self, conn: Conn, now: float) -> list[Command]:
        """A pair adopted from the switch (a restart, a takeover), present: kept while its
        authority can be named (the module's docstring), else handed back alive."""
        if conn.authority is Authority.POLICY or self.holding(conn, now) is not None:
            return []
        if conn.action is Action.BLOCK and conn.hard_timeout:
            if conn.authority is Authority.OPERATOR:  # held again, for what is left of it
                self.shared.pins.hold(conn.orig, Action.BLOCK, now, conn.hard_timeout)
            return []
        return self.shared.conns.hand_back(conn, R_UNNAMED, now)

    def reinstall_bound(self, conn: Conn, now: float) -> bool:
        """A pair to be installed again (a switch that lost its table) gets what is left of
        its pin as its hard timeout; False: its pin ended, it is not installed again."""
        if conn.authority is Authority.POLICY:
            return True
        pin = self.holding(conn, now)
        if pin is None:
            return False
        conn.hard_timeout = hard_timeout(pin.expires, now)
        return True
