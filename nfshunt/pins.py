"""An operator's pins: an unshunt (IGNORE) or a block held for a connection by its tuple
(both directions), applied to the entry its next packet creates on the slow path. No I/O."""
from __future__ import annotations

from dataclasses import dataclass

from .model import Action, ConnEvent, FlowTuple

PIN_TTL = 3600.0  # seconds an operator's unshunt/block holds for a tuple


@dataclass(slots=True)
class Pin:
    action: Action  # IGNORE (unshunt) or BLOCK
    expires: float
    ct_id: int | None = None  # the entry it applied to; its DESTROY ends an unshunt pin


class Pins(dict[FlowTuple, Pin]):
    """The pins by tuple: a dict, read as one on every event the admission decides."""
    __slots__ = ()

    def hold(self, orig: FlowTuple, action: Action, now: float) -> None:
        self[orig] = self[orig.reversed()] = Pin(action, now + PIN_TTL)

    def destroyed(self, ev: ConnEvent) -> None:
        """An entry left the firewall: an unshunt pin that held it back ends with it."""
        pin = self.get(ev.orig)
        if pin is not None and pin.action is Action.IGNORE and pin.ct_id == ev.ct_id:
            self.pop(ev.orig, None)
            self.pop(ev.reply, None)

    def expire(self, now: float) -> None:
        for t in [t for t, p in self.items() if p.expires <= now]:
            del self[t]
