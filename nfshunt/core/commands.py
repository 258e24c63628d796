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
from nfshunt.config.switch import PortGroup
from nfshunt.records.model import ConnEvent, FlowTuple, SwitchFlow

from .address_flows import AddressFlow
from .close_watch import CloseWatch
from .connection import Conn


@dataclass(slots=True)
class InstallDefaults:
    groups: tuple[PortGroup, ...]


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
class ResyncConntrack:
    """Dump the conntrack table and feed every entry to core.conntrack_event()."""


@dataclass(slots=True)
class ClearDecisions:
    """Clear the policy's decision bits of every conntrack entry: each is judged again by
    its next packet (a policy that changed while the controller was stopped)."""


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
    """Static flows by cookie: deleted, audited (`what`: each one's description)."""
    cookies: tuple[int, ...]
    what: tuple[str, ...]
    reason: str


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
                RequestSwitchFlows, RequestKeptDefaults, RequestTableSize, ResyncConntrack, ClearDecisions,
                InstallFlows, RemoveFlows, DeleteConntrack, ShortenConntrack, Later, EntryDue, ReadCounters, Ignored,
                Installed, Refused, Removed, RestoreConntrack, InstallStatic, RemoveStatic, ReadStaticCounters,
                InstallAddressBlocks, RemoveAddressBlocks, WatchFlows, UnwatchFlows, WatchEnds, CloseContradicted]
