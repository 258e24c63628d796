"""The rig: the real NFShuntApp, served one fake switch (support/fakeswitch.py), on the
test's clock (after Faucet's clib/valve_test_lib.py).

Everything between os-ken and the kernel is production code: the app's own handlers and
event loop (a handler's exception is counted as handler_errors, and the rig raises it),
its feeds (the ticker's look at what is due: Feeds.turn), peers (the handshake), replies,
housekeeping, role link, dispatcher and each session's send path. The rig only plays
os-ken and the kernel: it hands the app the switch's messages as os-ken's connection
thread does (the bytes the fake switch wrote, read by os-ken's parser, as events in the
connection's dispatcher state), and the kernel's answers when the test says
(`kernel_answers`). The conntrack worker, listener and policy watch are fakes
(support/kernel.py); the process's memory housekeeping (full collections, malloc_trim) is
left out, and its state folder (an operator's pins, the IDS's rules) is a temporary one of
its own unless the test names one (a rig's pins must not reach the next rig, nor the host's
/var/lib/nfshunt). The fake switch checks that every turn's messages are idempotent in effect
(`offset_check`, Faucet's offset check)."""
from __future__ import annotations

import logging
import queue
import tempfile
import threading
from typing import Any

import pytest
from os_ken.controller import ofp_event
from os_ken.controller.handler import CONFIG_DISPATCHER, DEAD_DISPATCHER, MAIN_DISPATCHER, register_instance

from nfshunt.app.operator_api import EventControl
from nfshunt.app.switch_app import NFShuntApp
from nfshunt.core.connection import State
from nfshunt.core.core import Core
from nfshunt.observe.collector import FullCollections
from nfshunt.observe.trim import Trimmer
from nfshunt.openflow.session import Session
from nfshunt.records import cookies
from nfshunt.records.model import OFP10, OFP13, ConnEvent, FlowTuple
from nfshunt.switch.feeds import TIMER_RESOLUTION
from nfshunt.switch.switch import Switch
from tests.helpers import config, event

from . import fakeswitch as fs
from .kernel import FakeListener, FakePolicy, FakeWorker, Restore

FIN, RST, ACK = 0x01, 0x04, 0x10
FAST_A, SLOW_A, FAST_B, SLOW_B = 1, 2, 3, 4  # tests.helpers' two port groups
ERRORS = ("handler_errors", "internal_errors")  # the app's counts of its own exceptions


class RigApp(NFShuntApp):
    """NFShuntApp with the host's kernel faked (its handlers, as they are)."""
    Worker = FakeWorker
    Listener = FakeListener
    Policy = FakePolicy


class _Raised(logging.Handler):
    """The exceptions the app logs while it counts them (to fail the test with)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(record)


class Rig:
    """One served switch's controller, driven by the test. `pipeline` picks the flow layout
    (the switch reports 254 tables); `cfg` overrides tests.helpers.config's keys."""

    def __init__(self, version: int = OFP13, pipeline: bool = False, switch: fs.FakeSwitch | None = None,
                 table_size: int | None = None, now: float = 100.0, stale_policy: bool = False,
                 connect: bool = True, **cfg: Any):
        self._now = now
        self.switch = switch or fs.FakeSwitch(version, table_size, now)
        self.switch.now = max(self.switch.now, now)
        self.switch.offset_check = True
        cfg.setdefault("control_socket", None)
        if "state_dir" not in cfg:  # the app's own (an operator's pins, the IDS's rules): never the host's
            self.state_dir = tempfile.TemporaryDirectory(prefix="nfshunt-rig-")
            cfg["state_dir"] = self.state_dir.name
        cfg.setdefault("flow_layout", "pipeline" if pipeline else "single")
        if cfg["flow_layout"] == "pipeline":
            cfg.setdefault("openflow_versions", ["1.3"])
        self.app = RigApp(nfshunt_config=config(**cfg), clock=self.clock)
        app = self.app
        if stale_policy:  # the policy changed while the controller was stopped (policy_state)
            app.policy.stale = True
            for sw in app.switches:
                sw.core.stale_policy = True
        app.collections = FullCollections(now, collect=lambda _gen: 0, clock=self.clock, freeze=lambda: None,
                                          unfreeze=lambda: None)
        app.trimmer = Trimmer(trim=lambda _pad: 0)
        register_instance(app)  # its handlers by event class and dispatcher state, as os-ken's AppManager does
        app.events = queue.Queue()  # (unbounded: one thread posts and serves)
        app._events_sem = threading.Semaphore(0)
        app.is_active = False  # _event_loop returns once the queue is empty
        app.send_event = lambda _name, ev, state=None: app.events.put((ev, state))
        self.worker: FakeWorker = app.worker
        self.busy = False
        self.errors = self.errors_seen = 0  # the app's counts of its own exceptions (ERRORS), as it makes them
        inc = app.counters.inc

        def counted(name: str, amount: int = 1) -> None:  # (reading them all back after each pump: 2/3 of a turn)
            if name in ERRORS:
                self.errors += amount
            inc(name, amount)
        app.counters.inc = counted  # (the instance's: the dispatcher, feeds and replies share it)
        self.raised = _Raised()
        if connect:
            self.connect(self.switch)

    # --- what the app is made of -------------------------------------------------------------

    def clock(self) -> float:
        return self._now

    @property
    def now(self) -> float:
        return self._now

    @now.setter
    def now(self, value: float) -> None:
        self._now = value

    @property
    def sw(self) -> Switch:
        return self.app.switches[0]

    @property
    def s(self) -> Session:
        assert self.sw.session is not None
        return self.sw.session

    @property
    def core(self) -> Core:
        return self.sw.core

    @property
    def counters(self) -> Any:
        return self.app.counters

    @property
    def dispatcher(self) -> Any:
        return self.app.dispatcher

    # --- os-ken's side: the connection and its messages ----------------------------------------

    def post(self, ev: Any, state: str | None = None) -> None:
        self.app.events.put((ev, state))

    def connect(self, switch: fs.FakeSwitch) -> None:
        """A handshake: the features reply, then the connection's move to MAIN_DISPATCHER."""
        self.switch = switch
        switch.connection()
        self.post(ofp_event.ofp_msg_to_ev(switch.features()), CONFIG_DISPATCHER)
        self.post(_state_change(switch, MAIN_DISPATCHER), MAIN_DISPATCHER)
        self.pump()
        if switch.closed:  # refused by the app
            self.disconnect()

    def post_state(self, switch: fs.FakeSwitch) -> None:
        """Another connection's handshake, while this one stays (the app decides whether it
        replaces the served one or is refused)."""
        switch.connection()
        self.post(ofp_event.ofp_msg_to_ev(switch.features()), CONFIG_DISPATCHER)
        self.post(_state_change(switch, MAIN_DISPATCHER), MAIN_DISPATCHER)
        self.pump()

    def deliver_state(self, switch: fs.FakeSwitch, state: str) -> None:
        """A connection's move to `state` ("dead": its end noticed)."""
        self.post(_state_change(switch, DEAD_DISPATCHER if state == "dead" else MAIN_DISPATCHER),
                  DEAD_DISPATCHER if state == "dead" else MAIN_DISPATCHER)
        self.pump()

    def disconnect(self) -> None:
        """The connection ends (closed, or its echoes unanswered); what it had not read is lost."""
        self.pump()
        self.switch.replies.clear()
        self.post(_state_change(self.switch, DEAD_DISPATCHER), DEAD_DISPATCHER)
        self.pump()

    def reconnect(self, switch: fs.FakeSwitch) -> None:
        """The switch's connection ends and one comes (the same switch, or another)."""
        self.disconnect()
        switch.offset_check = True
        switch.now = max(switch.now, self._now)
        self.connect(switch)

    def deliver(self, msg: Any) -> None:
        """One message of the switch's, as os-ken's connection thread hands it over."""
        self.post(ofp_event.ofp_msg_to_ev(msg), MAIN_DISPATCHER)
        self.pump()

    def pump(self) -> None:
        """Serve the event loop until quiet: what the app posted to itself, then the
        switch's replies one at a time (os-ken queues them as they are read); re-entrant
        calls (a handler's own) return at once."""
        if self.busy:
            return
        self.busy = True
        logging.getLogger("nfshunt").addHandler(self.raised)
        try:
            while True:
                if not self.app.events.empty():
                    self.app._event_loop()
                elif self.switch.replies:
                    self.post(ofp_event.ofp_msg_to_ev(self.switch.replies.pop(0)), MAIN_DISPATCHER)
                else:
                    break
        finally:
            self.busy = False
            logging.getLogger("nfshunt").removeHandler(self.raised)
        self._check()

    def _check(self) -> None:
        if self.errors > self.errors_seen:
            self.errors_seen = self.errors
            text = "\n".join(logging.Formatter().format(r) for r in self.raised.records)
            self.raised.records.clear()
            raise AssertionError(f"the app raised while the rig served it:\n{text}")

    # --- the controller's inputs ---------------------------------------------------------------

    def run(self, cmds: Any = ()) -> None:
        """Execute core commands as the app does (Dispatcher.run: the turn written to the
        switch), then serve what comes back until all is quiet."""
        self.app.run(self.sw, list(cmds))
        self.pump()

    def event(self, **kw: Any) -> Any:
        """A conntrack event (tests.helpers.event) handed over as the listener does; its pair, if any."""
        ev = event(received=self._now, **kw)
        self.events([ev])
        return self.core.find(tuple_=ev.orig)

    def events(self, evs: list[ConnEvent]) -> None:
        self.app.feeds.events(evs)
        self.pump()

    def advance(self, seconds: float) -> None:
        """Time passes: what the ticker finds due (the core's delayed commands, the look at
        half-closed shunts every WATCH_PERIOD, the 1 s tick) runs at its time, the switch's
        timeouts firing meanwhile; the advance ends with a tick (housekeeping)."""
        end = self._now + seconds
        feeds = self.app.feeds
        for _ in range(1_000_000):
            due = min(feeds.later[0][0] if feeds.later else end, feeds.next_watch, feeds.next_tick)
            if self.sw.session is not None and self.sw.session.send.queued:  # paced installs: every look
                due = min(due, self._now + TIMER_RESOLUTION)
            if due >= end:
                break
            self._at(due)
        else:
            raise AssertionError("the ticker never caught up (a command that schedules itself at once?)")
        if feeds.next_tick > end:
            feeds.next_tick = end
        self._at(end)

    def _at(self, t: float) -> None:
        """One turn of the ticker at `t` (Feeds.turn posts what is due), served."""
        self._now = max(self._now, t)
        self.switch.expire(self._now)
        self.app.feeds.turn(self._now)
        self.pump()

    def packet(self, in_port: int, t: FlowTuple, tcp_flags: int = 0, vlan: int | None = None,
               payload: int = 0, seq: int = 0) -> fs.Fate:
        """One packet through the switch (`payload` bytes of data after its headers, sequence
        number `seq`); its packet-ins (headers up to the catcher's max_len) reach the app's handler."""
        fate = self.switch.packet(in_port, t, tcp_flags, vlan, payload=payload, seq=seq)
        self.pump()
        return fate

    def kernel_answers(self) -> list[Restore]:
        """The worker reports every re-creation done: the flows that waited for it go."""
        answered, self.worker.unanswered = self.worker.unanswered, []
        for r in answered:
            r.done()
        afters, self.worker.afters = self.worker.afters, []
        for then in afters:
            then()
        self.pump()
        return answered

    def control(self, request: dict[str, Any]) -> dict[str, Any]:
        """A control-socket request (`nfshunt status`, unshunt, block, flush...), answered
        by the app's operator API on its event loop."""
        ev = EventControl(request)
        self.post(ev)
        self.pump()
        assert ev.done.is_set(), f"{request} not answered"
        return ev.reply

    # --- what the switch holds -----------------------------------------------------------------

    def flows(self, kind: cookies.Kind) -> list[fs.Entry]:
        return [e for e in self.switch.entries if (cookies.parse(e.cookie) or (None,))[0] is kind]


def _state_change(dp: Any, state: str) -> Any:
    ev = ofp_event.EventOFPStateChange(dp)
    ev.state = state
    return ev


def fast(rig: Rig, conn: Any) -> bool:
    """Both directions of the connection take the fast path, port to port."""
    return (rig.packet(conn.ingress.fast, conn.orig).outputs == (conn.egress.fast,)
            and rig.packet(conn.egress.fast, conn.reply).outputs == (conn.ingress.fast,))


def slow(rig: Rig, conn: Any) -> bool:
    """Both directions cross the firewall (the default flows to the bridge ports)."""
    return (rig.packet(conn.ingress.fast, conn.orig).outputs == (conn.ingress.slow,)
            and rig.packet(conn.egress.fast, conn.reply).outputs == (conn.egress.slow,))


def shunted(rig: Rig, **kw: Any) -> Any:
    """A shunt confirmed by the switch and past its drain: LIVE, its conntrack entry deleted."""
    conn = rig.event(**kw)
    rig.advance(rig.core.switch.drain)
    assert conn.state is State.LIVE
    return conn


LAYOUTS = [pytest.param(OFP13, False, id="single"), pytest.param(OFP13, True, id="pipeline"),
           pytest.param(OFP10, False, id="openflow1.0")]
