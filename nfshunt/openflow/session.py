"""One connection of a served switch, from the moment it is served to its end.

A `Session` holds what exists only while the switch is connected: the os-ken datapath,
the flow builder and send path made for it, the requests in flight (inflight.py) and
whether its packet-in meter is on. It is created when the connection is served and
dropped when it ends, so nothing of one connection outlives it, and code that holds a
session never asks whether the switch is there.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from nfshunt.config.settings import Config
from nfshunt.config.switch import SwitchConfig
from nfshunt.core.connection import Conn
from nfshunt.records.model import SwitchFlow

from .channel import SendPath
from .flows import FlowBuilder
from .inflight import Barrier, FlowsRead, InFlight, Request


class Session:
    def __init__(self, dp: Any, cfg: Config, pipeline: bool = False,
                 wanted: Callable[[Conn], bool] = lambda conn: True, clock: Callable[[], float] = time.monotonic,
                 switch: SwitchConfig | None = None):
        """switch: which of cfg.switches is connected (the first by default)."""
        self.dp = dp
        self.fb = FlowBuilder(dp, cfg, pipeline, switch)
        self.inflight = InFlight()
        self._wanted = wanted  # a paced install the core still wants sent
        self.clock = clock  # the event loop's
        self.send = self._send_path(self.fb.switch)
        self.meter_on = False  # the packet-in meter is set (and not refused)

    def _send_path(self, switch: SwitchConfig) -> SendPath:
        return SendPath(self.dp, self.fb, self.inflight, switch.flow_mod_rate, switch.install_queue, self._wanted,
                        self.clock)

    def ask(self, msg: Any, request: Request) -> None:
        """Queue a request, registered in flight under its xid."""
        self.inflight.ask(self.dp.set_xid(msg), request)
        self.send.queue([msg])

    def read_flows(self, done: Callable[[list[SwitchFlow] | None], None], now: float) -> None:
        """Read NFShunt's flows from the switch now, for `done` (an operator's status)."""
        self.ask(self.fb.owned_flow_stats_request(), FlowsRead(now, done))
        self.send.flush()

    def disown(self, switch: SwitchConfig) -> None:
        """No longer master: what was queued or is waiting for a barrier is not ours to
        send or settle any more."""
        self.inflight.unanswerable("this controller stopped being master before the switch answered")
        self.inflight.drop(Barrier)
        self.send = self._send_path(switch)
