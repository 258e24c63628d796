"""A firewall pair's role requests on the switch connection (switch/role_link.py, deciding
with core/roles.py) through the app on the rig: the fake switch keeps the connection's role
and the newest generation, refuses a stale claim and a slave's flow-mods. Both firewalls
on a real switch, with keepalived: tests/test_ha.py."""
from __future__ import annotations

import json
import logging

import pytest

from nfshunt.core.connection import State
from nfshunt.openflow.inflight import EXPIRY, RoleAsk
from nfshunt.records import cookies
from tests.support import fakeswitch as fs
from tests.support.rig import FAST_A, SLOW_A, Rig, fast, shunted


def pair_rig(tmp_path, role: str = "master", generation: int | None = None, switch: fs.FakeSwitch | None = None,
             role_check_interval: float = 1.0, **cfg):
    """A controller of a pair whose state file says `role` (and the generation it took over with)."""
    state = tmp_path / "pair.json"
    if generation is not None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        state.write_text(json.dumps({"role": role, "generation": generation}))
    pair = {"state_file": str(state), "start_role": role, "role_check_interval": role_check_interval}
    return Rig(switch=switch, openflow_versions=["1.3"], pair=pair, delete_flows_on_shutdown=False, **cfg)


def state(tmp_path):
    return json.loads((tmp_path / "pair.json").read_text())


def test_a_master_asks_the_generation_claims_one_above_and_only_then_programs_the_switch(tmp_path):
    switch = fs.FakeSwitch()
    switch.generation = 6  # a takeover before this controller's time
    rig = pair_rig(tmp_path, switch=switch)
    # A claim takes the next even generation above it (core/roles.py: odd says the holder let go).
    assert rig.sw.roles.granted == "master" and (switch.role, switch.generation) == (fs.MASTER, 8)
    assert state(tmp_path) == {"role": "master", "generation": 8, "takeover": False}
    assert rig.flows(cookies.Kind.DEFAULT) and rig.core.reconciled
    assert rig.counters.flat()["role_promotions"] == 1
    assert fast(rig, shunted(rig))


def test_a_backup_programs_nothing_and_installs_nothing(tmp_path):
    rig = pair_rig(tmp_path, role="backup")
    assert switch_role(rig) == fs.SLAVE and rig.sw.roles.granted == "backup"
    assert rig.switch.entries == [] and rig.event() is None and rig.switch.entries == []


def switch_role(rig: Rig) -> int:
    return rig.switch.role


def test_a_master_that_notices_a_newer_master_stands_by_and_leaves_its_pairs_to_it(tmp_path):
    rig = pair_rig(tmp_path)
    conn = shunted(rig)
    rig.switch.other_master(rig.switch.generation + 2)  # the other's claim: the next even generation
    rig.advance(1)  # the role query of a master (role_check_interval)
    assert rig.sw.roles.granted == "backup" and rig.core.backup and not rig.core.by_key
    # keepalived still says master here: it yields to the newer claim, asking until that one lets go.
    assert rig.counters.flat()["role_demotions"] == 1 and state(tmp_path)["role"] == "master"
    assert rig.sw.roles.status()["yielded_to"] == rig.switch.generation
    assert fast(rig, conn) and rig.worker.restores == []  # the pair stays on the switch, the other's now


def test_a_masters_role_queries_are_role_check_interval_apart_counted_from_its_claim(tmp_path):
    # Its claim's reply told it the role: the next query is due role_check_interval after it,
    # not at the first tick (a restarted master asked at once and learnt of a newer claim
    # before any refusal could tell it: test_ha's split brain saw no IS_SLAVE refusal).
    rig = pair_rig(tmp_path, role_check_interval=60)
    rig.switch.other_master(rig.switch.generation + 2)
    rig.advance(2)
    assert rig.sw.roles.granted == "master"  # no query yet: it does not know
    rig.advance(60)
    assert rig.sw.roles.granted == "backup" and rig.counters.flat()["role_demotions"] == 1


def test_a_master_refused_as_slave_stands_by_at_once(tmp_path):
    rig = pair_rig(tmp_path, role_check_interval=60)
    rig.switch.other_master(rig.switch.generation + 2)
    rig.event()  # its install's flow-mods are refused IS_SLAVE: no role query needed to notice
    assert rig.sw.roles.granted == "backup" and rig.counters.flat()["role_demotions"] == 1
    assert not rig.core.by_key and rig.worker.deleted == []  # the connection stays on the firewall
    assert rig.switch.entries and not rig.flows(cookies.Kind.SHUNT)


def test_a_restarted_master_whose_generation_went_stale_steps_down_without_touching_the_switch(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="nfshunt")
    switch = fs.FakeSwitch()
    switch.generation = 10  # the other controller took over while this one was stopped (an even claim)
    rig = pair_rig(tmp_path, generation=3, switch=switch)
    assert rig.sw.roles.granted == "backup" and switch.generation == 10 and switch.role == fs.SLAVE
    assert rig.switch.entries == [] and rig.sw.roles.status()["yielded_to"] == 10  # (keepalived's master: it yields)
    assert "refused this controller's role request as stale" in caplog.text


def test_a_takeover_adopts_the_pairs_the_other_master_left(tmp_path):
    first = pair_rig(tmp_path / "a")
    conn = shunted(first)
    backup = pair_rig(tmp_path / "b", role="backup", switch=first.switch, now=first.now + 1)
    assert backup.sw.roles.granted == "backup" and not backup.core.by_key
    backup.app.role_change(backup.sw, backup.sw.roles.take_over())
    backup.run()
    assert backup.sw.roles.granted == "master" and backup.switch.generation == 4  # (the first claimed 2)
    adopted = backup.core.find(tuple_=conn.orig)
    assert adopted is not None and adopted.adopted and adopted.state is State.LIVE and fast(backup, adopted)


def test_a_switch_that_refuses_roles_leaves_the_controller_backup_programming_nothing(tmp_path, caplog):
    switch = fs.FakeSwitch()
    switch.refuse.add(fs.ROLE)
    rig = pair_rig(tmp_path, switch=switch)
    assert rig.sw.roles.granted is None and rig.switch.entries == []
    assert "may not support controller roles" in caplog.text


def test_an_unanswered_role_request_is_asked_again(tmp_path):
    switch = fs.FakeSwitch()
    # Silent: the default flows' counters, read each tick, unanswered too, no packet-in meter to
    # read and no role query for a minute (an answer to anything keeps what is in flight
    # waiting: test_replies' SILENT).
    switch.mute.update({fs.ROLE, fs.FLOWS})
    rig = pair_rig(tmp_path, switch=switch, packet_in_rate=0, role_check_interval=60)
    assert rig.s.inflight.count(RoleAsk) == 1 and rig.switch.entries == []
    switch.mute = {fs.FLOWS}
    rig.advance(EXPIRY + 0.5)  # given up, asked again: master (its reconcile read unanswered: muted)
    assert rig.sw.roles.granted == "master" and not rig.core.reconciled
    switch.mute.clear()
    rig.advance(EXPIRY + 0.5)
    assert rig.sw.roles.granted == "master" and rig.flows(cookies.Kind.DEFAULT)
    assert rig.packet(FAST_A, shunted(rig).orig._replace(sport=1)).outputs == (SLOW_A,)


@pytest.mark.parametrize("interval", [1.0, 3.0])
def test_a_master_asks_its_role_every_role_check_interval(tmp_path, interval):
    rig = pair_rig(tmp_path, role_check_interval=interval)
    asked = rig.switch.asked[fs.ROLE]
    for _ in range(6):
        rig.advance(1)
    assert rig.switch.asked[fs.ROLE] - asked == int(6 / interval)
