# ruff: noqa: E501, E701, E702, B007  (throw-away experiment scripts of docs/design/routed.md, kept as run)
# liberal.py SRC SPORT DST DPORT: set BE_LIBERAL on both directions of the TCP entry (the codec's liberal_message)
import socket
import sys

sys.path.insert(0, __import__('os').path.join(__import__('os').path.dirname(__file__), '..', '..', '..'))
from nfshunt.kernel import codec
from nfshunt.records.model import FlowTuple

t = FlowTuple(4, 6, sys.argv[1], sys.argv[3], int(sys.argv[2]), int(sys.argv[4]))
s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, codec.NETLINK_NETFILTER); s.bind((0, 0)); s.settimeout(2)
s.send(codec.liberal_message(4, t, 0, 1)); print("liberal ack:", [c for _, c in codec.netlink_acks(s.recv(65536))])
