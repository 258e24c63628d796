#!/usr/bin/env python3
"""Forge one TCP segment of a running connection, as an attacker on its path would.

Runs in a host's namespace of the testbed (the attacker's place on the path). It reads the
connection's packets off the host's interface (a raw packet socket) to learn where its
peer's window is, then writes one segment with the connection's real tuple straight out
of that interface: the host's own TCP stack never sees it, the switch receives it as the
host's. For the testbed only: it writes to the interface it is given, with addresses
taken from a packet of the connection it saw there.

  tcpforge.py IFACE SRC SPORT DST DPORT

prints "ready", then reads lines "FLAG WINDOW" on stdin (FLAG rst or fin, WINDOW in or
out) and writes one segment for each, as soon as it has seen a fresh packet of the peer:

  in   the sequence number is the peer's next expected one + 1: inside its window, not
       the exact one, so a Linux peer answers a challenge ACK (RFC 5961) to an RST and
       queues a FIN out of order; neither ends the connection
  out  half the sequence space away: outside any window, ignored by the peer

For each it prints one JSON line: the flag, the sequence number written, the peer's next
expected one, and the time (monotonic and epoch) it was written. IPv4 only. No shell, no
external tools.
"""
from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import time

ETH_P_ALL, ETH_P_IP = 0x0003, 0x0800
FIN, RST, ACK = 0x01, 0x04, 0x10


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _parse(frame: bytes) -> tuple[bytes, bytes, str, str, int, int, int, int, int] | None:
    """(dst mac, src mac, src, dst, sport, dport, seq, ack, payload length) of a TCP/IPv4 frame."""
    if len(frame) < 54 or struct.unpack_from("!H", frame, 12)[0] != ETH_P_IP or frame[23] != socket.IPPROTO_TCP:
        return None
    ihl = (frame[14] & 0x0F) * 4
    total = struct.unpack_from("!H", frame, 16)[0]
    tcp = 14 + ihl
    sport, dport, seq, ack, off = struct.unpack_from("!HHIIB", frame, tcp)
    payload = max(0, total - ihl - (off >> 4) * 4)
    return (frame[0:6], frame[6:12], socket.inet_ntoa(frame[26:30]), socket.inet_ntoa(frame[30:34]),
            sport, dport, seq, ack, payload)


def sniff(sock: socket.socket, src: str, sport: int, dst: str, dport: int, timeout: float):
    """The first packet the peer (dst) sends to src on the connection, seen on the interface."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            frame = sock.recv(65535)
        except socket.timeout:
            break
        p = _parse(frame)
        if p is not None and p[2:6] == (dst, src, dport, sport):
            return p
    raise SystemExit(f"no packet of {dst}:{dport} -> {src}:{sport} within {timeout} s")


def segment(eth_dst: bytes, eth_src: bytes, src: str, dst: str, sport: int, dport: int,
            seq: int, ack: int, flags: int) -> bytes:
    tcp = struct.pack("!HHIIBBHHH", sport, dport, seq, ack, 5 << 4, flags, 1024, 0, 0)
    pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!BBH", 0, socket.IPPROTO_TCP, len(tcp))
    tcp = tcp[:16] + struct.pack("!H", _checksum(pseudo + tcp)) + tcp[18:]
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 0x4242, 0x4000, 64, socket.IPPROTO_TCP, 0,
                     socket.inet_aton(src), socket.inet_aton(dst))
    ip = ip[:10] + struct.pack("!H", _checksum(ip)) + ip[12:]
    return eth_dst + eth_src + struct.pack("!H", ETH_P_IP) + ip + tcp


def drain(sock: socket.socket) -> None:
    """Forget what the socket queued: the next packet read is a fresh one."""
    sock.setblocking(False)
    try:
        while True:
            sock.recv(65535)
    except BlockingIOError:
        pass
    finally:
        sock.setblocking(True)


def forge(sock: socket.socket, args: argparse.Namespace, flag: str, window: str) -> dict[str, object]:
    drain(sock)
    # The peer's packet: its ack is the sequence number it expects from src next.
    peer_dst_mac, peer_src_mac, _, _, _, _, peer_seq, expected, payload = sniff(
        sock, args.src, args.sport, args.dst, args.dport, args.sniff_timeout)
    seq = (expected + (1 if window == "in" else 1 << 31)) & 0xFFFFFFFF
    flags = (RST if flag == "rst" else FIN) | ACK
    sock.send(segment(peer_src_mac, peer_dst_mac, args.src, args.dst, args.sport, args.dport, seq,
                      (peer_seq + payload) & 0xFFFFFFFF, flags))
    return {"flag": flag, "window": window, "seq": seq, "expected": expected, "monotonic": time.monotonic(),
            "time": time.time()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("iface")
    ap.add_argument("src")
    ap.add_argument("sport", type=int)
    ap.add_argument("dst")
    ap.add_argument("dport", type=int)
    ap.add_argument("--sniff-timeout", type=float, default=3.0)
    args = ap.parse_args()
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.bind((args.iface, ETH_P_ALL))
    print("ready", flush=True)
    for line in sys.stdin:
        flag, window = line.split()
        if flag not in ("rst", "fin") or window not in ("in", "out"):
            raise SystemExit(f"not a FLAG WINDOW line: {line!r}")
        print(json.dumps(forge(sock, args, flag, window)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
