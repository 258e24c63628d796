#!/usr/bin/env python3
"""Many small TCP connections for the testbed (tests and benchmarks), in a host's namespace.

  conngen.py serve PORT
      accept any number of connections and echo what they send; a peer's close is
      answered with a clean close; a peer's line "bye" is answered with the server's own
      close first.
  conngen.py rate HOST PORT --rate R --seconds S [--hold H] [--out CSV]
      open R connections per second for S seconds, close each H seconds after it is up;
      print a JSON summary, and with --out "sport,t_start" (epoch) of every connection.
  conngen.py open HOST PORT N [--cport-base P]
      open N connections as fast as possible and print "open <epoch> <seconds>" when all are
      up; keep each one alive with a small echo every 0.2 s; on the line "close" on stdin,
      close them all cleanly and print "closed <ok> <failed>" (ok: the peer's FIN arrived,
      no reset) once done.
  conngen.py bulk HOST PORT [--cport P]
      one connection writing 64 KB blocks (what it reads back is drained) and printing
      "up" once connected; on the line "close" on stdin, close after the last block (its
      FIN rides on data) and print "closed <seconds> <ok>": how long until the peer's FIN
      arrived, and whether it did without a reset.
  conngen.py again HOST PORT --cport P
      one connection from the fixed port P, printing "up"; on stdin, "ping" sends a byte
      and prints "pong" once it is echoed; "close" asks the server to close first (the
      line "bye"), waits for its FIN, closes and prints "closed <seconds>"; "reconnect"
      opens a new connection from the same port P (trying again while the old one's last
      ACK is on its way) and prints "reconnected <seconds>" once a byte was echoed on it;
      "abort" resets the connection (SO_LINGER 0: an RST) and prints "aborted".

Runs until killed; prints errors on stderr. No shell, no external tools.
"""
from __future__ import annotations

import argparse
import errno
import json
import resource
import selectors
import socket
import struct
import sys
import time


def _more_files() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1 << 20
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(hard, want)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def rate(host: str, port: int, per_second: float, seconds: float, hold: float, out: str | None) -> int:
    sel = selectors.DefaultSelector()
    start = time.time()
    total = int(per_second * seconds)
    opened = connected = failed = closed = 0
    started: list[tuple[int, float]] = []
    closing: list[tuple[float, socket.socket]] = []  # (close at, socket), in order
    pending: dict[socket.socket, float] = {}
    while opened < total or pending or closing:
        now = time.time()
        due = min(total, int((now - start) * per_second) + 1)
        while opened < due:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            err = s.connect_ex((host, port))
            opened += 1
            if err not in (0, errno.EINPROGRESS):
                failed += 1
                s.close()
                continue
            started.append((s.getsockname()[1], now))
            pending[s] = now
            sel.register(s, selectors.EVENT_WRITE)
        for key, _ in sel.select(timeout=0.002):
            s = key.fileobj  # type: ignore[assignment]
            sel.unregister(s)
            t0 = pending.pop(s)  # type: ignore[arg-type]
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):  # type: ignore[union-attr]
                failed += 1
                s.close()  # type: ignore[union-attr]
                continue
            connected += 1
            closing.append((time.time() + hold, s))  # type: ignore[arg-type]
        now = time.time()
        for s, t0 in list(pending.items()):
            if now - t0 > 10:
                sel.unregister(s)
                del pending[s]
                failed += 1
                s.close()
        while closing and closing[0][0] <= now:
            _, s = closing.pop(0)
            s.close()
            closed += 1
    end = time.time()
    if out:
        with open(out, "w") as fh:
            fh.write("sport,t_start\n")
            fh.writelines(f"{p},{t:.6f}\n" for p, t in started)
    print(json.dumps({"offered_rate": per_second, "opened": opened, "connected": connected, "failed": failed,
                      "closed": closed, "start": start, "end": end}), flush=True)
    return 0


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
            if data.endswith(b"bye\n"):
                sel.unregister(sock)
                sock.close()  # type: ignore[union-attr]  # the server's close comes first
            elif data:
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


def bulk(host: str, port: int, cport: int | None) -> int:
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if cport:
        s.bind(("", cport))
    s.connect((host, port))
    s.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE)
    sel.register(sys.stdin, selectors.EVENT_READ)
    print("up", flush=True)
    block = b"x" * 65536
    while True:
        stop = False
        for key, events in sel.select(1.0):
            if key.fileobj is sys.stdin:
                stop = sys.stdin.readline().strip() == "close"
                continue
            if events & selectors.EVENT_READ:
                try:
                    s.recv(1 << 20)
                except BlockingIOError:
                    pass
            if events & selectors.EVENT_WRITE:
                try:
                    s.send(block)
                except BlockingIOError:
                    pass
        if stop:
            break
    t0 = time.monotonic()
    s.shutdown(socket.SHUT_WR)
    s.setblocking(True)
    s.settimeout(30)
    ok = True
    try:
        while s.recv(1 << 20):
            pass
    except OSError:
        ok = False
    print(f"closed {time.monotonic() - t0:.3f} {int(ok)}", flush=True)
    s.close()
    return 0


def _connect_from(host: str, port: int, cport: int) -> socket.socket:
    """A connection from the fixed port `cport`; while the port's last connection still
    waits for its last ACK the kernel refuses the same tuple, so it is tried again."""
    deadline = time.monotonic() + 5
    while True:
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.settimeout(5)
        try:
            s.bind(("", cport))
            s.connect((host, port))
            return s
        except OSError as exc:
            s.close()
            if exc.errno not in (errno.EADDRNOTAVAIL, errno.EADDRINUSE) or time.monotonic() > deadline:
                raise
            time.sleep(0.001)


def again(host: str, port: int, cport: int) -> int:
    s = _connect_from(host, port, cport)
    print("up", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        t0 = time.monotonic()
        if cmd == "ping":
            s.sendall(b"k")
            s.recv(16)
            print("pong", flush=True)
        elif cmd == "close":
            s.sendall(b"bye\n")
            while s.recv(4096):
                pass
            s.close()
            print(f"closed {time.monotonic() - t0:.4f}", flush=True)
        elif cmd == "reconnect":
            s = _connect_from(host, port, cport)
            s.sendall(b"k")
            s.recv(16)
            print(f"reconnected {time.monotonic() - t0:.4f}", flush=True)
        elif cmd == "abort":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
            print("aborted", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("port", type=int)
    r = sub.add_parser("rate")
    r.add_argument("host")
    r.add_argument("port", type=int)
    r.add_argument("--rate", type=float, required=True)
    r.add_argument("--seconds", type=float, required=True)
    r.add_argument("--hold", type=float, default=1.0)
    r.add_argument("--out")
    o = sub.add_parser("open")
    o.add_argument("host")
    o.add_argument("port", type=int)
    o.add_argument("n", type=int)
    o.add_argument("--cport-base", type=int)
    b = sub.add_parser("bulk")
    b.add_argument("host")
    b.add_argument("port", type=int)
    b.add_argument("--cport", type=int)
    a = sub.add_parser("again")
    a.add_argument("host")
    a.add_argument("port", type=int)
    a.add_argument("--cport", type=int, required=True)
    args = ap.parse_args()
    _more_files()
    if args.cmd == "again":
        return again(args.host, args.port, args.cport)
    if args.cmd == "serve":
        return serve(args.port)
    if args.cmd == "rate":
        return rate(args.host, args.port, args.rate, args.seconds, args.hold, args.out)
    if args.cmd == "bulk":
        return bulk(args.host, args.port, args.cport)
    return open_many(args.host, args.port, args.n, args.cport_base)


if __name__ == "__main__":
    sys.exit(main())
