"""A NAT pair's kept conntrack entry (docs/design/routed.md, 5.6): the firewall's own
traffic no longer renews it once the switch carries the connection, so the controller gives
it time ahead of the flows. Every pair's flows leave within an idle timeout of its last
packet (the switch's idle timeout), so while a pair is LIVE its counters rose within one:
refreshing it then to a few idle timeouts keeps the entry (the translated port, held by the
table alone) until after its flows are gone, and no longer. Pure: the pairs and `now` in,
commands out."""
from __future__ import annotations

from nfshunt.config.settings import Config

from .commands import RefreshConntrack
from .connection import Conn, State

# The entry gets this many of its flows' idle timeouts, every half of one.
LIFE_IN_IDLE_TIMEOUTS = 3
R_NAT_ENTRY_GONE = "routed: its NAT entry is gone"


def keeps(conn: Conn, ct_id: int) -> bool:
    """Whether entry `ct_id` is the one a NAT pair keeps for its translation. Once that entry
    is gone (flushed, deleted, timed out), nf_nat may give its translated tuple to another
    connection, whose replies the pair's reply flow would carry to this pair's host: the
    pair is taken down (admission)."""
    return conn.nat is not None and not conn.entry_deleted and conn.entry == ct_id \
        and conn.state is not State.TAKING_DOWN


def refreshes(cfg: Config, conns: list[Conn], now: float) -> list[RefreshConntrack]:
    out = []
    for conn in conns:
        if conn.nat is None or conn.state is not State.LIVE or conn.entry_deleted:
            continue
        idle = conn.idle_timeout or cfg.default_shunt_timeout
        if conn.nat_refreshed is not None and now - conn.nat_refreshed < max(1.0, idle / 2):
            continue
        conn.nat_refreshed = now
        out.append(RefreshConntrack(conn.orig.family, conn.orig, conn.entry, LIFE_IN_IDLE_TIMEOUTS * idle))
    return out
