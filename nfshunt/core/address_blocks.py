"""An IDS's address blocks on one switch: every frame to or from a prefix dropped.

Two flows a prefix (one matching it as the source, one as the destination), any
ingress port, any IP protocol, in table 0 at `block_priority`: above reactive shunts and
their catchers and above static shunts, so a block beats every shunt. Each flow carries
the rule's remaining lifetime as its hard timeout (the switch ends it on time even while
the controller is down) and asks for a flow-removed, whose counters the rule's end
reports. Installed at every connect, kept by reconcile, like the static flows. The flows
themselves are address_flows.py's. Pure: the dispatcher sends the commands made here.
A block or an unblock while the switch is not this controller's to program (away, or a
pair's backup) is kept and makes no flow-mod: `connected` installs what is kept.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from nfshunt.config.static import Network
from nfshunt.records import cookies
from nfshunt.records.model import SwitchFlow

from .address_flows import AddressFlow, cookie_of
from .commands import Command, InstallAddressBlocks, RemoveAddressBlocks


@dataclass(frozen=True)
class Counts:
    packets: int
    bytes: int


class AddressBlocks:
    """One switch's address blocks, by prefix; the counters of flows the switch removed."""

    def __init__(self, priority: int, ours: Callable[[], bool] = lambda: True):
        """ours: whether the switch is this controller's to program now (the core's)."""
        self.priority = priority
        self.ours = ours
        self.flows: dict[Network, tuple[AddressFlow, AddressFlow]] = {}
        self.removed: dict[int, Counts] = {}  # by cookie: what a removed flow reported

    @property
    def entries(self) -> int:
        return 2 * len(self.flows)

    def by_cookie(self) -> dict[int, AddressFlow]:
        return {f.cookie: f for pair in self.flows.values() for f in pair}

    def block(self, net: Network, expires: float, reason: str) -> list[Command]:
        """Drop every frame to or from `net` until `expires` (a longer rule of the same
        prefix extends it: the flows are written again with the new hard timeout)."""
        had = self.flows.get(net)
        if had is not None and had[0].expires >= expires:
            return []
        pair = (AddressFlow(net, False, self.priority, cookie_of(net, False), expires),
                AddressFlow(net, True, self.priority, cookie_of(net, True), expires))
        self.flows[net] = pair
        for f in pair:
            self.removed.pop(f.cookie, None)
        return [InstallAddressBlocks(pair, reason)] if self.ours() else []

    def unblock(self, net: Network, reason: str) -> list[Command]:
        pair = self.flows.pop(net, None)
        if pair is None or not self.ours():
            return []
        return [RemoveAddressBlocks(tuple(f.cookie for f in pair), tuple(f.describe() for f in pair), reason)]

    def flow_removed(self, cookie: int, packets: int, nbytes: int) -> None:
        """The switch removed one (its hard timeout, or our delete): its counters kept for the rule's end."""
        self.removed[cookie] = Counts(packets, nbytes)

    def counts(self, net: Network) -> tuple[int, int, int] | None:
        """(packets, bytes, flows reported) of the prefix's removed flows."""
        got = [self.removed.get(cookie_of(net, to)) for to in (False, True)]
        if not any(got):
            return None
        return (sum(c.packets for c in got if c), sum(c.bytes for c in got if c), sum(c is not None for c in got))

    def forget_counts(self, net: Network) -> None:
        for to in (False, True):
            self.removed.pop(cookie_of(net, to), None)

    def expire(self, now: float) -> None:
        """Blocks the switch's hard timeout has ended."""
        for net in [n for n, pair in self.flows.items() if pair[0].expires <= now]:
            del self.flows[net]

    def connected(self) -> list[Command]:
        """At connect: every block (each with what is left of its lifetime when sent)."""
        flows = tuple(f for pair in self.flows.values() for f in pair)
        return [InstallAddressBlocks(flows, "switch connected")] if flows else []

    def reconcile(self, flows: list[SwitchFlow]) -> tuple[list[SwitchFlow], list[Command]]:
        """Split the switch's address-block flows from the rest: ours are kept (installed at
        connect already); one no block here names (another run's, or the pair's other
        controller's) is a drop with its own end, kept until then; one without an end goes."""
        ours = self.by_cookie()
        blocks, rest = cookies.split(flows, cookies.Kind.ADDRESS_BLOCK)
        stale = [flow.cookie for flow in blocks if flow.cookie not in ours and not flow.hard_timeout]
        out: list[Command] = []
        if stale:
            out.append(RemoveAddressBlocks(tuple(stale), tuple(f"cookie 0x{c:016x}" for c in stale),
                                           "no IDS rule names it"))
        return rest, out
