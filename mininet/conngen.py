#!/usr/bin/env python3
"""Many small TCP connections for the testbed (tests and benchmarks), in a host's namespace.

  conngen.py serve PORT
      accept any number of connections and echo what they send; a peer's close is
      answered with a clean close.
  conngen.py open HOST PORT N [--cport-base P]
      open N connections as fast as possible and print "open <epoch> <seconds>" when all are
      up; keep each one alive with a small echo every 0.2 s; on the line "close" on stdin,
      close them all cleanly and print "closed <ok> <failed>" (ok: the peer's FIN arrived,
      no reset) once done.

Runs until killed; prints errors on stderr. No shell, no external tools.
"""
from __future__ import annotations

import argparse
import selectors
import socket
import sys
import time


def serve(port: int) -> int:
    sel = selectors.DefaultSelector()
    lsock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    lsock.bind(("::", port))
    lsock.listen(4096)
    lsock.setblocking(False)
    sel.register(lsock, selectors.EVENT_READ)
    print(f"listening {port}", flush=True)
    while True:
        for key, _ in sel.select():
            sock = key.fileobj
            if sock is lsock:
                while True:
                    try:
                        conn, _ = lsock.accept()
                    except BlockingIOError:
                        break
                    conn.setblocking(False)
                    sel.register(conn, selectors.EVENT_READ)
                continue
            try:
                data = sock.recv(65536)  # type: ignore[union-attr]
            except (ConnectionResetError, BlockingIOError):
                data = b""
            if data:
                try:
                    sock.send(data)  # type: ignore[union-attr]
                except OSError:
                    pass
            else:
                sel.unregister(sock)
                sock.close()  # type: ignore[union-attr]


def open_many(host: str, port: int, n: int, cport_base: int | None) -> int:
    socks: list[socket.socket] = []
    start = time.time()
    for i in range(n):
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if cport_base:
            s.bind(("", cport_base + i))
        s.settimeout(10)
        s.connect((host, port))
        s.setblocking(False)
        socks.append(s)
    end = time.time()
    print(f"open {end:.6f} {end - start:.6f}", flush=True)
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin, selectors.EVENT_READ)
    while True:
        if sel.select(timeout=0.2):
            line = sys.stdin.readline()
            if line.strip() == "close" or not line:
                break
        for s in socks:
            try:
                s.send(b"k")
                s.recv(4096)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                print(f"connection {s.getsockname()} failed: {exc}", file=sys.stderr, flush=True)
    ok = failed = 0
    for s in socks:
        try:
            s.shutdown(socket.SHUT_WR)
        except OSError:
            failed += 1
            continue
    deadline = time.time() + 10
    for s in socks:
        s.setblocking(True)
        s.settimeout(max(0.1, deadline - time.time()))
        try:
            while s.recv(4096):
                pass
            ok += 1
        except OSError:
            failed += 1
        s.close()
    print(f"closed {ok} {failed}", flush=True)
    return 0 if not failed else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("port", type=int)
    o = sub.add_parser("open")
    o.add_argument("host")
    o.add_argument("port", type=int)
    o.add_argument("n", type=int)
    o.add_argument("--cport-base", type=int)
    args = ap.parse_args()
    if args.cmd == "serve":
        return serve(args.port)
    return open_many(args.host, args.port, args.n, args.cport_base)


if __name__ == "__main__":
    sys.exit(main())
