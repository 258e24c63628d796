"""The core, the flow builder, the send path and the dispatcher against the fake switch
table (tests/fakeswitch.py): shunts, blocks, TCP teardown in both layouts, idle timeouts,
reconcile and adoption, room on the switch, and every take-down. What the testbed showed
with packets, shown here with "what happens to this packet?"; no root, no sleeps."""
from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import pytest

os.environ.setdefault("OSKEN_HUB_TYPE", "native")
from nfshunt.core import commands as cm  # noqa: E402
from nfshunt.core.connection import (
    CT_TCP_CLOSE,
    CT_TCP_ESTABLISHED,
    CT_TCP_LAST_ACK,
    IDLE_RESTORE_TIMEOUT,
    REEVALUATE_TIMEOUT,
    SPLIT_CLOSE_TIMEOUT,
    Action,
    State,
)
from nfshunt.observe.accounting import Outcomes  # noqa: E402
from nfshunt.observe.metrics import Metrics  # noqa: E402
from nfshunt.openflow.channel import table_full  # noqa: E402
from nfshunt.openflow.flows import REMOVED_REASONS, FlowBuilder, metadata_teardown  # noqa: E402
from nfshunt.openflow.inflight import Barrier, CounterRead, FlowsRead  # noqa: E402
from nfshunt.openflow.session import Session  # noqa: E402
from nfshunt.records import cookies  # noqa: E402
from nfshunt.records.markcodec import DECISION_MASK  # noqa: E402
from nfshunt.records.model import OFP10, OFP13, UDP, EventKind, FlowTuple  # noqa: E402  # noqa: E402
from nfshunt.switch.dispatch import Dispatcher  # noqa: E402
from nfshunt.switch.switch import Switch  # noqa: E402
from tests import fakeswitch as fs  # noqa: E402
from tests.helpers import config, event  # noqa: E402

FIN, RST = 0x01, 0x04
FAST_A, SLOW_A, FAST_B, SLOW_B = 1, 2, 3, 4  # tests.helpers' two port groups


@dataclass
class Restore:
    """A re-creation the core asked of the kernel; `done` is the kernel's answer."""
    orig: FlowTuple
    tcp_state: int
    timeout: int
    closer_is_reply: bool
    mark: int
    done: Callable[[], None]


class FakeWorker:
    """The conntrack worker: requests recorded, re-creations answered when the test says."""

    def __init__(self) -> None:
        self.deleted: list[tuple[FlowTuple, int | None]] = []
        self.restores: list[Restore] = []
        self.unanswered: list[Restore] = []
        self.dumps = 0
        self.cleared: list[int] = []  # clear_marks masks
        self.expired: list[tuple[FlowTuple, int, int]] = []  # (tuple, id, timeout) given a shorter life

    def delete(self, _family: int, orig: FlowTuple, ct_id: int | None, _counted: bool = False) -> None:
        self.deleted.append((orig, ct_id))

    def restore(self, _family: int, orig: FlowTuple, _reply: FlowTuple, tcp_state: int, timeout: int,
                closer_is_reply: bool, mark: int, done: Callable[[], None]) -> None:
        r = Restore(orig, tcp_state, timeout, closer_is_reply, mark, done)
        self.restores.append(r)
        self.unanswered.append(r)

    def liberal(self, *_args: Any) -> None:
        pass

    def expire(self, _family: int, orig: FlowTuple, ct_id: int, timeout: int) -> None:
        self.expired.append((orig, ct_id, timeout))

    def dump(self) -> None:
        self.dumps += 1

    def clear_marks(self, mask: int, done: Callable[[int, int, str | None], None]) -> None:
        self.cleared.append(mask)
        done(0, 0, None)

    def batched(self) -> contextlib.nullcontext:
        return contextlib.nullcontext()


class Rig:
    """One switch's Core, FlowBuilder, SendPath and the Dispatcher, wired to a fake switch and
    a fake worker as NFShuntApp wires them (its handlers' few lines are re-stated in `reply`)."""

    def __init__(self, version: int = OFP13, pipeline: bool = False, switch: fs.FakeSwitch | None = None,
                 table_size: int | None = None, now: float = 100.0, **cfg: Any):
        self.now = now
        self.switch = switch or fs.FakeSwitch(version, table_size, now)
        self.switch.now = now
        self.worker = FakeWorker()
        self.sw = Switch(config(**cfg), 0)
        self.sw.session = Session(self.switch, self.sw.cfg, pipeline)
        metrics = Metrics(lambda: {})
        self.counters = metrics.counters
        self.dispatcher = Dispatcher(self.worker, Outcomes(metrics, logging.getLogger("nfshunt.fake-audit")),
                                     self._schedule, lambda _sw, cmds: self.run(cmds))
        # dispatch.py reads time.monotonic() here; the rig's clock is injected.
        self.dispatcher.handlers[cm.EntryDue] = lambda sw, cmd: sw.core.entry_due(cmd.conn, self.now)
        self.timers: list[tuple[float, int, tuple[cm.Command, ...]]] = []
        self.seq = itertools.count()
        self.work: collections.deque[cm.Command] = collections.deque()
        self.busy = False
        self.run(self.core.switch_connected(self.switch.ofproto.OFP_VERSION, self.s.fb.pipeline))

    @property
    def s(self) -> Session:
        assert self.sw.session is not None
        return self.sw.session

    @property
    def core(self):
        return self.sw.core

    def _schedule(self, delay: float, _sw: Switch, cmds: tuple[cm.Command, ...]) -> None:
        heapq.heappush(self.timers, (self.now + delay, next(self.seq), cmds))  # ties never compare commands

    def run(self, cmds: Any = ()) -> None:
        """Execute commands and their follow-ups, write to the switch, and hand what it says
        back to the core (and so on) until all is quiet; re-entrant calls just queue."""
        self.work.extend(cmds)
        if self.busy:
            return
        self.busy = True
        try:
            while True:
                while self.work:
                    self.work.extend(self.dispatcher.execute(self.sw, self.work.popleft()) or ())
                self.s.send.flush()
                if not self.switch.replies:
                    return
                self.work.extend(self.reply(self.switch.replies.pop(0)))
        finally:
            self.busy = False

    def reply(self, msg: Any) -> list[cm.Command]:
        core, send, fb = self.core, self.s.send, self.s.fb
        asked = self.s.inflight.answer(msg.xid, self.now) if hasattr(msg, "xid") else None
        if isinstance(msg, fs.BarrierReply):
            batch = asked.answered() if isinstance(asked, Barrier) else None
            out: list[cm.Command] = []
            for conn in batch.conns if batch else ():
                failure = batch.failed.get(id(conn))
                out += core.flows_confirmed(conn, self.now) if failure is None else \
                    core.flows_failed(conn, *failure, now=self.now)
            return out
        if isinstance(msg, fs.Error):
            send.error(msg.xid, f"switch error type={msg.type} code={msg.code}", table_full(msg))
            return []
        if isinstance(msg, fs.FlowRemoved):
            return core.flow_removed(msg.cookie, REMOVED_REASONS[msg.reason], msg.packet_count, msg.byte_count,
                                     msg.duration_sec + msg.duration_nsec / 1e9, self.now)
        if isinstance(msg, fs.TableSizeReply):
            core.table_size(msg.max_entries)
            return []
        if isinstance(msg, fs.PacketIn):
            cookie, parsed = msg.cookie, cookies.parse(msg.cookie)
            if parsed is not None and parsed.kind is cookies.Kind.PIPELINE:
                cookie = cookies.make_teardown(*metadata_teardown(msg.match["metadata"]), cookies.is_rst(cookie))
            return core.teardown_packet(cookie, msg.match["in_port"], self.now) or []
        assert isinstance(msg, fs.FlowStatsReply)
        if isinstance(asked, FlowsRead):  # a read for someone else (status, an IDS rule's counters)
            asked.done([fb.parse_stats(s) for s in msg.body])
            return []
        if isinstance(asked, CounterRead):
            packets = {r: sum(s.packet_count for s in msg.body if bool(s.cookie & cookies.DIRECTION_BIT) == r)
                       for r in (False, True)}
            return core.counters_read(asked.conn, packets, self.now)
        return core.reconcile([fb.parse_stats(s) for s in msg.body], self.now)

    def reconnect(self, switch: fs.FakeSwitch) -> None:
        """The switch's connection ends and one comes (the same switch, or another)."""
        self.run(self.core.switch_disconnected())
        self.sw.gone()
        self.switch = switch
        self.sw.session = Session(switch, self.sw.cfg, self.core.pipeline)
        self.run(self.core.switch_connected(switch.ofproto.OFP_VERSION, self.s.fb.pipeline))

    def advance(self, seconds: float) -> None:
        """Time passes: the switch's timeouts fire, due timers run, the core ticks."""
        self.now += seconds
        self.switch.expire(self.now)
        due = []
        while self.timers and self.timers[0][0] <= self.now:
            due.extend(heapq.heappop(self.timers)[2])
        self.run([*due, *self.core.tick(self.now)])

    def event(self, **kw: Any) -> Any:
        """A conntrack event (tests.helpers.event) reaches the core; its pair, if any."""
        ev = event(received=self.now, **kw)
        self.run(self.core.conntrack_event(ev))
        return self.core.find(tuple_=ev.orig)

    def packet(self, in_port: int, t: FlowTuple, tcp_flags: int = 0, vlan: int | None = None) -> fs.Fate:
        fate = self.switch.packet(in_port, t, tcp_flags, vlan)
        self.run()  # its packet-ins reach the core
        return fate

    def kernel_answers(self) -> list[Restore]:
        """The worker reports every re-creation done: the flows that waited for it go."""
        answered, self.worker.unanswered = self.worker.unanswered, []
        for r in answered:
            r.done()
        return answered

    def flows(self, kind: cookies.Kind) -> list[fs.Entry]:
        return [e for e in self.switch.entries if (cookies.parse(e.cookie) or (None,))[0] is kind]


def fast(rig: Rig, conn: Any) -> bool:
    """Both directions of the connection take the fast path, port to port."""
    return (rig.packet(conn.ingress.fast, conn.orig).outputs == (conn.egress.fast,)
            and rig.packet(conn.egress.fast, conn.reply).outputs == (conn.ingress.fast,))


def slow(rig: Rig, conn: Any) -> bool:
    """Both directions cross the firewall (the default flows to the bridge ports)."""
    return (rig.packet(conn.ingress.fast, conn.orig).outputs == (conn.ingress.slow,)
            and rig.packet(conn.egress.fast, conn.reply).outputs == (conn.egress.slow,))


LAYOUTS = [pytest.param(OFP13, False, id="single"), pytest.param(OFP13, True, id="pipeline"),
           pytest.param(OFP10, False, id="openflow1.0")]


def shunted(rig: Rig, **kw: Any) -> Any:
    """A shunt confirmed by the switch and past its drain: LIVE, its conntrack entry deleted."""
    conn = rig.event(**kw)
    rig.advance(rig.core.cfg.drain)
    assert conn.state is State.LIVE
    return conn


# --- shunt, block -------------------------------------------------------------------------------

@pytest.mark.parametrize("version, pipeline", LAYOUTS)
def test_a_shunt_forwards_both_directions_fast_to_fast_and_its_entry_goes_after_the_drain(version, pipeline):
    rig = Rig(version, pipeline)
    assert rig.core.reconciled
    orig = event().orig
    assert rig.switch.packet(FAST_A, orig).outputs == (SLOW_A,)  # before: everything crosses the firewall
    conn = rig.event()
    assert conn.state is State.DRAINING and fast(rig, conn)
    assert rig.worker.deleted == []  # the slow path drains first
    rig.advance(rig.core.cfg.drain)
    assert rig.worker.deleted == [(conn.orig, conn.ct_id)] and conn.state is State.LIVE
    # Only this connection, and only untagged: the same tuple under an 802.1Q tag is another network's.
    assert rig.packet(FAST_A, orig._replace(sport=40001)).outputs == (SLOW_A,)
    assert rig.packet(FAST_A, orig, vlan=7).outputs == (SLOW_A,)
    assert rig.counters.flat()["installed:shunt"] == 1


@pytest.mark.parametrize("version, pipeline", LAYOUTS)
def test_a_block_drops_both_directions(version, pipeline):
    rig = Rig(version, pipeline)
    conn = rig.event(action=2, proto=UDP)
    assert rig.packet(FAST_A, conn.orig).dropped and rig.packet(FAST_B, conn.reply).dropped
    assert rig.packet(FAST_A, conn.orig._replace(sport=1)).outputs == (SLOW_A,)


def test_a_pipeline_shunt_takes_two_entries_in_table_0_and_a_single_one_six():
    for pipeline, entries in ((True, 2), (False, 6)):
        rig = Rig(OFP13, pipeline)
        before = len(rig.switch.table(0))
        rig.event()
        assert len(rig.switch.table(0)) - before == entries == rig.core.entries
        assert len(rig.switch.table(1)) == (10 if pipeline else 0)


def test_confirm_counters_keeps_the_entry_until_the_switch_counts_packets_both_ways():
    rig = Rig(OFP13, confirm="counters", openflow_versions=["1.3"])
    conn = rig.event()
    for _ in range(5):
        rig.advance(0.05)  # read again and again: the pair has carried nothing yet
    assert conn.state is State.DRAINING and rig.worker.deleted == []
    assert fast(rig, conn)  # a packet each way, counted by the switch
    rig.advance(0.05)
    rig.advance(rig.core.cfg.drain)
    assert rig.worker.deleted == [(conn.orig, conn.ct_id)] and conn.state is State.LIVE


@pytest.mark.parametrize("pipeline", [False, True], ids=["single", "pipeline"])
def test_connections_whose_conntrack_ids_collide_are_shunted_and_closed_apart(pipeline):
    rig = Rig(OFP13, pipeline)
    a = shunted(rig, ct_id=5, sport=41000)
    b = shunted(rig, ct_id=5, sport=42000)
    assert (a.slot, b.slot) == (0, 1) and fast(rig, a) and fast(rig, b)
    rig.packet(FAST_A, b.orig, tcp_flags=RST)
    rig.advance(rig.core.cfg.rst_grace)
    assert [r.orig for r in rig.kernel_answers()] == [b.orig]
    assert slow(rig, b) and fast(rig, a)


# --- TCP teardown -------------------------------------------------------------------------------

@pytest.mark.parametrize("pipeline", [False, True], ids=["single", "pipeline"])
def test_fins_both_ways_reach_the_controller_and_hand_the_connection_back_closing(pipeline):
    rig = Rig(OFP13, pipeline)
    conn = shunted(rig)
    first = rig.packet(FAST_A, conn.orig, tcp_flags=FIN | 0x10)
    assert first.outputs == (FAST_B,) and len(first.packet_ins) == 1  # forwarded by the switch, headers to us
    assert conn.state is State.LIVE and rig.worker.restores == []  # half-closed: the other side may send
    assert rig.packet(FAST_A, conn.orig).outputs == (FAST_B,)
    rig.packet(FAST_B, conn.reply, tcp_flags=FIN)
    (restore,) = rig.worker.restores
    assert (restore.tcp_state, restore.closer_is_reply) == (CT_TCP_LAST_ACK, False)
    assert fast(rig, conn)  # the flows wait for the kernel's answer
    rig.kernel_answers()
    assert slow(rig, conn) and rig.flows(cookies.Kind.TEARDOWN) == [] and rig.flows(cookies.Kind.SHUNT) == []
    assert rig.counters.flat()["removed:shunt:tcp fin"] == 1 and not rig.core.by_key


@pytest.mark.parametrize("pipeline", [False, True], ids=["single", "pipeline"])
def test_an_update_without_a_state_for_the_closing_entry_a_close_left_shunts_nothing(pipeline):
    """The entry a FIN teardown re-created keeps the shunt decision (nothing is left to
    decide). Its later updates that do not carry the TCP state (the reply direction seen)
    once shunted the ended connection again, and that shunt outlived it until its idle
    timeout (seen on the testbed, reusing the tuples of connections just closed)."""
    rig = Rig(OFP13, pipeline)
    conn = shunted(rig)
    rig.packet(FAST_A, conn.orig, tcp_flags=FIN | 0x10)
    rig.packet(FAST_B, conn.reply, tcp_flags=FIN)
    rig.event(ct_id=99, state=CT_TCP_LAST_ACK, kind=EventKind.NEW)  # the re-created entry, as the kernel tells it
    rig.kernel_answers()
    assert not rig.core.by_key
    assert rig.event(ct_id=99, state=None) is None  # its next update, without protoinfo
    assert rig.flows(cookies.Kind.SHUNT) == [] and slow(rig, conn)
    assert rig.counters.flat()["ignored:tcp closing"] == 2
    # A new connection on the same ports (SYN on the closed entry: a new one) is shunted as ever.
    assert fast(rig, rig.event(ct_id=100, state=CT_TCP_ESTABLISHED, kind=EventKind.NEW))


@pytest.mark.parametrize("pipeline", [False, True], ids=["single", "pipeline"])
def test_an_rst_ends_the_shunt_after_the_grace(pipeline):
    rig = Rig(OFP13, pipeline)
    conn = shunted(rig)
    assert rig.packet(FAST_B, conn.reply, tcp_flags=RST).outputs == (FAST_A,)
    assert rig.worker.restores == []  # data in flight from the side that reset still goes fast
    rig.advance(rig.core.cfg.rst_grace)
    (restore,) = rig.worker.restores
    assert (restore.tcp_state, restore.closer_is_reply) == (CT_TCP_CLOSE, True)
    rig.kernel_answers()
    assert slow(rig, conn)


def test_a_fin_caught_before_the_barrier_reply_is_taken_once_the_switch_confirms():
    rig = Rig(OFP13)
    conn = rig.core.conntrack_event(event())[0].conn
    rig.dispatcher.execute(rig.sw, cm.InstallFlows(conn))
    rig.s.send.flush()  # flows in, barrier reply not yet read
    barrier = [r for r in rig.switch.replies if isinstance(r, fs.BarrierReply)]
    rig.switch.replies = [r for r in rig.switch.replies if r not in barrier]
    rig.switch.packet(FAST_A, conn.orig, tcp_flags=RST)
    rig.run()
    assert conn.state is State.PENDING and conn.early
    rig.switch.replies.extend(barrier)
    rig.run()
    rig.advance(rig.core.cfg.rst_grace)
    assert [r.tcp_state for r in rig.worker.restores] == [CT_TCP_CLOSE]


def test_a_closing_update_of_another_entry_or_of_a_block_changes_nothing():
    """Updates of a handled connection are not decisions: a straggler's entry in a closing
    state leaves the shunt, and a block stays until it idles out."""
    rig = Rig(OFP13)
    conn = rig.event()
    rig.event(state=CT_TCP_LAST_ACK, ct_id=conn.ct_id + 1)  # a straggler's entry, not the pair's
    assert conn.state is State.DRAINING and fast(rig, conn)
    block = rig.event(action=2, sport=40001)
    rig.event(action=2, sport=40001, state=CT_TCP_LAST_ACK)
    assert block.state is State.LIVE and rig.flows(cookies.Kind.BLOCK)


# --- idle timeout -------------------------------------------------------------------------------

@pytest.mark.parametrize("version, pipeline", LAYOUTS)
def test_an_idle_shunt_times_out_and_its_connection_comes_back_established(version, pipeline):
    rig = Rig(version, pipeline, default_shunt_timeout=10)
    conn = shunted(rig)
    rig.advance(6)
    assert fast(rig, conn)  # traffic keeps it
    rig.advance(6)
    assert fast(rig, conn) and rig.worker.restores == []
    rig.advance(10)  # idle both ways: both flows go (the partner is deleted if it lags)
    (restore,) = rig.worker.restores  # idled out: back to the firewall, judged again by its next packet
    assert (restore.tcp_state, restore.timeout) == (CT_TCP_ESTABLISHED, IDLE_RESTORE_TIMEOUT)
    assert restore.mark == conn.mark & ~DECISION_MASK
    rig.kernel_answers()
    assert slow(rig, conn) and not rig.core.by_key
    assert rig.counters.flat()["removed:shunt:idle timeout"] == 1


# --- reconcile and adoption ---------------------------------------------------------------------

@pytest.mark.parametrize("version, pipeline", LAYOUTS)
def test_a_restarted_controller_adopts_exact_pairs_and_deletes_foreign_flows_under_our_cookies(version, pipeline):
    first = Rig(version, pipeline)
    tcp = shunted(first, ct_id=11)
    udp = shunted(first, ct_id=12, proto=UDP, sport=5353)
    block = shunted(first, ct_id=13, action=2, sport=6000)
    # Half a pair, and flows under pairs' cookies of shapes NFShunt does not install: for
    # tagged frames, and on in_port alone (1.3 only: see the 1.0 test below).
    fb = first.s.fb
    half = fb.install(first.core.conntrack_event(event(ct_id=14, sport=7000))[0].conn)[0]
    odd = [half, _tagged(fb, cookies.make(cookies.Kind.SHUNT, 15), event(sport=7001).orig)]
    if version == OFP13:
        odd.append(_by_port(fb, cookies.make(cookies.Kind.SHUNT, 16)))
    first.switch.send(b"".join(_wire(m) for m in odd))
    foreign = len(first.switch.entries)
    lost = first.switch.entries.pop(0)  # a default the crash took with it

    again = Rig(version, pipeline, switch=first.switch, now=first.now + 1)  # a new controller, the same switch
    core = again.core
    assert core.reconciled and {c.ct_id for c in core.by_key.values()} == {11, 12, 13}
    assert all(c.adopted and c.state is State.LIVE for c in core.by_key.values())
    assert len(again.switch.entries) == foreign - len(odd)  # the odd ones went, the lost default is back
    assert [e.match for e in again.flows(cookies.Kind.DEFAULT)].count(lost.match) == 1
    assert fast(again, tcp) and fast(again, udp)
    assert again.packet(FAST_A, block.orig).dropped
    assert again.worker.dumps == 1  # then the conntrack table is read to pick up the rest
    # An adopted pair is ours to take down: its connection comes back alive.
    again.run(core.remove(core.find(tuple_=tcp.orig), "flush", again.now))
    assert [r.orig for r in again.worker.restores] == [tcp.orig]
    again.kernel_answers()
    assert slow(again, tcp)


def test_a_policy_changed_while_the_controller_was_stopped_hands_the_pairs_it_left_back():
    first = Rig(OFP13)
    conn = shunted(first)
    again = Rig(OFP13, switch=first.switch, now=first.now + 1)
    again.core.stale_policy = True  # as policy_state finds it at start (the next reconcile reads it)
    again.reconnect(again.switch)
    assert again.worker.cleared == [DECISION_MASK] and [r.orig for r in again.worker.restores] == [conn.orig]
    again.kernel_answers()
    assert slow(again, conn) and not again.core.by_key


def _wire(msg: Any) -> bytes:
    msg.set_xid(999)
    msg.serialize()
    return bytes(msg.buf)


def _tagged(fb: FlowBuilder, cookie: int, t: FlowTuple) -> Any:
    """A flow of a pair's tuple under a pair's cookie, for frames tagged with VLAN 7."""
    p = fb.parser
    if fb.version == OFP10:
        match = p.OFPMatch(in_port=FAST_A, dl_vlan=7, dl_type=0x0800, nw_proto=t.proto, nw_src=t.src, nw_dst=t.dst,
                           tp_src=t.sport, tp_dst=t.dport)
    else:
        match = p.OFPMatch(in_port=FAST_A, vlan_vid=0x1007, eth_type=0x0800, ip_proto=t.proto, ipv4_src=t.src,
                           ipv4_dst=t.dst, tcp_src=t.sport, tcp_dst=t.dport)
    return fb._add(match, FAST_B, cookie, 33000, 0, False)


def _by_port(fb: FlowBuilder, cookie: int) -> Any:
    """A flow under a pair's cookie that matches on in_port alone."""
    return fb._add(fb.parser.OFPMatch(in_port=FAST_A), FAST_B, cookie, 33000, 0, False)


def test_openflow10_reconcile_deletes_an_unreadable_flow_of_ours_and_nothing_else():
    first = Rig(OFP10)
    conn = shunted(first)
    first.switch.send(_wire(_by_port(first.s.fb, cookies.make(cookies.Kind.SHUNT, 16))))
    again = Rig(OFP10, switch=first.switch, now=first.now + 1)
    assert again.packet(FAST_A, conn.orig._replace(sport=1)).outputs == (SLOW_A,)  # the port's default
    assert fast(again, conn)


@pytest.mark.parametrize("wipe", [False, True], ids=["control-link-drop", "switch-restart"])
def test_a_reconnected_switch_has_its_defaults_shunts_and_blocks_back(wipe):
    rig = Rig(OFP13)
    conn = shunted(rig)
    block = shunted(rig, ct_id=8, sport=6000, action=2)
    pairs = [id(e) for e in rig.flows(cookies.Kind.SHUNT) + rig.flows(cookies.Kind.BLOCK)]
    rig.reconnect(fs.FakeSwitch(OFP13, now=rig.now) if wipe else rig.switch)
    if not wipe:  # found on the switch: nothing sent again
        assert [id(e) for e in rig.flows(cookies.Kind.SHUNT) + rig.flows(cookies.Kind.BLOCK)] == pairs
    assert fast(rig, conn) and rig.packet(FAST_A, block.orig).dropped
    assert rig.packet(FAST_A, conn.orig._replace(sport=1)).outputs == (SLOW_A,)  # the defaults
    assert conn.state is State.LIVE and block.state is State.LIVE
    assert rig.worker.deleted == [(conn.orig, conn.ct_id), (block.orig, block.ct_id)]  # once, before the drop


@pytest.mark.parametrize("pipeline", [False, True], ids=["single", "pipeline"])
def test_a_shunt_that_timed_out_while_the_switch_was_away_is_not_installed_again(pipeline):
    """The control link dropped for longer than the shunt's idle timeout: the switch
    removed the idle pair and its flow-removed went nowhere. The reconnect hands the
    connection back as the flow-removed would have; nothing of it crosses the switch."""
    rig = Rig(OFP13, pipeline, default_shunt_timeout=10)
    conn = shunted(rig)
    rig.now += 12  # the link is down meanwhile: the switch times the pair out ...
    rig.switch.expire(rig.now)
    rig.switch.replies.clear()  # ... and its flow-removed messages reach nobody
    rig.reconnect(rig.switch)
    assert rig.flows(cookies.Kind.SHUNT) == [] and rig.core.find(tuple_=conn.orig) is None
    (restore,) = rig.worker.restores
    assert (restore.orig, restore.tcp_state, restore.timeout) == (conn.orig, CT_TCP_ESTABLISHED, REEVALUATE_TIMEOUT)
    rig.kernel_answers()
    assert slow(rig, conn) and rig.flows(cookies.Kind.SHUNT) == []
    assert rig.counters.flat()["removed:shunt:timed out while the switch was away"] == 1


def test_a_connection_that_closes_on_the_firewall_while_its_shunt_goes_in_leaves_no_shunt():
    """Its FINs crossed the firewall before the switch carried it: the shunt goes, its entry
    (tracking the close) is neither deleted nor brought back to ESTABLISHED, and a new
    connection on the same ports meets the firewall."""
    rig = Rig(OFP13, drain=0.5)
    conn = rig.event()
    assert conn.state is State.DRAINING and fast(rig, conn)
    rig.event(state=CT_TCP_LAST_ACK)  # the same entry: both FINs seen on the slow path
    rig.advance(1)
    assert rig.flows(cookies.Kind.SHUNT) == [] and rig.core.find(tuple_=conn.orig) is None
    assert rig.worker.deleted == [] and rig.worker.restores == []
    assert rig.worker.expired == [(conn.orig, conn.ct_id, SPLIT_CLOSE_TIMEOUT)]  # part of the close took the switch
    assert slow(rig, conn)
    assert rig.counters.flat()["removed:shunt:tcp closed on the firewall"] == 1


def test_a_pair_adopted_from_a_peer_posing_as_the_switch_never_reaches_the_real_one():
    poser = fs.FakeSwitch(OFP13)
    forged = event(ct_id=0x1234).orig
    liar = Rig(OFP13, switch=poser)
    liar.run(liar.core.conntrack_event(event(ct_id=0x1234)))  # the poser's table holds a pair nobody decided here
    rig = Rig(OFP13, switch=poser)
    assert rig.core.find(tuple_=forged).adopted
    real = fs.FakeSwitch(OFP13, now=rig.now)
    rig.reconnect(real)
    assert rig.flows(cookies.Kind.SHUNT) == [] and rig.core.find(tuple_=forged) is None
    assert rig.counters.flat()["removed:shunt:not on the switch after a reconnect"] == 1


# --- room on the switch -------------------------------------------------------------------------

def test_with_the_budget_full_a_shunt_waits_on_the_slow_path_and_goes_in_when_room_is_freed():
    rig = Rig(OFP13, max_shunts=1)
    first = shunted(rig, ct_id=1)
    second = rig.event(ct_id=2, sport=40002)
    assert second is None and rig.counters.flat()["ignored:flow budget full"] == 1
    later = event(ct_id=2, sport=40002)
    assert rig.packet(FAST_A, later.orig).outputs == (SLOW_A,)
    rig.run(rig.core.remove(first, "unshunt by operator", rig.now))
    rig.kernel_answers()
    again = rig.core.find(tuple_=later.orig)
    assert again is not None and fast(rig, again) and slow(rig, first)


def test_a_block_with_the_budget_full_evicts_the_newest_shunt_which_comes_back_alive():
    rig = Rig(OFP13, max_shunts=2)
    older = shunted(rig, ct_id=1)
    rig.advance(1)
    newer = shunted(rig, ct_id=2, sport=40002)
    block = rig.event(ct_id=3, sport=40003, action=2)
    assert block is not None and rig.packet(FAST_A, block.orig).dropped
    assert [r.orig for r in rig.worker.restores] == [newer.orig]  # asked before its flows go
    assert fast(rig, newer)
    rig.kernel_answers()
    assert slow(rig, newer) and fast(rig, older)
    assert rig.counters.flat()["removed:shunt:evicted for a block"] == 1


def test_blocks_take_precedence_over_shunts_within_max_shunts():
    rig = Rig(OFP13, max_shunts=1)
    first = shunted(rig, ct_id=1)
    waiting = event(ct_id=2, sport=40002)
    rig.run(rig.core.conntrack_event(waiting))
    assert list(rig.core.waiting) == [waiting.orig] and rig.packet(FAST_A, waiting.orig).outputs == (SLOW_A,)
    block = rig.event(ct_id=3, sport=40003, action=2)
    rig.kernel_answers()
    assert rig.packet(FAST_A, block.orig).dropped and rig.packet(FAST_B, block.reply).dropped
    assert (rig.core.blocks, rig.core.shunts) == (1, 0) and list(rig.core.waiting) == [waiting.orig]
    assert slow(rig, first)  # evicted, back on the firewall


@pytest.mark.parametrize("pipeline, pair", [(True, 2), (False, 6)], ids=["pipeline", "single"])
def test_a_full_table_keeps_the_connection_on_the_slow_path_until_a_close_frees_room(pipeline, pair):
    rig = Rig(OFP13, pipeline, table_size=4 + pair)  # the defaults and one TCP shunt
    first = shunted(rig, ct_id=1, sport=41001)
    second = event(ct_id=2, sport=41002)
    rig.run(rig.core.conntrack_event(second))
    assert rig.counters.flat()["refused:shunt"] == 1 and list(rig.core.waiting) == [second.orig]
    assert rig.packet(FAST_A, second.orig).outputs == (SLOW_A,)
    assert (second.orig, second.ct_id) not in rig.worker.deleted  # its conntrack entry is kept
    assert len(rig.switch.table(0)) == 4 + pair  # nothing of it left on the switch
    rig.packet(FAST_A, first.orig, tcp_flags=FIN)
    rig.packet(FAST_B, first.reply, tcp_flags=FIN)
    rig.kernel_answers()
    assert fast(rig, rig.core.find(tuple_=second.orig)) and slow(rig, first)


def test_a_full_table_rolls_the_pair_back_and_the_connection_waits():
    # Room for the defaults (4), one UDP pair (2) and one flow more: the next pair's first
    # flow gets in, its second is refused.
    rig = Rig(OFP13, table_size=7, max_shunts=100)
    first = shunted(rig, ct_id=1, proto=UDP)
    second = event(ct_id=2, sport=40002, proto=UDP)
    rig.run(rig.core.conntrack_event(second))
    assert rig.core.find(tuple_=second.orig) is None and second.orig in rig.core.waiting
    assert rig.packet(FAST_A, second.orig).outputs == (SLOW_A,)
    assert rig.packet(FAST_B, second.reply).outputs == (SLOW_B,)
    assert len(rig.switch.table(0)) == 6 and rig.counters.flat()["refused:shunt"] == 1
    assert rig.worker.deleted == [(first.orig, first.ct_id)]  # the refused one's entry was kept
    rig.run(rig.core.remove(first, "flush", rig.now))  # room: the waiting one goes in
    assert fast(rig, rig.core.find(tuple_=second.orig))


def test_the_switch_reported_table_size_sets_the_budget():
    rig = Rig(OFP13, switch=fs.FakeSwitch(reported_size=4 + 6 * 3))
    assert rig.core.budget == 3


# --- every take-down ----------------------------------------------------------------------------

def _unshunt(rig: Rig, conn: Any) -> None:
    rig.run(rig.core.pin(conn.orig, Action.IGNORE, rig.now))


def _flush(rig: Rig, _conn: Any) -> None:
    rig.run(rig.core.flush("flush by operator", rig.now))


def _evict(rig: Rig, _conn: Any) -> None:
    rig.core.budget = 1
    rig.event(ct_id=99, sport=1, action=2)


def _shutdown(rig: Rig, _conn: Any) -> None:
    rig.run(rig.core.stopping(rig.now, take_down=True))


@pytest.mark.parametrize("take_down", [_unshunt, _flush, _evict, _shutdown], ids=lambda f: f.__name__[1:])
@pytest.mark.parametrize("pipeline", [False, True], ids=["single", "pipeline"])
def test_every_take_down_recreates_the_entry_before_the_flows_go_and_leaves_the_slow_path(take_down, pipeline):
    rig = Rig(OFP13, pipeline)
    conn = shunted(rig)
    take_down(rig, conn)
    (restore,) = rig.worker.restores
    assert restore.orig == conn.orig and restore.tcp_state == CT_TCP_ESTABLISHED
    assert fast(rig, conn)  # nothing left the switch before the kernel answered
    rig.kernel_answers()
    assert slow(rig, conn)
    assert rig.flows(cookies.Kind.SHUNT) == [] and rig.flows(cookies.Kind.TEARDOWN) == []
