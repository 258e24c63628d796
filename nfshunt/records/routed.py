"""What a routing firewall's tables answer about a destination (kernel/routes.py asks them,
core/routing.py acts on the answers): a NextHop, or one of these reasons there is none."""
from __future__ import annotations

from .model import NextHop

R_NO_ROUTE = "routed: no route to the destination"
R_BLACKHOLE = "routed: blackhole route to the destination"
R_NOT_UNICAST = "routed: the destination's route is not unicast (blackhole, unreachable, prohibit)"
R_UNRESOLVED = "routed: the next hop's MAC is not resolved"
R_LOOKUP_FAILED = "routed: the route lookup failed"
R_NEXT_HOP_FAILED = "routed: next hop failed"

Answer = NextHop | str


def hop_json(hop: NextHop) -> dict[str, str]:
    """Where a routed pair's direction (or a routed static flow) goes: out of `interface`, to
    `neighbour` (the gateway, or the destination on a connected route; "" unknown) at `mac`."""
    return {"interface": hop.ifname, "neighbour": hop.neighbour, "mac": hop.eth_dst}
