"""The firewall's own route and neighbour tables, asked over netlink (pyroute2): the next hop
of a destination as the router forwards to it (docs/design/routed.md, 5.3). Not on the
event path's hot part: asked once per destination of a routed shunt, the answer kept by the
core for a while (core/routing.py). The tables' change events are a later slice.
"""
from __future__ import annotations

import errno
from typing import Any

from nfshunt.records.model import NextHop

RTN_UNICAST = 1
# Neighbour states whose MAC the kernel itself would use (a STALE entry is used and checked
# in the background: traffic that bypasses the firewall makes its entries STALE).
NUD_USABLE = 0x02 | 0x04 | 0x08 | 0x10 | 0x40 | 0x80  # REACHABLE STALE DELAY PROBE NOARP PERMANENT
R_NO_ROUTE = "routed: no route to the destination"
R_NOT_UNICAST = "routed: the destination's route is not unicast (blackhole, unreachable, prohibit)"
R_UNRESOLVED = "routed: the next hop's MAC is not resolved"
R_LOOKUP_FAILED = "routed: the route lookup failed"


class NextHops:
    """One netlink socket of its own, opened on first use; every answer a NextHop or the
    reason there is none (measured: no route answers ENETUNREACH, a blackhole EINVAL)."""

    def __init__(self) -> None:
        self._ipr: Any = None

    def resolve(self, address: str) -> NextHop | str:
        from pyroute2 import IPRoute
        from pyroute2.netlink.exceptions import NetlinkError
        if self._ipr is None:
            self._ipr = IPRoute()
        try:
            route = self._ipr.route("get", dst=address)[0]
            if route["type"] != RTN_UNICAST:
                return R_NOT_UNICAST
            oif = route.get("RTA_OIF")
            gateway = route.get("RTA_GATEWAY") or address
            link = self._ipr.get_links(oif)[0]
            neighbours = self._ipr.get_neighbours(dst=gateway, ifindex=oif)
        except NetlinkError as exc:
            return R_NO_ROUTE if exc.code == errno.ENETUNREACH else R_NOT_UNICAST
        except (OSError, IndexError):
            self.close()  # a new socket next time
            return R_LOOKUP_FAILED
        mac = next((n.get("NDA_LLADDR") for n in neighbours if n["state"] & NUD_USABLE and n.get("NDA_LLADDR")), None)
        if mac is None:
            return R_UNRESOLVED
        return NextHop(link.get("IFLA_IFNAME"), link.get("IFLA_ADDRESS"), mac)

    def close(self) -> None:
        if self._ipr is not None:
            try:
                self._ipr.close()
            finally:
                self._ipr = None
