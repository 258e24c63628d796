"""`nfshunt explain`: the controller's answer (app/explain.py) with the policy rule that
marked the entry (policy_rules.py, read here with iptables-save), for humans or as JSON."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from nfshunt.app.control import ControlError, NotRunning, request
from nfshunt.app.target import parse_target

from . import policy_rules

EXIT_FAILED, EXIT_BAD_INPUT = 1, 2
WIDTH = 12  # the layer names' column


def policy(reply: dict[str, Any]) -> dict[str, Any] | None:
    """The NFSHUNT_POLICY rules that may have marked the connection: matched against its
    entry, or its pair's tuples and mark once the entry is gone (None: neither is known)."""
    marked = reply["marked"]
    if marked is None:
        return None
    (osrc, odst, osp, odp), (rsrc, rdst, rsp, rdp) = marked["orig"], marked["reply"]
    conn = policy_rules.Conn(marked["proto"], (osrc, odst, osp, odp), (rsrc, rdst, rsp, rdp))
    try:
        rules = policy_rules.parse_policy(policy_rules.saved_policy(marked["family"]), reply["mark_actions"])
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        return {"error": f"the policy could not be read: {exc}"}
    return policy_rules.candidates(rules, marked["action"], conn)


def _size(n: float | None, unit: str = "B") -> str:
    if n is None:
        return "-"
    for prefix in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or prefix == "T":
            return f"{n:.0f} {unit}" if prefix == "" else f"{n:.1f} {prefix}{unit}"
        n /= 1000
    return str(n)


def _line(name: str, text: str) -> str:
    return f"{name:<{WIDTH}}{text}"


def _conntrack(reply: dict[str, Any]) -> list[str]:
    ct = reply["conntrack"]
    if ct["error"]:
        return [_line("conntrack", ct["error"])]
    e = ct["entry"]
    if e is None:
        extra = f" ({ct['entries_with_id']} entries share the id: give the tuple)" if ct["entries_with_id"] > 1 else ""
        if any((row["pair"] or {}).get("entry_deleted") for row in reply["switches"]):
            extra = ": NFShunt deleted it once the switch carried the shunt"
        return [_line("conntrack", "no entry" + extra)]
    d = e["decoded"]
    decision = f"decided {d['action'] or 'action ' + str(d['action_number'])}" if d["decided"] else "not decided"
    out = [_line("conntrack", f"entry {e['ct_id']} {e['tcp_state'] or ''} mark {e['mark']}: ingress port "
                 f"{d['ingress']}, egress port {d['egress']}, {decision}; zone {e['zone']}"
                 + (f"; NAT (reply {e['reply']})" if e["nat"] else ""))]
    if e["packets"] is not None:
        out.append(_line("", f"slow path counted {e['packets'][0]} pkts {_size(e['bytes'][0])} original, "
                         f"{e['packets'][1]} pkts {_size(e['bytes'][1])} reply"))
    elif ct["accounting"] is False:
        out.append(_line("", "byte counters off: sysctl net.netfilter.nf_conntrack_acct=1 turns them on"))
    return out


def _policy(found: dict[str, Any] | None) -> list[str]:
    if found is None:
        return []
    if "error" in found:
        return [_line("policy", found["error"])]
    rules = {r["number"]: r for r in found["rules"]}
    picked = [rules[n] for n in found["candidates"]]
    decided = found["decided"]
    if not picked:
        head = f"decided {decided}; no rule of NFSHUNT_POLICY can have marked it (changed since?)" if decided \
            else "no NFSHUNT_POLICY rule can decide it"
    elif found["certain"]:
        head = f"decided {decided} by rule {picked[0]['number']} of NFSHUNT_POLICY"
    elif decided:
        head = f"the policy's decision is {decided}; candidate rules: " + ", ".join(str(r["number"]) for r in picked) \
            + " (iptables does not record which rule set a mark)"
    else:
        head = "not decided yet; the rules that may decide it: " + ", ".join(str(r["number"]) for r in picked)
    return [_line("policy", head)] + [_line("", f"{r['number']}: [{r['packets']} pkts, {_size(r['bytes'])}] "
                                            f"{r['rule']}") for r in picked]


def _switch(row: dict[str, Any], several: bool) -> list[str]:
    name = f"switch {row['datapath_id']}" if several else "switch"
    state = "connected" if row["connected"] else "AWAY (not connected)"
    out = [_line("controller", f"{name} {state}" + ("" if row["reconciled"] or not row["connected"]
                                                     else ", its table not read back yet")
                 + (", backup of a pair" if row["backup"] else ""))]
    a = row["authority"]
    who = a["kind"] + (f" ({a['source']})" if a["source"] else "")
    pair = row["pair"]
    if pair is not None:
        out.append(_line("", f"{pair['action']} pair {pair['state']} for {pair['age']:.1f} s, ct_id {pair['ct_id']}"
                         f" slot {pair['slot']}, cookie {pair['cookie']}; decided by {who}"))
    else:
        out.append(_line("", "no pair; " + (f"decided by {who}" if a["kind"] != "none" else "nothing decides it yet")))
    if row["pin"]:
        p = row["pin"]
        out.append(_line("", f"pin: {p['source']}'s {p['action']}"
                         + (f", {p['expires_in']:.0f} s left" if p["expires_in"] is not None else "")))
    for s in row["static"]:
        out.append(_line("", f"static shunt {s['name']}: {s['flow']}"))
    if row["waiting"]:
        out.append(_line("", "waiting for room on the switch"))
    if row["flows"] is not None:
        for f in row["flows"]:
            out.append(_line("flows", f"{f['kind']:<8} {f['direction']:<8} {f['packets']} pkts {_size(f['bytes'])}"
                             f" in {f['duration']:.1f} s, cookie {f['cookie']}"))
    elif row["connected"] and (pair is not None or row["static"]):
        out.append(_line("flows", "the switch did not answer the flow read in time"))
    return out


def render(reply: dict[str, Any], rules: dict[str, Any] | None) -> str:
    lines = [_line("explain", reply["tuple"] or reply["target"])]
    lines += _conntrack(reply)
    lines += _policy(rules)
    several = len(reply["switches"]) > 1
    for row in reply["switches"]:
        lines += _switch(row, several)
    for r in reply["ids_rules"]:
        lines.append(_line("ids", f"{r['source']} rule {r['id']}: {r['kind']}, expires in {r['expires_in']:.0f} s"))
    for h in reply["history"]:
        lines.append(_line("history", f"{h.get('time', '?')} {h.get('event', '?')} {h.get('action') or ''}"
                           f" {h.get('reason') or ''} {_size(h.get('bytes'))}".rstrip()))
    v = reply["verdict"]
    lines.append(_line("verdict", f"{v['path'].upper()}: {v['text']}"))
    return "\n".join(lines)


def cmd_explain(args: argparse.Namespace, socket_path: str) -> int:
    text = " ".join(args.target)
    try:
        parse_target(text)  # bad input is refused here, the controller not asked
    except ValueError as exc:
        print(f"nfshunt explain: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        zone = {k: v for k in ("vlan", "zone") if (v := getattr(args, k, None)) is not None}
        reply = request(socket_path, {"cmd": "explain", "target": text, **zone}, timeout=15)
    except (NotRunning, ControlError) as exc:
        print(f"nfshunt: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if "error" in reply:
        print(f"nfshunt explain: {reply['error']}", file=sys.stderr)
        return EXIT_BAD_INPUT if reply.get("bad_input") else EXIT_FAILED
    rules = policy(reply)
    if args.json:
        print(json.dumps({**reply, "policy": rules}, indent=2, sort_keys=True))
    else:
        print(render(reply, rules))
    return 0
