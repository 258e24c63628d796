"""The router's tables are the truth (docs/design/routed.md slice 3, core/tables.py): what the
route follower's news does to routed pairs (rewritten in place, or handed back alive with the
reason), to flapping neighbours (held down) and to events waiting for a next hop (admitted)."""
import dataclasses

import pytest
from os_ken.ofproto import ofproto_protocol

from nfshunt.core import routing
from nfshunt.core.commands import (
    Ignored,
    InstallFlows,
    NeighbourHeldDown,
    RemoveFlows,
    RestoreConntrack,
    RewriteFlows,
)
from nfshunt.core.connection import State
from nfshunt.kernel import routes
from nfshunt.openflow.flows import FlowBuilder
from nfshunt.openflow.rewrite import rewrite
from nfshunt.records.model import OFP13
from tests.helpers import event
from tests.test_routed import FW1, GOOD, connected, experimental

H2 = "10.0.0.2"  # where the original direction goes (the reply's source)
NEW_MAC = "02:00:00:00:02:99"


def live_pair(core, now=100.0, **kw):
    ev = event(received=now, **kw)
    out = core.conntrack_event(ev)
    if not isinstance(out[0], InstallFlows):  # (asked first; known already for the next pair)
        out = core.next_hops_known(GOOD, ev, now)
    (install,) = out
    conn = install.conn
    core.flows_confirmed(conn, now)
    assert conn.state in (State.DRAINING, State.LIVE)
    return conn


def removals(out):
    """(reason, directions) of the flow removals a take-down makes (after the entry's re-creation)."""
    found = []
    for cmd in out:
        for inner in (cmd.then if isinstance(cmd, RestoreConntrack) else (cmd,)):
            if isinstance(inner, RemoveFlows):
                found.append((inner.reason, inner.directions))
    return found


def test_a_neighbour_s_new_mac_rewrites_its_pairs_in_place_and_nothing_else():
    core = connected(experimental())
    conn = live_pair(core)
    other = live_pair(core, ct_id=8, sport=40001)
    moved = dataclasses.replace(GOOD[H2], eth_dst=NEW_MAC)
    out = core.tables_changed({H2: moved}, 101.0)
    assert [type(x) for x in out] == [RewriteFlows, RewriteFlows]
    assert {id(x.conn) for x in out} == {id(conn), id(other)}
    assert conn.hops == (moved, GOOD["10.0.0.1"]) and conn.state is not State.TAKING_DOWN
    # The flow-mods: both flows and their catchers modified in place, match and cookie kept.
    fb = FlowBuilder(ofproto_protocol.ProtocolDesc(OFP13), experimental())
    fb.templated = False
    installed = fb.install(conn)
    msgs = rewrite(fb, conn)
    assert {m.command for m in msgs} == {fb.ofp.OFPFC_MODIFY_STRICT}
    assert sorted((m.cookie, m.priority, str(m.match)) for m in msgs) == \
        sorted((m.cookie, m.priority, str(m.match)) for m in installed)
    forward = [m for m in msgs if m.instructions[0].actions[-1].port == 3]
    assert len(forward) == 3 and all(
        [a.value for a in m.instructions[0].actions if type(a).__name__ == "OFPActionSetField"] == [FW1, NEW_MAC]
        for m in forward)
    # The same answer again (STALE/REACHABLE churn never reaches the core; a repeat changes nothing).
    assert core.tables_changed({H2: moved}, 102.0) == []


@pytest.mark.parametrize("answer,reason", [
    (routes.R_NEXT_HOP_FAILED, "routed: next hop failed"),
    (routes.R_NO_ROUTE, routes.R_NO_ROUTE),
    (routes.R_BLACKHOLE, routes.R_BLACKHOLE),
    (dataclasses.replace(GOOD[H2], ifname="fw-eth0"), routing.R_ROUTE_MOVED),
])
def test_a_next_hop_failed_or_a_route_moved_gone_or_blackholed_hands_the_pair_back_alive(answer, reason):
    core = connected(experimental())
    conn = live_pair(core)
    out = core.tables_changed({H2: answer}, 101.0)
    # The one take-down: the entry re-created first (alive on the firewall), then the flows go.
    assert isinstance(out[0], RestoreConntrack)
    assert removals(out) == [(reason, (False, True))]
    assert conn.state is State.TAKING_DOWN and conn.remove_reason == reason
    # And the firewall's tables now say no to a new connection between the same hosts.
    refused = core.conntrack_event(event(ct_id=9, sport=40002, received=101.5))
    assert [(type(x), x.reason) for x in refused] == [(Ignored, reason if reason != routing.R_ROUTE_MOVED
                                                         else routing.R_HOP_ELSEWHERE)]


def test_news_of_destinations_no_pair_uses_changes_no_pair():
    core = connected(experimental())
    conn = live_pair(core)
    assert core.tables_changed({"10.0.0.77": routes.R_NEXT_HOP_FAILED}, 101.0) == []
    assert conn.state is not State.TAKING_DOWN


def test_a_neighbour_flapping_is_held_down_once_its_pairs_handed_back_and_new_ones_refused():
    core = connected(experimental())
    conn = live_pair(core)
    macs = ["02:00:00:00:02:%02x" % i for i in range(10)]
    out, now = [], 101.0
    for i, mac in enumerate(macs[:routing.FLAP_CHANGES]):  # five changes in 10 s: rewritten each time
        out = core.tables_changed({H2: dataclasses.replace(GOOD[H2], eth_dst=mac)}, now + i * 0.1)
        assert [type(x) for x in out] == [RewriteFlows]
    out = core.tables_changed({H2: dataclasses.replace(GOOD[H2], eth_dst=macs[6])}, now + 0.6)
    assert [type(x) for x in out if isinstance(x, NeighbourHeldDown)] == [NeighbourHeldDown]
    assert removals(out) == [(routing.R_FLAPPING, (False, True))]
    # Still flapping: no second warning, nothing more to take down.
    out = core.tables_changed({H2: dataclasses.replace(GOOD[H2], eth_dst=macs[7])}, now + 0.7)
    assert not any(isinstance(x, NeighbourHeldDown) for x in out)
    # A new connection to it is refused while held down, and shunted once the hold-down is over.
    ev = event(ct_id=9, sport=40002, received=now + 1.0)
    assert [x.reason for x in core.conntrack_event(ev)] == [routing.R_FLAPPING]
    # (What it waits for comes back when the hold-down ends, with the tables' answer asked again.)
    core.next_hops_known({H2: dataclasses.replace(GOOD[H2], eth_dst=macs[7]), "10.0.0.1": GOOD["10.0.0.1"]},
                         ev, now + 1.0)
    assert ev.orig in core.shared.next_hops.waiting
    core.tick(now + 20.0)  # (the hold-down not over yet: it waits on)
    assert ev.orig in core.shared.next_hops.waiting
    after = core.tick(now + 0.6 + routing.HOLD_DOWN + 0.1)
    assert [type(x).__name__ for x in after if type(x).__name__ in ("InstallFlows", "ResolveHops")]
    assert conn.state is State.TAKING_DOWN


def test_changes_more_than_ten_seconds_apart_are_not_a_flap():
    core = connected(experimental())
    live_pair(core)
    for i in range(12):
        out = core.tables_changed({H2: dataclasses.replace(GOOD[H2], eth_dst="02:00:00:00:02:%02x" % i)},
                                  101.0 + i * 2.5)
        assert [type(x) for x in out] == [RewriteFlows], i


@pytest.mark.parametrize("answer", [routes.R_UNRESOLVED, routes.R_NEXT_HOP_FAILED, routes.R_NO_ROUTE])
def test_a_connection_waiting_for_its_next_hop_is_shunted_when_the_tables_give_it(answer):
    """A UDP stream's entry sends no event after its decision: the tables' news admits it."""
    core = connected(experimental())
    ev = event(proto=17, state=None)
    core.conntrack_event(ev)
    out = core.next_hops_known({**GOOD, H2: answer}, ev, 100.0)
    assert [x.reason for x in out] == [answer]
    assert not core.by_key and list(core.shared.next_hops.waiting) == [ev.orig]
    (install,) = core.tables_changed({H2: GOOD[H2]}, 100.4)
    assert isinstance(install, InstallFlows) and install.conn.hops == (GOOD[H2], GOOD["10.0.0.1"])
    assert not core.shared.next_hops.waiting


def test_a_waiting_connection_that_ended_is_not_shunted_later():
    core = connected(experimental())
    ev = event(proto=17, state=None)
    core.conntrack_event(ev)
    core.next_hops_known({**GOOD, H2: routes.R_UNRESOLVED}, ev, 100.0)
    core.conntrack_event(dataclasses.replace(ev, kind=type(ev.kind).DESTROY))
    assert core.tables_changed({H2: GOOD[H2]}, 100.4) == []
    # Nor one that waited longer than WAIT_MAX.
    ev2 = event(proto=17, state=None, ct_id=11, sport=40011)
    core.conntrack_event(ev2)
    core.next_hops_known({**GOOD, H2: routes.R_UNRESOLVED}, ev2, 101.0)
    assert core.tables_changed({H2: GOOD[H2]}, 101.0 + routing.WAIT_MAX + 1) == []


def test_a_mac_change_of_the_other_direction_rewrites_only_what_changed():
    core = connected(experimental())
    conn = live_pair(core)
    h1_new = dataclasses.replace(GOOD["10.0.0.1"], eth_dst=NEW_MAC)
    (cmd,) = core.tables_changed({"10.0.0.1": h1_new}, 101.0)
    assert isinstance(cmd, RewriteFlows) and conn.hops == (GOOD[H2], h1_new)


def test_the_pairs_of_a_destination_are_found_by_index_and_the_ones_gone_dropped():
    """A flapping neighbour feeds ten times a second: its pairs are looked up, not walked for."""
    core = connected(experimental())
    conn = live_pair(core)
    table = core.shared.next_hops
    assert set(table.users) == {H2, "10.0.0.1"} and table.users[H2] == {conn.key: conn}
    core.conns.forget(conn)  # (gone: its flows removed and the removal confirmed)
    assert core.tables_changed({H2: dataclasses.replace(GOOD[H2], eth_dst=NEW_MAC)}, 101.0) == []
    assert H2 not in table.users and "10.0.0.1" in table.users  # dropped where met
    core.tick(102.0)
    assert not table.users  # and by the sweep


def test_a_pair_judged_again_while_its_next_hop_is_failed_waits_and_is_shunted_once_resolved():
    """The take-down's re-evaluation comes back decided while the tables still say "failed"
    (its packet is what makes the firewall resolve the neighbour): it waits for the news."""
    core = connected(experimental())
    conn = live_pair(core)
    core.tables_changed({H2: routes.R_NEXT_HOP_FAILED}, 101.0)
    core.conns.forget(conn)  # (its flows gone)
    ev = event(ct_id=12, received=101.1)
    assert [x.reason for x in core.conntrack_event(ev)] == [routes.R_NEXT_HOP_FAILED]
    (install,) = core.tables_changed({H2: GOOD[H2]}, 101.2)
    assert isinstance(install, InstallFlows) and install.conn.ct_id == 12


def test_the_follower_tells_only_changed_answers_and_a_lost_neighbour_as_failed():
    """kernel/routes.Followed, its lookups faked: what the event loop hears of the tables."""
    from nfshunt.records.model import NextHop
    table = {H2: (GOOD[H2], (3, H2))}
    followed = routes.Followed(lambda address: table[address])
    assert followed.ask(H2) == GOOD[H2]
    assert followed.neighbour((3, H2), GOOD[H2].eth_dst) == {}  # STALE/REACHABLE churn: one MAC
    assert followed.neighbour((3, H2), NEW_MAC) == {H2: dataclasses.replace(GOOD[H2], eth_dst=NEW_MAC)}
    assert followed.neighbour((4, H2), "02:00:00:00:00:77") == {}  # another entry: no pair of ours uses it
    table[H2] = (routes.R_UNRESOLVED, (3, H2))
    assert followed.routes() == {H2: routes.R_NEXT_HOP_FAILED}  # a route event found it gone
    assert followed.neighbour((3, H2), None) == {}  # (already said)
    table[H2] = (NextHop("fw-eth1", FW1, "02:00:00:00:02:01", H2), (3, H2))
    assert followed.neighbour((3, H2), "02:00:00:00:02:01") == {H2: table[H2][0]}  # resolved again
    table[H2] = (routes.R_BLACKHOLE, None)
    assert followed.routes() == {H2: routes.R_BLACKHOLE}
    assert followed.routes() == {}


def test_the_dispatcher_asks_the_follower_and_runs_its_answer_on_the_loop(monkeypatch):
    """The event loop never calls netlink for a next hop: the follower's thread answers, and
    the answer comes back as a HopsKnown the loop runs; its news as TablesChanged."""
    from types import SimpleNamespace

    from nfshunt.core.commands import HopsKnown, ResolveHops, TablesChanged
    from nfshunt.switch import dispatch, tables_link

    asked, started = [], []

    class Follower:
        def __init__(self, on_news, on_error):
            self.on_news = on_news

        def start(self):
            started.append(True)

        def ask(self, addresses, reply, solicit=False):
            asked.append((addresses, reply))

    monkeypatch.setattr(tables_link, "TableFollower", Follower)
    posted = []
    news = []
    d = dispatch.Dispatcher(SimpleNamespace(), SimpleNamespace(counters=None, handlers={}), lambda *a: None,
                            lambda sw, cmds: posted.append(cmds), on_tables=news.append)
    core = connected(experimental())
    sw = SimpleNamespace(core=core)
    ev = event()
    (ask, _ignored) = core.conntrack_event(ev)
    assert isinstance(ask, ResolveHops)
    assert d.execute(sw, ask) is None and started == [True] and asked[0][0] == ("10.0.0.2", "10.0.0.1")
    asked[0][1](GOOD)  # (the follower's thread answers)
    ((answer,),) = posted
    assert isinstance(answer, HopsKnown)
    (install,) = d.execute(sw, answer)
    assert isinstance(install, InstallFlows)
    d.tables.follower.on_news({H2: routes.R_NO_ROUTE})
    assert news == [{H2: routes.R_NO_ROUTE}]
    down = d.execute(sw, TablesChanged({H2: routes.R_NO_ROUTE}))
    assert down == [] and install.conn.remove_reason == routes.R_NO_ROUTE  # (pending: goes once confirmed)
