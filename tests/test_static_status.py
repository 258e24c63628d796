"""What status and the metrics show of the static shunts (core/static_view.py): counts and
sums by default, whatever the number of flows; the per-flow rows a page at a time, only when
asked; the metrics' per-stream counters summed when the counters are read. (With 10,000
streams a status built one row per flow: 0.25 s of the event loop and a 9.9 MB answer.)"""
import json
import os
import time
from types import SimpleNamespace

os.environ.setdefault("OSKEN_HUB_TYPE", "native")

from prometheus_client import generate_latest  # noqa: E402

from nfshunt.app.operator_api import STATIC_LIMIT_MAX, EventControl, OperatorAPI, StaticListing, gauges  # noqa: E402
from nfshunt.config.settings import from_dict  # noqa: E402
from nfshunt.core import core as c  # noqa: E402
from nfshunt.observe.metrics import Metrics  # noqa: E402
from nfshunt.records import cookies  # noqa: E402
from nfshunt.records.model import FlowTuple, SwitchFlow  # noqa: E402
from nfshunt.switch.switch import Switch  # noqa: E402
from tests.helpers import BASE, config  # noqa: E402


def streams(n, net=1, **kw):
    """n named streams host to host, none overlapping another."""
    return [{"name": f"cell-{i}", "protocol": "udp", "src": f"10.{net}.{i // 250}.{i % 250 + 1}",
             "dst": "10.0.0.2", "dst_port": 30000, "fast_ports": [1, 3], **kw} for i in range(n)]


def _api(cfg):
    """The operator API over one switch's core, every static flow read back with counters."""
    sw = Switch(cfg, 0)
    sw.core.switch_connected(c.OFP13)
    sw.core.reconcile([], 0.0)
    sw.core.static.counted([SwitchFlow(cookie, f.priority, f.in_port, None, f.out_port, i + 1, 100 * (i + 1), 5.0)
                            for i, (cookie, f) in enumerate(sw.core.static.flows.items())])
    app = SimpleNamespace(switches=[sw], ids=None, counters=Metrics(lambda: {}).counters, started=time.time(),
                          clock=time.monotonic,
                          run=lambda sw, out: None, cfg=cfg)
    return OperatorAPI(app)


def _ask(api, request):
    ev = EventControl(request)
    api.handle(ev)
    assert ev.done.is_set()
    return ev.reply


def test_the_default_status_counts_the_static_flows_in_the_same_few_hundred_bytes_for_2_or_10000():
    small = _ask(_api(config(openflow_versions=["1.3"], static_shunts=streams(1))), {"cmd": "status",
                                                                                    "connections": False})
    big = _ask(_api(config(openflow_versions=["1.3"], static_shunts=streams(5000))), {"cmd": "status",
                                                                                     "connections": False})
    n = 10_000
    assert big["static"] == {"streams": 5000, "flows": n, "on_switch": n, "missing": 0,
                             "packets": n * (n + 1) // 2, "bytes": 100 * n * (n + 1) // 2}
    assert big["switches"][0]["static"] == big["static"] and "static_shunts" not in big
    size = len(json.dumps(big))
    assert size < 4096 and size - len(json.dumps(small)) < 100, size



def test_a_switch_put_back_after_a_reload_has_its_static_table_and_counts_whole():
    """A reload whose turn fails after this switch took it in puts the switch back
    (Switch.saved, app/reloading.py): its keys, the core's, the static table, and the
    counters of the flows that reload had removed (it popped them from the one dict the
    table kept, so they were gone even once the flows were back)."""
    cfg = config(openflow_versions=["1.3"], static_shunts=streams(4))
    api = _api(cfg)
    sw = api.switches[0]
    table = sw.core.static
    before, counts = _ask(api, {"cmd": "status", "connections": False})["static"], dict(table.counts)
    put_back = sw.saved()
    new = config(openflow_versions=["1.3"], static_shunts=streams(2), default_shunt_timeout=30)
    sw.reload(new, table.change(new, new.switches[0]), 0.0)
    assert len(table.flows) == 4 and sw.core.cfg is new and len(table.counts) == 4
    put_back()
    assert sw.cfg is sw.core.cfg is cfg and sw.switch is sw.core.switch is cfg.switches[0]
    assert len(table.flows) == 8 and table.counts == counts and len(counts) == 8
    assert _ask(api, {"cmd": "status", "connections": False})["static"] == before

def test_the_rows_are_listed_a_page_at_a_time_across_every_switch_and_by_name():
    cfg = from_dict({"mark_actions": BASE["mark_actions"], "openflow_versions": ["1.3"], "switches": [
        {"datapath_id": "a1", "ports": BASE["ports"]},
        {"datapath_id": "a2", "ports": [{"fast": 1, "slow": 2, "physdevin": 3}, {"fast": 3, "slow": 4,
                                                                                 "physdevin": 4}]}],
        "static_shunts": [*streams(3, datapath_id="a1"),
                          *[{**s, "name": f"b-{i}", "datapath_id": "a2"} for i, s in enumerate(streams(2, net=2))]]})
    switches = [Switch(cfg, i) for i in range(2)]
    every = [(sw.name, cookie) for sw in switches for cookie in sw.core.static.flows]
    assert len(every) == 10
    seen, pages, offset = [], [], 0
    while offset is not None:
        got = StaticListing(None, offset, 4).page(switches)
        seen += [(row["datapath_id"], int(row["cookie"], 16)) for row in got["static_shunts"]]
        pages.append(len(got["static_shunts"]))
        assert got["static_page"]["matched"] == 10
        offset = got["static_page"]["next"]
    assert pages == [4, 4, 2] and seen == every  # each row once, in the switches' and tables' order
    one = StaticListing("b-1", 0, 4).page(switches)
    assert [(r["name"], r["direction"], r["datapath_id"]) for r in one["static_shunts"]] == [
        ("b-1", "original", switches[1].name), ("b-1", "reply", switches[1].name)]
    assert one["static_page"] == {"name": "b-1", "offset": 0, "limit": 4, "matched": 2, "next": None}
    past = StaticListing(None, 10, 4).page(switches)
    assert past["static_shunts"] == [] and past["static_page"]["next"] is None


def test_a_bad_listing_request_is_refused_with_the_reason():
    api = _api(config(openflow_versions=["1.3"], static_shunts=streams(2)))
    for bad, why in (({"static": "yes"}, "static must be true or false"),
                     ({"static": True, "limit": 0}, f"limit must be an integer 1-{STATIC_LIMIT_MAX}"),
                     ({"static": True, "limit": STATIC_LIMIT_MAX + 1}, "limit must be"),
                     ({"static": True, "limit": True}, "limit must be"),
                     ({"static": True, "offset": -1}, "offset must be"),
                     ({"static": True, "name": 5}, "name must be")):
        reply = _ask(api, {"cmd": "status", "connections": False, **bad})
        assert reply == {"error": reply["error"], "bad_input": True} and why in reply["error"], (bad, reply)
    unknown = _ask(api, {"cmd": "status", "connections": False, "static": True, "name": "nobody"})
    assert unknown["static_shunts"] == [] and unknown["static_page"]["matched"] == 0


def _by_stream(rows):
    """Per-flow rows added up by stream and direction (what the metrics must show)."""
    out = {}
    for r in rows:
        if r["on_switch"]:
            p, b = out.get((r["name"], r["direction"]), (0, 0))
            out[r["name"], r["direction"]] = (p + r["packets"], b + r["bytes"])
    return out


def _listed(rig):
    """Every static flow's row, page by page through the control socket's request."""
    rows, offset = [], 0
    while offset is not None:
        reply = rig.control({"cmd": "status", "static": True, "limit": 7, "offset": offset})
        rows += reply["static_shunts"]
        offset = reply["static_page"]["next"]
    return rows


def _gauged(rig):
    st = gauges(rig.app.switches)["static"]
    return st["flows"], st["missing"], {(s["name"], s["direction"]): (s["packets"], s["bytes"])
                                        for s in st["by_stream"]}


def test_the_metrics_per_stream_counters_equal_the_rows_sums_as_read_and_after_a_reload(tmp_path):
    """On the rig: frames through some streams' flows, one flow gone from the switch; the
    gauges (summed when the counters were read) equal the per-flow rows' sums, status's
    counts too; a reload that removes streams takes their counts out at once."""
    from tests.support.rig import FAST_A, FAST_B, Rig
    from tests.test_reload import _serve
    entries = streams(12)
    rig = Rig(openflow_versions=["1.3"], static_shunts=entries)
    for i in (0, 3, 3, 7, 11):
        t = FlowTuple(4, 17, f"10.1.0.{i + 1}", "10.0.0.2", 4000 + i, 30000)
        assert rig.packet(FAST_A, t, payload=100 + i).outputs == (FAST_B,)
        assert rig.packet(FAST_B, t.reversed()).outputs == (FAST_A,)
    flows = rig.core.static.flows
    (gone,) = [e for e in rig.switch.entries if e.cookie in flows and flows[e.cookie].shunt.name == "cell-5"
               and not flows[e.cookie].reply]
    rig.switch.entries.remove(gone)
    rig.advance(1)  # the counters read
    rows = _listed(rig)
    assert len(rows) == 24 and len({r["cookie"] for r in rows}) == 24
    sums = _by_stream(rows)
    assert sums["cell-3", "original"][0] == 2 and sums["cell-7", "reply"][0] == 1
    assert _gauged(rig) == (24, 1, sums)
    st = rig.control({"cmd": "status", "connections": False})["static"]
    assert st == {"streams": 12, "flows": 24, "on_switch": 23, "missing": 1,
                  "packets": sum(p for p, _ in sums.values()), "bytes": sum(b for _, b in sums.values())}
    text = generate_latest(rig.app.metrics.registry).decode()
    assert 'nfshunt_static_packets_total{direction="original",name="cell-3"} 2.0' in text
    assert "nfshunt_static_flows 24.0" in text and "nfshunt_static_flows_missing 1.0" in text
    # A reload keeps cell-0..5 and drops the rest: their counts out before the next read.
    path = tmp_path / "nfshunt.json"
    path.write_text(json.dumps({**BASE, "openflow_versions": ["1.3"], "static_shunts": entries[:6]}))
    rig.app.config_path = str(path)
    ev = EventControl({"cmd": "reload"})
    rig.post(ev)
    _serve(rig, ev.done)
    assert ev.reply["confirmed"] and len(rig.flows(cookies.Kind.STATIC)) == 11
    rows = _listed(rig)
    assert len(rows) == 12 and _gauged(rig) == (12, 1, _by_stream(rows))
    assert rig.control({"cmd": "status", "connections": False})["static"]["packets"] == sum(
        p for p, _ in _by_stream(rows).values())



def test_nfshunt_status_prints_the_counts_and_with_static_a_page_of_rows(monkeypatch, capsys):
    """The CLI: one line of counts by default (and how to list them); --static NAME --limit
    asks for that page and says where the listing stands."""
    from nfshunt import cli
    from nfshunt.app import control
    api = _api(config(openflow_versions=["1.3"], static_shunts=streams(3)))
    asked = []
    monkeypatch.setattr(control, "request", lambda _path, payload: asked.append(payload) or _ask(api, payload))
    assert cli.main(["status", "--socket", "/nonexistent"]) == 0
    out = capsys.readouterr().out
    assert "static shunts: 3 streams, 6 flows, 6 on the switch; packets 21, bytes 2.1K  (nfshunt status --static" \
        in out and "static flows" not in out
    assert cli.main(["status", "--socket", "/nonexistent", "--static", "cell-1", "--limit", "1"]) == 0
    assert asked[-1] == {"cmd": "status", "static": True, "limit": 1, "offset": 0, "name": "cell-1"}
    out = capsys.readouterr().out
    assert "static flows of 'cell-1': 1-1 of 2; the next: --offset 1" in out
    (row,) = [line for line in out.splitlines() if line.startswith("cell-1 ")]
    assert "udp 10.1.0.2/32:* -> 10.0.0.2/32:30000 port 1 -> 3" in row
