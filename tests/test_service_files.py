"""The shipped service files and example configs are consistent with the program."""
import configparser
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_example_config_passes_check_config(tmp_path):
    import json
    configs = [f for f in os.listdir(os.path.join(REPO, "config")) if f.endswith(".json")]
    assert len(configs) >= 2
    for name in configs:
        raw = json.load(open(os.path.join(REPO, "config", name)))
        for key, path in (raw.get("tls") or {}).items():  # the PKI files of a real deployment
            stand_in = tmp_path / os.path.basename(path)
            stand_in.write_text("stand-in for a check-config run\n")
            raw["tls"][key] = str(stand_in)
        path = tmp_path / name
        path.write_text(json.dumps(raw))
        proc = subprocess.run([sys.executable, "-m", "nfshunt", "check-config", str(path)],
                              capture_output=True, text=True, cwd=REPO)
        assert proc.returncode == 0, proc.stderr


def test_the_pica8_example_is_deployed_with_tls_a_pinned_switch_and_an_allow_list():
    import json

    from nfshunt.config.settings import from_dict
    raw = json.load(open(os.path.join(REPO, "config", "nfshunt-pica8.json")))
    assert set(raw["tls"]) == {"private_key", "certificate", "ca_certificate"}
    raw.pop("tls")
    cfg = from_dict(raw)
    (sw,) = cfg.switches
    assert sw.datapath_id == 0xA1 and sw.switch_addresses == ("192.0.2.1",)
    assert sw.confirm == "counters"  # hardware answers the barrier before it forwards


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


def test_the_unit_lets_the_ids_api_process_give_up_its_privileges_and_the_installer_makes_its_user():
    """The IDS API's process (ids/confine.py) takes ids.user and empties its capability
    sets (CAP_SETUID, CAP_SETGID, CAP_SETPCAP) and loads a seccomp filter (the seccomp
    call); its threads count in TasksMax. The installer makes the default user."""
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(os.path.join(REPO, "config", "systemd", "nfshunt.service"))
    svc = unit["Service"]
    assert {"CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP"} <= set(svc["CapabilityBoundingSet"].split())
    assert "seccomp" in svc["SystemCallFilter"].split()
    assert int(svc["TasksMax"]) >= 64 * 2 + 32  # the API's threads (ids.max_connections) and the calls' waiting
    from nfshunt.config.ids import IdsConfig
    script = open(os.path.join(REPO, "scripts", "install-deps.sh")).read()
    assert "useradd --system" in script and IdsConfig().user in script
