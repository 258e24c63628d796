"""`nfshunt run`'s own settings of the Python process."""
import gc

from nfshunt import controller


def test_the_controller_collects_its_youngest_objects_less_often():
    saved = gc.get_threshold()
    try:
        controller.tune_gc()
        assert gc.get_threshold() == (controller.GC_YOUNG, *saved[1:])
        assert controller.GC_YOUNG > saved[0]
    finally:
        gc.set_threshold(*saved)


def test_a_handler_that_raises_is_counted_and_the_event_loop_goes_on(caplog):
    """With os-ken's threading hub, TaskExit is Exception: its own loop ended for good on any
    handler error. NFShunt's loop counts and logs it and serves the next event."""
    import queue
    import threading
    import types

    from nfshunt.switch_app import NFShuntApp
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
