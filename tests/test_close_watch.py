"""A caught close's watch, its pure parts: a packet-in's headers read as a TCP segment, and
what a segment says about the close it follows (nfshunt/core/close_watch.py)."""
from __future__ import annotations

import pytest

from nfshunt.core.close_watch import CloseWatch, Verdict, judge
from nfshunt.records.model import TCP, UDP, FlowTuple
from nfshunt.records.segment import ACK, FIN, RST, SYN, Segment, parse_segment
from tests.support.fakeswitch import frame

V4 = FlowTuple(4, TCP, "10.0.0.1", "10.0.0.2", 40000, 5201)
V6 = FlowTuple(6, TCP, "fd00::1", "fd00::2", 40000, 5201)


@pytest.mark.parametrize("t", [V4, V6], ids=["ipv4", "ipv6"])
def test_a_packet_ins_headers_give_the_segments_flags_and_data_length(t):
    assert parse_segment(frame(t, ACK, 1400)[:128]) == Segment(ACK, 1400)  # cut at 128 bytes, as the switch sends
    assert parse_segment(frame(t, FIN | ACK)) == Segment(FIN | ACK, 0)


def test_what_is_not_a_tcp_segment_behind_at_most_one_tag_reads_as_none():
    assert parse_segment(frame(V4._replace(proto=UDP), 0, 10)) is None
    assert parse_segment(frame(None)) is None
    assert parse_segment(frame(V4, ACK)[:40]) is None  # cut before the flags
    tagged = frame(V4, ACK)
    assert parse_segment(tagged[:12] + b"\x81\x00\x00\x07" + tagged[12:]) == Segment(ACK, 0)  # a trunk's frame
    for outer in (b"\x88\xa8\x01\x2c", b"\x81\x00\x01\x2c"):  # stacked tags (QinQ): never judged
        assert parse_segment(tagged[:12] + outer + b"\x81\x00\x00\x07" + tagged[12:]) is None
    assert parse_segment(tagged[:12] + b"\x81\x00\x00\x07" + tagged[12:33]) is None  # cut inside the IP header


def test_after_an_rst_only_the_side_that_reset_contradicts_it_and_only_with_no_rst():
    w = CloseWatch(frozenset({True}), False)
    assert judge(w, False, Segment(ACK, 1400)) is Verdict.NONE  # the other side's data in flight
    assert judge(w, True, Segment(RST, 0)) is Verdict.NONE  # the side that reset, answering it
    assert judge(w, True, Segment(ACK, 0)) is Verdict.CONTRADICTED  # it has no socket left to ACK from


def test_after_both_fins_data_contradicts_them_acks_and_resent_fins_do_not():
    w = CloseWatch(frozenset(), True)
    for reply in (False, True):
        assert judge(w, reply, Segment(ACK, 0)) is Verdict.NONE
        assert judge(w, reply, Segment(FIN | ACK, 100)) is Verdict.NONE  # a FIN resent with its data
    assert judge(w, True, Segment(ACK, 1)) is Verdict.CONTRADICTED


def test_a_syn_answered_by_a_syn_ack_is_a_new_connection_and_a_syn_alone_proves_nothing():
    w = CloseWatch(frozenset({False}), False)
    assert judge(w, True, Segment(SYN | ACK, 0)) is Verdict.NONE  # no SYN asked for it
    assert judge(w, False, Segment(SYN, 0)) is Verdict.NONE and w.syn
    assert judge(w, True, Segment(SYN | ACK, 0)) is Verdict.REOPENED
    forged = CloseWatch(frozenset(), True)
    judge(forged, False, Segment(SYN, 0))
    assert judge(forged, False, Segment(ACK, 1400)) is Verdict.CONTRADICTED  # the transfer went on
