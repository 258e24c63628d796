"""The accounting records (accounting_log): one JSON line a pair, in the documented schema
(docs/operating.md's table names every field, in order), with both paths' counts."""
import json
import os
import re

from nfshunt.config.settings import ConfigError
from nfshunt.core import core as c
from nfshunt.core.connection import FlowCount
from nfshunt.observe import flowrecords
from nfshunt.records.model import OFP13, EntryCounts
from tests.helpers import config, event

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pair(action=1, mark=None):
    core = c.Core(config())
    core.switch_connected(OFP13)
    core.reconcile([], 0.0)
    (install,) = core.conntrack_event(event(action=action, received=100.0, mark=mark))
    conn = install.conn
    conn.stats = {False: FlowCount(10, 15000, 4.0), True: FlowCount(8, 600, 4.0)}
    return conn


def test_the_docs_document_every_field_in_order():
    with open(os.path.join(REPO, "docs", "operating.md")) as fh:
        page = fh.read()
    section = page.split("**Accounting records**", 1)[1].split("\n\n", 2)[1]
    documented = re.findall(r"^\| `([a-z_]+)` \|", section, re.M)
    assert documented == list(flowrecords.FIELDS)
    assert flowrecords.SCHEMA in page


def test_a_record_carries_both_paths_and_the_conntrack_start():
    slow = EntryCounts(packets=(3, 2), bytes=(180, 120), start_ns=1_700_000_000_000_000_000)
    rec = flowrecords.record(pair(), config(), "idle timeout", slow, now_wall=1_700_000_010.0, now_mono=200.0)
    assert list(rec) == list(flowrecords.FIELDS)
    assert rec["schema"] == "nfshunt.accounting/1" and rec["action"] == "shunt" and rec["authority"] == "policy"
    assert (rec["proto"], rec["src"], rec["sport"], rec["dst"], rec["dport"]) == ("tcp", "10.0.0.1", 40000,
                                                                                 "10.0.0.2", 5201)
    assert (rec["zone"], rec["vlan"], rec["switch_ports"]) == (0, None, [1, 3])
    assert (rec["start"], rec["start_from"], rec["end"]) == ("2023-11-14T22:13:20.000Z", "conntrack",
                                                             "2023-11-14T22:13:30.000Z")
    assert rec["duration"] == 10.0 and rec["slow_counted"] == "conntrack"
    assert (rec["slow_orig_packets"], rec["slow_orig_bytes"], rec["slow_reply_packets"], rec["slow_reply_bytes"]) == \
        (3, 180, 2, 120)
    assert (rec["fast_orig_packets"], rec["fast_orig_bytes"], rec["fast_reply_packets"], rec["fast_reply_bytes"]) == \
        (10, 15000, 8, 600)
    assert (rec["packets"], rec["bytes"]) == (23, 15900)


def test_without_counters_the_record_says_why_and_starts_at_the_decision():
    off = flowrecords.record(pair(), config(), "flush", EntryCounts(), now_wall=1000.0, now_mono=130.0)
    assert off["slow_counted"] == "off" and off["slow_orig_bytes"] is None and off["start_from"] == "decision"
    assert off["duration"] == 30.0 and off["bytes"] == 15600  # the switch's only
    none = flowrecords.record(pair(), config(), "flush", None, now_wall=1000.0, now_mono=130.0)
    assert none["slow_counted"] == "none"


def test_the_record_names_the_authority_the_pair_carries():
    from nfshunt.records import cookies, markcodec
    conn = pair()
    conn.mark = markcodec.encode(1, 2, 0)  # the policy said ignore; an IDS's rule shunted it
    conn.authority = cookies.Authority.IDS
    assert flowrecords.record(conn, config(), "x", None, 0.0, 0.0)["authority"] == "ids"
    conn.authority = cookies.Authority.UNKNOWN  # adopted from an older release's cookie
    assert flowrecords.record(conn, config(), "x", None, 0.0, 0.0)["authority"] == "unknown"


def test_records_pair_the_slow_counts_with_their_pair_and_forget_the_oldest(tmp_path, monkeypatch):
    monkeypatch.setattr(flowrecords, "KEPT_MAX", 2)
    path = str(tmp_path / "sub" / "acct.log")
    records = flowrecords.FlowRecords(path, config())
    conn = pair()
    records.slow_counted(conn.orig, conn.ct_id, EntryCounts(packets=(1, 1), bytes=(60, 60)))
    records.slow_counted(conn.reply, 99, EntryCounts(packets=(5, 5), bytes=(9, 9)))  # another entry
    records.ended(conn, "tcp fin")
    records.ended(conn, "again")  # its counts were taken by the first record
    records.handler.flush()
    with open(path) as fh:
        lines = [json.loads(line) for line in fh]
    assert [(r["reason"], r["slow_orig_bytes"]) for r in lines] == [("tcp fin", 60), ("again", None)]
    for n in range(3):
        records.slow_counted(conn.orig, 1000 + n, EntryCounts())
    assert len(records._slow) == 2


def test_the_config_takes_an_accounting_log_path():
    assert config(accounting_log="/var/log/nfshunt/accounting.log").accounting_log.endswith("accounting.log")
    try:
        config(accounting_log="relative.log")
    except ConfigError as exc:
        assert "accounting_log" in str(exc)
    else:
        raise AssertionError("a relative path was taken")
