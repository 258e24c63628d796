"""The switch-limit benchmark writes the controller's own flow-mods (but for the
flow-removed flag), so its rate is the switch's rate for what the controller sends."""
import os
import struct
import sys

from os_ken.ofproto import ofproto_protocol

from nfshunt.core import Conn
from nfshunt.flows import FlowBuilder
from nfshunt.probe import RATE_ID
from tests.helpers import config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import switchlimit  # noqa: E402

CFG = config()


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
        for msg in fb.install(Conn(t, t.reversed(), RATE_ID + i, "shunt", CFG.ports[0], CFG.ports[-1], 0.0)):
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
    conn = Conn(t, t.reversed(), RATE_ID + 7, "shunt", CFG.ports[0], CFG.ports[-1], 0.0)
    assert conn.cookie(True) & mask == cookie & mask
    other = Conn(t, t.reversed(), 0x12345678, "shunt", CFG.ports[0], CFG.ports[-1], 0.0)
    assert other.cookie(False) & mask != cookie & mask
