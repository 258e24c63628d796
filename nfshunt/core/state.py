"""What the decision core's parts share for one switch: the switch as the core knows it,
the pairs on it, the connections waiting for room, the pins, the static shunts, the
address blocks and the half-closed watch. Each part (admission, confirmation, teardown, removal,
reconcile) is given this object, never the Core. No I/O."""
from __future__ import annotations

import collections
from typing import Callable

from nfshunt.config.settings import Config
from nfshunt.config.switch import SwitchConfig
from nfshunt.records.model import ConnEvent, FlowTuple

from .address_blocks import AddressBlocks
from .closing import ClosingEntries
from .connection import Conn
from .layout import pair_entries
from .pairs import Connections
from .pins import Pins
from .policy_state import Clearing
from .routing import NextHopTable
from .static_table import StaticTable
from .teardown_sweep import HalfClosed


class CoreState:
    __slots__ = ("cfg", "switch", "version", "pipeline", "backup", "reconciled", "table_kept", "stale_policy",
                 "budget", "conns", "waiting", "pins", "static", "address_blocks", "half_closed", "closing", "now",
                 "next_hops", "clearing")

    def __init__(self, cfg: Config, switch: SwitchConfig):
        self.cfg = cfg  # the controller's keys
        self.switch = switch  # this switch's own keys (ports, pacing, confirmation)
        self.version: int | None = None  # negotiated OpenFlow version; None: no switch (or not master)
        self.pipeline = False  # the switch's flows use the pipeline layout (two tables)
        self.backup = cfg.pair is not None  # one of a pair, not (yet) granted MASTER
        self.reconciled = False
        # Whether the switch kept its table across the break (its defaults were there before
        # they were sent again); None: not known (no defaults, OpenFlow 1.0, no answer).
        self.table_kept: bool | None = None
        # The policy changed since the pairs on the switch were decided (set by the app at
        # start, from policy_state.py): the first reconcile hands every adopted pair back.
        self.stale_policy = False
        # A re-evaluation's clearing of the decisions in the kernel: what an entry read
        # before it ended says the policy decided is not acted on (policy_state.Clearing).
        self.clearing = Clearing()
        self.budget = switch.max_shunts  # pairs allowed at once (0: no limit)
        self.conns = Connections()
        # Connections refused for lack of room, oldest first; blocks go to the front.
        self.waiting: collections.OrderedDict[FlowTuple, ConnEvent] = collections.OrderedDict()
        self.pins = Pins()  # operator overrides by tuple (both directions): IGNORE (unshunt) or BLOCK
        # Engineered streams (static.py: not pairs, not in the budget) and an IDS's prefix drops
        # (address_blocks.py): both make flow-mods only while the switch is ours (`programs`).
        self.static = StaticTable(cfg, switch, self.programs)
        self.address_blocks = AddressBlocks(cfg.block_priority, self.programs)
        # TCP shunts with one FIN caught: where a lost packet-in is looked for (teardown_sweep).
        self.half_closed = HalfClosed()
        self.closing = ClosingEntries()  # TCP entries seen closing, for events that omit the state
        self.next_hops = NextHopTable()  # a routing firewall's next hops (routing.py)
        # The last tick's time: an event retried from the waiting queue carries the time it
        # was first heard, which a pin's pair must not take as now (pins.hard_timeout).
        self.now = 0.0

    def programs(self) -> bool:
        """The switch is this controller's to program now (connected; in a pair, granted MASTER)."""
        return self.version is not None

    def remember(self, conn: Conn) -> None:
        """A new or adopted pair joins the table, with the entries it takes in this layout."""
        self.conns.remember(conn, pair_entries(self.version, self.cfg, conn, self.pipeline))

    def saved(self) -> Callable[[], None]:
        """What Core.reload replaces (the keys, the static table's flows, whether closes are
        watched), as a function that puts it back in the same turn of the event loop: a
        reload whose turn failed part way leaves the core in the config it ran
        (app/reloading.py). Nothing of the reload was sent by then."""
        cfg, switch, watch, static = self.cfg, self.switch, self.conns.watch_closes, self.static.saved()

        def put_back() -> None:
            self.cfg, self.switch, self.conns.watch_closes = cfg, switch, watch
            static()
        return put_back
