# ruff: noqa: E501, E701, E702, B007  (throw-away experiment scripts of docs/design/routed.md, kept as run)
# ctwatch.py SECONDS: print every conntrack event for port 7000: kind, orig, reply as the kernel sent it, status bits, mark
import socket
import struct
import sys
import time

sys.path.insert(0, __import__('os').path.join(__import__('os').path.dirname(__file__), '..', '..', '..'))
from nfshunt.kernel import codec

BITS = ["EXPECTED", "SEEN_REPLY", "ASSURED", "CONFIRMED", "SRC_NAT", "DST_NAT", "SEQ_ADJUST", "SRC_NAT_DONE",
        "DST_NAT_DONE", "DYING", "FIXED_TIMEOUT", "TEMPLATE", "UNTRACKED", "HELPER", "OFFLOAD", "HW_OFFLOAD"]
def status(data, top):
    v = codec._be(data, top.get(3), codec.BE32) or 0
    return "|".join(b for i, b in enumerate(BITS) if v >> i & 1)
def tup(data, span, fam):
    return str(codec._fast_tuple(data, span, fam, 0))
s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, codec.NETLINK_NETFILTER); s.bind((0, 1 | 2 | 4)); s.settimeout(0.5)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    try: data = s.recv(65536)
    except socket.timeout: continue
    off = 0
    while off + 16 <= len(data):
        length, mtype, flags = struct.unpack_from("=IHH", data, off)
        fam = codec.FAMILY.get(data[off + 16])
        top = codec._attrs(data, off + 20, off + length)
        kind = "DESTROY" if mtype & 0xff == 2 else ("NEW" if flags & 0x400 else "UPDATE")
        o, r = tup(data, top.get(1), fam), tup(data, top.get(2), fam)
        if "7000" in o:
            print(f"{kind:7} orig [{o}] reply [{r}] status {status(data, top)} mark {codec._be(data, top.get(8), codec.BE32)} attrs {sorted(top)}", flush=True)
        off += (length + 3) & ~3
