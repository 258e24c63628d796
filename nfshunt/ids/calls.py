"""The calls between the IDS API and the controller: what a request may be refused for,
what a call is answered, a rule as the API shows it, and what the API asks of the
controller (`RuleBackend`). The HTTP server (api.py) and the logic that answers it
(backend.py, loop.py, view.py, ends.py) both take these from here, so the logic never
imports the server."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol

from .rules import Kind, Network, Refusal, Rule


class Reject(enum.StrEnum):
    """Why a request was refused: the counter's label and the answer's "error"."""
    UNAUTHENTICATED = "unauthenticated"  # 401
    RATE_LIMITED = "rate_limited"  # 429
    TOO_LARGE = "too_large"  # 413
    LENGTH_REQUIRED = "length_required"  # 411
    MALFORMED = "malformed"  # 400: not JSON, or JSON past the bounds
    INVALID = "invalid"  # 400: a field is wrong
    NOT_FOUND = "not_found"  # 404
    METHOD = "method"  # 405
    DUPLICATE = "duplicate"  # 409: the requester's id names another rule
    REFUSED = "refused"  # 403: precedence refused it (Outcome.refusal says which rule)
    FULL = "full"  # 503: ids.max_rules active rules
    UNAVAILABLE = "unavailable"  # 503: the controller cannot act now (e.g. no switch)
    UNANSWERED = "unanswered"  # 504: the backend did not answer in time
    INTERNAL = "internal"  # 500
    TIMEOUT = "timeout"  # the request did not arrive within its deadline: connection cut
    UNREAD = "unread"  # the client took no answer within WRITE_SECONDS: connection cut
    FORBIDDEN = "forbidden"  # 403: another client's rules, to a client whose token is not an admin's
    BUSY = "busy"  # ids.max_connections open: connection closed at once
    CLIENT_BUSY = "client_busy"  # ids.max_connections_per_client of its client open: closed at once
    TLS = "tls"  # the TLS handshake failed (no or a wrong client certificate)


class Result(enum.StrEnum):
    ADDED = "added"
    EXISTS = "exists"
    REMOVED = "removed"
    EXPIRED = "expired"  # a removal of a rule that had expired already
    ERROR = "error"


class State(enum.StrEnum):
    PENDING = "pending"  # kept; waits for something (`waiting_for`) before its flows go on the switch
    ACTIVE = "active"  # its flows are on the switch, confirmed
    EXPIRED = "expired"
    REMOVED = "removed"


@dataclass(frozen=True)
class RuleView:
    """A rule as the API shows it: its state and its flows' counters (None: not read)."""
    rule: Rule
    state: State
    waiting_for: str | None = None
    packets: int | None = None
    bytes: int | None = None
    # An active connection rule's pair: the idle timeout its flows were installed with (the
    # rule's, or the config's default where the pair was on the switch before the rule, or
    # another rule of the connection holds it: ids_rules.holder).
    flows_idle_timeout: int | None = None

    def to_json(self) -> dict[str, Any]:
        out = {**self.rule.to_json(), "state": self.state.value, "packets": self.packets, "bytes": self.bytes}
        if self.waiting_for is not None:
            out["waiting_for"] = self.waiting_for
        if self.flows_idle_timeout is not None:
            out["flows_idle_timeout"] = self.flows_idle_timeout
        return out


@dataclass(frozen=True)
class Outcome:
    """The one answer to a request.
    ADDED: on the switch and confirmed, or (`pending` set) kept and waiting for that;
    EXISTS: reason says what already holds; REMOVED / EXPIRED: `view` has the counters;
    ERROR: `error` and `reason`, and `refusal` when the precedence rule refused it."""
    result: Result
    reason: str = ""
    pending: str | None = None
    error: Reject | None = None
    refusal: Refusal | None = None
    view: RuleView | None = None


PAGE_MAX = 1000  # rules in a listing's page at most


@dataclass(frozen=True)
class Page:
    """A listing's page: its rules' views, and where the next page starts (None: no more)."""
    views: list[RuleView]
    next: int | None = None


class RuleBackend(Protocol):
    """What the API asks of the controller (it runs the rules on the switch). Called from
    the API's threads, several at once: the implementation hands each call to the event
    loop and waits for its answer."""

    def submit(self, rule: Rule, timeout: float) -> Outcome:
        """Add a rule; answer within `timeout` seconds: ADDED once the switch confirmed its
        flows, ADDED with `pending` if it waits (for the connection, or still for the switch
        when the time is up: kept all the same, it expires as any rule), EXISTS, or ERROR."""
        ...

    def remove(self, source: str, rule_id: str) -> Outcome:
        """REMOVED (or EXPIRED, if it had) with its view and counters; ERROR NOT_FOUND."""
        ...

    def rules(self, source: str | None, kind: Kind | None, address: Network | None, after: int,
              limit: int) -> Page:
        """A page of the active rules (pending ones too), filtered (source None: every
        requester's), in the order they were added, after the place `after` (0: from the
        first). Read off the event loop."""
        ...

    def rule(self, source: str, rule_id: str) -> RuleView | None:
        """One rule of a requester, active or recently ended."""
        ...
