"""The threads that feed the app's event loop, and the events they post: conntrack
events handed over (a few at a time), dumps fed in slices, the 1 s tick, the look at
half-closed shunts, and the core's delayed commands when due (one timer thread however
many wait). Every handler then runs on the event loop, so the core needs no locks."""
from __future__ import annotations

import heapq
import threading
import time
from typing import Callable

from os_ken.controller import event

from nfshunt.core import commands as c
from nfshunt.core.teardown_sweep import WATCH_PERIOD
from nfshunt.records.model import ConnEvent, NextHop

from .switch import Switch

DUMP_SLICE = 2000  # dumped entries the event loop takes in one turn
HANDOVERS = 2  # conntrack hand-overs (the listener's or a dump's) in the event queue at most
TIMER_RESOLUTION = 0.05  # seconds: how late a delayed command (an RST's grace) may run


class EventConntrack(event.EventBase):
    def __init__(self, events: list[ConnEvent], dump: bool = False):
        super().__init__()
        self.events = events
        self.dump = dump


class EventOverflow(event.EventBase):
    pass


class EventTick(event.EventBase):
    pass


class EventWatch(event.EventBase):
    """A look at the catchers for lost packet-ins (teardown_sweep), every WATCH_PERIOD."""


class EventRun(event.EventBase):
    """A switch's core commands to run on the event loop (a worker's follow-up, a delayed
    command, paced installs whose turn came)."""

    def __init__(self, switch: Switch, commands: tuple[c.Command, ...], waiter: threading.Event | None = None):
        super().__init__()
        self.switch = switch
        self.commands = commands
        self.waiter = waiter  # set once the switch has answered this turn's barrier


class EventShutdown(event.EventBase):
    def __init__(self, done: threading.Event):
        super().__init__()
        self.done = done


Post = Callable[[event.EventBase], None]


class Feeds:
    def __init__(self, switches: list[Switch], post: Post, clock: Callable[[], float] = time.monotonic):
        self.switches = switches
        self.post = post
        self.clock = clock  # the event loop's (monotonic)
        self.running = True
        self.next_tick = self.next_watch = clock() + 1.0
        self.later: list[tuple[float, int, Switch, tuple[c.Command, ...]]] = []  # heap of (due, seq, switch, cmds)
        self._later_seq = 0
        self._later_lock = threading.Lock()
        self._handover_room = threading.BoundedSemaphore(HANDOVERS)
        self._dump_feed = threading.Lock()

    def stop(self) -> None:
        self.running = False

    # --- time ---------------------------------------------------------------------------------

    def schedule(self, delay: float, sw: Switch, commands: tuple[c.Command, ...]) -> None:
        """Run `commands` after `delay` (the ticker posts them when due)."""
        with self._later_lock:
            self._later_seq += 1  # ties never compare the commands
            heapq.heappush(self.later, (self.clock() + delay, self._later_seq, sw, commands))

    def ticker(self) -> None:
        """The 1 s housekeeping tick, and the core's delayed commands (Later) when due: one
        thread however many are waiting (an RST storm must not start a thread per RST)."""
        self.next_tick = self.next_watch = self.clock() + 1.0
        while self.running:
            time.sleep(TIMER_RESOLUTION)
            self.turn(self.clock())

    def turn(self, now: float) -> None:
        """One look of the ticker at `now`: what is due is posted to the event loop."""
        due: dict[int, list[c.Command]] = {}
        with self._later_lock:
            while self.later and self.later[0][0] <= now:
                _, _, sw, commands = heapq.heappop(self.later)
                due.setdefault(sw.index, []).extend(commands)
        for sw in self.switches:
            session = sw.session
            if sw.index in due or (session is not None and session.send.queued):  # paced installs wait their turn
                self.post(EventRun(sw, tuple(due.get(sw.index, ()))))
        if now >= self.next_watch:
            self.next_watch = now + WATCH_PERIOD
            self.post(EventWatch())
        if now >= self.next_tick:
            self.next_tick = now + 1.0
            self.post(EventTick())

    # --- conntrack ------------------------------------------------------------------------------

    def events(self, events: list[ConnEvent]) -> None:
        self.hand_over(EventConntrack(events))

    def hand_over(self, ev: EventConntrack) -> bool:
        """Queue conntrack events for the event loop, at most HANDOVERS at a time (the
        rest wait in the kernel's buffer, or in the dump). os-ken's event queue (128) also
        carries the switch's replies: when conntrack events filled it, the thread reading
        the switch blocked, the switch stopped reading flow-mods with its replies unread,
        the event loop blocked writing to it and never drained the queue, and barriers
        expired until the connection dropped (events handed over 1,000 at a time filled
        it in one 100,000 burst: 16% of it stayed unshunted)."""
        while not self._handover_room.acquire(timeout=0.5):
            if not self.running:
                return False
        self.post(ev)
        return True

    def taken(self) -> None:
        """The event loop took a hand-over: room for the next."""
        self._handover_room.release()

    def dump(self, events: list[ConnEvent]) -> None:
        # In slices: 100,000 entries in one turn of the event loop kept it from the switch's
        # barrier replies for seconds; the switch, its replies unread, stopped reading our
        # flow-mods, and the connection was lost. Fed on a thread of its own, one dump at a
        # time: the worker goes on deleting entries meanwhile.
        def feed() -> None:
            with self._dump_feed:
                for at in range(0, max(len(events), 1), DUMP_SLICE):
                    if not self.hand_over(EventConntrack(events[at:at + DUMP_SLICE], dump=at == 0)):
                        return
        threading.Thread(target=feed, name="conntrack-dump-feed", daemon=True).start()

    def tables(self, news: dict[str, NextHop | str]) -> None:
        """The route follower's news (from its thread): to every switch's core that routes."""
        for sw in self.switches:
            if sw.switch.experimental_routed:
                self.post(EventRun(sw, (c.TablesChanged(news),)))

    def overflow(self) -> None:
        self.post(EventOverflow())
