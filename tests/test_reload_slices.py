"""A reload off the event loop (app/reloading.py): the file read and validated on the thread
that asked, the difference sent in slices, each its own turn of the loop, with what came
meanwhile served between them; one reload at a time. Rig tests drive the real app; the
slicing itself is tested as the pure function it is. (How long a slice holds the loop is
measured in bench/, `bench/run.py reload-hold`, not timed here.)"""
import collections
import json
import os
import threading
import time

import pytest

os.environ.setdefault("OSKEN_HUB_TYPE", "native")

from nfshunt.app import reloading  # noqa: E402
from nfshunt.app.operator_api import EventControl  # noqa: E402
from nfshunt.config.settings import from_dict  # noqa: E402
from nfshunt.config.static import switch_flows  # noqa: E402
from nfshunt.core import commands as c  # noqa: E402
from nfshunt.records import cookies  # noqa: E402
from tests.test_reload import STREAM, _reload_on, _rig, _serve, raw  # noqa: E402


def streams(n, net=1):
    """n streams host to host, none overlapping another or STREAM."""
    return [{"protocol": "udp", "src": f"10.{net}.{i // 250}.{i % 250 + 1}", "dst": "10.0.0.2", "dst_port": 30000,
             "fast_ports": [1, 3]} for i in range(n)]


def one_turn(rig, timeout=5.0):
    """One event of the app's queue served (a reload's thread posts its steps one at a time)."""
    ev, state = rig.app.events.get(timeout=timeout)
    for handler in rig.app.get_handlers(ev, state):
        handler(ev)
    return ev


def recorded_status(rig):
    """A status request that notes how many static flows the switch held when it was answered
    (os-ken finds a handler by the event's own class: the instance's answer is wrapped)."""
    ev = EventControl({"cmd": "status", "connections": False})
    answer, ev.static_then = ev.answer, None

    def noted(reply):
        ev.static_then = len(rig.flows(cookies.Kind.STATIC))
        answer(reply)
    ev.answer = noted
    return ev


@pytest.fixture
def small_slices(monkeypatch):
    """Slices of 50 flow-mods, whatever their pace (the fake switch is no real one's)."""
    for name in ("FIRST_SLICE", "MIN_SLICE", "MAX_SLICE"):
        monkeypatch.setattr(reloading, name, 50)


def test_a_status_asked_during_a_reload_is_answered_between_its_slices(tmp_path, small_slices):
    """300 new streams (600 flow-mods) in slices of 50: a status asked once the first slice is
    in is answered before the second's successor, with at most 100 of them on the switch.
    (It was answered after the whole reload: one turn of the loop read the file, validated
    it and sent every flow-mod.)"""
    path = tmp_path / "nfshunt.json"
    rig = _rig(path)
    path.write_text(json.dumps(raw(static_shunts=[STREAM, *streams(300)])))
    reload_ev = EventControl({"cmd": "reload"})
    rig.post(reload_ev)
    one_turn(rig)  # the request: a thread of its own reads the file
    assert isinstance(one_turn(rig).context, reloading.Step)  # the loop's turn: config swapped, tables diffed
    assert len(rig.flows(cookies.Kind.STATIC)) == 2  # nothing sent yet
    one_turn(rig)  # the first slice
    assert len(rig.flows(cookies.Kind.STATIC)) == 2 + 50
    status = recorded_status(rig)
    rig.post(status)
    while not status.done.is_set():
        one_turn(rig)
    assert status.reply["static"]["flows"] == 602 and 2 + 50 <= status.static_then <= 2 + 100
    assert not reload_ev.done.is_set()
    _serve(rig, reload_ev.done)
    reply = reload_ev.reply
    assert reply["confirmed"] and reply["static"] == {"added": 600, "removed": 0, "flows": 602}
    assert reply["slices"] == 12 and reply["switches"][0]["sent"] == 600
    assert len(rig.flows(cookies.Kind.STATIC)) == 602


def test_a_second_reload_while_one_is_applied_is_refused_and_changes_nothing(tmp_path, small_slices, monkeypatch):
    """Asked as soon as the loop has applied the first, before the first's thread has run on
    (held here; a loaded CI run once got there first): it is told the first is being
    applied, not still being validated."""
    path = tmp_path / "nfshunt.json"
    rig = _rig(path)
    path.write_text(json.dumps(raw(default_shunt_timeout=30, static_shunts=[STREAM, *streams(200)])))
    held, on_loop = threading.Event(), reloading.Reloader._on_loop

    def holding(self, work):
        reply = on_loop(self, work)
        if reply is not None and "applied" in reply:
            held.wait(10)
        return reply
    monkeypatch.setattr(reloading.Reloader, "_on_loop", holding)
    first = EventControl({"cmd": "reload"})
    rig.post(first)
    one_turn(rig)
    one_turn(rig)  # applied: the config swapped in, the slices to come
    path.write_text(json.dumps(raw(default_shunt_timeout=40, static_shunts=[STREAM])))
    second = rig.app.operator.off_loop({"cmd": "reload"}, None)  # (what the control socket's thread does)
    held.set()
    assert second is not None and second["busy"] is True
    assert "reload refused, nothing changed" in second["error"] and "being applied: 0 of 400" in second["error"]
    _serve(rig, first.done)
    assert first.reply["confirmed"] and first.reply["static"]["added"] == 400
    assert rig.core.cfg.default_shunt_timeout == 30 and len(rig.flows(cookies.Kind.STATIC)) == 402
    # Once it is answered, the next is done.
    again = EventControl({"cmd": "reload"})
    rig.post(again)
    _serve(rig, again.done)
    assert again.reply["confirmed"] and again.reply["static"] == {"added": 0, "removed": 400, "flows": 2}
    assert rig.core.cfg.default_shunt_timeout == 40 and len(rig.flows(cookies.Kind.STATIC)) == 2


def test_the_file_is_read_and_validated_off_the_event_loop(tmp_path, monkeypatch):
    """The config file is read and checked on the thread that asked, never on the loop's."""
    from nfshunt.config import settings
    path = tmp_path / "nfshunt.json"
    rig = _rig(path)
    path.write_text(json.dumps(raw(static_shunts=[STREAM, *streams(3)])))
    readers, load = [], settings.load
    monkeypatch.setattr(settings, "load", lambda p: readers.append(threading.current_thread()) or load(p))
    ev = EventControl({"cmd": "reload"})
    rig.post(ev)
    _serve(rig, ev.done)
    assert ev.reply["confirmed"] and readers and threading.current_thread() not in readers  # (the rig's loop: ours)
    path.write_text("{")
    bad = rig.app.operator.off_loop({"cmd": "reload"}, None)  # (what the control socket's thread does)
    assert bad is not None and bad["invalid_config"] and len(readers) == 2  # refused off the loop: nothing posted
    assert rig.app.events.empty()


def test_a_step_the_loop_does_not_take_in_time_is_never_done(tmp_path, monkeypatch):
    """A loop that takes no step within LOOP_WAIT: the reload says so and nothing changed,
    and the step, taken later, does nothing."""
    monkeypatch.setattr(reloading, "LOOP_WAIT", 0.05)
    path = tmp_path / "nfshunt.json"
    rig = _rig(path)
    path.write_text(json.dumps(raw(default_shunt_timeout=30, static_shunts=[STREAM, *streams(3)])))
    reply = rig.app.operator.off_loop({"cmd": "reload"}, None)  # nobody serves the loop
    assert "did not take the reload" in reply["error"] and "nothing changed" in reply["error"]
    late = one_turn(rig)
    assert isinstance(late.context, reloading.Step) and not late.done.is_set()
    assert rig.core.cfg.default_shunt_timeout != 30 and len(rig.flows(cookies.Kind.STATIC)) == 2



def test_a_swap_that_fails_on_the_loop_leaves_the_running_config_whole(tmp_path, monkeypatch):
    """On the real event loop: the core's static table raises midway through the swap (the
    core has taken the new keys by then). Everything is put back, the session's flow builder
    too, nothing is sent; the answer says the turn failed, not that the loop did not take
    it (which was said, with the new config half in)."""
    from nfshunt.core.static_table import StaticTable
    path = tmp_path / "nfshunt.json"
    rig = _rig(path)
    rig._check = lambda: None  # (the rig fails a test on an internal error: here the one counted is the point)
    cfg, flows = rig.app.cfg, rig.core.static.flows
    path.write_text(json.dumps(raw(default_shunt_timeout=30, static_shunts=[STREAM, *streams(3)])))

    def midway(*_args):
        raise ValueError("a bug elsewhere")
    monkeypatch.setattr(StaticTable, "reload", midway)
    ev = EventControl({"cmd": "reload"})
    rig.post(ev)
    _serve(rig, ev.done)
    assert "failed on the controller's event loop (ValueError: a bug elsewhere)" in ev.reply["error"]
    assert "did not take" not in ev.reply["error"] and "nothing of it kept" in ev.reply["error"]
    assert rig.app.cfg is cfg and rig.sw.cfg is cfg and rig.core.cfg is cfg and rig.s.fb.cfg is cfg
    assert rig.sw.switch is rig.core.switch is rig.s.fb.switch is cfg.switches[0]
    assert rig.core.static.flows is flows and len(rig.flows(cookies.Kind.STATIC)) == 2
    assert rig.counters.flat()["internal_errors"] == 1


def test_a_slice_whose_turn_fails_is_reported_so_not_as_not_taken(tmp_path, small_slices):
    """The second slice's turn raises: that switch's change is pending, and says its turn
    failed (it said the loop had not taken it within 5 s); the first slice is in."""
    path = tmp_path / "nfshunt.json"
    rig = _rig(path)
    rig._check = lambda: None
    path.write_text(json.dumps(raw(static_shunts=[STREAM, *streams(100)])))
    run, slices = rig.app.run, []

    def second_fails(sw, commands, waiter=None):
        if isinstance(waiter, reloading.SliceWatch):
            slices.append(waiter)
            if len(slices) == 2:
                raise RuntimeError("a bug elsewhere")
        run(sw, commands, waiter)
    rig.app.run = second_fails
    reply = _reload_on(rig)
    (row,) = reply["switches"]
    assert row["state"] == "pending" and "did not take" not in row["why"], row
    assert "turn sending the change's next flow-mods failed (RuntimeError: a bug elsewhere" in row["why"]
    assert "50 of 200 sent before it" in row["why"] and len(rig.flows(cookies.Kind.STATIC)) == 2 + 50
    assert rig.counters.flat()["handler_errors"] == 1


# --- the slices themselves ----------------------------------------------------------------

def _flows(n):
    cfg = from_dict(raw(static_shunts=streams(n)))
    return tuple(switch_flows(cfg, cfg.switches[0]).values())


def test_slices_keep_the_order_and_split_only_static_changes():
    flows = _flows(60)  # 120 flows
    cookies_ = tuple(range(70))
    out = [c.LimitPacketIns(50), c.InstallStatic(flows, "reload"),
           c.RemoveStatic(cookies_, tuple(map(str, cookies_)), "reload")]
    work = collections.deque(out)
    slices = []
    while work:
        slices.append(reloading.take(work, 50))
    assert [sum(map(reloading.flow_mods, s)) for s in slices] == [50, 50, 50, 41]
    joined = [cmd for s in slices for cmd in s]
    assert joined[0] == out[0]
    assert tuple(f for cmd in joined if isinstance(cmd, c.InstallStatic) for f in cmd.flows) == flows
    removals = [cmd for cmd in joined if isinstance(cmd, c.RemoveStatic)]
    assert tuple(k for cmd in removals for k in cmd.cookies) == cookies_
    assert tuple(w for cmd in removals for w in cmd.what) == tuple(map(str, cookies_))
    # Every install comes before every removal (a changed entry's new flow overwrites the old first).
    kinds = [type(cmd) for cmd in joined]
    assert kinds.index(c.RemoveStatic) > max(i for i, k in enumerate(kinds) if k is c.InstallStatic)


def test_a_slice_is_sized_to_the_budget_at_the_last_ones_pace():
    pace = reloading.SLICE_BUDGET / 500  # the time of one flow-mod at which 500 fill the budget
    sizer = reloading.Sizer()
    assert sizer.size == reloading.FIRST_SLICE == 200
    sizer.took(200, 200 * pace)  # 500 would fit, but at most twice the last
    assert sizer.size == 400
    sizer.took(400, 400 * pace)
    assert sizer.size == pytest.approx(500, abs=1)
    sizer.took(500, 500 * pace * 10)  # ten times slower (a loaded machine): fifty
    assert sizer.size == pytest.approx(50, abs=1)
    sizer.took(50, 1.0)  # however slow, a slice moves on
    assert sizer.size == reloading.MIN_SLICE
    sizer.took(5, 1e-9)  # too few to tell the pace
    assert sizer.size == reloading.MIN_SLICE
    for _ in range(20):
        sizer.took(sizer.size, 0.0)
    assert sizer.size == reloading.MAX_SLICE


def test_the_signal_pipe_reads_a_sighup_at_once():
    """The controller's main thread blocks on the wakeup pipe: a SIGHUP is read the moment
    it comes (it looked every 0.5 s)."""
    import signal

    from nfshunt.app import controller
    old = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)}
    try:
        signals = controller.Signals()
        sent = []

        def hup():
            time.sleep(0.05)
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGHUP)
        threading.Thread(target=hup).start()
        assert signals.wait() == [signal.SIGHUP]
        assert time.monotonic() - sent[0] < 0.25  # (a poll's half period on average; here: microseconds)
    finally:
        signal.set_wakeup_fd(-1)
        for s, handler in old.items():
            signal.signal(s, handler)


def test_while_a_reload_is_prepared_a_waiting_thread_gets_the_interpreter_sooner(tmp_path, monkeypatch):
    """Reading and checking 10,000 entries is a second of CPU on the reload's thread: the
    event loop and the conntrack listener, waiting for the interpreter's lock, get it within
    PREPARE_SWITCH instead of Python's 5 ms; afterwards (a bad file too) the interval is back."""
    import sys

    from nfshunt.config import settings
    path = tmp_path / "nfshunt.json"
    rig = _rig(path)
    seen, load = [], settings.load
    monkeypatch.setattr(settings, "load", lambda p: seen.append(sys.getswitchinterval()) or load(p))
    before = sys.getswitchinterval()
    path.write_text("{")
    assert rig.app.operator.off_loop({"cmd": "reload"}, None)["invalid_config"]
    assert seen == [reloading.PREPARE_SWITCH] and sys.getswitchinterval() == before
