"""The switch's own limits, measured beside the controller in the same run: its flow-mod
rate, and how long it takes to report its flows (a reconcile's read).

The same flow-mods the controller sends for N UDP shunt pairs (built by its FlowBuilder),
serialised before the clock starts and written straight to the bridge's management socket
(Open vSwitch's `punix:<rundir>/<bridge>.mgmt`) behind one barrier. The barrier reply ends
the clock: what is left is the switch's own work, with no controller in the way.

Two differences from the controller's messages, both for the run's hygiene and neither
costing the switch at install: the send-flow-removed flag is cleared (so removing the
measurement's flows does not flood the running controller with notifications), and the
cookies are the probe's rate-test pairs (NFShunt never installs those).

`sustained` is the steady-rate counterpart, for the rate benchmark: the flow-mods go in
batches behind a barrier every 10 ms, the flag kept, and the flows idle out as a
controller's do, so the switch also expires them and sends their flow-removed messages.
"""
from __future__ import annotations

import itertools
import math
import socket
import struct
import threading
import time
from typing import Any, Callable

from os_ken.ofproto import ofproto_protocol

from nfshunt.config.settings import Config
from nfshunt.core.connection import Action, Conn
from nfshunt.openflow.flows import FlowBuilder
from nfshunt.probe import PROBE_FLOWS, RATE_ID
from nfshunt.records.model import UDP, FlowTuple

RATE_FLOWS = PROBE_FLOWS[2]  # cookie and mask of the probe's rate-test pairs, which these are

OFP13 = 4
HDR = struct.Struct("!BBHI")
T_HELLO, T_ERROR, T_SET_CONFIG, T_FLOW_REMOVED, T_FLOW_MOD, T_MULTIPART_REP, T_BARRIER_REQ, T_BARRIER_REP = (
    0, 1, 9, 11, 14, 19, 20, 21)
SET_CONFIG = struct.Struct("!HH")  # flags, miss_send_len
MULTIPART_REP = struct.Struct("!HH4x")  # ofp_multipart_reply after the header: type, flags
REPLY_MORE = 1
FLAGS_AT = 44  # ofp_flow_mod.flags in OpenFlow 1.3 (header 8, cookie 8, mask 8, table .. out_group 20)
SEND_FLOW_REM = 0x1
CHUNK = 1 << 20
TICK = 0.01  # the sustained measure's batch interval: a flow-mod batch and a barrier every 10 ms


def _msg(mtype: int, xid: int, body: bytes = b"") -> bytes:
    return HDR.pack(OFP13, mtype, HDR.size + len(body), xid) + body


def pair_tuple(i: int) -> FlowTuple:
    """The i-th measurement pair: 10.66.x.y -> 10.67.0.1 UDP (apart from ctfeed's 10.64/10.65)."""
    return FlowTuple(4, UDP, f"10.66.{(i >> 14) & 0xFF}.{(i >> 6) & 0xFF}", "10.67.0.1",
                     1024 + (i & 0x3F) * 1000 + (i >> 22), 5201)


def pair_mods(cfg: Config, n: int, removed: bool = False) -> list[bytes]:
    """The flow-mods of n shunt pairs as the controller builds them, between its first and
    last port group, one bytes a pair; removed=False clears the send-flow-removed flag."""
    fb = FlowBuilder(ofproto_protocol.ProtocolDesc(OFP13), cfg)
    a, b = cfg.switches[0].ports[0], cfg.switches[0].ports[-1]
    out = []
    for i in range(n):
        t = pair_tuple(i)
        conn = Conn(t, t.reversed(), RATE_ID + i, Action.SHUNT, a, b, 0.0)
        buf = bytearray()
        for msg in fb.install(conn):
            msg.set_xid(i + 1)
            msg.serialize()
            m = bytearray(msg.buf)
            if not removed:
                struct.pack_into("!H", m, FLAGS_AT, struct.unpack_from("!H", m, FLAGS_AT)[0] & ~SEND_FLOW_REM)
            buf += m
        out.append(bytes(buf))
    return out


def flow_mods(cfg: Config, n: int) -> bytes:
    """2n shunt flow-mods as the controller builds them (pair_mods), without the flag."""
    return b"".join(pair_mods(cfg, n))


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

    def _until(self, done: Callable[[int, int], bool], seen: Callable[[bytes], None] | None = None) -> None:
        while True:
            while len(self.buf) >= HDR.size:
                version, mtype, length, xid = HDR.unpack_from(self.buf)
                if length < HDR.size:
                    raise RuntimeError(f"bad OpenFlow length {length} from the switch")
                if len(self.buf) < length:
                    break
                if seen is not None:
                    seen(self.buf[:length])
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

    def read_flows(self, request: bytes, xid: int) -> int:
        """Send a flow-stats request (serialised with this xid) and read every part of the
        reply; the number of entries."""
        entries, last = 0, False

        def seen(msg: bytes) -> None:
            nonlocal entries, last
            _, mtype, length, x = HDR.unpack_from(msg)
            if mtype != T_MULTIPART_REP or x != xid:
                return
            at = HDR.size + MULTIPART_REP.size
            while at + 2 <= length:
                step = struct.unpack_from("!H", msg, at)[0]
                if step == 0:
                    raise RuntimeError("a flow-stats entry of length 0 from the switch")
                entries, at = entries + 1, at + step
            last = not MULTIPART_REP.unpack_from(msg, HDR.size)[1] & REPLY_MORE

        self.sock.sendall(request)
        self._until(lambda mtype, x: last, seen)
        return entries

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


def read_seconds(cfg: Config, bridge: str, rundir: str = "/var/run/openvswitch") -> dict[str, float]:
    """Seconds the switch takes to report NFShunt's flows, to a reader that only counts
    them: the controller's own request for a reconcile (FlowBuilder.owned_flow_stats_request)."""
    msg = FlowBuilder(ofproto_protocol.ProtocolDesc(OFP13), cfg).owned_flow_stats_request()
    msg.set_xid(0xFFFFFF02)
    msg.serialize()
    conn = MgmtConnection(f"{rundir}/{bridge}.mgmt")
    try:
        start = time.monotonic()
        entries = conn.read_flows(bytes(msg.buf), 0xFFFFFF02)
        seconds = time.monotonic() - start
    finally:
        conn.close()
    return {"entries": entries, "seconds": seconds}


# --- sustained: the switch alone at a steady rate --------------------------------------------

def batches(rate: float, seconds: float, tick: float = TICK) -> list[int]:
    """Pairs in each tick's batch: those due by the tick's end less those sent before, so
    a rate that is not a multiple of 1/tick is spread evenly."""
    due = [math.floor(rate * i * tick + 1e-9) for i in range(max(1, round(seconds / tick)) + 1)]
    return [b - a for a, b in itertools.pairwise(due)]


def sustained(cfg: Config, bridge: str, rate: float, seconds: float,
              rundir: str = "/var/run/openvswitch") -> dict[str, Any]:
    """The switch alone at a steady rate: every TICK the flow-mods of the pairs due by then
    (the controller's own, flow-removed flag kept) and a barrier. A batch's latency runs from
    the moment it was due to its barrier reply, so a switch that falls behind shows it. The
    flows idle out as the controller's do, and the switch sends their flow-removed messages
    here (a management connection gets them once it sets a miss send length), as it would
    to the controller. Run it with no controller connected."""
    sizes = batches(rate, seconds)
    per_pair = pair_mods(cfg, sum(sizes), removed=True)
    conn = MgmtConnection(f"{rundir}/{bridge}.mgmt")
    replied: dict[int, float] = {}
    removed = 0

    def seen(msg: bytes) -> None:
        nonlocal removed
        _, mtype, _, xid = HDR.unpack_from(msg)
        if mtype == T_BARRIER_REP:
            replied[xid] = time.monotonic()
        elif mtype == T_FLOW_REMOVED:
            removed += 1

    try:
        conn.sock.sendall(_msg(T_SET_CONFIG, 2, SET_CONFIG.pack(0, 128)))
        last = len(sizes)
        reader = threading.Thread(target=conn._until, args=(lambda mtype, x: mtype == T_BARRIER_REP and x == last,
                                                            seen), daemon=True)
        reader.start()
        start = time.monotonic() + 0.05
        due, at = [], 0
        for i, size in enumerate(sizes):
            due.append(start + (i + 1) * TICK)
            delay = due[-1] - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            conn.send(b"".join(per_pair[at:at + size]) + _msg(T_BARRIER_REQ, i + 1))
            at += size
        reader.join(seconds + 120)
        if reader.is_alive() or last not in replied:
            raise RuntimeError(f"the switch did not answer the last barrier within {seconds + 120:.0f} s")
        removed_in_run, errors = removed, conn.errors
        conn.send(delete_all_pairs(cfg))
        conn.barrier(0xFFFFFF03)
    finally:
        conn.close()
    latencies = [1000 * (replied[i + 1] - due[i]) for i, size in enumerate(sizes) for _ in range(size)]
    return {"pairs": len(latencies), "pairs_per_s": len(latencies) / (replied[last] - start),
            "latencies_ms": latencies, "flow_removed": removed_in_run, "errors": errors}
