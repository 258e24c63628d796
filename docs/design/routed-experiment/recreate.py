# ruff: noqa: E501, E701, E702, B007  (throw-away experiment scripts of docs/design/routed.md, kept as run)
# recreate.py VARIANT ORIG_SRC ORIG_SPORT ORIG_DST ORIG_DPORT NAT_IP NAT_PORT: re-create the deleted TCP entry ESTABLISHED
#   plain:     the codec's restore_message as today (orig + the entry's NAT'd reply tuple), no CTA_NAT_*
#   nat:       orig + orig reversed as reply + CTA_NAT_SRC (the translated address and port, min = max)
#   nat_reply: orig + the NAT'd reply + CTA_NAT_SRC
#   dnat:      orig + orig reversed + CTA_NAT_DST (NAT_IP:NAT_PORT is where the original goes)
import socket
import struct
import sys

sys.path.insert(0, __import__('os').path.join(__import__('os').path.dirname(__file__), '..', '..', '..'))
from nfshunt.kernel import codec
from nfshunt.records.model import FlowTuple

v, osrc, osp, odst, odp, nip, nport = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6], int(sys.argv[7])
CTA_NAT_SRC, CTA_NAT_DST, CTA_NAT_V4_MINIP, CTA_NAT_V4_MAXIP, CTA_NAT_PROTO = 6, 13, 1, 2, 3
CTA_PROTONAT_PORT_MIN, CTA_PROTONAT_PORT_MAX = 1, 2
orig = FlowTuple(4, 6, osrc, odst, osp, odp)
if v == "dnat":
    natted = FlowTuple(4, 6, nip, osrc, nport, osp)
else:
    natted = FlowTuple(4, 6, odst, nip, odp, nport)
def nat_attr(atype):
    ip = socket.inet_aton(nip)
    proto = codec.nla(CTA_PROTONAT_PORT_MIN, struct.pack("!H", nport)) + codec.nla(CTA_PROTONAT_PORT_MAX, struct.pack("!H", nport))
    return codec.nla(atype | codec.NLA_F_NESTED, codec.nla(CTA_NAT_V4_MINIP, ip) + codec.nla(CTA_NAT_V4_MAXIP, ip)
                     + codec.nla(CTA_NAT_PROTO | codec.NLA_F_NESTED, proto))
reply = natted if v in ("plain", "nat_reply") else orig.reversed()
msg = codec.restore_message(4, orig, reply, 3, 300, True, 0, 1)
extra = {"plain": b"", "nat": nat_attr(CTA_NAT_SRC), "nat_reply": nat_attr(CTA_NAT_SRC), "dnat": nat_attr(CTA_NAT_DST)}[v]
body = msg + extra
msg = struct.pack("=I", len(body)) + body[4:]
s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, codec.NETLINK_NETFILTER); s.bind((0, 0)); s.settimeout(2)
s.send(msg); print(v, "ack:", [c for _, c in codec.netlink_acks(s.recv(65536))])
