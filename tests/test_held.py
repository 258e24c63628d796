"""kernel/held.py's socket calls answer as the socket module's do with MSG_DONTWAIT: the
same bytes taken or given, the same exception for the same errno."""
from __future__ import annotations

import socket

import pytest

from nfshunt.kernel import held


def _pairs(kind: int, n: int = 2) -> list[tuple[socket.socket, socket.socket]]:
    pairs = [socket.socketpair(socket.AF_UNIX, kind) for _ in range(n)]
    for a, _ in pairs:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # (fills within a few writes)
    return pairs


def _outcome(call):
    try:
        return call()
    except OSError as exc:
        return type(exc), exc.errno


def test_send_takes_what_socket_send_takes_until_full_then_raises_what_it_raises():
    (a1, b1), (a2, b2) = _pairs(socket.SOCK_STREAM)
    chunk = bytes(range(256)) * 40  # 10,240 bytes: more than the buffer holds
    for _ in range(8):
        ours = _outcome(lambda: held.send(a1.fileno(), chunk))
        theirs = _outcome(lambda: a2.send(chunk, socket.MSG_DONTWAIT))
        assert ours == theirs
    assert ours == (BlockingIOError, 11)  # full by now, for both
    got1, got2 = b1.recv(1 << 20), b2.recv(1 << 20)
    assert got1 == got2 and got1.startswith(chunk[:100])
    b1.close()
    b2.close()
    assert _outcome(lambda: held.send(a1.fileno(), b"x")) == _outcome(lambda: a2.send(b"x", socket.MSG_DONTWAIT))
    assert _outcome(lambda: held.send(a1.fileno(), b"x"))[0] is BrokenPipeError
    a1.close()
    a2.close()


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_send_takes_any_bytes_like_object(kind):
    (a, b), = _pairs(socket.SOCK_STREAM, 1)
    assert held.send(a.fileno(), kind(b"hello")) == 5 and b.recv(16) == b"hello"
    a.close()
    b.close()


def test_a_closed_descriptor_is_the_same_oserror():
    (a, b), = _pairs(socket.SOCK_STREAM, 1)
    fd = a.fileno()
    a.close()
    b.close()
    ours = _outcome(lambda: held.send(fd, b"x"))
    assert ours[0] is OSError and ours[1] == 9  # EBADF, as os.write on a closed descriptor
    assert _outcome(lambda: held.Receiver(bytearray(16)).recv_into(fd)) == ours


@pytest.mark.parametrize("size", [64, 4096])
def test_recv_into_gives_each_datagram_as_socket_recv_into_does_truncated_alike(size):
    (a1, b1), (a2, b2) = _pairs(socket.SOCK_DGRAM)
    msgs = [b"", b"a", bytes(range(200)), b"z" * 1000]
    for m in msgs:
        a1.send(m)
        a2.send(m)
    ours, theirs = held.Receiver(bytearray(size)), bytearray(size)
    for _ in range(len(msgs) + 1):
        o = _outcome(lambda: ours.recv_into(b1.fileno()))
        t = _outcome(lambda: b2.recv_into(theirs, 0, socket.MSG_DONTWAIT))
        assert o == t
        if isinstance(o, int):
            assert ours.buf[:o] == theirs[:t]
    assert o == (BlockingIOError, 11)  # all read: nothing now, for both
    for s in (a1, b1, a2, b2):
        s.close()


def test_sendall_sends_what_the_socket_takes_at_once_and_the_rest_waiting():
    import threading
    (a, b), = _pairs(socket.SOCK_STREAM, 1)
    data = bytes(range(256)) * 400  # 102,400 bytes: far more than the buffer takes at once
    got = bytearray()
    reader = threading.Thread(target=lambda: [got.extend(c) for c in iter(lambda: b.recv(65536), b"")])
    reader.start()
    held.sendall(a, data)
    a.close()
    reader.join(5)
    b.close()
    assert bytes(got) == data
