"""Which policy the pairs on the switch were decided under.

Pairs outlive the controller when flows are kept across restarts
(`delete_flows_on_shutdown` and `delete_flows_on_startup` false): the next start adopts
them. A policy applied meanwhile (`nfshunt iptables apply --policy` with no controller to
tell) must still be enforced on them. The controller records a fingerprint of the live
NFSHUNT_POLICY chains whenever its pairs are decided under them (at start, once the
switches are reconciled; after each re-evaluation) and, at start, compares it with the
chains it finds: when they differ, or nothing was recorded, every adopted pair is handed
back to the firewall (its entry re-created, its next packet judged by the new policy).
The chains are read from the kernel, so a rule changed by hand counts as a change too.
Read at start and after a re-evaluation only, never on the event path.

While the decisions in the kernel are cleared (a re-evaluation's, or at start when the
policy changed: reconcile.py's ClearDecisions), what the event loop reads may still carry
the old policy's (`Clearing`).
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import subprocess
import tempfile

from .commands import Command, ResyncConntrack

LOG = logging.getLogger("nfshunt")
FILE = "policy-fingerprint"
POLICY_CHAIN = "NFSHUNT_POLICY"
SAVE_COMMANDS = (("iptables-save", "-t", "mangle"), ("ip6tables-save", "-t", "mangle"))


def fingerprint() -> str | None:
    """A digest of the NFSHUNT_POLICY rules of both families as the kernel has them;
    None if they cannot be read (then nothing can be compared: treated as changed)."""
    digest = hashlib.sha256()
    prefix = f"-A {POLICY_CHAIN} "
    for argv in SAVE_COMMANDS:
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            LOG.warning("cannot read the policy (%s): %s", argv[0], exc)
            return None
        if proc.returncode != 0:
            LOG.warning("cannot read the policy (%s): %s", argv[0], proc.stderr.strip())
            return None
        digest.update(argv[0].encode() + b"\n")
        for line in proc.stdout.splitlines():
            if line.startswith(prefix):
                digest.update(line.encode() + b"\n")
    return digest.hexdigest()


def recorded(state_dir: str) -> str | None:
    """The fingerprint the last decisions were made under; None if none was recorded."""
    path = os.path.join(state_dir, FILE)
    try:
        with open(path, encoding="ascii") as fh:
            value = fh.read(200).strip()
    except (OSError, UnicodeDecodeError):
        return None
    return value if len(value) == 64 and all(ch in "0123456789abcdef" for ch in value) else None


def record(state_dir: str, value: str | None) -> None:
    """Record the fingerprint atomically (a crash leaves the old one or the new one)."""
    if value is None:
        return
    try:
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=state_dir, prefix=f".{FILE}.")
        with os.fdopen(fd, "w", encoding="ascii") as fh:
            fh.write(value + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, os.path.join(state_dir, FILE))
    except OSError as exc:
        LOG.error("cannot record the policy's fingerprint in %s: %s (the next start will hand every adopted "
                  "pair back to the firewall)", state_dir, exc)


class PolicyWatch:
    """The controller's view: whether the pairs it finds on its switches at start were
    decided under another policy, and the record kept up to date."""

    def __init__(self, state_dir: str, switches: int, pair: bool):
        self.state_dir = state_dir
        self.live = fingerprint()
        before = recorded(state_dir)
        if pair and before is None:
            # One of a pair, first start: the pairs it will adopt at a takeover are its
            # peer's, decided under the pair's policy, which is this node's as it stands.
            record(state_dir, self.live)
            before = self.live
        self.stale = self.live is None or before != self.live
        self._waiting = set(range(switches))  # switches not reconciled since start
        if self.stale:
            LOG.warning("the policy is not the one the switch's pairs were decided under (%s): every pair "
                        "found on a switch is handed back to the firewall and judged again",
                        "none recorded" if before is None else "it changed while the controller was stopped")

    def reconciled(self, switch: int) -> None:
        """A switch's first reconcile since start is done: once every switch's is, the
        pairs on them were decided under the live policy."""
        if switch in self._waiting:
            self._waiting.discard(switch)
            if not self._waiting:
                record(self.state_dir, self.live)
                self.stale = False

    def reevaluated(self) -> None:
        """Every pair was judged again under the policy now in the kernel (on the worker thread)."""
        self.live = fingerprint()
        record(self.state_dir, self.live)


class Clearing:
    """A clearing of the policy's decisions in the kernel, as one switch's core follows it
    (pure). A re-evaluation's: the operator API says when one begins, with the flush, and
    when the kernel ended it (app/reevaluation.py). A start-up's, when the policy is not the
    one the switch's pairs were decided under: the first reconcile begins it with its
    ClearDecisions, whose answer ends it (ClearingDone: switch/clearing.py).

    The flush (a start-up's reconcile: the adopted pairs handed back) takes every pair down
    at once; the clearing walks the whole conntrack table on the worker's thread, seconds
    for a big one. An entry read before it ended may carry
    the old policy's decision: the listener's backlog, a dump's entries (read on the
    worker's thread but fed to the event loop in slices, after it), an event kept for later
    (queued behind a pair's removal, waiting for a next hop). Acted on, the shunt would
    outlive the re-evaluation: the kernel's clearing of its entry comes as an update of a
    held pair, or not at all once the pair's drain deleted the entry. So what the policy
    decided in an entry read before the clearing ended is not acted on (admission.decide);
    once it has ended, a dump reads every entry again. An update the kernel sent before the
    clearing reached its entry but the listener read after it ended is followed by the
    clearing's own update of that entry, which takes the pair down (admission: its decision
    withdrawn)."""
    __slots__ = ("going", "since", "ignored")

    def __init__(self) -> None:
        self.going = 0  # clearings begun and not yet ended
        # What the policy decided in an entry read before this time (the clock events are
        # read on: monotonic) may be an old policy's: -inf before any clearing, +inf while
        # one goes on.
        self.since = -math.inf
        # Decisions not acted on for it since the first of those going began, and not yet
        # said (`reported`: a re-evaluation's answer, a start-up clearing's log line).
        self.ignored = 0

    def begin(self) -> None:
        if not self.going:
            self.ignored = 0
        self.going += 1
        self.since = math.inf

    def reported(self) -> int:
        """The decisions not acted on that no end has said yet (each is said once, by the
        end of whichever clearing comes next: overlapping ones split them)."""
        ignored, self.ignored = self.ignored, 0
        return ignored

    def end(self, cleared_at: float) -> list[Command]:
        """The kernel ended a clearing at `cleared_at` (the worker ends them in the order
        they began): an entry read from then on carries none of an old policy's decisions.
        Once none is left going, every entry is read again (a dump), for what the new policy
        decided meanwhile and was not acted on."""
        self.going = max(0, self.going - 1)
        if self.going:
            return []
        self.since = cleared_at
        return [ResyncConntrack()]
