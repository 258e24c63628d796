"""The switch's own flow-mod limit, measured beside the controller in the same run.

The same flow-mods the controller sends for N UDP shunt pairs (built by its FlowBuilder),
serialised before the clock starts and written straight to the bridge's management socket
(Open vSwitch's `punix:<rundir>/<bridge>.mgmt`) behind one barrier. The barrier reply ends
the clock: what is left is the switch's own work, with no controller in the way.

Two differences from the controller's messages, both for the run's hygiene and neither
costing the switch at install: the send-flow-removed flag is cleared (so removing the
measurement's flows does not flood the running controller with notifications), and the
cookies are the probe's rate-test pairs (NFShunt never installs those).
"""
from __future__ import annotations

import socket
import struct
import time
from typing import Callable

from os_ken.ofproto import ofproto_protocol

from nfshunt.config import Config
from nfshunt.core import Conn
from nfshunt.flows import FlowBuilder
from nfshunt.model import UDP, FlowTuple
from nfshunt.probe import PROBE_FLOWS, RATE_ID

RATE_FLOWS = PROBE_FLOWS[2]  # cookie and mask of the probe's rate-test pairs, which these are

OFP13 = 4
HDR = struct.Struct("!BBHI")
T_HELLO, T_ERROR, T_FLOW_MOD, T_BARRIER_REQ, T_BARRIER_REP = 0, 1, 14, 20, 21
FLAGS_AT = 44  # ofp_flow_mod.flags in OpenFlow 1.3 (header 8, cookie 8, mask 8, table .. out_group 20)
SEND_FLOW_REM = 0x1
CHUNK = 1 << 20


def _msg(mtype: int, xid: int, body: bytes = b"") -> bytes:
    return HDR.pack(OFP13, mtype, HDR.size + len(body), xid) + body


def pair_tuple(i: int) -> FlowTuple:
    """The i-th measurement pair: 10.66.x.y -> 10.67.0.1 UDP (apart from ctfeed's 10.64/10.65)."""
    return FlowTuple(4, UDP, f"10.66.{(i >> 14) & 0xFF}.{(i >> 6) & 0xFF}", "10.67.0.1",
                     1024 + (i & 0x3F) * 1000 + (i >> 22), 5201)


def flow_mods(cfg: Config, n: int) -> bytes:
    """2n shunt flow-mods as the controller builds them, between its first and last port group."""
    fb = FlowBuilder(ofproto_protocol.ProtocolDesc(OFP13), cfg)
    a, b = cfg.ports[0], cfg.ports[-1]
    buf = bytearray()
    for i in range(n):
        t = pair_tuple(i)
        conn = Conn(t, t.reversed(), RATE_ID + i, "shunt", a, b, 0.0)
        for msg in fb.install(conn):
            msg.set_xid(i + 1)
            msg.serialize()
            m = bytearray(msg.buf)
            struct.pack_into("!H", m, FLAGS_AT, struct.unpack_from("!H", m, FLAGS_AT)[0] & ~SEND_FLOW_REM)
            buf += m
    return bytes(buf)


def delete_all_pairs(cfg: Config) -> bytes:
    """One flow-mod deleting every measurement pair (by cookie and mask)."""
    fb = FlowBuilder(ofproto_protocol.ProtocolDesc(OFP13), cfg)
    msg = fb.delete_by_cookie(*RATE_FLOWS)
    msg.set_xid(0xFFFFFFF0)
    msg.serialize()
    return bytes(msg.buf)


class MgmtConnection:
    """An OpenFlow 1.3 session on a bridge's management socket."""

    def __init__(self, path: str, timeout: float = 120.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.buf = b""
        self.errors = 0
        self.sock.sendall(_msg(T_HELLO, 1))
        self._until(lambda mtype, xid: mtype == T_HELLO)

    def _until(self, done: Callable[[int, int], bool]) -> None:
        while True:
            while len(self.buf) >= HDR.size:
                version, mtype, length, xid = HDR.unpack_from(self.buf)
                if length < HDR.size:
                    raise RuntimeError(f"bad OpenFlow length {length} from the switch")
                if len(self.buf) < length:
                    break
                self.buf = self.buf[length:]
                if mtype == T_ERROR:
                    self.errors += 1
                if done(mtype, xid):
                    return
            data = self.sock.recv(CHUNK)
            if not data:
                raise RuntimeError("the switch closed the management connection")
            self.buf += data

    def barrier(self, xid: int) -> None:
        self.sock.sendall(_msg(T_BARRIER_REQ, xid))
        self._until(lambda mtype, x: mtype == T_BARRIER_REP and x == xid)

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        for at in range(0, len(view), CHUNK):
            self.sock.sendall(view[at:at + CHUNK])

    def close(self) -> None:
        self.sock.close()


def measure(cfg: Config, bridge: str, n: int, rundir: str = "/var/run/openvswitch") -> dict[str, float]:
    """Pairs a second the switch takes: 2n pre-serialised flow-mods behind one barrier.
    The measurement's flows are deleted again (behind their own barrier) before it returns."""
    data = flow_mods(cfg, n)
    conn = MgmtConnection(f"{rundir}/{bridge}.mgmt")
    try:
        start = time.monotonic()
        conn.send(data)
        conn.barrier(0xFFFFFF00)
        seconds = time.monotonic() - start
        errors = conn.errors
        conn.send(delete_all_pairs(cfg))
        conn.barrier(0xFFFFFF01)
    finally:
        conn.close()
    return {"pairs": n, "flow_mods": 2 * n, "seconds": seconds, "pairs_per_s": n / seconds, "errors": errors}
