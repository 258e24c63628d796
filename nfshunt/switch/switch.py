"""The switches one controller serves (config `switches`), and which one a connection is for.

A `Switch` is one configured datapath: its own config (`switch`, a SwitchConfig: ports,
datapath id, pacing, layout, confirmation) beside the controller's (`cfg`), its decision
core, pair roles and, while connected, its session (session.py). The app keeps one per
configured switch and hands each switch message to the switch whose
connection it came on.

Every switch's port groups are bridge ports of the one firewall, so a connection's mark
(ingress and egress physdevin) names the switch it crossed. One that entered by a port
group of one switch and left by another's has no fast path (the switches are not
connected to each other): it stays on the slow path, counted as crossing two switches.
"""
from __future__ import annotations

from typing import Callable

from nfshunt.config.settings import Config
from nfshunt.core.commands import Command, Ignored
from nfshunt.core.core import Core
from nfshunt.core.roles import Roles
from nfshunt.core.static_table import StaticChange
from nfshunt.core.teardown_sweep import TeardownSweep
from nfshunt.observe.metrics import Counters
from nfshunt.openflow.session import Session
from nfshunt.records import markcodec
from nfshunt.records.model import ConnEvent, EventKind

R_CROSSES_SWITCHES = "crosses two switches"


class Switch:
    """One served datapath and everything this controller keeps about it."""

    def __init__(self, cfg: Config, index: int):
        self.cfg = cfg  # the controller's keys
        self.index = index
        self.switch = cfg.switches[index]  # this switch's own keys
        self.core = Core(cfg, self.switch)
        self.session: Session | None = None  # the connection served now
        self.roles = Roles(cfg.pair.state_file, cfg.pair.start_role) if cfg.pair else None
        self.role_checked = 0.0
        # The controller meter's drops and the catcher reads they call for (across reconnects).
        self.sweep = TeardownSweep()
        # The default flows' bytes by direction, as last read (housekeeping; the metrics'
        # slow path), and the session whose read of them is in flight.
        self.slow_path_bytes: dict[str, int] = {}
        self.slow_path_reading: Session | None = None
        # A VLAN trunk's drops (frames of tags its groups do not carry): packets by in_port, as
        # last read (status, metrics), and the session whose read is in flight.
        self.vlan_dropped: dict[int, int] = {}
        self.vlan_drops_reading: Session | None = None

    @property
    def name(self) -> str:
        """How logs name the switch: its configured datapath id (or the connected one's)."""
        dpid = self.switch.datapath_id if self.switch.datapath_id is not None else \
            getattr(self.session.dp, "id", None) if self.session is not None else None
        return f"{dpid:016x}" if dpid is not None else "(any datapath id)"

    def reload(self, cfg: Config, static: StaticChange, now: float) -> list[Command]:
        """A reloaded config taken in (app/reloading.py, on the event loop): the controller's
        keys and this switch's, here, in the session's flow builder and in the core; the
        commands that take the switch there (StaticChange: worked out off the loop)."""
        self.cfg, self.switch = cfg, cfg.switches[self.index]
        if self.session is not None:
            self.session.fb.cfg, self.session.fb.switch = cfg, self.switch
        return self.core.reload(cfg, self.switch, static, now)

    def saved(self) -> Callable[[], None]:
        """What `reload` replaces, as a function that puts it back in the same turn of the
        event loop (a reload whose turn failed part way: nothing of it was sent)."""
        cfg, switch, session, core = self.cfg, self.switch, self.session, self.core.shared.saved()
        fb = None if session is None else (session.fb.cfg, session.fb.switch)

        def put_back() -> None:
            self.cfg, self.switch = cfg, switch
            if session is not None and fb is not None:
                session.fb.cfg, session.fb.switch = fb
            core()
        return put_back

    def gone(self) -> Session | None:
        """The connection ended: its session is dropped (returned: what it had asked)."""
        session, self.session = self.session, None
        self.sweep.reset()
        return session


class Router:
    """Which switch a conntrack event is for, from the port groups in its mark."""

    def __init__(self, cfg: Config):
        self.several = len(cfg.switches) > 1
        self.by_physdevin = {p: i for i, sw in enumerate(cfg.switches) for p in sw.by_physdevin}  # (routed VLANs' too)

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

    def dispatch(self, events: list[ConnEvent], cores: list[Core], counters: Counters) -> list[list[Command]]:
        """Each event to its switch's core (counted by kind): each switch's commands (an
        event no switch takes is reported among the first's)."""
        outs: list[list[Command]] = [[] for _ in cores]
        route = self.route
        for ev in events:
            counters.add("conntrack_event", ev.kind.value)
            to = route(ev)
            if isinstance(to, Ignored):
                outs[0].append(to)
            else:
                outs[to].extend(cores[to].conntrack_event(ev))
        return outs
