"""Which policy the pairs on the switch were decided under (core/policy_state.py): the
fingerprint of the NFSHUNT_POLICY chains as iptables-save prints them (the commands faked),
its record in the state directory, and the watch that says at start whether adopted pairs
must be handed back. The live chains on a real kernel: tests/test_policy_change.py."""
from __future__ import annotations

import logging
import subprocess
from typing import Any

import pytest

from nfshunt.core import policy_state as ps

V4 = """*mangle
:PREROUTING ACCEPT [0:0]
:NFSHUNT_POLICY - [0:0]
-A PREROUTING -j NFSHUNT_PRE
-A NFSHUNT_POLICY -p tcp --dport 5201 -j MARK --set-xmark 0x10010000/0x100f0000
COMMIT
"""
V6 = "*mangle\n-A NFSHUNT_POLICY -p tcp --dport 5201 -j MARK --set-xmark 0x10010000/0x100f0000\nCOMMIT\n"


class Saves:
    """iptables-save and ip6tables-save as the test sets their output (or failure)."""

    def __init__(self, monkeypatch: Any, v4: str = V4, v6: str = V6):
        self.out = {"iptables-save": v4, "ip6tables-save": v6}
        self.fail: dict[str, Any] = {}
        self.calls: list[tuple[str, ...]] = []
        monkeypatch.setattr(ps.subprocess, "run", self.run)

    def run(self, argv: tuple[str, ...], **kw: Any) -> Any:
        # Its output read as text, a failure not raised, a hung command not waited for.
        assert kw == {"capture_output": True, "text": True, "timeout": 10, "check": False}, kw
        self.calls.append(tuple(argv))
        failure = self.fail.get(argv[0])
        if isinstance(failure, BaseException):
            raise failure
        if failure is not None:
            return subprocess.CompletedProcess(argv, failure, "", "no such table")
        return subprocess.CompletedProcess(argv, 0, self.out[argv[0]], "")


def test_the_fingerprint_reads_both_families_mangle_tables_and_only_the_policy_chain(monkeypatch):
    saves = Saves(monkeypatch)
    first = ps.fingerprint()
    assert saves.calls == [("iptables-save", "-t", "mangle"), ("ip6tables-save", "-t", "mangle")]
    assert first is not None and len(first) == 64
    saves.out["iptables-save"] = V4.replace("[0:0]", "[7:420]").replace("-A PREROUTING -j NFSHUNT_PRE\n", "")
    assert ps.fingerprint() == first  # counters and other chains change nothing
    saves.out["iptables-save"] = V4.replace("5201", "5999")
    assert ps.fingerprint() != first
    saves.out["iptables-save"] = V4
    saves.out["ip6tables-save"] = V6.replace("5201", "5999")
    assert ps.fingerprint() != first  # IPv6's rules count too
    saves.out["ip6tables-save"] = V6 + "-A NFSHUNT_POLICYX -j ACCEPT\n"
    assert ps.fingerprint() == first  # a chain whose name only starts alike is not the policy


@pytest.mark.parametrize("failure", [1, FileNotFoundError("iptables-save"), subprocess.TimeoutExpired("x", 10)],
                         ids=["exit-status", "missing", "timeout"])
@pytest.mark.parametrize("family", ["iptables-save", "ip6tables-save"])
def test_a_policy_that_cannot_be_read_has_no_fingerprint(monkeypatch, caplog, failure, family):
    saves = Saves(monkeypatch)
    saves.fail[family] = failure
    assert ps.fingerprint() is None
    assert f"cannot read the policy ({family})" in caplog.text


def test_a_recorded_fingerprint_is_read_back_and_a_damaged_record_is_none(tmp_path):
    assert ps.recorded(str(tmp_path)) is None  # none recorded
    value = "ab" * 32
    ps.record(str(tmp_path / "new"), value)  # its folder made, the controller's own
    assert ps.recorded(str(tmp_path / "new")) == value and (tmp_path / "new").stat().st_mode & 0o777 == 0o700
    assert not [p.name for p in (tmp_path / "new").iterdir() if p.name != ps.FILE]  # no temporary file left
    for damaged in ("ab" * 31, "AB" * 32, "xy" * 32, "ab" * 32 + "c", "\xff" * 64):
        (tmp_path / "new" / ps.FILE).write_bytes(damaged.encode("latin-1"))
        assert ps.recorded(str(tmp_path / "new")) is None, damaged
    ps.record(str(tmp_path), None)  # nothing to record
    assert ps.recorded(str(tmp_path)) is None


def test_a_record_that_cannot_be_written_is_logged_and_the_old_one_stays(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="nfshunt")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    ps.record(str(blocker), "cd" * 32)
    assert "cannot record the policy's fingerprint" in caplog.text


def test_the_watch_finds_the_pairs_stale_with_no_record_or_another_policy_and_records_once_all_reconciled(
        monkeypatch, tmp_path):
    saves = Saves(monkeypatch)
    state = str(tmp_path)
    watch = ps.PolicyWatch(state, 2, pair=False)
    assert watch.stale and ps.recorded(state) is None  # nothing recorded: every adopted pair goes back
    watch.reconciled(0)
    assert watch.stale and ps.recorded(state) is None  # one switch of two
    watch.reconciled(0)
    watch.reconciled(1)
    assert not watch.stale and ps.recorded(state) == ps.fingerprint()
    assert not ps.PolicyWatch(state, 1, pair=False).stale  # the same policy at the next start
    saves.out["iptables-save"] = V4.replace("5201", "5999")  # changed while the controller was stopped
    again = ps.PolicyWatch(state, 1, pair=False)
    assert again.stale
    again.reevaluated()  # every pair judged again under the new policy
    assert ps.recorded(state) == ps.fingerprint()
    saves.fail["iptables-save"] = 1
    assert ps.PolicyWatch(state, 1, pair=False).stale  # unreadable: treated as changed


def test_one_of_a_pair_at_its_first_start_takes_the_pairs_policy_as_its_own(monkeypatch, tmp_path):
    Saves(monkeypatch)
    watch = ps.PolicyWatch(str(tmp_path), 1, pair=True)
    assert not watch.stale and ps.recorded(str(tmp_path)) == ps.fingerprint()
