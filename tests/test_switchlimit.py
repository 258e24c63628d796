"""The switch-limit benchmark writes the controller's own flow-mods (but for the
flow-removed flag), so its rate is the switch's rate for what the controller sends."""
import os
import struct
import sys

from os_ken.ofproto import ofproto_protocol

from nfshunt.core.connection import Action, Conn
from nfshunt.openflow.flows import FlowBuilder
from nfshunt.probe import RATE_ID
from tests.helpers import config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import switchlimit  # noqa: E402

CFG = config()
PORTS = (CFG.switches[0].ports[0], CFG.switches[0].ports[-1])  # the first and last port group (as switchlimit)


def split(data: bytes) -> list[bytes]:
    out, at = [], 0
    while at < len(data):
        length = struct.unpack_from("!H", data, at + 2)[0]
        out.append(data[at:at + length])
        at += length
    return out


def test_the_measurement_writes_the_controllers_flow_mods_without_the_removed_flag():
    fb = FlowBuilder(ofproto_protocol.ProtocolDesc(switchlimit.OFP13), CFG)
    fb.templated = False  # os-ken's own encoder, not the controller's templates
    want = []
    for i in range(3):
        t = switchlimit.pair_tuple(i)
        for msg in fb.install(Conn(t, t.reversed(), RATE_ID + i, Action.SHUNT, *PORTS, 0.0)):
            msg.set_xid(i + 1)
            msg.serialize()
            want.append(bytes(msg.buf))
    got = split(switchlimit.flow_mods(CFG, 3))
    assert len(got) == len(want) == 6
    for g, w in zip(got, want, strict=True):
        flags = struct.unpack_from("!H", w, switchlimit.FLAGS_AT)[0]
        assert flags & switchlimit.SEND_FLOW_REM  # the controller asks for flow-removed ...
        assert struct.unpack_from("!H", g, switchlimit.FLAGS_AT)[0] == flags & ~switchlimit.SEND_FLOW_REM
        assert g[:switchlimit.FLAGS_AT] == w[:switchlimit.FLAGS_AT]  # ... and the rest is the same
        assert g[switchlimit.FLAGS_AT + 2:] == w[switchlimit.FLAGS_AT + 2:]


def test_the_cleanup_deletes_exactly_the_measurement_cookies():
    msg = switchlimit.delete_all_pairs(CFG)
    cookie, mask = struct.unpack_from("!QQ", msg, 8)
    t = switchlimit.pair_tuple(7)
    conn = Conn(t, t.reversed(), RATE_ID + 7, Action.SHUNT, *PORTS, 0.0)
    assert conn.cookie(True) & mask == cookie & mask
    other = Conn(t, t.reversed(), 0x12345678, Action.SHUNT, *PORTS, 0.0)
    assert other.cookie(False) & mask != cookie & mask


def _reply(xid, entries, more):
    body = b"".join(struct.pack("!H", 48) + bytes(46) for _ in range(entries))
    head = struct.pack("!BBHI", switchlimit.OFP13, switchlimit.T_MULTIPART_REP, 16 + len(body), xid)
    return head + switchlimit.MULTIPART_REP.pack(1, switchlimit.REPLY_MORE if more else 0) + body


class FakeSwitch:
    """A management socket at `path`: says hello to the one reader, then hands the
    connection to `serve` (on a thread of its own)."""

    def __init__(self, path, serve):
        import socket
        import threading
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        self.server.listen(1)
        self.serve = serve
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self):
        peer, _ = self.server.accept()
        peer.sendall(switchlimit._msg(switchlimit.T_HELLO, 1))
        try:
            self.serve(peer)
        finally:
            peer.close()

    def close(self):
        self.thread.join(5)
        self.server.close()


def test_the_flow_read_counts_every_part_of_its_own_reply_and_stops_at_the_last(tmp_path):
    asked = []

    def serve(peer):
        got = b""
        while b"request" not in got:  # the reader's hello, then its request
            got += peer.recv(1 << 16)
        asked.append(got)
        data = _reply(5, 3, True) + _reply(6, 9, False) + _reply(5, 4, True)  # another xid's reply between
        # Cut mid-message: the reader must join the pieces.
        peer.sendall(data[:70])
        peer.sendall(data[70:] + _reply(5, 2, False) + _reply(5, 7, False))  # the last part, then a stray one
        peer.recv(1)  # until the reader closes

    path = str(tmp_path / "br.mgmt")
    switch = FakeSwitch(path, serve)
    conn = switchlimit.MgmtConnection(path, timeout=5)
    try:
        assert conn.read_flows(b"request", 5) == 3 + 4 + 2
    finally:
        conn.close()
        switch.close()
    assert len(asked) == 1 and not switch.thread.is_alive()


def test_batches_spread_a_rate_evenly_and_add_up_to_it():
    for rate, seconds in ((500, 2), (2000, 30), (1234.5, 3), (50, 1), (5000, 0.5)):
        sizes = switchlimit.batches(rate, seconds)
        assert len(sizes) == round(seconds / switchlimit.TICK)
        assert sum(sizes) == int(rate * seconds)
        assert max(sizes) - min(sizes) <= 1


class BarrierAnswerer:
    """Answers barriers in order, counts flow-mods, and sends a flow-removed after the
    first barrier."""

    def __init__(self):
        self.flow_mods, self.barriers, self.miss_send_len, self.deletes = 0, [], None, 0

    def __call__(self, peer):
        buf = b""
        while True:
            data = peer.recv(1 << 16)
            if not data:
                break
            buf += data
            while len(buf) >= 8 and len(buf) >= struct.unpack_from("!H", buf, 2)[0]:
                length = struct.unpack_from("!H", buf, 2)[0]
                msg, buf = buf[:length], buf[length:]
                _, mtype, _, xid = switchlimit.HDR.unpack_from(msg)
                if mtype == switchlimit.T_SET_CONFIG:
                    self.miss_send_len = switchlimit.SET_CONFIG.unpack_from(msg, 8)[1]
                elif mtype == switchlimit.T_FLOW_MOD:
                    if msg[25] == 0:  # OFPFC_ADD
                        self.flow_mods += 1
                    else:
                        self.deletes += 1
                elif mtype == switchlimit.T_BARRIER_REQ:
                    out = switchlimit._msg(switchlimit.T_BARRIER_REP, xid)
                    if not self.barriers:
                        out += switchlimit._msg(switchlimit.T_FLOW_REMOVED, 0, bytes(40))
                    self.barriers.append(xid)
                    peer.sendall(out)


def test_the_sustained_measure_paces_every_pair_and_times_each_batch_to_its_barrier(tmp_path):
    switch = BarrierAnswerer()
    fake = FakeSwitch(str(tmp_path / "br.mgmt"), switch)
    try:
        r = switchlimit.sustained(CFG, "br", 1000, 0.2, rundir=str(tmp_path))
    finally:
        fake.close()
    assert r["pairs"] == 200 and switch.flow_mods == 400  # the pairs, two flow-mods each
    assert switch.miss_send_len > 0  # so the switch sends flow-removed here
    assert switch.barriers[:20] == list(range(1, 21)) and switch.deletes == 1  # then the clean-up
    assert r["flow_removed"] == 1 and r["errors"] == 0
    assert len(r["latencies_ms"]) == 200 and all(0 <= ms < 1000 for ms in r["latencies_ms"])
    assert 500 < r["pairs_per_s"] <= 1100  # paced over the 0.2 s, not written at once
