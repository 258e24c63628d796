"""explain and top without a kernel or a switch: the target's checks, the event loop's part
against the real core (a fake datapath), the verdict's words for every admission reason,
the audit tail, the policy rules' conservative match, top's rates and its 80x24 frame."""
import json
import os
import time

import pytest

os.environ.setdefault("OSKEN_HUB_TYPE", "native")

from nfshunt import policy_rules, topview  # noqa: E402
from nfshunt.app import explain as ex  # noqa: E402
from nfshunt.app import top  # noqa: E402
from nfshunt.app.operator_api import EventControl  # noqa: E402
from nfshunt.app.target import parse_target  # noqa: E402
from nfshunt.core import admission as adm  # noqa: E402
from nfshunt.openflow.inflight import FlowsRead  # noqa: E402
from nfshunt.records.model import EntryCounts, EventKind, SwitchFlow  # noqa: E402
from tests.helpers import event  # noqa: E402
from tests.test_operator_api import TWO, _reads  # noqa: E402
from tests.test_operator_api import _api as _two_switches  # noqa: E402

T = "tcp 10.0.0.1:1 -> 10.0.0.2:5201"  # the first switch's live shunt (test_operator_api._api)


def _api(state_dir, connected=(True, True)):
    api, switches = _two_switches(state_dir, connected)
    api.app.cfg = TWO
    return api, switches


@pytest.mark.parametrize("raw, says", [
    (None, "nothing to explain"), ("", "nothing to explain"), (12, "nothing to explain"),
    ("tcp 10.0.0.1:1 -> 10.0.0.2", "not a tuple"), ("sctp 10.0.0.1:1 -> 10.0.0.2:2", "not a tuple"),
    ("tcp 10.0.0.1:1 -> [fd00::2]:2", "different address families"), ("tcp 10.0.0.1:0 -> 10.0.0.2:2", "out of range"),
    ("9" * 11, "out of range"), ("0", "out of range"), ("0x" + "f" * 17, "not NFShunt's"), ("0xzz", "not a cookie"),
    ("0x0000000000000001", "not NFShunt's"), ("a" * 257, "target too long"),
])
def test_bad_targets_are_refused_with_what_to_give(raw, says):
    with pytest.raises(ValueError, match=says):
        parse_target(raw)


def test_targets_by_tuple_id_and_cookie():
    assert str(parse_target(" tcp [fd00::1]:1 -> [fd00::2]:2 ").tuple) == "tcp [fd00::1]:1 -> [fd00::2]:2"
    assert parse_target("4294967295").ct_id == 0xFFFFFFFF
    got = parse_target("0x4e0200100000002a")  # a shunt's cookie, slot 1, conntrack id 42
    assert (got.ct_id, got.key >> 32, got.kind.name) == (42, 1, "SHUNT")


def test_every_admission_reason_has_words():
    reasons = {v for k, v in vars(adm).items() if k.startswith("R_")}
    assert reasons == set(ex.REASONS)


def _explain(api, target, entries=()):
    answers = []
    got = ex.Gathered(parse_target(target), entries=list(entries), acct=True)
    ev = EventControl({"cmd": "explain"}, got)
    ev.answer = answers.append
    api.handle(ev)
    return answers, got


def test_a_live_shunt_is_explained_with_the_switchs_flows_read_now(tmp_path):
    api, (a1, a2) = _api(tmp_path)
    answers, _ = _explain(api, T)
    assert not answers  # waits for the first switch's read of the pair's flows
    (read,) = _reads(a1).values()
    conn = next(iter(a1.core.by_key.values()))
    ours = SwitchFlow(conn.cookie(False), 33000, 1, conn.orig, 3, 5, 700, 1.5)
    read.done([ours, SwitchFlow(0x4E02000000000063, 33000, 1, None, 3, 9, 9, 1.0)])  # another pair's: not shown
    (found,) = answers
    reply = ex.finish(found, None)
    row = reply["switches"][0]
    assert row["pair"]["state"] == "draining" and row["authority"] == {"kind": "policy", "source": None,
                                                                     "action": "shunt"}
    assert [(f["kind"], f["direction"], f["bytes"]) for f in row["flows"]] == [("shunt", "original", 700)]
    assert reply["verdict"]["path"] == "fast" and reply["marked"]["action"] == "shunt"
    assert reply["switches"][1]["pair"] is None  # the second switch has no pair of it
    json.dumps(reply)  # all of it goes over the socket


def test_with_the_switch_away_it_answers_at_once_and_says_so(tmp_path):
    api, (a1, _) = _api(tmp_path, connected=(False, False))
    answers, _ = _explain(api, T)
    (found,) = answers
    reply = ex.finish(found, None)
    assert "the switch is away" in reply["verdict"]["text"] and not reply["switches"][0]["connected"]


def test_an_entry_without_a_pair_gets_admissions_reason(tmp_path):
    api, _ = _api(tmp_path, connected=(False, False))
    ignored = event(action=0, ingress=1, egress=2, sport=7)
    answers, _ = _explain(api, "tcp 10.0.0.1:7 -> 10.0.0.2:5201", [(ignored, EntryCounts((3, 2), (300, 200)))])
    reply = ex.finish(answers[0], None)
    assert reply["verdict"] == {"path": "slow", "code": adm.R_POLICY_IGNORE, "text": ex.REASONS[adm.R_POLICY_IGNORE]}
    assert reply["conntrack"]["entry"]["packets"] == [3, 2]
    syn = event(state=1, mark=0x61200000, sport=8)
    answers, _ = _explain(api, "tcp 10.0.0.1:8 -> 10.0.0.2:5201", [(syn, EntryCounts())])
    assert ex.finish(answers[0], None)["verdict"]["text"].startswith("not yet ESTABLISHED (SYN_SENT)")


def test_a_read_the_switch_never_answers_is_given_up_at_read_wait(monkeypatch, tmp_path):
    monkeypatch.setattr(ex, "READ_WAIT", 0.05)
    api, (a1, _) = _api(tmp_path)
    answers, _ = _explain(api, T)
    deadline = time.monotonic() + 2
    while not answers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert answers and answers[0]["switches"][0]["flows"] is None
    (read,) = _reads(a1).values()
    read.done([])  # late: nothing more happens
    assert len(answers) == 1


def test_the_audit_history_is_the_connections_newest_lines_from_the_files_end(tmp_path, monkeypatch):
    monkeypatch.setattr(ex, "AUDIT_TAIL", 4000)
    path = tmp_path / "audit.log"
    lines = [{"event": "removed", "proto": "tcp", "src": "10.0.0.1", "sport": 1, "dst": "10.0.0.2", "dport": 5201,
              "n": n} for n in range(100)]
    lines.insert(50, {"event": "removed", "proto": "tcp", "src": "10.0.0.2", "sport": 5201, "dst": "10.0.0.1",
                      "dport": 1, "n": "reversed"})
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    t = parse_target(T).tuple
    got = ex.history(str(path), t, None)
    assert [x["n"] for x in got] == list(range(90, 100))
    assert ex.history(str(tmp_path / "missing"), t, None) == [] and ex.history(None, t, None) == []


SAVED = """*mangle
[10:1000] -A NFSHUNT_POLICY -m conntrack --ctstate ESTABLISHED --ctproto 6 --ctorigdstport 5201 -g NFSHUNT_SHUNT
[0:0] -A NFSHUNT_POLICY -m conntrack --ctstate ESTABLISHED --ctproto 6 --ctorigsrcport 5201 -g NFSHUNT_SHUNT
[3:300] -A NFSHUNT_POLICY -s 10.0.0.0/24 ! -d 10.0.0.9/32 -p tcp -m tcp --dport 22 -m comment --comment "ssh x" \
-j MARK --set-xmark 0x10000000/0x100f0000
[7:700] -A NFSHUNT_POLICY -m conntrack --ctstate ESTABLISHED -g NFSHUNT_IGNORE
[1:1] -A OTHER -j NFSHUNT_SHUNT
COMMIT
"""
ACTIONS = {"0": "ignore", "1": "shunt", "2": "block"}


def conn(sport, dport, src="10.0.0.1", dst="10.0.0.2"):
    return policy_rules.Conn(6, (src, dst, sport, dport), (dst, src, dport, sport))


def test_the_one_rule_that_can_have_marked_it_is_named():
    rules = policy_rules.parse_policy(SAVED, ACTIONS)
    assert [(r.number, r.decides, r.ends, r.packets) for r in rules] == [
        (1, "shunt", True, 10), (2, "shunt", True, 0), (3, "ignore", False, 3), (4, "ignore", True, 7)]
    got = policy_rules.candidates(rules, "shunt", conn(40000, 5201))
    assert got["candidates"] == [1] and got["certain"]
    assert [r["match"] for r in got["rules"]] == ["maybe", "no", "no", "maybe"]  # --ctstate: the packet's moment


def test_where_two_rules_can_have_marked_it_both_are_candidates():
    rules = policy_rules.parse_policy(SAVED, ACTIONS)
    got = policy_rules.candidates(rules, "ignore", conn(40000, 22))  # rule 3 (a MARK, not ending) and rule 4
    assert got["candidates"] == [3, 4] and not got["certain"]
    got = policy_rules.candidates(policy_rules.parse_policy(SAVED, ACTIONS), "ignore", conn(40000, 22, dst="10.0.0.9"))
    assert got["candidates"] == [4] and got["certain"]  # ! -d 10.0.0.9 rules 3 out
    assert policy_rules.candidates(policy_rules.parse_policy(SAVED, ACTIONS), None, conn(1, 2))["candidates"] == [4]


def test_a_jump_to_a_chain_of_the_admins_leaves_doubt():
    saved = "[0:0] -A NFSHUNT_POLICY -p tcp -j MYCHAIN\n[0:0] -A NFSHUNT_POLICY -p tcp -g NFSHUNT_SHUNT\n"
    got = policy_rules.candidates(policy_rules.parse_policy(saved, ACTIONS), "shunt", conn(1, 2))
    assert got["candidates"] == [2] and not got["certain"]


def _view(pairs, installed=0, removed=0):
    return {"pairs": pairs, "switches": [{"datapath_id": "a1", "connected": True, "flow_stats": True}],
            "shunts": len(pairs), "blocks": 0, "waiting": 0, "budget": 100, "installed": installed,
            "removed": removed}


def test_top_rates_are_the_change_since_the_last_sample_or_the_average_over_the_age():
    clock = [100.0]
    sampler = top.TopSampler(lambda: clock[0])
    pair = top.PairCount(("a1", 1), T, "shunt", "live", 10, 4000, 2.0)
    slow = (event(sport=9, kind=EventKind.DUMP), EntryCounts((1, 1), (100, 100)))
    first = sampler.rate(_view([pair], 5, 1), [slow], True, 10)
    assert first["interval"] is None and first["shunts_per_s"] is None
    assert [r["bytes_per_s"] for r in first["top"]] == [2000.0, None]  # average; the slow one not known yet
    clock[0] = 102.0
    later = top.PairCount(("a1", 1), T, "shunt", "live", 30, 10000, 4.0)
    second = sampler.rate(_view([later], 9, 2), [(slow[0], EntryCounts((2, 3), (300, 500)))], True, 10)
    assert (second["interval"], second["shunts_per_s"], second["takedowns_per_s"]) == (2.0, 2.0, 0.5)
    assert [(r["path"], r["bytes_per_s"]) for r in second["top"]] == [("fast", 3000.0), ("slow", 300.0)]
    assert second["slow_share"] == pytest.approx(300 / 3300)
    off = sampler.rate(_view([later]), [(slow[0], EntryCounts())], False, 10)
    assert off["slow_share"] is None and off["slow_bytes_per_s"] is None and off["accounting"] is False


def test_the_frame_fits_80x24_and_says_when_the_terminal_is_too_small():
    rows = [{"path": "fast", "action": "shunt", "state": "live", "tuple": "tcp [fd00::1234:5678]:40000 -> "
             "[fd00::9abc:def0]:5201", "bytes_per_s": 1.2e8, "bytes": 7.4e9, "packets_per_s": 1, "packets": 1}] * 40
    reply = {**top.TopSampler().rate(_view([]), [], False, 10), "top": rows, "conntrack_error": None}
    lines = topview.frame(reply, None, 80, 24, "12:00:00")
    assert len(lines) == 24 and max(map(len, lines)) < 80
    assert lines[0].startswith("nfshunt top") and "sysctl net.netfilter.nf_conntrack_acct=1" in "\n".join(lines)
    assert lines[-1].startswith("fast shunt  live") and "960.0Mb/s" in lines[-1] and lines[-1].endswith("7.4GB")
    wide = topview.frame(reply, None, 132, 50, "12:00:00")
    assert "[fd00::9abc:def0]:5201" in wide[-1] and len(wide) == 8 + 40  # every row fits
    assert topview.frame(reply, None, 79, 24, "x")[0] == "terminal too small (79x24):"
    assert topview.frame(None, "no controller", 80, 24, "x")[1] == "no answer: no controller"


def test_top_refuses_a_bad_limit_without_asking_the_loop(tmp_path):
    api, _ = _api(tmp_path)
    asked = []
    for bad in (0, 201, "5", True):
        reply = api.off_loop({"cmd": "top", "limit": bad}, lambda req, ctx: asked.append(req) or {})
        assert reply["bad_input"] and "limit" in reply["error"]
    assert not asked


def test_top_on_the_loop_reads_every_connected_switch(tmp_path):
    api, (a1, a2) = _api(tmp_path)
    ev = EventControl({"cmd": "top"}, "top")
    api.handle(ev)
    reads = [read for sw in (a1, a2) for read in sw.session.inflight._by_xid.values() if isinstance(read, FlowsRead)]
    assert len(reads) == 2 and not ev.done.is_set()
    for read in reads:
        read.done([])
    assert ev.done.is_set() and len(ev.reply["pairs"]) == 2
