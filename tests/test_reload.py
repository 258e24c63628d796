"""Reloading the config (reload.py, operator_api.reload): a bad file changes nothing, the
live keys change, static shunts change as the difference only, other keys are kept."""
import json
import os
import time
from types import SimpleNamespace

import pytest

os.environ.setdefault("OSKEN_HUB_TYPE", "native")

from nfshunt.app.operator_api import EventControl, OperatorAPI  # noqa: E402
from nfshunt.config import reload  # noqa: E402
from nfshunt.config.settings import from_dict  # noqa: E402
from nfshunt.core import commands as cmds  # noqa: E402
from nfshunt.core import core as c  # noqa: E402
from nfshunt.observe.metrics import Metrics  # noqa: E402
from nfshunt.records import cookies  # noqa: E402
from nfshunt.records.model import UDP, FlowTuple  # noqa: E402
from nfshunt.switch.switch import Switch  # noqa: E402
from tests.helpers import BASE, unbuildable  # noqa: E402

STREAM = {"name": "plc", "protocol": "udp", "src": "10.0.0.1", "dst": "10.0.0.2", "dst_port": 34964,
          "fast_ports": [1, 3]}


def raw(**kw):
    return {**json.loads(json.dumps(BASE)), "openflow_versions": ["1.3"], "static_shunts": [STREAM], **kw}


def test_the_plan_takes_the_live_keys_and_keeps_the_others():
    running = from_dict(raw())
    new = from_dict(raw(default_shunt_timeout=30, listen_port=7000, log_level="DEBUG",
                        static_shunts=[STREAM, {**STREAM, "name": "b", "dst_port": 1}]))
    p = reload.plan(running, new)
    assert set(p.changed) == {"default_shunt_timeout", "log_level", "static_shunts"}
    assert p.kept == ("listen_port",)
    assert p.config.listen_port == running.listen_port and p.config.default_shunt_timeout == 30
    assert len(p.config.static_shunts) == 2 and p.config.switches[0].by_physdevin == running.switches[0].by_physdevin
    assert reload.plan(running, from_dict(raw())).changed == ()


def test_another_list_of_switches_changes_nothing():
    two = {"mark_actions": BASE["mark_actions"], "switches": [
        {"datapath_id": "a1", "ports": BASE["ports"]},
        {"datapath_id": "a2", "ports": [{"fast": 1, "slow": 2, "physdevin": 3}]}]}
    one = {"mark_actions": BASE["mark_actions"], "switches": two["switches"][:1], "default_shunt_timeout": 30}
    p = reload.plan(from_dict(two), from_dict(one))
    assert p.changed == () and "switches" in p.kept and p.config.default_shunt_timeout == 10


def _two(top=None, second=None):
    return from_dict({"mark_actions": BASE["mark_actions"], **(top or {}), "switches": [
        {"datapath_id": "a1", "ports": BASE["ports"]},
        {"datapath_id": "a2", "ports": [{"fast": 1, "slow": 2, "physdevin": 3}], **(second or {})}]})


def test_a_switch_s_key_is_reported_for_each_switch_it_changes():
    """A top-level per-switch key of several switches is each one's default: the plan names
    the switches whose value changes (not the top-level key, which no switch runs with)."""
    p = reload.plan(_two(), _two(top={"drain": 0.2, "flow_layout": "single"}))
    assert p.changed == ("switches[0].drain", "switches[1].drain")
    assert p.kept == ("switches[0].flow_layout", "switches[1].flow_layout")
    assert [sw.drain for sw in p.config.switches] == [0.2, 0.2]
    assert [sw.flow_layout for sw in p.config.switches] == ["auto", "auto"]
    p = reload.plan(_two(second={"drain": 0.1}), _two(top={"drain": 0.3}, second={"drain": 0.1}))
    assert p.changed == ("switches[0].drain",) and [sw.drain for sw in p.config.switches] == [0.3, 0.1]


def test_a_datapath_id_named_at_a_reload_is_kept_until_a_restart():
    """One switch, then the same one as the only entry of `switches` (with its datapath id):
    the running controller still serves any datapath id, and says so."""
    running = from_dict(raw())
    new = from_dict({k: v for k, v in raw().items() if k != "ports"} | {"switches": [
        {"datapath_id": "a1", "ports": BASE["ports"]}]})
    p = reload.plan(running, new)
    assert p.kept == ("datapath_id",) and p.config.switches[0].datapath_id is None


def _app(path, cfg):
    switches = [Switch(cfg, i) for i in range(len(cfg.switches))]
    for sw in switches:
        sw.core.switch_connected(c.OFP13)
        sw.core.reconcile([], 0.0)
    ran = []

    def run(sw, out, waiter=None):
        ran.append(list(out))
        if waiter is not None:
            waiter.set()  # the switch's barrier reply
    return SimpleNamespace(cfg=cfg, config_path=str(path), switches=switches, counters=Metrics(lambda: {}).counters,
                           started=time.time(), run=run, clock=time.monotonic), ran


def _reload(api):
    """A reload asked on the control socket: its steps on the "event loop" (here: at once)."""
    api.app.post = api.handle
    return api.off_loop({"cmd": "reload"}, None)


def test_a_bad_config_changes_nothing_and_says_why(tmp_path):
    path = tmp_path / "nfshunt.json"
    cfg = from_dict(raw())
    app, ran = _app(path, cfg)
    flows = dict(app.switches[0].core.static.flows)
    path.write_text(json.dumps(raw(default_shunt_timeout=30, static_shunts=[{**STREAM, "src": "10.0.0.0/8"}])))
    reply = _reload(OperatorAPI(app))
    assert "nothing changed" in reply["error"] and "static_shunts[0].src" in reply["error"]
    assert app.cfg is cfg and app.switches[0].core.cfg is cfg and app.switches[0].core.static.flows == flows
    assert ran == []
    path.write_text("{")
    assert "not valid JSON" in _reload(OperatorAPI(app))["error"] and app.cfg is cfg


def test_a_good_config_applies_the_difference_and_reports_what_it_kept(tmp_path):
    path = tmp_path / "nfshunt.json"
    app, ran = _app(path, from_dict(raw()))
    sw = app.switches[0]
    kept = set(sw.core.static.flows)
    path.write_text(json.dumps(raw(default_shunt_timeout=30, listen_port=7000,
                                   static_shunts=[STREAM, {**STREAM, "name": "b", "dst_port": 1}])))
    reply = _reload(OperatorAPI(app))
    assert reply["ok"] and reply["confirmed"] and reply["confirmed_ms"] >= 0
    assert reply["static"] == {"added": 2, "removed": 0, "flows": 4}
    assert set(reply["changed"]) == {"default_shunt_timeout", "static_shunts"}
    assert list(reply["kept"]) == ["listen_port"] and "restart" in reply["kept"]["listen_port"]
    (out,) = ran
    (install,) = out
    assert isinstance(install, cmds.InstallStatic) and not kept & {f.cookie for f in install.flows}
    assert sw.core.cfg.default_shunt_timeout == 30 and app.cfg.listen_port == 6653



def _two_raw(**top):
    return {"mark_actions": BASE["mark_actions"], "openflow_versions": ["1.3"], **top, "switches": [
        {"datapath_id": "a1", "ports": BASE["ports"]},
        {"datapath_id": "a2", "ports": [{"fast": 1, "slow": 2, "physdevin": 3}]}]}


def _api_on_a_loop(app):
    """The operator API with its requests' turns run as the event loop runs them: a handler
    that raises is counted, and the loop goes on."""
    api = OperatorAPI(app)

    def loop(ev):
        try:
            api.handle(ev)
        except Exception:
            app.counters.inc("handler_errors")
    app.post = loop
    return api


def test_a_reload_whose_turn_on_the_loop_fails_midway_puts_back_what_it_swapped_and_says_so(tmp_path, caplog):
    """The second switch's core raises midway through its reload (after taking the new keys),
    the first's already reloaded: it was answered "the event loop did not take the reload
    within 5 s: nothing changed" while the controller and the first switch ran the new
    config. Now everything is put back (one config: the old), the answer and the log say
    the turn failed and what runs, it is counted, and the next reload applies whole."""
    path = tmp_path / "nfshunt.json"
    cfg = from_dict(_two_raw())
    app, ran = _app(path, cfg)
    first, second = app.switches
    tables = [sw.core.static.flows for sw in app.switches]
    path.write_text(json.dumps(_two_raw(default_shunt_timeout=30, static_shunts=[STREAM])))  # (STREAM: a1's only)
    reload_ = second.core.static.reload

    def midway(*_args):
        raise KeyError("a bug elsewhere")
    second.core.static.reload = midway
    api = _api_on_a_loop(app)
    reply = api.off_loop({"cmd": "reload"}, None)
    assert "did not take" not in reply["error"], reply
    assert "failed on the controller's event loop" in reply["error"] and "a bug elsewhere" in reply["error"]
    assert "nothing of it kept" in reply["error"] and "the config it ran before" in reply["error"]
    assert app.cfg is cfg and ran == []
    for i, sw in enumerate(app.switches):
        assert sw.cfg is cfg and sw.switch is cfg.switches[i] and sw.core.cfg is cfg
        assert sw.core.switch is cfg.switches[i] and sw.core.static.flows is tables[i]
    assert app.counters.flat().get("internal_errors") == 1 and "operator_reload" not in app.counters.flat()
    (failed,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert failed.exc_info and "failed on the event loop" in failed.getMessage()
    assert "the config running is the one before it" in failed.getMessage()
    second.core.static.reload = reload_
    again = api.off_loop({"cmd": "reload"}, None)
    assert again["confirmed"] and again["static"] == {"added": 2, "removed": 0, "flows": 2}
    assert first.core.cfg.default_shunt_timeout == 30 and second.core.cfg is app.cfg is first.cfg


def test_a_reload_that_cannot_be_put_back_says_the_controller_may_run_part_of_it(tmp_path, caplog):
    """Should putting back fail too, the answer does not claim one config: it says what may
    be running and to restart (the loop logged and counted the exception)."""
    path = tmp_path / "nfshunt.json"
    app, ran = _app(path, from_dict(_two_raw()))
    path.write_text(json.dumps(_two_raw(default_shunt_timeout=30)))
    second = app.switches[1]

    def fails(*_args):
        raise KeyError("a bug elsewhere")
    second.core.static.reload = fails
    second.saved = lambda: fails  # (its putting back fails as well)
    api = _api_on_a_loop(app)
    reply = api.off_loop({"cmd": "reload"}, None)
    assert "may not all be put back" in reply["error"] and "part of the new config; restart it" in reply["error"]
    assert "nothing of it kept" not in reply["error"] and app.counters.flat().get("handler_errors") == 1
    assert any("restart the controller" in r.getMessage() for r in caplog.records if r.levelname == "ERROR")


# --- what a reload's answer says: confirmed only when every flow-mod of it is in the switch --------

def _rig(path, table_size=None, connect=True, **kw):
    """The app on the rig (tests/support), started from the config file at `path` (raw(**kw))."""
    from tests.support.rig import Rig
    path.write_text(json.dumps(raw(**kw)))
    rig = Rig(table_size=table_size, connect=connect, openflow_versions=["1.3"], **{"static_shunts": [STREAM], **kw})
    rig.app.config_path = str(path)
    return rig


def _serve(rig, done, timeout=10.0):
    """Serve the app's event loop until `done` is set (a thread of the reload's posts to it)."""
    deadline = time.monotonic() + timeout
    while not done.is_set():
        assert time.monotonic() < deadline, "not answered in time"
        rig.pump()
        done.wait(0.001)


def _reload_on(rig):
    """A reload posted to the event loop (as SIGHUP's is), answered by the app's operator API
    once the switch has answered (or RELOAD_WAIT passed); its work is done on a thread of its
    own, whose steps the loop serves."""
    ev = EventControl({"cmd": "reload"})
    rig.post(ev)
    _serve(rig, ev.done)
    return ev.reply


def test_a_flow_mod_the_switch_refuses_is_reported_and_the_reload_is_not_confirmed(tmp_path):
    """Table full: 1 of the 2 new flows fits. The answer says which one the switch refused and
    why; it is not "confirmed" (it was, with `flows 4`, whatever the switch said)."""
    path = tmp_path / "nfshunt.json"
    rig = _rig(path, table_size=4 + 2 + 1)  # the defaults, the stream's two flows, and one more
    path.write_text(json.dumps(raw(static_shunts=[STREAM, {**STREAM, "name": "b", "dst_port": 1}])))
    reply = _reload_on(rig)
    assert reply["ok"] and reply["static"] == {"added": 2, "removed": 0, "flows": 4}
    assert reply["confirmed"] is False and reply["confirmed_ms"] is None
    (row,) = reply["switches"]
    assert row["state"] == "failed" and row["sent"] == 2
    (refused,) = row["refused"]
    assert "static flow b (" in refused["flow"] and "table full" in refused["error"]
    assert len(rig.switch.table(0)) == 4 + 2 + 1


def test_a_static_flow_that_cannot_be_built_is_reported_refused_and_the_reload_not_confirmed(tmp_path, monkeypatch):
    """A bug past the config's checks (os-ken refuses what they let through): it was
    "confirmed", with nothing sent. Now it names the flows left out; the entry before stays."""
    path = tmp_path / "nfshunt.json"
    rig = _rig(path)
    rig._check = lambda: None  # (the rig fails a test on an internal error: here the one counted is the point)
    unbuildable(monkeypatch, "b")
    path.write_text(json.dumps(raw(static_shunts=[STREAM, {**STREAM, "name": "b", "dst_port": 1}])))
    reply = _reload_on(rig)
    assert reply["confirmed"] is False
    (row,) = reply["switches"]
    assert row["state"] == "failed" and row["sent"] == 0  # (the flow-mods the switch was sent)
    assert sorted(r["flow"].split(":")[0] for r in row["refused"]) == ["the add of static flow b (original)",
                                                                       "the add of static flow b (reply)"]
    assert {r["error"] for r in row["refused"]} == {"not built: ValueError: not an address"}
    assert len(rig.switch.table(0)) == 4 + 2


def test_a_reload_while_the_switch_is_away_is_pending_not_confirmed(tmp_path):
    """It answered "confirmed by the switch in ~0 ms" with no switch there."""
    path = tmp_path / "nfshunt.json"
    rig = _rig(path, connect=False)
    path.write_text(json.dumps(raw(static_shunts=[STREAM, {**STREAM, "name": "b", "dst_port": 1}])))
    reply = _reload_on(rig)
    assert reply["confirmed"] is False
    (row,) = reply["switches"]
    assert row["state"] == "pending" and "not connected" in row["why"]
    assert reply["static"]["added"] == 2  # the table knows them: they go in when the switch connects
    path.write_text(json.dumps(raw(default_shunt_timeout=30, static_shunts=[STREAM, {**STREAM, "name": "b",
                                                                                     "dst_port": 1}])))
    nothing = _reload_on(rig)  # no flow changes: nothing of it waits for the switch
    assert nothing["confirmed"] is True and nothing["switches"][0]["state"] == "nothing to send"


def test_a_silent_switch_leaves_the_reload_pending(tmp_path, monkeypatch):
    from nfshunt.app import reloading
    from tests.support import fakeswitch as fs
    monkeypatch.setattr(reloading, "RELOAD_WAIT", 0.2)
    path = tmp_path / "nfshunt.json"
    rig = _rig(path)
    rig.switch.mute.add(fs.BARRIER)  # the flow-mods go in; their barrier is never answered
    path.write_text(json.dumps(raw(static_shunts=[STREAM, {**STREAM, "name": "b", "dst_port": 1}])))
    reply = _reload_on(rig)
    assert reply["confirmed"] is False
    (row,) = reply["switches"]
    assert row["state"] == "pending" and "not answered" in row["why"]


def test_a_pairs_backup_sends_nothing_and_says_so(tmp_path):
    path = tmp_path / "nfshunt.json"
    pair = {"pair": {"state_file": str(tmp_path / "pair.json")}, "delete_flows_on_shutdown": False}
    rig = _rig(path, **pair)
    path.write_text(json.dumps(raw(**pair, static_shunts=[STREAM, {**STREAM, "name": "b", "dst_port": 1}])))
    reply = _reload_on(rig)
    assert rig.switch.entries == []  # nothing sent (a real switch refuses a backup's flow-mods: IS_SLAVE)
    (row,) = reply["switches"]
    assert row["state"] == "backup" and reply["confirmed"] is True


def test_the_reload_commands_exit_codes(monkeypatch, capsys, tmp_path):
    """0 confirmed; 3 pending; 4 refused; 2 a config that fails validation (the controller's
    file, or the one --config names); 1 the controller not reached."""
    from nfshunt import cli
    from nfshunt.app import control
    head = {"ok": True, "changed": ["static_shunts"], "static": {"added": 2, "removed": 0, "flows": 4}, "kept": {}}
    answers = {
        0: {**head, "confirmed": True, "confirmed_ms": 0.8,
            "switches": [{"datapath_id": "a1", "state": "confirmed", "sent": 2}]},
        3: {**head, "confirmed": False, "confirmed_ms": None,
            "switches": [{"datapath_id": "a1", "state": "pending", "sent": 0, "why": "not connected"}]},
        4: {**head, "confirmed": False, "confirmed_ms": None,
            "switches": [{"datapath_id": "a1", "state": "failed", "sent": 2,
                          "refused": [{"flow": "the add of static flow b", "error": "table full"}]}]},
        2: {"error": "reload refused, nothing changed: x: static_shunts[0].src: too wide", "invalid_config": True},
        1: {"error": "this controller was not started from a config file"},
    }
    for code, answer in answers.items():
        monkeypatch.setattr(control, "request", lambda _path, _payload, *_timeout, answer=answer: answer)
        assert cli.main(["reload", "--socket", "/nonexistent"]) == code, answer
    out = capsys.readouterr()
    assert "refused: the add of static flow b: table full" in out.out and "NOT confirmed" in out.out
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(SystemExit) as exc:
        cli.main(["reload", "--config", str(bad)])
    assert exc.value.code == 2


def test_the_reload_command_waits_out_the_reloads_own_waits(monkeypatch):
    """Beyond its work (reading and validating the file, sending), a reload's answer may wait
    LOOP_WAIT for the loop to take its swap, LOOP_WAIT for a slice the loop takes late and
    RELOAD_WAIT for the switches' barriers. The command waited 10 s, as for any request: it
    said the controller had not answered (exit 1) while the reload went on, and a retry was
    refused as busy. It waits for those, on top of what any request gets for its work."""
    import inspect

    from nfshunt import cli
    from nfshunt.app import control, reloading
    signature = inspect.signature(control.request)
    waited = []

    def request(*args, **kw):
        bound = signature.bind(*args, **kw)
        bound.apply_defaults()
        waited.append(bound.arguments["timeout"])
        return {"ok": True, "changed": [], "static": {"added": 0, "removed": 0, "flows": 2}, "kept": {},
                "confirmed": True, "confirmed_ms": 0.5, "switches": []}
    monkeypatch.setattr(control, "request", request)
    assert cli.main(["reload", "--socket", "/nonexistent"]) == 0
    any_request = signature.parameters["timeout"].default
    assert waited == [any_request + 2 * reloading.LOOP_WAIT + reloading.RELOAD_WAIT]


def test_a_reload_not_answered_in_time_may_still_be_in_progress_and_the_command_says_where_to_look(
        monkeypatch, capsys, tmp_path):
    """A control socket that takes the request and does not answer within the reload's
    wait: the command says the reload may still be in progress, that its outcome will be in
    the controller's log and that one asked meanwhile is refused as busy; exit 1. (It said
    only that the controller did not answer within 10 s.)"""
    import socket
    import threading

    from nfshunt import cli
    from nfshunt.app import control, reloading
    monkeypatch.setattr(control, "REQUEST_TIMEOUT", 0.1, raising=False)
    monkeypatch.setattr(reloading, "LOOP_WAIT", 0.05)
    monkeypatch.setattr(reloading, "RELOAD_WAIT", 0.05)
    path = str(tmp_path / "nfshunt.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    done = threading.Event()

    def late():
        conn, _ = server.accept()
        with conn:
            conn.recv(1 << 16)  # the request, taken
            done.wait(30)  # the answer would come after the command gave up
    thread = threading.Thread(target=late, daemon=True)
    thread.start()
    t0 = time.monotonic()
    try:
        code = cli.main(["reload", "--socket", path])
    finally:
        done.set()
        thread.join(5)
        server.close()
    took, err = time.monotonic() - t0, capsys.readouterr().err
    assert code == 1 and 0.25 <= took < 5, (code, took)
    assert f"did not answer on {path} within 0.25 s" in err and "may still be in progress" in err
    assert "controller's log" in err and "reload (control socket)" in err and "busy" in err


def test_a_reload_before_the_switch_grants_the_claim_is_not_confirmed(tmp_path):
    """A pair's master reconnected, its role claim not granted yet (the switch has not answered
    it): the switch is connected but not this controller's to program (CoreState.programs), so
    the reload sends none of the change. It answered "confirmed, sent 0" (its row was "backup"
    only when the core had stood by); now the row says the flows wait for the switch to be
    ours, and the reload is not confirmed. Once the claim is granted, they go in."""
    from tests.support import fakeswitch as fs
    from tests.support.rig import FAST_A, FAST_B
    from tests.test_role_link import pair_rig
    pair = {"state_file": str(tmp_path / "pair.json"), "start_role": "master", "role_check_interval": 1.0}
    path = tmp_path / "nfshunt.json"
    path.write_text(json.dumps(raw(pair=pair, delete_flows_on_shutdown=False)))
    rig = pair_rig(tmp_path, static_shunts=[STREAM])
    rig.app.config_path = str(path)
    switch = rig.switch
    switch.mute.add(fs.ROLE)  # the claim at the reconnect is not answered (yet)
    rig.reconnect(switch)
    assert rig.sw.session is not None and not rig.core.shared.programs() and not rig.core.backup
    new = {**STREAM, "name": "new", "dst_port": 5000}
    path.write_text(json.dumps(raw(pair=pair, delete_flows_on_shutdown=False, static_shunts=[STREAM, new])))
    t = FlowTuple(4, UDP, "10.0.0.1", "10.0.0.2", 40000, 5000)
    reply = _reload_on(rig)
    (row,) = reply["switches"]
    assert rig.packet(FAST_A, t).outputs != (FAST_B,)  # nothing of it on the switch
    assert row["state"] == "pending" and "not master of the switch yet" in row["why"] and row["sent"] == 0, row
    assert reply["confirmed"] is False and reply["confirmed_ms"] is None
    switch.mute.discard(fs.ROLE)
    rig.reconnect(switch)  # a claim the switch answers: granted, the switch is programmed whole
    assert rig.core.shared.programs() and rig.packet(FAST_A, t).outputs == (FAST_B,)


NEW = {**STREAM, "name": "new", "dst_port": 5000}  # a stream a reload adds
IN_NEW = FlowTuple(4, UDP, "10.0.0.1", "10.0.0.2", 40000, 5000)  # a tuple it carries


def _blocked_through_a_reload(tmp_path, block, changed=None):
    """A block of IN_NEW held before a reload that adds NEW (or, `changed`, that changes the
    stream that carries it): the reload confirmed, the tuple dropped both ways above the
    stream, the rest of the stream carried. Returns the rig and the drops' hard timeouts."""
    path = tmp_path / "nfshunt.json"
    rig = _rig(path, static_shunts=[STREAM] if changed is None else [STREAM, NEW])
    block(rig)
    path.write_text(json.dumps(raw(static_shunts=[STREAM, changed or NEW])))
    reply = _reload_on(rig)
    assert reply["ok"] and reply["confirmed"], reply
    there, back = (changed or NEW)["fast_ports"]
    assert rig.packet(there, IN_NEW).dropped and rig.packet(back, IN_NEW.reversed()).dropped, \
        "the block is held but the stream the reload added carries its tuple"
    assert rig.packet(there, IN_NEW._replace(sport=40001)).outputs == (back,)  # the rest of the stream flows
    return rig, {e.hard_timeout for e in rig.flows(cookies.Kind.STATIC) if not e.outputs}


def test_an_operators_block_held_before_a_reload_drops_its_tuple_in_a_stream_the_reload_adds(tmp_path):
    """The reload installed the new stream but never looked at the held block pins: the
    tuple crossed the switch for the rest of the block's hour (a restart applied it:
    restore_pins). Its drops take what is left of the pin, as the tick's renewal does."""
    def block(rig):
        assert rig.control({"cmd": "block", "tuple": str(IN_NEW)})["ok"]
        rig.advance(100)
    _, timeouts = _blocked_through_a_reload(tmp_path, block)
    assert timeouts == {3500 + 1}  # what is left of the hour, and the pin's grace (pins.hard_timeout)


def test_an_ids_block_held_before_a_reload_drops_its_tuple_in_a_stream_the_reload_adds(tmp_path):
    from nfshunt.ids.rules import Kind
    from tests.test_ids_backend import rule, setup

    def block(rig):
        _, backend, _, _ = setup(rig=rig)
        assert backend.submit(rule(rig, Kind.BLOCK, connection=IN_NEW, expire=30), 1.0).result.value == "added"
    _, timeouts = _blocked_through_a_reload(tmp_path, block)
    assert timeouts == {31}  # the rule's end and a second, as its drops get at the block


def test_a_block_held_before_a_reload_that_changes_its_streams_ports_drops_it_on_the_new_ports(tmp_path):
    """The stream that carries the blocked tuple moves to other fast ports (here the same two
    the other way round): the old drops' in_port no longer meets it, so the changed
    stream's flows get theirs."""
    rig_ports = {**NEW, "fast_ports": [3, 1]}

    def block(rig):
        assert rig.control({"cmd": "block", "tuple": str(IN_NEW)})["ok"]
    _blocked_through_a_reload(tmp_path, block, changed=rig_ports)
