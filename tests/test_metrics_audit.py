"""Metrics families, the counters status reads back, and the audit record."""
import os

os.environ.setdefault("OSKEN_HUB_TYPE", "native")

from prometheus_client import generate_latest  # noqa: E402

from nfshunt.core import core as c  # noqa: E402
from nfshunt.core.connection import FlowCount  # noqa: E402
from nfshunt.observe.accounting import audit_record  # noqa: E402
from nfshunt.observe.metrics import Metrics  # noqa: E402
from tests.helpers import config, event  # noqa: E402


def snapshot():
    return {"shunts": 3, "blocks": 1, "waiting": 2, "connected": 1, "max_shunts": 10,
            "table_max": 2000, "table_used": 12, "table_1": 10}


def test_counters_are_labelled_prometheus_counters_and_status_reads_them_back():
    snap = snapshot()
    m = Metrics(lambda: snap)
    counters = m.counters
    counters.add("conntrack_event", "new", amount=5)
    for _ in range(4):
        counters.add("ignored", "policy ignore")
    counters.add("installed", "shunt", amount=3)
    counters.add("refused", "shunt")
    counters.add("removed", "shunt", "idle timeout", amount=2)
    counters.add("removed", "shunt", "tcp fin: a:b")  # a reason with colons stays one label
    counters.add("openflow_error", "5", "1")
    counters.add("operator", "flush")
    counters.inc("netlink_overflows", 2)
    counters.inc("switch_connects")
    m.latency.labels("shunt").observe(0.0015)
    text = generate_latest(m.registry).decode()
    for line in ('nfshunt_conntrack_events_total{type="new"} 5.0',
                 'nfshunt_ignored_events_total{reason="policy ignore"} 4.0',
                 'nfshunt_flows_installed_total{action="shunt"} 3.0',
                 'nfshunt_flows_refused_total{action="shunt"} 1.0',
                 'nfshunt_flows_removed_total{action="shunt",reason="idle timeout"} 2.0',
                 'nfshunt_flows_removed_total{action="shunt",reason="tcp fin: a:b"} 1.0',
                 'nfshunt_openflow_errors_total{code="1",type="5"} 1.0',
                 'nfshunt_operator_actions_total{action="flush"} 1.0',
                 'nfshunt_netlink_overflows_total 2.0', 'nfshunt_conntrack_resyncs_total 0.0',
                 'nfshunt_switch_connects_total 1.0', 'nfshunt_switch_connected 1.0',
                 'nfshunt_active{action="shunt"} 3.0', 'nfshunt_active{action="block"} 1.0',
                 'nfshunt_flow_budget_used 4.0', 'nfshunt_flow_budget_max 10.0', 'nfshunt_waiting 2.0',
                 'nfshunt_table_entries_max 2000.0', 'nfshunt_table_entries_used 12.0',
                 'nfshunt_table1_entries_used 10.0',
                 'nfshunt_shunt_latency_seconds_bucket{action="shunt",le="0.002"} 1.0'):
        assert line in text, line
    # What `nfshunt status` shows: only what counted, keyed as the control API always was.
    assert counters.flat() == {
        "conntrack_event:new": 5, "ignored:policy ignore": 4, "installed:shunt": 3, "refused:shunt": 1,
        "removed:shunt:idle timeout": 2, "removed:shunt:tcp fin: a:b": 1, "openflow_error:5:1": 1,
        "operator_flush": 1, "netlink_overflows": 2, "switch_connects": 1}


def test_several_switches_get_gauges_of_their_own():
    snap = snapshot()
    snap["switches"] = [{"datapath_id": "00000000000000a1", "connected": 1, "shunts": 2, "blocks": 0,
                         "table_used": 8},
                        {"datapath_id": "00000000000000a2", "connected": 0, "shunts": 1, "blocks": 1,
                         "table_used": 4}]
    text = generate_latest(Metrics(lambda: snap).registry).decode()
    for line in ('nfshunt_switch_up{datapath_id="00000000000000a2"} 0.0',
                 'nfshunt_switch_active{action="block",datapath_id="00000000000000a2"} 1.0',
                 'nfshunt_switch_table_entries_used{datapath_id="00000000000000a1"} 8.0'):
        assert line in text, line
    snap["switches"] = snap["switches"][:1]  # one switch: the totals say it all
    assert "nfshunt_switch_up" not in generate_latest(Metrics(lambda: snap).registry).decode()


def test_a_pair_member_reports_its_role_and_generation():
    snap = snapshot()
    snap["pair"] = {"wanted": "master", "granted": "master", "generation": 7, "switch_generation": 7,
                    "why_backup": None}
    m = Metrics(lambda: snap)
    m.counters.inc("role_promotions")
    m.counters.add("operator", "role_master")
    text = generate_latest(m.registry).decode()
    for line in ("nfshunt_pair_master 1.0", "nfshunt_pair_generation 7.0", "nfshunt_role_promotions_total 1.0",
                 'nfshunt_operator_actions_total{action="role_master"} 1.0', "nfshunt_role_demotions_total 0.0"):
        assert line in text, line
    assert m.counters.flat() == {"role_promotions": 1, "operator_role_master": 1}
    assert "nfshunt_pair_master" not in generate_latest(Metrics(lambda: snapshot()).registry).decode()


def test_audit_record_has_both_directions_duration_tuple_ports_id_and_reason():
    core = c.Core(config())
    core.switch_connected(c.OFP13)
    core.reconcile([], 0)
    conn = core.conntrack_event(event())[0].conn
    conn.stats = {False: FlowCount(100, 150000, 4.5), True: FlowCount(50, 3300, 4.4)}
    rec = audit_record(conn, "idle timeout")
    assert rec["event"] == "removed" and rec["reason"] == "idle timeout" and rec["ct_id"] == 7
    assert (rec["src"], rec["sport"], rec["dst"], rec["dport"], rec["proto"]) == (
        "10.0.0.1", 40000, "10.0.0.2", 5201, 6)
    assert (rec["ingress"], rec["egress"], rec["switch_ports"]) == (1, 2, [1, 3])
    assert (rec["orig_packets"], rec["orig_bytes"], rec["reply_packets"], rec["reply_bytes"]) == (100, 150000, 50, 3300)
    assert (rec["packets"], rec["bytes"], rec["duration"]) == (150, 153300, 4.5)
    conn.stats = {}
    assert audit_record(conn, "removal not confirmed")["orig_bytes"] is None


def test_close_stops_the_listener_and_lets_the_worker_finish_its_deletes():
    """close() used to return before stopping them (dead code after a return): queued
    conntrack deletes were lost at exit."""
    from types import SimpleNamespace

    from nfshunt.app.switch_app import NFShuntApp
    calls = []
    app = SimpleNamespace(feeds=SimpleNamespace(stop=lambda: calls.append("feeds")), control=None, ids_api=None,
                          ids=None, metrics=SimpleNamespace(stop=lambda: calls.append("metrics")),
                          listener=SimpleNamespace(stop=lambda: calls.append("listener")),
                          worker=SimpleNamespace(stop=lambda: calls.append("worker")),
                          dispatcher=SimpleNamespace(close=lambda: calls.append("route follower")))
    NFShuntApp.close(app)
    assert calls == ["feeds", "metrics", "listener", "route follower", "worker"]


def test_the_worker_runs_what_was_queued_before_it_stops():
    from nfshunt.kernel.worker import ConntrackWorker
    worker = ConntrackWorker(on_dump=lambda events: None, on_malformed=lambda what: None)
    done = []
    worker._send_batch = lambda batch: done.extend(type(item).__name__ for item in batch)  # no kernel needed
    worker.start()
    for i in range(300):
        worker.delete(4, None, i)
    worker.stop()
    assert done == ["Delete"] * 300


def test_requests_of_one_turn_reach_the_worker_as_one_hand_over_in_writes_of_at_most_batch():
    from nfshunt.kernel.worker import ConntrackWorker
    worker = ConntrackWorker(on_dump=lambda events: None, on_malformed=lambda what: None, batch=100)
    writes = []
    worker._send_batch = lambda batch: writes.append([item.ct_id for item in batch])  # no kernel needed
    with worker.batched():
        for i in range(250):
            worker.delete(4, None, i)
        with worker.batched():  # nested: handed over with the outer one
            worker.liberal(4, None, 250)
        assert worker.q.qsize() == 0  # nothing handed over before the turn ends
    assert worker.q.qsize() == 1
    worker.delete(4, None, 251)  # outside a turn: on its own
    worker.start()
    worker.stop()
    assert [len(w) for w in writes] == [100, 100, 51, 1]
    assert [i for w in writes for i in w] == list(range(252))


def test_a_restore_runs_its_callback_whatever_the_write_did_and_is_written_as_a_create():
    import socket

    from pyroute2.netlink.nfnetlink.nfctsocket import nfct_msg

    from nfshunt.kernel.codec import IPCTNL_MSG_CT_NEW, NLM_F_CREATE
    from nfshunt.kernel.worker import ConntrackWorker, Restore
    from nfshunt.records.model import TCP, FlowTuple

    class Unanswered:  # the kernel takes the write and never acknowledges it
        def __init__(self):
            self.sent = []

        def send(self, data):
            self.sent.append(data)

        def recv(self, size):
            raise socket.timeout
    worker = ConntrackWorker(on_dump=lambda events: None, on_malformed=lambda what: None)
    worker.sock.close()
    worker.sock = sock = Unanswered()
    orig = FlowTuple(4, TCP, "10.0.0.1", "10.0.0.2", 40000, 80)
    reply = FlowTuple(4, TCP, "10.0.0.2", "10.0.0.1", 80, 40000)
    calls = []
    item = Restore(4, orig, reply, 8, 10, True, 0x5, lambda: calls.append("done"))
    worker._requests([item])
    assert calls == ["done"]
    (raw,) = sock.sent
    msg = nfct_msg(raw)
    msg.decode()
    assert msg["header"]["type"] & 0xFF == IPCTNL_MSG_CT_NEW and msg["header"]["flags"] & NLM_F_CREATE
    assert msg.get_attr("CTA_MARK") == 5

    def refused(batch):
        raise OSError("no kernel here")
    worker._send_batch = refused
    worker._requests([item])
    assert calls == ["done", "done"]


def test_a_clearing_of_the_marks_is_answered_whatever_it_meets_and_its_failure_counted(monkeypatch):
    """A re-evaluation acts on no decision of the policy's until the kernel's clearing of
    them is answered (operator_api.reevaluate): a failure other than the kernel's refusal
    must not leave it unanswered for ever. It is still counted as the worker's failure."""
    from nfshunt.kernel import worker as wk
    failed = []
    worker = wk.ConntrackWorker(on_dump=lambda events: None, on_malformed=lambda what: None,
                                on_failed=lambda: failed.append(1))

    def broken(_mask, _on_malformed):
        raise ValueError("a message no one expected")
    monkeypatch.setattr(wk, "clear_marks", broken)
    answers = []
    worker.start()
    worker.clear_marks(0x100F0000, lambda *answer: answers.append(answer))
    worker.stop()
    assert answers == [(0, 0, "internal error: ValueError: a message no one expected")] and failed == [1]
