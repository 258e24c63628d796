"""The IDS API's test double and helpers: a fake backend (the real store and precedence,
no switch), a server on 127.0.0.1 at an ephemeral port, a client call."""
import http.client
import ipaddress
import json
import os
import threading
import time

from nfshunt.config.ids import IdsConfig, MayShunt
from nfshunt.ids.api import IDLE_SECONDS, PREAUTH_SECONDS, IdsApi
from nfshunt.ids.calls import Outcome, Page, Reject, Result, RuleView, State
from nfshunt.ids.rules import Decision, precedence
from nfshunt.ids.store import Added, Counts, Store

TOKEN = "zeek-token-0123456789abcdef"
OTHER = "scipass-token-0123456789abcdef"
ADMIN = "operator-token-0123456789abcdef"  # marked admin: sees every client's rules
CONN = {"protocol": "tcp", "src": "10.0.0.1", "sport": 40000, "dst": "10.0.0.2", "dport": 5201}


class FakeBackend:
    """The controller's side as the lead wires it, minus the switch: the real store and
    precedence; each connection's policy decision is given by the test (`policy`)."""

    def __init__(self, cfg):
        self.store = Store(None, cfg.max_rules)
        self.allowed = cfg.may_shunt
        self.policy = {}
        self.lock = threading.Lock()
        self.fail = None  # an exception submit raises

    def submit(self, rule, timeout):
        if self.fail is not None:
            raise self.fail
        with self.lock:
            conn = rule.connection
            policy = self.policy.get(min(conn, conn.reversed())) if conn is not None else None
            verdict = precedence(rule, self.store.situation(rule, policy=policy), self.allowed)
            if verdict.decision is Decision.REFUSE:
                return Outcome(Result.ERROR, verdict.reason, error=Reject.REFUSED, refusal=verdict.refusal)
            if verdict.decision is Decision.EXISTS:
                return Outcome(Result.EXISTS, verdict.reason)
            added = self.store.add(rule)
            if added is Added.EXISTS:
                return Outcome(Result.EXISTS, "the same rule is active")
            if added is Added.DUPLICATE:
                return Outcome(Result.ERROR, f"id {rule.id} names another active rule", error=Reject.DUPLICATE)
            if added is Added.FULL:
                return Outcome(Result.ERROR, "full: ids.max_rules rules are active", error=Reject.FULL)
            return Outcome(Result.ADDED, pending=verdict.reason if verdict.decision is Decision.WAIT else None)

    def remove(self, source, rule_id):
        with self.lock:
            ended = self.store.remove(source, rule_id, time.time(), lambda r: Counts(3, 4500))
        if ended is None:
            return Outcome(Result.ERROR, f"no rule {rule_id}", error=Reject.NOT_FOUND)
        expired = ended.why.startswith("expired")
        view = RuleView(ended.rule, State.EXPIRED if expired else State.REMOVED, packets=ended.counts.packets,
                        bytes=ended.counts.bytes)
        return Outcome(Result.EXPIRED if expired else Result.REMOVED, view=view)

    def rules(self, source, kind, address, after, limit):
        with self.lock:
            rules, nxt = self.store.page(source, kind, address, after, limit)
        return Page([RuleView(r, State.ACTIVE) for r in rules], nxt)

    def rule(self, source, rule_id):
        with self.lock:
            r = self.store.get(source, rule_id)
        return None if r is None else RuleView(r, State.ACTIVE, packets=0, bytes=0)


def write_tokens(folder):
    """A token file (mode 0600) naming three clients, zeek, scipass and operator (an admin's); its path."""
    path = folder / "tokens"
    path.write_text(f"# the IDS clients\nzeek {TOKEN}\nscipass {OTHER}\noperator {ADMIN} admin\n")
    os.chmod(path, 0o600)
    return str(path)


def ids_config(token_file, **kw):
    return IdsConfig(listen_port=0, token_file=token_file,
                     may_shunt=MayShunt(prefixes=(ipaddress.ip_network("10.0.0.0/24"),
                                                  ipaddress.ip_network("fd00::/64"))), **kw)


def make_api(token_file, request_seconds=5.0, preauth_seconds=PREAUTH_SECONDS, idle_seconds=IDLE_SECONDS, **kw):
    cfg = ids_config(token_file, **kw)
    backend = FakeBackend(cfg)
    counted = []
    api = IdsApi(cfg, backend, count=counted.append, request_seconds=request_seconds,
                 preauth_seconds=preauth_seconds, idle_seconds=idle_seconds)
    api.start()
    return api, backend, counted


def call(api, method, path, body=None, token=TOKEN, raw=None, headers=None):
    conn = http.client.HTTPConnection(*api.address, timeout=5)
    try:
        hdrs = dict(headers or {})
        if token is not None:
            hdrs["Authorization"] = f"Bearer {token}"
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()
