"""The shipped service files and example configs are consistent with the program."""
import configparser
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_example_config_passes_check_config():
    configs = [f for f in os.listdir(os.path.join(REPO, "config")) if f.endswith(".json")]
    assert len(configs) >= 2
    for name in configs:
        proc = subprocess.run([sys.executable, "-m", "nfshunt", "check-config", os.path.join(REPO, "config", name)],
                              capture_output=True, text=True, cwd=REPO)
        assert proc.returncode == 0, proc.stderr


def test_systemd_unit_restarts_on_failure_after_network_and_ovs_and_checks_first():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(os.path.join(REPO, "config", "systemd", "nfshunt.service"))
    svc = unit["Service"]
    assert svc["Restart"] == "on-failure"
    assert "network-online.target" in unit["Unit"]["After"] and "openvswitch-switch.service" in unit["Unit"]["After"]
    assert svc["ExecStart"].endswith("nfshunt run --config /etc/nfshunt/nfshunt.json")
    assert "check-config" in open(os.path.join(REPO, "config", "systemd", "nfshunt.service")).read()
    assert svc["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert svc["RuntimeDirectory"] == "nfshunt" and svc["RuntimeDirectoryMode"] == "0700"
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_logrotate_snippet_rotates_the_audit_log_and_signals_the_service():
    text = open(os.path.join(REPO, "config", "logrotate", "nfshunt")).read()
    assert "/var/log/nfshunt/audit.log {" in text and "postrotate" in text and "HUP" in text


def test_systemd_unit_exposure_is_4_or_lower():
    """systemd's own scoring of the sandbox (ProtectSystem=strict, address families,
    system call filter, capability bounding set, UMask, TasksMax ...)."""
    import re
    import shutil

    import pytest
    if shutil.which("systemd-analyze") is None:
        pytest.skip("needs systemd-analyze (Debian package systemd)")
    unit = os.path.join(REPO, "config", "systemd", "nfshunt.service")
    proc = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", unit],
                          capture_output=True, text=True)
    m = re.search(r"Overall exposure level for nfshunt\.service: ([0-9.]+)", proc.stdout)
    assert m, proc.stdout[-2000:] + proc.stderr
    assert float(m.group(1)) <= 4.0
