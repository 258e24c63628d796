"""`nfshunt run`'s own settings of the Python process."""
import gc

from nfshunt.observe import collector


def test_the_controller_collects_young_objects_less_often_and_never_fully_on_its_own():
    saved = gc.get_threshold()
    try:
        collector.tune()
        assert gc.get_threshold() == (collector.GC_YOUNG, saved[1], collector.NEVER)
        assert collector.GC_YOUNG > saved[0] and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*saved)


def test_start_up_empties_the_caches_os_ken_s_import_left_in_its_abstract_packet_classes():
    """os-ken's packet module asks of every class it imports whether it is a PacketBase;
    PacketBase and each subclass kept every answer (3.3 MB). `tune` empties the caches."""
    import _abc

    from os_ken.lib.packet import ethernet, packet, packet_base  # noqa: F401  (fills them)

    def negative_cache() -> int:
        return len(_abc._get_dump(packet_base.PacketBase)[2])
    assert issubclass(int, packet_base.PacketBase) is False and negative_cache() > 0
    assert collector.clear_abc_caches() > 40 and negative_cache() == 0
    assert issubclass(ethernet.ethernet, packet_base.PacketBase)  # the answers stay right
    assert not issubclass(int, packet_base.PacketBase) and negative_cache() == 1


def test_full_collections_wait_for_a_quiet_second_and_come_at_the_latest_after_full_max():
    made: list[int | str] = []
    clock = iter(range(0, 1000, 2)).__next__  # each collection "takes" 2 s (logged: over SLOW)
    full = collector.FullCollections(0.0, collect=lambda gen: made.append(gen) or 5, clock=clock,
                                     freeze=lambda: made.append("freeze"), unfreeze=lambda: made.append("unfreeze"))

    def collections() -> list[int | str]:
        return [m for m in made if m != "freeze"]
    events = 0
    for now in range(1, int(collector.FULL_MIN)):  # quiet, but too soon after start-up
        assert full.tick(float(now), events, busy=False) is None
    assert full.tick(collector.FULL_MIN, events, busy=True) is None  # busy: a switch is answering
    assert made == ["freeze"] * int(collector.FULL_MIN)  # what lives frozen at every tick
    assert full.tick(collector.FULL_MIN + 1, events, busy=False) == 2  # quiet at last
    assert made[-3:] == ["unfreeze", 2, "freeze"] and full.count == 1  # a full one walks everything
    now = collector.FULL_MIN + 1
    while now < collector.FULL_MIN + 1 + collector.FULL_MAX - 1:  # busy all along: none ...
        now += 1
        events += 100
        assert full.tick(now, events, busy=False) is None
    events += 100
    assert full.tick(collector.FULL_MIN + 1 + collector.FULL_MAX, events, busy=False) == 2  # ... until FULL_MAX
    assert collections() == ["unfreeze", 2, "unfreeze", 2] and full.count == 2 and full.seconds == 4


def test_a_handler_that_raises_is_counted_and_the_event_loop_goes_on(caplog):
    """With os-ken's threading hub, TaskExit is Exception: its own loop ended for good on any
    handler error. NFShunt's loop counts and logs it and serves the next event."""
    import queue
    import threading
    import types

    from nfshunt.app.switch_app import NFShuntApp
    served, counted = [], []

    def broken(ev):
        raise KeyError("a bug")

    loop = types.SimpleNamespace(is_active=False, events=queue.Queue(), _events_sem=threading.Semaphore(0),
                                 _event_stop=object(), counters=types.SimpleNamespace(inc=counted.append),
                                 get_handlers=lambda ev, state: [broken] if ev == "first" else [served.append])
    for ev in ("first", "second"):
        loop.events.put((ev, None))
    NFShuntApp._event_loop(loop)  # returns once the queue is empty (is_active False)
    assert served == ["second"] and counted == ["handler_errors"]
    assert "handler broken failed on str" in caplog.text


def test_installs_idle_outs_and_a_flush_leave_no_cycle_for_the_full_collection():
    """Full collections come minutes apart under load (collector.py): a pair's life must be
    freed by reference counting alone."""
    from tests.support.rig import Rig
    rig = Rig()
    # The offset check copies the table at every turn: with 100 pairs in it, 9 of this
    # test's 12 s (the rig's other tests keep it).
    rig.switch.offset_check = False
    gc.collect()
    gc.disable()
    try:
        for i in range(100):
            rig.event(sport=20000 + i, ct_id=1000 + i)
        assert gc.collect() == 0, "installs"
        rig.advance(100)  # every pair idles out
        assert gc.collect() == 0, "idle-outs"
        for i in range(100):
            rig.event(sport=30000 + i, ct_id=5000 + i)
        rig.run(rig.core.flush("test", rig.now))
        rig.advance(10)
        assert gc.collect() == 0, "a flush"
        assert not rig.core.conns.shunts
    finally:
        gc.enable()
