"""docs/config-keys.md is printed from the parser's own tables (nfshunt/config/reference.py):
the committed file is what the tables print, and the keys it lists for each object are
exactly the keys the parser accepts there."""
from __future__ import annotations

import os
import re

import pytest

from nfshunt.config import reference
from nfshunt.config.settings import ConfigError, from_dict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "config-keys.md")

# Where each object sits in a config: a config whose object at that place has one unknown
# key, and nothing before it that the parser would refuse first (a required key missing:
# the names of an object are checked before its values, in the order they come).
PROBES = {
    "": lambda bad: bad,
    "switches[]": lambda bad: {"switches": [{**bad, "datapath_id": 1}]},
    "ports[]": lambda bad: {"ports": [bad]},
    "ports[].vlans[]": lambda bad: {"ports": [{"fast": 1, "slow": 2, "physdevin": 1, "vlans": [bad]}]},
    "tls": lambda bad: {"tls": bad},
    "pair": lambda bad: {"pair": bad},
    "ids": lambda bad: {"ids": bad},
    "ids.tls": lambda bad: {"ids": {"tls": bad}},
    "ids.may_shunt": lambda bad: {"ids": {"may_shunt": bad}},
    "ids.max_prefix": lambda bad: {"ids": {"max_prefix": bad}},
    "static_shunts[]": lambda bad: {"static_shunts": [bad]},
    "static_shunt_max_prefix": lambda bad: {"static_shunt_max_prefix": bad},
}


def _accepted(where: str) -> set[str]:
    """The keys the parser accepts at `where`, as its refusal of an unknown one lists them."""
    with pytest.raises(ConfigError) as info:
        from_dict({**PROBES[where]({"no_such_key": 1}), "mark_actions": {"1": "shunt"}})
    assert info.value.key.endswith("no_such_key"), (info.value.key, info.value.problem)
    allowed = re.fullmatch(r"unknown key \(allowed: (.*)\)", info.value.problem)
    assert allowed, info.value.problem
    return set(allowed.group(1).split(", "))


def _documented() -> dict[str, set[str]]:
    """The keys docs/config-keys.md lists, by the object's section."""
    out: dict[str, set[str]] = {}
    section = None
    with open(DOC) as fh:
        for line in fh:
            if line.startswith("## "):
                title = line[3:].strip()
                section = "" if title == "The top level" else title.strip("`")
                out[section] = set()
            elif section is not None and (row := re.match(r"\| `([^`]+)` \|", line)):
                out[section].add(row.group(1))
    return out


def test_the_committed_reference_is_the_generated_one():
    with open(DOC) as fh:
        committed = fh.read()
    assert committed == reference.render(), (
        f"docs/config-keys.md differs from what the config's tables print: run `{reference.COMMAND}`")


def test_every_object_of_the_config_is_probed():
    assert {t.where for t in reference.TABLES} == set(PROBES)


@pytest.mark.parametrize("where", sorted(PROBES))
def test_the_reference_lists_exactly_the_keys_the_parser_accepts(where):
    """Every key the parser takes at this place is documented, and no key it refuses."""
    accepted = _accepted(where)
    assert _documented()[where] == accepted
    (table,) = [t for t in reference.TABLES if t.where == where]
    assert set(table.keys) == accepted


def test_a_switch_entry_takes_port_groups_as_the_top_level_does():
    with pytest.raises(ConfigError) as info:
        from_dict({"switches": [{"ports": [{"no_such_key": 1}], "datapath_id": 1}], "mark_actions": {"1": "shunt"}})
    assert info.value.key == "switches[0].ports[0].no_such_key"
    assert f"allowed: {', '.join(sorted(_documented()['ports[]']))})" in info.value.problem


def test_every_key_says_what_it_takes_and_means():
    for table in reference.TABLES:
        assert table.about
        for name, key in table.keys.items():
            at = f"{table.where or 'top level'}.{name}"
            assert key.help.endswith("."), at
            assert key.check.kind, at
            assert reference.default(table, name), at


def test_a_default_in_the_reference_is_the_parser_s():
    """The defaults come from the records the parser fills: an omitted key gets that value."""
    cfg = from_dict({"ports": [{"fast": 1, "slow": 2, "physdevin": 1}], "mark_actions": {"1": "shunt"}})
    doc = reference.render()
    for name in ("default_shunt_timeout", "netlink_rcvbuf", "shunt_priority", "confirm_delay", "listen_port"):
        assert f"| `{name}` | " in doc
        row = next(line for line in doc.splitlines() if line.startswith(f"| `{name}` |"))
        assert row.split(" | ")[2] == str(getattr(cfg.switches[0] if name == "confirm_delay" else cfg, name))
