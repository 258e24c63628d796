#!/usr/bin/env python3
"""Create marked conntrack entries over netlink at a given rate (run inside the firewall's
namespace). Each creation raises the same NEW event a real connection does, so the
controller shunts it: this feeds the controller without generating traffic.

  ctfeed.py --rate R --seconds S [--proto tcp|udp] [--start N] [--out CSV] [--action shunt]

Entries: 10.64.x.y:port -> 10.65.0.1:5201, unique per index, ESTABLISHED for TCP,
marked with ingress 1, egress 2 and the action. Prints one JSON summary line. --out
writes "index,src,sport,t_created" (epoch seconds) for end-to-end latency.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pyroute2.netlink import NLM_F_ACK, NLM_F_REQUEST  # noqa: E402
from pyroute2.netlink.nfnetlink import NFNL_SUBSYS_CTNETLINK  # noqa: E402
from pyroute2.netlink.nfnetlink.nfctsocket import IPCTNL_MSG_CT_NEW, NFCTAttrTuple, nfct_msg  # noqa: E402

from nfshunt.kernel.codec import netlink_acks  # noqa: E402
from nfshunt.records import markcodec  # noqa: E402

NETLINK_NETFILTER = 12
NLM_F_CREATE, NLM_F_EXCL = 0x400, 0x200
BATCH_INTERVAL = 0.005  # send what is due every 5 ms


def address(i: int) -> tuple[str, int]:
    return f"10.64.{(i >> 14) & 0xFF}.{(i >> 6) & 0xFF}", 1024 + (i & 0x3F) * 1000 + (i >> 22)


class Encoder:
    """pyroute2 encodes one template; each entry patches its address, port and sequence
    number in (pyroute2 alone manages ~5,000 messages/s, too slow to offer higher rates)."""

    SRC, SPORT = "10.64.201.202", 0xA7A5  # byte patterns that occur nowhere else

    def __init__(self, proto: int, mark: int):
        self.template = bytearray(message_slow(self.SRC, self.SPORT, proto, mark, 0))
        src = socket.inet_aton(self.SRC)
        self.src_at = [i for i in range(len(self.template) - 3) if self.template[i:i + 4] == src]
        port = struct.pack("!H", self.SPORT)
        self.port_at = [i for i in range(len(self.template) - 1) if self.template[i:i + 2] == port]
        if len(self.src_at) != 2 or len(self.port_at) != 2:
            raise RuntimeError("template fields not found exactly twice")

    def __call__(self, i: int, seq: int) -> bytes:
        src, sport = address(i)
        b = self.template
        raw = socket.inet_aton(src)
        for at in self.src_at:
            b[at:at + 4] = raw
        p = struct.pack("!H", sport)
        for at in self.port_at:
            b[at:at + 2] = p
        struct.pack_into("=I", b, 8, seq)
        return bytes(b)


def message_slow(src: str, sport: int, proto: int, mark: int, seq: int) -> bytes:
    dst, dport = "10.65.0.1", 5201
    kw = {}
    if proto == socket.IPPROTO_TCP:
        kw["protoinfo"] = {"attrs": [["CTA_PROTOINFO_TCP", {"attrs": [["CTA_PROTOINFO_TCP_STATE", 3]]}]]}
    msg = nfct_msg.create_from(
        tuple_orig=NFCTAttrTuple(family=socket.AF_INET, saddr=src, daddr=dst, proto=proto, sport=sport, dport=dport),
        tuple_reply=NFCTAttrTuple(family=socket.AF_INET, saddr=dst, daddr=src, proto=proto, sport=dport, dport=sport),
        timeout=600, mark=mark, **kw)
    msg["header"]["type"] = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW
    msg["header"]["flags"] = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL
    msg["header"]["sequence_number"] = seq
    msg["nfgen_family"] = socket.AF_INET
    msg.encode()
    return bytes(msg.data)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, required=True, help="entries per second (0: as fast as possible)")
    ap.add_argument("--seconds", type=float, default=0, help="how long (or --count)")
    ap.add_argument("--count", type=int, default=0)
    ap.add_argument("--proto", choices=["tcp", "udp"], default="tcp")
    ap.add_argument("--action", type=int, default=1, help="action number in the mark (1: shunt)")
    ap.add_argument("--start", type=int, default=0, help="first index (keeps runs' tuples apart)")
    ap.add_argument("--out")
    args = ap.parse_args()
    total = args.count or int(args.rate * args.seconds)
    if total <= 0:
        ap.error("give --count, or --rate and --seconds")
    proto = socket.IPPROTO_TCP if args.proto == "tcp" else socket.IPPROTO_UDP
    mark = markcodec.encode(1, 2, args.action)
    encode = Encoder(proto, mark)
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE: room for the acks
    sock.bind((0, 0))
    sock.setblocking(False)
    created = failed = 0
    errors: dict[str, int] = {}
    times: list[tuple[int, float]] = []
    start = time.time()
    sent = 0

    def drain() -> None:
        nonlocal created, failed
        while True:
            try:
                data = sock.recv(1 << 20)
            except BlockingIOError:
                return
            for _seq, code in netlink_acks(data):
                if code == 0:
                    created += 1
                else:
                    failed += 1
                    name = errno.errorcode.get(-code, str(code))
                    errors[name] = errors.get(name, 0) + 1

    while sent < total:
        now = time.time()
        due = total if args.rate <= 0 else min(total, int((now - start) * args.rate) + 1)
        if due > sent:
            due = min(due, sent + 400)  # one datagram stays well under the socket's send buffer
            buf = bytearray()
            for i in range(sent, due):
                buf += encode(args.start + i, i + 1)
            try:
                sock.send(bytes(buf))
            except BlockingIOError:
                drain()
                time.sleep(0.001)
                continue
            times.extend((args.start + i, now) for i in range(sent, due))
            sent = due
        drain()
        if args.rate > 0:
            time.sleep(max(0.0, min(BATCH_INTERVAL, start + sent / args.rate - time.time())))
    end = time.time()
    deadline = end + 5
    while created + failed < sent and time.time() < deadline:
        drain()
        time.sleep(0.01)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("index,src,sport,t_created\n")
            for i, t in times:
                src, sport = address(i)
                fh.write(f"{i},{src},{sport},{t:.6f}\n")
    print(json.dumps({"offered_rate": args.rate, "sent": sent, "created": created, "failed": failed,
                      "errors": errors, "start": start, "end": end,
                      "achieved_rate": sent / (end - start) if end > start else None}), flush=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
