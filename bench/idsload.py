#!/usr/bin/env python3
"""Shunt requests to the controller's IDS API at a given rate (run inside the firewall's
namespace, where the API listens on the loopback), one for each of ctfeed's entries.

  idsload.py --port P --token-file F --rate R --count N [--start I] [--connections C] --out CSV

Request i is due at start + i/R and shunts ctfeed's entry i (its address(i) -> 10.65.0.1:5201,
TCP), with rule id "bench-<i>". One thread drives C keep-alive HTTP/1.1 connections
(non-blocking sockets, a selector): a due request goes out on a free connection, one
request in flight on each (the server answers a connection's requests in turn); when none
is free it waits, and its lateness (sent - due) is recorded. Each answer is timed from
its send to its last byte. Every request ends in one row: its HTTP status and the
body's result and error, or status 0 with why (the connection closed or failed, or no
answer within --timeout, or still in flight when the run's time, its schedule and
--timeout, is up). Prints one JSON summary line (with its own CPU seconds); --out writes the rows
"index,due,sent,answered,status,result,error" (epoch seconds).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import selectors
import socket
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ctfeed import address  # noqa: E402

DST, DPORT = "10.65.0.1", 5201
MAX_HEAD = 65536


@dataclass
class Row:
    index: int
    due: float
    sent: float = 0.0
    answered: float = 0.0
    status: int = 0
    result: str = ""
    error: str = ""


class Conn:
    """One keep-alive connection: at most one request in flight, its answer read as it comes."""

    def __init__(self, sel: selectors.BaseSelector, port: int):
        self.sel, self.port = sel, port
        self.sock: socket.socket | None = None
        self.row: Row | None = None
        self.buf = b""
        self.out = b""

    def open(self) -> None:
        self.sock = socket.create_connection(("127.0.0.1", self.port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)
        self.sel.register(self.sock, selectors.EVENT_READ, self)

    def close(self) -> None:
        if self.sock is not None:
            self.sel.unregister(self.sock)
            self.sock.close()
            self.sock = None
        self.buf = self.out = b""

    def send(self, row: Row, request: bytes) -> None:
        self.row, row.sent = row, time.time()
        if self.sock is None:
            self.open()
        assert self.sock is not None
        try:
            n = self.sock.send(request)
        except BlockingIOError:
            n = 0
        self.out = request[n:]
        if self.out:
            self.sel.modify(self.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, self)

    def writable(self) -> None:
        assert self.sock is not None
        n = self.sock.send(self.out)
        self.out = self.out[n:]
        if not self.out:
            self.sel.modify(self.sock, selectors.EVENT_READ, self)

    def readable(self) -> Row | None:
        """The request's row once its whole answer is in; None while it is not."""
        assert self.sock is not None
        data = self.sock.recv(MAX_HEAD)
        if not data:
            raise ConnectionError("closed by the server")
        self.buf += data
        head, sep, body = self.buf.partition(b"\r\n\r\n")
        if not sep:
            if len(self.buf) > MAX_HEAD:
                raise ConnectionError("answer's headers too long")
            return None
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
        length = int(headers.get("content-length", "0"))
        if len(body) < length:
            return None
        row, self.row = self.row, None
        assert row is not None
        row.answered, row.status = time.time(), int(lines[0].split()[1])
        self.buf = body[length:]
        try:
            doc = json.loads(body[:length])
            row.result, row.error = str(doc.get("result", "")), str(doc.get("error", ""))
        except (ValueError, AttributeError):
            row.error = "answer not JSON"
        if headers.get("connection", "").lower() == "close":
            self.close()
        return row


def request(i: int, token: str, expire: int) -> bytes:
    src, sport = address(i)
    body = json.dumps({"id": f"bench-{i}", "action": "shunt", "expire": expire,
                       "connection": {"protocol": "tcp", "src": src, "sport": sport, "dst": DST, "dport": DPORT}},
                      separators=(",", ":")).encode()
    return (f"POST /v1/rules HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--token-file", required=True, help='"<client> <token>" (the first line is used)')
    ap.add_argument("--rate", type=float, required=True, help="requests a second")
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--start", type=int, default=0, help="ctfeed's index of the first entry")
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--expire", type=int, default=600, help="each rule's hard expiry, seconds")
    ap.add_argument("--timeout", type=float, default=30.0, help="a request unanswered this long is given up")
    ap.add_argument("--out")
    args = ap.parse_args()
    with open(args.token_file) as fh:
        token = fh.readline().split()[-1]
    requests = [request(args.start + i, token, args.expire) for i in range(args.count)]  # built before the clock
    sel = selectors.DefaultSelector()
    conns = [Conn(sel, args.port) for _ in range(args.connections)]
    for conn in conns:
        conn.open()
    start = time.time() + 0.1
    rows = [Row(args.start + i, start + i / args.rate) for i in range(args.count)]
    free, nxt, done = collections.deque(conns), 0, 0  # taken in turn: none sits idle past the server's cut-off
    end_by = start + args.count / args.rate + args.timeout

    def fail(conn: Conn, why: str) -> None:
        nonlocal done
        conn.close()
        if conn.row is not None:  # (a connection with nothing in flight is on the free list already)
            conn.row.answered, conn.row.error = time.time(), why
            conn.row, done = None, done + 1
            free.append(conn)

    while done < args.count and time.time() < end_by:
        now = time.time()
        while nxt < args.count and rows[nxt].due <= now and free:
            conn = free.popleft()
            try:
                conn.send(rows[nxt], requests[nxt])
            except OSError as exc:
                fail(conn, f"send: {exc.__class__.__name__}")
            nxt += 1
        for conn in conns:  # given up: no answer within the timeout
            if conn.row is not None and now - conn.row.sent > args.timeout:
                fail(conn, f"unanswered within {args.timeout:g} s")
        wait = 0.05 if nxt >= args.count or not free else max(0.0, rows[nxt].due - time.time())
        for key, mask in sel.select(min(wait, 0.05)):
            conn = key.data
            try:
                if mask & selectors.EVENT_WRITE:
                    conn.writable()
                if mask & selectors.EVENT_READ:
                    row = conn.readable()
                    if row is not None:
                        done += 1
                        free.append(conn)
            except (OSError, ValueError, IndexError) as exc:
                fail(conn, f"answer: {exc}")
    for conn in conns:
        if conn.row is not None:
            conn.row.error = "unanswered: in flight when the run's time was up"
        conn.close()
    sent = [r for r in rows if r.sent]
    for r in rows:
        if not r.sent:
            r.error = "not sent (the run's time was up)"
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("index,due,sent,answered,status,result,error\n")
            for r in rows:
                fh.write(f"{r.index},{r.due:.6f},{r.sent:.6f},{r.answered:.6f},{r.status},{r.result},"
                         f"{r.error.replace(',', ';')}\n")
    last = max((r.sent for r in sent), default=start)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"rate": args.rate, "count": args.count, "sent": len(sent), "connections": args.connections,
                      "start": start, "last_sent": last, "cpu_s": usage.ru_utime + usage.ru_stime,
                      "achieved_rate": (len(sent) - 1) / (last - start) if last > start else None}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
