"""bench/run.py's cut of the shunt latency at the control connection (issue 41.4): the
OpenFlow messages each captured segment starts with, and the switch's round trip of a
shunt's flow-mods (synthetic pcaps: the bench runs on the testbed in test_bench)."""
from __future__ import annotations

import os
import struct
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(HERE, "bench"))
sys.path.insert(0, os.path.join(HERE, "mininet"))
import run as bench  # noqa: E402

CONTROLLER, SWITCH = 6653, 40000


def _frame(sport: int, dport: int, payload: bytes) -> bytes:
    tcp = struct.pack("!HHIIBBHHH", sport, dport, 1, 1, 5 << 4, 0x18, 65535, 0, 0)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp) + len(payload), 0, 0, 64, 6, 0,
                     bytes([169, 254, 66, 2]), bytes([169, 254, 66, 1]))
    return b"\0" * 12 + b"\x08\x00" + ip + tcp + payload


def _of(msg_type: int, length: int = 8) -> bytes:
    return struct.pack("!BBHI", 4, msg_type, length, 1) + b"\0" * (length - 8)


def _pcap(path: str, frames: list[tuple[float, bytes]], snaplen: int = bench.OF_SNAPLEN) -> None:
    with open(path, "wb") as fh:
        fh.write(struct.pack("<IHHiIII", 0xA1B23C4D, 2, 4, 0, 0, snaplen, 1))
        for t, data in frames:
            kept = data[:snaplen]
            fh.write(struct.pack("<IIII", int(t), round((t - int(t)) * 1e9), len(kept), len(data)) + kept)


def test_a_segment_names_the_messages_it_starts_with_and_its_direction(tmp_path):
    path = str(tmp_path / "control.pcap")
    batch = _of(bench.OFPT_FLOW_MOD, 120) * 2 + _of(20)  # two flow-mods and the barrier, one write
    _pcap(path, [(10.0, _frame(CONTROLLER, SWITCH, batch)), (10.0002, _frame(SWITCH, CONTROLLER, _of(21))),
                 (10.0003, _frame(SWITCH, CONTROLLER, b""))])  # (a bare acknowledgement: no data)
    segments = bench.read_openflow(path)
    assert [(out, types) for _, out, types in segments] == [(True, (14, 14)), (False, (21,))]
    # (the barrier's header lies past the snapshot's 256 bytes: the types stop where the bytes do)


def test_the_round_trip_is_the_first_flow_mods_out_and_the_barrier_reply_behind_them(tmp_path):
    path = str(tmp_path / "control.pcap")
    _pcap(path, [(9.9, _frame(SWITCH, CONTROLLER, _of(21))),  # an earlier batch's reply: before the event
                 (10.0, _frame(CONTROLLER, SWITCH, _of(2))),  # an echo request: no flow-mod
                 (10.001, _frame(CONTROLLER, SWITCH, _of(bench.OFPT_FLOW_MOD, 64) + _of(20))),
                 (10.0012, _frame(SWITCH, CONTROLLER, _of(3))),  # the echo's reply
                 (10.0015, _frame(SWITCH, CONTROLLER, _of(21)))])
    segments = bench.read_openflow(path)
    assert bench.switch_round_trip(segments, 9.95, 10.01) == (10.001, 10.0015)
    assert bench.switch_round_trip(segments, 9.95, 10.0012) is None  # its reply came after the span
    assert bench.switch_round_trip(segments, 10.002, 10.01) is None  # no flow-mod in the span
