"""A pair's controller roles (nfshunt/roles.py): pure logic, with the state file."""
from __future__ import annotations

import json
import os
import sys

from nfshunt.core.roles import EQUAL, MASTER, NOCHANGE, SLAVE, UNDEFINED_GENERATION, Change, RoleRequest, Roles, newer


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
    assert change.request == RoleRequest(NOCHANGE, 0)  # first the switch's generation, now
    assert json.loads(path.read_text()) == {"role": "master", "generation": 0, "takeover": True}
    assert roles.reply(SLAVE, 7).request == RoleRequest(MASTER, 8)
    assert json.loads(path.read_text()) == {"role": "master", "generation": 8, "takeover": False}
    assert roles.reply(MASTER, 8).promoted
    assert not roles.reply(MASTER, 8).promoted  # a periodic check: still master, nothing to do
    assert roles.check() == RoleRequest(NOCHANGE, 0)


def test_a_restarted_master_claims_its_old_generation_and_a_stale_refusal_makes_it_yield(tmp_path):
    path = tmp_path / "pair.json"
    path.write_text(json.dumps({"role": "master", "generation": 4}))
    roles = Roles(str(path))
    roles.connected()
    assert roles.reply(EQUAL, 6).request == RoleRequest(MASTER, 4)  # not a new takeover
    change = roles.stale()
    assert "stale" in (roles.why or "") and change.request == RoleRequest(NOCHANGE, 0)
    assert roles.reply(EQUAL, 6).request == RoleRequest(SLAVE, 6)  # the newer claim (even) holds it
    assert roles.granted is None and roles.status()["yielded_to"] == 6 and roles.check() == RoleRequest(NOCHANGE, 0)
    assert json.loads(path.read_text())["role"] == "master"  # keepalived's word is kept


def test_a_master_made_slave_by_another_claim_is_demoted_once(tmp_path):
    roles = Roles(str(tmp_path / "pair.json"))
    roles.connected()
    roles.reply(EQUAL, UNDEFINED_GENERATION)
    roles.take_over()
    assert roles.reply(EQUAL, UNDEFINED_GENERATION).request == RoleRequest(MASTER, 2)
    assert roles.reply(MASTER, 2).promoted
    change = roles.reply(SLAVE, 4)  # the periodic query: the other controller took over
    assert change.demoted and "generation 4" in change.demoted and change.request is None
    assert roles.granted == "backup" and roles.status()["yielded_to"] == 4
    assert roles.refused_as_slave().demoted is None  # already handled
    assert roles.reply(SLAVE, 4) == Change()  # its next query: still held by that claim


def test_is_slave_error_demotes_a_master(tmp_path):
    roles = Roles(str(tmp_path / "pair.json"))
    roles.connected()
    roles.reply(EQUAL, 3)
    roles.take_over()
    roles.reply(EQUAL, 3)
    roles.reply(MASTER, 4)
    change = roles.refused_as_slave()
    assert change.demoted and change.request == RoleRequest(NOCHANGE, 0)  # who holds it now?
    assert roles.reply(SLAVE, 6).request is None and roles.granted == "backup"
    assert roles.status()["yielded_to"] == 6 and "generation 6" in (roles.why or "")


def test_stepping_down_stops_programming_before_the_switch_answers(tmp_path):
    roles = Roles(str(tmp_path / "pair.json"))
    roles.connected()
    roles.reply(EQUAL, 3)
    roles.take_over()
    roles.reply(EQUAL, 3)
    roles.reply(MASTER, 4)
    change = roles.stand_by()
    # released: the next odd generation says nobody holds the switch
    assert change.demoted == "asked to be backup" and change.request == RoleRequest(SLAVE, 5)
    assert roles.reply(SLAVE, 5).demoted is None  # the switch's answer does not demote twice


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


def test_an_unwritable_state_file_is_logged_and_no_claim_is_made_until_it_can_be_written(tmp_path, caplog):
    """docs/pair.md: the generation is written first. A claim made with one kept in memory
    only (review s57/2 V6) was the switch's newest after a restart that read the older one
    back: refused as stale, the controller yielded to its own lost claim for ever."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    roles = Roles(str(blocker / "pair.json"))  # its directory cannot exist: a file is in the way
    roles.take_over()
    change = roles.reply(EQUAL, UNDEFINED_GENERATION)
    assert change.request is None and change.withheld and "fix its path or permissions" in change.withheld
    assert roles.generation == 0 and roles.granted is None and roles.save_error
    assert "cannot write the pair state file" in caplog.text and "not claiming the switch" in caplog.text
    assert "cannot be written" in roles.status()["state_file_error"]
    assert roles.check() == RoleRequest(NOCHANGE, 0)  # tried again at each role check
    caplog.clear()
    assert roles.reply(EQUAL, UNDEFINED_GENERATION).withheld and caplog.text == ""  # said once
    blocker.unlink()
    assert roles.reply(EQUAL, UNDEFINED_GENERATION).request == RoleRequest(MASTER, 2)
    assert json.loads((blocker / "pair.json").read_text())["generation"] == 2
    assert roles.reply(MASTER, 2).promoted and roles.status()["state_file_error"] is None


def test_a_restart_never_yields_to_a_claim_of_its_own_the_state_file_lost(tmp_path, monkeypatch):
    """The claim that could not be saved is not made, so the switch never holds a generation
    of this controller's newer than its file's: the restart's claim is its switch's own."""
    path = tmp_path / "pair.json"
    path.write_text(json.dumps({"role": "master", "generation": 2, "takeover": False}))
    a = Roles(str(path), "master")
    a.connected()
    assert a.reply(EQUAL, 3).request == RoleRequest(MASTER, 2)  # released at 3 by the other meanwhile
    a.stale()
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda *_: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    change = a.reply(EQUAL, 3)  # odd: nobody holds it, claim it: not with a generation the file lacks
    assert change.request is None and "No space left on device" in (change.withheld or "")
    monkeypatch.setattr(os, "replace", real_replace)
    b = Roles(str(path), "master")  # the controller restarts before the disk is fixed
    b.connected()
    assert b.reply(EQUAL, 3).request == RoleRequest(MASTER, 2)  # stale (3 is newer): asked again
    b.stale()
    assert b.reply(EQUAL, 3).request == RoleRequest(MASTER, 4)  # odd: claimed, saved first
    assert json.loads(path.read_text())["generation"] == 4


def _held(roles, generation):
    """A master granted `generation` whose switch connection then broke."""
    roles.connected()
    assert roles.reply(EQUAL, generation).request == RoleRequest(MASTER, generation)
    assert roles.reply(MASTER, generation).promoted
    roles.disconnected()


def test_a_master_that_loses_the_switch_while_its_connection_is_down_is_demoted_once(tmp_path):
    """Review s57/2 V1: disconnected() cleared `granted`, and only a granted master was ever
    demoted: the core kept pairs the other controller owned, and installed them again when
    it took the switch back."""
    path = tmp_path / "pair.json"
    path.write_text(json.dumps({"role": "master", "generation": 2}))
    told = Roles(str(path))  # keepalived says BACKUP while it is away
    _held(told, 2)
    assert told.stand_by().demoted == "asked to be backup"
    told.connected()
    assert told.reply(EQUAL, 4).demoted is None  # once
    path.write_text(json.dumps({"role": "master", "generation": 2}))
    refused = Roles(str(path))  # still master: its claim is refused at the reconnect
    _held(refused, 2)
    refused.connected()
    change = refused.reply(EQUAL, 4)  # another controller's claim: demoted now, claimed again (stale)
    assert change.demoted and "generation 4" in change.demoted and change.request == RoleRequest(MASTER, 2)
    assert refused.stale().demoted is None and refused.reply(SLAVE, 4).demoted is None
    again = Roles(str(path))  # a takeover asked again while away: demoted before its newer claim
    _held(again, 2)
    again.take_over()
    again.connected()
    change = again.reply(EQUAL, 4)
    assert change.demoted and change.request == RoleRequest(MASTER, 6)
    assert again.reply(MASTER, 6).promoted


def test_a_master_whose_switch_is_its_own_at_the_reconnect_is_not_demoted(tmp_path):
    path = tmp_path / "pair.json"
    path.write_text(json.dumps({"role": "master", "generation": 2}))
    for generation in (2, UNDEFINED_GENERATION):  # still its claim; a switch that restarted
        roles = Roles(str(path))
        _held(roles, 2)
        roles.connected()
        change = roles.reply(EQUAL, generation)
        assert change.demoted is None and change.request == RoleRequest(MASTER, 2)
        assert roles.reply(MASTER, 2).promoted  # (switch_connected: the core's reconcile adopts its pairs)


def test_a_master_told_backup_while_away_or_stopped_releases_its_claim_when_it_connects(tmp_path):
    """Review s57/2 V2: it asked for SLAVE at its claim's even generation, so the other
    controller, keepalived's master, yielded to that claim for ever. Released only while the
    switch's generation is its own claim's."""
    path = tmp_path / "pair.json"
    path.write_text(json.dumps({"role": "master", "generation": 2}))
    away = Roles(str(path))
    _held(away, 2)
    away.stand_by()
    away.connected()
    assert away.reply(EQUAL, 2).request == RoleRequest(SLAVE, 3)
    assert away.reply(SLAVE, 3) == Change() and away.granted == "backup"
    Roles(str(path)).stand_by()  # `nfshunt role backup` while the controller is stopped ...
    path.write_text(json.dumps({"role": "backup", "generation": 2}))
    started = Roles(str(path), "master")  # ... which then starts from the file
    started.connected()
    assert started.reply(EQUAL, 2).request == RoleRequest(SLAVE, 3)
    # Not its claim: another's, released already, a restarted switch's (none): a plain SLAVE.
    for generation, asked in ((4, 4), (3, 3), (UNDEFINED_GENERATION, 2)):
        other = Roles(str(path))
        other.connected()
        assert other.reply(EQUAL, generation).request == RoleRequest(SLAVE, asked)




def test_a_takeover_claims_above_a_generation_the_backup_never_heard_of(tmp_path):
    """Issue 30.2: the backup asked for SLAVE before the first master's claim (generation 1),
    so it never learned it; its takeover asks the switch first and claims 2, not 1 (which
    the switch would accept as well, and so would the returning old master's claim)."""
    backup = Roles(str(tmp_path / "b.json"))
    backup.connected()
    assert backup.reply(EQUAL, UNDEFINED_GENERATION).request == RoleRequest(SLAVE, 0)
    backup.reply(SLAVE, 0)
    # ... the other controller claims generation 1 now; the switch tells the backup nothing.
    assert backup.take_over().request == RoleRequest(NOCHANGE, 0)
    assert backup.reply(SLAVE, 1).request == RoleRequest(MASTER, 2)
    assert backup.reply(MASTER, 2).promoted


def test_replies_to_what_was_sent_before_the_claim_do_not_demote_the_claimant(tmp_path):
    roles = Roles(str(tmp_path / "pair.json"))
    roles.connected()
    roles.reply(EQUAL, 5)
    roles.stand_by()  # a SLAVE request in flight
    roles.take_over()  # and a query after it
    assert roles.reply(SLAVE, 5).request == RoleRequest(MASTER, 6)  # the SLAVE request's answer
    change = roles.reply(SLAVE, 5)  # the query's answer, sent before the claim
    assert change == Change() and roles.wanted == "master"
    assert roles.reply(MASTER, 6).promoted


def test_a_takeover_recorded_while_the_controller_was_down_is_made_at_connect(tmp_path):
    """Issue 30.1: keepalived ran `nfshunt role master` before the controller was up; the
    command recorded it (nfshunt/cli.py) and the controller claims once the switch connects."""
    path = tmp_path / "pair.json"
    Roles(str(path)).take_over()  # what the command does without a controller
    assert json.loads(path.read_text())["takeover"] is True
    roles = Roles(str(path))  # the controller starts
    assert roles.status()["takeover"] == "querying"
    assert roles.connected() == RoleRequest(NOCHANGE, 0)
    assert roles.reply(EQUAL, 41).request == RoleRequest(MASTER, 42)
    assert roles.reply(MASTER, 42).promoted
    assert json.loads(path.read_text()) == {"role": "master", "generation": 42, "takeover": False}


def test_a_takeover_under_way_is_claimed_again_after_a_reconnect(tmp_path):
    roles = Roles(str(tmp_path / "pair.json"))
    roles.connected()
    roles.reply(EQUAL, 3)
    roles.take_over()
    assert roles.reply(EQUAL, 3).request == RoleRequest(MASTER, 4)
    roles.disconnected()  # the claim's answer lost with the connection
    roles.connected()
    assert roles.reply(EQUAL, 4).request == RoleRequest(MASTER, 4)  # the saved generation


def test_a_returning_master_is_refused_and_stays_backup(tmp_path):
    path = tmp_path / "pair.json"
    path.write_text(json.dumps({"role": "master", "generation": 2}))  # before it died
    roles = Roles(str(path))
    roles.connected()
    assert roles.reply(EQUAL, 4).request == RoleRequest(MASTER, 2)  # the survivor claimed 4
    assert roles.stale().request == RoleRequest(NOCHANGE, 0)
    assert roles.reply(EQUAL, 4).request == RoleRequest(SLAVE, 4)  # its claim holds the switch
    assert roles.granted is None and roles.status()["yielded_to"] == 4
    assert roles.stand_by().request == RoleRequest(SLAVE, 4)  # keepalived: backup; it held nothing to release
    assert roles.wanted == "backup" and roles.check() is None


def _pair_config(tmp_path, pair=True, **keys):
    cfg = {"ports": [{"fast": 1, "slow": 2, "physdevin": 1}, {"fast": 3, "slow": 4, "physdevin": 2}],
           "mark_actions": {"0": "ignore", "1": "shunt", "2": "block"}, "openflow_versions": ["1.3"],
           "delete_flows_on_shutdown": False,
           "control_socket": str(tmp_path / "run" / "nfshunt.sock")}
    if pair:
        cfg["pair"] = {"state_file": str(tmp_path / "lib" / "pair.json"), **keys}
    path = tmp_path / "nfshunt.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_role_master_without_a_running_controller_is_recorded_for_its_start(tmp_path, capsys):
    from nfshunt.cli import main
    assert main(["role", "master", "--config", _pair_config(tmp_path)]) == 0
    assert "recorded in" in capsys.readouterr().out
    state = json.loads((tmp_path / "lib" / "pair.json").read_text())
    assert state["role"] == "master" and state["takeover"] is True
    assert main(["role", "backup", "--config", _pair_config(tmp_path)]) == 0
    assert json.loads((tmp_path / "lib" / "pair.json").read_text())["role"] == "backup"


def test_role_without_a_controller_or_a_pair_to_record_it_in_fails_loudly(tmp_path, capsys):
    from nfshunt.cli import main
    assert main(["role", "master", "--config", _pair_config(tmp_path, pair=False)]) == 1
    assert "cannot be recorded" in capsys.readouterr().err
    (tmp_path / "lib").write_text("")  # the state file's directory cannot be made
    assert main(["role", "master", "--config", _pair_config(tmp_path)]) == 1
    assert "cannot be written" in capsys.readouterr().err


def test_role_answered_by_a_controller_that_cannot_write_its_state_file_fails_saying_what_to_fix(
        tmp_path, capsys, monkeypatch):
    """The controller's answer carries it (a takeover waits for the write: no claim is made
    with a generation the file lacks); the command fails, so keepalived's notify logs it."""
    from nfshunt.app import control
    from nfshunt.cli import main
    roles = Roles(str(tmp_path / "file" / "pair.json"))
    (tmp_path / "file").write_text("")
    roles.take_over()
    answered = {"ok": True, **roles.status(), "switch_connected": True}
    monkeypatch.setattr(control, "request", lambda _socket, _payload: answered)
    assert main(["role", "master", "--config", _pair_config(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "cannot be written" in err and "fix its path or permissions" in err and "does not claim" in err
    answered["state_file_error"] = None
    assert main(["role", "master", "--config", _pair_config(tmp_path)]) == 0


def test_the_notify_script_finds_nfshunt_with_keepalived_minimal_path_or_fails_loudly(tmp_path):
    """keepalived runs notify scripts with a minimal PATH (issue 26.3): the script finds the
    installed command itself, and without one it exits non-zero, saying so."""
    import os
    import subprocess
    script = os.path.join(os.path.dirname(__file__), "..", "config", "ha", "nfshunt-notify")
    bare = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    fake = tmp_path / "nfshunt"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/called\n")
    fake.chmod(0o755)
    args = [script, "/nonexistent/conntrackd.conf", "/etc/nfshunt/nfshunt.json", "INSTANCE", "NFSHUNT", "BACKUP", "100"]
    done = subprocess.run(args, env={**bare, "NFSHUNT": str(fake)}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "called").read_text().split() == ["role", "backup", "--config", "/etc/nfshunt/nfshunt.json"]
    failing = tmp_path / "failing"
    failing.write_text("#!/bin/sh\nexit 1\n")
    failing.chmod(0o755)
    done = subprocess.run(args[:5] + ["MASTER", "150"], env={**bare, "NFSHUNT": str(failing)},
                          capture_output=True, text=True)
    assert done.returncode == 1 and "ERROR: nfshunt role master failed" in done.stderr
    if not any(os.access(p, os.X_OK) for p in ("/usr/local/bin/nfshunt", "/opt/nfshunt-venv/bin/nfshunt")):
        done = subprocess.run(args, env=bare, capture_output=True, text=True)
        assert done.returncode == 1 and "not installed" in done.stderr


def test_the_fifo_reader_runs_keepalived_state_changes_one_after_the_other_in_order(tmp_path):
    """keepalived runs a `notify` script per change without waiting, so a MASTER that first
    commits conntrackd's cache could finish after the BACKUP right behind it, and the host
    that yielded would claim the switch. Through the FIFO each change runs after the one
    before. keepalived's TERM to the reader's process group (at its stop, then the last
    STOP line; at a reload) neither ends the reader nor cuts a change half-way."""
    import signal
    import subprocess
    import time
    reader = os.path.join(os.path.dirname(__file__), "..", "config", "ha", "nfshunt-notify-fifo")
    conf = _pair_config(tmp_path)
    calls = tmp_path / "calls"
    notify = tmp_path / "nfshunt-notify"
    # MASTER is the slow one (conntrackd's commit). Each call notes its session and whether
    # TERM is ignored in it.
    notify.write_text(f"#!/bin/sh\necho \"start $3 $4 $5 $6 $1 $2\" >> {calls}\n[ \"$5\" = MASTER ] && sleep 0.5\n"
                      f"ign=$(awk '/^SigIgn/ {{print $2}}' /proc/$$/status)\n"
                      f"echo \"end $5 $ign $(cut -d' ' -f6 /proc/$$/stat)\" >> {calls}\n")
    notify.chmod(0o755)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    proc = subprocess.Popen([reader, str(notify), "/etc/conntrackd/conntrackd.conf", conf, str(fifo)],
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=_nfshunt_env(tmp_path))
    fd = os.open(fifo, os.O_RDWR)  # as keepalived holds it

    def seen(text: str) -> bool:
        deadline = time.monotonic() + 5
        while text not in (calls.read_text() if calls.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.02)
        return text in calls.read_text()
    try:
        os.write(fd, b'INSTANCE "NFSHUNT" MASTER 150\nGROUP "G" MASTER 0\nINSTANCE "NFSHUNT" BACKUP 150\n')
        assert seen("start INSTANCE NFSHUNT MASTER")
        os.killpg(proc.pid, signal.SIGTERM)  # keepalived stopping, the takeover under way
        os.write(fd, b'INSTANCE "NFSHUNT" STOP 150\n')
        assert seen("end STOP")
    finally:
        os.close(fd)  # the reader ends at the FIFO's end (keepalived's kill would end it too)
    assert proc.wait(timeout=5) == 0
    lines = calls.read_text().splitlines()
    assert [line.split()[:2] for line in lines] == [["start", "INSTANCE"], ["end", "MASTER"], ["start", "INSTANCE"],
                                                    ["end", "BACKUP"], ["start", "INSTANCE"], ["end", "STOP"]]
    assert lines[0] == f"start INSTANCE NFSHUNT MASTER 150 /etc/conntrackd/conntrackd.conf {conf}"
    ends = [line.split() for line in lines if line.startswith("end")]
    term = 1 << (signal.SIGTERM - 1)
    assert all(not int(ignored, 16) & term for _, _, ignored, _ in ends), lines  # TERM's default back
    assert all(int(sid) != proc.pid for _, _, _, sid in ends), lines  # out of the reader's session
    assert "closed" in proc.stderr.read()


def _nfshunt_env(tmp_path):
    """keepalived's bare environment, with NFSHUNT naming this checkout's command (as the
    reader and nfshunt-notify find an installed one)."""
    command = tmp_path / "nfshunt"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command.write_text(f"#!/bin/sh\nPYTHONPATH={root} exec {sys.executable} -m nfshunt \"$@\"\n")
    command.chmod(0o755)
    return {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "NFSHUNT": str(command)}


def _read_fifo(tmp_path, conf, lines):
    """nfshunt-notify-fifo given `lines` (as keepalived writes them) and then the FIFO's end:
    (the nfshunt-notify calls it made, its stderr)."""
    import subprocess
    reader = os.path.join(os.path.dirname(__file__), "..", "config", "ha", "nfshunt-notify-fifo")
    calls = tmp_path / "calls"
    notify = tmp_path / "nfshunt-notify"
    notify.write_text(f"#!/bin/sh\necho \"$4 $5\" >> {calls}\n")
    notify.chmod(0o755)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    proc = subprocess.Popen([reader, str(notify), "/etc/conntrackd/conntrackd.conf", conf, str(fifo)],
                            stderr=subprocess.PIPE, text=True, env=_nfshunt_env(tmp_path))
    fd = os.open(fifo, os.O_WRONLY)
    os.write(fd, "".join(line + "\n" for line in lines).encode())
    os.close(fd)
    assert proc.wait(timeout=20) == 0
    return (calls.read_text().splitlines() if calls.exists() else []), proc.stderr.read()


KEEPALIVED_LINES = ['INSTANCE "NFSHUNT" BACKUP 150', 'INSTANCE "GATEWAY" BACKUP 100', 'INSTANCE "NFSHUNT" MASTER 150',
                    'INSTANCE "GATEWAY" MASTER 100', 'INSTANCE "GATEWAY" BACKUP 100', 'INSTANCE "NFSHUNT" BACKUP 150']


def test_the_fifo_reader_acts_only_on_nfshunts_vrrp_instances_and_logs_the_others_once(tmp_path):
    """A second VRRP instance on the same keepalived (a gateway address) going BACKUP
    stepped NFShunt down, its MASTER claimed the switch: only the instances the config's
    pair.vrrp_instances names (default: the shipped keepalived.conf's NFSHUNT) are acted on."""
    calls, said = _read_fifo(tmp_path, _pair_config(tmp_path), KEEPALIVED_LINES)
    assert calls == ["NFSHUNT BACKUP", "NFSHUNT MASTER", "NFSHUNT BACKUP"]
    assert said.count("VRRP instance GATEWAY is not NFShunt's (pair.vrrp_instances: NFSHUNT)") == 1, said
    assert "ERROR" not in said


def test_the_fifo_reader_follows_the_instances_the_config_names(tmp_path):
    conf = _pair_config(tmp_path, vrrp_instances=["GATEWAY", "NFSHUNT"])
    calls, said = _read_fifo(tmp_path, conf, KEEPALIVED_LINES)
    assert calls == [" ".join(line.replace('"', "").split()[1:3]) for line in KEEPALIVED_LINES]
    assert "is not NFShunt's" not in said


def test_a_typo_in_the_instances_shows_at_once_and_a_bad_config_acts_on_nothing(tmp_path):
    calls, said = _read_fifo(tmp_path, _pair_config(tmp_path, vrrp_instances=["NFSHUTN"]), KEEPALIVED_LINES[:1])
    assert calls == [] and "VRRP instance NFSHUNT is not NFShunt's (pair.vrrp_instances: NFSHUTN)" in said
    os.unlink(tmp_path / "fifo")
    bad = _pair_config(tmp_path, vrrp_instances=["NFSHUNT", "two words"])
    calls, said = _read_fifo(tmp_path, bad, KEEPALIVED_LINES[:1])
    assert calls == [] and "pair.vrrp_instances[1]" in said and "ERROR: NFSHUNT BACKUP not acted on" in said


def test_the_default_instance_is_the_shipped_keepalived_confs():
    import re

    from nfshunt.config.pair import PairConfig
    shipped = os.path.join(os.path.dirname(__file__), "..", "config", "ha", "keepalived.conf")
    with open(shipped) as fh:
        assert re.findall(r"^vrrp_instance (\S+) \{", fh.read(), re.M) == list(PairConfig("x").vrrp_instances)


def test_two_writers_of_the_state_file_at_once_both_succeed(tmp_path):
    """keepalived's notify script (`nfshunt role` recording a role) and a starting controller
    may write the state file at the same moment: each writes a temporary file of its own, so
    neither rename finds the other's gone (one shared name lost a role with ENOENT)."""
    import threading
    path = str(tmp_path / "pair.json")
    writers = [Roles(path), Roles(path)]
    errors: list[str] = []

    def write(roles: Roles) -> None:
        for _ in range(200):
            roles.stand_by()
            if roles.save_error is not None:
                errors.append(roles.save_error)
    threads = [threading.Thread(target=write, args=(r,)) for r in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert json.loads(open(path).read())["role"] == "backup"
    assert sorted(os.listdir(tmp_path)) == ["pair.json"]  # no temporary file left behind


def _granted(roles, generation):
    roles.connected()
    roles.reply(EQUAL, generation)
    roles.take_over()
    claim = roles.reply(SLAVE, generation).request
    assert claim.role == MASTER and roles.reply(MASTER, claim.generation).promoted
    return claim.generation


def test_both_hosts_master_for_a_moment_the_one_keepalived_keeps_takes_the_switch_back(tmp_path):
    """keepalived made both hosts MASTER for a moment at boot (or a split brain healed): a
    claimed 2, b claimed 4 (a silently made slave), then keepalived told b BACKUP. b releases
    the switch (5, odd); a's next role check finds it let go and claims it again. Before,
    a stepped down for good at that check, and nobody held the switch."""
    a, b = Roles(str(tmp_path / "a.json")), Roles(str(tmp_path / "b.json"))
    first = _granted(a, 0)
    second = _granted(b, first)
    release = b.stand_by().request
    assert release.role == SLAVE
    b.reply(SLAVE, release.generation)
    assert a.check() == RoleRequest(NOCHANGE, 0)
    change = a.reply(SLAVE, release.generation)  # what the switch says now
    assert change.request is not None and change.request.role == MASTER, (first, second, release, change)
    assert change.demoted and a.wanted == "master"
    assert a.reply(MASTER, change.request.generation).promoted and a.granted == "master"


def test_in_a_split_brain_the_later_claim_keeps_the_switch_until_its_host_lets_go(tmp_path):
    a, b = Roles(str(tmp_path / "a.json")), Roles(str(tmp_path / "b.json"))
    assert _granted(a, 0) == 2  # claims take even generations
    assert _granted(b, 2) == 4  # the VRRP link cut: b is master too, and claims later
    assert a.reply(SLAVE, 4).demoted  # a's check: b's claim (even) holds it: a yields, no fight
    for _ in range(3):
        assert a.check() == RoleRequest(NOCHANGE, 0) and a.reply(SLAVE, 4) == Change()
    assert a.take_over() == Change(request=RoleRequest(NOCHANGE, 0))  # keepalived says it again: no new claim
    assert a.reply(SLAVE, 4) == Change()
    b.stand_by()  # the link is back and b yields (keepalived: BACKUP): released at 5
    assert a.reply(SLAVE, 5).request == RoleRequest(MASTER, 6)
