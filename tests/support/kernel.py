"""The host's kernel as the app reaches it (NFShuntApp.Worker, .Listener, .Policy), faked:
the conntrack worker records what it is asked and answers a re-creation when the test
says (`Rig.kernel_answers`); the listener reads nothing; the policy's chains are as the
test sets them (`stale`)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

from nfshunt.records.model import FlowTuple, NatRange


@dataclass
class Restore:
    """A re-creation the core asked of the kernel; `done` is the kernel's answer."""
    orig: FlowTuple
    tcp_state: int
    timeout: int
    closer_is_reply: bool
    mark: int
    done: Callable[[], None]
    nat: tuple[NatRange, ...] = ()  # a NAT pair's translations (routed, slice 4)


class FakeWorker:
    """The conntrack worker: requests recorded, re-creations answered when the test says."""

    def __init__(self, on_dump: Callable[[list[Any]], None] | None = None,
                 on_malformed: Callable[[str], None] | None = None,
                 on_failed: Callable[[], None] | None = None) -> None:
        self.on_dump = on_dump
        self.deleted: list[tuple[FlowTuple, int | None]] = []
        self.restores: list[Restore] = []
        self.unanswered: list[Restore] = []
        self.dumps = 0
        self.cleared: list[int] = []  # clear_marks masks
        self.expired: list[tuple[FlowTuple, int, int]] = []  # (tuple, id, timeout) given a shorter life
        self.liberals: list[FlowTuple] = []
        self.undecided: list[tuple[FlowTuple, int]] = []  # UDP NAT pairs' kept entries, decision cleared
        self.refreshed: list[tuple[FlowTuple, int, int]] = []  # NAT pairs' kept entries given time
        self.afters: list[Callable[[], None]] = []  # what waits for the worker to finish what it was asked
        self.looked_up: list[FlowTuple] = []  # entries looked up (adopted NAT pairs')
        self.entries: dict[FlowTuple, Any] = {}  # what a lookup finds, by original tuple (the test's)
        self.running = False

    def start(self) -> None:
        self.running = True

    def stop(self) -> None:
        self.running = False

    def delete(self, _family: int, orig: FlowTuple, ct_id: int | None, _counted: bool = False) -> None:
        self.deleted.append((orig, ct_id))

    def restore(self, _family: int, orig: FlowTuple, _reply: FlowTuple, tcp_state: int, timeout: int,
                closer_is_reply: bool, mark: int, done: Callable[[], None], nat: tuple[NatRange, ...] = ()) -> None:
        r = Restore(orig, tcp_state, timeout, closer_is_reply, mark, done, nat)
        self.restores.append(r)
        self.unanswered.append(r)

    def liberal(self, _family: int, orig: FlowTuple, _ct_id: int) -> None:
        self.liberals.append(orig)

    def expire(self, _family: int, orig: FlowTuple, ct_id: int, timeout: int) -> None:
        self.expired.append((orig, ct_id, timeout))

    def clear_decision(self, _family: int, orig: FlowTuple, ct_id: int) -> None:
        self.undecided.append((orig, ct_id))

    def refresh(self, _family: int, orig: FlowTuple, ct_id: int, timeout: int) -> None:
        self.refreshed.append((orig, ct_id, timeout))

    def dump(self) -> None:
        self.dumps += 1

    def look_up(self, orig: FlowTuple, done: Callable[[Any, str | None], None]) -> None:
        """An entry looked up (an adopted NAT pair's): answered from `entries` (the test's
        kernel table: tuple -> ConnEvent) when the test says (Rig.kernel_answers)."""
        self.looked_up.append(orig)
        self.afters.append(lambda: done(self.entries.get(orig), None))

    def clear_marks(self, mask: int, done: Callable[[int, int, str | None], None]) -> None:
        self.cleared.append(mask)
        done(0, 0, None)

    def after(self, then: Callable[[], None]) -> None:
        """`then` once the worker has answered everything asked before (the rig calls it
        with the kernel's answers)."""
        self.afters.append(then)

    def batched(self) -> contextlib.nullcontext:
        return contextlib.nullcontext()


class FakeListener:
    """The conntrack event listener: nothing is read; events come from the test (Rig.event)."""

    def __init__(self, *_args: Any) -> None:
        self.running = False

    def start(self) -> None:
        self.running = True

    def stop(self) -> None:
        self.running = False


class FakePolicy:
    """policy_state.PolicyWatch without iptables: whether the pairs found at start were
    decided under another policy is the test's to say (`stale`)."""

    def __init__(self, _state_dir: str, switches: int, _pair: bool) -> None:
        self.stale = False  # (Rig(stale_policy=True): changed while the controller was stopped)
        self.waiting = set(range(switches))
        self.recorded = 0  # times the live policy was recorded (every switch reconciled, a re-evaluation)

    def reconciled(self, switch: int) -> None:
        if switch in self.waiting:
            self.waiting.discard(switch)
            if not self.waiting:
                self.recorded += 1
                self.stale = False

    def reevaluated(self) -> None:
        self.recorded += 1
