"""The IDS clients' bearer tokens (ids.token_file): read by the controller, checked by the API.

The file: "<client> <token>" lines, "<client> <token> admin" for a client that may list
every client's rules (# comments), or one bare token (client "ids"). It must be a regular
file of mode 0600: a file others may read, or a malformed one, authenticates nobody (and
is logged, naming the file).

The file is root's and the API's process runs as an unprivileged user (confine.py): the
controller reads it (`read`) and hands the tokens over (process.py). The API checks the
file's inode, time, size and mode before each request (a stat needs no read permission)
and asks for the tokens again when they changed, so a rotated token is refused from the
next request on; where its user cannot even look at the file (a folder it may not
search), it asks once a second.
"""
from __future__ import annotations

import hmac
import logging
import os
import re
import stat
import threading
import time
from dataclasses import dataclass
from typing import Callable

LOG = logging.getLogger("nfshunt")
MAX_TOKEN_FILE = 65536
MIN_TOKEN = 16  # characters: a shorter token is guessable
CLIENT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}", re.ASCII)
ADMIN = "admin"  # the third field of a client that sees every client's rules
UNSEEN_SECONDS = 1.0  # how often tokens are asked for when the file cannot be looked at

Signature = tuple[int, int, int, int] | None  # (inode, mtime ns, size, mode); None: not looked at


@dataclass(frozen=True)
class Token:
    client: str
    secret: bytes
    admin: bool = False


def signature(path: str) -> Signature:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size, st.st_mode


def read(path: str) -> tuple[Signature, list[Token]]:
    """The file's signature (as stat'ed before it was read) and its tokens; none (logged)
    when it cannot be read or is not as it must be."""
    try:
        st = os.stat(path)
        seen: Signature = (st.st_ino, st.st_mtime_ns, st.st_size, st.st_mode)
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
            LOG.error("IDS token file %s is not a regular file of mode 0600: every request is refused until it is",
                      path)
            return seen, []
        with open(path, "rb") as fh:
            data = fh.read(MAX_TOKEN_FILE + 1)
        if len(data) > MAX_TOKEN_FILE:  # (cut, its last line could read as a shorter, valid token)
            LOG.error("IDS token file %s is larger than %d bytes: every request is refused until it is not",
                      path, MAX_TOKEN_FILE)
            return seen, []
        lines = data.decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        LOG.error("cannot read the IDS token file %s (%s): every request is refused until it can be", path, exc)
        return None, []
    tokens: list[Token] = []
    entries = [line.split() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    for i, fields in enumerate(entries):
        admin = len(fields) == 3 and fields[2] == ADMIN
        if len(fields) == 1 and len(entries) == 1:
            name, token = "ids", fields[0]
        elif len(fields) == 2 or admin:
            name, token = fields[0], fields[1]
        else:
            name, token = "", ""
        if not CLIENT_NAME.fullmatch(name) or len(token) < MIN_TOKEN:
            LOG.error("IDS token file %s: entry %d is not \"<client> <token of %d or more characters> [admin]\": "
                      "every request is refused until it is", path, i + 1, MIN_TOKEN)
            return seen, []
        if any(t.secret == token.encode() for t in tokens):  # (which client would it be?)
            LOG.error("IDS token file %s: entry %d gives a token an earlier entry gives: every request is refused "
                      "until each client has its own", path, i + 1)
            return seen, []
        tokens.append(Token(name, token.encode(), admin))
    return seen, tokens


class Tokens:
    """The tokens as the API checks them. load: what gives them (the file read here, or,
    in the API's own process, the controller asked)."""

    def __init__(self, path: str, load: Callable[[], tuple[Signature, list[Token]]] | None = None):
        self.path = path
        self._load = load if load is not None else (lambda: read(path))
        # The tokens and the signature they were read at: one attribute replaced whole, so
        # a request reads it without the lock (API threads taking a lock held across a stat
        # queued behind one another: bench `ids`).
        self._read: tuple[Signature, list[Token]] = (None, [])
        self._loaded = -float("inf")  # monotonic: when, for a file this process cannot look at
        self._lock = threading.Lock()

    def take(self, seen: Signature, tokens: list[Token]) -> None:
        """Tokens read elsewhere (the controller's, at the API process's start)."""
        self._read = (seen, tokens)
        self._loaded = time.monotonic()

    def _stale(self, seen: Signature) -> bool:
        if seen is None or self._read[0] is None:  # not looked at here, or not read there: by the clock
            return time.monotonic() - self._loaded >= UNSEEN_SECONDS
        return seen != self._read[0]

    def client(self, authorization: str | None) -> Token | None:
        """The token a "Bearer <token>" header gives; None if none."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        given = authorization[7:].strip().encode("utf-8", "surrogateescape")
        seen = signature(self.path)
        if self._stale(seen):
            with self._lock:  # asked again by one thread at a time
                if self._stale(seen):
                    self._read = self._load()
                    self._loaded = time.monotonic()
        found = None
        for token in self._read[1]:  # every token compared, in constant time
            if hmac.compare_digest(token.secret, given):
                found = token
        return found
