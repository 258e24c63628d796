"""IDS rules: parsing kind by kind, the bad-input list of issue 28, and the precedence rule."""
import ipaddress
import math

import pytest

from nfshunt.config.ids import IdsConfig, MayShunt
from nfshunt.ids.rules import (
    DOTTED_QUAD,
    SCIPASS_FIELDS,
    Decision,
    Kind,
    Refusal,
    RuleError,
    Situation,
    parse,
    parse_scipass,
    precedence,
    scipass_id,
    scipass_json,
    serves,
)
from nfshunt.records.model import TCP, UDP, Action, FlowTuple

CFG = IdsConfig(token_file="/unused")
NOW = 1_700_000_000.0
CONN = {"protocol": "tcp", "src": "10.0.0.1", "sport": 40000, "dst": "10.0.0.2", "dport": 5201}
ALLOWED = MayShunt(prefixes=(ipaddress.ip_network("10.0.0.0/24"),), ports=((5201, 5201), (50000, 51000)))


def body(**kw):
    out = {"id": "7", "action": "shunt", "connection": dict(CONN), "expire": 60}
    out.update(kw)
    return {k: v for k, v in out.items() if v is not None}


def test_connection_shunt_parsed():
    rule = parse(body(priority=5, idle_timeout=10, expire=59.2), "ids:zeek", NOW, CFG)
    assert rule.kind is Kind.SHUNT and rule.source == "ids:zeek" and rule.id == "7"
    assert rule.connection == FlowTuple(4, TCP, "10.0.0.1", "10.0.0.2", 40000, 5201)
    assert (rule.priority, rule.expire, rule.idle_timeout, rule.expires) == (5, 60, 10, NOW + 60)
    assert rule.address is None


def test_connection_block_ipv6_canonical():
    conn = {"protocol": "udp", "src": "FD00:0::1", "sport": 1, "dst": "fd00::2", "dport": 65535}
    rule = parse(body(action="block", connection=conn), "ids:zeek", NOW, CFG)
    assert rule.kind is Kind.BLOCK
    assert rule.connection == FlowTuple(6, UDP, "fd00::1", "fd00::2", 1, 65535)


def test_address_block_and_whitelist():
    rule = parse(body(action="block", connection=None, address="192.0.2.0/24"), "ids:z", NOW, CFG)
    assert rule.kind is Kind.BLOCK_ADDRESS and rule.address == ipaddress.ip_network("192.0.2.0/24")
    rule = parse(body(action="whitelist", connection=None, address="2001:db8::5"), "ids:z", NOW, CFG)
    assert rule.kind is Kind.WHITELIST and rule.address == ipaddress.ip_network("2001:db8::5/128")


def test_same_target_either_direction():
    a = parse(body(), "ids:z", NOW, CFG)
    rev = {"protocol": "tcp", "src": "10.0.0.2", "sport": 5201, "dst": "10.0.0.1", "dport": 40000}
    b = parse(body(id="8", connection=rev), "ids:z", NOW, CFG)
    assert a.target == b.target
    assert parse(body(action="block"), "ids:z", NOW, CFG).target != a.target


@pytest.mark.parametrize("raw,field,problem", [
    ([1], "", "expected an object"),
    (body(colour="red"), "colour", "unknown field"),
    (body(connection={**CONN, "tpid": 3}), "connection.tpid", "unknown field"),  # (vlan, zone: test_trunk_ids)
    (body(id=None), "id", "required"),
    (body(expire=None), "expire", "required"),
    (body(id=7), "id", "not 1-128"),
    (body(id="a/b"), "id", "not 1-128"),
    (body(id="x" * 129), "id", "not 1-128"),
    (body(action="allow"), "action", "not one of"),
    (body(address="10.0.0.0/24"), "connection", "either"),
    (body(connection=None), "connection", "either"),
    (body(connection=None, address="10.0.0.0/24"), "address", "a shunt is of one connection"),
    (body(action="whitelist"), "connection", "whitelist is of an address"),
    (body(connection={**CONN, "protocol": "icmp"}), "connection.protocol", "not one of"),
    (body(connection={**CONN, "sport": "40000"}), "connection.sport", "expected an integer"),
    (body(connection={**CONN, "sport": True}), "connection.sport", "expected an integer"),
    (body(connection={**CONN, "dport": 0}), "connection.dport", "outside 1-65535"),
    (body(connection={**CONN, "dport": 65536}), "connection.dport", "outside 1-65535"),
    (body(connection={**CONN, "src": "10.0.0.256"}), "connection.src", "not an IPv4 or IPv6"),
    (body(connection={**CONN, "src": "10.0.0.0/24"}), "connection.src", "not an IPv4 or IPv6"),
    (body(connection={**CONN, "dst": "fd00::2"}), "connection.dst", "not IPv4"),
    (body(connection={**CONN, "dst": "10.0.0.1"}), "connection.dst", "same address"),
    (body(connection={k: v for k, v in CONN.items() if k != "dport"}), "connection.dport", "required"),
    (body(expire=0), "expire", "outside"),
    (body(expire=-1), "expire", "outside"),
    (body(expire=10**9), "expire", "outside"),
    (body(expire="60"), "expire", "expected a number"),
    (body(idle_timeout=0), "idle_timeout", "outside"),
    (body(idle_timeout=70000), "idle_timeout", "outside"),
    (body(priority=1.5), "priority", "expected an integer"),
    (body(priority=10**7), "priority", "outside"),
    (body(action="block", connection=None, address="10.0.0.0/8"), "address", "wider than /16"),
    (body(action="block", connection=None, address="2001:db8::/32"), "address", "wider than /48"),
    (body(action="block", connection=None, address="10.0.0.1/24"), "address", "host bits"),
    (body(action="block", connection=None, address=5), "address", "expected an address"),
])
def test_bad_input_names_the_field(raw, field, problem):
    with pytest.raises(RuleError) as info:
        parse(raw, "ids:z", NOW, CFG)
    assert info.value.field == field
    assert problem in info.value.problem


SCOPED = ["fe80::1%1", "::1%x", "fd00::1%eth0"]


@pytest.mark.parametrize("text", SCOPED)
@pytest.mark.parametrize("field", ["src", "dst"])
def test_a_connection_end_with_an_ipv6_scope_id_is_refused_naming_the_field(field, text):
    conn = {**CONN, "src": "fd00::1", "dst": "fd00::2", field: text}
    with pytest.raises(RuleError) as info:
        parse(body(connection=conn), "ids:z", NOW, CFG)
    assert info.value.field == f"connection.{field}" and "scope id" in info.value.problem


@pytest.mark.parametrize("text", ["fe80::%eth0/64", "fd00::1%1", "fd00::%x/48"])
@pytest.mark.parametrize("action", ["block", "whitelist"])
def test_an_address_rule_with_an_ipv6_scope_id_is_refused(action, text):
    with pytest.raises(RuleError) as info:
        parse(body(action=action, connection=None, address=text), "ids:z", NOW, CFG)
    assert info.value.field == "address" and "scope id" in info.value.problem


@pytest.mark.parametrize("field,text", [("nw_src", "fd00::1%x/128"), ("nw_dst", "fd00::2%eth0"),
                                        ("nw_src", "fe80::1%1")])
def test_a_scipass_end_with_an_ipv6_scope_id_is_refused(field, text):
    with pytest.raises(RuleError) as info:
        parse_scipass({**SCIPASS, "nw_src": "fd00::1", "nw_dst": "fd00::2", field: text}, True, "ids:sp", NOW, CFG)
    assert info.value.field == field and "scope id" in info.value.problem


def test_prefix_limit_from_config():
    cfg = IdsConfig(token_file="/unused", max_prefix={4: 8, 6: 32})
    assert parse(body(action="block", connection=None, address="10.0.0.0/8"), "ids:z", NOW, cfg).address.prefixlen == 8


SCIPASS = {"nw_src": "10.0.0.1/32", "nw_dst": "10.0.0.2/32", "tp_src": "1470", "tp_dst": "25"}


def test_scipass_bodies():
    good = parse_scipass({**SCIPASS, "idle_timeout": "90", "priority": "3"}, True, "ids:sp", NOW, CFG)
    assert good.kind is Kind.SHUNT and good.connection == FlowTuple(4, TCP, "10.0.0.1", "10.0.0.2", 1470, 25)
    assert (good.idle_timeout, good.priority, good.expire) == (90, 3, CFG.default_expire)
    bad = parse_scipass({**SCIPASS, "hard_timeout": 30, "nw_proto": "udp"}, False, "ids:sp", NOW, CFG)
    assert bad.kind is Kind.BLOCK and bad.expire == 30 and bad.connection.proto == UDP
    assert good.id == scipass_id(Kind.SHUNT, good.connection) != bad.id
    # The same flow sent the other way round is the same rule.
    back = {"nw_src": "10.0.0.2/32", "nw_dst": "10.0.0.1", "tp_src": 25, "tp_dst": 1470}
    assert parse_scipass(back, True, "ids:sp", NOW, CFG).id == good.id
    v6 = parse_scipass({**SCIPASS, "nw_src": "fd00::1/128", "nw_dst": "fd00::2"}, True, "ids:sp", NOW, CFG)
    assert v6.connection.family == 6
    listed = scipass_json(good)
    assert listed["nw_src"] == "10.0.0.1/32" and listed["tp_dst"] == "25" and listed["idle_timeout"] == "90"


@pytest.mark.parametrize("raw,field,problem", [
    ({**SCIPASS, "eval": "__import__('os')"}, "eval", "unknown field"),
    ({**SCIPASS, "nw_src": "10.0.0.0/24"}, "nw_src", "is a prefix"),
    ({**SCIPASS, "nw_dst": "fd00::2/128"}, "nw_dst", "not IPv4"),
    ({**SCIPASS, "tp_src": "0"}, "tp_src", "outside 1-65535"),
    ({**SCIPASS, "tp_dst": "65536"}, "tp_dst", "outside 1-65535"),
    ({**SCIPASS, "tp_dst": "2x"}, "tp_dst", "expected an integer"),
    ({k: v for k, v in SCIPASS.items() if k != "nw_dst"}, "nw_dst", "required"),
])
def test_scipass_bad_input(raw, field, problem):
    with pytest.raises(RuleError) as info:
        parse_scipass(raw, True, "ids:sp", NOW, CFG)
    assert info.value.field == field and problem in info.value.problem


# What a client may put in any field instead of what it takes: each a RuleError (a 400), never another exception.
WRONG_TYPES = [[], {}, True, 1.5, math.nan, "x%y", 10**99, 10**400]
TAKEN = [("expire", 1.5)]  # (seconds as a double: rounded up)
RULE_FIELDS = ["id", "action", "connection", "address", "priority", "expire", "idle_timeout",
               *(f"connection.{name}" for name in ("protocol", "src", "sport", "dst", "dport", "zone", "vlan"))]


def _with(field, value):
    raw = body(action="block", connection=None, address="10.0.0.0/24") if field == "address" else body()
    where, _, name = field.rpartition(".")
    (raw[where] if where else raw)[name] = value
    return raw


@pytest.mark.parametrize("value", WRONG_TYPES, ids=lambda v: f"{type(v).__name__}:{v!r:.10}")
@pytest.mark.parametrize("field", RULE_FIELDS)
def test_a_wrong_type_in_any_field_is_a_rule_error_naming_it(field, value):
    if (field, value) in TAKEN:
        parse(_with(field, value), "ids:z", NOW, CFG)
        return
    with pytest.raises(RuleError) as info:
        parse(_with(field, value), "ids:z", NOW, CFG)
    assert info.value.field == field or info.value.field.startswith(f"{field}.")  # ({} as a connection: its fields)


@pytest.mark.parametrize("value", WRONG_TYPES, ids=lambda v: f"{type(v).__name__}:{v!r:.10}")
@pytest.mark.parametrize("field", SCIPASS_FIELDS)
def test_a_wrong_type_in_any_scipass_field_is_a_rule_error_naming_it(field, value):
    with pytest.raises(RuleError) as info:
        parse_scipass({**SCIPASS, field: value}, True, "ids:sp", NOW, CFG)
    assert info.value.field == field


# --- precedence -----------------------------------------------------------------------------

def rule_of(action="shunt", conn=None, address=None):
    raw = body(action=action, connection=conn if address is None else None, address=address)
    if address is None and conn is None:
        raw["connection"] = dict(CONN)
    return parse(raw, "ids:z", NOW, CFG)


def test_serves_the_server_alone():
    assert serves(ALLOWED, ("10.0.0.2", 5201))
    assert serves(ALLOWED, ("10.0.0.2", 50500))
    assert not serves(ALLOWED, ("10.0.0.2", 22))
    assert not serves(ALLOWED, ("192.0.2.1", 5201))
    assert serves(MayShunt(prefixes=ALLOWED.prefixes), ("10.0.0.2", 22))  # no ports: any
    assert not serves(MayShunt(), ("10.0.0.2", 5201))  # empty: none
    assert not serves(ALLOWED, ("fd00::2", 5201))  # another family


ISSUE_SCOPE = MayShunt(prefixes=(ipaddress.ip_network("10.10.0.0/16"),), ports=((5201, 5201), (50000, 51000)))


def _shunt(src, sport, dst, dport):
    return rule_of(conn={"protocol": "tcp", "src": src, "sport": sport, "dst": dst, "dport": dport})


@pytest.mark.parametrize("named,orig", [
    # issue 36's two: a client inside choosing a source port in the list, to a server outside
    (("10.10.0.5", 50123, "198.51.100.9", 22), ("10.10.0.5", 50123, "198.51.100.9", 22)),
    # a server inside on a port not in the list, from a client outside on a listed port
    (("203.0.113.7", 5201, "10.10.0.5", 22), ("203.0.113.7", 5201, "10.10.0.5", 22)),
    # either named the other way round: the entry's original direction says who the server is
    (("198.51.100.9", 22, "10.10.0.5", 50123), ("10.10.0.5", 50123, "198.51.100.9", 22)),
    (("10.10.0.5", 22, "203.0.113.7", 5201), ("203.0.113.7", 5201, "10.10.0.5", 22)),
])
def test_a_shunt_is_inside_may_shunt_only_by_its_server(named, orig):
    entry = FlowTuple(4, TCP, orig[0], orig[2], orig[1], orig[3])
    verdict = precedence(_shunt(*named), Situation(policy=Action.IGNORE, server=(entry.dst, entry.dport)), ISSUE_SCOPE)
    assert (verdict.decision, verdict.refusal) == (Decision.REFUSE, Refusal.OUTSIDE_MAY_SHUNT)
    assert f"{entry.dst}:{entry.dport}" in verdict.reason


def test_before_its_entry_is_seen_a_shunt_is_judged_on_its_dst_and_keeps_it_as_its_server():
    for named in (("10.10.0.5", 50123, "198.51.100.9", 22), ("203.0.113.7", 5201, "10.10.0.5", 22),
                  ("198.51.100.9", 22, "10.10.0.5", 49000)):
        verdict = precedence(_shunt(*named), Situation(policy=None), ISSUE_SCOPE)
        assert verdict.refusal is Refusal.OUTSIDE_MAY_SHUNT, named
    verdict = precedence(_shunt("198.51.100.9", 22, "10.10.0.5", 50123), Situation(policy=None), ISSUE_SCOPE)
    assert (verdict.decision, verdict.server) == (Decision.WAIT, ("10.10.0.5", 50123))  # (its pin: that server only)
    # named from the server's side, of a known entry: inside, judged on the entry
    verdict = precedence(_shunt("10.10.0.5", 5201, "203.0.113.7", 40000),
                         Situation(policy=Action.IGNORE, server=("10.10.0.5", 5201)), ISSUE_SCOPE)
    assert (verdict.decision, verdict.server) == (Decision.APPLY, ("10.10.0.5", 5201))
    assert _shunt("10.10.0.5", 5201, "203.0.113.7", 40000).to_json().get("server") is None  # set when judged


@pytest.mark.parametrize("situation,decision,refusal", [
    (Situation(policy=Action.IGNORE), Decision.APPLY, None),
    (Situation(policy=None), Decision.WAIT, None),
    (Situation(policy=Action.SHUNT), Decision.EXISTS, None),
    (Situation(policy=Action.BLOCK), Decision.REFUSE, Refusal.BLOCKED),
    (Situation(policy=Action.IGNORE, ids_block="ids:x/3"), Decision.REFUSE, Refusal.BLOCKED),
    (Situation(policy=Action.IGNORE, entry_accepted=False), Decision.REFUSE, Refusal.NOT_ACCEPTED),
    (Situation(policy=Action.IGNORE, pin=Action.BLOCK), Decision.REFUSE, Refusal.OPERATOR_PIN),
    (Situation(policy=Action.BLOCK, pin=Action.SHUNT), Decision.EXISTS, None),  # the pin beats the policy
])
def test_precedence_of_a_shunt(situation, decision, refusal):
    verdict = precedence(rule_of(), situation, ALLOWED)
    assert (verdict.decision, verdict.refusal) == (decision, refusal)
    assert verdict.reason


def test_shunt_outside_may_shunt_refused_and_empty_default_refuses_all():
    verdict = precedence(rule_of(conn={**CONN, "dport": 22}), Situation(policy=Action.IGNORE), ALLOWED)
    assert verdict.refusal is Refusal.OUTSIDE_MAY_SHUNT and "outside ids.may_shunt" in verdict.reason
    verdict = precedence(rule_of(), Situation(policy=Action.IGNORE), MayShunt())
    assert verdict.refusal is Refusal.OUTSIDE_MAY_SHUNT and "empty" in verdict.reason


@pytest.mark.parametrize("situation,decision,refusal", [
    (Situation(policy=Action.SHUNT), Decision.APPLY, None),  # an IDS block beats a policy shunt
    (Situation(policy=None), Decision.APPLY, None),  # always allowed, seen or not
    (Situation(policy=Action.BLOCK), Decision.EXISTS, None),
    (Situation(policy=Action.SHUNT, whitelist="ids:x/w"), Decision.REFUSE, Refusal.WHITELISTED),
    (Situation(policy=Action.IGNORE, pin=Action.SHUNT), Decision.REFUSE, Refusal.OPERATOR_PIN),
    (Situation(policy=Action.IGNORE, pin=Action.BLOCK), Decision.EXISTS, None),
])
def test_precedence_of_a_connection_block(situation, decision, refusal):
    verdict = precedence(rule_of("block"), situation, MayShunt())
    assert (verdict.decision, verdict.refusal) == (decision, refusal)


def test_precedence_of_address_rules():
    block = rule_of("block", address="192.0.2.0/24")
    assert precedence(block, Situation(), MayShunt()).decision is Decision.APPLY
    verdict = precedence(block, Situation(whitelist="ids:x/w"), MayShunt())
    assert verdict.refusal is Refusal.WHITELISTED and "ids:x/w" in verdict.reason
    assert precedence(rule_of("whitelist", address="192.0.2.5"), Situation(), MayShunt()).decision is Decision.APPLY


def test_a_dotted_quad_is_an_address_written_as_ipaddress_writes_it():
    """DOTTED_QUAD spares _host ipaddress's parse: each text it takes must be one."""
    octets = [str(i) for i in range(300)] + ["00", "01", "007", "010", "0256", "+1", "-1", " 1", "1 ", "1\n", "", "a",
                                             "0x1", "\u0661"]
    taken = 0
    for octet in octets:
        for text in (f"{octet}.1.2.3", f"1.{octet}.2.3", f"1.2.{octet}.3", f"1.2.3.{octet}", octet,
                     f"1.2.{octet}", f"1.2.3.4.{octet}"):
            if DOTTED_QUAD.fullmatch(text):
                taken += 1
                assert str(ipaddress.ip_address(text)) == text
    assert taken == 4 * 256  # x.1.2.3 and its kin, for every octet 0-255 written plainly


@pytest.mark.parametrize("text", ["010.1.2.3", "1.2.3.256", "1.2.3", "1.2.3.4 ", "1.2.3.4/32", "::ffff:1.2.3.4",
                                  "1.2.3.\u0664"])
def test_an_address_not_a_dotted_quad_is_judged_by_ipaddress(text):
    conn = {"protocol": "tcp", "src": text, "sport": 1, "dst": "10.0.0.9", "dport": 2}
    try:
        expected = str(ipaddress.ip_address(text))
    except ValueError:
        with pytest.raises(RuleError, match="connection.src"):
            parse({"id": "1", "action": "shunt", "connection": conn, "expire": 9}, "ids:x", NOW, CFG)
        return
    rule = parse({"id": "1", "action": "shunt", "connection": {**conn, "dst": "::9"}, "expire": 9}, "ids:x", NOW, CFG)
    assert rule.connection is not None and ipaddress.ip_address(rule.connection.src) == ipaddress.ip_address(expected)
