"""Which NFSHUNT_POLICY rule marked a connection: the chain's rules with their counters
(`iptables-save -c -t mangle`, read once), each matched against the connection's entry.

iptables does not record which rule set a mark, and a rule is judged on a packet (either
direction, in the connection state of that moment), so the match is conservative: a rule
is ruled out only by what the entry proves (its tuples, protocol and ports); what depends
on the packet's moment (--ctstate, interfaces, other marks) leaves it a candidate. With one
candidate that decides what the mark says, that rule; otherwise the candidates are listed.
Pure, but for `saved_policy`, which runs iptables-save (the CLI only, never a hot path).
"""
from __future__ import annotations

import enum
import ipaddress
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from typing import Any

from nfshunt.records import markcodec

POLICY = "NFSHUNT_POLICY"
DECISION_CHAINS = {"NFSHUNT_SHUNT": "shunt", "NFSHUNT_BLOCK": "block", "NFSHUNT_IGNORE": "ignore"}
SAVE = {4: "iptables-save", 6: "ip6tables-save"}
_COUNTED = re.compile(r"^\[(\d+):(\d+)\]\s+(-A\s+.*)$")
PROTOCOLS = {"tcp": 6, "udp": 17, "icmp": 1, "ipv6-icmp": 58, "icmpv6": 58}


class Match(enum.Enum):
    YES = "yes"
    NO = "no"
    MAYBE = "maybe"


@dataclass
class Rule:
    number: int  # its place in the chain, from 1
    text: str  # as iptables-save prints it (without the counters)
    packets: int
    bytes: int
    decides: str | None = None  # the action it marks ("shunt", ...); None: none, or not known
    ends: bool = False  # it leaves the chain (-g, or a terminating target)
    opaque: bool = False  # it jumps to a chain of the admin's: whatever that marks is not read here
    match: Match = Match.MAYBE
    unchecked: list[str] = field(default_factory=list)  # options judged on the packet's moment


def saved_policy(family: int) -> str:
    """iptables-save's mangle table with counters (ip6tables-save for IPv6)."""
    proc = subprocess.run([SAVE[family], "-c", "-t", "mangle"], capture_output=True, text=True, timeout=10)
    if proc.returncode != 0:
        raise OSError(f"{SAVE[family]} failed: {proc.stderr.strip()}")
    return proc.stdout


def parse_policy(saved: str, mark_actions: dict[str, str]) -> list[Rule]:
    """NFSHUNT_POLICY's rules in order, with counters and the decision each marks."""
    rules: list[Rule] = []
    for line in saved.splitlines():
        m = _COUNTED.match(line.strip())
        if m is None or m.group(3).split()[1] != POLICY:
            continue
        rule = Rule(len(rules) + 1, m.group(3), int(m.group(1)), int(m.group(2)))
        rule.decides, rule.ends, rule.opaque = _decision(shlex.split(rule.text), mark_actions)
        rules.append(rule)
    return rules


def _decision(words: list[str], mark_actions: dict[str, str]) -> tuple[str | None, bool, bool]:
    """(the action a rule marks, whether it leaves the chain, whether it jumps elsewhere)."""
    for i, word in enumerate(words[:-1]):
        if word in ("-g", "--goto", "-j", "--jump"):
            target = words[i + 1]
            if target in DECISION_CHAINS:
                return DECISION_CHAINS[target], word in ("-g", "--goto"), False
            if target == "MARK":
                how = next((w for w in ("--set-xmark", "--set-mark") if w in words), None)
                value, _, mask = (words[words.index(how) + 1] if how else "0").partition("/")
                v, k = int(value, 0), int(mask or "0xffffffff", 0)
                if k & markcodec.DECISION_MASK == markcodec.DECISION_MASK and v & markcodec.FLAG_DECIDED:
                    return mark_actions.get(str((v & markcodec.ACTION_MASK) >> markcodec.ACTION_SHIFT)), False, False
                return None, False, False
            if target in ("RETURN", "ACCEPT", "DROP", "CONNMARK", "LOG"):
                return None, target != "LOG" and target != "CONNMARK", False
            return None, word in ("-g", "--goto"), True
    return None, False, False


@dataclass(frozen=True)
class Conn:
    """The entry as the match needs it: both tuples (proto, src, dst, sport, dport)."""
    proto: int
    orig: tuple[str, str, int, int]
    reply: tuple[str, str, int, int]


def _address(value: str, address: str) -> bool:
    return ipaddress.ip_address(address) in ipaddress.ip_network(value, strict=False)


def _ports(value: str, port: int) -> bool:
    for part in value.split(","):
        lo, _, hi = part.partition(":")
        if int(lo or 0) <= port <= int(hi or lo or 65535):
            return True
    return False


# Options the entry decides, and how: (which tuple, which field) or the protocol.
_ENTRY = {"--ctorigsrc": ("orig", 0), "--ctorigdst": ("orig", 1), "--ctreplsrc": ("reply", 0),
          "--ctrepldst": ("reply", 1), "--ctorigsrcport": ("orig", 2), "--ctorigdstport": ("orig", 3),
          "--ctreplsrcport": ("reply", 2), "--ctrepldstport": ("reply", 3)}
# Options a packet decides: the field of its own tuple (either direction).
_PACKET = {"-s": 0, "--source": 0, "-d": 1, "--destination": 1, "--sport": 2, "--source-port": 2,
           "--dport": 3, "--destination-port": 3, "--sports": 2, "--source-ports": 2, "--dports": 3,
           "--destination-ports": 3}
_HARMLESS = {"-A", "-m", "--match", "--comment", "-g", "--goto", "-j", "--jump", "--set-xmark", "--set-mark"}


def judge(rule: Rule, conn: Conn) -> Rule:
    """Rule out what the entry proves cannot match; the rest stays a candidate."""
    words = shlex.split(rule.text)
    entry_ok, per_direction = True, {"orig": True, "reply": True}
    i, negate = 0, False
    while i < len(words):
        word = words[i]
        if word == "!":
            negate, i = True, i + 1
            continue
        value = words[i + 1] if i + 1 < len(words) else ""
        got = _one(word, value, conn)
        if got is None:
            if word.startswith("-") and word not in _HARMLESS and word not in rule.unchecked:
                rule.unchecked.append(word)
        elif isinstance(got, bool):
            entry_ok &= got != negate
        else:
            for direction, ok in got.items():
                per_direction[direction] &= ok != negate
        negate = False
        i += 2 if word.startswith("-") and not value.startswith("-") and word not in ("!",) else 1
    possible = entry_ok and any(per_direction.values())
    rule.match = Match.NO if not possible else Match.MAYBE if rule.unchecked else Match.YES
    return rule


def _one(word: str, value: str, conn: Conn) -> bool | dict[str, bool] | None:
    """One option judged: True/False (the entry decides it), per direction (a packet's),
    None (not judged here)."""
    if word in ("-p", "--protocol", "--ctproto"):
        proto = PROTOCOLS.get(value, int(value) if value.isdigit() else -1)
        return proto == conn.proto
    if word in _ENTRY:
        which, index = _ENTRY[word]
        tuple_ = conn.orig if which == "orig" else conn.reply
        return _ports(value, tuple_[index]) if index >= 2 else _address(value, tuple_[index])  # type: ignore[arg-type]
    if word in _PACKET:
        index = _PACKET[word]
        return {d: _ports(value, t[index]) if index >= 2 else _address(value, t[index])  # type: ignore[arg-type]
                for d, t in (("orig", conn.orig), ("reply", conn.reply))}
    if word == "--ports":  # multiport: either port
        return {d: _ports(value, t[2]) or _ports(value, t[3]) for d, t in (("orig", conn.orig), ("reply", conn.reply))}
    return None


def candidates(rules: list[Rule], decided: str | None, conn: Conn) -> dict[str, Any]:
    """Which rules may have marked the entry with `decided` (None: not decided yet: which
    may decide it), in order. Certain when exactly one can: every other rule that marks
    that action (or jumps to a chain of the admin's) is ruled out by the entry itself."""
    for rule in rules:
        judge(rule, conn)
    found, doubt = [], False
    for rule in rules:
        if rule.match is Match.NO:
            continue
        if rule.decides is not None and (decided is None or rule.decides == decided):
            found.append(rule)
        doubt = doubt or rule.opaque
        if rule.match is Match.YES and rule.ends:
            break  # every packet that gets here leaves the chain at this rule
    return {"decided": decided, "candidates": [r.number for r in found],
            "certain": decided is not None and len(found) == 1 and not doubt,
            "rules": [{"number": r.number, "rule": r.text, "packets": r.packets, "bytes": r.bytes,
                       "decides": r.decides, "match": r.match.value, "unchecked": r.unchecked} for r in rules]}
