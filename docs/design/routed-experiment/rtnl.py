# ruff: noqa: E501, E701, E702, B007  (throw-away experiment scripts of docs/design/routed.md, kept as run)
# rtnl.py: the firewall's route and neighbour for h2 read with pyroute2, then 6 s of RTM_*NEIGH / RTM_*ROUTE events
import select
import sys
import time

from pyroute2 import IPRoute
from pyroute2.netlink.rtnl import RTMGRP_IPV4_ROUTE, RTMGRP_IPV6_ROUTE, RTMGRP_NEIGH

with IPRoute() as ip:
    for dst in ("10.0.2.1", "fd02::1", "192.0.2.9"):
        try:
            r = ip.route("get", dst=dst)[0]
            print("route get", dst, {k: r.get(k) for k in ("RTA_OIF", "RTA_GATEWAY", "RTA_PREFSRC", "RTA_DST")}, "type", r["type"])
        except Exception as e:
            print("route get", dst, "->", type(e).__name__, e)
    for n in ip.get_neighbours(dst="10.0.2.1") + ip.get_neighbours(dst="fd02::1"):
        print("neigh", n.get("NDA_DST"), n.get("NDA_LLADDR"), "state", n["state"], "ifindex", n["ifindex"])
with IPRoute() as ip:
    t0 = time.monotonic()
    ip.bind(groups=RTMGRP_NEIGH | RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_ROUTE)
    end = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < end:
        if not select.select([ip.fileno()], [], [], 0.2)[0]:
            continue
        for m in ip.get():
            ev = m["event"]
            if "NEIGH" in ev:
                print(f"{time.monotonic()-t0:5.2f} {ev} {m.get('NDA_DST')} {m.get('NDA_LLADDR')} state {m['state']:#x} if {m['ifindex']}", flush=True)
            else:
                print(f"{time.monotonic()-t0:5.2f} {ev} dst {m.get('RTA_DST')}/{m['dst_len']} oif {m.get('RTA_OIF')} gw {m.get('RTA_GATEWAY')} type {m['type']} table {m.get('RTA_TABLE')}", flush=True)
