"""The os-ken app itself (app/switch_app.py), built as `nfshunt run` builds it: os-ken's
AppManager loads the module and makes the app from a minimal config (the host's kernel
faked: the listener needs root), no thread started. Each handler is fed a fake event
through os-ken's own dispatch (the event queue, the handler table by event class and
dispatcher state) and must reach the object whose job it is, with no handler error."""
from __future__ import annotations

import threading
from typing import Any

import pytest
from os_ken.base import app_manager
from os_ken.controller import ofp_event
from os_ken.controller.handler import CONFIG_DISPATCHER, DEAD_DISPATCHER, MAIN_DISPATCHER
from os_ken.ofproto import ofproto_protocol

from nfshunt.app import switch_app
from nfshunt.app.operator_api import EventControl
from nfshunt.ids.loop import EventIds
from nfshunt.switch.feeds import EventConntrack, EventOverflow, EventRun, EventShutdown, EventTick, EventWatch
from tests.helpers import config, event
from tests.support import fakeswitch as fs
from tests.support.kernel import FakeListener, FakePolicy, FakeWorker


@pytest.fixture
def app(monkeypatch):
    """The app as controller.run makes it (AppManager), not started; closed and
    unregistered afterwards."""
    cfg = config(control_socket=None)
    monkeypatch.setattr(switch_app.NFShuntApp, "Worker", FakeWorker)
    monkeypatch.setattr(switch_app.NFShuntApp, "Listener", FakeListener)
    monkeypatch.setattr(switch_app.NFShuntApp, "Policy", FakePolicy)
    monkeypatch.setattr(switch_app.NFShuntApp, "OFP_VERSIONS", cfg.ofp_versions)
    # os-ken narrows its process-wide versions to the app's: put them back afterwards.
    monkeypatch.setattr(ofproto_protocol, "_supported_versions", set(ofproto_protocol._supported_versions))
    manager = app_manager.AppManager()
    manager.load_apps(["nfshunt.app.switch_app"])
    manager.create_contexts()
    threads = threading.active_count()
    # (os-ken's OpenFlow handler comes with it: the service its events come from; not made here)
    assert set(manager.applications_cls) == {"nfshunt.app.switch_app", "os_ken.controller.ofp_handler"}
    made = manager.instantiate(manager.applications_cls["nfshunt.app.switch_app"], nfshunt_config=cfg)
    assert isinstance(made, switch_app.NFShuntApp) and threading.active_count() == threads
    made.is_active = False  # its loop (run by the test) returns once the queue is empty
    yield made
    manager.uninstantiate(made.name)
    assert made.name not in app_manager.SERVICE_BRICKS


def serve(app: Any, ev: Any, state: str | None = None) -> None:
    """An event through os-ken's send path and the app's own loop."""
    if state is None:
        app.send_event(app.name, ev)
    else:
        app.send_event(app.name, ev, state)
    app._event_loop()


def spy(monkeypatch, obj: Any, name: str, calls: list[str]) -> None:
    real = getattr(obj, name)

    def called(*args: Any, **kwargs: Any) -> Any:
        calls.append(f"{type(obj).__name__}.{name}")
        return real(*args, **kwargs)
    monkeypatch.setattr(obj, name, called)


def state_change(dp: Any, state: str) -> Any:
    ev = ofp_event.EventOFPStateChange(dp)
    ev.state = state
    return ev


def test_every_handler_is_fed_a_fake_event_and_reaches_its_object(app, monkeypatch):
    calls: list[str] = []
    for obj, names in ((app.peers, ("features", "connected", "dead")),
                       (app.replies, ("reply", "stats", "error", "packet_in", "flow_removed")),
                       (app.housekeeping, ("tick", "watch", "shutdown")),
                       (app.operator, ("handle",)), (app.worker, ("dump",)), (app.router, ("dispatch",)),
                       (app.dispatcher, ("run",))):
        for name in names:
            spy(monkeypatch, obj, name, calls)
    app.run = app.dispatcher.run  # (the app keeps the dispatcher's run as its own)
    dp = fs.FakeSwitch()
    ofp = dp.ofproto
    sw = app.switches[0]

    def fed(ev: Any, state: str | None, *expected: str) -> None:
        calls.clear()
        serve(app, ev, state)
        missing = [e for e in expected if e not in calls]
        assert not missing, f"{type(ev).__name__}: {missing} not reached (reached {calls})"

    fed(ofp_event.ofp_msg_to_ev(dp.features()), CONFIG_DISPATCHER, "Peers.features")
    fed(state_change(dp, MAIN_DISPATCHER), MAIN_DISPATCHER, "Peers.connected")
    assert sw.session is not None and sw.session.dp is dp and dp.asked[fs.TABLE] == 1  # programmed
    dp.replies.clear()
    replies = {ofp.OFPT_BARRIER_REPLY: ("Replies.reply", b""),
               ofp.OFPT_ROLE_REPLY: ("Replies.reply", b"\0" * 16),
               ofp.OFPT_MULTIPART_REPLY: ("Replies.stats", None)}
    for msg_type, (expected, body) in replies.items():
        if body is not None:
            fed(ofp_event.ofp_msg_to_ev(dp.reply(msg_type, 77, body)), MAIN_DISPATCHER, expected)
    for kind in (ofp.OFPMP_FLOW, ofp.OFPMP_METER, ofp.OFPMP_TABLE_FEATURES):
        dp.multipart(77, kind, [])
        fed(ofp_event.ofp_msg_to_ev(dp.replies.pop()), MAIN_DISPATCHER, "Replies.stats")
    dp.error(78, ofp.OFPET_BAD_REQUEST, ofp.OFPBRC_BAD_TYPE, b"")
    fed(ofp_event.ofp_msg_to_ev(dp.replies.pop()), MAIN_DISPATCHER, "Replies.error")
    dp.packet_in(fs.PacketIn(0x1234, 0, {"in_port": 1}, 128), 60)
    fed(ofp_event.ofp_msg_to_ev(dp.replies.pop()), MAIN_DISPATCHER, "Replies.packet_in")
    dp.entries.clear()
    fed(ofp_event.ofp_msg_to_ev(_flow_removed(dp)), MAIN_DISPATCHER, "Replies.flow_removed")
    app.feeds._handover_room.acquire()  # (as the listener's hand-over does)
    fed(EventConntrack([event()]), None, "Router.dispatch", "Dispatcher.run")
    fed(EventOverflow(), None, "FakeWorker.dump")
    control = EventControl({"cmd": "status"})
    fed(control, None, "OperatorAPI.handle")
    worked: list[bool] = []
    fed(EventIds(lambda: worked.append(True)), None)
    fed(EventRun(sw, ()), None, "Dispatcher.run")
    fed(EventWatch(), None, "Housekeeping.watch")
    fed(EventTick(), None, "Housekeeping.tick")
    done = threading.Event()
    fed(EventShutdown(done), None, "Housekeeping.shutdown")
    fed(state_change(dp, DEAD_DISPATCHER), DEAD_DISPATCHER, "Peers.dead")
    assert sw.session is None and worked == [True]
    assert app.counters.flat().get("handler_errors", 0) == 0
    # Every event class the app handles was fed above.
    handled = set(app.event_handlers)
    fed_classes = {ofp_event.EventOFPSwitchFeatures, ofp_event.EventOFPStateChange, ofp_event.EventOFPBarrierReply,
                   ofp_event.EventOFPRoleReply, ofp_event.EventOFPFlowStatsReply, ofp_event.EventOFPMeterStatsReply,
                   ofp_event.EventOFPTableFeaturesStatsReply, ofp_event.EventOFPErrorMsg, ofp_event.EventOFPPacketIn,
                   ofp_event.EventOFPFlowRemoved, EventConntrack, EventOverflow, EventControl, EventIds, EventRun,
                   EventWatch, EventTick, EventShutdown}
    assert handled - fed_classes == {ofp_event.EventOFPTableStatsReply}  # (OpenFlow 1.0's: the rig's 1.0 tests)


def test_a_message_before_the_handshake_or_of_another_connection_is_counted_not_handled(app):
    stranger = fs.FakeSwitch()
    stranger.error(5, stranger.ofproto.OFPET_BAD_REQUEST, stranger.ofproto.OFPBRC_BAD_TYPE, b"")
    serve(app, ofp_event.ofp_msg_to_ev(stranger.replies.pop()), CONFIG_DISPATCHER)
    flat = app.counters.flat()
    assert flat["openflow_ignored:error"] == 1 and flat.get("handler_errors", 0) == 0


def test_a_handler_that_raises_is_counted_and_the_app_serves_the_next_event(app, monkeypatch):
    def broken(*_args: Any) -> None:
        raise KeyError("a bug")
    monkeypatch.setattr(app.housekeeping, "tick", broken)
    serve(app, EventTick())
    serve(app, EventWatch())
    assert app.counters.flat()["handler_errors"] == 1


def _flow_removed(dp: fs.FakeSwitch) -> Any:
    """A flow-removed message of a flow nobody knows (as os-ken reads it)."""
    p, ofp = dp.ofproto_parser, dp.ofproto
    dp.send(_wire(p.OFPFlowMod(dp, cookie=0x99, command=ofp.OFPFC_ADD, priority=5, flags=ofp.OFPFF_SEND_FLOW_REM,
                               match=p.OFPMatch(in_port=7), instructions=[])))
    dp.send(_wire(p.OFPFlowMod(dp, command=ofp.OFPFC_DELETE, table_id=ofp.OFPTT_ALL, out_port=ofp.OFPP_ANY,
                               out_group=ofp.OFPG_ANY, match=p.OFPMatch(in_port=7))))
    return dp.replies.pop()


def _wire(msg: Any) -> bytes:
    msg.set_xid(999)
    msg.serialize()
    return bytes(msg.buf)


def test_entries_read_outside_the_listener_are_decided_as_events_are(app):
    """An IDS request's lookup hands its entry to `feed`: the core decides it, the switch
    gets its flows."""
    dp = fs.FakeSwitch()
    serve(app, ofp_event.ofp_msg_to_ev(dp.features()), CONFIG_DISPATCHER)
    serve(app, state_change(dp, MAIN_DISPATCHER), MAIN_DISPATCHER)
    while dp.replies:  # the switch's answers: reconciled
        serve(app, ofp_event.ofp_msg_to_ev(dp.replies.pop(0)), MAIN_DISPATCHER)
    assert app.switches[0].core.reconciled
    ev = event()
    app.feed([ev])
    assert app.switches[0].core.find(tuple_=ev.orig) is not None
    assert app.counters.flat()["conntrack_event:update"] == 1


def test_a_malformed_conntrack_message_is_counted(app, caplog):
    app._malformed("bad netlink length 3")
    assert app.counters.flat()["netlink_malformed"] == 1 and "skipped malformed conntrack message" in caplog.text


def test_sighup_reopens_the_audit_log_and_asks_for_a_reload(app, monkeypatch):
    posted: list[Any] = []
    monkeypatch.setattr(app, "send_event", lambda _name, ev, state=None: posted.append(ev))
    app.reopen_logs()
    (ev,) = posted
    assert isinstance(ev, EventControl) and ev.request == {"cmd": "reload", "by": "SIGHUP"}
