"""Counting, logging and auditing an IDS rule's changes (the audit names the requester)."""
from __future__ import annotations

import json
import logging
from typing import Any

from nfshunt.observe.accounting import _stamp

from .rules import Rule
from .store import Ended

LOG = logging.getLogger("nfshunt")


class RuleLog:
    def __init__(self, counters: Any, audit: logging.Logger):
        self.counters = counters
        self.audit = audit

    def count(self, outcome: str, rule: Rule) -> None:
        self.counters.add("ids_rules", outcome, rule.kind.value)

    def change(self, event_name: str, rule: Rule, **more: Any) -> None:
        """The audit line of a rule's change: it names the requester (the rule's source)."""
        if self.audit.handlers:
            self.audit.info(json.dumps({"time": _stamp(), "event": event_name, "requester": rule.source,
                                        **rule.to_json(), **more}))

    def ended(self, ended: Ended) -> None:
        """A rule's end: counted by why, logged and audited with its flows' counters."""
        rule = ended.rule
        self.count(ended.why.split(" ", 1)[0], rule)
        LOG.info("IDS rule %s/%s (%s) ended: %s; %d packets %d bytes", rule.source, rule.id, rule.kind.value,
                 ended.why, ended.counts.packets, ended.counts.bytes)
        if self.audit.handlers:
            self.audit.info(json.dumps({"time": _stamp(), "event": "ids_rule_ended", "requester": rule.source,
                                        **ended.to_json()}))
