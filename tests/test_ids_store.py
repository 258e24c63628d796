"""The IDS rule store: per requester, capped, hard expiry, the state file across restarts."""
import ipaddress
import json
import os
import stat

import pytest

from nfshunt.config.ids import IdsConfig
from nfshunt.ids import store as store_module
from nfshunt.ids.rules import Kind, parse
from nfshunt.ids.store import Added, Counts, write
from nfshunt.ids.store import Store as _Store
from nfshunt.records.model import Action, FlowTuple

CFG = IdsConfig(token_file="/unused")
NOW = 1_700_000_000.0
CONN = {"protocol": "tcp", "src": "10.0.0.1", "sport": 40000, "dst": "10.0.0.2", "dport": 5201}


def rule(rule_id="1", source="ids:zeek", action="shunt", address=None, expire=60, now=NOW, **conn):
    raw = {"id": rule_id, "action": action, "expire": expire}
    if address is None:
        raw["connection"] = {**CONN, **conn}
    else:
        raw["address"] = address
    return parse(raw, source, now, CFG)


def counts(r):
    return Counts(packets=10, bytes=1500)


class Clock:
    """The store's two clocks, set by the test (both read NOW at first)."""

    def __init__(self) -> None:
        self.wall_at = self.mono_at = NOW

    def wall(self) -> float:
        return self.wall_at

    def mono(self) -> float:
        return self.mono_at


def Store(path, max_rules, clock=None, **kw):  # noqa: N802 (the store, on the test's clock)
    clock = clock or Clock()
    return _Store(path, max_rules, wall=clock.wall, mono=clock.mono, **kw)


def test_add_exists_duplicate_full():
    store = Store(None, max_rules=2)
    assert store.add(rule()) is Added.ADDED
    assert store.add(rule()) is Added.EXISTS  # the same id and target
    assert store.add(rule(sport=1)) is Added.DUPLICATE  # the same id, another target
    assert store.add(rule(source="ids:other")) is Added.ADDED  # ids are per requester
    assert store.add(rule("2")) is Added.FULL
    assert len(store) == 2 and store.dirty
    assert sorted(r.source for r in store.holders(rule())) == ["ids:other", "ids:zeek"]


def test_remove_and_expire_report_counts():
    store = Store(None, max_rules=10)
    store.add(rule("1", expire=10))
    store.add(rule("2", expire=20, sport=2))
    assert store.expire(NOW + 9.9, counts) == []
    [ended] = store.expire(NOW + 10, counts)
    assert ended.rule.id == "1" and ended.why == "expired" and ended.counts == Counts(10, 1500)
    assert ended.to_json()["state"] == "expired" and ended.to_json()["packets"] == 10
    # A DELETE racing the expiry is answered with how it ended.
    assert store.remove("ids:zeek", "1", NOW + 11, counts) is ended
    removed = store.remove("ids:zeek", "2", NOW + 11, lambda r: Counts(1, 2))
    assert removed.why == "removed" and removed.counts == Counts(1, 2) and len(store) == 0
    assert store.remove("ids:zeek", "3", NOW, counts) is None
    assert store.remove("ids:other", "2", NOW, counts) is None  # another requester's id


def test_ended_rules_remembered_within_bound():
    store = Store(None, max_rules=10, remember=2)
    for i in range(3):
        store.add(rule(str(i), sport=i + 1, expire=1))
    store.expire(NOW + 1, counts)
    assert store.ended("ids:zeek", "0") is None and store.ended("ids:zeek", "2") is not None


def test_select_filters():
    store = Store(None, max_rules=10)
    store.add(rule("1"))
    store.add(rule("2", source="ids:b", action="block", sport=9))
    store.add(rule("3", action="block", address="192.0.2.0/24"))
    store.add(rule("4", action="whitelist", address="fd00::/64"))
    assert [r.id for r in store.select(source="ids:b")] == ["2"]
    assert [r.id for r in store.select(kind=Kind.BLOCK_ADDRESS)] == ["3"]
    assert {r.id for r in store.select(address=ipaddress.ip_network("10.0.0.2"))} == {"1", "2"}
    assert [r.id for r in store.select(address=ipaddress.ip_network("192.0.2.77"))] == ["3"]
    assert [r.id for r in store.select(address=ipaddress.ip_network("fd00::9"))] == ["4"]
    assert len(store.select()) == 4


def test_situation_from_ids_blocks_and_whitelists():
    store = Store(None, max_rules=10)
    shunt = rule("s")
    assert store.situation(shunt, policy=Action.IGNORE).ids_block is None
    store.add(rule("b", source="ids:x", action="block", address="10.0.0.0/24"))
    situation = store.situation(shunt, policy=Action.IGNORE, pin=Action.SHUNT)
    assert situation.ids_block == "ids:x/b" and situation.pin is Action.SHUNT
    store.add(rule("w", action="whitelist", address="10.0.0.2"))
    assert store.situation(rule("c", action="block"), policy=Action.SHUNT).whitelist == "ids:zeek/w"
    # ids:zeek's whitelist exempts from ids:zeek's blocks only, unless whitelists are shared
    assert store.situation(rule("c", source="ids:x", action="block"), policy=Action.SHUNT).whitelist is None
    assert store.exempted_by(store.get("ids:zeek", "w")) == []
    store.add(rule("b2", action="block", address="10.0.0.0/30"))
    assert [r.id for r in store.exempted_by(store.get("ids:zeek", "w"))] == ["b2"]
    store.shared_whitelists = True
    assert store.situation(rule("c", source="ids:x", action="block"), policy=Action.SHUNT).whitelist == "ids:zeek/w"
    assert [r.id for r in store.exempted_by(store.get("ids:zeek", "w"))] == ["b", "b2"]
    # A connection block of the reply direction covers the connection too.
    other = Store(None, max_rules=10)
    other.add(rule("r", action="block", src="10.0.0.2", dst="10.0.0.1", sport=5201, dport=40000))
    assert other.blocking(FlowTuple(4, 6, "10.0.0.1", "10.0.0.2", 40000, 5201)).id == "r"


def test_state_file_atomic_0600_and_reloaded_with_expiry(tmp_path):
    path = str(tmp_path / "state" / "ids-rules.json")
    store = Store(path, max_rules=10)
    store.add(rule("short", expire=10))
    store.add(rule("long", expire=100, sport=2))
    store.add(rule("addr", action="block", address="fd00:1::/64", expire=100))
    store.save()
    assert not store.dirty
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.listdir(tmp_path / "state") == ["ids-rules.json"]  # no temporary left
    # Restart 50 s later: the short rule expired while the controller was down.
    clock = Clock()
    clock.wall_at, clock.mono_at = NOW + 50, 7.0  # (a new boot's monotonic clock, say)
    again = Store(path, max_rules=10, clock=clock)
    [gone] = again.load()
    assert again.deadline(again.get("ids:zeek", "long")) == 7.0 + 50  # what the wall clock leaves of it
    assert gone.rule.id == "short" and gone.why == "expired while the controller was down"
    assert {r.id for r in again.select()} == {"long", "addr"}
    assert again.get("ids:zeek", "addr").address == ipaddress.ip_network("fd00:1::/64")
    assert again.get("ids:zeek", "long") == store.get("ids:zeek", "long")
    assert again.dirty  # the expired one is to be written out


def test_due_sees_only_rules_still_active():
    """The next expiry is kept in a heap (no scan of every rule a tick): a rule that ended
    before it, or whose id came back with a later expiry, is not due at the old time."""
    clock = Clock()
    store = Store(None, max_rules=10, clock=clock)
    store.add(rule("1", expire=10))
    store.add(rule("2", expire=20, sport=2))
    store.remove("ids:zeek", "1", NOW + 5, counts)
    assert store.due(NOW + 15) == []
    clock.wall_at = clock.mono_at = NOW + 5
    store.add(rule("1", expire=30, now=NOW + 5))
    assert [r.id for r in store.due(NOW + 25)] == ["2"]
    assert [r.id for r in store.due(NOW + 35)] == ["2", "1"]


def test_rules_added_and_removed_before_their_expiry_do_not_grow_the_expiry_heap():
    """An IDS that adds and removes long-lived rules in a loop: the heap stays bounded."""
    store = Store(None, max_rules=10)
    store.add(rule("keep", expire=100, sport=9))
    for i in range(1000):
        store.add(rule(str(i), expire=86400))
        store.remove("ids:zeek", str(i), NOW + 1, counts)
    assert len(store._expiries) <= 2 * len(store.rules) + 65
    assert [r.id for r in store.due(NOW + 100)] == ["keep"]


def test_the_state_file_is_the_rules_json_written_from_their_lines(tmp_path):
    """Each rule's line is made when it is added; a tick's snapshot of them can be written
    off the event loop, and the file is the same JSON as the rules' own."""
    path = str(tmp_path / "ids-rules.json")
    store = Store(path, max_rules=10)
    store.add(rule("a"))
    store.add(rule("b", action="block", address="10.1.0.0/16"))
    lines = store.snapshot()
    assert not store.dirty
    store.add(rule("c", sport=3))  # after the snapshot: not in this write
    write(path, lines)
    with open(path) as fh:
        assert json.load(fh) == {"version": 1, "rules": [r.to_json() for r in store.select() if r.id != "c"]}
    assert store.whitelisting(rule("x", action="block", address="10.1.2.3").networks(), "ids:zeek") is None
    assert store.blocking(FlowTuple(4, 6, "10.1.2.3", "10.0.0.2", 1, 2)).id == "b"


def test_state_file_bad_entries_dropped_bad_file_kept_aside(tmp_path):
    path = tmp_path / "ids-rules.json"
    good = rule("ok").to_json()
    path.write_text(json.dumps({"version": 1, "rules": [good, {**good, "id": "x/y"}, {**good, "extra": 1}, good,
                                                        {**good, "id": "p", "connection": {**CONN, "dport": 0}}]}))
    store = Store(str(path), max_rules=10)
    assert store.load() == [] and [r.id for r in store.select()] == ["ok"]
    path.write_text("{not json")
    fresh = Store(str(path), max_rules=10)
    assert fresh.load() == [] and len(fresh) == 0
    assert (tmp_path / "ids-rules.json.bad").exists() and not path.exists()


def test_state_file_rules_with_an_ipv6_scope_id_are_dropped_and_logged(tmp_path, caplog):
    path = tmp_path / "ids-rules.json"
    good = rule("ok").to_json()
    block = rule("b", action="block", address="fd00::/64").to_json()
    scoped_conn = {**good, "id": "c", "connection": {**CONN, "src": "fd00::1%eth0", "dst": "fd00::2"}}
    path.write_text(json.dumps({"version": 1, "rules": [good, {**block, "address": "fe80::%eth0/64"},
                                                        scoped_conn]}))
    store = Store(str(path), max_rules=10)
    assert store.load() == [] and [r.id for r in store.select()] == ["ok"]
    assert "rules[1] is dropped: address:" in caplog.text and "rules[2] is dropped: connection.src:" in caplog.text
    assert caplog.text.count("scope id") == 2


# What a hand-edited state file may hold in a rule's field instead of what it takes.
WRONG_TYPES = [[], {}, True, 1.5, float("nan"), "x%y", 10**99, -1e308, None]
TAKEN = [("server", None), ("idle_timeout", None), ("created", 10**99)]  # (a deadline is at most `expire` away)
FILE_FIELDS = ["source", "id", "kind", "priority", "expire", "created", "idle_timeout", "server", "server.address",
               "server.port", "address", "connection",
               *(f"connection.{name}" for name in ("protocol", "src", "sport", "dst", "dport", "zone", "vlan"))]


@pytest.mark.parametrize("value", WRONG_TYPES, ids=lambda v: f"{type(v).__name__}:{v!r:.10}")
@pytest.mark.parametrize("field", FILE_FIELDS)
def test_a_hand_edited_field_of_any_type_drops_its_rule_with_a_log_line_not_the_start(tmp_path, caplog, field, value):
    path = tmp_path / "ids-rules.json"
    edited = (rule("e", action="block", address="10.9.0.0/24") if field == "address" else rule("e")).to_json()
    edited["server"] = {"address": CONN["dst"], "port": CONN["dport"]}
    where, _, name = field.rpartition(".")
    (edited[where] if where else edited)[name] = value
    path.write_text(json.dumps({"version": 1, "rules": [rule("ok", sport=1).to_json(), edited]}))
    store = Store(str(path), max_rules=10)
    gone = store.load()
    kept = [r.id for r in store.select()]
    if (field, value) in TAKEN:
        assert sorted(kept) == ["e", "ok"]
    elif field == "created" and value in (1.5, -1e308):  # long past: the rule ended while the controller was down
        assert kept == ["ok"] and [e.rule.id for e in gone] == ["e"]
    else:
        assert kept == ["ok"] and "rules[1] is dropped" in caplog.text


def test_a_rule_whose_check_raises_another_error_is_dropped_with_a_log_line_not_the_start(tmp_path, caplog,
                                                                                        monkeypatch):
    path = tmp_path / "ids-rules.json"
    path.write_text(json.dumps({"version": 1, "rules": [rule("bad").to_json(), rule("ok", sport=1).to_json()]}))
    checked = store_module.from_json

    def from_json(raw):  # a field's check with a bug: the wrong exception for a wrong value
        if raw["id"] == "bad":
            raise TypeError("unhashable type: 'list'")
        return checked(raw)
    monkeypatch.setattr(store_module, "from_json", from_json)
    store = Store(str(path), max_rules=10)
    assert store.load() == [] and [r.id for r in store.select()] == ["ok"]
    assert "rules[0] is dropped: TypeError: unhashable type: 'list'" in caplog.text


def test_state_file_over_the_cap(tmp_path):
    path = str(tmp_path / "ids-rules.json")
    store = Store(path, max_rules=3)
    for i in range(3):
        store.add(rule(str(i), sport=i + 1))
    store.save()
    smaller = Store(path, max_rules=2)
    smaller.load()
    assert len(smaller) == 2


def test_missing_state_file_is_an_empty_start(tmp_path):
    store = Store(str(tmp_path / "none.json"), max_rules=3)
    assert store.load() == [] and len(store) == 0


def test_rules_are_judged_again_by_precedence_against_the_config_at_start(tmp_path):
    """Issue 36.4: a saved shunt outside `ids.may_shunt` as it is now ends at start; a block,
    and a shunt beneath another rule's block (its pin waits, as while running), stay."""
    from nfshunt.config.ids import MayShunt
    path = str(tmp_path / "ids-rules.json")
    store = Store(path, max_rules=10)
    store.add(rule("in", sport=1))
    store.add(rule("out", sport=2, dport=22))
    store.add(rule("b", action="block", sport=3))
    store.add(rule("under", sport=3))
    store.save()
    again = Store(path, max_rules=10)
    again.load()
    scope = MayShunt(prefixes=(ipaddress.ip_network("10.0.0.0/24"),), ports=((5201, 5201),))
    gone = again.judge(scope)
    assert [(e.rule.id, e.why) for e in gone] == [
        ("out", "refused at start: outside ids.may_shunt: the connection's server 10.0.0.2:22 (the end it was opened "
                "to) is not on a listed port of a listed prefix")]
    assert sorted(r.id for r in again.select()) == ["b", "in", "under"] and again.dirty
    assert {e.rule.id for e in again.judge(MayShunt())} == {"in", "under"}  # emptied: no IDS may shunt
    assert [r.id for r in again.select()] == ["b"]


def test_a_running_rule_ends_on_the_monotonic_clock_and_a_restart_gives_it_no_more_than_its_expire(tmp_path):
    """Issue 36.7: the wall clock stepped back an hour (while running, or across a restart)
    lengthens no rule; stepped forward while running, it cuts none short."""
    clock = Clock()
    path = str(tmp_path / "ids-rules.json")
    store = Store(path, max_rules=10, clock=clock)
    store.add(rule("1", expire=100))
    clock.wall_at, clock.mono_at = NOW + 3600, NOW + 50  # an hour forward, 50 s on
    assert store.due(clock.mono_at) == []
    clock.wall_at, clock.mono_at = NOW - 3600, NOW + 100  # an hour back, 100 s on
    assert [r.id for r in store.due(clock.mono_at)] == ["1"]
    store.save()
    later = Clock()
    later.wall_at, later.mono_at = NOW - 3600, 5.0  # restarted with the clock an hour back
    again = Store(path, max_rules=10, clock=later)
    again.load()
    assert again.deadline(again.get("ids:zeek", "1")) == 5.0 + 100  # not 5 + 3700


@pytest.mark.parametrize("count", [0, 1, 3, 40000])
def test_the_state_file_written_in_parts_is_the_lines_joined(tmp_path, count):
    """write() hands the file its lines a part at a time (no 18 MB join in one hold of the
    interpreter's lock): the bytes are those of the whole joined at once."""
    from nfshunt.ids.store import FORMAT
    lines = [json.dumps({"n": i, "pad": "x" * 40}).encode() for i in range(count)]  # 40,000: past one part
    path = tmp_path / "ids.json"
    write(str(path), lines)
    assert path.read_bytes() == b'{"version":%d,"rules":[' % FORMAT + b",".join(lines) + b"]}"
