"""Log handlers that do not write (and flush) once per record.

At thousands of shunts a second, one flushed write per log line cost the event loop more
than everything else it does (profile in bench/results). These handlers write into a
buffer and flush at most every FLUSH_INTERVAL, at once for WARNING and above, on the
app's 1 s tick (flush_all) and at shutdown: a line is at most a second late.
"""
from __future__ import annotations

import io
import logging
import os
import sys
import threading
import time
from typing import Any

FLUSH_INTERVAL = 0.5


class _Batched(logging.StreamHandler):
    """A stream handler whose writes are flushed at most every FLUSH_INTERVAL."""
    _last_flush = 0.0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = self.format(record)
            stream = self.stream
            if stream is None:  # a FileHandler opened with delay, or closed
                stream = self.stream = self._reopened()
            stream.write(msg + "\n")
            now = time.monotonic()
            if record.levelno >= logging.WARNING or now - self._last_flush >= FLUSH_INTERVAL:
                self.flush()
                self._last_flush = now
        except Exception:
            self.handleError(record)

    def _reopened(self) -> "io.TextIOBase":
        raise ValueError("the stream is closed")


class BatchedStreamHandler(_Batched, logging.StreamHandler):
    """stderr through a buffer of its own (sys.stderr is line-buffered)."""

    def __init__(self) -> None:
        stream = io.TextIOWrapper(io.BufferedWriter(io.FileIO(sys.stderr.fileno(), "w", closefd=False), 1 << 16),
                                  encoding="utf-8", errors="replace")
        super().__init__(stream)


class BatchedFileHandler(_Batched, logging.FileHandler):
    """A file that logrotate may move: checked once a second (not per line, as
    WatchedFileHandler does), reopened then or on reopen()."""

    def __init__(self, path: str):
        super().__init__(path, encoding="utf-8", delay=False)
        self._ino = self._inode()

    def _inode(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.baseFilename)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def _reopened(self) -> "io.TextIOBase":
        return self._open()

    def reopen(self) -> None:
        self.acquire()
        try:
            if self.stream is not None:
                self.stream.flush()
                self.stream.close()
            self.stream = self._open()
            self._ino = self._inode()
        finally:
            self.release()

    def check_rotated(self) -> None:
        if self._inode() != self._ino:
            self.reopen()


def flush_all() -> None:
    """Flush every batched handler (the app's tick); reopen audit and accounting files
    logrotate moved."""
    names = ("nfshunt", "nfshunt.audit", "nfshunt.accounting")
    for logger in [logging.getLogger()] + [logging.getLogger(n) for n in names]:
        for handler in logger.handlers:
            if isinstance(handler, _Batched):
                handler.flush()
            if isinstance(handler, BatchedFileHandler):
                handler.check_rotated()


class RateLimitedLog:
    """At most `burst` lines per key every `interval` seconds, with how many were held back;
    from any thread. Past `keys` keys the rest share one: keys a peer names (the IDS API
    process's loggers) cannot grow it, nor escape the limit by naming more."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0, burst: int = 1, keys: int = 1000):
        self.logger = logger
        self.interval = interval
        self.burst = burst
        self.keys = keys
        self._seen: dict[str, tuple[float, int, int]] = {}  # a key's interval's start, lines in it, held back
        self._lock = threading.Lock()

    def allow(self, key: str) -> int | None:
        """How many lines of this key were held back since the last one, if this one may
        be logged; None if it is held back too."""
        now = time.monotonic()
        with self._lock:
            if key not in self._seen and len(self._seen) >= self.keys:
                key = "(other keys)"
            start, lines, held = self._seen.get(key, (-1e9, 0, 0))
            if now - start >= self.interval:
                start, lines = now, 0
            if lines >= self.burst:
                self._seen[key] = (start, lines, held + 1)
                return None
            self._seen[key] = (start, lines + 1, 0)
            return held

    @staticmethod
    def note(held: int) -> str:
        """What a line says of the `held` lines of its key held back before it."""
        return f" ({held} more like this since the last report)" if held else ""

    def warning(self, key: str, msg: str, *args: Any) -> None:
        self.log(logging.WARNING, key, msg, *args)

    def log(self, level: int, key: str, msg: str, *args: Any, exc_info: bool = False) -> None:
        held = self.allow(key)
        if held is not None:
            self.logger.log(level, msg + self.note(held), *args, exc_info=exc_info)
