"""The switch channel's send path and peer checks against a fake datapath: batching behind
one barrier, errors matched to their install, and installs the switch never confirms."""
import os

os.environ.setdefault("OSKEN_HUB_TYPE", "native")
from os_ken.ofproto import ofproto_protocol  # noqa: E402

from nfshunt import core as c  # noqa: E402
from nfshunt.channel import SendPath, address_allowed  # noqa: E402
from nfshunt.flows import FlowBuilder  # noqa: E402
from tests.helpers import config, event  # noqa: E402


class FakeDatapath(ofproto_protocol.ProtocolDesc):
    def __init__(self):
        super().__init__(c.OFP13)
        self.xid = 0
        self.sent: list[bytes] = []

    def set_xid(self, msg):
        self.xid += 1
        msg.set_xid(self.xid)
        return self.xid

    def send(self, buf):
        self.sent.append(buf)
        return True


def _setup():
    dp = FakeDatapath()
    core = c.Core(config())
    core.switch_connected(c.OFP13)
    core.reconcile([], 0.0)
    return dp, SendPath(dp, FlowBuilder(dp, core.cfg)), core


def test_installs_go_out_in_one_write_behind_one_barrier_and_errors_name_their_install():
    dp, send, core = _setup()
    a = core.conntrack_event(event(sport=1, ct_id=1))[0].conn
    b = core.conntrack_event(event(sport=2, ct_id=2))[0].conn
    send.install(a)
    send.install(b)
    send.flush()
    assert len(dp.sent) == 1 and send.pending() == 2
    barrier_xid = dp.xid  # the barrier is the last message written
    first_of_b = barrier_xid - 6  # b's six flow-mods (pair and catchers) precede it
    assert send.error(first_of_b, "switch error type=5 code=1", True) is b
    assert send.error(9999, "unrelated", False) is None
    batch = send.barrier_reply(barrier_xid)
    assert batch.conns == [a, b] and batch.failed == {id(b): ("switch error type=5 code=1", True)}
    assert send.pending() == 0 and send.barrier_reply(barrier_xid) is None


def test_an_unanswered_barrier_expires_its_installs():
    dp, send, core = _setup()
    conn = core.conntrack_event(event())[0].conn
    send.install(conn)
    send.flush()
    sent_at = next(iter(send._batches.values())).sent
    assert send.expired(sent_at + 1.0, 5.0) == []
    (batch,) = send.expired(sent_at + 5.1, 5.0)
    assert batch.conns == [conn] and send.pending() == 0
    # Rolled back by the core like a refusal: the entry stays, the connection on the slow path.
    out = core.flows_failed(conn, "no answer from the switch")
    assert [type(x).__name__ for x in out] == ["RemoveFlows", "Refused"]


def test_switch_addresses_allow_listed_addresses_and_networks_only():
    assert address_allowed("192.0.2.1", ())
    assert address_allowed("192.0.2.1", ("192.0.2.1",))
    assert address_allowed("::ffff:192.0.2.1", ("192.0.2.0/24",))
    assert not address_allowed("192.0.2.2", ("192.0.2.1",))
    assert not address_allowed("not an address", ("0.0.0.0/0",))


def test_delayed_commands_run_on_the_one_ticker_thread_when_due():
    import threading
    import time
    from types import SimpleNamespace

    from nfshunt.switch_app import EventRun, EventTick, NFShuntApp
    posted = []
    app = SimpleNamespace(_running=True, _later=[], _later_seq=0, _later_lock=threading.Lock(), fb=None,
                          name="nfshunt", send_event=lambda name, ev: posted.append((time.monotonic(), ev)))
    marker = c.ResyncConntrack()
    t0 = time.monotonic()
    NFShuntApp._execute(app, c.Later(0.3, (marker,)))
    NFShuntApp._execute(app, c.Later(0.1, (marker, marker)))
    thread = threading.Thread(target=NFShuntApp._ticker, args=(app,))
    thread.start()
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not any(isinstance(ev, EventTick) for _, ev in posted):
            time.sleep(0.02)
    finally:
        app._running = False
        thread.join()
    runs = [(t - t0, ev.commands) for t, ev in posted if isinstance(ev, EventRun)]
    assert [len(cmds) for _, cmds in runs] == [2, 1]  # the earlier one first, each once
    assert 0.1 <= runs[0][0] < 0.25 and 0.3 <= runs[1][0] < 0.45
    assert app._later == []
