"""One direction of an IDS's address block as a flow: the record the core's commands
carry and the flow builder writes (address_blocks.py keeps one switch's table of them).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

from nfshunt.config.static import Network
from nfshunt.records import cookies


@dataclass(frozen=True)
class AddressFlow:
    """One direction of an address block: frames whose source (to=False) or destination is inside `net`."""
    net: Network
    to: bool
    priority: int
    cookie: int
    expires: float  # monotonic: when the switch's hard timeout ends it

    def hard_timeout(self, now: float) -> int:
        """Seconds left, at least 1 (0 would be never), at most OpenFlow's 16 bits."""
        return max(1, min(0xFFFF, math.ceil(self.expires - now)))

    def describe(self) -> str:
        return f"{'to' if self.to else 'from'} {self.net} drop"


def cookie_of(net: Network, to: bool) -> int:
    """A stable name for the prefix's flow: the same across restarts (reconcile keeps it)."""
    return cookies.make(cookies.Kind.ADDRESS_BLOCK, zlib.crc32(str(net).encode()), to)
