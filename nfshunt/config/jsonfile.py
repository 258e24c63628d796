"""Small JSON documents read safely (the config file, the pair state file, control requests)
and state files written atomically (`write_atomic`).

Whatever the input, the answer is the parsed value or a JsonInputError naming where in
the document the problem is and the limit it broke: never a hang (only regular files are
read, without blocking on a FIFO), never a traceback (nesting and integer digits are
bounded here, not by the interpreter's process-wide limits), never a silently dropped key.
"""
from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from typing import Any, Iterable

MAX_DEPTH = 32  # our documents nest 4 levels; this keeps repr() and every walk far from recursion limits
MAX_DIGITS = 100  # an integer literal's digits: 2**64 has 20; int() of thousands is slow or refused
_LONG_RUN = re.compile(f"[0-9]{{{MAX_DIGITS + 1}}}", re.ASCII)


class JsonInputError(ValueError):
    """key: where in the document ('ports[0].fast'; '' for the whole of it)."""

    def __init__(self, key: str, problem: str):
        self.key = key
        self.problem = problem
        super().__init__(f"{key}: {problem}" if key else problem)


class _LongNumber:
    """An integer literal over MAX_DIGITS, kept unconverted until its key is known."""
    __slots__ = ("digits",)

    def __init__(self, digits: int):
        self.digits = digits


def _parse_int(text: str) -> int | _LongNumber:
    digits = len(text) - text.startswith("-")
    return int(text) if digits <= MAX_DIGITS else _LongNumber(digits)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise JsonInputError(key, "appears twice in one object (JSON would silently keep the last)")
        out[key] = value
    return out


def _check_tree(value: Any) -> None:
    """Nesting and long integers, walked without recursion (the key path of the first)."""
    todo: list[tuple[Any, str, int]] = [(value, "", 0)]
    while todo:
        node, key, depth = todo.pop()
        if isinstance(node, _LongNumber):
            raise JsonInputError(key, f"a number of {node.digits} digits (the limit is {MAX_DIGITS})")
        if isinstance(node, dict):
            children = [(f"{key}.{name}" if key else name, child) for name, child in node.items()]
        elif isinstance(node, list):
            children = [(f"{key}[{i}]", child) for i, child in enumerate(node)]
        else:
            continue
        if depth >= MAX_DEPTH:
            raise JsonInputError(key, f"nested deeper than {MAX_DEPTH} levels")
        todo.extend((child, name, depth + 1) for name, child in reversed(children))


def parse(data: bytes | str, what: str) -> Any:
    """One JSON document (what: how to name it in an error, e.g. the file's path)."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        value = json.loads(text, parse_int=_parse_int, object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as exc:
        raise JsonInputError("", f"{what} is not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise JsonInputError("", f"{what} is not valid JSON: line {exc.lineno} column {exc.colno}: {exc.msg}") \
            from None
    except RecursionError:
        raise JsonInputError("", f"{what} is nested deeper than {MAX_DEPTH} levels") from None
    # Only a text of more than MAX_DEPTH brackets can nest too deep, and only a run of more
    # than MAX_DIGITS digits hold a long integer: a text with neither (an IDS request's body)
    # needs no walk of its tree, which cost ~2 us and named every node (~15 us before).
    if text.count("{") + text.count("[") > MAX_DEPTH or _LONG_RUN.search(text):
        _check_tree(value)
    return value


def _read_regular(path: str, max_bytes: int) -> bytes | None:
    """The file's first max_bytes + 1 bytes; None if it is not a regular file."""
    if not stat.S_ISREG(os.stat(path).st_mode):  # before open: opening a device can act
        return None
    # O_NONBLOCK: a FIFO swapped in after the stat must not hang the open.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes and (chunk := os.read(fd, max_bytes + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read(path: str, max_bytes: int) -> Any:
    """A regular file of at most max_bytes, parsed; JsonInputError for anything else."""
    try:
        data = _read_regular(path, max_bytes)
    except OSError as exc:
        raise JsonInputError("", f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # a NUL byte, or what no file name can hold
        raise JsonInputError("", f"cannot read {path!r}: {exc}") from None
    if data is None:
        raise JsonInputError("", f"{path} is not a regular file")
    if len(data) > max_bytes:
        raise JsonInputError("", f"{path} is larger than {max_bytes} bytes (the limit)")
    return parse(data, path)


def write_atomic(path: str, data: bytes | Iterable[bytes]) -> None:
    """`data` (or its parts, one after another) as the file at `path`, whole or not at all:
    written beside it (mode 0600, its folder made 0700), synced, renamed over it, and the
    rename synced too (it survives a power cut). OSError is the caller's to report; no
    temporary file is left behind."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            if isinstance(data, bytes):
                fh.write(data)
            else:  # (each buffer's write lets the other threads run: no one long hold of the lock)
                fh.writelines(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
