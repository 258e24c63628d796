"""A re-evaluation (`nfshunt iptables apply --policy`, the control socket's `reevaluate`):
every connection is judged again by the policy in the kernel now.

On the event loop every pair is taken down at once (a TCP one after its entry is re-created
with its decision cleared); on the worker's thread the decisions of the whole conntrack
table are cleared (the next packet of each entry crosses NFSHUNT_POLICY), seconds for a big
table. What the event loop reads meanwhile may carry the old policy's decision, so until the
kernel is done no decision of the policy's is acted on (core/policy_state.Clearing); then a
dump reads every entry again. The request is answered on the event loop once the kernel is
done and every core knows it.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

from nfshunt.core import commands as c
from nfshunt.core.policy_state import PolicyWatch
from nfshunt.kernel.worker import ConntrackWorker
from nfshunt.observe.metrics import Counters
from nfshunt.records import markcodec
from nfshunt.switch.switch import Switch

LOG = logging.getLogger("nfshunt")

Answer = Callable[[dict[str, Any]], None]
Post = Callable[[dict[str, Any], Any], object]  # hands (request, context) to the event loop


class Host(Protocol):
    """What a re-evaluation needs of the controller."""
    switches: list[Switch]
    counters: Counters
    worker: ConntrackWorker
    policy: PolicyWatch
    clock: Callable[[], float]  # monotonic: the conntrack listener's and worker's clock (a rig's own)

    def run(self, sw: Switch, commands: Iterable[c.Command], waiter: threading.Event | None = None) -> None:
        """Execute a switch's core's commands and send what they make."""


@dataclass(frozen=True)
class Cleared:
    """A re-evaluation whose clearing of the kernel's decisions is done (the worker's
    answer), handed to the event loop: its turn ends the re-evaluation and answers it."""
    answer: Answer  # the re-evaluation's request's
    at: float  # when the kernel was done, on the app's clock
    removed: int
    connected: bool
    cleared: int
    failed: int
    error: str | None


class Reevaluation:
    def __init__(self, app: Host, post: Post):
        self.app = app
        self.post = post

    def begin(self, request: dict[str, Any], answer: Answer, reason: str, now: float) -> None:
        """On the event loop: every pair taken down, and no decision of the policy's acted
        on (an operator's pin and an IDS's block are: they decide whatever the policy said)
        until the kernel's clearing of them is done (`cleared`)."""
        removed = 0
        for sw in self.app.switches:
            sw.core.clearing.begin()
            out = sw.core.flush(reason, now)
            removed += len(out)
            self.app.run(sw, out)
        self.app.counters.add("operator", "reevaluate")
        LOG.warning("re-evaluating every connection (%s): taking down %d shunts and blocks", reason, removed)
        connected = any(sw.session is not None for sw in self.app.switches)

        def done(cleared: int, failed: int, error: str | None) -> None:  # on the worker thread
            at = self.app.clock()  # (before the policy is read: an entry read from now on is cleared)
            try:
                if error is None:
                    self.app.policy.reevaluated()  # the pairs from now on are the new policy's
            finally:  # (the event loop must hear of it whatever happened: it acts on no decision until then)
                self.post(request, Cleared(answer, at, removed, connected, cleared, failed, error))
        self.app.worker.clear_marks(markcodec.DECISION_MASK, done)

    def cleared(self, done: Cleared) -> None:
        """On the event loop, the kernel's clearing done (failed or not: an entry read from
        now on is acted on again): every core told, a dump asked (what the new policy
        decided meanwhile), the re-evaluation answered."""
        ignored = sum(sw.core.clearing.reported() for sw in self.app.switches)
        for sw in self.app.switches:
            self.app.run(sw, sw.core.clearing.end(done.at))
        if done.error is not None:
            done.answer({"error": f"could not clear the decision marks: {done.error}"})
            return
        if ignored:
            LOG.warning("re-evaluation: %d decisions read before the kernel had cleared them were not acted on "
                        "(maybe the old policy's); a dump reads every entry again", ignored)
        done.answer({"ok": True, "removed": done.removed, "cleared": done.cleared, "clear_failed": done.failed,
                     "ignored_meanwhile": ignored, "switch_connected": done.connected})
