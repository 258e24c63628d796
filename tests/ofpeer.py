"""A hostile OpenFlow 1.3 peer for the trust tests: it connects to the controller, claims
a datapath id, answers the handshake, echoes and barriers, and answers every flow-stats
request with a forged NFShunt shunt pair. Messages are packed by hand (os-ken builds
requests, not replies); the match and instructions use os-ken's own serialisers."""
from __future__ import annotations

import socket
import struct
import threading

from os_ken.ofproto import ofproto_protocol

OFP13 = 4
HDR = struct.Struct("!BBHI")
T_HELLO, T_ECHO_REQ, T_ECHO_REP, T_FEATURES_REQ, T_FEATURES_REP = 0, 2, 3, 5, 6
T_MP_REQ, T_MP_REP, T_BARRIER_REQ, T_BARRIER_REP, T_FLOW_MOD = 18, 19, 20, 21, 14
MP_FLOW, MP_PORT_DESC = 1, 13


def _msg(mtype: int, xid: int, body: bytes = b"") -> bytes:
    return HDR.pack(OFP13, mtype, HDR.size + len(body), xid) + body


def forged_flow(cookie: int, in_port: int, out_port: int, src: str, dst: str, sport: int, dport: int,
                priority: int = 33000) -> bytes:
    """One ofp_flow_stats entry: an exact TCP match forwarding to out_port, of the very
    shape NFShunt installs (untagged: vlan_vid none), which is the only one it adopts."""
    dp = ofproto_protocol.ProtocolDesc(OFP13)
    p = dp.ofproto_parser
    match = p.OFPMatch(in_port=in_port, vlan_vid=0x0000, eth_type=0x0800, ip_proto=6, ipv4_src=src, ipv4_dst=dst,
                       tcp_src=sport, tcp_dst=dport)
    mbuf = bytearray()
    match.serialize(mbuf, 0)
    ibuf = bytearray()
    p.OFPInstructionActions(dp.ofproto.OFPIT_APPLY_ACTIONS, [p.OFPActionOutput(out_port)]).serialize(ibuf, 0)
    fixed = struct.Struct("!HBxIIHHHH4xQQQ")
    length = fixed.size + len(mbuf) + len(ibuf)
    return fixed.pack(length, 0, 5, 0, priority, 10, 0, 1, cookie, 1000, 100000) + bytes(mbuf) + bytes(ibuf)


class ForgedSwitch:
    """Runs on a thread until close(); records what the controller sent it."""

    def __init__(self, address: tuple[str, int], dpid: int, flows: list[bytes], source: str | None = None):
        self.dpid = dpid
        self.flows = flows
        self.sock = socket.create_connection(address, timeout=5, source_address=(source, 0) if source else None)
        self.received: list[int] = []  # message types
        self.flow_mods = 0
        self.closed_by_peer = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.sock.sendall(_msg(T_HELLO, 1))
        self._thread.start()

    def _run(self) -> None:
        buf = b""
        self.sock.settimeout(0.2)
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                break
            if not data:
                break
            buf += data
            while len(buf) >= HDR.size:
                _v, mtype, length, xid = HDR.unpack_from(buf)
                if len(buf) < length:
                    break
                body, buf = buf[HDR.size:length], buf[length:]
                self._answer(mtype, xid, body)
        self.closed_by_peer.set()

    def _answer(self, mtype: int, xid: int, body: bytes) -> None:
        self.received.append(mtype)
        out = b""
        if mtype == T_FEATURES_REQ:
            # One table: the controller picks the single-table layout, whose pairs the
            # forged flows (output in table 0) are.
            out = _msg(T_FEATURES_REP, xid, struct.pack("!QIBB2xII", self.dpid, 0, 1, 0, 0x4F, 0))
        elif mtype == T_ECHO_REQ:
            out = _msg(T_ECHO_REP, xid, body)
        elif mtype == T_BARRIER_REQ:
            out = _msg(T_BARRIER_REP, xid)
        elif mtype == T_FLOW_MOD:
            self.flow_mods += 1
        elif mtype == T_MP_REQ:
            (mp_type,) = struct.unpack_from("!H", body)
            payload = b"".join(self.flows) if mp_type == MP_FLOW else b""
            out = _msg(T_MP_REP, xid, struct.pack("!HH4x", mp_type, 0) + payload)
        if out:
            try:
                self.sock.sendall(out)
            except OSError:
                pass

    def wait_closed(self, timeout: float) -> bool:
        return self.closed_by_peer.wait(timeout)

    def close(self) -> None:
        self._stop = True
        try:
            self.sock.close()
        except OSError:
            pass
        self._thread.join(timeout=2)
