"""A start-up's clearing of the kernel's decisions: the policy is not the one the switch's
pairs were decided under (core/policy_state.PolicyWatch), so the first reconcile hands the
adopted pairs back and asks for the decision bits of every conntrack entry to be cleared
(reconcile.py's ClearDecisions), on the worker's thread, seconds for a big table.

The core began its clearing with the command (policy_state.Clearing, the re-evaluation's
gate): no decision of the policy's read before the kernel is done is acted on. The
worker's answer comes back to the event loop whatever it was (kernel/worker.py answers
every clearing, a failed one too; a request that could not even be made is answered at
once) as a ClearingDone for the switch, not for its connection: a session that ends, or a
reconnect's reconcile, meanwhile keeps no gate closed. Its turn ends the clearing, which
asks for the dump that reads every entry again, and says how many decisions read
meanwhile were not acted on.
"""
from __future__ import annotations

import logging
from typing import Callable

from nfshunt.core import commands as c
from nfshunt.kernel.worker import ConntrackWorker
from nfshunt.records.markcodec import DECISION_MASK

from .switch import Switch

LOG = logging.getLogger("nfshunt")

Post = Callable[[Switch, tuple[c.Command, ...]], None]


def clear_decisions(worker: ConntrackWorker, post: Post, clock: Callable[[], float], sw: Switch) -> None:
    """Ask the worker to clear the decisions; its answer is posted to the event loop."""
    def done(cleared: int, failed: int, error: str | None) -> None:  # on the worker thread
        # (the time first: an entry read from now on carries none of the old policy's decisions)
        post(sw, (c.ClearingDone(clock(), cleared, failed, error),))
    try:
        worker.clear_marks(DECISION_MASK, done)
    except Exception as exc:  # no answer will ever come: the gate opens now
        done(0, 0, f"not asked: {type(exc).__name__}: {exc}")
        raise  # (the turn counts and logs it)


def clearing_done(sw: Switch, done: c.ClearingDone) -> list[c.Command]:
    """On the event loop: the core's clearing ended (failed or not: an entry read from now
    on is acted on again) and what it meant logged once."""
    clearing = sw.core.clearing
    ignored = clearing.reported()
    out = clearing.end(done.at)
    if done.error is not None:
        LOG.error("switch %s: could not clear the policy's decisions in conntrack: %s; decisions are acted on "
                  "again all the same (a connection the old policy decided keeps its decision)", sw.name,
                  done.error)
    else:
        LOG.warning("switch %s: the policy is not the one last recorded: decisions cleared on %d conntrack entries "
                    "(%d failed); each is judged again by its next packet", sw.name, done.cleared, done.failed)
    if ignored:
        LOG.warning("switch %s: %d decisions read before the kernel had cleared them were not acted on (maybe the "
                    "old policy's); %s", sw.name, ignored, "a dump reads every entry again" if out else
                    "every entry is read again once the re-evaluation's clearing is done too")
    return out
