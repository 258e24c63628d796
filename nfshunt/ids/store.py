"""The IDS rules kept: per requester, capped, expiring hard, surviving restarts.

One owner thread (the controller's event loop) calls it; nothing here blocks but `save`.
Two clocks: a rule is made and kept with its expiry on the wall clock (`Rule.created`,
`expires`: what the IDS and the state file say, and what holds across a restart of the
controller), and while the controller runs it expires on the monotonic clock: when a rule
is added or loaded, what is left of it by the wall clock (never more than its `expire`)
becomes a monotonic deadline (`deadline`), and `due` and `expire` are asked with monotonic
time. A step of the wall clock neither lengthens nor shortens a running rule; across a
restart the wall clock is all there is (a rule whose expiry passed meanwhile is reported
expired at `load`; a backward step meanwhile lengthens none beyond its own `expire`).

The state file (`ids.state_file`, under the state directory by default) is written
atomically (a temporary file in the same directory, fsynced, renamed over it; mode 0600)
by `write` (`save`), which the owner calls when `dirty` on its periodic tick and at stop:
one write a tick, not one a request (at 1,000 requests a second a write each would be the
bottleneck). Each rule's line is made once, when it is added (a rule never changes), so a
tick's `snapshot` is a list of them and the write can run off the owner's thread (60,000
rules: 14 MB, ~350 ms to encode afresh and ~50 ms to join and write, bench `ids`).
A crash loses at most the last tick's changes; an IDS reconciles by listing its rules.
The tick's write runs on a thread of its own (`save_soon`), the stop's at once (`save_now`).
"""
from __future__ import annotations

import dataclasses
import enum
import heapq
import ipaddress
import itertools
import json
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from nfshunt.config import jsonfile
from nfshunt.config.ids import MAX_IDS_EXPIRE, MayShunt
from nfshunt.config.validate import check_names
from nfshunt.core.pins import IdsHold
from nfshunt.records.model import Action, FlowTuple

from .rules import (
    CONNECTION_KINDS,
    MAX_IDLE_TIMEOUT,
    MAX_PRIORITY,
    RULE_ID,
    Decision,
    Kind,
    Network,
    Rule,
    RuleError,
    Situation,
    _connection,
    _host,
    _int,
    connection_vlan,
    pair_key,
    precedence,
    prefix_of,
    server_of,
)

LOG = logging.getLogger("nfshunt")
FORMAT = 1  # the state file's layout version
BYTES_A_RULE = 1024  # a stored rule is ~350 bytes: the file's size limit is this times max_rules


class Added(enum.StrEnum):
    ADDED = "added"
    EXISTS = "exists"  # this requester already has this id for this very target
    DUPLICATE = "duplicate"  # this requester already has this id for another target
    FULL = "full"  # max_rules active rules


@dataclass(frozen=True)
class Counts:
    packets: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class Ended:
    """A rule that ended (expired, or removed), with its flows' last counters."""
    rule: Rule
    why: str  # "expired", "removed", "expired while the controller was down"
    at: float
    counts: Counts

    def to_json(self) -> dict[str, Any]:
        return {**self.rule.to_json(), "state": "expired" if self.why.startswith("expired") else "removed",
                "why": self.why, "ended": self.at, "packets": self.counts.packets, "bytes": self.counts.bytes}


class Store:
    def __init__(self, path: str | None, max_rules: int, remember: int = 1000, shared_whitelists: bool = False,
                 wall: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic):
        """path: the state file (None: kept in memory only); remember: how many ended rules
        are kept for a requester that asks after one (a DELETE or GET racing the expiry);
        shared_whitelists: a whitelist exempts from every requester's blocks (else from
        its own requester's only); wall, mono: the two clocks (the module's docstring)."""
        self.path = path
        self.max_rules = max_rules
        self.shared_whitelists = shared_whitelists
        self.wall = wall
        self.mono = mono
        self.rules: dict[tuple[str, str], Rule] = {}
        self._deadlines: dict[tuple[str, str], float] = {}  # each active rule's end, monotonic
        # Each requester's rules in the order they were added, with their place in that
        # order: a listing's page is read from these off the owner's thread (`page`).
        self._by_source: dict[str, dict[tuple[str, str], tuple[int, Rule]]] = {}
        self._order = itertools.count(1)
        self._by_target: dict[tuple[Any, ...], set[tuple[str, str]]] = {}
        self._lines: dict[tuple[str, str], bytes] = {}  # each active rule as the state file has it
        # Rules of an address (blocks, whitelists: few), asked about on every request: not a scan of all.
        self._addressed: dict[tuple[str, str], Rule] = {}
        self._expiries: list[tuple[float, tuple[str, str]]] = []  # a heap of deadlines: no scan a tick
        self._ended: OrderedDict[tuple[str, str], Ended] = OrderedDict()
        self._remember = remember
        self.dirty = False
        self._writer: threading.Thread | None = None  # the tick's write of the state file

    def __len__(self) -> int:
        return len(self.rules)

    # --- changes ------------------------------------------------------------------------------

    def add(self, rule: Rule) -> Added:
        had = self.rules.get(rule.key)
        if had is not None:
            return Added.EXISTS if had.target == rule.target else Added.DUPLICATE
        if len(self.rules) >= self.max_rules:
            return Added.FULL
        self._put(rule, self.wall(), self.mono())
        self._ended.pop(rule.key, None)
        self.dirty = True
        return Added.ADDED

    def _put(self, rule: Rule, wall: float, mono: float) -> None:
        """An active rule kept, its deadline what is left of it now by the wall clock (at
        most its `expire`: a wall clock set back since it was made gives it no more)."""
        deadline = self._deadlines[rule.key] = mono + min(float(rule.expire), max(0.0, rule.expires - wall))
        self.rules[rule.key] = rule
        self._by_source.setdefault(rule.source, {})[rule.key] = (next(self._order), rule)
        self._by_target.setdefault(rule.target, set()).add(rule.key)
        self._lines[rule.key] = json.dumps(rule.to_json(), separators=(",", ":")).encode()
        if rule.address is not None:
            self._addressed[rule.key] = rule
        heapq.heappush(self._expiries, (deadline, rule.key))

    def _drop(self, rule: Rule, why: str, now: float, counts: Counts) -> Ended:
        del self.rules[rule.key]
        own = self._by_source[rule.source]
        del own[rule.key]
        if not own:
            del self._by_source[rule.source]
        del self._deadlines[rule.key]
        del self._lines[rule.key]
        self._addressed.pop(rule.key, None)
        keys = self._by_target[rule.target]
        keys.discard(rule.key)
        if not keys:
            del self._by_target[rule.target]
        if len(self._expiries) > 2 * len(self.rules) + 64:
            # Entries of rules removed before their expiry (up to 30 days away) are dropped
            # from the heap now and then, or adds and removals would grow it without bound.
            self._expiries = [(self._deadlines[k], k) for k in self.rules]
            heapq.heapify(self._expiries)
        ended = self._ended[rule.key] = Ended(rule, why, now, counts)
        while len(self._ended) > self._remember:
            self._ended.popitem(last=False)
        self.dirty = True
        return ended

    def remove(self, source: str, rule_id: str, now: float, counts: Callable[[Rule], Counts]) -> Ended | None:
        """The requester removes its rule: how it ended (an expired one as it expired);
        None if it names no rule this store knows of."""
        rule = self.rules.get((source, rule_id))
        if rule is None:
            return self._ended.get((source, rule_id))
        return self._drop(rule, "removed", now, counts(rule))

    def due(self, now: float) -> list[Rule]:
        """The rules whose hard expiry has come by `now` (monotonic; their flows go before
        they are `end`ed)."""
        heap = self._expiries
        due: dict[tuple[str, str], Rule] = {}
        while heap and heap[0][0] <= now:
            deadline, key = heapq.heappop(heap)
            if self._deadlines.get(key) == deadline:  # else it ended before its expiry
                due[key] = self.rules[key]
        for key in due:  # active until `end`: due again on the next tick meanwhile
            heapq.heappush(heap, (self._deadlines[key], key))
        return list(due.values())

    def deadline(self, rule: Rule) -> float:
        """An active rule's end on the monotonic clock."""
        return self._deadlines[rule.key]

    def hold(self, rule: Rule) -> IdsHold:
        """What an active connection rule's pin holds its connection to (pins.py), until its end."""
        server = rule.server
        if server is None and rule.kind is Kind.SHUNT and rule.connection is not None:
            server = server_of(rule.connection)  # not judged on an entry: its dst, as precedence takes it
        return IdsHold(rule.action, rule.source, rule.idle_timeout, self._deadlines[rule.key], server)

    def end(self, rule: Rule, why: str, now: float, counts: Counts) -> Ended:
        """An active rule taken out once its flows are gone, with their counters."""
        return self._drop(rule, why, now, counts)

    def expire(self, now: float, counts: Callable[[Rule], Counts]) -> list[Ended]:
        """Every rule whose hard expiry has come by `now` (monotonic), taken out, with its
        flows' counters."""
        due = sorted((d, k) for k, d in self._deadlines.items() if d <= now)
        wall = self.wall()
        return [self._drop(self.rules[k], "expired", wall, counts(self.rules[k])) for _, k in due]

    # --- questions ----------------------------------------------------------------------------

    def get(self, source: str, rule_id: str) -> Rule | None:
        return self.rules.get((source, rule_id))

    def ended(self, source: str, rule_id: str) -> Ended | None:
        return self._ended.get((source, rule_id))

    def holders(self, rule: Rule) -> list[Rule]:
        """The active rules of any requester with this rule's target (one set of flows serves them all)."""
        return [self.rules[k] for k in self._by_target.get(rule.target, ())]

    def select(self, source: str | None = None, kind: Kind | None = None,
               address: Network | None = None) -> list[Rule]:
        """The active rules, filtered: by requester, kind, and an address or prefix they concern."""
        out = []
        for rule in self.rules.values():
            if source is not None and rule.source != source:
                continue
            if kind is not None and rule.kind is not kind:
                continue
            if address is not None and not any(_overlap(n, address) for n in rule.networks()):
                continue
            out.append(rule)
        return sorted(out, key=lambda r: (r.source, r.created, r.id))

    def page(self, source: str | None, kind: Kind | None, address: Network | None, after: int,
             limit: int) -> tuple[list[Rule], int | None]:
        """Up to `limit` active rules, filtered, in the order they were added, from after
        the place `after` (0: the first); and the place to ask after for the next page (None:
        no more). Read from any thread while the owner changes the store: each requester's
        rules are taken as they are at once (a dict copied whole), never walked as they change."""
        if source is not None:
            sources = [self._by_source.get(source, {})]
        else:
            sources = [self._by_source.get(name, {}) for name in list(self._by_source)]
        picked: list[tuple[int, Rule]] = []
        for own in sources:
            for place, rule in list(own.values()):  # (a copy, taken at once)
                if place <= after or (kind is not None and rule.kind is not kind):
                    continue
                if address is not None and not any(_overlap(n, address) for n in rule.networks()):
                    continue
                picked.append((place, rule))
        picked.sort(key=lambda p: p[0])
        more = len(picked) > limit
        return [r for _, r in picked[:limit]], picked[limit - 1][0] if more else None

    def whitelisting(self, networks: Iterable[Network], source: str) -> Rule | None:
        """An active whitelist covering any address of these networks: `source`'s own, or
        any requester's with shared_whitelists."""
        nets = tuple(networks)
        return next((r for r in self._addressed.values() if r.kind is Kind.WHITELIST and r.address is not None
                     and (self.shared_whitelists or r.source == source)
                     and any(_overlap(r.address, n) for n in nets)), None)

    def blocking(self, conn: FlowTuple) -> Rule | None:
        """An active IDS block covering this connection: of it, or of an address of it."""
        for key in self._by_target.get((Kind.BLOCK, pair_key(conn)), ()):
            return self.rules[key]
        if not self._addressed:  # no address rule: the addresses are not parsed (3.9 -> 0.7 us a shunt request)
            return None
        hosts = (ipaddress.ip_address(conn.src), ipaddress.ip_address(conn.dst))
        return next((r for r in self._addressed.values() if r.kind is Kind.BLOCK_ADDRESS and r.address is not None
                     and any(h.version == r.address.version and h in r.address for h in hosts)), None)

    def of_connection(self, conn: FlowTuple) -> list[Rule]:
        """The active shunts and blocks of this connection (either direction), of any requester."""
        key = pair_key(conn)
        return [self.rules[k] for kind in CONNECTION_KINDS for k in self._by_target.get((kind, key), ())]

    def exempted_by(self, whitelist: Rule) -> list[Rule]:
        """The active IDS blocks a new whitelist contradicts (precedence 4): to be lifted.
        Its own requester's only, unless shared_whitelists: one IDS's whitelist does not lift
        another's block."""
        assert whitelist.address is not None
        return [r for r in self.rules.values() if r.kind in (Kind.BLOCK, Kind.BLOCK_ADDRESS)
                and (self.shared_whitelists or r.source == whitelist.source)
                and any(_overlap(whitelist.address, n) for n in r.networks())]

    def situation(self, rule: Rule, policy: Action | None = None, pin: Action | None = None,
                  entry_accepted: bool = True, server: tuple[str, int] | None = None) -> Situation:
        """What ids_rules.precedence needs, the IDS part from this store and the rest from
        the caller (the connection's live entry as the policy decided it, an operator's pin)."""
        block = self.blocking(rule.connection) if rule.kind is Kind.SHUNT and rule.connection is not None else None
        white = (self.whitelisting(rule.networks(), rule.source) if rule.kind in (Kind.BLOCK, Kind.BLOCK_ADDRESS)
                 else None)
        return Situation(policy, server, entry_accepted, pin, None if block is None else f"{block.source}/{block.id}",
                         None if white is None else f"{white.source}/{white.id}")

    # --- the state file -----------------------------------------------------------------------

    def load(self) -> list[Ended]:
        """The rules of the state file, at start; those that expired meanwhile are returned
        (their flows, if any were left, ended on the switch at their hard timeout:
        counters unknown)."""
        if self.path is None:
            return []
        gone = []
        now, mono = self.wall(), self.mono()
        for i, raw in enumerate(read(self.path, self.max_rules)):
            try:
                rule = from_json(raw)
            except (ValueError, TypeError, LookupError, ArithmeticError, OSError) as exc:
                # RuleError (a ValueError) is the checks' own; the others are what a check that
                # misjudges an edited value raises (a wrong type, a missing key, a number out of
                # range, inet_pton's refusal): that rule is lost, not the controller's start.
                LOG.error("IDS rules file %s: rules[%d] is dropped: %s", self.path, i,
                          exc if isinstance(exc, RuleError) else f"{type(exc).__name__}: {exc}")
                continue
            if rule.key in self.rules:
                LOG.error("IDS rules file %s: rules[%d] repeats %s/%s: dropped", self.path, i, rule.source, rule.id)
            elif len(self.rules) >= self.max_rules:
                LOG.error("IDS rules file %s: rules[%d] is over ids.max_rules (%d): dropped", self.path, i,
                          self.max_rules)
            elif rule.expires <= now:
                self._put(rule, now, mono)
                gone.append(self._drop(rule, "expired while the controller was down", now, Counts()))
            else:
                self._put(rule, now, mono)
        self.dirty = bool(gone)
        return gone

    def judge(self, allowed: MayShunt) -> list[Ended]:
        """At start, after `load`: every rule judged again by ids_rules.precedence against
        the config as it is now (`ids.may_shunt`) and the whitelists; one it refuses ends
        (its flows, if a pair of it is on the switch, are handed back: reconcile.py). The
        policy's decision of each connection is judged where it always is (admission); an
        operator's pin and another rule's block are not reasons to end a rule here, as they
        are not while it runs (its pin waits beneath them)."""
        gone = []
        wall = self.wall()
        for rule in sorted(self.rules.values(), key=lambda r: (r.created, r.key)):
            # (its server as it was judged: a shunt's rule keeps the entry's original destination)
            verdict = precedence(rule, dataclasses.replace(self.situation(rule, server=rule.server), ids_block=None),
                                 allowed)
            if verdict.decision is Decision.REFUSE:
                LOG.warning("IDS rule %s/%s refused at start (%s): it ends, its flows go", rule.source, rule.id,
                            verdict.reason)
                gone.append(self._drop(rule, f"refused at start: {verdict.reason}", wall, Counts()))
        return gone

    def snapshot(self) -> list[bytes]:
        """The active rules' lines for `write`, as they are now; `dirty` is cleared (the
        caller sets it again if the write fails)."""
        self.dirty = False
        return list(self._lines.values())

    def save(self) -> None:
        """Write the active rules atomically; OSError is the caller's to report (the rules
        stay in memory and `dirty`, so the next tick tries again)."""
        if self.path is None:
            self.dirty = False
            return
        write(self.path, list(self._lines.values()))
        self.dirty = False

    def save_soon(self) -> None:
        """The tick's write: on a thread, one write at a time, of the rules as they are now
        (a failed write leaves the store dirty: tried again next tick). At 60,000 rules a
        write is ~50 ms the event loop must not wait for."""
        if not self.dirty or self._writer is not None and self._writer.is_alive():
            return
        path = self.path
        if path is None:
            self.save()  # (kept in memory only)
            return
        lines = self.snapshot()

        def run() -> None:
            try:
                write(path, lines)
            except OSError as exc:
                self.dirty = True
                LOG.error("cannot write the IDS rules file %s (%s): kept in memory, tried again next tick", path,
                          exc)
        self._writer = threading.Thread(target=run, name="nfshunt-ids-save", daemon=True)
        self._writer.start()

    def save_now(self) -> None:
        """At stop (and start): the state file written now, after the tick's write if one runs."""
        if self._writer is not None:
            self._writer.join()
        if not self.dirty:
            return
        try:
            self.save()
        except OSError as exc:
            LOG.error("cannot write the IDS rules file %s (%s): kept in memory, tried again next tick", self.path,
                      exc)


def read(path: str, max_rules: int) -> list[Any]:
    """The state file's rules, each as written (checked by `from_json`); none if there is
    no file, and none if it cannot be read, which is then kept aside as `<path>.bad`."""
    if not os.path.exists(path):
        return []
    try:
        doc = jsonfile.read(path, max_rules * BYTES_A_RULE + 4096)
        if not isinstance(doc, dict) or doc.get("version") != FORMAT or not isinstance(doc.get("rules"), list):
            raise jsonfile.JsonInputError("", f"not a version {FORMAT} IDS rules file")
    except jsonfile.JsonInputError as exc:
        aside = f"{path}.bad"
        LOG.error("cannot read the IDS rules file %s (%s): starting with no IDS rules; the file is kept as "
                  "%s. Each IDS can list and add its rules again", path, exc, aside)
        try:
            os.replace(path, aside)
        except OSError:
            pass
        return []
    rules: list[Any] = doc["rules"]
    return rules


def write(path: str, lines: list[bytes]) -> None:
    """The state file of these rules' lines (`Store.snapshot`), written atomically; from any
    thread. Written a part of about WRITE_PART at a time: joined whole, 60,000 rules' 18 MB
    were copied three times in one hold of the interpreter's lock (28 ms) every tick, which
    the event loop waited out (the IDS bench's p99 grew with the rules held); a write a line
    would wait for the lock again after each of 60,000 system calls."""
    jsonfile.write_atomic(path, _parts(lines))


WRITE_PART = 1 << 20


def _parts(lines: list[bytes]) -> Iterator[bytes]:
    yield b'{"version":%d,"rules":[' % FORMAT
    part: list[bytes] = []
    size, sep = 0, b""
    for line in lines:
        part.append(line)
        size += len(line) + 1
        if size >= WRITE_PART:
            yield sep + b",".join(part)
            part, size, sep = [], 0, b","
    if part:
        yield sep + b",".join(part)
    yield b"]}"


def _overlap(a: Network, b: Network) -> bool:
    return a.version == b.version and a.overlaps(b)


def from_json(raw: Any, created_at: float | None = None) -> Rule:
    """A rule as `Rule.to_json` wrote it, every field checked again (the file may be edited);
    created_at: its time of creation instead of the one it says (the controller's, for a rule
    the API's process sends)."""
    if not isinstance(raw, dict):
        raise RuleError("", "not an object")
    allowed = {"source", "id", "kind", "priority", "expire", "created", "expires", "idle_timeout", "connection",
               "address", "server"}
    unknown = set(raw) - allowed
    if unknown:
        raise RuleError(sorted(unknown)[0], "unknown field")
    try:
        source, rule_id, kind = raw["source"], raw["id"], Kind(raw["kind"])
        created = raw["created"]
    except (KeyError, ValueError) as exc:
        raise RuleError("", f"missing or wrong field {exc}") from None
    if not isinstance(source, str) or not source.startswith("ids:") or not isinstance(rule_id, str) \
            or not RULE_ID.fullmatch(rule_id):
        raise RuleError("id", "not a requester and an id")
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created):
        raise RuleError("created", "not a time")
    idle = raw.get("idle_timeout")
    conn = address = None
    if kind in CONNECTION_KINDS:
        conn = _connection("connection", raw.get("connection"))
    else:
        address = prefix_of("address", raw.get("address"))
    return Rule(source, rule_id, kind, _int("priority", raw.get("priority", 0), -MAX_PRIORITY, MAX_PRIORITY),
                _int("expire", raw.get("expire"), 1, MAX_IDS_EXPIRE),
                float(created) if created_at is None else created_at, conn, address,
                None if idle is None else _int("idle_timeout", idle, 1, MAX_IDLE_TIMEOUT),
                _server(raw.get("server"), conn) if kind is Kind.SHUNT else None,
                connection_vlan("connection", raw.get("connection")) if conn is not None else None)


def _server(raw: Any, conn: FlowTuple | None) -> tuple[str, int] | None:
    """A shunt's server as the state file has it: one end of its connection (a file from
    before servers were kept has none: Rule.hold then takes the rule's dst)."""
    if raw is None:
        return None
    body = check_names("server", raw, ("address", "port"), ("address", "port"), RuleError, "field")
    server = (_host("server.address", body["address"]), _int("server.port", body["port"], 1, 65535))
    if conn is None or server not in ((conn.src, conn.sport), (conn.dst, conn.dport)):
        raise RuleError("server", "not an end of the rule's connection")
    return server
