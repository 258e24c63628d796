"""Socket calls that cannot block, made without letting go of the interpreter's lock.

Each of Python's socket calls lets go of the lock (the GIL) around its system call and
takes it back after. When another thread runs Python meanwhile, the caller waits until that
thread lets go: up to the switch interval (5 ms). A write of a few hundred bytes, a
microsecond's work, then cost the event loop milliseconds, three times an IDS request (its
flow-mods, its conntrack lookup, its answer; bench ids). Measured beside one busy thread:
socket.send of 200 bytes p99 5.3 ms, `send` here 1.9 us.

Each call is made with MSG_DONTWAIT, so it returns at once whatever the descriptor, and
answers as the socket method would with that flag: the bytes taken, BlockingIOError when
it can take or give nothing now, OSError (its subclass for the errno) for the rest.
tests/test_held.py holds them equal to the socket module's calls.
"""
from __future__ import annotations

import ctypes
import errno
import os
import socket

_LIBC = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the lock is kept through the call
_SEND = _LIBC.send
_SEND.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int)
_SEND.restype = ctypes.c_ssize_t
_RECV = _LIBC.recv
_RECV.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_RECV.restype = ctypes.c_ssize_t
_DONTWAIT = socket.MSG_DONTWAIT
_NOSIGNAL = socket.MSG_NOSIGNAL


def _error() -> OSError:
    code = ctypes.get_errno()
    if code == errno.EINTR:  # (a signal before anything moved: as nothing taken now)
        code = errno.EAGAIN
    return OSError(code, os.strerror(code))  # (BlockingIOError, BrokenPipeError, ... by the errno)


def send(fd: int, data: bytes | bytearray | memoryview) -> int:
    """socket.send(data, MSG_DONTWAIT) on the socket `fd`: the number of bytes taken."""
    if type(data) is not bytes:  # (os-ken's own messages are bytearrays)
        data = bytes(data)
    n = _SEND(fd, data, len(data), _DONTWAIT | _NOSIGNAL)
    if n < 0:
        raise _error()
    return n


def sendall(sock: socket.socket, data: bytes) -> None:
    """sock.sendall(data): as much as the socket takes at once with `send`, the rest (if
    any) with the socket's own call, which waits, letting go of the lock."""
    try:
        sent = send(sock.fileno(), data)
    except BlockingIOError:
        sent = 0
    if sent < len(data):
        sock.sendall(data[sent:])


class Receiver:
    """recv_into(buf, 0, MSG_DONTWAIT) into one bytearray, read again and again."""

    def __init__(self, buf: bytearray):
        self.buf = buf
        self._view = (ctypes.c_char * len(buf)).from_buffer(buf)  # (held: buf cannot be resized meanwhile)
        self._at = ctypes.addressof(self._view)

    def recv_into(self, fd: int) -> int:
        """The number of bytes of the next datagram (or stream bytes) now in `buf`."""
        n = _RECV(fd, self._at, len(self.buf), _DONTWAIT)
        if n < 0:
            raise _error()
        return n
