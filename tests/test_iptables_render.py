"""Golden tests of the rendered iptables-restore text."""
import os

import pytest

from nfshunt import iptables
from nfshunt.config.settings import ConfigError
from tests.helpers import config

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def four_ports():
    return config(ports=[{"fast": 1 + 2 * i, "slow": 2 + 2 * i, "physdevin": i + 1, "bridge_port": f"fw-eth{i}"}
                         for i in range(4)])


@pytest.mark.parametrize("name,cfg", [("two-port", config), ("four-port", four_ports)])
def test_rendered_text_matches_golden(name, cfg):
    policy = iptables.read_policy(os.path.join(os.path.dirname(GOLDEN), "..", "iptables", "policy-example.rules"))
    text = iptables.render(cfg(), policy)
    path = os.path.join(GOLDEN, f"{name}.rules")
    if os.environ.get("NFSHUNT_UPDATE_GOLDEN") == "1":
        with open(path, "w") as fh:
            fh.write(text)
    with open(path) as fh:
        assert text == fh.read()


def test_reapply_keeps_admin_policy_and_adds_no_second_jump():
    existing = iptables.Existing(set(iptables.CHAINS), set(iptables.JUMPS))
    text = iptables.render(config(), None, existing)
    assert ":NFSHUNT_POLICY" not in text  # declaring would flush the admin's rules
    assert "-I PREROUTING" not in text and "-I POSTROUTING" not in text


def test_removal_text_touches_only_our_chains():
    text = iptables.render_removal(iptables.Existing(set(iptables.CHAINS), set(iptables.JUMPS)))
    for line in text.splitlines()[1:-1]:
        assert "NFSHUNT_" in line


def test_bridge_port_names_are_required(tmp_path):
    with pytest.raises(ConfigError, match=r"ports\[0\].bridge_port"):
        iptables.render(config(ports=[{"fast": 1, "slow": 2, "physdevin": 1}]), [])


def test_a_missing_bridge_port_is_named_where_it_is_in_a_file_of_several_switches():
    ports = [{"fast": 1, "slow": 2, "physdevin": 1, "bridge_port": "fw-eth0"},
             {"fast": 3, "slow": 4, "physdevin": 2, "bridge_port": "fw-eth1"}]
    from nfshunt.config.settings import from_dict
    from tests.helpers import BASE
    raw = {k: v for k, v in BASE.items() if k not in ("ports", "datapath_id")}
    cfg = from_dict({**raw, "switches": [
        {"datapath_id": "a1", "ports": ports},
        {"datapath_id": "a2", "ports": [{"fast": 1, "slow": 2, "physdevin": 3, "bridge_port": "fw-eth2"},
                                        {"fast": 3, "slow": 4, "physdevin": 4}]}]})
    with pytest.raises(ConfigError) as info:
        iptables.render(cfg, [])
    assert info.value.key == "switches[1].ports[1].bridge_port"  # not the 4th of every group: ports[3]


def test_policy_file_lines_are_checked(tmp_path):
    bad = tmp_path / "p.rules"
    bad.write_text("-A FORWARD -j ACCEPT\n")
    with pytest.raises(iptables.IptablesError, match="p.rules:1"):
        iptables.read_policy(str(bad))


def test_mark_command(capsys):
    from nfshunt.cli import main
    assert main(["iptables", "mark", "shunt"]) == 0
    assert capsys.readouterr().out.strip() == "-j MARK --set-xmark 0x10010000/0x100f0000"
    assert main(["iptables", "mark", "block"]) == 0
    assert capsys.readouterr().out.strip() == "-j MARK --set-xmark 0x10020000/0x100f0000"
    assert main(["iptables", "mark", "forward"]) == 1
