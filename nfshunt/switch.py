"""The switches one controller serves (config `switches`), and which one a connection is for.

A `Switch` is one configured datapath: its own config (ports, datapath id, pacing,
layout), decision core, connection, send path and the reads it has in flight. The app
keeps one per configured switch and hands each switch message to the switch whose
connection it came on.

Every switch's port groups are bridge ports of the one firewall, so a connection's mark
(ingress and egress physdevin) names the switch it crossed. One that entered by a port
group of one switch and left by another's has no fast path (the switches are not
connected to each other): it stays on the slow path, counted as crossing two switches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .commands import Ignored
from .connection import Conn
from .core import Core
from . import markcodec
from .config import Config
from .flows import FlowBuilder
from .model import ConnEvent, EventKind, SwitchFlow
from .roles import Roles
from .channel import SendPath
from .teardown_sweep import TeardownSweep

R_CROSSES_SWITCHES = "crosses two switches"


@dataclass(frozen=True, slots=True)
class Asked:
    """A periodic read in flight (meter, static flows): asked again once it is overdue."""
    xid: int
    at: float  # when it was asked (monotonic)


@dataclass(frozen=True, slots=True)
class CatcherRead:
    """The catcher read after dropped packet-ins (teardown_sweep), filled part by part."""
    xid: int
    counted: list[int]  # cookies of the catchers that counted


@dataclass(frozen=True, slots=True)
class CounterRead:
    """A new shunt's flow counters (confirm: counters), summed over the reply's parts."""
    conn: Conn
    packets: dict[bool, int]  # by direction (reply: True)


class Switch:
    """One served datapath and everything this controller keeps about it."""

    def __init__(self, cfg: Config, index: int):
        self.cfg = cfg
        self.index = index
        self.core = Core(cfg)
        self.dp: Any = None  # the connection served now (os-ken Datapath)
        self.fb: FlowBuilder | None = None
        self.send: SendPath | None = None
        self.roles = Roles(cfg.pair.state_file, cfg.pair.start_role) if cfg.pair else None
        self.role_xids: set[int] = set()
        self.role_checked = 0.0
        self.table_xid: int | None = None
        self.meter_xid: int | None = None
        # The controller meter's drops, read every tick, and the catcher read they call for.
        self.meter_on = False
        self.meter_read: Asked | None = None
        self.catcher_read: CatcherRead | None = None
        self.sweep = TeardownSweep()
        # Half-closed shunts' catcher reads (teardown_sweep): by xid, the cookies that counted.
        self.watch_reads: dict[int, list[int]] = {}
        # confirm: counters: flow-stats requests of new shunts, by xid
        self.counter_reads: dict[int, CounterRead] = {}
        self.flow_stats: list[SwitchFlow] = []  # a reconcile's flows read so far
        self.static_read: Asked | None = None  # the static flows' counters read
        self.static_flows: list[SwitchFlow] = []  # ... its flows so far

    @property
    def name(self) -> str:
        """How logs name the switch: its configured datapath id (or the connected one's)."""
        dpid = self.cfg.datapath_id if self.cfg.datapath_id is not None else getattr(self.dp, "id", None)
        return f"{dpid:016x}" if dpid is not None else "(any datapath id)"

    def gone(self) -> None:
        """The connection ended: what belonged to it is void."""
        self.dp = None
        self.fb = None
        self.send = None
        self.role_xids.clear()
        self.counter_reads.clear()
        self.meter_on, self.meter_read, self.catcher_read = False, None, None
        self.flow_stats = []
        self.static_read, self.static_flows = None, []
        self.sweep.reset()
        self.watch_reads.clear()


class Router:
    """Which switch a conntrack event is for, from the port groups in its mark."""

    def __init__(self, cfg: Config):
        self.several = len(cfg.served) > 1
        self.by_physdevin = {g.physdevin: i for i, sw in enumerate(cfg.served) for g in sw.ports}

    def route(self, ev: ConnEvent) -> int | Ignored:
        """The index of the switch whose core takes the event, or why no switch does."""
        if not self.several:
            return 0
        ingress = self.by_physdevin.get((ev.mark & markcodec.INGRESS_MASK) >> markcodec.INGRESS_SHIFT)
        egress = self.by_physdevin.get((ev.mark & markcodec.EGRESS_MASK) >> markcodec.EGRESS_SHIFT)
        if (ingress is not None and egress is not None and ingress != egress
                and ev.mark & markcodec.FLAGS == markcodec.FLAGS and ev.kind is not EventKind.DESTROY):
            return Ignored(R_CROSSES_SWITCHES, ev)
        # Unrecorded ports: the core of the first switch says why it ignores the event.
        return ingress if ingress is not None else egress if egress is not None else 0
