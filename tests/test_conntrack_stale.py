"""An update the worker sends names an entry by tuple and id, but the kernel applies it to
whatever entry holds the tuple, and an entry re-created there mostly has the old one's id
(tests/test_conntrack_netns.py shows both): a take-down's short timeout goes only to the
closing entry it was asked for, looked up just before it is sent."""
from __future__ import annotations

import socket
import threading

import pytest

from nfshunt.kernel import codec, worker
from nfshunt.records.model import TCP, ConnEvent, EventKind, FlowTuple

T = FlowTuple(4, TCP, "10.9.0.1", "10.9.0.2", 2002, 80)
ASKED = worker.Expire(4, T, 77, 10)
TIME_WAIT, ESTABLISHED, SYN_SENT = 7, 3, 1


def entry(ct_id: int, tcp_state: int | None) -> ConnEvent:
    return ConnEvent(EventKind.DUMP, ct_id, T, T.reversed(), 0x71210000, tcp_state, 0.0)


@pytest.mark.parametrize("found, meant", [
    (entry(77, TIME_WAIT), True),      # the closing entry it was asked for
    (entry(77, 8), True),              # CLOSE: still closing
    (entry(77, ESTABLISHED), False),   # re-created on the tuple, same id (the usual case)
    (entry(77, SYN_SENT), False),
    (entry(78, TIME_WAIT), False),     # another entry's id
    (None, False),                     # gone: nothing to shorten
])
def test_an_expire_is_meant_only_for_the_closing_entry_it_was_asked_for(found, meant):
    assert ASKED.meant_for(found) is meant


class Sock:
    def __init__(self):
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)

    def recv(self, _size: int) -> bytes:
        raise socket.timeout

    def close(self) -> None:
        pass


@pytest.mark.parametrize("found, sent", [(entry(77, TIME_WAIT), True), (entry(77, ESTABLISHED), False)])
def test_the_worker_sends_an_expire_only_to_its_entry(monkeypatch, found, sent):
    w = worker.ConntrackWorker(lambda _: None, print)
    w.sock.close()
    w.sock = fake = Sock()
    monkeypatch.setattr(worker, "entry_of", lambda t: found if t == T else None)
    monkeypatch.setattr(worker.time, "monotonic", iter([0.0, 10.0]).__next__)  # no wait for acknowledgements
    delete = worker.Delete(4, T, 77)
    w._send_batch([ASKED, delete])
    expected = [codec.timeout_message(4, T, 77, 10, 1), codec.delete_message(4, T, 77, 2)] if sent else \
        [codec.delete_message(4, T, 77, 1)]
    assert fake.sent == [b"".join(expected)]
    assert w.stale == (0 if sent else 1)


def test_the_worker_outlives_a_refused_lookup_and_a_failing_request(monkeypatch):
    # A lookup the codec refused ended the worker's thread, and every delete and hand-back
    # queued after it waited for ever (no shunt was taken down again).
    from nfshunt.kernel import table

    def refused(t: FlowTuple) -> ConnEvent | None:
        raise table.RefusedAnswer("conntrack lookup: the kernel's answer was refused: directional")

    monkeypatch.setattr(worker, "entry_of", refused)
    failures = []
    w = worker.ConntrackWorker(lambda _: None, print, on_failed=lambda: failures.append(1))
    w.sock.close()
    w.sock = Sock()
    looked_up, ran = [], threading.Event()
    w.start()
    try:
        w.q.put(worker.LookUp(T, lambda entry, why: looked_up.append((entry, why))))
        w.q.put(worker.Call(lambda: 1 / 0))  # a request that fails in a way nobody foresaw
        w.q.put(worker.Call(ran.set))
        assert ran.wait(5), "the worker stopped serving its queue"
    finally:
        w.stop()
    assert looked_up == [(None, "conntrack lookup: the kernel's answer was refused: directional")]
    assert failures == [1]  # counted (internal_errors)
