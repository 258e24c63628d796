"""IDS rules: what an intrusion detection system may ask of NFShunt, checked and ranked.

Pure (no I/O): the typed records, the parsing of request bodies (the API's own and
SciPass's), and the one precedence rule (`precedence`) that says whether a rule may take
effect. The rules kept, their expiry and their state file are ids_store.py's.

Precedence, written once here and nowhere else:
  1. an operator's pin beats everything;
  2. a block (the policy's or an IDS's) beats a shunt;
  3. an IDS may shunt only a connection the firewall accepted (a live conntrack entry the
     policy did not decide "block") and only inside `ids.may_shunt`: its server (`server`:
     the destination address and port of the entry's original direction, the end that
     listened; the rule's own dst and dport until its entry is seen) inside one of the
     prefixes, on one of the ports. The client's address and port count for nothing;
  4. an IDS block is always allowed, except of an address its own requester whitelisted
     (WHITELIST rules exempt their addresses from their requester's blocks; with
     ids.shared_whitelists from every requester's: Store.whitelisting);
  5. between an IDS's rules of one connection (`holder`), a block before a shunt, then
     the higher `priority` (NetControl's meaning: higher wins), then the newer: the pair
     built while that rule holds takes its action and idle timeout. Every such rule
     still ends at its own expiry; the connection's pin passes to the next holder.
A rule that a later policy change contradicts is judged again by the same function.
"""
from __future__ import annotations

import enum
import hashlib
import ipaddress
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable

from nfshunt.config.ids import MAX_IDS_EXPIRE, IdsConfig, MayShunt
from nfshunt.config.validate import check_names, parsed, type_name
from nfshunt.records.model import (
    TCP,
    UDP,
    Action,
    FlowTuple,
    Network,
    canonical_address,
    parse_address,
    parse_network,
)

PROTOCOLS = {"tcp": TCP, "udp": UDP}
PROTOCOL_NAMES = {v: k for k, v in PROTOCOLS.items()}
# URL-safe (a rule is named in /v1/rules/<id>), and what Zeek's ids look like ("12", "worker-1:12").
RULE_ID = re.compile(r"[A-Za-z0-9._:@~-]{1,128}", re.ASCII)
# An IPv4 address as ipaddress and inet_ntop write it (no leading zeros): always an address
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
DOTTED_QUAD = re.compile(rf"(?:{_OCTET}\.){{3}}{_OCTET}", re.ASCII)
MAX_PRIORITY = 1 << 20  # NetControl's priorities are small (default 0, whitelists +5); either sign
MAX_IDLE_TIMEOUT = 65535  # an OpenFlow idle timeout is 16 bits


class Kind(enum.StrEnum):
    SHUNT = "shunt"  # a connection (both directions) bypasses the firewall
    BLOCK = "block"  # a connection (both directions) is dropped in the switch
    BLOCK_ADDRESS = "block_address"  # all traffic to or from an address or prefix is dropped in the switch
    WHITELIST = "whitelist"  # an address or prefix exempt from IDS blocks


CONNECTION_KINDS = frozenset({Kind.SHUNT, Kind.BLOCK})


def pair_key(t: FlowTuple) -> FlowTuple:
    """A connection named direction-blind (either direction's tuple gives the same key)."""
    return min(t, t.reversed())


class RuleError(ValueError):
    """A request the API refuses as malformed (a 400): field names where, problem what."""

    def __init__(self, field: str, problem: str):
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}" if field else problem)


@dataclass(frozen=True)
class Rule:
    source: str  # the requester: "ids:<client>"
    id: str  # the requester's name for it, unique per requester
    kind: Kind
    priority: int
    expire: int  # hard: seconds after `created`
    created: float  # wall-clock seconds (time.time()): expiry holds across restarts
    connection: FlowTuple | None = None  # SHUNT and BLOCK: one direction as given (both are meant)
    address: Network | None = None  # BLOCK_ADDRESS and WHITELIST
    idle_timeout: int | None = None
    # A shunt's server as precedence judged it (`serves`): the (address, port) the entry's
    # original direction goes to; its pin applies only to an entry going there.
    server: tuple[str, int] | None = None
    # The VLAN id the requester named the connection by (the controller resolves it to the
    # connection's zone: ids/backend); echoed in views. None: named by zone (or untagged).
    vlan: int | None = None

    @property
    def key(self) -> tuple[str, str]:
        return self.source, self.id

    @property
    def expires(self) -> float:
        return self.created + self.expire

    @property
    def action(self) -> Action:
        """What a connection rule asks of its pair: SHUNT or BLOCK."""
        return Action.SHUNT if self.kind is Kind.SHUNT else Action.BLOCK

    @property
    def target(self) -> tuple[Any, ...]:
        """What the rule acts on, direction-blind: two rules with the same target are the same rule."""
        if self.connection is not None:
            return self.kind, pair_key(self.connection)
        return self.kind, self.address

    def networks(self) -> tuple[Network, ...]:
        """The addresses it concerns (a connection's two hosts)."""
        if self.connection is not None:
            return tuple(ipaddress.ip_network(a) for a in (self.connection.src, self.connection.dst))
        assert self.address is not None
        return (self.address,)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "id": self.id, "kind": self.kind.value,
                               "priority": self.priority, "expire": self.expire, "created": self.created,
                               "expires": self.expires}
        if self.idle_timeout is not None:
            out["idle_timeout"] = self.idle_timeout
        if self.server is not None:
            out["server"] = {"address": self.server[0], "port": self.server[1]}
        if self.connection is not None:
            c = self.connection
            out["connection"] = {"protocol": PROTOCOL_NAMES[c.proto], "src": c.src, "sport": c.sport,
                                 "dst": c.dst, "dport": c.dport,
                                 **({"zone": c.zone} if c.zone else {}),
                                 **({"vlan": self.vlan} if self.vlan is not None else {})}
        else:
            out["address"] = str(self.address)
        return out


# --- parsing ----------------------------------------------------------------------------------

def _fields(where: str, body: Any, allowed: Iterable[str], required: Iterable[str]) -> dict[str, Any]:
    return check_names(where, body, allowed, required, RuleError, "field")


def _int(field: str, value: Any, lo: int, hi: int, text: bool = False) -> int:
    """An integer in lo..hi (text: also its decimal digits in a string, as SciPass sends)."""
    if text and isinstance(value, str) and re.fullmatch(r"-?[0-9]{1,10}", value, re.ASCII):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RuleError(field, f"expected an integer, got {type_name(value)} {value!r:.40}")
    if not lo <= value <= hi:
        raise RuleError(field, f"{value} is outside {lo}-{hi}")
    return value


def _expire(field: str, value: Any) -> int:
    """Hard expiry in seconds, > 0; a fraction rounds up (Zeek sends intervals as doubles)."""
    # (isfinite only of a float: of an int past a double's range it raises OverflowError)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            isinstance(value, float) and not math.isfinite(value):
        raise RuleError(field, f"expected a number of seconds, got {type_name(value)} {value!r:.40}")
    if not 0 < value <= MAX_IDS_EXPIRE:
        raise RuleError(field, f"{value} is outside (0, {MAX_IDS_EXPIRE}] seconds")
    return math.ceil(value)


def _host(field: str, value: Any, scipass: bool = False) -> str:
    """One address in the listener's text form (SciPass: also "a/32" or "a/128")."""
    if not isinstance(value, str):
        raise RuleError(field, f"expected an address, got {type_name(value)} {value!r:.40}")
    text = value
    if scipass and "/" in value:
        net = parsed(field, parse_network, value, f"{value!r:.60} is not an address or a /32 (/128) of one", RuleError)
        if net.prefixlen != net.max_prefixlen:
            raise RuleError(field, f"{value} is a prefix: a connection's ends are single hosts (/{net.max_prefixlen})")
        text = str(net.network_address)
    if not DOTTED_QUAD.fullmatch(text):  # one is an address: ipaddress's parse of it was ~5 us
        parsed(field, parse_address, text, f"{value!r:.60} is not an IPv4 or IPv6 address", RuleError)
    return canonical_address(text)


def _protocol(field: str, value: Any) -> int:
    if not isinstance(value, str) or value not in PROTOCOLS:  # (a list or object is no dict key: TypeError)
        raise RuleError(field, f"{value!r:.40} is not one of {', '.join(PROTOCOLS)}")
    return PROTOCOLS[value]


def _connection(field: str, value: Any, text_numbers: bool = False) -> FlowTuple:
    """A connection (in its conntrack `zone`, if given: 0-65535; a `vlan` is read apart)."""
    body = _fields(field, value, ("protocol", "src", "sport", "dst", "dport", "zone", "vlan"),
                   ("protocol", "src", "sport", "dst", "dport"))
    proto = _protocol(f"{field}.protocol", body["protocol"])
    src = _host(f"{field}.src", body["src"])
    dst = _host(f"{field}.dst", body["dst"])
    t = _tuple(field, proto, src, dst, _int(f"{field}.sport", body["sport"], 1, 65535, text_numbers),
               _int(f"{field}.dport", body["dport"], 1, 65535, text_numbers), ("src", "dst"))
    return t._replace(zone=_int(f"{field}.zone", body["zone"], 0, 65535)) if "zone" in body else t


def connection_vlan(field: str, value: Any) -> int | None:
    """A connection's `vlan` (1-4094), if it names one."""
    if not isinstance(value, dict) or "vlan" not in value:
        return None
    return _int(f"{field}.vlan", value["vlan"], 1, 4094)


def _tuple(field: str, proto: int, src: str, dst: str, sport: int, dport: int, names: tuple[str, str]) -> FlowTuple:
    family = 6 if ":" in src else 4
    if (6 if ":" in dst else 4) != family:
        raise RuleError(f"{field}.{names[1]}" if field else names[1],
                        f"{dst} is not IPv{family} like {names[0]} {src}: one family a connection")
    if src == dst:
        raise RuleError(f"{field}.{names[1]}" if field else names[1], f"the same address as {names[0]}")
    return FlowTuple(family, proto, src, dst, sport, dport)


def prefix_of(field: str, value: Any) -> Network:
    """A rule's `address`: an address or prefix, host bits zero (the API's and the state file's)."""
    if not isinstance(value, str):
        raise RuleError(field, f"expected an address or prefix, got {type_name(value)} {value!r:.40}")
    return parsed(field, parse_network, value,
                  f"{value!r:.60} is not an address or prefix (host bits must be zero)", RuleError)


def _prefix(field: str, value: Any, max_prefix: dict[int, int]) -> Network:
    net = prefix_of(field, value)
    limit = max_prefix[net.version]
    if net.prefixlen < limit:
        raise RuleError(field, f"{net} is wider than /{limit} (ids.max_prefix ipv{net.version})")
    return net


RULE_FIELDS = ("id", "action", "connection", "address", "priority", "expire", "idle_timeout")


def parse(body: Any, source: str, now: float, cfg: IdsConfig) -> Rule:
    """A POST /v1/rules body:
    {"id": "12", "action": "shunt" | "block" | "whitelist",
     "connection": {"protocol": "tcp", "src": a, "sport": n, "dst": b, "dport": m}  (shunt, block;
                    + "vlan": 1-4094 or "zone": 0-65535 for a VLAN trunk's connection)
     or "address": "10.1.2.0/24"  (block, whitelist),
     "expire": seconds, "priority": n (default 0), "idle_timeout": seconds (optional)}."""
    body = _fields("", body, RULE_FIELDS, ("id", "action", "expire"))
    rule_id = body["id"]
    if not isinstance(rule_id, str) or not RULE_ID.fullmatch(rule_id):
        raise RuleError("id", f"{rule_id!r:.60} is not 1-128 of A-Z a-z 0-9 . _ : @ ~ -")
    action = body["action"]
    if action not in ("shunt", "block", "whitelist"):
        raise RuleError("action", f"{action!r:.40} is not one of shunt, block, whitelist")
    has_conn, has_addr = "connection" in body, "address" in body
    if has_conn == has_addr:
        raise RuleError("connection", "give either a connection or an address")
    if action == "shunt" and has_addr:
        raise RuleError("address", "a shunt is of one connection: an address shunt would let every "
                        "connection of a host bypass the firewall")
    if action == "whitelist" and has_conn:
        raise RuleError("connection", "a whitelist is of an address or prefix")
    kind = {("shunt", True): Kind.SHUNT, ("block", True): Kind.BLOCK, ("block", False): Kind.BLOCK_ADDRESS,
            ("whitelist", False): Kind.WHITELIST}[action, has_conn]
    idle = body.get("idle_timeout")
    connection = _connection("connection", body["connection"]) if has_conn else None
    vlan = connection_vlan("connection", body["connection"]) if has_conn else None
    if vlan is not None and "zone" in body["connection"]:
        raise RuleError("connection.zone", "give the connection's vlan or its zone, not both")
    return Rule(source, rule_id, kind, _int("priority", body.get("priority", 0), -MAX_PRIORITY, MAX_PRIORITY),
                _expire("expire", body["expire"]), now, connection=connection,
                address=_prefix("address", body["address"], cfg.max_prefix) if has_addr else None,
                idle_timeout=None if idle is None else _int("idle_timeout", idle, 1, MAX_IDLE_TIMEOUT), vlan=vlan)


SCIPASS_FIELDS = ("nw_src", "nw_dst", "tp_src", "tp_dst", "nw_proto", "idle_timeout", "hard_timeout", "priority")


def parse_scipass(body: Any, good: bool, source: str, now: float, cfg: IdsConfig) -> Rule:
    """A SciPass good_flow (shunt) or bad_flow (block) body: {"nw_src": "a/32", "nw_dst":
    "b/32", "tp_src": "1470", "tp_dst": "25"} (+ "idle_timeout", "priority"; numbers as
    numbers or digit strings). SciPass names no protocol (TCP) nor expiry: "nw_proto"
    ("tcp", "udp") and "hard_timeout" may say them, else TCP and ids.default_expire. The
    id is made from the connection, so the same flow sent twice is the same rule."""
    body = _fields("", body, SCIPASS_FIELDS, ("nw_src", "nw_dst", "tp_src", "tp_dst"))
    proto = _protocol("nw_proto", body.get("nw_proto", "tcp"))
    conn = _tuple("", proto, _host("nw_src", body["nw_src"], scipass=True),
                  _host("nw_dst", body["nw_dst"], scipass=True), _int("tp_src", body["tp_src"], 1, 65535, True),
                  _int("tp_dst", body["tp_dst"], 1, 65535, True), ("nw_src", "nw_dst"))
    idle = body.get("idle_timeout")
    hard = body.get("hard_timeout")
    kind = Kind.SHUNT if good else Kind.BLOCK
    return Rule(source, scipass_id(kind, conn), kind,
                _int("priority", body.get("priority", 0), -MAX_PRIORITY, MAX_PRIORITY, True),
                cfg.default_expire if hard is None else _expire("hard_timeout", _int("hard_timeout", hard, 1,
                                                                                     MAX_IDS_EXPIRE, True)),
                now, connection=conn,
                idle_timeout=None if idle in (None, 0, "0") else _int("idle_timeout", idle, 1, MAX_IDLE_TIMEOUT, True))


def scipass_id(kind: Kind, conn: FlowTuple) -> str:
    """The id a SciPass request's rule gets: the same for the same flow, either direction."""
    digest = hashlib.sha256(repr((kind.value, pair_key(conn))).encode()).hexdigest()
    return f"scipass-{kind.value}-{digest[:16]}"


def scipass_json(rule: Rule) -> dict[str, Any]:
    """A rule as SciPass's get_good_flows / get_bad_flows list it (plus its id and expiry)."""
    c = rule.connection
    assert c is not None
    width = 32 if c.family == 4 else 128
    return {"nw_src": f"{c.src}/{width}", "nw_dst": f"{c.dst}/{width}", "tp_src": str(c.sport),
            "tp_dst": str(c.dport), "nw_proto": PROTOCOL_NAMES[c.proto], "idle_timeout": str(rule.idle_timeout or 0),
            "priority": str(rule.priority), "id": rule.id, "expires": rule.expires}


# --- precedence ---------------------------------------------------------------------------

class Refusal(enum.StrEnum):
    """Which precedence rule refused a request (the module docstring's numbers)."""
    OPERATOR_PIN = "operator_pin"  # 1
    BLOCKED = "blocked"  # 2: a block by the policy or an IDS covers the connection
    NOT_ACCEPTED = "not_accepted"  # 3: no live conntrack entry the firewall accepted
    OUTSIDE_MAY_SHUNT = "outside_may_shunt"  # 3: outside ids.may_shunt
    WHITELISTED = "whitelisted"  # 4: an IDS block of a whitelisted address


class Decision(enum.StrEnum):
    APPLY = "apply"  # put it on the switch
    WAIT = "wait"  # a shunt of a connection not seen yet: kept, applied when its entry is accepted
    EXISTS = "exists"  # what it asks for already holds (the policy or a pin did it)
    REFUSE = "refuse"


@dataclass(frozen=True)
class Situation:
    """What the controller knows of the rule's target when it is judged."""
    # The connection's live conntrack entry as the policy decided it: IGNORE (accepted, left
    # to the firewall), SHUNT, BLOCK; None: no live entry (not seen yet, or gone).
    policy: Action | None = None
    # Its server: the live entry's original destination (address, port); None: no entry known.
    server: tuple[str, int] | None = None
    entry_accepted: bool = True  # False: no mark of ours on the entry, or an action the config lacks
    pin: Action | None = None  # an operator's pin on the connection
    ids_block: str | None = None  # an active IDS block covering it: its "source/id"
    whitelist: str | None = None  # an active whitelist covering one of its addresses: its "source/id"


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    refusal: Refusal | None = None
    reason: str = ""
    server: tuple[str, int] | None = None  # a shunt's: the server it was judged on (Rule.server)


def serves(allowed: MayShunt, server: tuple[str, int]) -> bool:
    """Inside `ids.may_shunt`: the server's address inside one of the prefixes and (ports
    listed) its port inside one of the ranges. Only the server counts: a client's address
    or its port (chosen by the client, any of them) never brings a connection inside."""
    host = ipaddress.ip_address(server[0])
    if not any(host in net for net in allowed.prefixes if host.version == net.version):
        return False
    return not allowed.ports or any(lo <= server[1] <= hi for lo, hi in allowed.ports)


def server_of(orig: FlowTuple) -> tuple[str, int]:
    """A connection's server, from the tuple of its original direction: where it went."""
    return orig.dst, orig.dport


def _endpoint(server: tuple[str, int]) -> str:
    return f"[{server[0]}]:{server[1]}" if ":" in server[0] else f"{server[0]}:{server[1]}"


def holder(rules: Iterable[Rule]) -> Rule | None:
    """Of the IDS rules of one connection, the one its pin follows (rule 5; rules made in
    the same instant: by requester and id, so that a restart picks the same)."""
    return max(rules, key=lambda r: (r.kind is Kind.BLOCK, r.priority, r.created, r.key), default=None)


def precedence(rule: Rule, situation: Situation, allowed: MayShunt) -> Verdict:
    """Whether an IDS rule may take effect now: the one place precedence is decided."""
    s = situation
    if rule.kind is Kind.WHITELIST:
        return Verdict(Decision.APPLY, reason="a whitelist only exempts addresses from IDS blocks")
    if rule.kind in CONNECTION_KINDS and s.pin is not None:
        wanted = rule.action
        if s.pin is wanted:
            return Verdict(Decision.EXISTS, reason=f"an operator's pin already {wanted.value}s it")
        return Verdict(Decision.REFUSE, Refusal.OPERATOR_PIN,
                       f"an operator's pin ({s.pin.value}) beats every other decision")
    if rule.kind in (Kind.BLOCK, Kind.BLOCK_ADDRESS):
        if s.whitelist is not None:
            return Verdict(Decision.REFUSE, Refusal.WHITELISTED,
                           f"whitelisted by {s.whitelist}: exempt from IDS blocks")
        if rule.kind is Kind.BLOCK and s.policy is Action.BLOCK:
            return Verdict(Decision.EXISTS, reason="the policy already blocks it")
        return Verdict(Decision.APPLY, reason="an IDS block is always allowed")
    # A shunt.
    if s.policy is Action.BLOCK:
        return Verdict(Decision.REFUSE, Refusal.BLOCKED, "the policy blocks it: a block beats a shunt")
    if s.ids_block is not None:
        return Verdict(Decision.REFUSE, Refusal.BLOCKED, f"blocked by {s.ids_block}: a block beats a shunt")
    assert rule.connection is not None
    # The server: the entry's original destination; before the entry is seen, the rule's
    # dst (its pin then applies only to an entry going there: pins.py).
    server = s.server or server_of(rule.connection)
    if not serves(allowed, server):
        return Verdict(Decision.REFUSE, Refusal.OUTSIDE_MAY_SHUNT,
                       f"outside ids.may_shunt: the connection's server {_endpoint(server)} (the end it was opened "
                       "to) is not on a listed port of a listed prefix" if allowed.prefixes
                       else "ids.may_shunt is empty: no IDS may shunt")
    if s.policy is Action.SHUNT:
        return Verdict(Decision.EXISTS, reason="the policy already shunts it", server=server)
    if s.policy is None:
        return Verdict(Decision.WAIT, reason="waits for the connection's conntrack entry and its decision",
                       server=server)
    if not s.entry_accepted:
        return Verdict(Decision.REFUSE, Refusal.NOT_ACCEPTED,
                       "the firewall has not accepted the connection for NFShunt (its conntrack entry has no mark "
                       "of ours, or an action the config does not know): an IDS may shunt only what it accepted")
    return Verdict(Decision.APPLY, reason="accepted by the firewall, inside ids.may_shunt", server=server)
