# ruff: noqa: E501, E701, E702, B007  (throw-away experiment scripts of docs/design/routed.md, kept as run)
# udp_special.py frag|rr: one UDP datagram to 10.0.2.1:9999 from port 40000: 3000 B without DF (3 fragments), or 100 B with a record-route option
import socket
import sys

s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", 40000))
if sys.argv[1] == "frag":
    s.setsockopt(socket.IPPROTO_IP, 10, 0)  # IP_MTU_DISCOVER = IP_PMTUDISC_DONT
    s.sendto(b"f" * 3000, ("10.0.2.1", 9999))
else:
    s.setsockopt(socket.IPPROTO_IP, socket.IP_OPTIONS, bytes([7, 39, 4]) + bytes(36) + bytes([1]))
    s.sendto(b"r" * 100, ("10.0.2.1", 9999))
