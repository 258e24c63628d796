"""What the decision core asks of the rest: typed commands, executed by the dispatcher
(dispatch.py), one handler for each type. No I/O here.

Commands that act (install, remove, restore, delete, read) and commands that report an
outcome (Ignored, Installed, Refused, Removed: counted, logged and audited in one place,
accounting.py). Not frozen: several are made a shunt, and a frozen dataclass costs three
times as much to build. Nothing changes a command once made.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from nfshunt.config.static import StaticFlow
from nfshunt.config.switch import PortGroup, RoutedSide
from nfshunt.records.model import ConnEvent, FlowTuple, NatRange, NextHop, SwitchFlow

from .address_flows import AddressFlow
from .close_watch import CloseWatch
from .connection import Conn


@dataclass(slots=True)
class InstallDefaults:
    groups: tuple[PortGroup, ...]


@dataclass(slots=True)
class AnnounceGateways:
    """A routing firewall pair's new master: the hosts told its MAC for every address of its
    routed interfaces, out of their groups' fast ports (a VLAN's tagged; openflow/announce.py):
    keepalived's own announcements went out before this host held the switch, and reached no host."""
    sides: tuple[RoutedSide, ...]


@dataclass(frozen=True, slots=True)
class PortFrame:
    """A frame the controller sends out of a switch port (a packet-out)."""
    port: int
    data: bytes


@dataclass(slots=True)
class SendAnnouncements:
    """The frames an AnnounceGateways makes (the interfaces read off the event loop), each out
    of its group's fast port."""
    frames: tuple[PortFrame, ...]
    interfaces: tuple[str, ...]  # the ones read (what the log names)


@dataclass(slots=True)
class InstallPipeline:
    """The pipeline layout's shared table-1 flows: per port group, FIN and RST catchers
    (IPv4 and IPv6) and the output (see flows.py)."""
    groups: tuple[PortGroup, ...]


@dataclass(slots=True)
class DeleteAllFlows:
    pass


@dataclass(slots=True)
class LimitPacketIns:
    """Have the switch rate-limit the packet-ins it sends (an OpenFlow 1.3 meter on the
    controller port): a host sending FIN segments must not saturate the controller."""
    rate: int  # packets per second


@dataclass(slots=True)
class DeleteSwitchFlow:
    flow: SwitchFlow
    reason: str


@dataclass(slots=True)
class RequestSwitchFlows:
    """Read NFShunt's flows back from the switch; answer with core.reconcile()."""


@dataclass(slots=True)
class RequestKeptDefaults:
    """Ask whether the switch still holds NFShunt's slow-path defaults, before anything is
    sent at a connect (it kept its table across the break, or lost it); answer with
    core.defaults_kept()."""


@dataclass(slots=True)
class RequestTableSize:
    """Ask the switch how many entries its table 0 holds; answer with core.table_size()."""


@dataclass(slots=True)
class ResolveHops:
    """Ask the firewall's route and neighbour tables where `addresses` go; answer with
    core.next_hops_known(), which judges `event` again (a routing firewall's shunt)."""
    event: ConnEvent
    addresses: tuple[str, ...]
    attempt: int = 0  # asked again while the tables say no (routing.RETRIES)


@dataclass(slots=True)
class ResolveStatic:
    """Ask the firewall's route and neighbour tables where `addresses` go, for the static
    shunts through it (`via`); answer with a StaticHopsKnown."""
    addresses: tuple[str, ...]
    attempt: int = 0


@dataclass(slots=True)
class StaticHopsKnown:
    """The tables' answer to a ResolveStatic (the route follower's thread), run on the event
    loop: core.tables_changed(), as the follower's news are."""
    answers: dict[str, NextHop | str]
    attempt: int = 0


@dataclass(slots=True)
class HopsKnown:
    """The firewall's tables' answer to a ResolveHops (from the route follower's thread),
    run on the event loop: core.next_hops_known()."""
    answers: dict[str, NextHop | str]
    event: ConnEvent
    attempt: int = 0


@dataclass(slots=True)
class CheckAdopted:
    """Routed pairs read back at a reconcile (docs/design/routed.md 5.7): ask the firewall's
    tables where `addresses` (their destinations) go now, as a ResolveHops does (the route
    follower, off the event loop); answer with core.adopted_hops_known()."""
    conns: tuple[Conn, ...]
    addresses: tuple[str, ...]


@dataclass(slots=True)
class AdoptedHopsKnown:
    """The tables' answer to a CheckAdopted, run on the event loop: core.adopted_hops_known()."""
    conns: tuple[Conn, ...]
    answers: dict[str, NextHop | str]


@dataclass(slots=True)
class LookUpEntry:
    """A NAT pair read back at a reconcile (design 5.6): look its kept conntrack entry up by
    its original tuple (the conntrack worker, off the event loop); answer with
    core.adopted_entry_found()."""
    conn: Conn


@dataclass(slots=True)
class EntryFound:
    """The kernel's answer to a LookUpEntry, run on the event loop: the entry that holds the
    pair's original tuple now (None: none), or why it could not be looked up (`failed`)."""
    conn: Conn
    entry: ConnEvent | None
    failed: str | None = None


@dataclass(slots=True)
class TablesChanged:
    """The route follower's news (kernel/routes.py): destinations whose next hop changed,
    the new answer each; run on the event loop: core.tables_changed()."""
    answers: dict[str, NextHop | str]


@dataclass(slots=True)
class RewriteFlows:
    """A routed pair's next hop changed its MAC: both flows (and their catchers) modified in
    place, match, priority and cookie kept, the actions replaced (no gap, no removal)."""
    conn: Conn


@dataclass(slots=True)
class NeighbourHeldDown:
    """A flapping neighbour held down (routing.HOLD_DOWN): said once a hold-down."""
    interface: str
    address: str
    seconds: float


@dataclass(slots=True)
class ClearDecision:
    """Clear the policy's decision bits of one kept entry (a UDP NAT pair's, whose flows
    go: core/pairs.py), so its next packet is judged again; its translation stays."""
    family: int
    orig: FlowTuple
    ct_id: int


@dataclass(slots=True)
class RefreshConntrack:
    """Give a NAT pair's kept entry `timeout` seconds, whatever its state (core/nat.py):
    the switch carries its traffic, so the kernel's own renewal has stopped."""
    family: int
    orig: FlowTuple
    ct_id: int
    timeout: int


@dataclass(slots=True)
class ResyncConntrack:
    """Dump the conntrack table and feed every entry to core.conntrack_event()."""


@dataclass(slots=True)
class ClearDecisions:
    """Clear the policy's decision bits of every conntrack entry: each is judged again by
    its next packet (a policy that changed while the controller was stopped). The core's
    clearing (policy_state.Clearing) was begun with it: the worker's answer, whatever it
    is, comes back as a ClearingDone."""


@dataclass(slots=True)
class ClearingDone:
    """The kernel answered a ClearDecisions at `at` (the clock events are read on): the
    core's clearing ends (answer with core.clearing.end()); `error` if it could not clear."""
    at: float
    cleared: int
    failed: int
    error: str | None


@dataclass(slots=True)
class InstallFlows:
    conn: Conn


@dataclass(slots=True)
class RemoveFlows:
    conn: Conn
    directions: tuple[bool, ...]
    reason: str


@dataclass(slots=True)
class RestoreConntrack:
    """(Re-)create a TCP connection's conntrack entry in `tcp_state` (an existing one is
    brought to it), then run `then` once the kernel has answered, whatever it answered:
    the flows must go either way (connection.py's take-down rule)."""
    orig: FlowTuple
    reply: FlowTuple
    tcp_state: int
    timeout: int
    closer_is_reply: bool
    mark: int
    then: tuple["Command", ...]
    # A NAT pair's (docs/design/routed.md, 5.6): its kept entry is updated (the decision
    # cleared); only if that one is gone, it is created with these translations, its reply
    # the original reversed (F14: the translated reply alone translates nothing).
    nat: tuple[NatRange, ...] = ()
    # A take-down's pair: told when the kernel has answered (EntryBack), as `then` goes.
    handed_back: Conn | None = None


@dataclass(slots=True)
class WatchFlows:
    """Change a caught close's two flows in place (close_watch.py): each packet to the
    peer's port (an RST's grace) or else to the firewall's bridge port of its side and its
    own catchers gone, and its headers to the controller (answer each with core.watch_sample())."""
    conn: Conn


@dataclass(slots=True)
class UnwatchFlows:
    """An RST's grace contradicted (close_watch.py): the pair's flows as they were installed."""
    conn: Conn


@dataclass(slots=True)
class WatchEnds:
    """A caught close's watch is over (answer with core.watch_ends())."""
    conn: Conn
    watch: CloseWatch  # that watch (a later one of the same pair has its own end)


@dataclass(slots=True)
class CloseContradicted:
    """A caught close that the connection's own traffic contradicted (a forged FIN or RST,
    most likely): counted and logged; its take-down undoes itself."""
    conn: Conn
    claimed: str  # what the catchers had seen
    by: str = ""  # the segment that contradicted it: its direction, flags and data


@dataclass(slots=True)
class ShortenConntrack:
    """Give an existing conntrack entry, still closing, `timeout` seconds; its state stays,
    and its traffic renews it by its state's own timeout. The kernel would change whatever
    entry holds the tuple: the worker sends it only to this closing entry (Expire.meant_for)."""
    family: int
    orig: FlowTuple
    ct_id: int
    timeout: int


@dataclass(slots=True)
class Later:
    """Run `commands` after `delay` seconds (the app's timer posts them back)."""
    delay: float
    commands: tuple["Command", ...]


@dataclass(slots=True)
class EntryBack:
    """A handed-back pair's entry is back (the kernel answered its re-creation) and its
    removal goes: the wait for its flow-removed messages starts (answer with core.conns.entry_back());
    posted by the dispatcher ahead of a RestoreConntrack's `then`."""
    conn: Conn


@dataclass(slots=True)
class EntryDue:
    """The shunt's conntrack entry may go now (answer with core.entry_due())."""
    conn: Conn


@dataclass(slots=True)
class ReadCounters:
    """Read the pair's packet counters from the switch (answer with core.counters_read())."""
    conn: Conn


@dataclass(slots=True)
class DeleteConntrack:
    family: int
    orig: FlowTuple
    ct_id: int | None  # None: whatever entry holds this tuple
    counted: bool = False  # a shunt's own entry: its last counters are the slow path's share (accounting)


@dataclass(slots=True)
class InstallStatic:
    """Static shunts' flows (static.py): written as they are, audited."""
    flows: tuple[StaticFlow, ...]
    reason: str


@dataclass(slots=True)
class RemoveStatic:
    """Static flows by cookie: deleted, audited (`what`: each one's description). `event`:
    "static_withheld" for routed flows never installed this run (their next hop not given at
    the start: the delete only clears what an earlier run may have left)."""
    cookies: tuple[int, ...]
    what: tuple[str, ...]
    reason: str
    event: str = "static_removed"


@dataclass(slots=True)
class InstallAddressBlocks:
    """An IDS's address blocks' drop flows (address_blocks.py): written, audited."""
    flows: tuple[AddressFlow, ...]
    reason: str


@dataclass(slots=True)
class RemoveAddressBlocks:
    """Address-block flows by cookie: deleted (the switch reports their counters), audited."""
    cookies: tuple[int, ...]
    what: tuple[str, ...]
    reason: str


@dataclass(slots=True)
class ReadStaticCounters:
    """Read the static flows' counters (answer with the table's counted())."""


@dataclass(slots=True)
class Ignored:
    reason: str
    event: ConnEvent


@dataclass(slots=True)
class Installed:
    conn: Conn
    latency: float  # seconds from the event being read to the switch's confirmation


@dataclass(slots=True)
class Refused:
    conn: Conn
    reason: str


@dataclass(slots=True)
class Removed:
    conn: Conn
    reason: str


Command = Union[InstallDefaults, InstallPipeline, DeleteAllFlows, LimitPacketIns, DeleteSwitchFlow,
                RequestSwitchFlows, RequestKeptDefaults, RequestTableSize, ResyncConntrack, ResolveHops,
                ResolveStatic, StaticHopsKnown, HopsKnown, TablesChanged, RewriteFlows, NeighbourHeldDown,
                CheckAdopted, AdoptedHopsKnown, AnnounceGateways, SendAnnouncements,
                LookUpEntry, EntryFound,
                RefreshConntrack, ClearDecision, ClearDecisions, ClearingDone,
                InstallFlows, RemoveFlows, DeleteConntrack, ShortenConntrack, Later, EntryBack, EntryDue, ReadCounters,
                Ignored, Installed, Refused, Removed, RestoreConntrack, InstallStatic, RemoveStatic, ReadStaticCounters,
                InstallAddressBlocks, RemoveAddressBlocks, WatchFlows, UnwatchFlows, WatchEnds, CloseContradicted]
