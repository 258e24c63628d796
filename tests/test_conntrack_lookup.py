"""table.lookup without a kernel: one socket per thread, kept across lookups and
dropped after an error; an answer is taken only if it carries its request's sequence
number (a late answer to an earlier, timed-out request is never this one's)."""
import errno
import gc
import struct
import threading
from collections import deque

import pytest
from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple, nfct_msg

from nfshunt.kernel import table
from nfshunt.kernel.codec import (
    AF,
    CTA_ID,
    CTA_MARK,
    CTA_TUPLE_ORIG,
    CTA_TUPLE_REPLY,
    CTA_TUPLE_ZONE,
    NLA_F_NESTED,
    NLMSG_ERROR,
    NLMSG_HDR,
    nla,
    tuple_attr,
)
from nfshunt.records.model import TCP, FlowTuple

CLIENT = FlowTuple(4, TCP, "10.64.0.1", "10.65.0.1", 40000, 5201)
OTHER = FlowTuple(4, TCP, "10.64.0.2", "10.65.0.1", 40001, 5201)


def entry(t, ct_id, seq):
    """The kernel's answer to a GET: the entry (its original tuple `t`), with the request's seq."""
    m = nfct_msg.create_from(
        tuple_orig=NFCTAttrTuple(family=AF[t.family], saddr=t.src, daddr=t.dst, proto=t.proto, sport=t.sport,
                                 dport=t.dport),
        tuple_reply=NFCTAttrTuple(family=AF[t.family], saddr=t.dst, daddr=t.src, proto=t.proto, sport=t.dport,
                                  dport=t.sport),
        id=ct_id, mark=0x71210000)
    m["header"]["type"] = 1 << 8
    m["header"]["sequence_number"] = seq
    m["nfgen_family"] = AF[t.family]
    m.encode()
    return bytes(m.data)


def missing(seq):
    return NLMSG_HDR.pack(NLMSG_HDR.size + 4, NLMSG_ERROR, 0, seq, 0) + struct.pack("=i", -errno.ENOENT)


def asked(data):
    """(sequence number, tuple asked for) of a lookup request."""
    seq = NLMSG_HDR.unpack_from(data)[3]
    for t in (CLIENT, CLIENT.reversed(), OTHER, OTHER.reversed()):
        if data[NLMSG_HDR.size:] == struct.pack("=BBH", AF[t.family], 0, 0) + tuple_attr(CTA_TUPLE_ORIG, t):
            return seq, t
    raise AssertionError("not a lookup request")


class FakeNetlink:
    """A netlink socket whose kernel answers each request with `answer(seq, tuple)`:
    datagrams queued for recv (none queued: the wait times out)."""

    def __init__(self, answer):
        self.answer = answer
        self.inbox = deque()
        self.asked = []
        self.closed = False

    def send(self, data):
        seq, t = asked(data)
        self.asked.append((seq, t))
        self.inbox.extend(self.answer(seq, t))

    def recv(self, size):
        if not self.inbox:  # SO_RCVTIMEO passed
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        return self.inbox.popleft()

    def close(self):
        self.closed = True


class Opened(list):
    """Every socket lookup opened, in order; each answers as `answer` says at the time."""

    def __init__(self):
        super().__init__()
        self.answer = lambda seq, t: [entry(t, 7, seq)] if t == CLIENT else [missing(seq)]

    def open(self):
        sock = FakeNetlink(lambda seq, t: self.answer(seq, t))
        self.append(sock)
        return sock


@pytest.fixture
def sockets(monkeypatch):
    opened = Opened()
    monkeypatch.setattr(table, "_lookup_socket", opened.open)
    monkeypatch.setattr(table, "_LOOKUPS", threading.local())
    return opened


def test_one_socket_a_thread_kept_across_lookups_with_its_own_sequence_numbers(sockets):
    for _ in range(3):
        assert table.lookup(CLIENT).ct_id == 7
    assert len(sockets) == 1 and [seq for seq, _t in sockets[0].asked] == [1, 2, 3]
    found = []
    worker = threading.Thread(target=lambda: found.append(table.lookup(CLIENT).ct_id))
    worker.start()
    worker.join()
    assert found == [7] and len(sockets) == 2 and sockets[1].asked == [(1, CLIENT)]
    del worker
    gc.collect()
    assert sockets[1].closed and not sockets[0].closed  # the ended thread's socket is closed with it


def test_the_reply_direction_is_asked_when_the_original_has_no_entry(sockets):
    got = table.lookup(CLIENT.reversed())
    assert got.ct_id == 7 and got.orig == CLIENT
    assert sockets[0].asked == [(1, CLIENT.reversed()), (2, CLIENT)]
    assert table.lookup(OTHER) is None
    assert sockets[0].asked[2:] == [(3, OTHER), (4, OTHER.reversed())] and len(sockets) == 1


def test_a_late_answer_to_an_earlier_request_is_never_taken_for_this_ones(sockets):
    # Before this request's answer: an earlier request's (another entry), in a datagram of
    # its own and in the same datagram.
    sockets.answer = lambda seq, t: [entry(OTHER, 9, seq - 1), entry(OTHER, 9, seq + 7) + entry(t, 7, seq)]
    assert table.lookup(CLIENT).ct_id == 7
    sockets.answer = lambda seq, t: [entry(OTHER, 9, seq - 1) + missing(seq)] if t == CLIENT else [entry(t, 8, seq)]
    assert table.lookup(CLIENT).ct_id == 8


def test_a_timed_out_lookup_drops_its_socket_and_with_it_the_late_answer(sockets):
    sockets.answer = lambda seq, t: []  # the kernel does not answer in time
    with pytest.raises(TimeoutError):
        table.lookup(CLIENT)
    late = sockets[0]
    assert late.closed
    late.inbox.append(entry(OTHER, 9, 1))  # its answer comes after all: on the dropped socket
    sockets.answer = lambda seq, t: [entry(t, 7, seq)]
    assert table.lookup(CLIENT).ct_id == 7
    assert len(sockets) == 2 and sockets[1].asked == [(1, CLIENT)]


def test_only_late_answers_until_the_deadline_is_a_timeout(sockets, monkeypatch):
    monkeypatch.setattr(table, "LOOKUP_SECONDS", 0.0)
    sockets.answer = lambda seq, t: [entry(OTHER, 9, seq - 1)] * 3
    with pytest.raises(TimeoutError):
        table.lookup(CLIENT)
    assert sockets[0].closed and len(sockets[0].inbox) == 2  # one read, then the deadline


def test_a_bad_answer_drops_the_socket(sockets):
    sockets.answer = lambda seq, t: [NLMSG_HDR.pack(4, NLMSG_ERROR, 0, seq, 0)]  # shorter than its header
    with pytest.raises(OSError):
        table.lookup(CLIENT)
    sockets.answer = lambda seq, t: [entry(t, 7, seq)]
    assert table.lookup(CLIENT).ct_id == 7 and sockets[0].closed and len(sockets) == 2


def directional(t, seq):
    """The kernel's answer for an entry made by `-j CT --zone-orig 100`: its original tuple
    carries a zone of its own, which no pair of flows can stand for."""
    zone = nla(CTA_TUPLE_ZONE, struct.pack("!H", 100))
    body = struct.pack("=BBH", AF[t.family], 0, 0) \
        + nla(CTA_TUPLE_ORIG | NLA_F_NESTED, tuple_attr(CTA_TUPLE_ORIG, t)[4:] + zone) \
        + tuple_attr(CTA_TUPLE_REPLY, t.reversed()) \
        + nla(CTA_ID, struct.pack("!I", 5)) + nla(CTA_MARK, struct.pack("!I", 0x71210000))
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), 1 << 8, 0, seq, 0) + body


def test_an_answer_the_codec_refuses_is_a_failed_lookup_as_a_timeout_is(sockets):
    # Every caller (the conntrack worker, the IDS's threads, explain) handles a failed lookup
    # as an OSError; the codec's own error got through them and ended the worker's thread.
    sockets.answer = lambda seq, t: [directional(t, seq)]
    with pytest.raises(table.RefusedAnswer, match="directional conntrack zone") as refused:
        table.entry_of(CLIENT)
    assert isinstance(refused.value, OSError)
    with pytest.raises(OSError, match="directional conntrack zone"):
        table.lookup_counted(CLIENT)
    sockets.answer = lambda seq, t: [entry(t, 7, seq)]
    assert table.entry_of(CLIENT).ct_id == 7  # the next lookup is answered
