"""The frames between the controller and the IDS API's process: plain, versioned, bounded.

A frame is a 5-byte head, the format's version (1) and the payload's length (big-endian,
32 bits), then the payload: one JSON object in UTF-8, its "op" naming what it is. No
pickle: the API's process faces the network (HTTP, TLS, tokens from anyone) and runs as an
unprivileged user (confine.py); what it sends is read by the controller as a request from
it, never as a decision. The controller reads at most MAX_REQUEST bytes of a child's
frame, and checks every field (`request_of`): a frame that is not one ends that child (it is started
again, and the frame counted: process.py). A rule comes as the API parsed it and is
checked again here, field by field, as the state file's are (store.from_json), its time
the controller's own; it carries no conntrack entry: the controller looks that up itself.

  child -> controller                             controller -> child
  {"op": "submit", "seq", "rule", "timeout"}      {"op": "setup", "config", "log_level",
  {"op": "remove", "seq", "source", "id"}           "request_seconds", "tokens"}
  {"op": "rules", "seq", "source", "kind",        {"op": "answer", "seq", "done", "value"}
     "address", "after", "limit"}
  {"op": "rule", "seq", "source", "id"}
  {"op": "tokens", "seq"}   (the token file changed: read it again)
  {"op": "count", "reason"}, {"op": "log", "name", "level", "message", "exc"},
  {"op": "serving", "error"}
"""
from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import socket
import struct
import threading
from typing import Any

from nfshunt.config.ids import IdsConfig, IdsTLS, MayShunt
from nfshunt.kernel import held
from nfshunt.records.model import ScopeIdError, parse_network

from .calls import PAGE_MAX, Outcome, Page, Reject, Result, RuleView, State
from .rules import RULE_ID, Kind, Network, Refusal, Rule, RuleError
from .store import from_json
from .tokens import CLIENT_NAME, Signature, Token

VERSION = 1
HEAD = struct.Struct("!BI")  # version, payload length
MAX_REQUEST = 64 * 1024  # a child's frame: a rule is ~400 bytes, a log record's text is cut at LOG_TEXT
MAX_ANSWER = 16 * 1024 * 1024  # the controller's: the config and tokens, or a page of views (~0.5 MB)
LOG_TEXT = 8192
MAX_TIMEOUT = 60.0  # seconds an add may ask to be waited for (ids.answer_timeout's bound)
AFTER_END = 1 << 62  # a listing's places (?after=) are below it: an integer any JSON reader keeps exact


class FrameError(ValueError):
    """What was read is not a frame of this format, or not a request the child may make."""


class Channel:
    """Frames over a connected stream socket, sent from any thread. limit: the largest
    payload it takes."""

    def __init__(self, sock: socket.socket, limit: int):
        self.sock = sock
        self.limit = limit
        self._reader = sock.makefile("rb")
        self._send_lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message, separators=(",", ":")).encode()
        frame = HEAD.pack(VERSION, len(data)) + data
        with self._send_lock:  # (an answer, from the event loop: the interpreter's lock kept if it can be)
            held.sendall(self.sock, frame)

    def receive(self) -> dict[str, Any] | None:
        """The next message; None at the peer's end (EOF). FrameError: not a frame."""
        head = self._reader.read(HEAD.size)
        if len(head) < HEAD.size:
            return None
        version, length = HEAD.unpack(head)
        if version != VERSION:
            raise FrameError(f"a frame of format version {version} (this is {VERSION})")
        if length > self.limit:
            raise FrameError(f"a frame of {length} bytes (at most {self.limit})")
        data = self._reader.read(length)
        if len(data) < length:
            return None
        try:
            # The child's: bounded by the frame's size, whose nesting and digits Python's own
            # limits refuse (RecursionError, ValueError); a key it repeats is taken once, and
            # each value is checked as any other (jsonfile's duplicate-key hook cost 3x json.loads).
            message = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise FrameError(f"not a JSON frame: {str(exc)[:200]}") from None
        if not isinstance(message, dict) or not isinstance(message.get("op"), str):
            raise FrameError("a frame that is not an object with an op")
        return message

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # (a send waiting on it fails now)
        except OSError:
            pass
        self._reader.close()
        with self._send_lock:  # not between a send's read of the descriptor and its write to it
            self.sock.close()


# --- what the controller sends (trusted by the child) ------------------------------------------

def config_json(cfg: IdsConfig) -> dict[str, Any]:
    out = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    out["tls"] = None if cfg.tls is None else dataclasses.asdict(cfg.tls)
    out["may_shunt"] = {"prefixes": [str(n) for n in cfg.may_shunt.prefixes],
                        "ports": [list(r) for r in cfg.may_shunt.ports]}
    out["max_prefix"] = {str(k): v for k, v in cfg.max_prefix.items()}
    return out


def config_of(raw: dict[str, Any]) -> IdsConfig:
    raw = dict(raw)
    raw["tls"] = None if raw["tls"] is None else IdsTLS(**raw["tls"])
    raw["may_shunt"] = MayShunt(tuple(ipaddress.ip_network(n) for n in raw["may_shunt"]["prefixes"]),
                                tuple((lo, hi) for lo, hi in raw["may_shunt"]["ports"]))
    raw["max_prefix"] = {int(k): v for k, v in raw["max_prefix"].items()}
    return IdsConfig(**raw)


def tokens_json(seen: Signature, tokens: list[Token]) -> dict[str, Any]:
    return {"signature": None if seen is None else list(seen),
            "tokens": [{"client": t.client, "token": t.secret.decode("utf-8", "surrogateescape"), "admin": t.admin}
                       for t in tokens]}


def tokens_of(raw: dict[str, Any]) -> tuple[Signature, list[Token]]:
    sig = raw["signature"]
    return (None if sig is None else (sig[0], sig[1], sig[2], sig[3]),
            [Token(t["client"], t["token"].encode("utf-8", "surrogateescape"), t["admin"]) for t in raw["tokens"]])


def view_json(v: RuleView) -> dict[str, Any]:
    return {"rule": v.rule.to_json(), "state": v.state.value, "waiting_for": v.waiting_for, "packets": v.packets,
            "bytes": v.bytes, "flows_idle_timeout": v.flows_idle_timeout}


def view_of(raw: dict[str, Any]) -> RuleView:
    return RuleView(from_json(raw["rule"]), State(raw["state"]), raw["waiting_for"], raw["packets"], raw["bytes"],
                    raw["flows_idle_timeout"])


def page_json(page: Page) -> dict[str, Any]:
    return {"views": [view_json(v) for v in page.views], "next": page.next}


def page_of(raw: dict[str, Any]) -> Page:
    return Page([view_of(v) for v in raw["views"]], raw["next"])


def outcome_json(o: Outcome) -> dict[str, Any]:
    return {"result": o.result.value, "reason": o.reason, "pending": o.pending,
            "error": None if o.error is None else o.error.value,
            "refusal": None if o.refusal is None else o.refusal.value,
            "view": None if o.view is None else view_json(o.view)}


def outcome_of(raw: dict[str, Any]) -> Outcome:
    return Outcome(Result(raw["result"]), raw["reason"], raw["pending"],
                   None if raw["error"] is None else Reject(raw["error"]),
                   None if raw["refusal"] is None else Refusal(raw["refusal"]),
                   None if raw["view"] is None else view_of(raw["view"]))


# --- what the child asks (checked by the controller) -------------------------------------------

def _fields(message: dict[str, Any], names: tuple[str, ...]) -> None:
    if set(message) != {"op", *names}:
        extra, missing = sorted(set(message) - {"op", *names}), sorted({*names} - set(message))
        raise FrameError(f"{message['op']}: " + (f"unknown field {extra[0]!r:.40}" if extra
                                                  else f"missing field {missing[0]!r}"))


def _seq(message: dict[str, Any]) -> int:
    seq = message["seq"]
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 < seq < 1 << 62:
        raise FrameError(f"{message['op']}: seq is not a positive integer")
    return seq


def source_of(value: Any) -> str:
    """A requester: "ids:<client>", as the API names an authenticated client."""
    if not isinstance(value, str) or not value.startswith("ids:") or not CLIENT_NAME.fullmatch(value[4:]):
        raise FrameError(f"{value!r:.60} is not a requester (ids:<client>)")
    return value


def _rule_id(value: Any) -> str:
    if not isinstance(value, str) or not RULE_ID.fullmatch(value):
        raise FrameError(f"{value!r:.60} is not a rule id")
    return value


def rule_of(raw: Any, now: float, cfg: IdsConfig) -> Rule:
    """A rule the child parsed, checked again as the state file's are: its requester, its
    fields and bounds, its address no wider than ids.max_prefix; no server (precedence
    sets it) and the controller's time as its creation (the child's clock counts for nothing)."""
    if not isinstance(raw, dict):
        raise FrameError("submit: rule is not an object")
    if "server" in raw:
        raise FrameError("submit: a rule's server is the controller's to judge")
    try:
        rule = from_json(raw, created_at=now)
    except RuleError as exc:
        raise FrameError(f"submit: rule: {exc}") from None
    source_of(rule.source)
    if rule.address is not None and rule.address.prefixlen < cfg.max_prefix[rule.address.version]:
        raise FrameError(f"submit: rule: {rule.address} is wider than ids.max_prefix")
    return rule


def request_of(message: dict[str, Any], now: float, cfg: IdsConfig) -> tuple[str, int, tuple[Any, ...]]:
    """A call the child asks for, checked: (op, seq, its arguments). FrameError otherwise."""
    op = message["op"]
    if op == "submit":
        _fields(message, ("seq", "rule", "timeout"))
        timeout = message["timeout"]
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT:
            raise FrameError("submit: timeout is not a number of seconds in (0, 60]")
        return op, _seq(message), (rule_of(message["rule"], now, cfg), float(timeout))
    if op in ("remove", "rule"):
        _fields(message, ("seq", "source", "id"))
        return op, _seq(message), (source_of(message["source"]), _rule_id(message["id"]))
    if op == "rules":
        _fields(message, ("seq", "source", "kind", "address", "after", "limit"))
        try:
            listing = listing_of(message["source"], message["kind"], message["address"], message["after"],
                                 message["limit"])
        except FrameError as exc:
            raise FrameError(f"rules: {exc}") from None
        return op, _seq(message), listing
    if op == "tokens":
        _fields(message, ("seq",))
        return op, _seq(message), ()
    raise FrameError(f"an unknown op {op!r:.40}")


def listing_of(source: Any, kind: Any, address: Any, after: Any,
               limit: Any) -> tuple[str | None, Kind | None, Network | None, int, int]:
    """A listing's filters and page, checked: a rules frame's here, and the API's query
    before it relays one, so that no listing it takes is a forged frame here (which would
    end its process). FrameError naming the field otherwise."""
    if source is not None:
        try:
            source_of(source)
        except FrameError as exc:
            raise FrameError(f"source: {exc}") from None
    if isinstance(after, bool) or not isinstance(after, int) or not 0 <= after < AFTER_END:
        raise FrameError(f"after: {after!r:.40} is not a place in the listing (0-{AFTER_END - 1})")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= PAGE_MAX:
        raise FrameError(f"limit: {limit!r:.40} is not 1-{PAGE_MAX}")
    return source, _kind(kind), _network(address), after, limit


def _kind(value: Any) -> Kind | None:
    if value is None:
        return None
    try:
        return Kind(value)
    except ValueError:
        raise FrameError(f"kind: {value!r:.40} is not one of " + ", ".join(Kind)) from None


def _network(value: Any) -> Network | None:
    if value is None:
        return None
    try:
        if isinstance(value, str):
            return parse_network(value, strict=False)
    except ScopeIdError as exc:  # (the API's filter and the controller refuse it alike)
        raise FrameError(f"address: {exc}") from None
    except ValueError:
        pass
    raise FrameError(f"address: {value!r:.60} is not an address or prefix")


def count_of(message: dict[str, Any]) -> Reject:
    _fields(message, ("reason",))
    try:
        return Reject(message["reason"])
    except ValueError:
        raise FrameError(f"count: {message['reason']!r:.40} is not a refusal") from None


def log_of(message: dict[str, Any]) -> logging.LogRecord:
    """A log record of the child's, to be logged by the controller under its name (the
    "nfshunt" logger's family only), its text cut at LOG_TEXT."""
    _fields(message, ("name", "level", "message", "exc"))
    name, level, text, exc = message["name"], message["level"], message["message"], message["exc"]
    if not isinstance(name, str) or not (name == "nfshunt" or name.startswith("nfshunt.")) or len(name) > 100:
        raise FrameError("log: name is not one of nfshunt's loggers")
    if level not in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL):
        raise FrameError("log: level is not a logging level")
    if not isinstance(text, str) or not (exc is None or isinstance(exc, str)):
        raise FrameError("log: message or exc is not text")
    return logging.makeLogRecord({"name": name, "levelno": level, "levelname": logging.getLevelName(level),
                                  "msg": "ids api: " + text[:LOG_TEXT],
                                  "exc_text": None if exc is None else exc[:LOG_TEXT]})


def serving_of(message: dict[str, Any]) -> str | None:
    _fields(message, ("error",))
    error = message["error"]
    if error is not None and not isinstance(error, str):
        raise FrameError("serving: error is not text")
    return None if error is None else error[:LOG_TEXT]

