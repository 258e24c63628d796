"""Pure logic of the link emulation and the experiments: validation, the RTT rule, pcap
reading, statistics. No root needed."""
import math
import struct

import pytest
from experiments import describe, last_of_first_burst, ranksum, read_pcap

from nfshunt_testbed.linkemu import Emulation, EmulationError, check_rtt, nfqueue_rules


@pytest.mark.parametrize("kwargs, word", [
    ({"delay": "tc"}, "delay mechanism"),
    ({"rtt_ms": -1}, "rtt_ms"),
    ({"mtu": 100}, "mtu"),
    ({"link_mbit": 0}, "link_mbit"),
    ({"slow_mbit": -5}, "slow_mbit"),
    ({"slow_buffer_kb": 0}, "slow_buffer_kb"),
])
def test_bad_emulation_is_refused_with_the_field_named(kwargs, word):
    with pytest.raises(EmulationError, match=word):
        Emulation(**kwargs)


def test_thesis_emulation_uses_jumbo_frames_and_tuned_hosts():
    emu = Emulation.thesis(rtt_ms=200)
    assert (emu.mtu, emu.tune_hosts, emu.rtt_ms) == (9000, True, 200)
    assert emu.slow_mbit < emu.link_mbit  # the firewall, not the link, is the bottleneck


@pytest.mark.parametrize("requested, measured, ok", [
    (100, 101.0, True), (100, 104.9, True), (100, 105.1, False), (100, 94.0, False), (0, 1.9, True),
    (400, 419.0, True), (400, 421.0, False), (0, 0.3, True), (0, 2.5, False), (100, 50.6, False),
])
def test_rtt_more_than_five_percent_off_is_refused(requested, measured, ok):
    if ok:
        check_rtt(requested, measured)
    else:
        with pytest.raises(EmulationError, match="refusing to run"):
            check_rtt(requested, measured)


def test_nfqueue_rules_cover_both_families_and_are_removable():
    add, delete = nfqueue_rules("h1-eth0", True), nfqueue_rules("h1-eth0", False)
    assert [r[0] for r in add] == ["iptables", "ip6tables"]
    assert all("-A" in r and "PREROUTING" in r and "h1-eth0" in r for r in add)
    assert [r[r.index("-D") + 1:] for r in delete] == [r[r.index("-A") + 1:] for r in add]


def _pcap(tmp_path, packets, nano=True):
    path = tmp_path / "t.pcap"
    with open(path, "wb") as fh:
        fh.write(struct.pack("<IHHiIII", 0xA1B23C4D if nano else 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1))
        for t, sport, dport, flags in packets:
            eth = b"\x00" * 12 + b"\x08\x00"
            ip = bytes([0x45, 0]) + b"\x00\x28" + b"\x00" * 5 + bytes([6]) + b"\x00" * 10
            tcp = struct.pack("!HHIIBBHHH", sport, dport, 0, 0, 0x50, flags, 0, 0, 0)
            frame = eth + ip + tcp
            sec, frac = int(t), round((t - int(t)) * (1e9 if nano else 1e6))
            fh.write(struct.pack("<IIII", sec, frac, len(frame), len(frame)) + frame)
        # A non-IP frame is skipped.
        fh.write(struct.pack("<IIII", 9, 0, 14, 14) + b"\x00" * 12 + b"\x08\x06")
    return str(path)


@pytest.mark.parametrize("nano", [True, False])
def test_read_pcap_gives_times_ports_and_flags(tmp_path, nano):
    pkts = [(1.000001, 40000, 5201, 0x02), (1.5, 5201, 40000, 0x12), (2.25, 40000, 5201, 0x10)]
    got = read_pcap(_pcap(tmp_path, pkts, nano))
    assert [(sp, dp, fl) for _, sp, dp, fl in got] == [(40000, 5201, 2), (5201, 40000, 0x12), (40000, 5201, 0x10)]
    assert [round(t, 6) for t, *_ in got] == [1.000001, 1.5, 2.25]


def test_last_slow_packet_is_the_end_of_the_first_burst():
    assert last_of_first_burst([0.0, 0.001, 0.004, 2.0, 2.1]) == 0.004
    assert last_of_first_burst([0.0, 0.3, 0.6]) == 0.6


def test_describe_and_ranksum():
    d = describe([1.0, 2.0, 3.0, 4.0, float("nan")])
    assert (d["n"], d["mean"], d["median"], d["max"]) == (4, 2.5, 2.5, 4.0)
    assert math.isnan(describe([])["mean"])
    assert ranksum([1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13, 14, 15, 16, 17, 18]) < 0.01
    assert ranksum([1, 2, 3, 4], [1, 2, 3, 4]) > 0.5
    assert math.isnan(ranksum([1], [2]))
    assert ranksum([0.0] * 20, [0.0] * 20) == 1.0  # no loss in any run of either path


def test_the_paths_take_turns_in_rotating_blocks():
    from experiments import interleaved
    blocks = interleaved(20)
    assert [m for m, _, _ in blocks[:6]] == ["direct", "nfshunt", "firewall", "nfshunt", "firewall", "direct"]
    for mode in ("direct", "nfshunt", "firewall"):
        runs = [r for m, first, n in blocks if m == mode for r in range(first, first + n)]
        assert runs == list(range(20))
    assert interleaved(2) == [("direct", 0, 2), ("nfshunt", 0, 2), ("firewall", 0, 2)]
