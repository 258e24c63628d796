"""`nfshunt iptables apply/remove` against real iptables in a fresh network namespace."""
import json
import os
import sys

import pytest

from tests.helpers import BASE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICY = os.path.join(REPO, "iptables", "policy-example.rules")
ADMIN_FILTER = ["-A", "FORWARD", "-p", "tcp", "--dport", "22", "-j", "DROP"]
ADMIN_MANGLE = ["-A", "PREROUTING", "-p", "udp", "--dport", "53", "-j", "MARK", "--set-mark", "0x7"]


BACKEND_TOOLS = ("iptables", "iptables-restore", "iptables-save", "ip6tables", "ip6tables-restore", "ip6tables-save")


@pytest.fixture(params=["default", "legacy"])
def fw(request, netns, tmp_path):
    """A namespace with bridge br0 over fw-eth0/fw-eth1, and a config naming them; run
    once with Debian's selected iptables back end (nft) and once with the legacy one,
    chosen the way an admin's alternatives would: by what `iptables` on PATH is."""
    path = os.environ["PATH"]
    if request.param == "legacy":
        bindir = tmp_path / "legacy-bin"
        bindir.mkdir()
        for tool in BACKEND_TOOLS:
            real = "/usr/sbin/" + tool.replace("tables", "tables-legacy", 1)
            if not os.path.exists(real):
                pytest.skip(f"{real} not installed")
            (bindir / tool).symlink_to(real)
        path = f"{bindir}:{path}"
    inner = netns

    def netns(*args, check=True, input=None):  # noqa: F811
        return inner("env", f"PATH={path}", *args, check=check, input=input)
    for i in (0, 1):
        netns("ip", "link", "add", f"fw-eth{i}", "type", "veth", "peer", "name", f"peer{i}")
    netns("ip", "link", "add", "br0", "type", "bridge")
    for i in (0, 1):
        netns("ip", "link", "set", f"fw-eth{i}", "master", "br0")
    for v in ("call-iptables", "call-ip6tables", "filter-vlan-tagged"):
        netns("sysctl", "-qw", f"net.bridge.bridge-nf-{v}=1")
    cfg = tmp_path / "nfshunt.json"
    # A socket path of its own: the machine's default may belong to a controller running here.
    cfg.write_text(json.dumps({**BASE, "control_socket": str(tmp_path / "nfshunt.sock")}))
    netns.config = str(cfg)

    def nfshunt(*args, check=True):
        return netns("env", f"PYTHONPATH={REPO}", sys.executable, "-m", "nfshunt", *args, check=check)
    netns.nfshunt = nfshunt
    return netns


def save(fw, cmd="iptables-save"):
    """The ruleset: every rule and user chain, by table. Comments, counters and empty
    built-in tables (the legacy back end lists a table once anything looked at it) are
    left out: they are not rules."""
    out, table = [], ""
    for line in fw(cmd).stdout.splitlines():
        if line.startswith("*"):
            table = line
        elif line.startswith("-A") or (line.startswith(":") and line.split()[1] == "-"):
            out.append(f"{table} {line}")
        elif line.startswith(":") and line.split()[1] != "ACCEPT":
            out.append(f"{table} {line.split()[0]} {line.split()[1]}")  # a non-default policy
    return "\n".join(out)


def test_apply_is_idempotent_keeps_admin_rules_and_remove_is_clean(fw):
    fw("iptables", *ADMIN_FILTER)
    fw("iptables", "-t", "mangle", *ADMIN_MANGLE)
    before = save(fw)
    fw.nfshunt("iptables", "apply", "--config", fw.config, "--policy", POLICY)
    after_once = save(fw)
    for chain in ("NFSHUNT_PRE", "NFSHUNT_PRE_PD_IN", "NFSHUNT_POST", "NFSHUNT_POST_PD_OUT", "NFSHUNT_POLICY"):
        assert fw("iptables", "-t", "mangle", "-S", chain).returncode == 0
    rules = fw("iptables", "-t", "mangle", "-S").stdout
    assert "-A NFSHUNT_PRE_PD_IN -m physdev --physdev-in fw-eth1 -j MARK --set-xmark 0x42000000/0x4f000000" in rules
    assert "--ctorigdstport 5201 -g NFSHUNT_SHUNT" in rules
    assert "-A PREROUTING -p udp" in rules and "--dport 22 -j DROP" in save(fw)
    v6 = fw("ip6tables", "-t", "mangle", "-S").stdout
    assert "-A POSTROUTING -j NFSHUNT_POST" in v6 and "NFSHUNT_SHUNT" in v6

    fw.nfshunt("iptables", "apply", "--config", fw.config)  # again, no policy: keeps the admin's
    assert save(fw) == after_once
    assert rules.count("-j NFSHUNT_PRE\n") == 1

    fw.nfshunt("iptables", "remove", "--config", fw.config)
    assert "NFSHUNT" not in save(fw) and "NFSHUNT" not in save(fw, "ip6tables-save")
    assert save(fw) == before  # the admin's rules in filter and mangle are untouched


def test_policy_chain_keeps_hand_written_rules_without_policy_file(fw):
    fw.nfshunt("iptables", "apply", "--config", fw.config)
    fw("iptables", "-t", "mangle", "-A", "NFSHUNT_POLICY", "-p", "tcp", "--dport", "2811", "-g", "NFSHUNT_SHUNT")
    fw.nfshunt("iptables", "apply", "--config", fw.config)
    assert "--dport 2811" in fw("iptables", "-t", "mangle", "-S", "NFSHUNT_POLICY").stdout
    fw.nfshunt("iptables", "apply", "--config", fw.config, "--policy", POLICY)  # a policy file replaces
    assert "--dport 2811" not in fw("iptables", "-t", "mangle", "-S", "NFSHUNT_POLICY").stdout


@pytest.mark.parametrize("problem", ["missing-interface", "not-a-bridge-port", "sysctl-off", "vlan-sysctl-off",
                                     "bad-policy"])
def test_failed_checks_change_nothing(fw, tmp_path, problem):
    fw("iptables", *ADMIN_FILTER)
    cfg = json.loads(json.dumps(BASE))
    args = []
    if problem == "missing-interface":
        cfg["ports"][1]["bridge_port"] = "fw-eth9"
        expect = "fw-eth9 does not exist"
    elif problem == "not-a-bridge-port":
        fw("ip", "link", "set", "fw-eth1", "nomaster")
        expect = "fw-eth1 is not a bridge port"
    elif problem == "sysctl-off":
        fw("sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0")
        expect = "--fix-sysctl"
    elif problem == "vlan-sysctl-off":  # tagged IP would cross the bridge unjudged
        fw("sysctl", "-qw", "net.bridge.bridge-nf-filter-vlan-tagged=0")
        expect = "net.bridge.bridge-nf-filter-vlan-tagged is 0, so 802.1Q-tagged IP crosses the bridge"
    else:
        bad = tmp_path / "bad.rules"
        bad.write_text("-A NFSHUNT_POLICY -m nosuchmatch -j ACCEPT\n")
        args = ["--policy", str(bad)]
        expect = "rejected the ruleset"
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    before, before6 = save(fw), save(fw, "ip6tables-save")
    result = fw.nfshunt("iptables", "apply", "--config", str(path), *args, check=False)
    assert result.returncode == 1
    assert expect in result.stderr
    assert save(fw) == before and save(fw, "ip6tables-save") == before6


def test_fix_sysctl_turns_bridge_netfilter_on(fw):
    fw("sysctl", "-qw", "net.bridge.bridge-nf-call-ip6tables=0")
    fw("sysctl", "-qw", "net.bridge.bridge-nf-filter-vlan-tagged=0")
    fw.nfshunt("iptables", "apply", "--config", fw.config, "--fix-sysctl")
    assert fw("sysctl", "-n", "net.bridge.bridge-nf-call-ip6tables").stdout.strip() == "1"
    assert fw("sysctl", "-n", "net.bridge.bridge-nf-filter-vlan-tagged").stdout.strip() == "1"


def test_family_specific_policy_rules_load_into_their_family_only(fw):
    fw.nfshunt("iptables", "apply", "--config", fw.config, "--policy",
               os.path.join(REPO, "iptables", "policy-dtn.rules"))
    v4 = fw("iptables", "-t", "mangle", "-S", "NFSHUNT_POLICY").stdout
    v6 = fw("ip6tables", "-t", "mangle", "-S", "NFSHUNT_POLICY").stdout
    assert "10.0.0.0/24" in v4 and "fd00::" not in v4 and "10.0.0.66" in v4
    assert "fd00::/64" in v6 and "10.0.0" not in v6
    assert "50000:51000" in v4 and "50000:51000" in v6
