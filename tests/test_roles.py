"""A pair's controller roles (nfshunt/roles.py): pure logic, with the state file."""
from __future__ import annotations

import json

from nfshunt.roles import EQUAL, MASTER, NOCHANGE, SLAVE, UNDEFINED_GENERATION, RoleRequest, Roles, newer


def test_generations_compare_as_the_switch_does_across_the_wrap():
    assert newer(2, 1) and not newer(1, 2) and not newer(5, 5)
    assert newer(0, UNDEFINED_GENERATION - 1)  # wrapped: 0 comes after 2**64-2


def test_a_backup_learns_the_switch_generation_and_asks_for_slave_with_it(tmp_path):
    roles = Roles(str(tmp_path / "pair.json"))
    assert roles.connected() == RoleRequest(NOCHANGE, 0)
    change = roles.reply(EQUAL, 7)
    assert change.request == RoleRequest(SLAVE, 7) and not change.promoted
    change = roles.reply(SLAVE, 7)
    assert roles.granted == "backup" and change.demoted is None and change.request is None


def test_a_takeover_claims_a_newer_generation_saved_before_the_claim(tmp_path):
    path = tmp_path / "pair.json"
    roles = Roles(str(path))
    roles.reply(EQUAL, 7)
    change = roles.take_over()
    assert change.request == RoleRequest(MASTER, 8)
    assert json.loads(path.read_text()) == {"role": "master", "generation": 8}
    assert roles.reply(MASTER, 8).promoted
    assert not roles.reply(MASTER, 8).promoted  # a periodic check: still master, nothing to do
    assert roles.check() == RoleRequest(NOCHANGE, 0)


def test_a_restarted_master_claims_its_old_generation_and_a_stale_refusal_makes_it_backup(tmp_path):
    path = tmp_path / "pair.json"
    path.write_text(json.dumps({"role": "master", "generation": 4}))
    roles = Roles(str(path))
    roles.connected()
    assert roles.reply(EQUAL, 5).request == RoleRequest(MASTER, 4)  # not a new takeover
    change = roles.stale()
    assert roles.wanted == "backup" and "stale" in (roles.why or "")
    assert change.request == RoleRequest(NOCHANGE, 0)
    assert roles.reply(EQUAL, 5).request == RoleRequest(SLAVE, 5)
    assert json.loads(path.read_text())["role"] == "backup"  # a restart does not try again


def test_a_master_made_slave_by_another_claim_is_demoted_once(tmp_path):
    roles = Roles(str(tmp_path / "pair.json"))
    roles.connected()
    roles.reply(EQUAL, UNDEFINED_GENERATION)
    roles.take_over()
    assert roles.reply(MASTER, 1).promoted
    change = roles.reply(SLAVE, 2)  # the periodic query: the other controller took over
    assert change.demoted and "generation 2" in change.demoted and roles.wanted == "backup"
    assert roles.refused_as_slave().demoted is None  # already handled


def test_is_slave_error_demotes_a_master(tmp_path):
    roles = Roles(str(tmp_path / "pair.json"))
    roles.connected()
    roles.reply(EQUAL, 3)
    roles.take_over()
    roles.reply(MASTER, 4)
    assert roles.refused_as_slave().demoted
    assert roles.granted == "backup"


def test_stepping_down_stops_programming_before_the_switch_answers(tmp_path):
    roles = Roles(str(tmp_path / "pair.json"))
    roles.connected()
    roles.reply(EQUAL, 3)
    roles.take_over()
    roles.reply(MASTER, 4)
    change = roles.stand_by()
    assert change.demoted == "asked to be backup" and change.request == RoleRequest(SLAVE, 4)
    assert roles.reply(SLAVE, 4).demoted is None  # the switch's answer does not demote twice


def test_an_unreadable_state_file_starts_as_backup(tmp_path, caplog):
    path = tmp_path / "pair.json"
    for text in ("{", '{"role": "boss", "generation": 1}', '{"role": "master", "generation": -1}', "[]"):
        path.write_text(text)
        roles = Roles(str(path), start_role="master")
        assert roles.wanted == "backup" and roles.generation == 0
    assert "cannot read the pair state file" in caplog.text


def test_start_role_master_without_a_state_file_takes_over_on_connect(tmp_path):
    roles = Roles(str(tmp_path / "pair.json"), start_role="master")
    roles.connected()
    assert roles.reply(EQUAL, 9).request == RoleRequest(MASTER, 10)


def test_an_unwritable_state_file_is_logged_and_the_takeover_goes_on(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    roles = Roles(str(blocker / "pair.json"))  # its directory cannot exist: a file is in the way
    change = roles.take_over()
    assert change.request == RoleRequest(MASTER, 1)
    assert "cannot write the pair state file" in caplog.text
