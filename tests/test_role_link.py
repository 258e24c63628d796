"""A firewall pair's role requests on the switch connection (switch/role_link.py, deciding
with core/roles.py) through the app on the rig: the fake switch keeps the connection's role
and the newest generation, refuses a stale claim and a slave's flow-mods. Both firewalls
on a real switch, with keepalived: tests/test_ha.py."""
from __future__ import annotations

import json
import logging

import pytest

from nfshunt.core import roles
from nfshunt.core.connection import State
from nfshunt.core.roles import RoleRequest, Roles
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


# --- a master that loses the switch while its connection is down (review s57/2 V1, V2) ---------


def _other_took_over(switch: fs.FakeSwitch, generation: int) -> None:
    """The pair's other controller claimed the switch, re-pointed the defaults at its own
    slow ports (ours deleted) and later took our old pair down (its connection ended)."""
    switch.other_master(generation)
    switch.entries = [e for e in switch.entries
                      if (cookies.parse(e.cookie) or (None,))[0] not in (cookies.Kind.DEFAULT, cookies.Kind.SHUNT)]


def _lost_while_away(tmp_path, how: str):
    """A master with a LIVE pair whose connection drops; the other controller takes over
    meanwhile; then `how`: keepalived says BACKUP here while it is away ("backup"), or it
    comes back still keepalived's master and its claim is refused as stale ("stale")."""
    rig = pair_rig(tmp_path)
    conn = shunted(rig)
    switch = rig.switch
    rig.disconnect()
    _other_took_over(switch, switch.generation + 2)
    if how == "backup":
        assert rig.control({"cmd": "role", "role": "backup"})["ok"]
    rig.reconnect(switch)
    return rig, conn, switch


@pytest.mark.parametrize("how", ["backup", "stale"])
def test_a_master_that_lost_the_switch_while_away_forgets_the_pairs_the_other_owns_now(tmp_path, how):
    """Roles.disconnected() cleared `granted`, so neither the step-down nor the stale refusal
    reported a demotion: the core kept the other's pairs LIVE as its own."""
    rig, conn, switch = _lost_while_away(tmp_path, how)
    assert rig.sw.roles.granted != "master" and switch.role == fs.SLAVE
    assert rig.core.backup and rig.core.find(tuple_=conn.orig) is None
    assert rig.counters.flat()["role_demotions"] == 1  # once, not again at the reconnect
    if how == "stale":
        assert rig.sw.roles.status()["yielded_to"] == switch.generation


@pytest.mark.parametrize("how", ["backup", "stale"])
def test_taking_the_switch_back_does_not_install_a_pair_the_other_took_down(tmp_path, how):
    """The reconcile saw this config's defaults gone (the other's replaced them: a switch that
    lost its table) and installed the pair the core had kept: a shunt nobody decided."""
    rig, conn, switch = _lost_while_away(tmp_path, how)
    rig.advance(30)
    switch.generation += 1  # later the other controller lets the switch go (keepalived: BACKUP there)
    if how == "backup":  # and keepalived makes this host master again
        assert rig.control({"cmd": "role", "role": "master"})["ok"]
    rig.advance(1)
    assert rig.sw.roles.granted == "master" and rig.core.reconciled and not rig.core.backup
    assert not rig.flows(cookies.Kind.SHUNT) and rig.core.find(tuple_=conn.orig) is None
    assert not fast(rig, conn)


def test_a_takeover_asked_again_while_away_forgets_the_pairs_before_its_newer_claim_wins(tmp_path):
    """keepalived says MASTER again while the connection is down (a reload re-sends the
    states): the new claim is above the other's and wins, but the switch's generation said
    another controller had claimed it meanwhile: the pairs were demoted first, not installed
    again."""
    rig = pair_rig(tmp_path)
    conn = shunted(rig)
    switch = rig.switch
    rig.disconnect()
    _other_took_over(switch, switch.generation + 2)
    assert rig.control({"cmd": "role", "role": "master"})["ok"]
    rig.reconnect(switch)
    assert rig.sw.roles.granted == "master" and switch.generation == 6 and rig.core.reconciled
    assert rig.counters.flat()["role_demotions"] == 1 and rig.counters.flat()["role_promotions"] == 2
    assert not rig.flows(cookies.Kind.SHUNT) and rig.core.find(tuple_=conn.orig) is None


def test_a_master_whose_switch_is_still_its_own_after_a_reconnect_keeps_its_pairs(tmp_path):
    rig = pair_rig(tmp_path)
    conn = shunted(rig)
    rig.reconnect(rig.switch)
    assert rig.sw.roles.granted == "master" and "role_demotions" not in rig.counters.flat()
    found = rig.core.find(tuple_=conn.orig)
    assert found is not None and found.state is State.LIVE and fast(rig, found)


def _yielded_other(generation: int) -> Roles:
    """The pair's other controller: keepalived's master too, yielded to `generation` (a split
    brain that healed, or both MASTER at boot)."""
    other = Roles(None, "master")
    other.reply(roles.EQUAL, roles.UNDEFINED_GENERATION)
    other.stale()
    assert other.reply(roles.SLAVE, generation).request is None and other.yielded == generation
    return other


def test_a_master_told_backup_while_its_connection_is_down_releases_the_switch_when_it_is_back(tmp_path):
    """It sent a plain SLAVE at its claim's even generation, so the other controller,
    keepalived's master, yielded to that claim for ever and nobody programmed the switch."""
    rig = pair_rig(tmp_path)
    switch, held = rig.switch, rig.switch.generation
    other = _yielded_other(held)
    rig.disconnect()
    assert rig.control({"cmd": "role", "role": "backup"})["ok"]
    rig.reconnect(switch)
    assert rig.sw.roles.granted == "backup" and switch.role == fs.SLAVE
    assert switch.generation == held + 1  # released
    assert other.reply(roles.SLAVE, switch.generation).request == RoleRequest(roles.MASTER, held + 2)


def test_a_master_told_backup_while_its_controller_is_stopped_releases_the_switch_when_it_starts(tmp_path):
    rig = pair_rig(tmp_path)
    switch, held = rig.switch, rig.switch.generation
    other = _yielded_other(held)
    rig.disconnect()
    Roles(str(tmp_path / "pair.json"), "master").stand_by()  # `nfshunt role backup` with no controller
    assert state(tmp_path) == {"role": "backup", "generation": held, "takeover": False}
    again = pair_rig(tmp_path, role="master", switch=switch, now=rig.now + 1)  # starts from the state file
    assert again.sw.roles.wanted == "backup" and again.sw.roles.granted == "backup"
    assert switch.generation == held + 1 and again.switch.entries == switch.entries
    assert other.reply(roles.SLAVE, switch.generation).request == RoleRequest(roles.MASTER, held + 2)


def test_a_backup_whose_claim_no_longer_holds_the_switch_releases_nothing(tmp_path):
    """Told backup while away, after the other claimed the switch: the generation is the
    other's, and a release would say nobody holds it."""
    rig, _, switch = _lost_while_away(tmp_path, "backup")
    assert switch.generation == 4 and switch.role == fs.SLAVE


# --- the state file cannot be written (review s57/2 V6) ------------------------------------------


def test_a_claim_the_state_file_cannot_hold_is_not_made_and_is_made_once_it_can(tmp_path):
    """A claim whose generation was kept in memory only was lost by a restart, which then
    claimed the file's older generation, was refused as stale and yielded to its own lost
    claim for ever. The claim waits for the write: said in the role command's answer and
    status, logged, counted, tried again at each role check."""
    blocker = tmp_path / "lib"
    blocker.write_text("")  # the state file's directory cannot be made: a file is in the way
    rig = pair_rig(blocker, role="backup")
    assert rig.sw.roles.granted == "backup" and rig.switch.generation == 0
    answer = rig.control({"cmd": "role", "role": "master"})
    assert answer["ok"] and "cannot be written" in answer["state_file_error"]
    assert "fix its path or permissions" in answer["state_file_error"]
    rig.advance(3)
    assert rig.switch.generation == 0 and rig.switch.role == fs.SLAVE and rig.sw.roles.granted == "backup"
    assert rig.counters.flat()["role_claims_withheld"] >= 3  # (every role check)
    assert "not claiming the switch" in rig.sw.roles.status()["why_backup"]
    blocker.unlink()  # the admin fixes it
    rig.advance(1)
    assert rig.sw.roles.granted == "master" and rig.switch.generation == 2
    assert state(blocker) == {"role": "master", "generation": 2, "takeover": False}
    assert rig.sw.roles.status()["state_file_error"] is None


# --- a controller that is not master writes no blocks (review s57/2 V5) ---------------------------


def test_a_backup_writes_no_static_block_to_the_switch(tmp_path):
    """With SLAVE granted, the switch refused the drops (IS_SLAVE): counted as errors on every
    backup, at each block and each renewal."""
    from nfshunt.records.model import UDP, FlowTuple
    from tests.test_static import STREAM
    rig = pair_rig(tmp_path, role="backup", static_shunts=[STREAM])
    assert rig.sw.roles.granted == "backup"
    t = FlowTuple(4, UDP, "10.0.0.1", "10.0.0.2", 40000, 34964)
    assert rig.control({"cmd": "block", "tuple": str(t)})["ok"] and rig.core.static.blocks
    assert not any(k.startswith("openflow_error") for k in rig.counters.flat())


def test_a_controller_the_switch_grants_no_role_writes_no_static_block(tmp_path):
    """The switch refuses roles: the connection is EQUAL, which may program; the controller
    said it "stays backup and programs nothing", and then wrote the drops."""
    from nfshunt.records.model import UDP, FlowTuple
    from tests.test_static import STREAM
    switch = fs.FakeSwitch()
    switch.refuse.add(fs.ROLE)
    rig = pair_rig(tmp_path, switch=switch, static_shunts=[STREAM])
    t = FlowTuple(4, UDP, "10.0.0.1", "10.0.0.2", 40000, 34964)
    assert rig.control({"cmd": "block", "tuple": str(t)})["ok"]
    assert rig.switch.entries == []
