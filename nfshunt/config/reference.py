"""The configuration key reference (docs/config-keys.md), printed from the parser's own
tables: each object's Table gives its keys, their checks (type and allowed values) and
help text, and the dataclass its values become gives the defaults. So the reference and
the parser cannot disagree (tests/test_config_reference.py holds the file equal to this).

    python -m nfshunt.config.reference > docs/config-keys.md
"""
from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from . import ids, pair, settings, static, switch
from .reload import LIVE
from .validate import Table

# Every object the config has, in the reference's order; tests/test_config_reference.py
# checks each against what the parser accepts.
TABLES: tuple[Table, ...] = (settings.TABLE, switch.SWITCH, switch.PORT_GROUP, switch.VLAN, switch.TLS, pair.PAIR,
                             ids.IDS, ids.TLS, ids.MAY_SHUNT, ids.MAX_PREFIX, static.ENTRY, static.MAX_PREFIX)
COMMAND = "python -m nfshunt.config.reference > docs/config-keys.md"

INTRO = f"""# Configuration keys

Every key of `nfshunt.json`, printed from the config parser's own tables (`nfshunt/config`:
each key's check, help text and default), so it says what the parser does. Do not edit it:
`{COMMAND}` writes it again, and
`tests/test_config_reference.py` fails when it differs.

A config that fails is refused whole, before anything touches iptables or the switch, with
the key's path and the problem (`nfshunt check-config` exits 2): an unknown key, a key's
wrong type or value, a required key missing, and keys that do not agree with each other.
A key marked *live* takes effect at a reload (`nfshunt reload`, SIGHUP); any other that
changed keeps its running value until a restart.
"""


def _value(value: Any) -> str:
    """A default as it would be written in the config."""
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value)


def default(table: Table, name: str) -> str:
    """What the parser takes when the key is not given."""
    key = table.keys[name]
    if name in table.required:
        return "required"
    if key.default is not None:
        return key.default
    if table.inherits:
        return table.inherits
    records = (table.record, *table.also) if table.record else table.also
    fields = {f.name: f for record in records for f in dataclasses.fields(record)}
    found = fields.get(name)
    if found is None:
        raise ValueError(f"{table.where or 'top level'}.{name}: no default found")
    if found.default is not dataclasses.MISSING:
        return _value(found.default)
    if found.default_factory is not dataclasses.MISSING:
        return _value(found.default_factory())
    raise ValueError(f"{table.where or 'top level'}.{name}: no default found")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _section(table: Table) -> list[str]:
    live = table in (settings.TABLE, switch.SWITCH)
    out = [f"## {f'`{table.where}`' if table.where else 'The top level'}", "", table.about, ""]
    out.append("| key | type | default | allowed | meaning |" + (" reload |" if live else ""))
    out.append("|---|---|---|---|---|" + ("---|" if live else ""))
    for name in sorted(table.keys):
        key = table.keys[name]
        row = [f"`{name}`", key.check.kind, default(table, name), key.check.allowed, key.help]
        if live:
            row.append("live" if name in LIVE else "restart")
        out.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return out + [""]


def render() -> str:
    lines = [INTRO]
    for table in TABLES:
        lines.extend(_section(table))
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
