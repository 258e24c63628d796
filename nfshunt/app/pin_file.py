"""An operator's pins kept across a restart of the controller (`<state_dir>/operator-pins.json`).

`nfshunt block` and `nfshunt unshunt` hold a connection's tuple for an hour (core/pins.py).
A restarted controller that forgot them would let the blocked connection's next entry be
judged by the policy alone, which may shunt it: an operator's block silently become a
hole. So the operator's pins are written here, atomically (0600), each time the operator
pins a tuple, at the tick after an unshunt ended with its connection, and at stop, with
their ends on the wall clock, and held again at start for what is left of them (never more
than the pin's own lifetime). An unshunt pin whose connection ended while the controller
was stopped comes back for what is left of its hour: it keeps a tuple on the slow path,
which is safe. A bad file is reported and moved aside.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Iterable

from nfshunt.config import jsonfile
from nfshunt.core.pins import PIN_TTL, Pin
from nfshunt.records.model import Action, FlowTuple

from .control import parse_tuple

LOG = logging.getLogger("nfshunt")
FILE = "operator-pins.json"
FORMAT = 1
MAX_BYTES = 16 << 20  # ~100,000 pins
ACTIONS = {"unshunt": Action.IGNORE, "block": Action.BLOCK}
NAMES = {v: k for k, v in ACTIONS.items()}


@dataclass(frozen=True)
class Kept:
    """A pin read back: its tuple, action and seconds left."""
    orig: FlowTuple
    action: Action
    left: float


def path_in(state_dir: str) -> str:
    return os.path.join(state_dir, FILE)


def save(path: str, pins: Iterable[tuple[FlowTuple, Pin]], wall: float, mono: float) -> None:
    """The operator's pins (IDS pins are the IDS rules' file's), one line each, atomically.
    OSError is the caller's to report."""
    seen: set[FlowTuple] = set()
    rows = []
    for t, pin in pins:
        if pin.source is not None or pin.expires <= mono or t.reversed() in seen:
            continue
        seen.add(t)
        rows.append({"tuple": str(t), "action": NAMES[pin.action], "expires": round(wall + pin.expires - mono, 3)})
    jsonfile.write_atomic(path, json.dumps({"version": FORMAT, "pins": rows}).encode())


def load(path: str, wall: float) -> list[Kept]:
    """The pins still to hold (an unreadable file: none, reported, kept aside as .bad)."""
    if not os.path.exists(path):
        return []
    try:
        doc = jsonfile.read(path, MAX_BYTES)
        if not isinstance(doc, dict) or doc.get("version") != FORMAT or not isinstance(doc.get("pins"), list):
            raise jsonfile.JsonInputError("", f"not a version {FORMAT} operator pins file")
    except jsonfile.JsonInputError as exc:
        LOG.error("cannot read the operator's pins %s (%s): none held; the file is kept as %s.bad", path, exc, path)
        try:
            os.replace(path, f"{path}.bad")
        except OSError:
            pass
        return []
    out = []
    for i, row in enumerate(doc["pins"]):
        kept = _row(row, wall)
        if kept is None:
            LOG.error("operator pins file %s: pins[%d] is not a pin: dropped", path, i)
        elif kept.left > 0:
            out.append(kept)
    return out


def _row(row: Any, wall: float) -> Kept | None:
    if not isinstance(row, dict) or set(row) != {"tuple", "action", "expires"} or row["action"] not in ACTIONS:
        return None
    expires = row["expires"]
    if isinstance(expires, bool) or not isinstance(expires, (int, float)) or not math.isfinite(expires):
        return None
    try:
        orig = parse_tuple(str(row["tuple"]))
    except ValueError:
        return None
    return Kept(orig, ACTIONS[row["action"]], min(PIN_TTL, expires - wall))
