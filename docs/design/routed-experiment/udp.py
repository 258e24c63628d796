# ruff: noqa: E501, E701, E702, B007  (throw-away experiment scripts of docs/design/routed.md, kept as run)
import os
import socket
import sys

# udp.py DST PORT COUNT [TTL]   (SIZE=bytes in the environment: the datagram's payload, default 100)
dst, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fam = socket.AF_INET6 if ":" in dst else socket.AF_INET
s = socket.socket(fam, socket.SOCK_DGRAM)
s.bind(("::" if fam == socket.AF_INET6 else "0.0.0.0", 40000))
if len(sys.argv) > 4:
    if fam == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_UNICAST_HOPS, int(sys.argv[4]))
    else:
        s.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, int(sys.argv[4]))
for i in range(count):
    s.sendto(b"x" * int(os.environ.get("SIZE", "100")), (dst, port))
