"""A caught close on watch: what the connection's next packets say about it. No I/O.

A catcher tells the controller that a FIN or RST with the connection's tuple crossed the
switch, not who sent it, and the controller cannot judge its sequence number (conntrack
does not export its window over netlink; the switch keeps none). A shunt's entry that
reports a closing state (connection.py `closed_on_firewall`) says no more: a FIN that
reaches the firewall while the switch is not yet forwarding on a new pair's flows moves
the entry (liberal) wherever its sequence number lies. One forged segment would
otherwise end a shunt: its entry re-created (or left) closing, its decision kept, the
transfer carried on through the firewall for good. So the pair's own two flows, changed
in place (no entry more on the switch), show the controller the connection's next
packets (the first 128 bytes of each) for a moment:

- after an RST, for its grace (`rst_grace`, the aborted transfer's tail kept on the fast
  path): the flows go on forwarding to the peer; the connection is handed back (its entry
  re-created in CLOSE, then the flows go) only at the grace's end;
- after both FINs (or one, taken as closed: teardown_sweep), or an RST with no grace: the
  connection is handed back at once, its entry re-created in the state the close reached
  (the firewall tracks the rest of it), and for `WATCH` seconds the flows send each
  packet to the firewall's bridge port of its side (as the default flows would) instead
  of going at once; its own catchers go;
- after a close seen on the firewall: likewise, its entry left in the state the firewall
  has it in (or re-created in it, if it was deleted), and watched as after both FINs.

What comes meanwhile decides:

- a segment a real close cannot be followed by contradicts it: from the side that reset,
  anything but another RST (a stack that reset the connection has no socket left to send
  from); after both FINs, data beyond its side's FIN (each side said it had no more). Data
  that ends at or before it (within BEFORE_FIN) was sent before the close and may still
  come: a retransmission, or a segment late on its way. Where a FIN's sequence number is not
  known (taken from the catchers' counters, or seen on the firewall), any data
  contradicts. In an RST's grace nothing was handed back: the flows are put back as they
  were and the pair goes on (unless a take-down was asked for meanwhile, which the RST does
  not undo: the pair is handed back for it, pairs.py). After a hand-back the take-down
  undoes itself: the entry is brought back ESTABLISHED with the policy's decision cleared,
  the flows go, and the connection's next packet, judged by the policy again, shunts it
  again;
- a SYN from the client answered by a SYN/ACK: a new connection on the ports. After a
  hand-back the firewall judged its SYN as new (a closing entry with CLOSE_INIT lets
  conntrack open a new one); in an RST's grace it rode the shunt, as it always did there.
  The close stands, and is handed back (its flows go) at once;
- anything else (the last ACK, a retransmitted FIN, an RST's answers, the other side's
  data in flight towards the side that reset): the close stands, handed back at the end.

Packet-ins come through the switch's controller meter like the catchers'. Not judged: a
connection that sends nothing during the watch (its close is taken as real, as before).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from nfshunt.records.segment import ACK, SYN, Segment

WATCH = 0.2  # seconds a caught close's flows show its packets to the controller before they go
SEQ_MASK = 0xFFFFFFFF
# How far before its side's caught FIN data may end and still be taken as sent before the
# close (a retransmission, or a segment late on its way): a real bulk close was undone by its
# echo server's 11,584 bytes sent before its FIN. An off-path forger's FIN lands within this
# span ahead of the real stream with a chance of 2^24 / 2^32 (0.4 %): data beyond the FIN (the
# first new segment after a forgery at the peer's next expected byte) still contradicts.
BEFORE_FIN = 1 << 24


class Verdict(enum.Enum):
    NONE = "none"  # nothing the close cannot be followed by
    CONTRADICTED = "contradicted"  # the endpoints did not close: the take-down undoes itself
    REOPENED = "reopened"  # a new connection on the ports: the watch ends now


@dataclass(slots=True)
class CloseWatch:
    """What a caught close claimed, and what its watch has seen."""
    reset: frozenset[bool]  # directions (reply?) whose RST was caught
    # Both directions' FINs caught (or the second taken as lost: teardown_sweep), or a close seen on the firewall.
    fins: bool
    # The RST's grace (`rst_grace`): the pair still forwards to the peer, shows the controller
    # each packet, and is handed back only when the grace ends uncontradicted.
    forwarding: bool = False
    draining: bool = False  # (forwarding) the pair was DRAINING, not LIVE, when the RST came
    syn: bool = False  # a SYN of the original direction came: a new connection may be opening
    settled: bool = False  # decided (contradicted, reopened, or the watch is over)
    fin_seqs: dict[bool, int] = field(default_factory=dict)  # each side's caught FIN's sequence number
    firewall: bool = False  # seen on the firewall (its entry closing), not by a catcher

    def describe(self) -> str:
        if self.firewall:
            return "its entry closing on the firewall"
        parts = [f"RST from the {'reply' if r else 'original'} side" for r in sorted(self.reset)]
        return " and ".join(parts + (["FINs from both sides"] if self.fins else []))


def judge(watch: CloseWatch, reply: bool, seg: Segment) -> Verdict:
    """One packet of the watched connection (its direction, its headers)."""
    if seg.flags & SYN:
        if not reply and not seg.flags & ACK:
            watch.syn = True
        elif reply and seg.flags & ACK and watch.syn:
            return Verdict.REOPENED
        return Verdict.NONE
    if seg.closes:
        return Verdict.NONE
    # After a SYN too: a forged SYN gets a live server's challenge ACK, not a SYN/ACK, and
    # the transfer's data that follows still undoes the close (and the entry the SYN made).
    if reply in watch.reset or (watch.fins and seg.payload > 0 and not _before_fin(watch, reply, seg)):
        return Verdict.CONTRADICTED
    return Verdict.NONE


def _before_fin(watch: CloseWatch, reply: bool, seg: Segment) -> bool:
    """Data that ends at or before its side's caught FIN (within BEFORE_FIN): sent before the
    close, not after it. False where the FIN's sequence number is not known."""
    fin = watch.fin_seqs.get(reply)
    return fin is not None and (fin - (seg.seq + seg.payload)) & SEQ_MASK < BEFORE_FIN
