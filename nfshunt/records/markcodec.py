"""The 32-bit connection-mark layout shared with the admin's iptables rules.

Bit-exact with the original NFShunt (BRIEF.md section 3). Only the top 16 bits are
NFShunt's; the low 16 bits belong to the admin and are never read or written here.

    bit 30      ingress bridge port recorded
    bit 29      egress bridge port recorded
    bit 28      policy decided (action field valid)
    bits 24-27  ingress port number (physdevin 1-15)
    bits 20-23  egress port number
    bits 16-19  action number
"""
from __future__ import annotations

from dataclasses import dataclass

FLAG_INGRESS = 0x40000000
FLAG_EGRESS = 0x20000000
FLAG_DECIDED = 0x10000000
INGRESS_SHIFT = 24
EGRESS_SHIFT = 20
ACTION_SHIFT = 16
NIBBLE = 0xF
INGRESS_MASK = NIBBLE << INGRESS_SHIFT  # 0x0f000000
EGRESS_MASK = NIBBLE << EGRESS_SHIFT  # 0x00f00000
ACTION_MASK = NIBBLE << ACTION_SHIFT  # 0x000f0000
NFSHUNT_BITS = 0xFFFF0000
DECISION_MASK = FLAG_DECIDED | ACTION_MASK  # cleared to have the policy judge a connection again
FLAGS = FLAG_INGRESS | FLAG_EGRESS | FLAG_DECIDED  # set on every entry that crossed the plumbing
MAX_PORT = 15


@dataclass(frozen=True, slots=True)
class Mark:
    """A decoded connection mark. A field is None when its flag bit is clear."""

    ingress: int | None
    egress: int | None
    action: int | None

    @property
    def complete(self) -> bool:
        """True when both bridge ports and the policy decision are recorded."""
        return None not in (self.ingress, self.egress, self.action)


def decode(mark: int) -> Mark:
    return Mark(
        ingress=(mark >> INGRESS_SHIFT) & NIBBLE if mark & FLAG_INGRESS else None,
        egress=(mark >> EGRESS_SHIFT) & NIBBLE if mark & FLAG_EGRESS else None,
        action=(mark >> ACTION_SHIFT) & NIBBLE if mark & FLAG_DECIDED else None,
    )


def encode(ingress: int | None = None, egress: int | None = None,
           action: int | None = None, admin: int = 0) -> int:
    """Build a mark; `admin` supplies the low 16 bits."""
    value = admin & 0xFFFF
    if ingress is not None:
        value |= FLAG_INGRESS | (_nibble(ingress, "ingress") << INGRESS_SHIFT)
    if egress is not None:
        value |= FLAG_EGRESS | (_nibble(egress, "egress") << EGRESS_SHIFT)
    if action is not None:
        value |= FLAG_DECIDED | (_nibble(action, "action") << ACTION_SHIFT)
    return value


def ingress_xmark(port: int) -> tuple[int, int]:
    """(value, mask) for `MARK --set-xmark` recording ingress bridge port `port`."""
    return FLAG_INGRESS | (_port(port) << INGRESS_SHIFT), FLAG_INGRESS | INGRESS_MASK


def egress_xmark(port: int) -> tuple[int, int]:
    return FLAG_EGRESS | (_port(port) << EGRESS_SHIFT), FLAG_EGRESS | EGRESS_MASK


def action_xmark(action: int) -> tuple[int, int]:
    return FLAG_DECIDED | (_nibble(action, "action") << ACTION_SHIFT), FLAG_DECIDED | ACTION_MASK


def _nibble(value: int, what: str) -> int:
    if not 0 <= value <= NIBBLE:
        raise ValueError(f"{what} number {value} does not fit in 4 bits (0-15)")
    return value


def _port(port: int) -> int:
    if not 1 <= port <= MAX_PORT:
        raise ValueError(f"bridge port number {port} is outside 1-{MAX_PORT}")
    return port
